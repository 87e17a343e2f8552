"""The choices a configuration makes beside the paper's, each one named function, as the reference's
:mod:`reference_numpy.variants` defines them (JAX); :mod:`.model` holds the paper's own and calls these by
``config``'s name: the activations :func:`silu` and :func:`gelu` (``config.activation``) and the ``fairseq``
layout's rows, :func:`position_ids` (the layouts' tables themselves are the reference's, :mod:`.model`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def silu(x: jax.Array) -> jax.Array:
    """x sigmoid(x) (``jax.nn.silu``). Shape: (...) -> (...)."""
    return jax.nn.silu(x)


def gelu(x: jax.Array) -> jax.Array:
    """x Phi(x), the exact erf form (``jax.nn.gelu(approximate=False)``). Shape: (...) -> (...)."""
    return jax.nn.gelu(x, approximate=False)


def position_ids(tokens: jax.Array, pad_id: int, offset: int | jax.Array = 0, by_step: bool = False) -> jax.Array:
    """The row of the ``fairseq`` table each token reads (the reference's
    :func:`~reference_numpy.variants.position_ids`): 0 for a pad token, else ``offset`` plus the number of non-pad
    tokens of its row up to and including it; ``by_step`` (the decoder's tokens), plus its own position in the row
    counted from 1, pads included. ``offset`` may be traced.

    Shape: tokens (B, T) int -> rows (B, T) int32.
    """
    real = (jnp.asarray(tokens) != pad_id).astype(jnp.int32)           # (B, T)
    counted = jnp.arange(1, real.shape[1] + 1, dtype=jnp.int32) if by_step else jnp.cumsum(real, axis=1)
    return (offset + counted) * real
