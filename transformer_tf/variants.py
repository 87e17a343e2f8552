"""The choices a configuration makes beside the paper's, each one named function, as the reference's
:mod:`reference_numpy.variants` defines them (TensorFlow); :mod:`.model` holds the paper's own and calls these by
``config``'s name: the activations :func:`silu` and :func:`gelu` (``config.activation``), the layouts' tables
(``_halves_table``, ``_fairseq_table``: the reference's ``halves_table`` and ``fairseq_table`` computed with
TensorFlow's float64 operations, private since the reference's names are its own, docs/ports.md) and the ``fairseq``
layout's rows, :func:`position_ids`.
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


# ----------------------------------------------------------------------------- sinusoidal layouts

def _halves_table(length: int, d_model: int) -> tf.Tensor:
    """The halves layout, the reference's :func:`~reference_numpy.variants.halves_table`: section 3.5's angles, the
    sines in the first half of the columns, the cosines in the second.

    Shape: returns (L, D), rows 0 .. L-1, float64.
    """
    position = tf.range(length, dtype=tf.float64)[:, None]                # (L, 1)
    two_i = tf.range(0, d_model, 2, dtype=tf.float64)[None, :]            # (1, D/2)
    angle = position / tf.pow(tf.constant(10000.0, tf.float64), two_i / d_model)  # (L, D/2)
    return tf.concat([tf.sin(angle), tf.cos(angle)], axis=-1)


def _fairseq_table(length: int, d_model: int, pad_id: int) -> tf.Tensor:
    """fairseq's table, the reference's :func:`~reference_numpy.variants.fairseq_table`: frequencies
    exp(-i ln(10000) / (D/2 - 1)), sines then cosines, at the positions pad_id + 1, pad_id + 2, ...; row 0 zeros.

    Shape: returns (L + 1, D), float64.
    """
    half = d_model // 2
    frequency = tf.exp(tf.range(half, dtype=tf.float64) * -(math.log(10000.0) / (half - 1)))  # (D/2,)
    position = pad_id + tf.range(1, length + 1, dtype=tf.float64)[:, None]                    # (L, 1)
    angle = position * frequency[None, :]                                                    # (L, D/2)
    return tf.concat([tf.zeros((1, d_model), tf.float64),
                      tf.concat([tf.sin(angle), tf.cos(angle)], axis=-1)], axis=0)             # (L + 1, D)


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
