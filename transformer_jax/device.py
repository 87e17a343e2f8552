"""Device choice, full-precision float32 and determinism for the JAX/Flax port.

* Devices are named ``"cpu"`` and ``"gpu:N"``; :func:`place` moves a model's state there and
  JAX then runs every computation on the device its committed inputs live on.
* Full-precision float32: on GPUs XLA may run float32 matmuls in TF32 (or bf16 passes) unless
  told otherwise. Every matmul of the port passes ``precision=PRECISION`` (``HIGHEST``), so the
  port never depends on ``jax_default_matmul_precision``; on CPU the flag changes nothing.
* Determinism: XLA on CPU is run-to-run deterministic. On GPU some reductions (scatter, some
  fusions) are not unless XLA is started with ``DETERMINISM_FLAG`` in ``XLA_FLAGS``;
  :func:`enable_determinism` adds it and must run before JAX's first computation.
* float64 needs ``jax_enable_x64``; :func:`check_dtype` refuses float64 without it instead of
  letting JAX silently truncate to float32.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from jax import lax

PRECISION = lax.Precision.HIGHEST
DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_dtype(dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype; ``ValueError`` unless float32, or float64 with x64 enabled."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        raise ValueError("dtype float64 needs 64-bit JAX, which is off: call "
                         "jax.config.update('jax_enable_x64', True) before creating arrays "
                         "(or set JAX_ENABLE_X64=1), or use dtype float32")
    return dtype


def available_devices() -> list[str]:
    """``"cpu"`` and one ``"gpu:N"`` per GPU that JAX sees."""
    return ["cpu"] + [f"gpu:{i}" for i in range(len(_gpus()))]


def get_device(name: str) -> jax.Device:
    """The ``jax.Device`` for ``"cpu"`` or ``"gpu:N"``; ``ValueError`` for anything else."""
    if name == "cpu":
        return jax.devices("cpu")[0]
    kind, _, index = name.partition(":")
    gpus = _gpus()
    if kind == "gpu" and index.isdigit() and int(index) < len(gpus):
        return gpus[int(index)]
    raise ValueError(f"device {name!r} is not available; choose one of {available_devices()}")


def place(model: nnx.Module, device: str) -> nnx.Module:
    """Move every variable of ``model`` to ``device`` (in place); returns the model."""
    nnx.update(model, jax.device_put(nnx.state(model), get_device(device)))
    return model


def enable_determinism() -> None:
    """Ask XLA for deterministic GPU kernels; call before JAX runs its first computation."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DETERMINISM_FLAG not in flags.split():
        os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISM_FLAG}".strip()


def _gpus() -> list[jax.Device]:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU platform in this jaxlib or on this machine
        return []
