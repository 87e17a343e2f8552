"""Devices, full-precision float32 and the determinism switch for the JAX/Flax port.

* :func:`devices` / :func:`resolve_device`: ``"cpu"`` and ``"gpu:N"`` for every GPU JAX sees.
  JAX runs a computation on the device its committed inputs live on, so a model is on a device
  when its state is: ``from_params``/``load_checkpoint`` take ``device``, and
  ``nnx.update(model, jax.device_put(nnx.state(model), resolve_device(name)))`` moves one.
* :func:`full_precision`: on GPUs XLA may run float32 matmuls in TF32 (or bf16 passes) unless
  told otherwise. Every matmul of the port already passes ``precision=HIGHEST``, so the port
  never depends on it; this also sets ``jax_default_matmul_precision`` to "highest" for the
  caller's own JAX code. On CPU it changes nothing.
* :func:`deterministic`: XLA on CPU is run-to-run deterministic. On GPU some reductions
  (scatter, some fusions) are not unless XLA starts with ``--xla_gpu_deterministic_ops=true``
  in ``XLA_FLAGS``; this adds it, and must run before JAX's first computation.
* :func:`_check_dtype`: a model's dtype is float32, float64, bfloat16 or float16, parsed by the
  reference's ``parse_dtype`` (one error message in every backend).
* float64 needs ``jax_enable_x64`` (``jax.config.update("jax_enable_x64", True)`` for the process,
  or ``with jax.enable_x64(True):`` around the calls); the port refuses float64 without it
  instead of letting JAX silently truncate to float32. Importing the port never turns it on.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import numpy.typing as npt

from reference_numpy.precision import parse_dtype

_DETERMINISM_FLAG = "--xla_gpu_deterministic_ops=true"


def devices() -> list[str]:
    """Devices usable here: ``"cpu"``, then one ``"gpu:N"`` per GPU that JAX sees."""
    return ["cpu"] + [f"gpu:{i}" for i in range(len(_gpus()))]


def resolve_device(device: str) -> jax.Device:
    """The ``jax.Device`` for ``"cpu"`` or ``"gpu:N"``; a ``ValueError`` for anything else."""
    if device == "cpu":
        return jax.devices("cpu")[0]
    kind, _, index = str(device).partition(":")
    gpus = _gpus()
    if kind == "gpu" and index.isdigit() and int(index) < len(gpus):
        return gpus[int(index)]
    raise ValueError(f"device {device!r} is not available; choose one of {devices()}")


def full_precision() -> None:
    """float32 matmuls in full float32 precision (no TF32/bf16 passes) for JAX code outside the
    port too; the port's own matmuls pass ``precision=HIGHEST`` whatever this says."""
    jax.config.update("jax_default_matmul_precision", "highest")


def deterministic(enabled: bool = True) -> None:
    """Ask XLA for deterministic GPU kernels (``enabled=False`` removes the flag again); call it
    before JAX runs its first computation."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag != _DETERMINISM_FLAG]
    os.environ["XLA_FLAGS"] = " ".join(flags + [_DETERMINISM_FLAG] if enabled else flags)


def _check_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """``dtype`` (a name, a NumPy, ml_dtypes or JAX dtype) as a NumPy dtype; ``ValueError`` unless float32,
    bfloat16, float16, or float64 with x64 enabled."""
    dtype = parse_dtype(dtype)
    if dtype == np.float64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # a flag jax's Config stub omits
        raise ValueError("dtype float64 needs 64-bit JAX, which is off: call "
                         "jax.config.update('jax_enable_x64', True) before creating arrays "
                         "(or set JAX_ENABLE_X64=1), or use dtype float32")
    return dtype


def _gpus() -> list[jax.Device]:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU platform in this jaxlib or on this machine
        return []
