"""Flax plumbing of the JAX port's layers: framework idiom, not section 3, so not in :mod:`.model`.

The reference's ``Linear`` as an ``nnx.Linear`` (``_linear`` builds one in the model's dtype, or in Flax's mixed
precision beside float32 parameters; ``_Linear`` rounds its output once), the full-precision matmul every product of
the port uses (``_matmul``, ``_PRECISION``), the generator's x W + b (``_affine``), the dropout layer each sublayer
owns (``_dropout``) and the model's constants (``_Constant``). JAX only: the other backends' frameworks need none of
it (docs/ports.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

from reference_numpy.config import TransformerConfig

from .precision import autocast_dtype, computation, narrow, rounding, wide

_PRECISION = lax.Precision.HIGHEST


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b at float32's full precision (XLA's default on some devices would round the inputs to bfloat16)."""
    return jnp.matmul(a, b, precision=_PRECISION)



def _affine(x: jax.Array, weight: jax.Array, bias: jax.Array | None, dtype: DTypeLike) -> jax.Array:
    """x W (+ b) by the recipe for a weight no ``nnx.Linear`` holds (the generator's, shared or its own): x, W and b
    rounded to ``dtype``, the products and the sum float32, rounded once to ``dtype``.

    Shape: x (..., in), weight (in, out), bias (out,) or None -> (..., out).
    """
    logits = jnp.matmul(wide(narrow(x, dtype)), wide(narrow(weight, dtype)), precision=_PRECISION)
    if bias is not None:
        logits = logits + wide(narrow(bias, dtype))
    return narrow(logits, dtype)

class _Linear(nnx.Linear):
    """``nnx.Linear`` with its output rounded once to the lower of ``dtype`` and ``param_dtype``."""

    def __call__(self, inputs: jax.Array) -> jax.Array:  # type: ignore[override]  # without out_sharding (unused)
        return narrow(super().__call__(inputs), rounding(self.dtype, self.param_dtype))


def _linear(in_features: int, out_features: int, dtype: DTypeLike, rngs: nnx.Rngs,
            param_dtype: DTypeLike | None = None) -> _Linear:
    """y = x W + b with ``kernel`` W stored (in, out), as in the checkpoint. Shape: (..., in) -> (..., out)."""
    mixed = autocast_dtype(dtype, param_dtype)
    if mixed is not None:
        return _Linear(in_features, out_features, dtype=mixed, param_dtype=jnp.float32,
                       preferred_element_type=jnp.float32, precision=_PRECISION, rngs=rngs)
    return _Linear(in_features, out_features, dtype=computation(dtype), param_dtype=dtype, precision=_PRECISION,
                   rngs=rngs)



class _Constant(nnx.Variable):
    """A fixed array of the model's state, never trained (the sinusoidal table)."""

def _dropout(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    """Dropout with P_drop = ``config.dropout`` (section 5.4), off unless asked for."""
    return nnx.Dropout(config.dropout, deterministic=True, rngs=rngs)
