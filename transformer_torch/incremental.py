"""Incremental decoding beside the model in PyTorch: a parallel text of ``reference_numpy/incremental.py`` (the
key/value cache, attention over a cache and over beam hypotheses, the widths a cached step reads).

A cache is written in place (at a traced position, as in an exported decoding step, into new tensors, as JAX's
and TensorFlow's ports write). Eq. (1) is handed to it by the attention layer; :func:`beam_attention` shares
Eq. (1)'s masked softmax and fully masked row with it (:mod:`.softmax`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# every text takes both widths functions: a traced position (JAX, TensorFlow) picks among the widths; a compiled
# PyTorch step reads them all
from reference_numpy import checks
from reference_numpy.incremental import attended_width, attended_widths  # noqa: F401

from . import speed
from .checks import check_beams, check_cache_index, checked_mask, checked_memory
from .precision import computed_wide, dtype_name
from .softmax import masked_softmax, zero_fully_masked_rows

Index: TypeAlias = int | Tensor             # a position: a Python int, or a 0-d tensor (an exported decoding step)
# Eq. (1) with its mask: (query, key, value, mask, return_weights) -> (output, weights)
Attention = Callable[..., tuple[Tensor, Tensor | None]]


class KVCache(NamedTuple):
    """Keys and values of one attention sublayer kept between decoding steps -- section 3.2.3.

    Masked self-attention: C = the capacity, target positions 0 .. C-1 (zeros until written), ``position`` the next one
    written; encoder-decoder attention: the projected memory, C = S, ``position`` ``()`` (never written). ``beams``
    (B, K, C) int, in a beam search (section 6.1) whose N = B * K rows stay in place: position c of the hypothesis in
    row b*K + j is in row b*K + beams[b, j, c]; ``()``: every row holds its own positions.
    """

    keys: Tensor    # (B, H, C, d_k)
    values: Tensor  # (B, H, C, d_k)
    beams: Tensor | tuple = ()   # (B / K, K, C) int, or ()
    position: Any = ()   # the next position written (an int, or traced); () for the memory's keys and values

    @property
    def is_memory(self) -> bool:
        """Whether this is the memory's cache (encoder-decoder attention), which is read and never written."""
        return isinstance(self.position, tuple)

    def update(self, keys: Tensor, values: Tensor) -> KVCache:
        """This cache with ``keys`` and ``values`` (B, H, T_new, d_k) written at positions ``position`` .. ``position``
        + T_new - 1, the beam table marking them each row's own, and ``position`` advanced past them.

        PyTorch: in place at an int position (the same tensors), into new tensors at a traced one.
        """
        start = check_cache_index(self.position, keys.shape[2], self.keys.shape[2])
        return KVCache(_written(self.keys, keys, start), _written(self.values, values, start),
                       _written_beams(self.beams, start, keys.shape[2]), start + keys.shape[2])


def at_position(cache: tuple, position: Index) -> tuple:
    """The decoder's caches (:meth:`.model.Transformer.init_cache`) with every self-attention cache's next write at
    ``position``: the positions before it are the prefix decoded so far.
    """
    return tuple((own._replace(position=position), memory) for own, memory in cache)


def decoder_cache(model: Any, memory: Tensor | np.ndarray, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
    """The caches of ``model``'s decoder (:meth:`.model.Transformer.init_cache`) for ``capacity`` target positions: per
    layer an empty self-attention cache and the memory's keys and values -- section 3.2.3.

    Shape: memory (B, S, D) -> per layer (B, H, C, d_k), (B, H, S, d_k).
    """
    memory = checked_memory(memory, None, model.config.d_model, dtype_name(model.dtype), model.device)
    checks.check_cache_capacity(capacity, model.config.max_len)
    return tuple((self_attention_cache(layer.self_attn, memory.shape[0], capacity),
                  memory_cache(layer.cross_attn, memory)) for layer in model.decoder.layers)


def self_attention_cache(attention: Any, batch: int, capacity: int) -> KVCache:
    """An empty self-attention cache of ``capacity`` positions for ``attention`` (a :class:`.model.MultiHeadAttention`).

    Shape: keys and values (B, H, C, d_k), zeros.
    """
    d_k = attention.q_proj.out_features // attention.n_heads
    weight = attention.q_proj.weight
    return KVCache(weight.new_zeros(batch, attention.n_heads, capacity, d_k),
                   weight.new_zeros(batch, attention.n_heads, capacity, d_k), position=0)


def memory_cache(attention: Any, memory: Tensor) -> KVCache:
    """The memory's keys and values, projected once by ``attention`` for encoder-decoder attention.

    Shape: memory (B, S, D) -> keys and values (B, H, S, d_k).
    """
    keys, values, _ = _keys_values(attention, memory, memory, None)                 # (B, H, S, d_k)
    return KVCache(keys, values)


def _checked_cache(cache: tuple | None, length: int) -> tuple[tuple | None, Any, int]:
    """``(cache, start, keys)``: the decoder's caches (None: none), the position of the first of the ``length`` new
    positions and the number of key positions a self-attention reads (T without a cache, else the capacity C); every
    layer's beam table, and its memory's rows against its own, checked before any layer runs."""
    if cache is None:
        return None, 0, length
    keys = cache[0][0].keys.shape[2]
    start = check_cache_index(cache[0][0].position, length, keys)
    for own, memory in cache:
        _beam_table(own)
        checks.check_memory_rows(own.keys.shape[0], memory.keys.shape[0])
    return cache, start, keys


def _returned(out: Any, *optional: Any) -> Any:
    """``out``, or ``(out, *results)`` with each optional result asked for (None: not asked), in the docstring's order,
    the cache last.
    """
    asked = tuple(result for result in optional if result is not None)
    return (out, *asked) if asked else out


def _keys_values(attention: Any, key: Tensor, value: Tensor,
                 cache: KVCache | None) -> tuple[Tensor, Tensor, KVCache | None]:
    """The keys and values ``attention`` attends over and the cache it returns: the memory's cached ones, or the new
    ones projected (and, with a self-attention cache, written into it)."""
    if cache is not None and cache.is_memory:
        return cache.keys, cache.values, cache                             # (B, H, S, d_k)
    k = attention._split_heads(attention.k_proj(key))                      # (B, H, Tk, d_k)
    v = attention._split_heads(attention.v_proj(value))                    # (B, H, Tk, d_k)
    if cache is None:
        return k, v, None
    cache = cache.update(k, v)
    return cache.keys, cache.values, cache                                 # (B, H, C, d_k)


def _attend(attention: Any, query: Tensor, memory: Tensor, mask: Tensor | None, cache: KVCache | None,
            kept: list) -> Tensor:
    """``attention`` of ``query`` over ``memory``; with a ``cache``, the cache it returns appended to ``kept``."""
    if cache is None:
        return attention(query, memory, memory, mask)
    out, cache = attention(query, memory, memory, mask, cache=cache)
    kept.append(cache)
    return out


def _beam_table(cache: KVCache | None) -> Tensor | None:
    """The cache's ``beams`` table, checked against its keys; None without one."""
    if cache is None or isinstance(cache.beams, tuple):
        return None
    check_beams(cache.beams, cache.keys.shape[0], cache.keys.shape[2])
    return cache.beams


def _cached_causal_mask(cache_index: Index, length: int, capacity: int, device: torch.device) -> Tensor:
    """New position q (absolute position cache_index + q) may attend to cache positions j <= cache_index + q -- section
    3.2.3; later positions, not yet written, are hidden.

    Shape: mask (1, 1, T_new, C), bool, True = may attend.

    PyTorch: ``cache_index`` may be a traced tensor (an exported step).
    """
    keys, queries = torch.arange(capacity, device=device), torch.arange(length, device=device)
    return (keys <= cache_index + queries[:, None])[None, None]


@computed_wide
def beam_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                   beams: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. (1) along each beam hypothesis (section 6.1): row b*K + j's queries attend over the keys and values of its
    own hypothesis, position c read from row b*K + beams[b, j, c] (:class:`KVCache`).

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), mask broadcastable to (N, H, Tq, C), beams (B, K, C) ->
    output (N, H, Tq, d_k), weights (N, H, Tq, C).

    PyTorch: without gathering keys and values (:func:`.speed.beam_scores`, :func:`.speed.beam_mix`).
    """
    if mask is not None:
        mask = checked_mask("mask", mask, (*query.shape[:-1], key.shape[-2]), query.device)
    scores = speed.beam_scores(query, key, beams)                       # (N, H, Tq, C)
    weights = masked_softmax(scores, mask, query.shape[-1])
    return zero_fully_masked_rows(speed.beam_mix(weights, value, beams), mask), weights


def _along_beams(attention: Attention, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                 beams: Tensor | None, return_weights: bool) -> tuple[Tensor, Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over ``key`` and ``value`` under
    ``mask``: Eq. (1) itself without a beam table, along each hypothesis (:func:`beam_attention`) with ``beams``.

    PyTorch: the weights when asked.
    """
    if beams is None:
        return attention(query, key, value, mask, return_weights)
    heads, weights = beam_attention(query, key, value, mask, beams)
    return heads, (weights if return_weights else None)


def _attend_cache(attention: Attention, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                  cache: KVCache | None, position: Index, return_weights: bool) -> tuple[Tensor, Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions ``position`` .. ``position`` +
    Tq - 1 over a ``cache``: the memory's keys and values (:func:`_attend_memory`), or a self-attention cache that
    holds the new positions, without a ``mask`` causally over its written positions (:func:`_attend_written`); along
    each hypothesis (:func:`beam_attention`) when it holds a beam table.

    PyTorch: the weights when asked.
    """
    if cache is not None and cache.is_memory:
        return _attend_memory(attention, query, key, value, mask, return_weights)
    beams = _beam_table(cache)
    if mask is None:
        return _attend_written(attention, query, key, value, beams, position, return_weights)
    return _along_beams(attention, query, key, value, mask, beams, return_weights)


def _attend_memory(attention: Attention, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over the memory's cached keys and
    values: Eq. (1) itself when they have a row per query row; the memory of B sentences read by N = B * K rows (a
    beam search's K hypotheses of each sentence, section 6.1) is attended by each sentence's K * Tq queries at once
    (:func:`_by_sentence`), so that its keys and values are projected and read once per sentence, not once per beam.

    Shape: query (N, H, Tq, d_k), key and value (B, H, S, d_k), mask broadcastable to (N, H, Tq, S) -> output
    (N, H, Tq, d_k), weights (N, H, Tq, S).

    PyTorch: the weights when asked.
    """
    rows, _, length, _ = query.shape
    batch = key.shape[0]
    if rows == batch:
        return attention(query, key, value, mask, return_weights)
    if mask is not None:
        heads = mask.shape[-3] if mask.dim() > 2 else 1                                  # 1 or H
        mask = _by_sentence(mask.expand(rows, heads, length, key.shape[2]), batch)      # (B, 1 or H, K*Tq, S)
    out, weights = attention(_by_sentence(query, batch), key, value, mask, return_weights)
    return _by_row(out, rows), (None if weights is None else _by_row(weights, rows))


def _by_sentence(x: Tensor, batch: int) -> Tensor:
    """The N = B * K rows of B sentences as B rows, each holding its sentence's K rows one after the other along
    the third axis. Shape: (N, H, T, Z) -> (B, H, K*T, Z)."""
    rows, heads, length, width = x.shape
    x = x.reshape(batch, rows // batch, heads, length, width).transpose(1, 2)   # (B, H, K, T, Z)
    return x.reshape(batch, heads, -1, width)


def _by_row(x: Tensor, rows: int) -> Tensor:
    """:func:`_by_sentence` undone. Shape: (B, H, K*T, Z) -> (N, H, T, Z)."""
    batch, heads, _, width = x.shape
    x = x.reshape(batch, heads, rows // batch, -1, width).transpose(1, 2)       # (B, K, H, T, Z)
    return x.reshape(rows, heads, -1, width)


def _attend_written(attention: Attention, query: Tensor, key: Tensor, value: Tensor, beams: Tensor | None,
                    cache_index: Index, return_weights: bool) -> tuple[Tensor, Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions cache_index .. cache_index + Tq
    - 1 over a self-attention cache, causally (:func:`_cached_causal_mask`), reading only its first W positions
    (``attended_width``: the rest are not yet written), along each hypothesis with ``beams`` (:func:`beam_attention`);
    the weights (N, H, Tq, C), zero after W.

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), beams (B, K, C) or None.

    PyTorch: W = C at a traced ``cache_index``; the weights when asked.
    """
    capacity, length = key.shape[2], query.shape[2]
    cache_index = check_cache_index(cache_index, length, capacity)     # an int, unless traced
    width = capacity if isinstance(cache_index, Tensor) else attended_width(capacity, cache_index + length)
    key, value = key[:, :, :width], value[:, :, :width]
    mask = _cached_causal_mask(cache_index, length, width, query.device)
    heads, weights = _along_beams(attention, query, key, value, mask, None if beams is None else beams[:, :, :width],
                                  return_weights)
    if weights is None or not return_weights:
        return heads, None
    return heads, F.pad(weights, (0, capacity - width))                  # (N, H, Tq, C)


def _written(buffer: Tensor, new: Tensor, index: Index) -> Tensor:
    """``buffer`` (B, H, C, d_k) with positions index .. index + T_new - 1 set to ``new`` (B, H, T_new, d_k).

    PyTorch: by :func:`_write_at`.
    """
    return _write_at(buffer, new, _positions(index, new.shape[2]))


def _written_beams(beams: Tensor | tuple, index: Index, length: int) -> Tensor | tuple:
    """The ``beams`` table (B, K, C) with positions index .. index + length - 1 each row's own
    (what the keys' write wrote there); ``()`` stays ``()``.

    PyTorch: by :func:`_write_at`.
    """
    if isinstance(beams, tuple):
        return beams
    own = torch.arange(beams.shape[1], device=beams.device, dtype=beams.dtype)              # (K,)
    return _write_at(beams, own[None, :, None].expand(beams.shape[0], -1, length), _positions(index, length))


def _write_at(buffer: Tensor, new: Tensor, positions: slice | Tensor) -> Tensor:
    """``buffer`` with ``positions`` (:func:`_positions`) of its third axis set to ``new``: in place at a slice
    (eager decoding: ``buffer`` itself is returned), into a new tensor at traced positions (an exported step: its
    inputs stay as they were)."""
    if isinstance(positions, slice):
        buffer[:, :, positions] = new
        return buffer
    return buffer.index_copy(2, positions, new)


def _positions(start: Index, length: int) -> slice | Tensor:
    """Positions start .. start + length - 1 as an index: a slice, or, from a traced ``start`` (an exported
    decoding step), a (length,) tensor."""
    if isinstance(start, Tensor):
        return start + torch.arange(length, device=start.device)
    return slice(start, start + length)
