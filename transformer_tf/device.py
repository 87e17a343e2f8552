"""Device choice, full-precision float32 and the determinism switch for the TensorFlow port.

* devices are named "cpu" and "gpu:N" (as in every port's ``devices()``);
  :func:`resolve_device` gives TensorFlow's name for one, to use as ``with tf.device(...)``;
  :func:`model_device` (a TensorFlow extra) tells where a model's weights live, so that its
  computations can run there;
* TensorFloat-32 rounds float32 matmul inputs to 10 mantissa bits on Ampere and newer GPUs;
  :func:`full_precision` switches it off for agreement checks
  (``tf.config.experimental.enable_tensor_float_32_execution(False)``);
* :func:`deterministic` calls ``tf.config.experimental.enable_op_determinism()``: every op
  gives the same bits on every run on the same hardware (it is slower; ops without a
  deterministic kernel raise).
"""

from __future__ import annotations

import re

import keras
import tensorflow as tf


def devices() -> list[str]:
    """Devices TensorFlow can use here: "cpu" and one "gpu:N" per visible GPU."""
    return ["cpu"] + [f"gpu:{i}" for i in range(len(tf.config.list_physical_devices("GPU")))]


def resolve_device(name: str) -> str:
    """TensorFlow's name of a device: "cpu" -> "/CPU:0", "gpu:N" -> "/GPU:N"."""
    if name == "cpu":
        return "/CPU:0"
    match = re.fullmatch(r"gpu:(\d+)", name)
    if match is None or name not in devices():
        raise ValueError(f"device must be one of {devices()}, got {name!r}")
    return f"/GPU:{match.group(1)}"


def model_device(model: keras.Model) -> str:
    """The device holding a model's weights (TensorFlow's full device name)."""
    return model.weights[0].value.device


def full_precision() -> None:
    """Switch TensorFloat-32 off: float32 matmuls and convolutions keep their 24-bit mantissa."""
    tf.config.experimental.enable_tensor_float_32_execution(False)


def deterministic(enabled: bool = True) -> None:
    """The determinism switch: seed Python, NumPy, TensorFlow and Keras with 0 and make TensorFlow
    ops deterministic. TensorFlow has no switch back, so ``enabled=False`` is refused."""
    if not enabled:
        raise ValueError("enabled=False: TensorFlow cannot turn op determinism off once it is on; "
                         "start a new process instead")
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
