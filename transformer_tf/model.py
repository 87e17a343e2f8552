"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Keras 3 layers.

A parallel text of ``reference_numpy/model.py``: its concepts, names, argument order, shape legend and masks
(bool, True = may attend); the framework's idiom is listed in docs/ports.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import DTypeLike

from reference_numpy.config import TransformerConfig

from .checks import checked_decoder_masks, checked_forward_inputs, checked_mask, checked_source, checked_target
from .incremental import Index, KVCache, _attend, _attend_cache, _checked_cache, _keys_values, _returned, decoder_cache
from .layers import (
    _as_config,
    _Dense,
    _Generator,
    _logits,
    _Model,
    _Normalization,
    _Stream,
    _TransformerLayer,
    _uniform_weight,
)
from .precision import attention_product, autocast_dtype, computed_wide, float32_under_autocast, narrow, round_to, wide
from .softmax import masked_softmax, zero_fully_masked_rows
from .variants import _fairseq_table, _halves_table, gelu, position_ids, silu

ACTIVATIONS = {"silu": silu, "gelu": gelu}   # config.activation's choices beside the paper's ReLU (.variants)


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: tf.Tensor, pad_id: int) -> tf.Tensor:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return tf.not_equal(tokens, pad_id)[:, None, None, :]


def causal_mask(length: Index) -> tf.Tensor:
    """Position i may attend to positions j <= i -- decoder self-attention, 3.2.3. Shape: (1, 1, T, T), bool."""
    position = tf.range(length)
    return (position[:, None] >= position[None, :])[None, None]


def target_mask(tgt: tf.Tensor, pad_id: int) -> tf.Tensor:
    """The causal mask and the target's padding mask, the start token read even when it is pad (docs/ports.md).

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    length = tf.shape(tgt)[1]
    return (padding_mask(tgt, pad_id) | (tf.range(length) == 0)) & causal_mask(length)


# ----------------------------------------------------------------------------- attention

@computed_wide
def scaled_dot_product_attention(query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: tf.Tensor | None = None, *,
                                 dtype: DTypeLike | tf.DType | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V -- Eq. (1), section 3.2.1.

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v), mask broadcastable to (..., Tq, Tk) -> output
    (..., Tq, d_v), weights (..., Tq, Tk).

    TensorFlow: ``dtype`` P (a mixed policy's compute dtype) computes by the autocast recipe.
    """
    scores = attention_product(functools.partial(tf.matmul, transpose_b=True), query, key, dtype)   # (..., Tq, Tk)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])             # (..., Tq, Tk)
    return zero_fully_masked_rows(attention_product(tf.matmul, weights, value, dtype), mask), weights


class MultiHeadAttention(_TransformerLayer):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) -- 3.2.2.

    Shape: query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk or C) -> (B, Tq, D); with
    ``return_weights`` also the weights (B, H, Tq, Tk or C); with a ``cache`` also the cache, last.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.n_heads, d_model, sub = self.config.n_heads, self.config.d_model, self._sublayer_kwargs
        self.q_proj = _Dense(d_model, d_model, **sub("q_proj"))
        self.k_proj = _Dense(d_model, d_model, **sub("k_proj"))
        self.v_proj = _Dense(d_model, d_model, **sub("v_proj"))
        self.o_proj = _Dense(d_model, d_model, **sub("o_proj"))

    def call(self, query, key, value, mask=None, return_weights=False, cache=None):
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k, v, written = _keys_values(self, key, value, cache)              # (B, H, Tk or C, d_k)
        dtype = autocast_dtype(self.dtype_policy)
        if cache is not None:                                              # over the memory's or its own cache
            heads, weights = _attend_cache(scaled_dot_product_attention, q, k, v, mask, written, cache.position,
                                           return_weights, dtype)
        else:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, dtype=dtype)   # (B, H, Tq, d_k)
        shape = tf.shape(heads)
        concat = tf.reshape(tf.transpose(heads, (0, 2, 1, 3)),
                            (shape[0], shape[2], self.config.d_model))     # (B, Tq, D)
        out = self.o_proj(concat)
        return _returned(out, weights if return_weights else None, written)

    def _split_heads(self, x: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(x)
        x = tf.reshape(x, (shape[0], shape[1], self.n_heads, self.config.d_k))  # (B, T, H, d_k)
        return tf.transpose(x, (0, 2, 1, 3))                                    # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

def activation(x: tf.Tensor, name: str) -> tf.Tensor:
    """The feed-forward network's ``config.activation``: max(0, x) -- Eq. (2); ``silu``, ``gelu``: :mod:`.variants`.

    Shape: (...) -> (...).
    """
    if name == "relu":
        return tf.maximum(x, 0)
    if name in ACTIVATIONS:
        return narrow(ACTIVATIONS[name](wide(x)), x.dtype)
    raise ValueError(f"activation must be one of ('relu', 'silu', 'gelu'), got {name!r}")


class PositionwiseFeedForward(_TransformerLayer):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, act :func:`activation` (max(0, .) in the paper) -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer (B, T, F).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.linear1 = _Dense(self.config.d_model, self.config.d_ff, **self._sublayer_kwargs("linear1"))
        self.linear2 = _Dense(self.config.d_ff, self.config.d_model, **self._sublayer_kwargs("linear2"))

    def call(self, x):
        return self.linear2(activation(self.linear1(x), self.config.activation))


class LayerNorm(_Normalization):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, var biased, eps ``config.layer_norm_eps`` -- Ba et al., 3.1.

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        config = _as_config(config)
        super().__init__(axis=-1, epsilon=config.layer_norm_eps, **float32_under_autocast(kwargs))
        self.config = config

    def call(self, x):
        overflow = tf.math.is_inf(tf.math.reduce_variance(wide(x), axis=-1, keepdims=True))   # (..., 1)
        return tf.where(overflow, tf.constant(np.nan, x.dtype), super().call(x))


def residual(x: tf.Tensor, sublayer: Callable[[tf.Tensor], tf.Tensor], norm: LayerNorm, norm_first: bool,
             dropout: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """Post-LN LayerNorm(x + Sublayer(x)) (the paper) or pre-LN x + Sublayer(LayerNorm(x)) -- 3.1 (its dropout: 5.4).

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return add(x, dropout(sublayer(norm(x))))
    return norm(add(x, dropout(sublayer(x))))


def add(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """x + y in x's precision (:mod:`.precision`). Shape: x (...), y broadcastable to x -> (...)."""
    return narrow(wide(x) + wide(y), x.dtype)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype: DTypeLike | tf.DType = "float64",
                                   layout: str = "interleaved", pad_id: int = 0) -> tf.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) -- section 3.5;
    another ``layout`` (``config.sinusoidal_layout``) as ``reference_numpy/variants.py`` defines it.

    Shape: returns (L, D) in ``dtype``, rows 0 .. L-1 ((L + 1, D) for ``fairseq``).
    """
    if layout == "halves":
        table = _halves_table(length, d_model)                                # (L, D)
    elif layout == "fairseq":
        table = _fairseq_table(length, d_model, pad_id)                       # (L + 1, D)
    else:
        position = tf.range(length, dtype=tf.float64)[:, None]                # (L, 1)
        two_i = tf.range(0, d_model, 2, dtype=tf.float64)[None, :]            # (1, D/2)
        angle = position / tf.pow(tf.constant(10000.0, tf.float64), two_i / d_model)  # (L, D/2)
        table = tf.reshape(tf.stack([tf.sin(angle), tf.cos(angle)], axis=-1), (length, d_model))  # (L, D)
    return round_to(table, dtype)


class Embeddings(_TransformerLayer):
    """Token embedding times sqrt(d_model) (1 unless ``config.scale_embeddings``) -- 3.4. Shape: (B, T) -> (B, T, D)."""

    def __init__(self, config: TransformerConfig | dict, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(config, **float32_under_autocast(kwargs))
        self.vocab_size = vocab_size
        self.scale = math.sqrt(self.config.d_model) if self.config.scale_embeddings else 1.0

    def build(self, input_shape=None):
        self.weight = _uniform_weight(self, (self.vocab_size, self.config.d_model))  # (V, D)

    def call(self, tokens):
        return narrow(wide(tf.gather(self.weight, tokens)) * self.scale, self.compute_dtype)


class PositionalEncoding(_TransformerLayer):
    """x plus the encodings of positions ``offset`` .. ``offset`` + T - 1 -- section 3.5 (``learned``: Table 3 row E);
    the ``fairseq`` layout reads rows :func:`position_ids` of ``tokens`` (``by_step`` for the decoder's).

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; tokens (B, T) int or None.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **float32_under_autocast(kwargs))
        self.learned = self.config.positional_encoding == "learned"
        self.dropout = keras.layers.Dropout(self.config.dropout, **self._sublayer_kwargs("dropout"))

    def build(self, input_shape=None):
        cfg = self.config
        if self.learned:                                            # (L + offset, D): position t at row t + offset
            self.weight = _uniform_weight(self, (cfg.max_len + cfg.position_offset, cfg.d_model))
        else:
            self.weight = sinusoidal_positional_encoding(cfg.max_len, cfg.d_model, self.compute_dtype,
                                                         cfg.sinusoidal_layout, cfg.pad_id)

    def call(self, x, offset=0, tokens=None, by_step=False, training=None):
        fairseq, table = self.config.sinusoidal_layout == "fairseq", tf.convert_to_tensor(self.weight)
        if not fairseq or tokens is None:           # a learned table's position t at row t + position_offset
            offset = offset + 1 if fairseq else offset + self.config.position_offset
            table = tf.slice(table, (offset, 0), (tf.shape(x)[1], self.config.d_model))            # (T, D)
            return self.dropout(add(x, table), training=training)
        rows = position_ids(tokens, self.config.pad_id, offset, by_step)                          # (B, T)
        return self.dropout(add(x, tf.gather(table, rows)), training=training)                   # (B, T, D)


class Generator(_Generator):
    """log softmax(x W), with ``config.output_bias`` log softmax(x W + b) -- the pre-softmax linear map, 3.4.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).

    TensorFlow: with ``share_embeddings`` the shared ``embeddings``' matrix, transposed.
    """

    def __init__(self, config: TransformerConfig | dict, embeddings: Embeddings | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.config.share_embeddings and embeddings is None:
            raise ValueError("a Generator with share_embeddings needs the shared Embeddings layer (embeddings=)")
        self.embeddings = embeddings

    def build(self, input_shape=None):
        if self.embeddings is None:
            self.weight = self.add_weight(name="weight", shape=(self.config.d_model, self.config.tgt_vocab_size),
                                          initializer="glorot_uniform")   # (D, V)
        self.bias = self.add_weight(name="bias", shape=(self.config.tgt_vocab_size,), initializer="zeros") \
            if self.config.output_bias else None                           # (V,)

    def call(self, x):
        return log_softmax(self.logits(x))

    def logits(self, x: tf.Tensor) -> tf.Tensor:
        """x W (+ b), the log-softmax's logits (a low precision's widened). Shape: x (B, T, D) -> (B, T, V_tgt)."""
        return _logits(x, self._weight(), self._bias())


def log_softmax(x: tf.Tensor) -> tf.Tensor:
    """log softmax over the last axis, computed stably. Shape: (..., V) -> (..., V)."""
    shifted = x - tf.reduce_max(x, axis=-1, keepdims=True)
    return shifted - tf.math.log(tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer(_Stream):
    """Self-attention then feed-forward, each in :func:`residual` -- section 3.1.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.norm_first = cfg.norm_first
        self.self_attn = MultiHeadAttention(cfg, **sub("self_attn"))
        self.self_attn_norm = LayerNorm(cfg, **sub("self_attn_norm"))
        self.ffn = PositionwiseFeedForward(cfg, **sub("ffn"))
        self.ffn_norm = LayerNorm(cfg, **sub("ffn_norm"))
        self.dropout = keras.layers.Dropout(cfg.dropout, **sub("dropout"))

    def call(self, x, mask=None, training=None):
        dropout = functools.partial(self.dropout, training=training)
        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, dropout)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)


class DecoderLayer(_Stream):
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in :func:`residual` -- 3.1, 3.2.3.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S), tgt_mask to (B, H, T, T or C) ->
    (B, T, D); with a ``cache`` (a self-attention's and the memory's, :mod:`.incremental`) ``(x, cache)``.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.norm_first = cfg.norm_first
        self.self_attn = MultiHeadAttention(cfg, **sub("self_attn"))
        self.self_attn_norm = LayerNorm(cfg, **sub("self_attn_norm"))
        self.cross_attn = MultiHeadAttention(cfg, **sub("cross_attn"))
        self.cross_attn_norm = LayerNorm(cfg, **sub("cross_attn_norm"))
        self.ffn = PositionwiseFeedForward(cfg, **sub("ffn"))
        self.ffn_norm = LayerNorm(cfg, **sub("ffn_norm"))
        self.dropout = keras.layers.Dropout(cfg.dropout, **sub("dropout"))

    def call(self, x, memory, src_mask=None, tgt_mask=None, cache=None, training=None):
        self_cache, cross_cache = (None, None) if cache is None else cache
        dropout = functools.partial(self.dropout, training=training)
        kept: list[KVCache] = []                                           # the caches the attentions return
        x = residual(x, lambda h: _attend(self.self_attn, h, h, tgt_mask, self_cache, kept),
                     self.self_attn_norm, self.norm_first, dropout)
        x = residual(x, lambda h: _attend(self.cross_attn, h, memory, src_mask, cross_cache, kept),
                     self.cross_attn_norm, self.norm_first, dropout)
        x = residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)
        return x if cache is None else (x, tuple(kept))


class Encoder(_Stream):
    """A stack of N encoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.layers = [EncoderLayer(cfg, **sub(f"layers_{i}")) for i in range(cfg.n_encoder_layers)]
        self.norm = LayerNorm(cfg, **sub("norm")) if cfg.norm_first else None

    def call(self, x, mask=None, training=None):
        for layer in self.layers:
            x = layer(x, mask, training=training)
        return self.norm(x) if self.norm is not None else x


class Decoder(_Stream):
    """A stack of N decoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); with a ``cache`` (a pair per layer) ``(x, cache)``.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.layers = [DecoderLayer(cfg, **sub(f"layers_{i}")) for i in range(cfg.n_decoder_layers)]
        self.norm = LayerNorm(cfg, **sub("norm")) if cfg.norm_first else None

    def call(self, x, memory, src_mask=None, tgt_mask=None, cache=None, training=None):
        kept = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, src_mask, tgt_mask, training=training)
            else:
                x, layer_cache = layer(x, memory, src_mask, tgt_mask, cache[i], training=training)
                kept.append(layer_cache)
        x = self.norm(x) if self.norm is not None else x
        return x if cache is None else (x, tuple(kept))


# ----------------------------------------------------------------------------- the model

class Transformer(_Model):
    """The encoder-decoder Transformer -- section 3, Figure 1.

    Shape: src (B, S) int, tgt (B, T) int (the target shifted right, from bos_id); src_mask broadcastable to
    (B, H, T or S, S), default :func:`padding_mask` of src; tgt_mask to (B, H, T, T), default :func:`target_mask` of tgt
    -> log-probabilities (B, T, V_tgt).

    TensorFlow: ``dtype`` one of the four dtypes or a Keras dtype policy (a mixed one: autocast); built on creation.
    """

    def __init__(self, config: TransformerConfig | dict, dtype: DTypeLike | tf.DType | keras.DTypePolicy = "float64",
                 **kwargs: Any) -> None:
        super().__init__(config, dtype, **kwargs)
        cfg, sub, shared = self.config, self._sublayer_kwargs, self.config.share_embeddings
        self.src_embed = Embeddings(cfg, cfg.src_vocab_size, **sub("shared_embed" if shared else "src_embed"))
        self.tgt_embed = self.src_embed if shared else Embeddings(cfg, cfg.tgt_vocab_size, **sub("tgt_embed"))
        self.src_pos = PositionalEncoding(cfg, **sub("src_pos"))
        self.tgt_pos = PositionalEncoding(cfg, **sub("tgt_pos"))
        self.src_embed_norm = LayerNorm(cfg, **sub("src_embed_norm")) if cfg.embedding_norm else None
        self.tgt_embed_norm = LayerNorm(cfg, **sub("tgt_embed_norm")) if cfg.embedding_norm else None
        self.encoder = Encoder(cfg, **sub("encoder"))
        self.decoder = Decoder(cfg, **sub("decoder"))
        self.generator = Generator(cfg, self.tgt_embed if cfg.share_embeddings else None, **sub("generator"))
        self.build((None, None), (None, None))

    def encode(self, src: tf.Tensor, src_mask: tf.Tensor | None = None, training: bool | None = None) -> Any:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src, src_mask = checked_source(self.config, src, src_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        x = self.src_pos(self.src_embed(src), 0, src, training=training)
        x = self.src_embed_norm(x) if self.src_embed_norm is not None else x
        return self.encoder(x, src_mask, training=training)

    def init_cache(self, memory: tf.Tensor, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """The decoder's caches of ``capacity`` target positions (:func:`.incremental.decoder_cache`) -- 3.2.3."""
        return decoder_cache(self, memory, capacity)

    def decode(self, tgt: tf.Tensor, memory: tf.Tensor, src_mask: tf.Tensor | None = None,
               tgt_mask: tf.Tensor | None = None, cache: tuple[tuple[KVCache, KVCache], ...] | None = None,
               training: bool | None = None) -> Any:
        """Embed the shifted target and run the decoder stack; with a ``cache``, from its ``position`` on -- 3.2.3.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D), with a cache ``(out, cache)``; tgt_mask broadcastable to
        (B, H, T, T), or (B, H, T, C) with a cache (default: causal over absolute positions).
        """
        tgt, memory = checked_target(self.config, tgt, memory, self.variable_dtype)
        cache, start, keys = _checked_cache(cache, tgt.shape[1])          # start: the first new position
        if tgt_mask is None and cache is None:  # with a cache and none given, each self-attention's causal mask over W
            tgt_mask = target_mask(tgt, self.config.pad_id)
        src_mask, tgt_mask = checked_decoder_masks(self.config, tuple(tgt.shape), memory.shape[1], keys, src_mask,
                                                   tgt_mask)
        y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True, training=training)
        y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y
        return self.decoder(y, memory, src_mask, tgt_mask, cache=cache, training=training)

    def call(self, src, tgt, src_mask=None, tgt_mask=None, training=None):
        """Log-probabilities of the next target token at every target position."""
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask, training=training)
        return self.generator(self.decode(tgt, memory, src_mask, tgt_mask, training=training))

    def _check_inputs(self, src: tf.Tensor, tgt: tf.Tensor, src_mask: tf.Tensor | None,
                      tgt_mask: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
        """Every check of the forward pass, made before any computation (``checks.checked_forward_inputs``)."""
        return checked_forward_inputs(self.config, src, tgt, src_mask, tgt_mask)
