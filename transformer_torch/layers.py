"""PyTorch plumbing of the torch port's layers: framework idiom, not section 3, so not in :mod:`.model`.

The reference's ``Linear`` as an ``nn.Linear`` computed by :func:`.speed.linear` (``_linear``, ``_Linear``: weights
stored (out, in), low precisions entered wide and left rounded once), the embedding's lookup (``_embedding``), the
model's ``dtype`` and ``device`` (``_Model``) and the normal initialisation that draws nothing on the meta device
(``_normal_parameter``). PyTorch only: the other backends' frameworks need none of it (docs/ports.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import speed
from .precision import LOW, narrow, wide


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b for a weight stored (out, in), as ``F.linear``, by :func:`.speed.linear`.

    Shape: x (..., in), weight (out, in), bias (out,) -> (..., out).
    """
    if weight.dtype in LOW:
        return narrow(speed.linear(wide(x), wide(weight), None if bias is None else wide(bias)), weight.dtype)
    return speed.linear(x, weight, bias)


class _Linear(nn.Linear):
    """``nn.Linear`` (weight (out, in), bias (out,)) computed by :func:`_linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return _linear(x, self.weight, self.bias)



def _embedding(tokens: Tensor, weight: Tensor) -> Tensor:
    """The rows ``weight[tokens]`` (``F.embedding``), widened; a low precision's looked up wide when a gradient is
    asked for: torch's embedding backward would sum a row's gradients in P, the recipe (reference_numpy/backward.py)
    sums them wide, and the exact round trip through P rounds each row first.

    Shape: tokens (B, T) int, weight (V, D) -> (B, T, D).
    """
    if weight.dtype in LOW and weight.requires_grad and torch.is_grad_enabled():
        return wide(narrow(F.embedding(tokens, wide(weight)), weight.dtype))
    return wide(F.embedding(tokens, weight))


class _Model(nn.Module):
    """The model's plumbing: its ``dtype`` and ``device``, its source embedding's weight's."""

    src_embed: Any

    @property
    def dtype(self) -> torch.dtype:
        return self.src_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.src_embed.weight.device

def _normal_parameter(*shape: int, std: float) -> nn.Parameter:
    """A parameter drawn from N(0, std^2); nothing drawn on the meta device (docs/ports.md)."""
    weight = torch.empty(*shape)
    return nn.Parameter(weight if weight.is_meta else nn.init.normal_(weight, std=std))
