"""The low-precision recipe of ``reference_numpy/precision.py`` on JAX's arrays.

A model in a low precision P (bfloat16, float16) stores its parameters, activations and caches in P; Flax's layers
compute in :func:`computation` (float32: wide) and :func:`narrow` rounds a concept's result once to P at the
reference's rounding points; for float32 and float64 all three are the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from reference_numpy.precision import is_low


def wide(x: jax.Array) -> jax.Array:
    """A P array as float32 (exact), for a concept computed wide; float32 and float64 arrays unchanged."""
    return x.astype(jnp.float32) if is_low(x.dtype) else x


def narrow(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """A concept's wide result rounded once (to nearest, ties to even) to the model's ``dtype`` when it is low;
    unchanged otherwise."""
    return x.astype(dtype) if is_low(dtype) else x


def computation(dtype: DTypeLike) -> DTypeLike:
    """The dtype Flax layers of a model in ``dtype`` compute in: float32 (wide) for P, ``dtype`` itself otherwise."""
    return jnp.float32 if is_low(dtype) else dtype
