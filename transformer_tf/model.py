"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as Keras 3 layers.

A parallel text of ``reference_numpy/model.py``: same classes and functions in the same
order, same argument names, same math. Keras idiom: every component is a named layer whose
weights are created in ``build()`` (all shapes come from the config), ``get_config()`` holds
the :class:`TransformerConfig` as a dict, ``training=`` switches dropout (section 5.4) and the
dtype comes from the Keras dtype policy (``dtype="float64"`` per layer or model, so float32
and float64 models live side by side). The reference's ``Linear`` is ``keras.layers.Dense``,
whose kernel is stored (in, out) like the checkpoint: y = x @ W + b.

Shape legend used in every docstring:
    B: batch size          H: number of heads h        D: d_model
    S: source length       T: target length            d_k: D / H
    Tq, Tk: query and key lengths                      F: d_ff
    V: vocabulary size     L: number of positions (config.max_len)

Masks are boolean and **True means "may attend"**, broadcastable to (B, H, Tq, Tk). They are
plain inputs: Keras' implicit masks (``_keras_mask``) are never consulted.
"""

from __future__ import annotations

import math
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from reference_numpy import model as reference
from reference_numpy.config import TransformerConfig

register = keras.saving.register_keras_serializable(package="transformer_tf")


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens, pad_id: int) -> tf.Tensor:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return tf.not_equal(tokens, pad_id)[:, None, None, :]


def causal_mask(length) -> tf.Tensor:
    """Position i may attend to positions j <= i (decoder self-attention, section 3.2.3).

    Shape: mask (1, 1, T, T), bool, True = may attend.
    """
    position = tf.range(length)
    return (position[:, None] >= position[None, :])[None, None]


def target_mask(tgt, pad_id: int) -> tf.Tensor:
    """Causal mask combined with the target's padding mask.

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    return padding_mask(tgt, pad_id) & causal_mask(tf.shape(tgt)[1])


# ----------------------------------------------------------------------------- attention

def scaled_dot_product_attention(query, key, value, mask=None) -> tuple[tf.Tensor, tf.Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V  -- Eq. (1), section 3.2.1.

    A query row whose mask has no True entry sees no key: its weights are all zero and its
    output is zero (never NaN, never a uniform average).

    Shape:
        query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v),
        mask broadcastable to (..., Tq, Tk), bool, True = may attend.
        Returns output (..., Tq, d_v) and weights (..., Tq, Tk).
    """
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    d_k = query.shape[-1]
    scores = tf.matmul(query, key, transpose_b=True) / math.sqrt(d_k)   # (..., Tq, Tk)
    if mask is not None:
        mask = _check_mask(mask, scores.shape)
        scores = tf.where(mask, scores, tf.constant(-np.inf, scores.dtype))
    row_max = tf.reduce_max(scores, axis=-1, keepdims=True)              # -inf on fully masked rows
    row_max = tf.where(tf.math.is_finite(row_max), row_max, tf.zeros_like(row_max))
    exp = tf.exp(scores - row_max)                                      # exactly 0 where masked
    total = tf.reduce_sum(exp, axis=-1, keepdims=True)
    weights = exp / tf.where(total > 0, total, tf.ones_like(total))     # fully masked row -> zeros
    return tf.matmul(weights, value), weights


def _check_mask(mask, scores_shape, name: str = "mask") -> tf.Tensor:
    reference.check_mask(name, *_describe(name, mask), tuple(scores_shape))   # None: a size unknown while tracing
    return tf.convert_to_tensor(mask)


def _describe(name: str, value) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional tensor or array argument, for the reference's input checks."""
    if value is None:
        return None
    if not tf.is_tensor(value):
        value = reference.as_array(name, value)
    return tuple(value.shape), value.dtype.name


class _TransformerLayer:
    """Keras plumbing shared by the layers below (mixed in before the Keras base class).

    * ``config`` (a TransformerConfig or its dict) is kept and travels as a dict in
      ``get_config``, so ``from_config`` round-trips;
    * masks are plain inputs. Keras fills an argument named ``mask`` (or ``src_mask`` for an
      argument ``src``) from a ``_keras_mask`` attribute of the inputs, by keyword: so inputs
      lose that attribute, and the arguments are bound to ``call()``'s signature and passed by
      keyword (a mask given by position would otherwise collide with Keras' keyword).
    """

    def __init__(self, config: TransformerConfig | dict, **kwargs):
        super().__init__(**kwargs)
        self.config = config if isinstance(config, TransformerConfig) else TransformerConfig.from_dict(config)

    def __call__(self, *args, **kwargs):
        arguments = self._call_signature.bind(*args, **kwargs).arguments
        return super().__call__(**tf.nest.map_structure(_without_keras_mask, arguments))

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    def compute_mask(self, inputs, previous_mask):
        """Attention masks are not Keras sequence masks: outputs carry none."""
        return None

    def _sublayer_kwargs(self, name: str) -> dict:
        return {"name": name, "dtype": self.dtype_policy}


def _without_keras_mask(value):
    if getattr(value, "_keras_mask", None) is not None:
        return tf.identity(value)  # a new tensor, without the mask attribute
    return value


@register
class MultiHeadAttention(_TransformerLayer, keras.layers.Layer):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)  -- section 3.2.2.

    The h heads are split head-major: head i owns columns i*d_k .. (i+1)*d_k - 1 of the
    projections W^Q, W^K, W^V (and rows of W^O). Every projection has a bias.

    Shape:
        query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk).
        Returns (B, Tq, D); with ``return_weights`` also the weights (B, H, Tq, Tk).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.n_heads = self.config.n_heads
        d_model = self.config.d_model
        self.q_proj = keras.layers.Dense(d_model, **self._sublayer_kwargs("q_proj"))
        self.k_proj = keras.layers.Dense(d_model, **self._sublayer_kwargs("k_proj"))
        self.v_proj = keras.layers.Dense(d_model, **self._sublayer_kwargs("v_proj"))
        self.o_proj = keras.layers.Dense(d_model, **self._sublayer_kwargs("o_proj"))

    def build(self, input_shape=None):
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.build((None, self.config.d_model))

    def call(self, query, key, value, mask=None, return_weights=False):
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k = self._split_heads(self.k_proj(key))                            # (B, H, Tk, d_k)
        v = self._split_heads(self.v_proj(value))                          # (B, H, Tk, d_k)
        return self.attend(q, k, v, mask, return_weights)

    def attend(self, q, k, v, mask=None, return_weights=False):
        """Attention of heads already projected and split, then Concat(...) W^O.

        Used directly by cached decoding, where k and v come from the key/value cache.
        Shape: q (B, H, Tq, d_k), k and v (B, H, Tk, d_k) -> (B, Tq, D).
        """
        heads, weights = scaled_dot_product_attention(q, k, v, mask)       # (B, H, Tq, d_k)
        shape = tf.shape(heads)
        concat = tf.reshape(tf.transpose(heads, (0, 2, 1, 3)),
                            (shape[0], shape[2], self.config.d_model))     # (B, Tq, D)
        out = self.o_proj(concat)
        return (out, weights) if return_weights else out

    def _split_heads(self, x):
        shape = tf.shape(x)
        x = tf.reshape(x, (shape[0], shape[1], self.n_heads, self.config.d_k))  # (B, T, H, d_k)
        return tf.transpose(x, (0, 2, 1, 3))                                    # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

@register
class PositionwiseFeedForward(_TransformerLayer, keras.layers.Layer):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2  -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer is (B, T, F).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.linear1 = keras.layers.Dense(self.config.d_ff, **self._sublayer_kwargs("linear1"))
        self.linear2 = keras.layers.Dense(self.config.d_model, **self._sublayer_kwargs("linear2"))

    def build(self, input_shape=None):
        self.linear1.build((None, self.config.d_model))
        self.linear2.build((None, self.config.d_ff))

    def call(self, x):
        return self.linear2(tf.maximum(self.linear1(x), 0))


@register
class LayerNorm(keras.layers.LayerNormalization):
    """Layer normalization (Ba et al., 2016) used around every sublayer (section 3.1).

    y = (x - mean) / sqrt(var + eps) * weight + bias, with the biased variance over the last
    axis and eps added to the variance. ``eps`` is always passed from ``config.layer_norm_eps``
    (Keras' own default is 1e-3). Keras evaluates it as x * g + (beta - mean * g) with
    g = rsqrt(var + eps) * gamma: the same function, rounded differently by a few ulps.

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, eps: float, **kwargs):
        super().__init__(axis=-1, epsilon=eps, **kwargs)

    def get_config(self) -> dict:
        return {**keras.layers.Layer.get_config(self), "eps": self.epsilon}


def residual(x, sublayer: Callable, norm: LayerNorm, norm_first: bool, dropout: Callable) -> tf.Tensor:
    """Residual connection around a sublayer (section 3.1), with dropout on the sublayer's
    output before it is added (section 5.4).

    Post-LN (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-LN: x + Dropout(Sublayer(LayerNorm(x))).
    """
    if norm_first:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype="float64") -> tf.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))
    -- section 3.5. Sine and cosine are **interleaved** (even columns sin, odd columns cos).

    The table is computed in float64 and then cast to ``dtype``.

    Shape: returns (L, D).
    """
    position = tf.range(length, dtype=tf.float64)[:, None]                # (L, 1)
    two_i = tf.range(0, d_model, 2, dtype=tf.float64)[None, :]            # (1, D/2)
    angle = position / tf.pow(tf.constant(10000.0, tf.float64), two_i / d_model)  # (L, D/2)
    table = tf.reshape(tf.stack([tf.sin(angle), tf.cos(angle)], axis=-1), (length, d_model))  # (L, D)
    return tf.cast(table, dtype)


@register
class Embeddings(_TransformerLayer, keras.layers.Layer):
    """Token embedding multiplied by sqrt(d_model) (section 3.4).

    Shape: tokens (B, T) int -> (B, T, D).
    """

    def __init__(self, config, vocab_size: int, **kwargs):
        super().__init__(config, **kwargs)
        self.vocab_size = vocab_size
        self.scale = math.sqrt(self.config.d_model)

    def build(self, input_shape=None):
        limit = math.sqrt(3.0 / self.config.d_model)  # standard deviation d_model^-0.5
        self.embeddings = self.add_weight(name="embeddings", shape=(self.vocab_size, self.config.d_model),
                                          initializer=keras.initializers.RandomUniform(-limit, limit))

    def call(self, tokens):
        return tf.gather(self.embeddings, tokens) * self.scale

    def get_config(self) -> dict:
        return {**super().get_config(), "vocab_size": self.vocab_size}


@register
class PositionalEncoding(_TransformerLayer, keras.layers.Layer):
    """Adds position information to the embeddings (section 3.5), then dropout (section 5.4).

    ``sinusoidal``: the fixed table of :func:`sinusoidal_positional_encoding`;
    ``learned``: a trained (L, D) table (Table 3, row E).

    Shape: x (B, T, D) -> (B, T, D), T <= L.
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.learned = self.config.positional_encoding == "learned"
        self.dropout = keras.layers.Dropout(self.config.dropout, **self._sublayer_kwargs("dropout"))

    def build(self, input_shape=None):
        cfg = self.config
        if self.learned:
            limit = math.sqrt(3.0 / cfg.d_model)
            self.embeddings = self.add_weight(name="embeddings", shape=(cfg.max_len, cfg.d_model),
                                              initializer=keras.initializers.RandomUniform(-limit, limit))
        else:
            self.embeddings = sinusoidal_positional_encoding(cfg.max_len, cfg.d_model, self.compute_dtype)

    def call(self, x, offset=0, training=None):
        table = tf.slice(tf.convert_to_tensor(self.embeddings), (offset, 0),
                         (tf.shape(x)[1], self.config.d_model))            # (T, D)
        return self.dropout(x + table, training=training)


@register
class Generator(_TransformerLayer, keras.layers.Layer):
    """Pre-softmax linear transformation and log-softmax (section 3.4); no bias.

    With ``share_embeddings`` its weight is the transposed shared embedding matrix: pass the
    shared :class:`Embeddings` layer as ``embeddings``.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config, embeddings: Embeddings | None = None, **kwargs):
        super().__init__(config, **kwargs)
        if self.config.share_embeddings and embeddings is None:
            raise ValueError("a Generator with share_embeddings needs the shared Embeddings layer (embeddings=)")
        self.embeddings = embeddings

    def build(self, input_shape=None):
        if self.embeddings is None:
            self.kernel = self.add_weight(name="kernel", shape=(self.config.d_model, self.config.tgt_vocab_size),
                                          initializer="glorot_uniform")

    def call(self, x):
        weight = (tf.transpose(self.embeddings.embeddings) if self.embeddings is not None
                  else self.kernel)                                       # (D, V)
        return log_softmax(tf.matmul(x, weight))


def log_softmax(x) -> tf.Tensor:
    """log softmax over the last axis, computed stably."""
    shifted = x - tf.reduce_max(x, axis=-1, keepdims=True)
    return shifted - tf.math.log(tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- layers and stacks

@register
class EncoderLayer(_TransformerLayer, keras.layers.Layer):
    """Self-attention then feed-forward, each wrapped in :func:`residual` (section 3.1).

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.norm_first = cfg.norm_first
        self.self_attn = MultiHeadAttention(cfg, **sub("self_attn"))
        self.self_attn_norm = LayerNorm(cfg.layer_norm_eps, **sub("self_attn_norm"))
        self.ffn = PositionwiseFeedForward(cfg, **sub("ffn"))
        self.ffn_norm = LayerNorm(cfg.layer_norm_eps, **sub("ffn_norm"))
        self.dropout = keras.layers.Dropout(cfg.dropout, **sub("dropout"))

    def build(self, input_shape=None):
        _build_all((self.self_attn, self.self_attn_norm, self.ffn, self.ffn_norm), self.config)

    def call(self, x, mask=None, training=None):
        def dropout(h):
            return self.dropout(h, training=training)

        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first, dropout)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)


@register
class DecoderLayer(_TransformerLayer, keras.layers.Layer):
    """Masked self-attention, encoder-decoder attention (queries from the decoder, keys and
    values from the encoder output), then feed-forward; each wrapped in :func:`residual`
    (sections 3.1 and 3.2.3).

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S),
    tgt_mask broadcastable to (B, H, T, T) -> (B, T, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.norm_first = cfg.norm_first
        self.self_attn = MultiHeadAttention(cfg, **sub("self_attn"))
        self.self_attn_norm = LayerNorm(cfg.layer_norm_eps, **sub("self_attn_norm"))
        self.cross_attn = MultiHeadAttention(cfg, **sub("cross_attn"))
        self.cross_attn_norm = LayerNorm(cfg.layer_norm_eps, **sub("cross_attn_norm"))
        self.ffn = PositionwiseFeedForward(cfg, **sub("ffn"))
        self.ffn_norm = LayerNorm(cfg.layer_norm_eps, **sub("ffn_norm"))
        self.dropout = keras.layers.Dropout(cfg.dropout, **sub("dropout"))

    def build(self, input_shape=None):
        _build_all((self.self_attn, self.self_attn_norm, self.cross_attn, self.cross_attn_norm,
                    self.ffn, self.ffn_norm), self.config)

    def call(self, x, memory, src_mask=None, tgt_mask=None, training=None):
        def dropout(h):
            return self.dropout(h, training=training)

        x = residual(x, lambda h: self.self_attn(h, h, h, tgt_mask), self.self_attn_norm, self.norm_first,
                     dropout)
        x = residual(x, lambda h: self.cross_attn(h, memory, memory, src_mask), self.cross_attn_norm,
                     self.norm_first, dropout)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, dropout)


def _build_all(layers, config: TransformerConfig) -> None:
    """Build sublayers whose weight shapes depend only on the config (inputs are (..., D))."""
    for layer in layers:
        layer.build((None, config.d_model))


@register
class Encoder(_TransformerLayer, keras.layers.Layer):
    """A stack of N encoder layers (section 3.1); pre-LN adds a final LayerNorm.

    With ``return_intermediates`` also returns each layer's output under ``layers.{i}`` (a
    Keras call copies its arguments, so the reference's output dict becomes a return value).

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.layers = [EncoderLayer(cfg, **sub(f"layers_{i}")) for i in range(cfg.n_encoder_layers)]
        self.norm = LayerNorm(cfg.layer_norm_eps, **sub("norm")) if cfg.norm_first else None

    def build(self, input_shape=None):
        _build_all(self.layers + ([self.norm] if self.norm is not None else []), self.config)

    def call(self, x, mask=None, return_intermediates=False, training=None):
        steps = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, training=training)
            steps[f"layers.{i}"] = x
        x = self.norm(x) if self.norm is not None else x
        return (x, steps) if return_intermediates else x


@register
class Decoder(_TransformerLayer, keras.layers.Layer):
    """A stack of N decoder layers (section 3.1); pre-LN adds a final LayerNorm.

    With ``return_intermediates`` also returns each layer's output under ``layers.{i}``.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D).
    """

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        cfg, sub = self.config, self._sublayer_kwargs
        self.layers = [DecoderLayer(cfg, **sub(f"layers_{i}")) for i in range(cfg.n_decoder_layers)]
        self.norm = LayerNorm(cfg.layer_norm_eps, **sub("norm")) if cfg.norm_first else None

    def build(self, input_shape=None):
        _build_all(self.layers + ([self.norm] if self.norm is not None else []), self.config)

    def call(self, x, memory, src_mask=None, tgt_mask=None, return_intermediates=False, training=None):
        steps = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, src_mask, tgt_mask, training=training)
            steps[f"layers.{i}"] = x
        x = self.norm(x) if self.norm is not None else x
        return (x, steps) if return_intermediates else x


# ----------------------------------------------------------------------------- the model

@register
class Transformer(_TransformerLayer, keras.Model):
    """The encoder-decoder Transformer (section 3, Figure 1).

    Built on construction (every weight shape comes from ``config``). ``dtype`` is the Keras
    dtype policy, "float32" or "float64"; weights come from :mod:`.checkpoint`
    (``load_checkpoint``, ``from_params``) or from Keras' ``load_weights``.

    Shape:
        src (B, S) int, tgt (B, T) int: the target shifted right (starting with bos_id).
        src_mask broadcastable to (B, H, T or S, S), default :func:`padding_mask` of src;
        tgt_mask broadcastable to (B, H, T, T), default :func:`target_mask` of tgt.
        Returns log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config, dtype="float64", **kwargs):
        super().__init__(config, dtype=dtype, **kwargs)
        if self.compute_dtype not in ("float32", "float64") or self.variable_dtype != self.compute_dtype:
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype_policy.name}")
        cfg, sub = self.config, self._sublayer_kwargs
        if cfg.share_embeddings:
            self.src_embed = Embeddings(cfg, cfg.src_vocab_size, **sub("shared_embed"))
            self.tgt_embed = self.src_embed
        else:
            self.src_embed = Embeddings(cfg, cfg.src_vocab_size, **sub("src_embed"))
            self.tgt_embed = Embeddings(cfg, cfg.tgt_vocab_size, **sub("tgt_embed"))
        self.src_pos = PositionalEncoding(cfg, **sub("src_pos"))
        self.tgt_pos = PositionalEncoding(cfg, **sub("tgt_pos"))
        self.encoder = Encoder(cfg, **sub("encoder"))
        self.decoder = Decoder(cfg, **sub("decoder"))
        self.generator = Generator(cfg, self.tgt_embed if cfg.share_embeddings else None, **sub("generator"))
        self.build()

    def build(self, input_shape=None):
        for layer in (self.src_embed, self.tgt_embed, self.src_pos, self.tgt_pos, self.encoder, self.decoder,
                      self.generator):
            if not layer.built:  # with share_embeddings, src_embed is tgt_embed
                layer.build()

    def encode(self, src, src_mask=None, intermediates: dict | None = None, training=None) -> tf.Tensor:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        (batch, length), heads = src.shape, self.config.n_heads
        src_mask = _check_mask(src_mask, (batch, heads, length, length), "src_mask")
        x = self.src_pos(self.src_embed(src), training=training)
        memory, steps = self.encoder(x, src_mask, return_intermediates=True, training=training)
        if intermediates is not None:
            intermediates["src_embed"] = x
            intermediates.update({f"encoder.{key}": value for key, value in steps.items()})
            intermediates["encoder"] = memory
        return memory

    def decode(self, tgt, memory, src_mask=None, tgt_mask=None, intermediates: dict | None = None,
               training=None) -> tf.Tensor:
        """Embed the shifted target and run the decoder stack.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D). ``src_mask`` is required when the
        source had padding (the decoder cannot see source tokens).
        """
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        reference.check_memory(*_describe("memory", memory), tgt.shape[0], self.config.d_model, self.compute_dtype)
        memory = tf.convert_to_tensor(memory)
        (batch, length), heads = tgt.shape, self.config.n_heads
        if src_mask is not None:
            src_mask = _check_mask(src_mask, (batch, heads, length, memory.shape[1]), "src_mask")
        if tgt_mask is None:
            tgt_mask = target_mask(tgt, self.config.pad_id)
        tgt_mask = _check_mask(tgt_mask, (batch, heads, length, length), "tgt_mask")
        y = self.tgt_pos(self.tgt_embed(tgt), training=training)
        out, steps = self.decoder(y, memory, src_mask, tgt_mask, return_intermediates=True, training=training)
        if intermediates is not None:
            intermediates["tgt_embed"] = y
            intermediates.update({f"decoder.{key}": value for key, value in steps.items()})
            intermediates["decoder"] = out
        return out

    def __call__(self, src, tgt, src_mask=None, tgt_mask=None, *args, **kwargs):
        """Checks the inputs before Keras' ``Layer.__call__``: an error raised inside ``call`` is
        re-raised by Keras as a multi-line report of the call's arguments, not the one-line error."""
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        return super().__call__(src, tgt, src_mask, tgt_mask, *args, **kwargs)

    def call(self, src, tgt, src_mask=None, tgt_mask=None, return_intermediates=False, training=None):
        """Log-probabilities of the next target token at every target position.

        With ``return_intermediates`` returns ``(log_probs, stages)`` where ``stages`` maps
        "src_embed", "encoder.layers.{i}", "encoder", "tgt_embed", "decoder.layers.{i}",
        "decoder" and "log_probs" to tensors, in that order (the shared stage names of every port).
        """
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        stages = {}
        memory = self.encode(src, src_mask, stages, training=training)
        out = self.decode(tgt, memory, src_mask, tgt_mask, stages, training=training)
        log_probs = self.generator(out)
        if not return_intermediates:
            return log_probs
        stages["log_probs"] = log_probs
        return log_probs, stages

    def _check_inputs(self, src, tgt, src_mask, tgt_mask) -> tuple[tf.Tensor, tf.Tensor]:
        """Every check of the forward pass, made before any computation (the reference's
        :func:`~reference_numpy.model.check_forward_inputs`)."""
        src = self._check_tokens("src", src, self.config.src_vocab_size)
        tgt = self._check_tokens("tgt", tgt, self.config.tgt_vocab_size)
        reference.check_forward_inputs(self.config, tuple(src.shape), tuple(tgt.shape),
                                       _describe("src_mask", src_mask), _describe("tgt_mask", tgt_mask))
        return src, tgt

    def _check_tokens(self, name: str, tokens, vocab_size: int) -> tf.Tensor:
        """The reference's token checks: shape and dtype always, the id range unless the tensor is
        symbolic (traced), which is why public entry points check before compiled code. Ids of
        any integer dtype become int64 (``tf.gather`` takes no unsigned indices)."""
        if tf.is_symbolic_tensor(tokens):
            reference.check_token_layout(name, *_describe(name, tokens), self.config.max_len)
        elif tf.is_tensor(tokens):
            reference.check_tokens(name, tokens.numpy(), vocab_size, self.config.max_len)
        else:
            tokens = reference.check_tokens(name, tokens, vocab_size, self.config.max_len)
        return tf.cast(tokens, tf.int64)


def compiled_forward(model: Transformer, jit_compile: bool = True, return_intermediates: bool = False) -> Callable:
    """The inference forward pass as one ``tf.function``, traced (and with ``jit_compile``
    XLA-compiled) on the first call for each input shape. XLA handles float64 on CPU for every
    op used; on the CPU it ran the ``base`` forward pass a few percent faster than TensorFlow's
    graph executor (``docs/benchmarks-tf.md``).

    The returned function checks its inputs eagerly, then runs the graph: once traced, token ids
    can no longer be compared with the vocabulary size (``tf.gather`` would clamp an id out of range).

    Shape: as :class:`Transformer`; returns log-probabilities (B, T, V_tgt), or with
    ``return_intermediates`` ``(log_probs, stages)``.
    """
    @tf.function(jit_compile=jit_compile)
    def graph(src, tgt, src_mask=None, tgt_mask=None):
        return model(src, tgt, src_mask, tgt_mask, return_intermediates=return_intermediates, training=False)

    def forward(src, tgt, src_mask=None, tgt_mask=None):
        src, tgt = model._check_inputs(src, tgt, src_mask, tgt_mask)
        return graph(src, tgt, src_mask, tgt_mask)

    return forward
