"""The TensorFlow port's compile machinery, out of ``model.py`` (which holds the paper's math alone).

One seam: :func:`compiled_forward` is the single entry through which this module wraps a
:class:`~.model.Transformer` -- its inference forward pass as one ``tf.function``, XLA-compiled by default.
It exists for speed: XLA's fused program ran the ``base`` forward pass faster on the CPU than TensorFlow's
graph executor with its oneDNN matmuls (measured in ``docs/benchmarks-tf.md``), and every forward pass the
adapters, ``bench`` and the equivalence harness time goes through it. :func:`_xla_keeps_roundings` says when XLA
may compile a model at all; the compiled searches of :mod:`.decoding` ask it too.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from .model import Transformer, _is_low


def _xla_keeps_roundings(model: Transformer) -> bool:
    """Whether XLA may compile ``model``: float32 and float64, yes. In bfloat16 and float16 TensorFlow's XLA leaves
    out some of the recipe's roundings (it keeps an attention output in float32 into the residual addition:
    "excess precision", which ``tf.function`` offers no option to turn off and ``XLA_FLAGS`` did not change), so a
    low-precision model runs TensorFlow's graph executor, which rounds where the recipe rounds."""
    return not _is_low(model.compute_dtype)


def compiled_forward(model: Transformer, jit_compile: bool = True, return_intermediates: bool = False) -> Callable:
    """The inference forward pass as one ``tf.function``, traced (and with ``jit_compile``
    XLA-compiled) on the first call for each input shape. XLA handles float64 on CPU for every
    op used, and it is the default because its fused program ran the ``base`` forward pass faster on the CPU
    than TensorFlow's graph executor (the numbers: ``docs/benchmarks-tf.md``). A bfloat16 or float16 model runs
    the graph without XLA whatever ``jit_compile`` says (:func:`_xla_keeps_roundings`).

    The returned function checks its inputs eagerly, then runs the graph: once traced, token ids
    can no longer be compared with the vocabulary size (``tf.gather`` would clamp an id out of range).

    Shape: as :class:`~.model.Transformer`; returns log-probabilities (B, T, V_tgt), or with
    ``return_intermediates`` ``(log_probs, stages)``.
    """
    @tf.function(jit_compile=jit_compile and _xla_keeps_roundings(model), autograph=False)   # no control flow
    def graph(src, tgt, src_mask=None, tgt_mask=None):
        return model(src, tgt, src_mask, tgt_mask, return_intermediates=return_intermediates, training=False)

    def forward(src, tgt, src_mask=None, tgt_mask=None):
        src, tgt = model._check_inputs(src, tgt, src_mask, tgt_mask)
        return graph(src, tgt, src_mask, tgt_mask)

    return forward
