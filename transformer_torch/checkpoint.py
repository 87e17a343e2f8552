"""The shared checkpoint <-> the PyTorch port's parameters.

The conversion is data: :data:`RENAMED` (the checkpoint names whose torch parameter path
differs; every other name is its own path) and :data:`TRANSPOSED` (the tensors stored (in, out)
in the checkpoint, so that y = x @ W + b, and (out, in) by ``nn.Linear`` and the generator).
:func:`name_table` applies them to ``parameter_shapes(config)``. Every tensor's shape is checked
against the parameter it fills. File validation is the reference's own
(``reference_numpy.checkpoint.load_checkpoint`` / ``validate_params``), so load errors are the
reference's one-line ``ValueError``s.

With ``share_embeddings`` the one checkpoint tensor ``shared_embed.weight`` fills the one
parameter ``src_embed.weight``, which ``tgt_embed`` and ``generator`` share (tied weights).
The sinusoidal table is a non-persistent buffer, not a parameter, and is not stored.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy.config import TransformerConfig

from .device import resolve_device
from .model import Transformer

# checkpoint name -> torch parameter path, where they differ.
RENAMED = {
    "shared_embed.weight": "src_embed.weight",
    "src_pos_embed.weight": "src_pos.weight",
    "tgt_pos_embed.weight": "tgt_pos.weight",
}
# Name endings of the tensors stored (in, out) in the checkpoint and (out, in) in torch.
TRANSPOSED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
              "linear1.weight", "linear2.weight", "generator.weight")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def name_table(config: TransformerConfig) -> dict[str, str]:
    """Every tensor of a checkpoint for ``config``: checkpoint name -> torch parameter path."""
    return {name: RENAMED.get(name, name) for name in reference_checkpoint.parameter_shapes(config)}


def torch_dtype(dtype) -> torch.dtype:
    """``torch.float32``/``torch.float64`` from a torch dtype or the names "float32"/"float64"."""
    if dtype in DTYPES.values():
        return dtype
    if str(dtype) not in DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return DTYPES[str(dtype)]


def from_params(config: TransformerConfig, params: dict[str, np.ndarray], dtype=torch.float64,
                device="cpu") -> Transformer:
    """A :class:`Transformer` in ``dtype`` on ``device``, in eval mode, from checkpoint-layout arrays."""
    reference_checkpoint.validate_params(config, params)
    model = Transformer(config).to(device=resolve_device(device), dtype=torch_dtype(dtype))
    targets = dict(model.named_parameters())
    with torch.no_grad():
        for name, path in name_table(config).items():
            value = torch.from_numpy(np.ascontiguousarray(params[name]))
            value = value.T if name.endswith(TRANSPOSED) else value
            if value.shape != targets[path].shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)} after conversion; "
                                 f"parameter {path!r} needs {tuple(targets[path].shape)}")
            targets[path].copy_(value)
    return model.eval()


def to_params(model: Transformer, gradients: bool = False) -> dict[str, np.ndarray]:
    """The model's weights -- or, with ``gradients``, their ``.grad`` -- in checkpoint layout
    (name -> (in, out) NumPy arrays, the model's dtype)."""
    targets = dict(model.named_parameters())
    params = {}
    for name, path in name_table(model.config).items():
        value = (targets[path].grad if gradients else targets[path]).detach().cpu()
        params[name] = np.ascontiguousarray((value.T if name.endswith(TRANSPOSED) else value).numpy())
    return params


def load_checkpoint(path: str | os.PathLike, dtype=torch.float64, device="cpu") -> Transformer:
    """Read, validate and load a shared checkpoint into a :class:`Transformer` (eval mode)."""
    config, params = reference_checkpoint.load_checkpoint(path)
    return from_params(config, params, dtype, device)


def save_checkpoint(model: Transformer, path: str | os.PathLike) -> None:
    """Write the model's weights (in its dtype) and config as a shared checkpoint, atomically."""
    reference_checkpoint.save_checkpoint(path, model.config, to_params(model))
