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


def storage(dtype: DTypeLike, param_dtype: DTypeLike | None) -> DTypeLike:
    """The dtype a layer stores its parameters in and, under the autocast recipe, computes its float32 concepts in:
    ``param_dtype``, or ``dtype`` when none is given."""
    return dtype if param_dtype is None else param_dtype


def autocast_dtype(dtype: DTypeLike | None, param_dtype: DTypeLike | None) -> DTypeLike | None:
    """P when a layer computes in P over float32 parameters (Flax's ``dtype=P, param_dtype=float32``: the autocast
    recipe of ``reference_numpy/precision.py``); None otherwise."""
    if dtype is None or param_dtype is None or not is_low(dtype) or jnp.dtype(param_dtype) != jnp.float32:
        return None
    return dtype


def rounding(dtype: DTypeLike | None, param_dtype: DTypeLike) -> DTypeLike:
    """The dtype a linear map's output is rounded to: P when either ``dtype`` (the autocast recipe) or
    ``param_dtype`` (a model stored in P) is low; the model's own dtype otherwise."""
    mixed = autocast_dtype(dtype, param_dtype)
    return mixed if mixed is not None else param_dtype
