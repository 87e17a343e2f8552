"""Incremental decoding beside the model (section 3.2.3): the key/value cache, attention over a cache and over beam
hypotheses, and the widths a cached step reads.

:mod:`.model` is section 3 alone; its attention takes one :class:`KVCache`, which carries the position its new keys
are written at, and hands attention over a cache to this module (:func:`_attend_cache`): over the memory's keys and
values, once per sentence for a beam search's rows (:func:`_attend_memory`); causal over the written positions
(:func:`_attend_written`), and along each hypothesis of a beam search (:func:`beam_attention`).
Eq. (1) is handed to it by the attention layer; :func:`beam_attention` shares Eq. (1)'s masked softmax and fully
masked row with it (:mod:`.softmax`). Every port's ``incremental.py`` has the same names in the same order
(tests/project/test_parallel_texts.py).

Shape legend (besides :mod:`.model`'s): C the cache's capacity in target positions, W the positions a step reads
(:func:`attended_widths`), K beams per sentence, N = B * K rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .checks import (
    as_array,
    check_beams,
    check_cache_capacity,
    check_cache_index,
    check_memory,
    check_memory_rows,
    checked_mask,
)
from .precision import attention_product, computed_wide
from .softmax import masked_softmax, zero_fully_masked_rows

# Eq. (1) with its mask: (query, key, value, mask) -> (output, weights)
Attention = Callable[..., tuple[np.ndarray, np.ndarray]]


# The narrowest width a causal step over a self-attention cache reads (:func:`attended_widths`): the tests' models
# (max_len 64) read their whole cache; a budget of hundreds of positions reads 64, 128, 256 ... as it fills.
ATTENDED_WIDTH = 64


def attended_widths(capacity: int) -> tuple[int, ...]:
    """The widths W a causal step over a self-attention cache of ``capacity`` C reads: :data:`ATTENDED_WIDTH`,
    twice that, and so on below C, then C. A step reads the narrowest W holding every position written so far
    (:func:`attended_width`): the positions after them are not yet written and the causal mask hides them, so a
    step's work grows with its hypothesis, not with C -- a budget of 511 tokens would otherwise have every step read
    511 positions of every layer's cache. Every port reads
    the same W (a program traced with the step's position unknown holds one branch per width)."""
    widths: list[int] = []
    while (width := ATTENDED_WIDTH << len(widths)) < capacity:
        widths.append(width)
    return (*widths, capacity)


def attended_width(capacity: int, written: int) -> int:
    """The narrowest of :func:`attended_widths` holding the ``written`` positions 0 .. written - 1."""
    return next(width for width in attended_widths(capacity) if width >= written)


class KVCache(NamedTuple):
    """Keys and values of one attention sublayer kept between decoding steps -- section 3.2.3.

    Masked self-attention: C = the capacity, target positions 0 .. C-1 (zeros until written), ``position`` the next one
    written; encoder-decoder attention: the projected memory, C = S, ``position`` ``()`` (never written). ``beams``
    (B, K, C) int, in a beam search (section 6.1) whose N = B * K rows stay in place: position c of the hypothesis in
    row b*K + j is in row b*K + beams[b, j, c]; ``()``: every row holds its own positions.
    """

    keys: np.ndarray    # (B, H, C, d_k)
    values: np.ndarray  # (B, H, C, d_k)
    beams: np.ndarray | tuple = ()   # (B / K, K, C) int, or ()
    position: Any = ()   # the next position written (an int, or traced); () for the memory's keys and values

    @property
    def is_memory(self) -> bool:
        """Whether this is the memory's cache (encoder-decoder attention), which is read and never written."""
        return isinstance(self.position, tuple)

    def update(self, keys: np.ndarray, values: np.ndarray) -> KVCache:
        """This cache with ``keys`` and ``values`` (B, H, T_new, d_k) written at positions ``position`` .. ``position``
        + T_new - 1, the beam table marking them each row's own, and ``position`` advanced past them.

        NumPy: a new cache, this one left as it was.
        """
        start = check_cache_index(self.position, keys.shape[2], self.keys.shape[2])
        return KVCache(_written(self.keys, keys, start), _written(self.values, values, start),
                       _written_beams(self.beams, start, keys.shape[2]), start + keys.shape[2])


def at_position(cache: tuple, position: int) -> tuple:
    """The decoder's caches (:meth:`.model.Transformer.init_cache`) with every self-attention cache's next write at
    ``position``: the positions before it are the prefix decoded so far.
    """
    return tuple((own._replace(position=position), memory) for own, memory in cache)


def decoder_cache(model: Any, memory: np.ndarray, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
    """The caches of ``model``'s decoder (:meth:`.model.Transformer.init_cache`) for ``capacity`` target positions: per
    layer an empty self-attention cache and the memory's keys and values -- section 3.2.3.

    Shape: memory (B, S, D) -> per layer (B, H, C, d_k), (B, H, S, d_k).
    """
    memory = as_array("memory", memory)
    check_memory(memory.shape, memory.dtype.name, memory.shape[0] if memory.ndim else None,
                 model.config.d_model, model.dtype.name)
    check_cache_capacity(capacity, model.config.max_len)
    return tuple((self_attention_cache(layer.self_attn, len(memory), capacity),
                  memory_cache(layer.cross_attn, memory)) for layer in model.decoder.layers)


def self_attention_cache(attention: Any, batch: int, capacity: int) -> KVCache:
    """An empty self-attention cache of ``capacity`` positions for ``attention`` (a :class:`.model.MultiHeadAttention`).

    Shape: keys and values (B, H, C, d_k), zeros.
    """
    weight = attention.q_proj.weight
    shape = (batch, attention.n_heads, capacity, weight.shape[1] // attention.n_heads)
    return KVCache(np.zeros(shape, weight.dtype), np.zeros(shape, weight.dtype), position=0)


def memory_cache(attention: Any, memory: np.ndarray) -> KVCache:
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
        check_memory_rows(own.keys.shape[0], memory.keys.shape[0])
    return cache, start, keys


def _returned(out: Any, *optional: Any) -> Any:
    """``out``, or ``(out, *results)`` with each optional result asked for (None: not asked), in the docstring's order,
    the cache last.
    """
    asked = tuple(result for result in optional if result is not None)
    return (out, *asked) if asked else out


def _keys_values(attention: Any, key: np.ndarray, value: np.ndarray,
                 cache: KVCache | None) -> tuple[np.ndarray, np.ndarray, KVCache | None]:
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


def _attend(attention: Any, query: np.ndarray, memory: np.ndarray, mask: np.ndarray | None, cache: KVCache | None,
            kept: list) -> np.ndarray:
    """``attention`` of ``query`` over ``memory``; with a ``cache``, the cache it returns appended to ``kept``."""
    if cache is None:
        return attention(query, memory, memory, mask)
    out, cache = attention(query, memory, memory, mask, cache=cache)
    kept.append(cache)
    return out


def _beam_table(cache: KVCache | None) -> np.ndarray | None:
    """The cache's ``beams`` table, checked against its keys; None without one."""
    if cache is None or isinstance(cache.beams, tuple):
        return None
    beams = as_array("cache.beams", cache.beams)
    check_beams(beams.shape, beams.dtype.name, cache.keys.shape[0], cache.keys.shape[2])
    return beams


def _cached_causal_mask(cache_index: int, length: int, capacity: int) -> np.ndarray:
    """New position q (absolute position cache_index + q) may attend to cache positions j <= cache_index + q -- section
    3.2.3; later positions, not yet written, are hidden.

    Shape: mask (1, 1, T_new, C), bool, True = may attend.
    """
    return (np.arange(capacity) <= cache_index + np.arange(length)[:, None])[None, None]


@computed_wide
def beam_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None,
                   beams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (1) along each beam hypothesis (section 6.1): row b*K + j's queries attend over the keys and values of its
    own hypothesis, position c read from row b*K + beams[b, j, c] (:class:`KVCache`).

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), mask broadcastable to (N, H, Tq, C), beams (B, K, C) ->
    output (N, H, Tq, d_k), weights (N, H, Tq, C).

    NumPy: the definition, Eq. (1) over each hypothesis's keys and values gathered (:func:`_own_hypothesis`).
    """
    key, value = _own_hypothesis(key, beams), _own_hypothesis(value, beams)   # (N, H, C, d_k)
    scores = attention_product(query, np.swapaxes(key, -1, -2))        # (N, H, Tq, C)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])
    return zero_fully_masked_rows(attention_product(weights, value), mask), weights


def _along_beams(attention: Attention, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None,
                 beams: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over ``key`` and ``value`` under
    ``mask``: Eq. (1) itself without a beam table, along each hypothesis (:func:`beam_attention`) with ``beams``."""
    if beams is None:
        return attention(query, key, value, mask)
    return beam_attention(query, key, value, mask, beams)


def _attend_cache(attention: Attention, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                  mask: np.ndarray | None, cache: KVCache | None, position: int) -> tuple[np.ndarray, np.ndarray]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions ``position`` .. ``position`` +
    Tq - 1 over a ``cache``: the memory's keys and values (:func:`_attend_memory`), or a self-attention cache that
    holds the new positions, without a ``mask`` causally over its written positions (:func:`_attend_written`); along
    each hypothesis (:func:`beam_attention`) when it holds a beam table."""
    if cache is not None and cache.is_memory:
        return _attend_memory(attention, query, key, value, mask)
    beams = _beam_table(cache)
    if mask is None:
        return _attend_written(attention, query, key, value, beams, position)
    return _along_beams(attention, query, key, value, mask, beams)


def _attend_memory(attention: Attention, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                   mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over the memory's cached keys and
    values: Eq. (1) itself when they have a row per query row; the memory of B sentences read by N = B * K rows (a
    beam search's K hypotheses of each sentence, section 6.1) is attended by each sentence's K * Tq queries at once
    (:func:`_by_sentence`), so that its keys and values are projected and read once per sentence, not once per beam.

    Shape: query (N, H, Tq, d_k), key and value (B, H, S, d_k), mask broadcastable to (N, H, Tq, S) -> output
    (N, H, Tq, d_k), weights (N, H, Tq, S).
    """
    rows, _, length, _ = query.shape
    batch = key.shape[0]
    if rows == batch:
        return attention(query, key, value, mask)
    if mask is not None:
        heads = mask.shape[-3] if mask.ndim > 2 else 1                                   # 1 or H
        mask = _by_sentence(np.broadcast_to(mask, (rows, heads, length, key.shape[2])), batch)   # (B, 1 or H, K*Tq, S)
    out, weights = attention(_by_sentence(query, batch), key, value, mask)
    return _by_row(out, rows), _by_row(weights, rows)


def _by_sentence(x: np.ndarray, batch: int) -> np.ndarray:
    """The N = B * K rows of B sentences as B rows, each holding its sentence's K rows one after the other along
    the third axis. Shape: (N, H, T, Z) -> (B, H, K*T, Z)."""
    rows, heads, length, width = x.shape
    x = x.reshape(batch, rows // batch, heads, length, width).transpose(0, 2, 1, 3, 4)   # (B, H, K, T, Z)
    return x.reshape(batch, heads, -1, width)


def _by_row(x: np.ndarray, rows: int) -> np.ndarray:
    """:func:`_by_sentence` undone. Shape: (B, H, K*T, Z) -> (N, H, T, Z)."""
    batch, heads, _, width = x.shape
    x = x.reshape(batch, heads, rows // batch, -1, width).transpose(0, 2, 1, 3, 4)       # (B, K, H, T, Z)
    return x.reshape(rows, heads, -1, width)


def _attend_written(attention: Attention, query: np.ndarray, key: np.ndarray, value: np.ndarray,
                    beams: np.ndarray | None, cache_index: int) -> tuple[np.ndarray, np.ndarray]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions cache_index .. cache_index + Tq
    - 1 over a self-attention cache, causally (:func:`_cached_causal_mask`), reading only its first W positions
    (``attended_width``: the rest are not yet written), along each hypothesis with ``beams`` (:func:`beam_attention`);
    the weights (N, H, Tq, C), zero after W.

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), beams (B, K, C) or None.
    """
    capacity, length = key.shape[2], query.shape[2]
    cache_index = check_cache_index(cache_index, length, capacity)
    width = attended_width(capacity, cache_index + length)
    key, value, mask = key[:, :, :width], value[:, :, :width], _cached_causal_mask(cache_index, length, width)
    heads, weights = _along_beams(attention, query, key, value, mask, None if beams is None else beams[:, :, :width])
    return heads, np.pad(weights, [(0, 0)] * 3 + [(0, capacity - width)])       # (N, H, Tq, C)


def _written(buffer: np.ndarray, new: np.ndarray, index: int) -> np.ndarray:
    """``buffer`` (B, H, C, d_k) with positions index .. index + T_new - 1 set to ``new`` (B, H, T_new, d_k).

    NumPy: a copy.
    """
    buffer = buffer.copy()
    buffer[:, :, index:index + new.shape[2]] = new
    return buffer


def _written_beams(beams: np.ndarray | tuple, index: int, length: int) -> np.ndarray | tuple:
    """The ``beams`` table (B, K, C) with positions index .. index + length - 1 each row's own
    (what the keys' write wrote there); ``()`` stays ``()``.

    NumPy: a copy.
    """
    if isinstance(beams, tuple):
        return beams
    beams = beams.copy()
    beams[:, :, index:index + length] = np.arange(beams.shape[1])[:, None]
    return beams


def _own_hypothesis(x: np.ndarray, beams: np.ndarray) -> np.ndarray:
    """Each row's keys (or values) along its hypothesis: position c of row b*K + j taken from
    row b*K + beams[b, j, c]. Shape: x (N, H, C, d_k), beams (B, K, C) -> (N, H, C, d_k)."""
    batch, k, capacity = beams.shape
    rows = (np.arange(batch)[:, None, None] * k + beams).reshape(batch * k, capacity)   # (N, C)
    return x[rows, :, np.arange(capacity)].transpose(0, 2, 1, 3)        # (N, C, H, d_k) -> (N, H, C, d_k)
