"""The TensorFlow port's compile machinery and kernel choices, out of ``model.py`` (which holds the paper's math
alone).

Two seams. :func:`compiled_forward` is the single entry through which this module wraps a
:class:`~.model.Transformer` -- its inference forward pass as one ``tf.function``, XLA-compiled by default.
It exists for speed: XLA's fused program ran the ``base`` forward pass faster on the CPU than TensorFlow's
graph executor with its oneDNN matmuls (measured in ``docs/benchmarks-tf.md``), and every forward pass the
adapters, ``bench`` and the equivalence harness time goes through it. :func:`_xla_keeps_roundings` says when XLA
may compile a model at all; the compiled searches of :mod:`.decoding` ask it too. And :func:`beam_scores` and
:func:`beam_mix`, where ``incremental.beam_attention`` (Eq. (1) along beam hypotheses) computes its products along a
beam-search cache's hypotheses without gathering keys and values. This module imports nothing from the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import tensorflow as tf

from reference_numpy.config import TransformerConfig
from reference_numpy.precision import is_low

from .capture import capture_stages


class _Model(Protocol):
    """What this module uses of a :class:`~.model.Transformer` (it imports nothing from the model; ``incremental``
    calls :func:`beam_scores` and :func:`beam_mix`)."""

    compute_dtype: str
    config: TransformerConfig

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def _check_inputs(self, src: Any, tgt: Any, src_mask: Any, tgt_mask: Any) -> tuple[Any, Any]: ...


def _xla_keeps_roundings(model: _Model) -> bool:
    """Whether XLA may compile ``model``: float32 and float64, yes. In bfloat16 and float16 TensorFlow's XLA leaves
    out some of the recipe's roundings (it keeps an attention output in float32 into the residual addition:
    "excess precision", which ``tf.function`` offers no option to turn off and ``XLA_FLAGS`` did not change), so a
    low-precision model runs TensorFlow's graph executor, which rounds where the recipe rounds."""
    return not is_low(tf.as_dtype(model.compute_dtype).as_numpy_dtype)


def compiled_forward(model: _Model, jit_compile: bool = True, stages: bool = False) -> Callable:
    """The inference forward pass as one ``tf.function``, traced (and with ``jit_compile``
    XLA-compiled) on the first call for each input shape. XLA handles float64 on CPU for every
    op used, and it is the default because its fused program ran the ``base`` forward pass faster on the CPU
    than TensorFlow's graph executor (the numbers: ``docs/benchmarks-tf.md``). A bfloat16 or float16 model runs
    the graph without XLA whatever ``jit_compile`` says (:func:`_xla_keeps_roundings`).

    The returned function checks its inputs eagerly, then runs the graph: once traced, token ids
    can no longer be compared with the vocabulary size (``tf.gather`` would clamp an id out of range).

    Shape: as :class:`~.model.Transformer`; returns log-probabilities (B, T, V_tgt), or with
    ``stages`` ``(log_probs, stages)``: the traced call is then ``capture_stages(model, ...)`` (:mod:`.capture`).
    """
    @tf.function(jit_compile=jit_compile and _xla_keeps_roundings(model), autograph=False)   # no control flow
    def graph(src, tgt, src_mask=None, tgt_mask=None):
        call = functools.partial(capture_stages, model) if stages else model
        return call(src, tgt, src_mask, tgt_mask, training=False)

    def forward(src, tgt, src_mask=None, tgt_mask=None):
        src, tgt = model._check_inputs(src, tgt, src_mask, tgt_mask)
        return graph(src, tgt, src_mask, tgt_mask)

    return forward


def beam_scores(query: tf.Tensor, key: tf.Tensor, beams: tf.Tensor) -> tf.Tensor:
    """Q K^T along each query row's hypothesis (a cache's ``beams`` table: position c of the hypothesis in row
    b*K + j is in row b*K + beams[b, j, c]) without gathering keys: every query row of a sentence against every
    key row of it (K times the products, a few KB), then at each position the score against the row ``beams``
    names. Shape: query (N, H, Tq, d_k), key (N, H, C, d_k), beams (B, K, C) -> (N, H, Tq, C)."""
    batch, k, capacity = beams.shape
    _, heads, length, _ = query.shape
    every = tf.matmul(_every_row(query, beams), key, transpose_b=True)   # (N, H, K*Tq, C)
    every = tf.reshape(every, (batch, k, heads, k, length, capacity))    # (B, Ki, H, Kj, Tq, C)
    scores = tf.reduce_sum(tf.where(_picked(beams), every, tf.zeros_like(every)), axis=1)  # (B, H, Kj, Tq, C)
    return tf.reshape(tf.transpose(scores, (0, 2, 1, 3, 4)), (batch * k, heads, length, capacity))


def beam_mix(weights: tf.Tensor, value: tf.Tensor, beams: tf.Tensor) -> tf.Tensor:
    """weights V along each query row's hypothesis without gathering values: each key row's values weighted by
    the weights of the positions it holds for every query row, summed over key rows.
    Shape: weights (N, H, Tq, C), value (N, H, C, d_v), beams (B, K, C) -> (N, H, Tq, d_v)."""
    batch, k, capacity = beams.shape
    _, heads, length, _ = weights.shape
    every = tf.reshape(_every_row(weights, beams), (batch, k, heads, k, length, capacity))   # (B, Ki, H, Kj, Tq, C)
    every = tf.where(_picked(beams), every, tf.zeros_like(every))
    out = tf.matmul(tf.reshape(every, (batch * k, heads, k * length, capacity)), value)       # (N, H, K*Tq, d_v)
    out = tf.reduce_sum(tf.reshape(out, (batch, k, heads, k, length, -1)), axis=1)          # (B, H, Kj, Tq, d_v)
    return tf.reshape(tf.transpose(out, (0, 2, 1, 3, 4)), (batch * k, heads, length, -1))


def _every_row(x: tf.Tensor, beams: tf.Tensor) -> tf.Tensor:
    """For key row b*K + i, the rows of all K query rows of sentence b, one after the other.

    Shape: x (N, H, Tq, Z), beams (B, K, C) -> (N, H, K*Tq, Z).
    """
    batch, k, _ = beams.shape
    _, heads, length, width = x.shape
    x = tf.transpose(tf.reshape(x, (batch, 1, k, heads, length, width)), (0, 1, 3, 2, 4, 5))  # (B, 1, H, K, Tq, Z)
    x = tf.broadcast_to(x, (batch, k, heads, k, length, width))           # (B, Ki, H, Kj, Tq, Z)
    return tf.reshape(x, (batch * k, heads, k * length, width))


def _picked(beams: tf.Tensor) -> tf.Tensor:
    """(B, Ki, 1, Kj, 1, C) bool: position c of query row b*K + j is in key row b*K + i."""
    k = beams.shape[1]
    return beams[:, None, None, :, None, :] == tf.reshape(tf.range(k, dtype=beams.dtype), (1, k, 1, 1, 1, 1))
