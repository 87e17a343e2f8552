"""Eq. (1) under a mask in JAX: a parallel text of ``reference_numpy/softmax.py`` (the softmax over the keys a query
may attend to, and the fully masked row), shared by :mod:`.model` and :mod:`.incremental`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def masked_softmax(scores: jax.Array, mask: jax.Array | None, d_k: int) -> jax.Array:
    """softmax(scores / sqrt(d_k)) over the keys each row may attend to -- Eq. (1)'s weights; a row that may attend to
    no key gets zero weights (:func:`zero_fully_masked_rows`).

    Shape: scores (..., Tq, Tk), mask broadcastable to them -> weights (..., Tq, Tk).
    """
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    # softmax(x / sqrt(d_k)) from exp((x - max x) / sqrt(d_k)): the maximum of the unscaled products, so that the
    # largest entry's difference is an exact 0, however a compiler fuses the scaling (max(x / c) = max(x) / c).
    # Scaling first would let XLA:CPU compute x / c twice, in the maximum's fusion and in the exponential's, and
    # contract one with the subtraction into a fused multiply-add: the largest score minus its own maximum would be
    # the product's rounding error, not 0, and its exp could overflow for large scores.
    # With d_k = 1, Q K^T is itself a product of one term, which XLA:CPU recomputes in both fusions in the same way:
    # the select below (an identity) stands between the product and the subtraction, so that no fused multiply-add
    # can take them together.
    scores = jnp.where(jnp.isnan(scores), jnp.nan, scores)
    row_max = lax.stop_gradient(scores.max(axis=-1, keepdims=True))   # -inf on fully masked rows
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp((scores - row_max) / math.sqrt(d_k))                 # exactly 0 where masked
    total = exp.sum(axis=-1, keepdims=True)
    return exp / jnp.where(total > 0, total, 1.0)                       # fully masked row -> zeros


def zero_fully_masked_rows(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The fully masked row: a query row that may attend to no key gets zero weights and a zero output, never NaN --
    Eq. (1) under a mask (docs/ports.md).

    Shape: x (..., Tq, Z), mask broadcastable to (..., Tq, Tk) -> (..., Tq, Z).
    """
    if mask is None:
        return x
    return jnp.where(mask.any(axis=-1, keepdims=True), x, 0.0)         # a row that sees no key -> zeros
