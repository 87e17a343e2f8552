"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in PyTorch.

A parallel text of ``reference_numpy/model.py``: its concepts, names, argument order, shape legend and masks
(bool, True = may attend); the framework's idiom is listed in docs/ports.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from reference_numpy import model as reference
from reference_numpy.config import TransformerConfig

from . import speed
from .checks import checked_decoder_masks, checked_forward_inputs, checked_mask, checked_source, checked_target
from .incremental import (
    Index,
    KVCache,
    _attend,
    _attend_cache,
    _checked_cache,
    _keys_values,
    _positions,
    _returned,
    decoder_cache,
)
from .layers import _embedding, _Linear, _linear, _Model, _normal_parameter
from .precision import computed_wide, dtype_name, from_numpy, narrow, wide
from .softmax import masked_softmax, zero_fully_masked_rows
from .variants import gelu, position_ids, silu

ACTIVATIONS = {"silu": silu, "gelu": gelu}   # config.activation's choices beside the paper's ReLU (.variants)


# ----------------------------------------------------------------------------- masks

def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """Keys that are not padding may be attended to.

    Shape: tokens (B, Tk) -> mask (B, 1, 1, Tk), bool, True = may attend.
    """
    return (torch.as_tensor(tokens) != pad_id)[:, None, None, :]


def causal_mask(length: int, device: torch.device | str | None = None) -> Tensor:
    """Position i may attend to positions j <= i -- decoder self-attention, 3.2.3. Shape: (1, 1, T, T), bool."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]


def target_mask(tgt: Tensor, pad_id: int) -> Tensor:
    """The causal mask and the target's padding mask, the start token read even when it is pad (docs/ports.md).

    Shape: tgt (B, T) -> mask (B, 1, T, T).
    """
    tgt = torch.as_tensor(tgt)
    first = torch.arange(tgt.shape[1], device=tgt.device) == 0
    return (padding_mask(tgt, pad_id) | first) & causal_mask(tgt.shape[1], tgt.device)


# ----------------------------------------------------------------------------- attention

@computed_wide
def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                                 return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V -- Eq. (1), section 3.2.1.

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v), mask broadcastable to (..., Tq, Tk) -> output
    (..., Tq, d_v), weights (..., Tq, Tk).

    PyTorch: torch's fused kernel where neither ``return_weights`` nor gradients are asked for; the weights then None.
    """
    if mask is not None:
        batch = speed.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        mask = checked_mask("mask", mask, (*batch, query.shape[-2], key.shape[-2]), query.device)
    if not return_weights and speed.fused(query, key, value):
        return speed.attention(query, key, value, mask), None
    weights = masked_softmax(query @ key.transpose(-1, -2), mask, query.shape[-1])   # (..., Tq, Tk)
    return zero_fully_masked_rows(weights @ value, mask), (weights if return_weights else None)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) -- 3.2.2.

    Shape: query (B, Tq, D), key and value (B, Tk, D), mask broadcastable to (B, H, Tq, Tk or C) -> (B, Tq, D); with
    ``return_weights`` also the weights (B, H, Tq, Tk or C); with a ``cache`` also the cache, last.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.q_proj = _Linear(config.d_model, config.d_model)
        self.k_proj = _Linear(config.d_model, config.d_model)
        self.v_proj = _Linear(config.d_model, config.d_model)
        self.o_proj = _Linear(config.d_model, config.d_model)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                return_weights: bool = False, cache: KVCache | None = None) -> Any:
        q = self._split_heads(self.q_proj(query))                          # (B, H, Tq, d_k)
        k, v, written = _keys_values(self, key, value, cache)              # (B, H, Tk or C, d_k)
        if cache is not None:                                              # over the memory's or its own cache
            heads, weights = _attend_cache(scaled_dot_product_attention, q, k, v, mask, written, cache.position,
                                           return_weights)
        else:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, return_weights)   # (B, H, Tq, d_k)
        batch, _, length, _ = heads.shape
        concat = heads.transpose(1, 2).reshape(batch, length, -1)          # (B, Tq, D)
        out = self.o_proj(concat)
        return _returned(out, weights, written)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        x = x.view(batch, length, self.n_heads, width // self.n_heads)     # (B, T, H, d_k)
        return x.transpose(1, 2)                                           # (B, H, T, d_k)


# ----------------------------------------------------------------------------- sublayers

def activation(x: Tensor, name: str) -> Tensor:
    """The feed-forward network's ``config.activation``: max(0, x) -- Eq. (2); ``silu``, ``gelu``: :mod:`.variants`.

    Shape: (...) -> (...).
    """
    if name == "relu":
        return torch.relu(x)
    if name in ACTIVATIONS:
        return narrow(ACTIVATIONS[name](wide(x)), x.dtype)
    raise ValueError(f"activation must be one of ('relu', 'silu', 'gelu'), got {name!r}")


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, act :func:`activation` (max(0, .) in the paper) -- Eq. (2), section 3.3.

    Shape: x (B, T, D) -> (B, T, D); the hidden layer (B, T, F).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.linear1 = _Linear(config.d_model, config.d_ff)
        self.linear2 = _Linear(config.d_ff, config.d_model)
        self.activation = config.activation

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(activation(self.linear1(x), self.activation))


class LayerNorm(nn.LayerNorm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, var biased, eps ``config.layer_norm_eps`` -- Ba et al., 3.1.

    Shape: x (..., D) -> (..., D).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__(config.d_model, eps=config.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        y, _, rstd = torch.native_layer_norm(wide(x), self.normalized_shape, wide(self.weight), wide(self.bias),
                                             self.eps)                      # rstd (..., 1): 1 / sqrt(var + eps)
        return narrow(torch.where(rstd == 0, torch.nan, y), x.dtype)       # rstd 0: the variance overflowed


def residual(x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: LayerNorm, norm_first: bool,
             dropout: Callable[[Tensor], Tensor]) -> Tensor:
    """Post-LN LayerNorm(x + Sublayer(x)) (the paper) or pre-LN x + Sublayer(LayerNorm(x)) -- 3.1 (its dropout: 5.4).

    Shape: x (B, T, D) -> (B, T, D).
    """
    if norm_first:
        return add(x, dropout(sublayer(norm(x))))
    return norm(add(x, dropout(sublayer(x))))


def add(x: Tensor, y: Tensor) -> Tensor:
    """x + y in x's precision (:mod:`.precision`). Shape: x (...), y broadcastable to x -> (...)."""
    return narrow(wide(x) + wide(y), x.dtype)


# ----------------------------------------------------------------------------- embeddings

def sinusoidal_positional_encoding(length: int, d_model: int, dtype: torch.dtype = torch.float64,
                                   device: torch.device | str | None = None, layout: str = "interleaved",
                                   pad_id: int = 0) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) -- section 3.5;
    another ``layout`` (``config.sinusoidal_layout``) as ``reference_numpy/variants.py`` defines it.

    Shape: returns (L, D) in ``dtype``, rows 0 .. L-1 ((L + 1, D) for ``fairseq``).
    """
    table = reference.sinusoidal_positional_encoding(length, d_model, dtype_name(dtype), layout, pad_id)
    return from_numpy(table).to(device=device)


class Embeddings(nn.Module):
    """Token embedding times sqrt(d_model) (1 unless ``config.scale_embeddings``) -- 3.4. Shape: (B, T) -> (B, T, D)."""

    def __init__(self, config: TransformerConfig, vocab_size: int):
        super().__init__()
        self.weight = _normal_parameter(vocab_size, config.d_model, std=config.d_model ** -0.5)  # (V, D)
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0

    def forward(self, tokens: Tensor) -> Tensor:
        return narrow(_embedding(tokens, self.weight) * self.scale, self.weight.dtype)


class PositionalEncoding(nn.Module):
    """x plus the encodings of positions ``offset`` .. ``offset`` + T - 1 -- section 3.5 (``learned``: Table 3 row E);
    the ``fairseq`` layout reads rows :func:`position_ids` of ``tokens`` (``by_step`` for the decoder's).

    Shape: x (B, T, D) -> (B, T, D), offset + T <= L; tokens (B, T) int or None.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.learned = config.positional_encoding == "learned"
        self.max_len, self.d_model = config.max_len, config.d_model
        self.layout, self.pad_id = config.sinusoidal_layout, config.pad_id
        self.table: Tensor
        self.position_offset = config.position_offset
        if self.learned:                                            # (L + offset, D): position t at row t + offset
            self.weight = _normal_parameter(config.max_len + config.position_offset, config.d_model,
                                            std=config.d_model ** -0.5)
        else:
            self.register_buffer("table", sinusoidal_positional_encoding(config.max_len, config.d_model,
                                                                         torch.get_default_dtype(), None,
                                                                         self.layout, self.pad_id),
                                 persistent=False)                        # (L, D), or (L + 1, D)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, offset: Index = 0, tokens: Tensor | None = None, by_step: bool = False) -> Tensor:
        table = self.weight[self.position_offset:] if self.learned else self.table
        if self.layout != "fairseq":
            return self.dropout(add(x, table[_positions(offset, x.shape[1])]))
        if tokens is None:
            return self.dropout(add(x, table[_positions(offset + 1, x.shape[1])]))
        return self.dropout(add(x, table[position_ids(tokens, self.pad_id, offset, by_step)]))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if not self.learned:
            self.table = sinusoidal_positional_encoding(self.max_len, self.d_model, self.table.dtype,
                                                        self.table.device, self.layout, self.pad_id)
        return self


class Generator(nn.Module):
    """log softmax(x W), with ``config.output_bias`` log softmax(x W + b) -- the pre-softmax linear map, 3.4.

    Shape: x (B, T, D) -> log-probabilities (B, T, V_tgt).

    PyTorch: ``weight`` (V, D) as ``nn.Linear``'s; with ``share_embeddings`` the shared ``embeddings``' weight.
    """

    def __init__(self, config: TransformerConfig, embeddings: Embeddings | None = None):
        super().__init__()
        if config.share_embeddings and embeddings is None:
            raise ValueError("a Generator with share_embeddings needs the shared Embeddings (embeddings=)")
        self.embeddings = embeddings
        if embeddings is None:
            self.weight = nn.Parameter(torch.empty(config.tgt_vocab_size, config.d_model))  # (V, D)
            nn.init.xavier_uniform_(self.weight)
        self.bias = nn.Parameter(torch.zeros(config.tgt_vocab_size)) if config.output_bias else None  # (V,)

    def forward(self, x: Tensor) -> Tensor:
        return log_softmax(self.logits(x))

    def logits(self, x: Tensor) -> Tensor:
        """x W (+ b), the log-softmax's logits (a low precision's widened). Shape: x (B, T, D) -> (B, T, V_tgt)."""
        weight = self.weight if self.embeddings is None else self.embeddings.weight          # (V, D)
        return wide(_linear(x, weight, self.bias))                                        # logits (B, T, V)


def log_softmax(x: Tensor) -> Tensor:
    """log softmax over the last axis, computed stably. Shape: (..., V) -> (..., V)."""
    return torch.log_softmax(x, dim=-1)


# ----------------------------------------------------------------------------- layers and stacks

class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in :func:`residual` -- section 3.1.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config)
        self.self_attn_norm = LayerNorm(config)
        self.ffn = PositionwiseFeedForward(config)
        self.ffn_norm = LayerNorm(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = residual(x, lambda h: self.self_attn(h, h, h, mask), self.self_attn_norm, self.norm_first,
                     self.dropout)
        return residual(x, self.ffn, self.ffn_norm, self.norm_first, self.dropout)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in :func:`residual` -- 3.1, 3.2.3.

    Shape: x (B, T, D), memory (B, S, D), src_mask broadcastable to (B, H, T, S), tgt_mask to (B, H, T, T or C) ->
    (B, T, D); with a ``cache`` (a self-attention's and the memory's, :mod:`.incremental`) ``(x, cache)``.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm_first = config.norm_first
        self.self_attn = MultiHeadAttention(config)
        self.self_attn_norm = LayerNorm(config)
        self.cross_attn = MultiHeadAttention(config)
        self.cross_attn_norm = LayerNorm(config)
        self.ffn = PositionwiseFeedForward(config)
        self.ffn_norm = LayerNorm(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, cache: tuple[KVCache, KVCache] | None = None) -> Any:
        self_cache, cross_cache = (None, None) if cache is None else cache
        kept: list[KVCache] = []                                           # the caches the attentions return
        x = residual(x, lambda h: _attend(self.self_attn, h, h, tgt_mask, self_cache, kept),
                     self.self_attn_norm, self.norm_first, self.dropout)
        x = residual(x, lambda h: _attend(self.cross_attn, h, memory, src_mask, cross_cache, kept),
                     self.cross_attn_norm, self.norm_first, self.dropout)
        x = residual(x, self.ffn, self.ffn_norm, self.norm_first, self.dropout)
        return x if cache is None else (x, tuple(kept))


class Encoder(nn.Module):
    """A stack of N encoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, S, D), mask broadcastable to (B, H, S, S) -> (B, S, D).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.norm = LayerNorm(config) if config.norm_first else None

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """A stack of N decoder layers -- section 3.1; pre-LN ends with a LayerNorm.

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); with a ``cache`` (a pair per layer) ``(x, cache)``.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        self.norm = LayerNorm(config) if config.norm_first else None

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                cache: tuple | None = None) -> Any:
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

class Transformer(_Model):
    """The encoder-decoder Transformer -- section 3, Figure 1.

    Shape: src (B, S) int, tgt (B, T) int (the target shifted right, from bos_id); src_mask broadcastable to
    (B, H, T or S, S), default :func:`padding_mask` of src; tgt_mask to (B, H, T, T), default :func:`target_mask` of tgt
    -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.src_embed = Embeddings(config, config.src_vocab_size)
        self.tgt_embed = self.src_embed if config.share_embeddings else Embeddings(config, config.tgt_vocab_size)
        self.src_pos = PositionalEncoding(config)
        self.tgt_pos = PositionalEncoding(config)
        self.src_embed_norm = LayerNorm(config) if config.embedding_norm else None
        self.tgt_embed_norm = LayerNorm(config) if config.embedding_norm else None
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.generator = Generator(config, self.tgt_embed if config.share_embeddings else None)

    def encode(self, src: Tensor | np.ndarray, src_mask: Tensor | np.ndarray | None = None) -> Tensor:
        """Embed the source and run the encoder stack. Shape: src (B, S) -> memory (B, S, D)."""
        src, src_mask = checked_source(self.config, src, src_mask, self.device)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        x = self.src_pos(self.src_embed(src), 0, src)
        x = self.src_embed_norm(x) if self.src_embed_norm is not None else x
        return self.encoder(x, src_mask)

    def init_cache(self, memory: Tensor | np.ndarray, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
        """The decoder's caches of ``capacity`` target positions (:func:`.incremental.decoder_cache`) -- 3.2.3."""
        return decoder_cache(self, memory, capacity)

    def decode(self, tgt: Tensor | np.ndarray, memory: Tensor | np.ndarray, src_mask: Tensor | np.ndarray | None = None,
               tgt_mask: Tensor | np.ndarray | None = None, cache: tuple | None = None) -> Any:
        """Embed the shifted target and run the decoder stack; with a ``cache``, from its ``position`` on -- 3.2.3.

        Shape: tgt (B, T), memory (B, S, D) -> (B, T, D), with a cache ``(out, cache)``; tgt_mask broadcastable to
        (B, H, T, T), or (B, H, T, C) with a cache (default: causal over absolute positions).
        """
        tgt, memory = checked_target(self.config, tgt, memory, dtype_name(self.dtype), self.device)
        cache, start, keys = _checked_cache(cache, tgt.shape[1])          # start: the first new position
        if tgt_mask is None and cache is None:  # with a cache and none given, each self-attention's causal mask over W
            tgt_mask = target_mask(tgt, self.config.pad_id)
        src_mask, tgt_mask = checked_decoder_masks(self.config, tuple(tgt.shape), memory.shape[1], keys, src_mask,
                                                   tgt_mask, self.device)
        y = self.tgt_pos(self.tgt_embed(tgt), start, tgt, by_step=True)
        y = self.tgt_embed_norm(y) if self.tgt_embed_norm is not None else y
        return self.decoder(y, memory, src_mask, tgt_mask, cache=cache)

    def __call__(self, src, tgt, src_mask=None, tgt_mask=None, *args, **kwargs):
        """Log-probabilities of the next target token at every target position.

        PyTorch: the inputs checked (ids on the host) before ``nn.Module.__call__``, which may run a compiled
        ``forward``.
        """
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        return super().__call__(src, tgt, src_mask, tgt_mask, *args, **kwargs)

    def forward(self, src: Tensor | np.ndarray, tgt: Tensor | np.ndarray, src_mask: Tensor | np.ndarray | None = None,
                tgt_mask: Tensor | np.ndarray | None = None) -> Tensor:
        """Log-probabilities of the next target token at every target position."""
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        if src_mask is None:
            src_mask = padding_mask(src, self.config.pad_id)
        memory = self.encode(src, src_mask)
        return self.generator(self.decode(tgt, memory, src_mask, tgt_mask))

    def _check_inputs(self, src: Tensor | np.ndarray, tgt: Tensor | np.ndarray, src_mask: Tensor | np.ndarray | None,
                      tgt_mask: Tensor | np.ndarray | None) -> tuple[Tensor, Tensor]:
        """Every check of the forward pass, made before any computation (``checks.checked_forward_inputs``)."""
        return checked_forward_inputs(self.config, src, tgt, src_mask, tgt_mask, self.device)
