"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in JAX with Flax NNX.

A parallel text of ``reference_numpy/model.py``: its concepts, names, argument order, shape legend and masks
(bool, True = may attend); the framework's idiom is listed in docs/ports.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy.typing as npt
from flax import nnx
from jax import lax
from jax.typing import DTypeLike

from reference_numpy import model as reference
from reference_numpy.config import TransformerConfig

from . import speed
from .checks import (
    checked_decoder_masks,
    checked_dtypes,
    checked_forward_inputs,
    checked_mask,
    checked_source,
    checked_target,
)
from .incremental import KVCache, _attend, _attend_cache, _checked_cache, _keys_values, _returned, decoder_cache
from .layers import _affine, _Constant, _dropout, _linear, _matmul
from .precision import attention_product, autocast_dtype, computation, computed_wide, narrow, storage, wide
from .softmax import masked_softmax, zero_fully_masked_rows
from .variants import gelu, position_ids, silu

ACTIVATIONS = {"silu": silu, "gelu": gelu}   # config.activation's choices beside the paper's ReLU (.variants)


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: npt.ArrayLike, pad_id: int) -> jax.Array:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return (jnp.asarray(tokens) != pad_id)[:, None, None, :]


def causal_mask(length: int) -> jax.Array:
    """Position i may attend to positions j <= i -- decoder self-attention, 3.2.3. Shape: (1, 1, T, T), bool."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def target_mask(tgt: npt.ArrayLike, pad_id: int) -> jax.Array:
    """The causal mask and the target's padding mask, the start token read even when it is pad (docs/ports.md).

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    padding = padding_mask(tgt, pad_id)                                   # (B, 1, 1, T)
    return (padding | (jnp.arange(padding.shape[-1]) == 0)) & causal_mask(padding.shape[-1])


# ----------------------------------------------------------------------------- attention

@computed_wide
def scaled_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None, *,
                                 dtype: DTypeLike | None = None) -> tuple[jax.Array, jax.Array]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V -- Eq. (1), section 3.2.1.

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v), mask broadcastable to (..., Tq, Tk) -> output
    (..., Tq, d_v), weights (..., Tq, Tk).

    JAX: ``dtype`` P (Flax's computation dtype beside float32 parameters) computes by the autocast recipe.
    """
    scores = attention_product(_matmul, query, jnp.swapaxes(key, -1, -2), dtype)     # (..., Tq, Tk)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])             # (..., Tq, Tk)
    return zero_fully_masked_rows(attention_product(_matmul, weights, value, dtype), mask), weights


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) -- 3.2.2.

    Shape: query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk or C) -> (B, Tq, D); with
    ``return_weights`` also the weights (B, H, Tq, Tk or C); with a ``cache`` also the cache, last.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.n_heads = config.n_heads
        self.q_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.k_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.v_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)
        self.o_proj = _linear(config.d_model, config.d_model, dtype, rngs, param_dtype)

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None,
                 return_weights: bool = False, cache: KVCache | None = None) -> Any:
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k, v, written = _keys_values(self, key, value, cache)              # (B, H, Tk or C, d_k)
        dtype = autocast_dtype(self.q_proj.dtype, self.q_proj.param_dtype)
        if cache is not None:                                              # over the memory's or its own cache
            heads, weights = _attend_cache(scaled_dot_product_attention, q, k, v, mask, written, cache.position,
                                           return_weights, dtype)
        else:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, dtype=dtype)   # (B, H, Tq, d_k)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)    # (B, Tq, D)
        out = self.o_proj(concat)
        return _returned(out, weights if return_weights else None, written)

    def _split_heads(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)
        return x.transpose(0, 2, 1, 3)                                     # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

def activation(x: jax.Array, name: str) -> jax.Array:
    """The feed-forward network's ``config.activation``: max(0, x) -- Eq. (2); ``silu``, ``gelu``: :mod:`.variants`.

    Shape: (...) -> (...).
    """
    if name == "relu":
        return jnp.maximum(x, 0)
    if name in ACTIVATIONS:
        return narrow(ACTIVATIONS[name](wide(x)), x.dtype)
    raise ValueError(f"activation must be one of ('relu', 'silu', 'gelu'), got {name!r}")


class PositionwiseFeedForward(nnx.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, act :func:`activation` (max(0, .) in the paper) -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer (B, T, F).
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.linear1 = _linear(config.d_model, config.d_ff, dtype, rngs, param_dtype)
        self.linear2 = _linear(config.d_ff, config.d_model, dtype, rngs, param_dtype)
        self.activation = config.activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear2(activation(self.linear1(x), self.activation))


class LayerNorm(nnx.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, var biased, eps ``config.layer_norm_eps`` -- Ba et al., 3.1.

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
    """Post-LN LayerNorm(x + Sublayer(x)) (the paper) or pre-LN x + Sublayer(LayerNorm(x)) -- 3.1 (its dropout: 5.4).

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return add(x, dropout(sublayer(norm(x))))
    return norm(add(x, dropout(sublayer(x))))


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y in x's precision (:mod:`.precision`). Shape: x (...), y broadcastable to x -> (...)."""
    return narrow(wide(x) + wide(y), x.dtype)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype: DTypeLike = jnp.float64,
                                   layout: str = "interleaved", pad_id: int = 0) -> jax.Array:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) -- section 3.5;
    another ``layout`` (``config.sinusoidal_layout``) as ``reference_numpy/variants.py`` defines it.

    Shape: returns (L, D) in ``dtype``, rows 0 .. L-1 ((L + 1, D) for ``fairseq``).
    """
    return jnp.asarray(reference.sinusoidal_positional_encoding(length, d_model, dtype, layout, pad_id), dtype=dtype)


class Embeddings(nnx.Embed):
    """Token embedding times sqrt(d_model) (1 unless ``config.scale_embeddings``) -- 3.4. Shape: (B, T) -> (B, T, D)."""

    def __init__(self, config: TransformerConfig, vocab_size: int, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        dtype = storage(dtype, param_dtype)                                 # float32 under autocast
        super().__init__(vocab_size, config.d_model, dtype=computation(dtype), param_dtype=dtype, rngs=rngs)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0

    def __call__(self, tokens: jax.Array) -> jax.Array:  # type: ignore[override]  # the reference's call: tokens
        return narrow(super().__call__(tokens) * self.scale, self.param_dtype)


class PositionalEncoding(nnx.Module):
    """x plus the encodings of positions ``offset`` .. ``offset`` + T - 1 -- section 3.5 (``learned``: Table 3 row E);
    the ``fairseq`` layout reads rows :func:`position_ids` of ``tokens`` (``by_step`` for the decoder's).

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; tokens (B, T) int or None.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        dtype = storage(dtype, param_dtype)                                 # float32 under autocast
        self.learned = config.positional_encoding == "learned"
        self.fairseq_pad_id = config.pad_id if config.sinusoidal_layout == "fairseq" else None
        self.position_offset = config.position_offset
        if self.learned:                                            # (L + offset, D): position t at row t + offset
            init = nnx.initializers.normal(config.d_model ** -0.5)
            self.weight = nnx.Param(init(rngs.params(), (config.max_len + config.position_offset, config.d_model),
                                         dtype))
        else:
            self.table = _Constant(sinusoidal_positional_encoding(config.max_len, config.d_model, dtype,
                                                                  config.sinusoidal_layout, config.pad_id))  # (L, D)
        self.dropout = _dropout(config, rngs)

    def __call__(self, x: jax.Array, offset: int | jax.Array = 0, tokens: jax.Array | None = None,
                 by_step: bool = False, *, deterministic: bool | None = None) -> jax.Array:
        table = self.weight if self.learned else self.table
        if self.fairseq_pad_id is None or tokens is None:
            start = offset + self.position_offset if self.fairseq_pad_id is None else offset + 1
            positions = lax.dynamic_slice_in_dim(table[...], start, x.shape[1], axis=0)   # (T, D)
            return self.dropout(add(x, positions), deterministic=deterministic)
        return self.dropout(add(x, table[...][position_ids(tokens, self.fairseq_pad_id, offset, by_step)]),
                            deterministic=deterministic)                                  # (B, T, D)


class Generator(nnx.Module):
    """log softmax(x W), with ``config.output_bias`` log softmax(x W + b) -- the pre-softmax linear map, 3.4.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).

    JAX: ``weight`` (D, V); with ``share_embeddings`` the shared ``embeddings``' matrix, transposed.
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
        return log_softmax(self.logits(x))

    def logits(self, x: jax.Array) -> jax.Array:
        """x W (+ b), the log-softmax's logits (a low precision's widened). Shape: x (B, T, D) -> (B, T, V_tgt)."""
        weight = self.weight[...] if self.embeddings is None else self.embeddings.embedding[...].T  # (D, V)
        dtype = weight.dtype if self.mixed is None else self.mixed      # autocast: x, W and b rounded to P
        return wide(_affine(x, weight, None if self.bias is None else self.bias[...], dtype))   # (B, T, V)


def log_softmax(x: jax.Array) -> jax.Array:
    """log softmax over the last axis, computed stably. Shape: (..., V) -> (..., V)."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(speed.sum_exp(shifted))


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each in :func:`residual` -- section 3.1.

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
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in :func:`residual` -- 3.1, 3.2.3.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S), tgt_mask to (B, H, T, T or C) ->
    (B, T, D); with a ``cache`` (a self-attention's and the memory's, :mod:`.incremental`) ``(x, cache)``.
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
                 tgt_mask: jax.Array | None = None, cache: tuple[KVCache, KVCache] | None = None, *,
                 deterministic: bool | None = None) -> Any:
        self_cache, cross_cache = (None, None) if cache is None else cache
        drop = functools.partial(self.dropout, deterministic=deterministic)
        kept: list[KVCache] = []                                           # the caches the attentions return
        x = residual(x, lambda h: _attend(self.self_attn, h, h, tgt_mask, self_cache, kept),
                     self.self_attn_norm, self.norm_first, drop)
        x = residual(x, lambda h: _attend(self.cross_attn, h, memory, src_mask, cross_cache, kept),
                     self.cross_attn_norm, self.norm_first, drop)
        x = residual(x, self.ffn, self.ffn_norm, self.norm_first, drop)
        return x if cache is None else (x, tuple(kept))


class Encoder(nnx.Module):
    """A stack of N encoder layers -- section 3.1; pre-LN ends with a LayerNorm.

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
    """A stack of N decoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); with a ``cache`` (a pair per layer) ``(x, cache)``.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.layers = nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype)
                                for _ in range(config.n_decoder_layers)])
        self.norm = LayerNorm(config, dtype=dtype, rngs=rngs, param_dtype=param_dtype) if config.norm_first else None

    def __call__(self, x: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None, cache: tuple[tuple[KVCache, KVCache], ...] | None = None, *,
                 deterministic: bool | None = None) -> Any:
        kept = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, src_mask, tgt_mask, deterministic=deterministic)
            else:
                x, layer_cache = layer(x, memory, src_mask, tgt_mask, cache[i], deterministic=deterministic)
                kept.append(layer_cache)
        x = self.norm(x) if self.norm is not None else x
        return x if cache is None else (x, tuple(kept))


# ----------------------------------------------------------------------------- the model

class Transformer(nnx.Module):
    """The encoder-decoder Transformer -- section 3, Figure 1.

    Shape: src (B, S) int, tgt (B, T) int (the target shifted right, from bos_id); src_mask broadcastable to
    (B, H, T or S, S), default :func:`padding_mask` of src; tgt_mask to (B, H, T, T), default :func:`target_mask` of tgt
    -> log-probabilities (B, T, V_tgt).

    JAX: ``dtype`` float64 (``jax_enable_x64``), float32, bfloat16, float16; ``param_dtype`` float32 beside P: mixed.
    """

    def __init__(self, config: TransformerConfig, *, dtype: DTypeLike = jnp.float64, rngs: nnx.Rngs,
                 param_dtype: DTypeLike | None = None):
        self.config = config
        self.dtype, self.param_dtype = checked_dtypes(dtype, param_dtype)
        kw: dict[str, Any] = {"dtype": self.dtype, "rngs": rngs, "param_dtype": self.param_dtype}
        self.src_embed = Embeddings(config, config.src_vocab_size, **kw)
        self.tgt_embed = self.src_embed if config.share_embeddings else Embeddings(config, config.tgt_vocab_size, **kw)
        self.src_pos = PositionalEncoding(config, **kw)
        self.tgt_pos = PositionalEncoding(config, **kw)
        self.src_embed_norm = LayerNorm(config, **kw) if config.embedding_norm else None
        self.tgt_embed_norm = LayerNorm(config, **kw) if config.embedding_norm else None
        self.encoder = Encoder(config, **kw)
        self.decoder = Decoder(config, **kw)
        self.generator = Generator(config, self.src_embed if config.share_embeddings else None, **kw)

    def encode(self, src: jax.Array, src_mask: jax.Array | None = None, *,
               deterministic: bool | None = None) -> jax.Array:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src, src_mask = checked_source(self.config, src, src_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        x = self.src_pos(self.src_embed(src), 0, src, deterministic=deterministic)
        x = self.src_embed_norm(x) if self.src_embed_norm is not None else x
        return self.encoder(x, src_mask, deterministic=deterministic)

    def init_cache(self, memory: jax.Array, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """The decoder's caches of ``capacity`` target positions (:func:`.incremental.decoder_cache`) -- 3.2.3."""
        return decoder_cache(self, memory, capacity)

    def decode(self, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array | None = None,
               tgt_mask: jax.Array | None = None, cache: tuple[tuple[KVCache, KVCache], ...] | None = None, *,
               deterministic: bool | None = None) -> Any:
        """Embed the shifted target and run the decoder stack; with a ``cache``, from its ``position`` on -- 3.2.3.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D), with a cache ``(out, cache)``; tgt_mask broadcastable to
        (B, H, T, T), or (B, H, T, C) with a cache (default: causal over absolute positions).
        """
        tgt, memory = checked_target(self.config, tgt, memory, self.param_dtype.name)
        cache, start, keys = _checked_cache(cache, tgt.shape[1])          # start: the first new position
        if tgt_mask is None and cache is None:  # with a cache and none given, each self-attention's causal mask over W
            tgt_mask = target_mask(tgt, self.config.pad_id)
        src_mask, tgt_mask = checked_decoder_masks(self.config, tuple(tgt.shape), memory.shape[1], keys, src_mask,
                                                   tgt_mask)
        y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True, deterministic=deterministic)
        y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y
        return self.decoder(y, memory, src_mask, tgt_mask, cache=cache, deterministic=deterministic)

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
        """Every check of the forward pass, made before any computation (``checks.checked_forward_inputs``)."""
        return checked_forward_inputs(self.config, src, tgt, src_mask, tgt_mask)
