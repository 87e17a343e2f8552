"""The low-precision recipe of ``reference_numpy/precision.py`` on TensorFlow's tensors and dtypes.

A model in a low precision P (bfloat16, float16) keeps Keras layer P inputs; each concept computes wide, in float32
(:func:`wide`), and rounds its result once to P (:func:`narrow`); for float32 and float64 both are the identity.
:func:`is_low` and :func:`parse_dtype` are the reference's, also for a TensorFlow dtype.
"""

from __future__ import annotations

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
