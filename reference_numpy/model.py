"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in plain NumPy.

The math every port is checked against, section 3 in the paper's order; parameters from the flat checkpoint
dictionary (docs/checkpoint-format.md), low precisions by :mod:`.precision`, the design notes in docs/ports.md.

Shape legend:
    B: batch size          H: number of heads h        D: d_model
    S: source length       T: target length            d_k: D / H
    Tq, Tk: query and key lengths                      F: d_ff
    V: vocabulary size     L: number of positions (config.max_len)
    C: a key/value cache's capacity (:mod:`.incremental`)

Masks are boolean and **True means "may attend"**, broadcastable to (B, H, Tq, Tk).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .checks import checked_decoder_masks, checked_forward_inputs, checked_mask, checked_source, checked_target
from .config import TransformerConfig
from .incremental import KVCache, _attend, _attend_cache, _checked_cache, _keys_values, _returned, decoder_cache
from .precision import (
    attention_product,
    cast,
    computed_wide,
    narrow,
    parse_dtype,
    product_dtype,
    round_to,
    score_dtype,
    wide,
)
from .softmax import masked_softmax, zero_fully_masked_rows
from .variants import fairseq_table, gelu, halves_table, position_ids, silu

Params = Mapping[str, np.ndarray]
ACTIVATIONS = {"silu": silu, "gelu": gelu}   # config.activation's choices beside the paper's ReLU (.variants)


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return (np.asarray(tokens) != pad_id)[:, None, None, :]


def causal_mask(length: int) -> np.ndarray:
    """Position i may attend to positions j <= i -- decoder self-attention, 3.2.3. Shape: (1, 1, T, T), bool."""
    return np.tril(np.ones((length, length), dtype=bool))[None, None]


def target_mask(tgt: np.ndarray, pad_id: int) -> np.ndarray:
    """The causal mask and the target's padding mask, the start token read even when it is pad (docs/ports.md).

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    length = np.shape(tgt)[1]
    return (padding_mask(tgt, pad_id) | (np.arange(length) == 0)) & causal_mask(length)


# ----------------------------------------------------------------------------- attention

@computed_wide
def scaled_dot_product_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                                 mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V -- Eq. (1), section 3.2.1.

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v), mask broadcastable to (..., Tq, Tk) -> output
    (..., Tq, d_v), weights (..., Tq, Tk).
    """
    scores = attention_product(query, np.swapaxes(key, -1, -2))        # (..., Tq, Tk)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])             # (..., Tq, Tk)
    return zero_fully_masked_rows(attention_product(weights, value), mask), weights


class Linear:
    """Affine map y = x W + b, W stored (in, out) as in the checkpoint. Shape: x (..., in) -> y (..., out)."""

    def __init__(self, params: Params, name: str):
        self.weight = params[f"{name}.weight"]  # (in, out)
        self.bias = params[f"{name}.bias"]      # (out,)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        dtype = product_dtype(self.weight.dtype)                        # P under autocast: x, W and b rounded to P
        return narrow(wide(cast(x, dtype)) @ wide(cast(self.weight, dtype)) + wide(cast(self.bias, dtype)), dtype)


class MultiHeadAttention:
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) -- 3.2.2.

    Shape: query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk or C) -> (B, Tq, D); with
    ``return_weights`` also the weights (B, H, Tq, Tk or C); with a ``cache`` also the cache, last.
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.n_heads = config.n_heads
        self.q_proj = Linear(params, f"{name}.q_proj")
        self.k_proj = Linear(params, f"{name}.k_proj")
        self.v_proj = Linear(params, f"{name}.v_proj")
        self.o_proj = Linear(params, f"{name}.o_proj")

    def __call__(self, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                 mask: np.ndarray | None = None, return_weights: bool = False, cache: KVCache | None = None) -> Any:
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k, v, written = _keys_values(self, key, value, cache)              # (B, H, Tk or C, d_k)
        if cache is not None:                                              # over the memory's or its own cache
            heads, weights = _attend_cache(scaled_dot_product_attention, q, k, v, mask, written,
                                           cache.position)
        else:
            heads, weights = scaled_dot_product_attention(q, k, v, mask)   # (B, H, Tq, d_k)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)    # (B, Tq, D)
        out = self.o_proj(concat)
        return _returned(out, weights if return_weights else None, written)

    def _split_heads(self, x: np.ndarray) -> np.ndarray:
        batch, length, width = x.shape
        x = x.reshape(batch, length, self.n_heads, width // self.n_heads)  # (B, T, H, d_k)
        return x.transpose(0, 2, 1, 3)                                     # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

def activation(x: np.ndarray, name: str) -> np.ndarray:
    """The feed-forward network's ``config.activation``: max(0, x) -- Eq. (2); ``silu``, ``gelu``: :mod:`.variants`.

    Shape: (...) -> (...).
    """
    if name == "relu":
        return np.maximum(x, 0)
    if name in ACTIVATIONS:
        return narrow(ACTIVATIONS[name](wide(x)), x.dtype)
    raise ValueError(f"activation must be one of ('relu', 'silu', 'gelu'), got {name!r}")


class PositionwiseFeedForward:
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, act :func:`activation` (max(0, .) in the paper) -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer (B, T, F).
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.linear1 = Linear(params, f"{name}.linear1")
        self.linear2 = Linear(params, f"{name}.linear2")
        self.activation = config.activation

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.linear2(activation(self.linear1(x), self.activation))


class LayerNorm:
    """y = (x - mean) / sqrt(var + eps) * weight + bias, var biased, eps ``config.layer_norm_eps`` -- Ba et al., 3.1.

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.weight = params[f"{name}.weight"]  # (D,)
        self.bias = params[f"{name}.bias"]      # (D,)
        self.eps = config.layer_norm_eps

    def __call__(self, x: np.ndarray) -> np.ndarray:
        dtype, x = x.dtype, wide(x)
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        normalized = np.where(np.isinf(var), np.nan, (x - mean) / np.sqrt(var + self.eps))
        return narrow(normalized * wide(self.weight) + wide(self.bias), dtype)


def residual(x: np.ndarray, sublayer: Callable[[np.ndarray], np.ndarray], norm: LayerNorm,
             norm_first: bool) -> np.ndarray:
    """Post-LN LayerNorm(x + Sublayer(x)) (the paper) or pre-LN x + Sublayer(LayerNorm(x)) -- 3.1 (its dropout: 5.4).

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return add(x, sublayer(norm(x)))
    return norm(add(x, sublayer(x)))


def add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x + y in x's precision (:mod:`.precision`). Shape: x (...), y broadcastable to x -> (...)."""
    return narrow(wide(x) + wide(y).astype(wide(x).dtype, copy=False), x.dtype)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype: npt.DTypeLike = np.float64,
                                   layout: str = "interleaved", pad_id: int = 0) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) -- section 3.5;
    another ``layout`` (``config.sinusoidal_layout``) as ``reference_numpy/variants.py`` defines it.

    Shape: returns (L, D) in ``dtype``, rows 0 .. L-1 ((L + 1, D) for ``fairseq``).
    """
    if layout == "halves":
        return round_to(halves_table(length, d_model), dtype)
    if layout == "fairseq":
        return round_to(fairseq_table(length, d_model, pad_id), dtype)
    position = np.arange(length, dtype=np.float64)[:, None]              # (L, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]          # (1, D/2)
    angle = position / np.power(10000.0, two_i / d_model)                # (L, D/2)
    table = np.empty((length, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angle)
    table[:, 1::2] = np.cos(angle)
    return round_to(table, dtype)


class Embeddings:
    """Token embedding times sqrt(d_model) (1 unless ``config.scale_embeddings``) -- 3.4. Shape: (B, T) -> (B, T, D)."""

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.weight = params[f"{name}.weight"]  # (V, D)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        return narrow(wide(self.weight[tokens]) * self.scale, self.weight.dtype)


class PositionalEncoding:
    """x plus the encodings of positions ``offset`` .. ``offset`` + T - 1 -- section 3.5 (``learned``: Table 3 row E);
    the ``fairseq`` layout reads rows :func:`position_ids` of ``tokens`` (``by_step`` for the decoder's).

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; tokens (B, T) int or None.
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str, dtype: npt.DTypeLike):
        self.pad_id = config.pad_id if config.sinusoidal_layout == "fairseq" else None
        if config.positional_encoding == "learned":
            self.table = params[f"{name}.weight"][config.position_offset:]  # (L, D): position t at row t + offset
        else:
            self.table = sinusoidal_positional_encoding(config.max_len, config.d_model, dtype,
                                                        config.sinusoidal_layout, config.pad_id)

    def __call__(self, x: np.ndarray, offset: int = 0, tokens: np.ndarray | None = None,
                 by_step: bool = False) -> np.ndarray:
        if self.pad_id is None:
            return add(x, self.table[offset:offset + x.shape[1]])
        if tokens is None:
            return add(x, self.table[offset + 1:offset + 1 + x.shape[1]])
        return add(x, self.table[position_ids(tokens, self.pad_id, offset, by_step)])


class Generator:
    """log softmax(x W), with ``config.output_bias`` log softmax(x W + b) -- the pre-softmax linear map, 3.4.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        if config.share_embeddings:
            self.weight = params["shared_embed.weight"].T                   # (D, V)
        else:
            self.weight = params[f"{name}.weight"]                          # (D, V)
        self.bias = params[f"{name}.bias"] if config.output_bias else None  # (V,)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return log_softmax(self.logits(x)).astype(score_dtype(self.weight.dtype))

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x W (+ b), the log-softmax's logits (a low precision's widened). Shape: x (B, T, D) -> (B, T, V_tgt)."""
        dtype = product_dtype(self.weight.dtype)                        # P under autocast: x, W and b rounded to P
        bias = 0.0 if self.bias is None else wide(cast(self.bias, dtype))
        logits = narrow(wide(cast(x, dtype)) @ wide(cast(self.weight, dtype)) + bias, dtype)   # (B, T, V)
        return wide(logits)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, computed stably. Shape: (..., V) -> (..., V)."""
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer:
    """Self-attention then feed-forward, each in :func:`residual` -- section 3.1.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, params, f"{name}.self_attn")
        self.self_attn_norm = LayerNorm(config, params, f"{name}.self_attn_norm")
        self.ffn = PositionwiseFeedForward(config, params, f"{name}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{name}.ffn_norm")

    def __call__(self, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first)


class DecoderLayer:
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in :func:`residual` -- 3.1, 3.2.3.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S), tgt_mask to (B, H, T, T or C) ->
    (B, T, D); with a ``cache`` (a self-attention's and the memory's, :mod:`.incremental`) ``(x, cache)``.
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config, params, f"{name}.self_attn")
        self.self_attn_norm = LayerNorm(config, params, f"{name}.self_attn_norm")
        self.cross_attn = MultiHeadAttention(config, params, f"{name}.cross_attn")
        self.cross_attn_norm = LayerNorm(config, params, f"{name}.cross_attn_norm")
        self.ffn = PositionwiseFeedForward(config, params, f"{name}.ffn")
        self.ffn_norm = LayerNorm(config, params, f"{name}.ffn_norm")

    def __call__(self, x: np.ndarray, memory: np.ndarray, src_mask: np.ndarray | None = None,
                 tgt_mask: np.ndarray | None = None, cache: tuple[KVCache, KVCache] | None = None) -> Any:
        self_cache, cross_cache = (None, None) if cache is None else cache
        kept: list[KVCache] = []                                           # the caches the attentions return
        x = residual(x, lambda h: _attend(self.self_attn, h, h, tgt_mask, self_cache, kept),
                     self.self_attn_norm, self.norm_first)
        x = residual(x, lambda h: _attend(self.cross_attn, h, memory, src_mask, cross_cache, kept),
                     self.cross_attn_norm, self.norm_first)
        x = residual(x, self.ffn, self.ffn_norm, self.norm_first)
        return x if cache is None else (x, tuple(kept))


class Encoder:
    """A stack of N encoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.layers = [EncoderLayer(config, params, f"{name}.layers.{i}")
                       for i in range(config.n_encoder_layers)]
        self.norm = LayerNorm(config, params, f"{name}.norm") if config.norm_first else None

    def __call__(self, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x) if self.norm is not None else x


class Decoder:
    """A stack of N decoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); with a ``cache`` (a pair per layer) ``(x, cache)``.
    """

    def __init__(self, config: TransformerConfig, params: Params, name: str):
        self.layers = [DecoderLayer(config, params, f"{name}.layers.{i}")
                       for i in range(config.n_decoder_layers)]
        self.norm = LayerNorm(config, params, f"{name}.norm") if config.norm_first else None

    def __call__(self, x: np.ndarray, memory: np.ndarray, src_mask: np.ndarray | None = None,
                 tgt_mask: np.ndarray | None = None, cache: tuple | None = None) -> Any:
        kept = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, src_mask, tgt_mask)
            else:
                x, layer_cache = layer(x, memory, src_mask, tgt_mask, cache[i])
                kept.append(layer_cache)
        x = self.norm(x) if self.norm is not None else x
        return x if cache is None else (x, tuple(kept))


# ----------------------------------------------------------------------------- the model

def _owned(rounded: np.ndarray, given: np.ndarray, copy: bool) -> np.ndarray:
    """``rounded`` (``given`` in the model's dtype), copied if ``copy`` and still the caller's memory."""
    return rounded.copy() if copy and np.may_share_memory(rounded, given) else rounded


class Transformer:
    """The encoder-decoder Transformer -- section 3, Figure 1.

    Shape: src (B, S) int, tgt (B, T) int (the target shifted right, from bos_id); src_mask broadcastable to
    (B, H, T or S, S), default :func:`padding_mask` of src; tgt_mask to (B, H, T, T), default :func:`target_mask` of tgt
    -> log-probabilities (B, T, V_tgt).

    NumPy: ``params`` the checkpoint's dictionary, rounded to ``dtype`` (float64, float32, bfloat16 or float16) into
    arrays of the model's own (``copy=False``: arrays already in ``dtype`` taken as they are).
    """

    def __init__(self, config: TransformerConfig, params: Params, dtype: npt.DTypeLike = np.float64, *,
                 copy: bool = True):
        self.config = config
        self.dtype = parse_dtype(dtype)
        self.params = {name: _owned(round_to(value, self.dtype), value, copy) for name, value in params.items()}
        p = self.params
        src_name, tgt_name = ("shared_embed", "shared_embed") if config.share_embeddings \
            else ("src_embed", "tgt_embed")
        self.src_embed = Embeddings(config, p, src_name)
        self.tgt_embed = Embeddings(config, p, tgt_name)
        self.src_pos = PositionalEncoding(config, p, "src_pos_embed", self.dtype)
        self.tgt_pos = PositionalEncoding(config, p, "tgt_pos_embed", self.dtype)
        self.src_embed_norm = LayerNorm(config, p, "src_embed_norm") if config.embedding_norm else None
        self.tgt_embed_norm = LayerNorm(config, p, "tgt_embed_norm") if config.embedding_norm else None
        self.encoder = Encoder(config, p, "encoder")
        self.decoder = Decoder(config, p, "decoder")
        self.generator = Generator(config, p, "generator")

    def encode(self, src: np.ndarray, src_mask: np.ndarray | None = None) -> np.ndarray:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src, src_mask = checked_source(self.config, src, src_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        x = self.src_pos(self.src_embed(src), 0, src)
        x = self.src_embed_norm(x) if self.src_embed_norm is not None else x
        return self.encoder(x, src_mask)

    def init_cache(self, memory: np.ndarray, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """The decoder's caches of ``capacity`` target positions (:func:`.incremental.decoder_cache`) -- 3.2.3."""
        return decoder_cache(self, memory, capacity)

    def decode(self, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray | None = None,
               tgt_mask: np.ndarray | None = None, cache: tuple | None = None) -> Any:
        """Embed the shifted target and run the decoder stack; with a ``cache``, from its ``position`` on -- 3.2.3.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D), with a cache ``(out, cache)``; tgt_mask broadcastable to
        (B, H, T, T), or (B, H, T, C) with a cache (default: causal over absolute positions).
        """
        tgt, memory = checked_target(self.config, tgt, memory, self.dtype.name)
        cache, start, keys = _checked_cache(cache, tgt.shape[1])          # start: the first new position
        if tgt_mask is None and cache is None:  # with a cache and none given, each self-attention's causal mask over W
            tgt_mask = target_mask(tgt, self.config.pad_id)
        src_mask, tgt_mask = checked_decoder_masks(self.config, tgt.shape, memory.shape[1], keys, src_mask, tgt_mask)
        y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True)
        y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y
        return self.decoder(y, memory, src_mask, tgt_mask, cache=cache)

    def __call__(self, src: np.ndarray, tgt: np.ndarray, src_mask: np.ndarray | None = None,
                 tgt_mask: np.ndarray | None = None) -> np.ndarray:
        """Log-probabilities of the next target token at every target position."""
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask)
        return self.generator(self.decode(tgt, memory, src_mask, tgt_mask))

    def _check_inputs(self, src: object, tgt: object, src_mask: object, tgt_mask: object
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Every check of the forward pass, made before any computation (``checks.checked_forward_inputs``)."""
        return checked_forward_inputs(self.config, src, tgt, src_mask, tgt_mask)
