"""The choices a configuration makes beside the paper's, each one named function, as the reference's
:mod:`reference_numpy.variants` defines them (TensorFlow); :mod:`.model` holds the paper's own and calls these by
``config``'s name: the activations :func:`silu` and :func:`gelu` (``config.activation``) and the ``fairseq``
layout's rows, :func:`position_ids` (the layouts' tables themselves are the reference's, :mod:`.model`).
"""

from __future__ import annotations

import math

import tensorflow as tf


def silu(x: tf.Tensor) -> tf.Tensor:
    """x sigmoid(x) (``tf.nn.silu``). Shape: (...) -> (...)."""
    return tf.nn.silu(x)


def gelu(x: tf.Tensor) -> tf.Tensor:
    """x Phi(x) = x / 2 (1 + erf(x / sqrt(2))), the exact form, written with ``tf.math.erf``
    (``tf.nn.gelu(approximate=False)`` evaluates erfc(-x / sqrt(2)), 5e-9 off in float64). Shape: (...) -> (...)."""
    return 0.5 * x * (1.0 + tf.math.erf(x / math.sqrt(2.0)))


def position_ids(tokens: tf.Tensor, pad_id: int, offset: int | tf.Tensor = 0, by_step: bool = False) -> tf.Tensor:
    """The row of the ``fairseq`` table each token reads (the reference's
    :func:`~reference_numpy.variants.position_ids`): 0 for a pad token, else ``offset`` plus the number of non-pad
    tokens of its row up to and including it; ``by_step`` (the decoder's tokens), plus its own position in the row
    counted from 1, pads included. ``offset`` may be a tensor (cached decoding).

    Shape: tokens (B, T) int -> rows (B, T) int32.
    """
    real = tf.cast(tf.not_equal(tokens, tf.cast(pad_id, tokens.dtype)), tf.int32)   # (B, T)
    counted = tf.range(1, tf.shape(real)[1] + 1) if by_step else tf.cumsum(real, axis=1)
    return (tf.cast(offset, tf.int32) + counted) * real
