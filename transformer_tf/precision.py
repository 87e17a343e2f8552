"""The low-precision recipe of ``reference_numpy/precision.py`` on TensorFlow's tensors and dtypes.

A model in a low precision P (bfloat16, float16) keeps Keras layer P inputs; each concept computes wide, in float32
(:func:`wide`), and rounds its result once to P (:func:`narrow`); for float32 and float64 both are the identity.
:func:`is_low`, :func:`parse_dtype` and :func:`round_to` are the reference's, also for a TensorFlow dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import DTypeLike

from reference_numpy import precision as reference


def is_low(dtype: DTypeLike | tf.DType) -> bool:
    """Whether ``dtype`` (a TensorFlow dtype or a name) is bfloat16 or float16, computed by the recipe."""
    return reference.is_low(tf.as_dtype(dtype).as_numpy_dtype)


def wide(x: tf.Tensor) -> tf.Tensor:
    """A P tensor as float32 (exact: float32 holds every bfloat16 and float16 number), for a concept computed
    wide; a float32 or float64 tensor unchanged."""
    return tf.cast(x, tf.float32) if is_low(x.dtype) else x


def narrow(x: tf.Tensor, dtype: DTypeLike | tf.DType) -> tf.Tensor:
    """A concept's wide (float32) result rounded once to the model's ``dtype`` when it is low (TensorFlow's and
    XLA's float32 -> P casts round to nearest, ties to even); unchanged otherwise."""
    return tf.cast(x, dtype) if is_low(dtype) else x


def round_to(x: tf.Tensor, dtype: DTypeLike | tf.DType) -> tf.Tensor:
    """The reference's ``round_to`` of a float64 tensor: ``dtype``'s nearest numbers, a low precision's rounded once
    by the reference (TensorFlow's own float64 -> bfloat16 cast rounds twice, through float32)."""
    if is_low(dtype):
        return tf.constant(reference.round_to(x.numpy(), tf.as_dtype(dtype).as_numpy_dtype))
    return tf.cast(x, dtype)


def attention_product(product: Callable[[tf.Tensor, tf.Tensor], tf.Tensor], a: tf.Tensor, b: tf.Tensor,
                      mixed: tf.DType | None) -> tf.Tensor:
    """``product(a, b)``, a product of Eq. (1) (Q K^T, weights . V, or their forms along beam hypotheses) of float32
    inputs: with ``mixed`` P the autocast recipe's P product -- both inputs rounded to P, float32 sums, the result
    rounded once to P and read as float32, the precision the softmax computes in; otherwise the product itself."""
    if mixed is None:
        return product(a, b)
    return wide(narrow(product(wide(narrow(a, mixed)), wide(narrow(b, mixed))), mixed))


Concept = TypeVar("Concept", bound=Callable[..., Any])


def computed_wide(concept: Concept) -> Concept:
    """``concept`` (a function of tensors returning a tuple of tensors, with a keyword ``dtype``: P for the autocast
    recipe, or None) entered and left by the recipe: its floating arguments rounded to its precision -- ``dtype``, or
    its first argument's dtype -- and widened on entry, each tensor it returns rounded once (:func:`narrow`) to it."""

    @functools.wraps(concept)
    def entered_and_left(*args: Any, dtype: DTypeLike | tf.DType | None = None, **kwargs: Any) -> tuple:
        args = tuple(tf.convert_to_tensor(a) if _floating(a) else a for a in args)
        mixed = None if dtype is None else tf.as_dtype(dtype)
        rounding = args[0].dtype if mixed is None else mixed
        args = tuple(wide(narrow(a, rounding)) if _floating(a) else a for a in args)
        results = concept(*args, dtype=mixed, **kwargs)
        return tuple(None if result is None else narrow(result, rounding) for result in results)

    return entered_and_left  # type: ignore[return-value]


def _floating(x: Any) -> bool:
    """Whether ``x`` is a tensor or array of floating-point numbers (a mask or a beam table is not)."""
    if tf.is_tensor(x):
        return x.dtype.is_floating
    return isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)


def parse_dtype(dtype: DTypeLike | tf.DType) -> np.dtype:
    """The reference's ``parse_dtype`` (one ValueError for anything but float64, float32, bfloat16, float16),
    also for a TensorFlow dtype."""
    return reference.parse_dtype(dtype.as_numpy_dtype if isinstance(dtype, tf.DType) else dtype)


def autocast_dtype(policy: keras.DTypePolicy) -> tf.DType | None:
    """P for a mixed Keras policy (``mixed_bfloat16``, ``mixed_float16``: float32 variables, computation in P -- the
    autocast recipe of ``reference_numpy/precision.py``); None for any other."""
    if policy.variable_dtype == "float32" and policy.compute_dtype in ("bfloat16", "float16"):
        return tf.as_dtype(policy.compute_dtype)
    return None


def float32_under_autocast(kwargs: dict) -> dict:
    """A layer's keyword arguments with a mixed policy replaced by float32 (its variables' dtype): the autocast
    recipe computes LayerNorm, the embeddings and the positional encoding in float32, where Keras' mixed policy
    would cast their outputs to P."""
    policy = kwargs.get("dtype")
    if policy is None:
        policy = keras.config.dtype_policy()
    if isinstance(policy, (str, keras.DTypePolicy)):
        policy = keras.DTypePolicy(policy) if isinstance(policy, str) else policy
        if autocast_dtype(policy) is not None:
            return {**kwargs, "dtype": policy.variable_dtype}
    return kwargs
