"""The choices a configuration makes beside the paper's, each one named function, as the reference's
:mod:`reference_numpy.variants` defines them (PyTorch); :mod:`.model` holds the paper's own and calls these by
``config``'s name: the activations :func:`silu` and :func:`gelu` (``config.activation``) and the ``fairseq``
layout's rows, :func:`position_ids` (the layouts' tables themselves are the reference's, :mod:`.model`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def silu(x: Tensor) -> Tensor:
    """x sigmoid(x) (``F.silu``). Shape: (...) -> (...)."""
    return F.silu(x)


def gelu(x: Tensor) -> Tensor:
    """x Phi(x), the exact erf form (``F.gelu``, not its tanh approximation). Shape: (...) -> (...)."""
    return F.gelu(x)


def position_ids(tokens: Tensor, pad_id: int, offset: int | Tensor = 0, by_step: bool = False) -> Tensor:
    """The row of the ``fairseq`` table each token reads (the reference's
    :func:`~reference_numpy.variants.position_ids`): 0 for a pad token, else ``offset`` plus the number of non-pad
    tokens of its row up to and including it; ``by_step`` (the decoder's tokens), plus its own position in the row
    counted from 1, pads included. ``offset`` may be a traced tensor (an exported decoding step).

    Shape: tokens (B, T) int -> rows (B, T) int64.
    """
    real = (tokens != pad_id).long()                                    # (B, T)
    counted = torch.arange(1, real.shape[1] + 1, device=real.device) if by_step else torch.cumsum(real, dim=1)
    return (offset + counted) * real
