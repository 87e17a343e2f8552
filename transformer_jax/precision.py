"""The low-precision recipe of ``reference_numpy/precision.py`` on JAX's arrays.

A model in a low precision P (bfloat16, float16) stores its parameters, activations and caches in P; Flax's layers
compute in :func:`computation` (float32: wide) and :func:`narrow` rounds a concept's result once to P at the
reference's rounding points; for float32 and float64 all three are the identity.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
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


def attention_product(product: Callable[[jax.Array, jax.Array], jax.Array], a: jax.Array, b: jax.Array,
                      mixed: DTypeLike | None) -> jax.Array:
    """``product(a, b)``, a product of Eq. (1) (Q K^T, weights . V, or their forms along beam hypotheses) of float32
    inputs: with ``mixed`` P the autocast recipe's P product -- both inputs rounded to P, float32 sums, the result
    rounded once to P and read as float32, the precision the softmax computes in; otherwise the product itself."""
    if mixed is None:
        return product(a, b)
    return wide(narrow(product(wide(narrow(a, mixed)), wide(narrow(b, mixed))), mixed))


Concept = TypeVar("Concept", bound=Callable[..., Any])


def computed_wide(concept: Concept) -> Concept:
    """``concept`` (a function of arrays returning a tuple of arrays, with a keyword ``dtype``: P for the autocast
    recipe, or None) entered and left by the recipe: its floating arguments rounded to its precision -- ``dtype``, or
    its first argument's dtype -- and widened on entry, each array it returns rounded once (:func:`narrow`) to it."""

    @functools.wraps(concept)
    def entered_and_left(*args: Any, dtype: DTypeLike | None = None, **kwargs: Any) -> tuple:
        rounding = args[0].dtype if dtype is None else dtype
        args = tuple(wide(narrow(a, rounding)) if _floating(a) else a for a in args)
        results = concept(*args, dtype=dtype, **kwargs)
        return tuple(None if result is None else narrow(result, rounding) for result in results)

    return entered_and_left  # type: ignore[return-value]


def _floating(x: Any) -> bool:
    """Whether ``x`` is an array of floating-point numbers (a mask or a beam table is not)."""
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating)
