"""The low-precision recipe of ``reference_numpy/precision.py`` on TensorFlow's tensors and dtypes.

A model in a low precision P (bfloat16, float16) keeps Keras layer P inputs; each concept computes wide, in float32
(:func:`wide`), and rounds its result once to P (:func:`narrow`); for float32 and float64 both are the identity.
:func:`is_low` and :func:`parse_dtype` are the reference's, also for a TensorFlow dtype.
"""

from __future__ import annotations

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
