"""Eq. (1) under a mask in TensorFlow: a parallel text of ``reference_numpy/softmax.py`` (the softmax over the keys a
query may attend to, and the fully masked row), shared by :mod:`.model` and :mod:`.incremental`.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf


def masked_softmax(scores: tf.Tensor, mask: tf.Tensor | None, d_k: int) -> tf.Tensor:
    """softmax(scores / sqrt(d_k)) over the keys each row may attend to -- Eq. (1)'s weights; a row that may attend to
    no key gets zero weights (:func:`zero_fully_masked_rows`).

    Shape: scores (..., Tq, Tk), mask broadcastable to them -> weights (..., Tq, Tk).
    """
    if mask is not None:
        scores = tf.where(mask, scores, tf.constant(-np.inf, scores.dtype))
    # softmax(x / sqrt(d_k)) from exp((x - max x) / sqrt(d_k)): the maximum of the unscaled products, so that the
    # largest entry's difference is an exact 0, however a compiler fuses the scaling (max(x / c) = max(x) / c).
    # With d_k = 1, Q K^T is itself a product of one term, which XLA:CPU recomputes in the maximum's fusion and in
    # the exponential's alike: the select below (an identity) stands between the product and the subtraction, so
    # that no fused multiply-add can take them together (contracted, the largest score minus its own maximum would
    # be the product's rounding error, not 0, and its exp could overflow for large scores).
    scores = tf.where(tf.math.is_nan(scores), tf.constant(np.nan, scores.dtype), scores)
    row_max = tf.reduce_max(scores, axis=-1, keepdims=True)              # -inf on fully masked rows
    row_max = tf.where(tf.math.is_finite(row_max), row_max, tf.zeros_like(row_max))
    exp = tf.exp((scores - row_max) / math.sqrt(d_k))                   # exactly 0 where masked
    total = tf.reduce_sum(exp, axis=-1, keepdims=True)
    return exp / tf.where(total > 0, total, tf.ones_like(total))        # fully masked row -> zeros


def zero_fully_masked_rows(x: tf.Tensor, mask: tf.Tensor | None) -> tf.Tensor:
    """The fully masked row: a query row that may attend to no key gets zero weights and a zero output, never NaN --
    Eq. (1) under a mask (docs/ports.md).

    Shape: x (..., Tq, Z), mask broadcastable to (..., Tq, Tk) -> (..., Tq, Z).
    """
    if mask is None:
        return x
    return tf.where(tf.reduce_any(mask, axis=-1, keepdims=True), x, tf.zeros_like(x))   # sees no key -> zeros
