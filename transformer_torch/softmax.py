"""Eq. (1) under a mask in PyTorch: a parallel text of ``reference_numpy/softmax.py`` (the softmax over the keys a
query may attend to, and the fully masked row), shared by :mod:`.model` and :mod:`.incremental`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .precision import wide


def masked_softmax(scores: Tensor, mask: Tensor | None, d_k: int) -> Tensor:
    """softmax(scores / sqrt(d_k)) over the keys each row may attend to -- Eq. (1)'s weights; a row that may attend to
    no key gets zero weights (:func:`zero_fully_masked_rows`).

    Shape: scores (..., Tq, Tk), mask broadcastable to them -> weights (..., Tq, Tk).

    PyTorch: computed wide (float32 also for ``torch.autocast``'s P scores).
    """
    scores = wide(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    # softmax(x / sqrt(d_k)) from exp((x - max x) / sqrt(d_k)): the maximum of the unscaled products, so that the
    # largest entry's difference is an exact 0, however a compiler fuses the scaling (max(x / c) = max(x) / c).
    row_max = scores.amax(dim=-1, keepdim=True)                         # -inf on fully masked rows
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    exp = torch.exp((scores - row_max) / math.sqrt(d_k))                # exactly 0 where masked
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total > 0, total, 1.0)                     # fully masked row -> zeros


def zero_fully_masked_rows(x: Tensor, mask: Tensor | None) -> Tensor:
    """The fully masked row: a query row that may attend to no key gets zero weights and a zero output, never NaN --
    Eq. (1) under a mask (docs/ports.md).

    Shape: x (..., Tq, Z), mask broadcastable to (..., Tq, Tk) -> (..., Tq, Z).
    """
    if mask is None:
        return x
    return torch.where(mask.any(dim=-1, keepdim=True), x, 0.0)         # a row that sees no key -> zeros
