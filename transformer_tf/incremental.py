"""Incremental decoding beside the model in TensorFlow: a parallel text of ``reference_numpy/incremental.py`` (the
key/value cache, attention over a cache and over beam hypotheses, the widths a cached step reads).

A cache is a ``NamedTuple`` of tensors passed in and returned (tensors are immutable: a write makes a new one), so
that a decoding loop under ``tf.function`` / XLA carries it; a traced step's position picks its width by
``tf.switch_case``. Eq. (1) is handed to it by the attention layer; :func:`beam_attention` shares Eq. (1)'s
masked softmax and fully masked row with it (:mod:`.softmax`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import tensorflow as tf

from reference_numpy import checks
from reference_numpy.incremental import attended_width, attended_widths

from . import speed
from .checks import check_beams, check_cache_index, checked_mask, checked_memory
from .precision import attention_product, computed_wide
from .softmax import masked_softmax, zero_fully_masked_rows

Index: TypeAlias = int | tf.Tensor          # a position or count: a Python int, or a scalar tensor (traced decoding)
# Eq. (1) with its mask: (query, key, value, mask, dtype=) -> (output, weights)
Attention = Callable[..., tuple[tf.Tensor, tf.Tensor]]


class KVCache(NamedTuple):
    """Keys and values of one attention sublayer kept between decoding steps -- section 3.2.3.

    Masked self-attention: C = the capacity, target positions 0 .. C-1 (zeros until written), ``position`` the next one
    written; encoder-decoder attention: the projected memory, C = S, ``position`` ``()`` (never written). ``beams``
    (B, K, C) int, in a beam search (section 6.1) whose N = B * K rows stay in place: position c of the hypothesis in
    row b*K + j is in row b*K + beams[b, j, c]; ``()``: every row holds its own positions.

    TensorFlow: fixed sizes, so that every shape stays static under XLA.
    """

    keys: tf.Tensor     # (B, H, C, d_k)
    values: tf.Tensor   # (B, H, C, d_k)
    beams: tf.Tensor | tuple = ()   # (B / K, K, C) int, or ()
    position: Any = ()   # the next position written (an int, or traced); () for the memory's keys and values

    @property
    def is_memory(self) -> bool:
        """Whether this is the memory's cache (encoder-decoder attention), which is read and never written."""
        return isinstance(self.position, tuple)

    def update(self, keys: tf.Tensor, values: tf.Tensor) -> KVCache:
        """This cache with ``keys`` and ``values`` (B, H, T_new, d_k) written at positions ``position`` .. ``position``
        + T_new - 1, the beam table marking them each row's own, and ``position`` advanced past them.

        TensorFlow: a new cache (a scatter, also under XLA; ``position`` may be traced).
        """
        cache_index = check_cache_index(self.position, keys.shape[2], self.keys.shape[2])
        return KVCache(_written(self.keys, keys, cache_index), _written(self.values, values, cache_index),
                       _written_beams(self.beams, cache_index, keys.shape[2]),
                       tf.convert_to_tensor(cache_index + keys.shape[2]))


def at_position(cache: tuple, position: Index) -> tuple:
    """The decoder's caches (:meth:`.model.Transformer.init_cache`) with every self-attention cache's next write at
    ``position``: the positions before it are the prefix decoded so far.
    """
    return tuple((own._replace(position=position), memory) for own, memory in cache)


def decoder_cache(model: Any, memory: tf.Tensor, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
    """The caches of ``model``'s decoder (:meth:`.model.Transformer.init_cache`) for ``capacity`` target positions: per
    layer an empty self-attention cache and the memory's keys and values -- section 3.2.3.

    Shape: memory (B, S, D) -> per layer (B, H, C, d_k), (B, H, S, d_k).
    """
    memory = checked_memory(memory, None, model.config.d_model, model.variable_dtype)
    checks.check_cache_capacity(capacity, model.config.max_len)
    return tuple((self_attention_cache(layer.self_attn, tf.shape(memory)[0], capacity),
                  memory_cache(layer.cross_attn, memory)) for layer in model.decoder.layers)


def self_attention_cache(attention: Any, batch: Index, capacity: int) -> KVCache:
    """An empty self-attention cache of ``capacity`` positions for ``attention`` (a :class:`.model.MultiHeadAttention`).

    Shape: keys and values (B, H, C, d_k), zeros.
    """
    empty = tf.zeros((batch, attention.n_heads, capacity, attention.config.d_k), attention.compute_dtype)
    return KVCache(empty, empty, position=tf.constant(0))


def memory_cache(attention: Any, memory: tf.Tensor) -> KVCache:
    """The memory's keys and values, projected once by ``attention`` for encoder-decoder attention.

    Shape: memory (B, S, D) -> keys and values (B, H, S, d_k).
    """
    keys, values, _ = _keys_values(attention, memory, memory, None)                 # (B, H, S, d_k)
    return KVCache(keys, values)


def _checked_cache(cache: tuple | None, length: int) -> tuple[tuple | None, Any, int]:
    """``(cache, start, keys)``: the decoder's caches (None: none), the position of the first of the ``length`` new
    positions and the number of key positions a self-attention reads (T without a cache, else the capacity C); every
    layer's beam table, and its memory's rows against its own, checked before any layer runs.

    TensorFlow: the position a tensor in the caches returned (Keras takes no int among a call's tensors).
    """
    if cache is None:
        return None, 0, length
    keys = cache[0][0].keys.shape[2]
    check_cache_index(cache[0][0].position, length, keys)
    cache = at_position(cache, tf.convert_to_tensor(cache[0][0].position))
    for own, memory in cache:
        _beam_table(own)
        checks.check_memory_rows(own.keys.shape[0], memory.keys.shape[0])
    return cache, cache[0][0].position, keys


def _returned(out: Any, *optional: Any) -> Any:
    """``out``, or ``(out, *results)`` with each optional result asked for (None: not asked), in the docstring's order,
    the cache last.
    """
    asked = tuple(result for result in optional if result is not None)
    return (out, *asked) if asked else out


def _keys_values(attention: Any, key: tf.Tensor, value: tf.Tensor,
                 cache: KVCache | None) -> tuple[tf.Tensor, tf.Tensor, KVCache | None]:
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


def _attend(attention: Any, query: tf.Tensor, memory: tf.Tensor, mask: tf.Tensor | None, cache: KVCache | None,
            kept: list) -> tf.Tensor:
    """``attention`` of ``query`` over ``memory``; with a ``cache``, the cache it returns appended to ``kept``."""
    if cache is None:
        return attention(query, memory, memory, mask)
    out, cache = attention(query, memory, memory, mask, cache=cache)
    kept.append(cache)
    return out


def _beam_table(cache: KVCache | None) -> tf.Tensor | None:
    """The cache's ``beams`` table, checked against its keys; None without one."""
    if cache is None or isinstance(cache.beams, tuple):
        return None
    check_beams(cache.beams, cache.keys.shape[0], cache.keys.shape[2])
    return cache.beams


def _cached_causal_mask(cache_index: Index, length: int, capacity: Index) -> tf.Tensor:
    """New position q (absolute position cache_index + q) may attend to cache positions j <= cache_index + q -- section
    3.2.3; later positions, not yet written, are hidden.

    Shape: mask (1, 1, T_new, C), bool, True = may attend.

    TensorFlow: ``cache_index`` may be a tensor (traced decoding).
    """
    query = tf.cast(cache_index, tf.int32) + tf.range(length)             # (T_new,)
    return (tf.range(capacity)[None, :] <= query[:, None])[None, None]


@computed_wide
def beam_attention(query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: tf.Tensor | None, beams: tf.Tensor, *,
                   dtype: Any = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Eq. (1) along each beam hypothesis (section 6.1): row b*K + j's queries attend over the keys and values of its
    own hypothesis, position c read from row b*K + beams[b, j, c] (:class:`KVCache`).

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), mask broadcastable to (N, H, Tq, C), beams (B, K, C) ->
    output (N, H, Tq, d_k), weights (N, H, Tq, C).

    TensorFlow: without gathering keys and values (:func:`.speed.beam_scores`, :func:`.speed.beam_mix`); ``dtype`` P
    computes by the autocast recipe.
    """
    scores = attention_product(functools.partial(speed.beam_scores, beams=beams), query, key, dtype)  # (N, H, Tq, C)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])
    out = attention_product(functools.partial(speed.beam_mix, beams=beams), weights, value, dtype)
    return zero_fully_masked_rows(out, mask), weights


def _along_beams(attention: Attention, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: tf.Tensor | None,
                 beams: tf.Tensor | None, dtype: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over ``key`` and ``value`` under
    ``mask``: Eq. (1) itself without a beam table, along each hypothesis (:func:`beam_attention`) with ``beams``.

    TensorFlow: ``dtype`` P computes by the autocast recipe.
    """
    if beams is None:
        return attention(query, key, value, mask, dtype=dtype)
    return beam_attention(query, key, value, mask, beams, dtype=dtype)


def _attend_cache(attention: Attention, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: tf.Tensor | None,
                  cache: KVCache | None, position: Index, return_weights: bool,
                  dtype: Any) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions ``position`` .. ``position`` +
    Tq - 1 over a ``cache``: the memory's keys and values (:func:`_attend_memory`), or a self-attention cache that
    holds the new positions, without a ``mask`` causally over its written positions (:func:`_attend_written`); along
    each hypothesis (:func:`beam_attention`) when it holds a beam table.

    TensorFlow: the weights when asked; ``dtype`` P computes by the autocast recipe.
    """
    if cache is not None and cache.is_memory:
        return _attend_memory(attention, query, key, value, mask, dtype)
    beams = _beam_table(cache)
    if mask is None:
        return _attend_written(attention, query, key, value, beams, position, return_weights, dtype)
    return _along_beams(attention, query, key, value, mask, beams, dtype)


def _attend_memory(attention: Attention, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, mask: tf.Tensor | None,
                   dtype: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over the memory's cached keys and
    values: Eq. (1) itself when they have a row per query row; the memory of B sentences read by N = B * K rows (a
    beam search's K hypotheses of each sentence, section 6.1) is attended by each sentence's K * Tq queries at once
    (:func:`_by_sentence`), so that its keys and values are projected and read once per sentence, not once per beam.

    Shape: query (N, H, Tq, d_k), key and value (B, H, S, d_k), mask broadcastable to (N, H, Tq, S) -> output
    (N, H, Tq, d_k), weights (N, H, Tq, S).

    TensorFlow: ``dtype`` P computes by the autocast recipe; rows of a count unknown when traced are attended as
    Eq. (1) itself.
    """
    rows, batch = query.shape[0], key.shape[0]
    if rows is None or batch is None or rows == batch:
        return attention(query, key, value, mask, dtype=dtype)
    if mask is not None:
        heads = mask.shape[-3] if mask.shape.rank > 2 else 1                             # 1 or H
        shape = (rows, heads, tf.shape(query)[2], tf.shape(key)[2])
        mask = _by_sentence(tf.broadcast_to(mask, shape), batch)                         # (B, 1 or H, K*Tq, S)
    out, weights = attention(_by_sentence(query, batch), key, value, mask, dtype=dtype)
    return _by_row(out, rows), _by_row(weights, rows)


def _by_sentence(x: tf.Tensor, batch: int) -> tf.Tensor:
    """The N = B * K rows of B sentences as B rows, each holding its sentence's K rows one after the other along
    the third axis. Shape: (N, H, T, Z) -> (B, H, K*T, Z)."""
    rows, heads, length, width = x.shape[0], tf.shape(x)[1], tf.shape(x)[2], tf.shape(x)[3]
    x = tf.transpose(tf.reshape(x, (batch, rows // batch, heads, length, width)), (0, 2, 1, 3, 4))   # (B, H, K, T, Z)
    return tf.reshape(x, (batch, heads, -1, width))


def _by_row(x: tf.Tensor, rows: int) -> tf.Tensor:
    """:func:`_by_sentence` undone. Shape: (B, H, K*T, Z) -> (N, H, T, Z)."""
    batch, heads, width = x.shape[0], tf.shape(x)[1], tf.shape(x)[3]
    x = tf.transpose(tf.reshape(x, (batch, heads, rows // batch, -1, width)), (0, 2, 1, 3, 4))       # (B, K, H, T, Z)
    return tf.reshape(x, (rows, heads, -1, width))


def _attend_written(attention: Attention, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor,
                    beams: tf.Tensor | None, cache_index: Index, return_weights: bool,
                    dtype: Any) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions cache_index .. cache_index + Tq
    - 1 over a self-attention cache, causally (:func:`_cached_causal_mask`), reading only its first W positions
    (``attended_width``: the rest are not yet written), along each hypothesis with ``beams`` (:func:`beam_attention`);
    the weights (N, H, Tq, C), zero after W.

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), beams (B, K, C) or None.

    TensorFlow: at a traced ``cache_index`` ``tf.switch_case`` picks the branch of W among ``attended_widths``
    (all C when C is not known when tracing); the weights when asked.
    """
    capacity, length = key.shape[2], query.shape[2]
    cache_index = check_cache_index(cache_index, length, capacity)     # an int, unless traced

    def over(width: Index) -> tuple[tf.Tensor, tf.Tensor | None]:
        key_w, value_w, mask = key[:, :, :width], value[:, :, :width], _cached_causal_mask(cache_index, length, width)
        beams_w = None if beams is None else beams[:, :, :width]
        heads, weights = _along_beams(attention, query, key_w, value_w, mask, beams_w, dtype)
        return heads, tf.pad(weights, [[0, 0]] * 3 + [[0, tf.shape(key)[2] - width]]) if return_weights else None

    if capacity is None:
        return over(tf.shape(key)[2])
    if isinstance(cache_index, int):
        return over(attended_width(capacity, cache_index + length))
    widths = attended_widths(capacity)
    branch = tf.searchsorted(tf.constant(widths), tf.reshape(tf.cast(cache_index, tf.int32) + length, [1]))[0]
    if return_weights:
        return tuple(tf.switch_case(branch, [functools.partial(over, width) for width in widths]))
    return tf.switch_case(branch, [lambda width=width: over(width)[0] for width in widths]), None


def _written(buffer: tf.Tensor, new: tf.Tensor, index: Index) -> tf.Tensor:
    """``buffer`` (B, H, C, d_k) with positions index .. index + T_new - 1 set to ``new`` (B, H, T_new, d_k).

    TensorFlow: a new tensor, by a scatter (also under XLA; ``index`` may be traced).
    """
    shape = tf.shape(new)
    positions = tf.cast(index, tf.int32) + tf.range(shape[2])               # (T_new,)
    batch, heads, position = tf.meshgrid(tf.range(shape[0]), tf.range(shape[1]), positions,
                                         indexing="ij")                   # each (B, H, T_new)
    return tf.tensor_scatter_nd_update(buffer, tf.stack([batch, heads, position], axis=-1), new)


def _written_beams(beams: tf.Tensor | tuple, index: Index, length: int) -> tf.Tensor | tuple:
    """The ``beams`` table (B, K, C) with positions index .. index + length - 1 each row's own
    (what the keys' write wrote there); ``()`` stays ``()``.
    """
    if isinstance(beams, tuple):
        return beams
    position = tf.range(beams.shape[2]) - tf.cast(index, tf.int32)       # (C,)
    own = tf.range(beams.shape[1], dtype=beams.dtype)[None, :, None]     # (1, K, 1)
    return tf.where((position >= 0) & (position < length), own, beams)
