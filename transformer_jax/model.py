"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX with Flax NNX.

A parallel text of ``reference_numpy/model.py``: the same pieces, names, argument order and
shape comments; only framework idiom differs. Parameters are created with explicit ``rngs``
and loaded from the shared checkpoint by :mod:`.checkpoint`; ``dtype`` is both the parameter
and the computation dtype (float64 needs ``jax_enable_x64``, see :mod:`.device`). Dropout
(section 5.4) is applied to every sublayer output before the residual add and to the sums of
embeddings and positional encodings; it is off unless ``deterministic=False`` is passed (or set
with ``nnx.view(model, deterministic=False)``). Every matmul runs at ``device.PRECISION``.

Shape legend used in every docstring:
    B: batch size          H: number of heads h        D: d_model
    S: source length       T: target length            d_k: D / H
    Tq, Tk: query and key lengths                      F: d_ff
    V: vocabulary size     L: number of positions (config.max_len)
    M: cache length (the decoding budget, fixed when the cache is created)

Masks are boolean and **True means "may attend"**, broadcastable to (B, H, Tq, Tk).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from reference_numpy import model as reference
from reference_numpy.config import TransformerConfig

from .device import PRECISION, check_dtype


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: jax.Array, pad_id: int) -> jax.Array:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return (jnp.asarray(tokens) != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """Position i may attend to positions j <= i (decoder self-attention, section 3.2.3).

    Shape: mask (1, 1, T, T), bool, True = may attend.
    """
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def target_mask(tgt: jax.Array, pad_id: int) -> jax.Array:
    """Causal mask combined with the target's padding mask.

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    return padding_mask(tgt, pad_id) & causal_mask(jnp.shape(tgt)[1])


# ----------------------------------------------------------------------------- attention

def scaled_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                                 mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  -- Eq. (1), section 3.2.1.

    Written out rather than taken from ``jax.nn.dot_product_attention`` or Flax: those give a
    query row whose mask has no True entry the uniform average of the values; here its weights
    are all zero and its output is zero (never NaN), as in the reference. The row maximum is
    held constant for gradients (it cancels mathematically), so fully masked rows have finite
    gradients too.

    Shape:
        query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v),
        mask broadcastable to (..., Tq, Tk), bool, True = may attend.
        Returns output (..., Tq, d_v) and weights (..., Tq, Tk).
    """
    d_k = query.shape[-1]
    scores = jnp.matmul(query, jnp.swapaxes(key, -1, -2), precision=PRECISION) / math.sqrt(d_k)  # (..., Tq, Tk)
    if mask is not None:
        mask = _check_mask(mask, scores.shape)
        scores = jnp.where(mask, scores, -jnp.inf)
    row_max = lax.stop_gradient(scores.max(axis=-1, keepdims=True))   # -inf on fully masked rows
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp(scores - row_max)                                     # exactly 0 where masked
    total = exp.sum(axis=-1, keepdims=True)
    weights = exp / jnp.where(total > 0, total, 1.0)                    # fully masked row -> zeros
    return jnp.matmul(weights, value, precision=PRECISION), weights


def _check_mask(mask, scores_shape: tuple[int, ...], name: str = "mask") -> jax.Array:
    reference.check_mask(name, *_describe(name, mask), tuple(scores_shape))
    return jnp.asarray(mask)


def _describe(name: str, value) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional array argument (traced or not), for the reference's input checks."""
    if value is None:
        return None
    if not isinstance(value, jax.Array):
        value = reference.as_array(name, value)
    return tuple(value.shape), value.dtype.name


def _linear(in_features: int, out_features: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """y = x @ W + b with ``kernel`` W stored (in, out), the checkpoint's layout. Shape: (..., in) -> (..., out)."""
    return nnx.Linear(in_features, out_features, dtype=dtype, param_dtype=dtype, precision=PRECISION,
                      rngs=rngs)


class KVCache(NamedTuple):
    """Keys and values of one decoder layer during decoding (fixed sizes, so the loop compiles once).

    Shape: key, value (B, H, M, d_k): self-attention, filled up to the current position;
    memory_key, memory_value (B, H, S, d_k): cross-attention, projected once from the memory.
    """

    key: jax.Array
    value: jax.Array
    memory_key: jax.Array
    memory_value: jax.Array


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)  -- section 3.2.2.

    The h heads are split head-major: head i owns columns i*d_k .. (i+1)*d_k - 1 of the
    projections W^Q, W^K, W^V (and rows of W^O). Every projection has a bias.
    :meth:`project_key_value` and :meth:`attend` are the two halves of ``__call__``, used
    separately by cached decoding.

    Shape:
        query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk).
        Returns (B, Tq, D); with ``return_weights`` also the weights (B, H, Tq, Tk).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.n_heads = config.n_heads
        self.q_proj = _linear(config.d_model, config.d_model, dtype, rngs)
        self.k_proj = _linear(config.d_model, config.d_model, dtype, rngs)
        self.v_proj = _linear(config.d_model, config.d_model, dtype, rngs)
        self.o_proj = _linear(config.d_model, config.d_model, dtype, rngs)

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array,
                 mask: jax.Array | None = None, return_weights: bool = False):
        out, weights = self.attend(query, *self.project_key_value(key, value), mask)
        return (out, weights) if return_weights else out

    def project_key_value(self, key: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K W^K and V W^V split into heads. Shape: key, value (B, Tk, D) -> two (B, H, Tk, d_k)."""
        k = self._split_heads(self.k_proj(key))                            # (B, H, Tk, d_k)
        v = self._split_heads(self.v_proj(value))                          # (B, H, Tk, d_k)
        return k, v

    def attend(self, query: jax.Array, k: jax.Array, v: jax.Array,
               mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Project the queries, attend to projected keys/values, concatenate the heads, apply W^O.

        Shape: query (B, Tq, D), k and v (B, H, Tk, d_k) -> (B, Tq, D) and weights (B, H, Tq, Tk).
        """
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        heads, weights = scaled_dot_product_attention(q, k, v, mask)       # (B, H, Tq, d_k)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)    # (B, Tq, D)
        return self.o_proj(concat), weights

    def _split_heads(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)
        return x.transpose(0, 2, 1, 3)                                     # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

class PositionwiseFeedForward(nnx.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2  -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer is (B, T, F).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.linear1 = _linear(config.d_model, config.d_ff, dtype, rngs)
        self.linear2 = _linear(config.d_ff, config.d_model, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(jnp.maximum(self.linear1(x), 0))


class LayerNorm(nnx.LayerNorm):
    """Layer normalization (Ba et al., 2016) used around every sublayer (section 3.1).

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance over the last
    axis and eps added to the variance; eps is ``config.layer_norm_eps`` (never Flax's default).
    ``use_fast_variance=False`` computes var = mean((x - mean)^2) like the reference instead of
    the one-pass E[x^2] - E[x]^2, which loses digits. Flax names the weight ``scale``.

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        super().__init__(config.d_model, epsilon=config.layer_norm_eps, use_fast_variance=False,
                         dtype=dtype, param_dtype=dtype, rngs=rngs)


def residual(x: jax.Array, sublayer: Callable[[jax.Array], jax.Array], norm: LayerNorm,
             norm_first: bool, dropout: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Residual connection around a sublayer (section 3.1), with dropout on the sublayer's
    output before the addition (section 5.4).

    Post-LN (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN: x + Dropout(Sublayer(LayerNorm(x))).

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


def _dropout(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.Dropout:
    """Dropout with P_drop = config.dropout (section 5.4), off (deterministic) unless asked for."""
    return nnx.Dropout(config.dropout, deterministic=True, rngs=rngs)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype=jnp.float64) -> jax.Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))
    -- section 3.5. Sine and cosine are **interleaved** (even columns sin, odd columns cos).

    The table is a constant: it is computed once on the host in float64 by the reference's
    formula and then cast to ``dtype``, so a float32 model holds the correctly rounded table.

    Shape: returns (L, D).
    """
    return jnp.asarray(reference.sinusoidal_positional_encoding(length, d_model), dtype=dtype)


class Embeddings(nnx.Embed):
    """Token embedding multiplied by sqrt(d_model) (section 3.4); Flax names the weight ``embedding``.

    Shape: tokens (B, T) int -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, *, dtype, rngs: nnx.Rngs):
        super().__init__(vocab_size, config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.scale = math.sqrt(config.d_model)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return super().__call__(tokens) * self.scale


class Constant(nnx.Variable):
    """A fixed array that is part of the model state but never trained (the sinusoidal table)."""


class PositionalEncoding(nnx.Module):
    """Adds position information to the embeddings (section 3.5).

    ``sinusoidal``: the fixed table of :func:`sinusoidal_positional_encoding` (a ``Constant``);
    ``learned``: a trained (L, D) table (Table 3, row E), an ``nnx.Param``.

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; ``offset`` may be traced.
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        if config.positional_encoding == "learned":
            init = nnx.initializers.normal(config.d_model ** -0.5)
            self.table = nnx.Param(init(rngs.params(), (config.max_len, config.d_model), dtype))  # (L, D)
        else:
            self.table = Constant(sinusoidal_positional_encoding(config.max_len, config.d_model, dtype))

    def __call__(self, x: jax.Array, offset: int | jax.Array = 0) -> jax.Array:
        return x + lax.dynamic_slice_in_dim(self.table[...], offset, x.shape[1], axis=0)


class Generator(nnx.Module):
    """Pre-softmax linear transformation and log-softmax (section 3.4); no bias.

    With ``share_embeddings`` its weight is the transposed shared embedding matrix: ``embed``
    is then the model's (one) ``Embeddings`` module.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs,
                 embed: Embeddings | None = None):
        self.embed = embed
        if embed is None:
            init = nnx.initializers.xavier_uniform()
            self.weight = nnx.Param(init(rngs.params(), (config.d_model, config.tgt_vocab_size), dtype))  # (D, V)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...] if self.embed is None else self.embed.embedding[...].T  # (D, V)
        return jax.nn.log_softmax(jnp.matmul(x, weight, precision=PRECISION), axis=-1)


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each wrapped in :func:`residual` (section 3.1).

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs)
        self.ffn = PositionwiseFeedForward(config, dtype=dtype, rngs=rngs)
        self.ffn_norm = LayerNorm(config, dtype=dtype, rngs=rngs)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, *,
                 deterministic: bool | None = None) -> jax.Array:
        drop = functools.partial(self.dropout, deterministic=deterministic)
        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, drop)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)


class DecoderLayer(nnx.Module):
    """Masked self-attention, encoder-decoder attention (queries from the decoder, keys and
    values from the encoder output), then feed-forward; each wrapped in :func:`residual`
    (sections 3.1 and 3.2.3). :meth:`step` is the same layer for one new position with a
    key/value cache.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S),
    tgt_mask broadcastable to (B, H, T, T) -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.self_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs)
        self.cross_attn = MultiHeadAttention(config, dtype=dtype, rngs=rngs)
        self.cross_attn_norm = LayerNorm(config, dtype=dtype, rngs=rngs)
        self.ffn = PositionwiseFeedForward(config, dtype=dtype, rngs=rngs)
        self.ffn_norm = LayerNorm(config, dtype=dtype, rngs=rngs)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, *, deterministic: bool | None = None) -> jax.Array:
        return self._sublayers(x, lambda h: self.self_attn(h, h, h, tgt_mask),
                               lambda h: self.cross_attn(h, memory, memory, src_mask), deterministic)

    def init_cache(self, memory: jax.Array, max_steps: int) -> KVCache:
        """An empty self-attention cache of M = ``max_steps`` positions and the memory's keys/values.

        Shape: memory (B, S, D) -> KVCache with key, value (B, H, M, d_k), memory_* (B, H, S, d_k).
        """
        memory_key, memory_value = self.cross_attn.project_key_value(memory, memory)  # (B, H, S, d_k)
        batch, heads, _, d_k = memory_key.shape
        empty = jnp.zeros((batch, heads, max_steps, d_k), memory_key.dtype)      # (B, H, M, d_k)
        return KVCache(empty, empty, memory_key, memory_value)

    def step(self, x: jax.Array, cache: KVCache, index: int | jax.Array, src_mask: jax.Array | None = None,
             *, deterministic: bool | None = None) -> tuple[jax.Array, KVCache]:
        """The layer at position ``index`` only: its key/value are written into the cache with
        ``lax.dynamic_update_slice_in_dim`` and it attends to the filled positions 0..index (the
        causal mask of the full layer), and to the memory through the cached projections.

        Shape: x (B, 1, D), cache as :meth:`init_cache` -> (B, 1, D) and the updated cache.
        A concrete ``index`` outside the cache is refused (a traced one is the caller's to bound).
        """
        if isinstance(index, int) and not 0 <= index < cache.key.shape[2]:
            raise ValueError(f"index {index} is outside the key/value cache of {cache.key.shape[2]} positions")
        written = {}

        def self_attention(h: jax.Array) -> jax.Array:
            k, v = self.self_attn.project_key_value(h, h)                      # (B, H, 1, d_k)
            written["key"] = lax.dynamic_update_slice_in_dim(cache.key, k, index, axis=2)  # (B, H, M, d_k)
            written["value"] = lax.dynamic_update_slice_in_dim(cache.value, v, index, axis=2)
            filled = jnp.arange(cache.key.shape[2]) <= index                   # (M,)
            return self.self_attn.attend(h, written["key"], written["value"], filled)[0]

        def cross_attention(h: jax.Array) -> jax.Array:
            return self.cross_attn.attend(h, cache.memory_key, cache.memory_value, src_mask)[0]

        out = self._sublayers(x, self_attention, cross_attention, deterministic)
        return out, cache._replace(**written)

    def _sublayers(self, x: jax.Array, self_attention, cross_attention, deterministic: bool | None) -> jax.Array:
        drop = functools.partial(self.dropout, deterministic=deterministic)
        x = residual(x, self_attention, self.self_attn_norm, self.norm_first, drop)
        x = residual(x, cross_attention, self.cross_attn_norm, self.norm_first, drop)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)


class Encoder(nnx.Module):
    """A stack of N encoder layers (section 3.1); pre-LN adds a final LayerNorm.

    ``intermediates``, when a dict, receives each layer's output under ``layers.{i}``.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([EncoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.n_encoder_layers)])
        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs) if config.norm_first else None

    def __call__(self, x: jax.Array, mask: jax.Array | None = None, intermediates: dict | None = None, *,
                 deterministic: bool | None = None) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, deterministic=deterministic)
            if intermediates is not None:
                intermediates[f"layers.{i}"] = x
        return self.norm(x) if self.norm is not None else x


class Decoder(nnx.Module):
    """A stack of N decoder layers (section 3.1); pre-LN adds a final LayerNorm.

    ``intermediates``, when a dict, receives each layer's output under ``layers.{i}``.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.n_decoder_layers)])
        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs) if config.norm_first else None

    def __call__(self, x: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, intermediates: dict | None = None, *,
                 deterministic: bool | None = None) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, tgt_mask, deterministic=deterministic)
            if intermediates is not None:
                intermediates[f"layers.{i}"] = x
        return self._final_norm(x)

    def init_cache(self, memory: jax.Array, max_steps: int) -> tuple[KVCache, ...]:
        """One :class:`KVCache` per layer (see :meth:`DecoderLayer.init_cache`)."""
        return tuple(layer.init_cache(memory, max_steps) for layer in self.layers)

    def step(self, x: jax.Array, cache: tuple[KVCache, ...], index: int | jax.Array,
             src_mask: jax.Array | None = None, *, deterministic: bool | None = None):
        """The stack at position ``index`` only (see :meth:`DecoderLayer.step`).

        Shape: x (B, 1, D) -> (B, 1, D) and the updated caches.
        """
        updated = []
        for layer, layer_cache in zip(self.layers, cache):
            x, layer_cache = layer.step(x, layer_cache, index, src_mask, deterministic=deterministic)
            updated.append(layer_cache)
        return self._final_norm(x), tuple(updated)

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self.norm(x) if self.norm is not None else x


# ----------------------------------------------------------------------------- the model

class Transformer(nnx.Module):
    """The encoder-decoder Transformer (section 3, Figure 1).

    ``dtype`` (float64 by default, like the reference, or float32) is the dtype of every
    parameter and of the computation; float64 needs ``jax_enable_x64`` and is refused with a
    ``ValueError`` otherwise. Weights are random (``rngs``) until loaded with
    :func:`transformer_jax.checkpoint.from_params` or ``load_checkpoint``. With
    ``share_embeddings`` one ``Embeddings`` module is ``src_embed``, ``tgt_embed`` and
    ``generator.embed``.

    Shape:
        src (B, S) int, tgt (B, T) int: the target shifted right (starting with bos_id).
        src_mask broadcastable to (B, H, T or S, S), default :func:`padding_mask` of src;
        tgt_mask broadcastable to (B, H, T, T), default :func:`target_mask` of tgt.
        Returns log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, dtype=jnp.float64, *, rngs: nnx.Rngs):
        self.config = config
        self.dtype = check_dtype(dtype)
        kw = {"dtype": self.dtype, "rngs": rngs}
        self.src_embed = Embeddings(config, config.src_vocab_size, **kw)
        self.tgt_embed = self.src_embed if config.share_embeddings \
            else Embeddings(config, config.tgt_vocab_size, **kw)
        self.src_pos = PositionalEncoding(config, **kw)
        self.tgt_pos = PositionalEncoding(config, **kw)
        self.encoder = Encoder(config, **kw)
        self.decoder = Decoder(config, **kw)
        self.generator = Generator(config, embed=self.src_embed if config.share_embeddings else None, **kw)
        self.dropout = _dropout(config, rngs)

    def encode(self, src: jax.Array, src_mask: jax.Array | None = None, intermediates: dict | None = None,
               *, deterministic: bool | None = None) -> jax.Array:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        (batch, length), heads = src.shape, self.config.n_heads
        src_mask = _check_mask(src_mask, (batch, heads, length, length), "src_mask")
        x = self.dropout(self.src_pos(self.src_embed(src)), deterministic=deterministic)
        steps: dict = {}
        memory = self.encoder(x, src_mask, steps, deterministic=deterministic)
        if intermediates is not None:
            intermediates["src_embed"] = x
            intermediates.update({f"encoder.{key}": value for key, value in steps.items()})
            intermediates["encoder"] = memory
        return memory

    def decode(self, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
               tgt_mask: jax.Array | None = None, intermediates: dict | None = None,
               *, deterministic: bool | None = None) -> jax.Array:
        """Embed the shifted target and run the decoder stack.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D). ``src_mask`` is required when the
        source had padding (the decoder cannot see source tokens).
        """
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        reference.check_memory(*_describe("memory", memory), len(tgt), self.config.d_model, self.dtype.name)
        memory = jnp.asarray(memory)
        (batch, length), heads = tgt.shape, self.config.n_heads
        if src_mask is not None:
            src_mask = _check_mask(src_mask, (batch, heads, length, memory.shape[1]), "src_mask")
        if tgt_mask is None:
            tgt_mask = target_mask(tgt, self.config.pad_id)
        tgt_mask = _check_mask(tgt_mask, (batch, heads, length, length), "tgt_mask")
        y = self.dropout(self.tgt_pos(self.tgt_embed(tgt)), deterministic=deterministic)
        steps: dict = {}
        out = self.decoder(y, memory, src_mask, tgt_mask, steps, deterministic=deterministic)
        if intermediates is not None:
            intermediates["tgt_embed"] = y
            intermediates.update({f"decoder.{key}": value for key, value in steps.items()})
            intermediates["decoder"] = out
        return out

    def __call__(self, src: jax.Array, tgt: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, return_intermediates: bool = False,
                 *, deterministic: bool | None = None):
        """Log-probabilities of the next target token at every target position.

        With ``return_intermediates`` returns ``(log_probs, stages)`` where ``stages`` maps
        "src_embed", "encoder.layers.{i}", "encoder", "tgt_embed", "decoder.layers.{i}",
        "decoder" and "log_probs" to arrays, in that order (the shared stage names of every port;
        ``jax.jit`` returns dicts with sorted keys, see :func:`stage_names`).
        """
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        stages: dict | None = {} if return_intermediates else None
        memory = self.encode(src, src_mask, stages, deterministic=deterministic)
        out = self.decode(tgt, memory, src_mask, tgt_mask, stages, deterministic=deterministic)
        log_probs = self.generator(out)
        if stages is None:
            return log_probs
        stages["log_probs"] = log_probs
        return log_probs, stages

    def _check_inputs(self, src, tgt, src_mask, tgt_mask) -> tuple[jax.Array, jax.Array]:
        """Every check of the forward pass, made before any computation (the reference's
        :func:`~reference_numpy.model.check_forward_inputs`)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        reference.check_forward_inputs(self.config, src.shape, tgt.shape, _describe("src_mask", src_mask),
                                       _describe("tgt_mask", tgt_mask))
        return src, tgt

    def _check_tokens(self, name: str, tokens, vocab_size: int) -> jax.Array:
        """The reference's token checks: shape and dtype always, the id range only on concrete
        (untraced) arrays, which is why public entry points check before compiled code."""
        if isinstance(tokens, jax.core.Tracer):
            reference.check_token_layout(name, *_describe(name, tokens), self.config.max_len)
            return tokens
        return jnp.asarray(reference.check_tokens(name, tokens, vocab_size, self.config.max_len))


def stage_names(config: TransformerConfig) -> list[str]:
    """The shared stage names of ``return_intermediates``, in forward order."""
    return ["src_embed", *[f"encoder.layers.{i}" for i in range(config.n_encoder_layers)], "encoder",
            "tgt_embed", *[f"decoder.layers.{i}" for i in range(config.n_decoder_layers)], "decoder",
            "log_probs"]


def compiled_forward(model: Transformer, src, tgt, src_mask=None, tgt_mask=None, return_intermediates: bool = False):
    """``model(src, tgt, src_mask, tgt_mask, return_intermediates)`` compiled with ``nnx.jit``
    (one compilation per model structure, input shapes and mask presence).

    The inputs are checked on the host first: once traced, token ids can no longer be compared
    with the vocabulary size (an id out of range would give NaN log-probabilities).
    Shape: as :class:`Transformer`.
    """
    src, tgt = model._check_inputs(src, tgt, src_mask, tgt_mask)
    return _jitted_forward(model, src, tgt, src_mask, tgt_mask, return_intermediates)


@nnx.jit(static_argnames="return_intermediates")
def _jitted_forward(model: Transformer, src: jax.Array, tgt: jax.Array, src_mask: jax.Array | None,
                    tgt_mask: jax.Array | None, return_intermediates: bool):
    return model(src, tgt, src_mask, tgt_mask, return_intermediates)


def forward(model: Transformer, src, tgt, src_mask=None, tgt_mask=None, return_intermediates: bool = False):
    """:func:`compiled_forward` with the stages in forward order.

    Shape: as :class:`Transformer`.
    """
    result = compiled_forward(model, src, tgt, src_mask, tgt_mask, return_intermediates)
    if not return_intermediates:
        return result
    log_probs, stages = result
    return log_probs, {name: stages[name] for name in stage_names(model.config)}
