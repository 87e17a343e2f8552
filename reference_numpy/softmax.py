"""Eq. (1) under a mask in plain NumPy: the softmax over the keys a query may attend to, and the fully masked row.

Written once for the two places Eq. (1) is computed: :func:`.model.scaled_dot_product_attention` and attention
along beam hypotheses (:func:`.incremental.beam_attention`); every port's ``softmax.py`` has the same names
(tests/project/test_parallel_texts.py).
"""

from __future__ import annotations

import math

import numpy as np


def masked_softmax(scores: np.ndarray, mask: np.ndarray | None, d_k: int) -> np.ndarray:
    """softmax(scores / sqrt(d_k)) over the keys each row may attend to -- Eq. (1)'s weights; a row that may attend to
    no key gets zero weights (:func:`zero_fully_masked_rows`).

    Shape: scores (..., Tq, Tk), mask broadcastable to them -> weights (..., Tq, Tk).
    """
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    # softmax(x / sqrt(d_k)) from exp((x - max x) / sqrt(d_k)): the maximum of the unscaled products, so that the
    # largest entry's difference is an exact 0, however a compiler fuses the scaling (max(x / c) = max(x) / c).
    row_max = scores.max(axis=-1, keepdims=True)                        # -inf on fully masked rows
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exp = np.exp((scores - row_max) / math.sqrt(d_k))                   # exactly 0 where masked
    total = exp.sum(axis=-1, keepdims=True)
    return exp / np.where(total > 0, total, 1.0)                        # fully masked row -> zeros


def zero_fully_masked_rows(x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The fully masked row: a query row that may attend to no key gets zero weights and a zero output, never NaN --
    Eq. (1) under a mask (docs/ports.md).

    Shape: x (..., Tq, Z), mask broadcastable to (..., Tq, Tk) -> (..., Tq, Z).
    """
    if mask is None:
        return x
    return np.where(mask.any(axis=-1, keepdims=True), x, 0.0)          # a row that sees no key -> zeros
