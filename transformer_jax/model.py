"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX with Flax NNX.

A parallel text of ``reference_numpy/model.py``: the same pieces, names, argument order and
shape comments; only framework idiom differs. Constructors take the config first, then
``dtype`` (float32 or float64: both the parameter and the computation dtype; float64 needs
``jax_enable_x64``, see :mod:`.device`) and ``rngs`` as keywords. A model in a low precision P
(bfloat16 or float16) follows the recipe of ``reference_numpy/precision.py``: Flax's
``param_dtype=P`` stores the weights, ``dtype=float32`` computes each concept wide (the framework's
accumulation width; the reference's is float64), and :func:`narrow` rounds its output once to P at
the reference's rounding points; the log-probabilities are float32. Parameters are random until
loaded from the shared checkpoint by :mod:`.checkpoint`. Dropout (section 5.4) is applied to
every sublayer output before the residual add and, in :class:`PositionalEncoding`, to the sums of
embeddings and positional encodings; it is off unless ``deterministic=False`` is passed (or set with
``nnx.view(model, deterministic=False)``). Every matmul passes ``precision=HIGHEST`` (full float32
on GPUs too).

Shape legend used in every docstring:
    B: batch size          H: number of heads h        D: d_model
    S: source length       T: target length            d_k: D / H
    Tq, Tk: query and key lengths                      F: d_ff
    V: vocabulary size     L: number of positions (config.max_len)
    C: key/value cache capacity (self-attention: the decoding budget; encoder-decoder: S)
    K: beams per sentence (beam search), N = B * K rows

Masks are boolean and **True means "may attend"**, broadcastable to (B, H, Tq, Tk).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

from reference_numpy import checks
from reference_numpy import model as reference
from reference_numpy.config import TransformerConfig

from . import speed
from .checks import check_cache_index, check_tokens, checked_mask, checked_memory, describe
from .device import _check_dtype
from .incremental import KVCache, _attend_written, _beam_table
from .precision import autocast_dtype, computation, narrow, rounding, storage, wide
from .variants import gelu, position_ids, silu

_PRECISION = lax.Precision.HIGHEST
ACTIVATIONS = {"silu": silu, "gelu": gelu}   # config.activation's choices beside the paper's ReLU (.variants)


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: npt.ArrayLike, pad_id: int) -> jax.Array:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return (jnp.asarray(tokens) != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """Position i may attend to positions j <= i (decoder self-attention, section 3.2.3).

    Shape: mask (1, 1, T, T), bool, True = may attend.
    """
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def target_mask(tgt: npt.ArrayLike, pad_id: int) -> jax.Array:
    """Causal mask combined with the target's padding mask; the first position, the start token, is read even when
    it is pad (Marian's ``decoder_start_token_id`` is its pad, which transformers' decoder reads: it masks no
    target position, so a right-padded target's pad keys are hidden by the causal mask from every real position).

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    padding = padding_mask(tgt, pad_id)                                   # (B, 1, 1, T)
    return (padding | (jnp.arange(padding.shape[-1]) == 0)) & causal_mask(padding.shape[-1])


# ----------------------------------------------------------------------------- attention

def scaled_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                                 mask: jax.Array | None = None,
                                 beams: jax.Array | None = None, *,
                                 dtype: DTypeLike | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  -- Eq. (1), section 3.2.1.

    Written out rather than taken from ``jax.nn.dot_product_attention`` or Flax: those give a
    query row whose mask has no True entry the uniform average of the values; here its weights
    are all zero and its output is zero (never NaN), as in the reference. The row maximum is
    held constant for gradients (it cancels mathematically), so fully masked rows have finite
    gradients too.

    With ``beams`` (a beam-search cache whose rows stay in place, see :class:`.incremental.KVCache`) query
    row b*K + j attends over its own hypothesis: at position c, the key and value of row
    b*K + beams[b, j, c] (without moving keys or values: :func:`.speed.beam_scores`, :func:`.speed.beam_mix`).

    In a low precision the whole of Eq. (1) is computed wide (float32) from the P inputs and the
    output and weights are rounded to P. With ``dtype`` P (Flax's computation dtype, as in
    ``flax.nnx.dot_product_attention``; a model built with ``dtype=P, param_dtype=float32``), the autocast recipe:
    Q, K and V rounded to P, Q K^T and weights . V each accumulated in float32 and rounded to P, the scaling, the
    mask and the softmax in float32 (Flax's own attention would run the softmax in ``dtype`` unless
    ``force_fp32_for_softmax``, flax/nnx/nn/attention.py).

    Shape:
        query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v),
        mask broadcastable to (..., Tq, Tk), bool, True = may attend.
        Returns output (..., Tq, d_v) and weights (..., Tq, Tk).
        With ``beams`` (B, K, Tk) int: query, key, value (N, H, T, d_k).
    """
    mixed, dtype = dtype, query.dtype if dtype is None else dtype
    query, key, value = (wide(narrow(x, dtype)) for x in (query, key, value))   # P inputs exactly in float32
    d_k = query.shape[-1]
    if beams is None:
        scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=_PRECISION)    # (..., Tq, Tk)
    else:
        scores = speed.beam_scores(query, key, beams)
    if mixed is not None:
        scores = wide(narrow(scores, mixed))                            # autocast: Q K^T a P product
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, d_k)                         # (..., Tq, Tk)
    if mixed is not None:
        weights = wide(narrow(weights, mixed))                          # autocast: weights . V a P product
    out = jnp.matmul(weights, value, precision=_PRECISION) if beams is None else speed.beam_mix(weights, value, beams)
    if mask is not None:
        out = jnp.where(mask.any(axis=-1, keepdims=True), out, 0.0)     # a row that sees no key -> zeros
    return narrow(out, dtype), narrow(weights, dtype)


def masked_softmax(scores: jax.Array, mask: jax.Array | None, d_k: int) -> jax.Array:
    """softmax(scores / sqrt(d_k)) over the keys each query row may attend to -- Eq. (1)'s weights, section 3.2.1.
    A row whose mask has no True entry attends to nothing: its weights are all zero (never NaN, never a uniform
    average), the project's convention for a fully masked row (the reference's
    :func:`~reference_numpy.model.masked_softmax`); the row maximum is held constant for gradients (it cancels
    mathematically), so that such a row's gradients are finite too.

    Shape: scores (..., Tq, Tk), mask broadcastable to them, bool, True = may attend -> weights (..., Tq, Tk).
    """
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    # softmax(x / sqrt(d_k)) from exp((x - max x) / sqrt(d_k)): the maximum of the unscaled products, so that the
    # largest entry's difference is an exact 0, however a compiler fuses the scaling (max(x / c) = max(x) / c).
    # Scaling first would let XLA:CPU compute x / c twice, in the maximum's fusion and in the exponential's, and
    # contract one with the subtraction into a fused multiply-add: the largest score minus its own maximum would be
    # the product's rounding error, not 0, and its exp could overflow for large scores.
    # With d_k = 1, Q K^T is itself a product of one term, which XLA:CPU recomputes in both fusions in the same way:
    # the select below (an identity) stands between the product and the subtraction, so that no fused multiply-add
    # can take them together.
    scores = jnp.where(jnp.isnan(scores), jnp.nan, scores)
    row_max = lax.stop_gradient(scores.max(axis=-1, keepdims=True))   # -inf on fully masked rows
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp((scores - row_max) / math.sqrt(d_k))                 # exactly 0 where masked
    total = exp.sum(axis=-1, keepdims=True)
    return exp / jnp.where(total > 0, total, 1.0)                       # fully masked row -> zeros


class _Linear(nnx.Linear):
    """``nnx.Linear`` whose output is rounded once to the low one of its ``dtype`` and ``param_dtype`` (computed
    wide before)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:  # type: ignore[override]  # without out_sharding (unused)
        return narrow(super().__call__(inputs), rounding(self.dtype, self.param_dtype))


def _linear(in_features: int, out_features: int, dtype: DTypeLike, rngs: nnx.Rngs,
            param_dtype: DTypeLike | None = None) -> _Linear:
    """y = x @ W + b with ``kernel`` W stored (in, out), the checkpoint's layout; in a low precision computed
    wide and rounded once to P. Under the autocast recipe (``dtype`` P, ``param_dtype`` float32) Flax's own
    promotion rounds x, W and b to P (``nnx.Linear.__call__``: ``promote_dtype`` to ``dtype``), the product is
    accumulated in float32 (``preferred_element_type``), the bias added to it, and the result rounded once to P;
    ``nnx.Linear`` alone would return the product in P and add the bias in P, a second rounding
    (flax/nnx/nn/linear.py). Shape: (..., in) -> (..., out)."""
    mixed = autocast_dtype(dtype, param_dtype)
    if mixed is not None:
        return _Linear(in_features, out_features, dtype=mixed, param_dtype=jnp.float32,
                       preferred_element_type=jnp.float32, precision=_PRECISION, rngs=rngs)
    return _Linear(in_features, out_features, dtype=computation(dtype), param_dtype=dtype, precision=_PRECISION,
                   rngs=rngs)


def _returned(out: Any, *optional: Any) -> Any:
    """What a call returns: ``out`` alone, or ``(out, *results)`` with each optional result that was asked for
    (None: not asked), in the order the docstring names them (the cache last)."""
    asked = tuple(result for result in optional if result is not None)
    return (out, *asked) if asked else out


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)  -- section 3.2.2.

    The h heads are split head-major: head i owns columns i*d_k .. (i+1)*d_k - 1 of the
    projections W^Q, W^K, W^V (and rows of W^O). Every projection has a bias.

    With a ``cache`` (:class:`.incremental.KVCache`, incremental decoding) and no ``cache_index``, the queries
    attend over the cached keys and values (encoder-decoder attention over the projected memory;
    ``key`` and ``value`` are not projected again). With a ``cache_index`` too, ``key`` and
    ``value`` are the new positions: their projections are written into the cache at positions
    cache_index .. cache_index + Tk - 1 (``lax.dynamic_update_slice_in_dim``: a new cache, the
    given one is left as it was; ``cache_index`` may be traced) and the queries attend over the C positions
    through ``mask``; without a ``mask``, causally (query q sees positions j <= cache_index + q), reading only
    the first W positions of the cache (``attended_width``; at a traced ``cache_index``, ``lax.switch``
    over one branch per width of ``attended_widths``).

    Shape:
        query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk or C).
        Returns (B, Tq, D); with ``return_weights`` also the weights (B, H, Tq, Tk or C); with a
        ``cache`` also the cache, last: ``(out, cache)`` or ``(out, weights, cache)``.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.n_heads = config.n_heads
        self.q_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.k_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.v_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.o_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                 return_weights: bool = False, cache: KVCache | None = None,
                 cache_index: int | jax.Array | None = None) -> Any:
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k, v, cache = self._keys_values(key, value, cache, cache_index)    # (B, H, Tk or C, d_k)
        dtype = autocast_dtype(self.q_proj.dtype, self.q_proj.param_dtype)
        if cache is not None and cache_index is not None and mask is None:    # causal, over the written positions
            heads, weights = _attend_written(scaled_dot_product_attention, q, k, v, _beam_table(cache), cache_index,
                                             return_weights, dtype)
        else:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, _beam_table(cache),   # (B, H, Tq, d_k)
                                                          dtype=dtype)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)    # (B, Tq, D)
        out = self.o_proj(concat)
        return _returned(out, weights if return_weights else None, cache)

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty self-attention cache of ``capacity`` positions in the dtype of the projections it holds: the
        model's, or P under the autocast recipe (``dtype=P, param_dtype=float32``).

        Shape: keys, values (B, H, C, d_k), zeros.
        """
        d_k = self.q_proj.out_features // self.n_heads
        dtype = rounding(self.k_proj.dtype, self.k_proj.param_dtype)       # the projections' P, or the model's
        empty = jnp.zeros((batch, self.n_heads, capacity, d_k), dtype)      # (B, H, C, d_k)
        return KVCache(empty, empty)

    def memory_cache(self, memory: jax.Array) -> KVCache:
        """The encoder-decoder attention cache: the memory projected by W^K and W^V once.

        Shape: memory (B, S, D) -> keys, values (B, H, S, d_k).
        """
        return KVCache(self._split_heads(self.k_proj(memory)), self._split_heads(self.v_proj(memory)))

    def _keys_values(self, key: jax.Array, value: jax.Array, cache: KVCache | None,
                     cache_index: int | jax.Array | None) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """The keys and values to attend over and the cache to return (see the class docstring)."""
        if cache is not None and cache_index is None:
            return cache.keys, cache.values, cache                         # (B, H, S, d_k)
        k = self._split_heads(self.k_proj(key))                            # (B, H, Tk, d_k)
        v = self._split_heads(self.v_proj(value))                          # (B, H, Tk, d_k)
        if cache is None or cache_index is None:                           # (cache_index None: cache is None too)
            return k, v, None
        cache = cache.update(k, v, cache_index)
        return cache.keys, cache.values, cache                             # (B, H, C, d_k)

    def _split_heads(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)
        return x.transpose(0, 2, 1, 3)                                     # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

def activation(x: jax.Array, name: str) -> jax.Array:
    """The feed-forward network's nonlinearity, ``config.activation`` (the reference's
    :func:`~reference_numpy.model.activation`): ``relu`` max(0, x) (Eq. (2)); ``silu`` and ``gelu`` from
    :mod:`.variants`. ReLU of a P number is exact; the others are computed wide and rounded once to P.

    Shape: (...) -> (...).
    """
    if name == "relu":
        return jnp.maximum(x, 0)
    if name in ACTIVATIONS:
        return narrow(ACTIVATIONS[name](wide(x)), x.dtype)
    raise ValueError(f"activation must be one of ('relu', 'silu', 'gelu'), got {name!r}")


class PositionwiseFeedForward(nnx.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, act = max(0, .) in the paper -- Eq. (2), section 3.3; ``act`` is
    :func:`activation` of ``config.activation``.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer is (B, T, F).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.linear1 = _linear(config.d_model, config.d_ff, dtype, rngs, param_dtype)
        self.linear2 = _linear(config.d_ff, config.d_model, dtype, rngs, param_dtype)
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(activation(self.linear1(x), self.activation))


class LayerNorm(nnx.LayerNorm):
    """Layer normalization (Ba et al., 2016) used around every sublayer (section 3.1).

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance over the last
    axis and eps added to the variance; eps is ``config.layer_norm_eps`` (never Flax's default).
    ``use_fast_variance=False`` computes var = mean((x - mean)^2) like the reference instead of
    the one-pass E[x^2] - E[x]^2, which loses digits. Flax names the weight ``scale``. In a low
    precision the statistics, the normalization, gain and bias are computed wide (Flax's ``dtype``
    float32) and the output rounded to P. Under the autocast recipe (``dtype=P, param_dtype=float32``) it is
    float32 throughout, as torch's autocast list has it (Flax's own ``nnx.LayerNorm`` would return its ``dtype``,
    ``_normalize`` in flax/nnx/nn/normalization.py). A variance past the format's largest number gives NaN, as in
    the reference (Flax would give the bias).

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        dtype = storage(dtype, param_dtype)                                 # float32 under autocast
        super().__init__(config.d_model, epsilon=config.layer_norm_eps, use_fast_variance=False,
                         dtype=computation(dtype), param_dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # type: ignore[override]  # the reference's call: no mask
        overflow = jnp.isinf(jnp.var(wide(x), axis=-1, keepdims=True))          # (..., 1)
        return narrow(jnp.where(overflow, jnp.nan, super().__call__(x)), self.param_dtype)


def residual(x: jax.Array, sublayer: Callable[[jax.Array], jax.Array], norm: LayerNorm,
             norm_first: bool, dropout: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Residual connection around a sublayer (section 3.1), with dropout on the sublayer's
    output before the addition (section 5.4).

    Post-LN (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN: x + Dropout(Sublayer(LayerNorm(x))). The addition is the model's own arithmetic: in a
    low precision, the residual stream stays in P.

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return add(x, dropout(sublayer(norm(x))))
    return norm(add(x, dropout(sublayer(x))))


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y in x's precision: in a low precision P, the float32 sum rounded to P (P arithmetic)."""
    return narrow(wide(x) + wide(y), x.dtype)


def _dropout(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    """Dropout with P_drop = config.dropout (section 5.4), off (deterministic) unless asked for."""
    return nnx.Dropout(config.dropout, deterministic=True, rngs=rngs)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype: DTypeLike = jnp.float64,
                                   layout: str = "interleaved", pad_id: int = 0) -> jax.Array:
    """The fixed sinusoidal table of ``layout`` (``config.sinusoidal_layout``): ``interleaved`` -- section 3.5,
    PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)), sine and cosine
    **interleaved** (even columns sin, odd columns cos); ``halves`` (Marian) and ``fairseq`` (M2M100/NLLB, (L + 1, D),
    row 0 zeros) as the reference's :func:`~reference_numpy.model.sinusoidal_positional_encoding` defines them.

    The table is a constant: it is computed once on the host in float64 by the reference's
    formula and rounded to ``dtype`` by the reference (in one step, also for bfloat16, whose
    casts from float64 round twice), so every model holds the correctly rounded table.

    Shape: returns (L, D), or (L + 1, D) for ``fairseq``.
    """
    return jnp.asarray(reference.sinusoidal_positional_encoding(length, d_model, dtype, layout, pad_id), dtype=dtype)


class Embeddings(nnx.Embed):
    """Token embedding multiplied by sqrt(d_model) (section 3.4) when ``config.scale_embeddings`` (else by 1); Flax
    names the weight ``embedding``.
    In a low precision the product is computed in float32 (Flax's ``dtype``) and rounded to P; under the autocast
    recipe it is float32 (torch's autocast runs an embedding in its weight's dtype; ``nnx.Embed`` would return
    ``dtype``).

    Shape: tokens (B, T) int -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        dtype = storage(dtype, param_dtype)                                 # float32 under autocast
        super().__init__(vocab_size, config.d_model, dtype=computation(dtype), param_dtype=dtype, rngs=rngs)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0

    def __call__(self, tokens: jax.Array) -> jax.Array:  # type: ignore[override]  # the reference's call: tokens
        return narrow(super().__call__(tokens) * self.scale, self.param_dtype)


class _Constant(nnx.Variable):
    """A fixed array that is part of the model state but never trained (the sinusoidal table)."""


class PositionalEncoding(nnx.Module):
    """Adds position information to the embeddings (section 3.5), then dropout (section 5.4:
    "to the sums of the embeddings and the positional encodings").

    ``sinusoidal``: the fixed ``table`` of :func:`sinusoidal_positional_encoding` in ``config.sinusoidal_layout``
    (a constant, not a parameter); ``learned``: a trained (L, D) ``weight`` (Table 3, row E), an ``nnx.Param``.
    Position t of ``x`` reads row ``offset`` + t, except in the ``fairseq`` layout, where it reads row
    :func:`position_ids` of ``tokens`` (counted ``by_step`` for the decoder's; None: no pad among them, rows
    ``offset`` + 1 .. ``offset`` + T).

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; ``offset`` may be traced; tokens (B, T) or None.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        dtype = storage(dtype, param_dtype)                                 # float32 under autocast
        self.learned = config.positional_encoding == "learned"
        self.fairseq_pad_id = config.pad_id if config.sinusoidal_layout == "fairseq" else None
        if self.learned:
            init = nnx.initializers.normal(config.d_model ** -0.5)
            self.weight = nnx.Param(init(rngs.params(), (config.max_len, config.d_model), dtype))  # (L, D)
        else:
            self.table = _Constant(sinusoidal_positional_encoding(config.max_len, config.d_model, dtype,
                                                                  config.sinusoidal_layout, config.pad_id))  # (L, D)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, offset: int | jax.Array = 0, tokens: jax.Array | None = None,
                 by_step: bool = False, *, deterministic: bool | None = None) -> jax.Array:
        table = self.weight if self.learned else self.table
        if self.fairseq_pad_id is None or tokens is None:
            start = offset if self.fairseq_pad_id is None else offset + 1
            positions = lax.dynamic_slice_in_dim(table[...], start, x.shape[1], axis=0)   # (T, D)
            return self.dropout(add(x, positions), deterministic=deterministic)
        return self.dropout(add(x, table[...][position_ids(tokens, self.fairseq_pad_id, offset, by_step)]),
                            deterministic=deterministic)                                  # (B, T, D)


class Generator(nnx.Module):
    """Pre-softmax linear transformation and log-softmax (section 3.4): no bias (the paper), or with
    ``config.output_bias`` a ``bias`` (V,) (Marian's ``final_logits_bias``).

    ``weight`` is (D, V) like the checkpoint. With ``share_embeddings`` pass the shared
    :class:`Embeddings` as ``embeddings``: its transposed matrix is the projection (tied, not
    copied) and the generator has no parameter of its own. In a low precision P the logits are a
    linear map's (computed wide, rounded to P) and their log-softmax is float32; under the autocast recipe
    (``dtype=P, param_dtype=float32``) a product of the P-rounded x and W, rounded to P.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, embeddings: Embeddings | None = None, *, dtype: DTypeLike,
                 rngs: nnx.Rngs, param_dtype: DTypeLike | None = None):
        if config.share_embeddings and embeddings is None:
            raise ValueError("a Generator with share_embeddings needs the shared Embeddings (embeddings=)")
        self.embeddings = embeddings
        if embeddings is None:
            init = nnx.initializers.xavier_uniform()
            self.weight = nnx.Param(init(rngs.params(), (config.d_model, config.tgt_vocab_size),
                                         storage(dtype, param_dtype)))   # (D, V)
        self.bias = nnx.Param(jnp.zeros((config.tgt_vocab_size,), storage(dtype, param_dtype))) \
            if config.output_bias else None                             # (V,)
        self.mixed = autocast_dtype(dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...] if self.embeddings is None else self.embeddings.embedding[...].T  # (D, V)
        dtype = weight.dtype if self.mixed is None else self.mixed      # autocast: x, W and b rounded to P
        logits = jnp.matmul(wide(narrow(x, dtype)), wide(narrow(weight, dtype)), precision=_PRECISION)
        if self.bias is not None:
            logits = logits + wide(narrow(self.bias[...], dtype))
        logits = narrow(logits, dtype)                                  # (B, T, V)
        return log_softmax(wide(logits))


def log_softmax(x: jax.Array) -> jax.Array:
    """log softmax over the last axis (section 3.4), max-shifted: ``s - log(sum(exp(s)))``, ``s = x - max(x)``;
    the row sums are :func:`.speed.sum_exp`'s (by chunks, faster under XLA:CPU).

    Shape: (..., V) -> (..., V).
    """
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(speed.sum_exp(shifted))


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each wrapped in :func:`residual` (section 3.1).

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.self_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.ffn = PositionwiseFeedForward(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.ffn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *,
                 deterministic: bool | None = None) -> jax.Array:
        drop = functools.partial(self.dropout, deterministic=deterministic)
        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, drop)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)


class DecoderLayer(nnx.Module):
    """Masked self-attention, encoder-decoder attention (queries from the decoder, keys and
    values from the encoder output), then feed-forward; each wrapped in :func:`residual`
    (sections 3.1 and 3.2.3).

    With a ``cache`` -- the pair (self-attention, encoder-decoder attention) of :meth:`init_cache`
    -- ``x`` holds the new positions at ``cache_index`` .. (see :class:`MultiHeadAttention`) and
    the result is ``(x, cache)``, the pair updated.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S),
    tgt_mask broadcastable to (B, H, T, T) (T, C with a cache) -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.self_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.cross_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.cross_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.ffn = PositionwiseFeedForward(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.ffn_norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, cache: tuple[KVCache, KVCache] | None = None,
                 cache_index: int | jax.Array | None = None, *, deterministic: bool | None = None) -> Any:
        self_cache, cross_cache = (None, None) if cache is None else cache
        drop = functools.partial(self.dropout, deterministic=deterministic)
        x, self_cache = _cached_residual(x, lambda h: _attend(self.self_attn, h, h, tgt_mask, self_cache, cache_index),
                                         self.self_attn_norm, self.norm_first, drop)
        x, cross_cache = _cached_residual(x, lambda h: _attend(self.cross_attn, h, memory, src_mask, cross_cache, None),
                                          self.cross_attn_norm, self.norm_first, drop)
        x = residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)
        return x if cache is None else (x, (self_cache, cross_cache))

    def init_cache(self, memory: jax.Array, capacity: int) -> tuple[KVCache, KVCache]:
        """An empty self-attention cache of ``capacity`` positions and the memory's projected keys/values.

        Shape: memory (B, S, D) -> (keys/values (B, H, C, d_k), keys/values (B, H, S, d_k)).
        """
        return self.self_attn.init_cache(memory.shape[0], capacity), self.cross_attn.memory_cache(memory)


def _attend(attention: MultiHeadAttention, query: jax.Array, memory: jax.Array, mask: jax.Array | None,
            cache: KVCache | None, cache_index: int | jax.Array | None) -> tuple[jax.Array, KVCache | None]:
    """``(out, cache)``: ``attention`` of ``query`` over ``memory`` (keys and values) and the cache it returns
    (None without a cache)."""
    if cache is None:
        return attention(query, memory, memory, mask), None
    return attention(query, memory, memory, mask, cache=cache, cache_index=cache_index)


def _cached_residual(x: jax.Array, sublayer: Callable[[jax.Array], tuple[jax.Array, KVCache | None]],
                     norm: LayerNorm, norm_first: bool,
                     dropout: Callable[[jax.Array], jax.Array]) -> tuple[jax.Array, KVCache | None]:
    """:func:`residual` around an attention sublayer that returns ``(out, cache)`` (incremental decoding):
    ``(the residual connection's output, the cache)``, both as values."""
    if norm_first:
        out, cache = sublayer(norm(x))
        return add(x, dropout(out)), cache
    out, cache = sublayer(x)
    return norm(add(x, dropout(out))), cache


class Encoder(nnx.Module):
    """A stack of N encoder layers (section 3.1); pre-LN adds a final LayerNorm.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.layers = nnx.List([EncoderLayer(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
                                for _ in range(config.n_encoder_layers)])
        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype) if config.norm_first else None

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool | None = None) -> jax.Array:
        for layer in self.layers:
            x = layer(x, mask, deterministic=deterministic)
        return self.norm(x) if self.norm is not None else x


class Decoder(nnx.Module):
    """A stack of N decoder layers (section 3.1); pre-LN adds a final LayerNorm.

    ``cache``, for incremental decoding, holds one cache pair per layer (:meth:`init_cache`,
    see :class:`DecoderLayer`). The call returns ``x``, with a ``cache`` ``(x, cache)``.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
                                for _ in range(config.n_decoder_layers)])
        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype) if config.norm_first else None

    def __call__(self, x: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, cache: tuple[tuple[KVCache, KVCache], ...] | None = None,
                 cache_index: int | jax.Array | None = None, *, deterministic: bool | None = None) -> Any:
        kept = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, src_mask, tgt_mask, deterministic=deterministic)
            else:
                x, layer_cache = layer(x, memory, src_mask, tgt_mask, cache[i], cache_index,
                                       deterministic=deterministic)
                kept.append(layer_cache)
        x = self.norm(x) if self.norm is not None else x
        return x if cache is None else (x, tuple(kept))

    def init_cache(self, memory: jax.Array, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """One :meth:`DecoderLayer.init_cache` pair per layer."""
        return tuple(layer.init_cache(memory, capacity) for layer in self.layers)


def _check_param_dtype(dtype: np.dtype, param_dtype: DTypeLike) -> np.dtype:
    """``param_dtype`` beside the computation ``dtype``: ``dtype`` itself, or float32 beside bfloat16 or float16 (the
    autocast recipe); anything else is one ValueError naming ``param_dtype``."""
    parsed = _check_dtype(param_dtype)
    if parsed != dtype and not (parsed == np.float32 and autocast_dtype(dtype, parsed) is not None):
        raise ValueError(f"param_dtype must be the dtype ({dtype.name}) or float32 beside a bfloat16 or float16 "
                         f"dtype (mixed precision), got {parsed.name}")
    return parsed


# ----------------------------------------------------------------------------- the model

class Transformer(nnx.Module):
    """The encoder-decoder Transformer (section 3, Figure 1).

    ``dtype`` (float64 by default, like the reference, or float32) is the dtype of every
    parameter and of the computation; float64 needs ``jax_enable_x64`` and is refused with a
    ``ValueError`` otherwise. Flax's mixed precision, ``dtype=jnp.bfloat16`` (or float16) with
    ``param_dtype=jnp.float32``, runs the autocast recipe of ``reference_numpy/precision.py``: float32 parameters,
    embeddings, residual stream, LayerNorms and log-probabilities, every linear map and attention product in P, the
    key/value caches in P; any other ``param_dtype`` than ``dtype`` or float32 is refused. A low precision alone,
    bfloat16 or float16, stores the parameters, the activations and the key/value caches in P and computes by the
    recipe of
    ``reference_numpy/precision.py`` (each concept in float32, rounded once to P; log-probabilities
    float32). Weights are random (``rngs``) until loaded with
    :func:`transformer_jax.checkpoint.from_params` or ``load_checkpoint``. With
    ``share_embeddings`` one ``Embeddings`` module is ``src_embed``, ``tgt_embed`` and
    ``generator.embeddings``.

    Shape:
        src (B, S) int, tgt (B, T) int: the target shifted right (starting with bos_id).
        src_mask broadcastable to (B, H, T or S, S), default :func:`padding_mask` of src;
        tgt_mask broadcastable to (B, H, T, T), default :func:`target_mask` of tgt.
        Returns log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike = jnp.float64, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.config = config
        self.dtype = _check_dtype(dtype)
        self.param_dtype = self.dtype if param_dtype is None else _check_param_dtype(self.dtype, param_dtype)
        kw: dict[str, Any] = {"dtype": self.dtype, "rngs": rngs, "param_dtype": self.param_dtype}
        self.src_embed = Embeddings(config, config.src_vocab_size, **kw)
        self.tgt_embed = self.src_embed if config.share_embeddings \
            else Embeddings(config, config.tgt_vocab_size, **kw)
        self.src_pos = PositionalEncoding(config, **kw)
        self.tgt_pos = PositionalEncoding(config, **kw)
        self.encoder = Encoder(config, **kw)
        self.decoder = Decoder(config, **kw)
        self.generator = Generator(config, self.src_embed if config.share_embeddings else None, **kw)

    def encode(self, src: jax.Array, src_mask: jax.Array | None = None, *,
               deterministic: bool | None = None) -> jax.Array:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        (batch, length), heads = src.shape, self.config.n_heads
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, length))
        x = self.src_pos(self.src_embed(src), 0, src, deterministic=deterministic)
        return self.encoder(x, src_mask, deterministic=deterministic)

    def init_cache(self, memory: jax.Array, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """The decoder's caches for ``capacity`` target positions: per layer, an empty self-attention
        :class:`.incremental.KVCache` and the memory's projected keys and values (section 3.2.3).

        Shape: memory (B, S, D) -> per layer keys and values (B, H, C, d_k) and (B, H, S, d_k).
        """
        memory = checked_memory(memory, None, self.config.d_model, self.param_dtype.name)
        checks.check_cache_capacity(capacity, self.config.max_len)
        return self.decoder.init_cache(memory, capacity)

    def decode(self, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
               tgt_mask: jax.Array | None = None, cache: tuple[tuple[KVCache, KVCache], ...] | None = None,
               cache_index: int | jax.Array | None = None, *, deterministic: bool | None = None) -> Any:
        """Embed the shifted target and run the decoder stack.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D). ``src_mask`` is required when the
        source had padding (the decoder cannot see source tokens).

        With a ``cache`` (:meth:`init_cache`), ``tgt`` holds only the new positions
        cache_index .. cache_index + T - 1 (their positional encodings are those positions'; a
        traced ``cache_index`` is the compiled loop's to bound), the earlier ones being in the
        cache; ``tgt_mask`` is then broadcastable to (B, H, T, C) over the cache's C positions and
        defaults to the causal mask over absolute positions (query q sees key j <= cache_index + q,
        which also hides the positions not yet written).
        Returns ``(out, cache)``.
        """
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        memory = checked_memory(memory, tgt.shape[0], self.config.d_model, self.param_dtype.name)
        (batch, length), heads = tgt.shape, self.config.n_heads
        keys = length if cache is None else cache[0][0].keys.shape[2]            # T, or the capacity C
        offset: int | jax.Array = 0                                              # the position of tgt[:, 0]
        if cache is not None:
            offset = check_cache_index(cache_index, length, keys)
            for own, _ in cache:                                               # every table, before any layer runs
                _beam_table(own)
        if src_mask is not None:
            src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, memory.shape[1]))
        if tgt_mask is None and cache is None:
            tgt_mask = target_mask(tgt, self.config.pad_id)
        if tgt_mask is not None:           # with a cache and none given, each self-attention's causal mask over W
            tgt_mask = checked_mask("tgt_mask", tgt_mask, (batch, heads, length, keys))
        y = self.tgt_pos(self.tgt_embed(tgt), offset, tgt, by_step=True, deterministic=deterministic)
        return self.decoder(y, memory, src_mask, tgt_mask, cache=cache, cache_index=cache_index,
                            deterministic=deterministic)

    def __call__(self, src: jax.Array, tgt: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, *, deterministic: bool | None = None) -> jax.Array:
        """Log-probabilities of the next target token at every target position."""
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask, deterministic=deterministic)
        return self.generator(self.decode(tgt, memory, src_mask, tgt_mask, deterministic=deterministic))

    def _check_inputs(self, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: npt.ArrayLike | None,
                      tgt_mask: npt.ArrayLike | None) -> tuple[jax.Array, jax.Array]:
        """Every check of the forward pass, made before any computation (the reference's
        :func:`~reference_numpy.checks.check_forward_inputs`)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        checks.check_forward_inputs(self.config, src.shape, tgt.shape, describe("src_mask", src_mask),
                                    describe("tgt_mask", tgt_mask))
        return src, tgt

    def _check_tokens(self, name: str, tokens: npt.ArrayLike, vocab_size: int) -> jax.Array:
        """The reference's token checks (:func:`.checks.check_tokens`: the id range only on concrete, untraced
        arrays, which is why public entry points check before compiled code)."""
        return check_tokens(name, tokens, vocab_size, self.config.max_len)
