"""Devices, full-precision float32 and the determinism switch.

* :func:`devices` / :func:`resolve_device`: "cpu", and "cuda:N" for every visible GPU.
* :func:`full_precision`: float32 matrix products in true float32. On Ampere and later GPUs
  torch may run float32 matmuls and convolutions in TF32 (10-bit mantissa), which breaks the
  float32 tolerance policy; this turns TF32 off.
* :func:`deterministic`: THE switch for run-to-run identical results (same machine, same
  versions): ``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  (needed by cuBLAS on CUDA >= 10.2) and ``torch.backends.cudnn.benchmark = False``. Call it
  before the first CUDA operation (the cuBLAS setting is read when the CUDA context starts).
"""

from __future__ import annotations

import os

import torch

_CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def devices() -> list[str]:
    """Devices usable here: "cpu", then "cuda:0", "cuda:1", ... when CUDA is available."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["cpu"] + [f"cuda:{i}" for i in range(gpus)]


def resolve_device(device: str | int | torch.device) -> torch.device:
    """A ``torch.device`` for a name or device that exists here; a ``ValueError`` otherwise."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device name; choose one of {devices()}") from None
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", 0)
    if str(resolved) not in devices():
        raise ValueError(f"device {device!r} is not available here; choose one of {devices()}")
    return resolved


def full_precision() -> None:
    """Turn TF32 off: float32 matmuls and cuDNN convolutions in full float32 precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def deterministic(enabled: bool = True) -> None:
    """The determinism switch: deterministic algorithms (an error where none exists),
    a fixed cuBLAS workspace and no cuDNN autotuning. ``enabled=False`` undoes it."""
    if enabled:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = _CUBLAS_WORKSPACE_CONFIG
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
