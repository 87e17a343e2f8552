"""Incremental decoding beside the model in JAX: a parallel text of ``reference_numpy/incremental.py`` (the
key/value cache, attention over a cache and over beam hypotheses, the widths a cached step reads).

A cache is a pytree (a ``NamedTuple`` of arrays) passed in and returned, never module state, so that a decoding
loop under ``jit`` / ``lax.while_loop`` carries it; a traced step's position picks its width by ``lax.switch``.
Eq. (1) is handed to it by the attention layer; :func:`beam_attention` shares Eq. (1)'s masked softmax and
fully masked row with it (:mod:`.softmax`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from reference_numpy import checks
from reference_numpy.incremental import attended_width, attended_widths

from . import speed
from .checks import check_beams, check_cache_index, checked_mask, checked_memory
from .precision import attention_product, computed_wide, rounding
from .softmax import masked_softmax, zero_fully_masked_rows

# Eq. (1) with its mask: (query, key, value, mask, dtype=) -> (output, weights)
Attention = Callable[..., tuple[jax.Array, jax.Array]]


class KVCache(NamedTuple):
    """Keys and values of one attention sublayer kept between decoding steps -- section 3.2.3.

    Masked self-attention: C = the capacity, target positions 0 .. C-1 (zeros until written), ``position`` the next one
    written; encoder-decoder attention: the projected memory, C = S, ``position`` ``()`` (never written). ``beams``
    (B, K, C) int, in a beam search (section 6.1) whose N = B * K rows stay in place: position c of the hypothesis in
    row b*K + j is in row b*K + beams[b, j, c]; ``()``: every row holds its own positions.

    JAX: fixed sizes, so that a decoding loop compiles once.
    """

    keys: jax.Array     # (B, H, C, d_k)
    values: jax.Array   # (B, H, C, d_k)
    beams: jax.Array | tuple = ()   # (B / K, K, C) int, or ()
    position: Any = ()   # the next position written (an int, or traced); () for the memory's keys and values

    @property
    def is_memory(self) -> bool:
        """Whether this is the memory's cache (encoder-decoder attention), which is read and never written."""
        return isinstance(self.position, tuple)

    def update(self, keys: jax.Array, values: jax.Array) -> KVCache:
        """This cache with ``keys`` and ``values`` (B, H, T_new, d_k) written at positions ``position`` .. ``position``
        + T_new - 1, the beam table marking them each row's own, and ``position`` advanced past them.

        JAX: a new cache (``lax.dynamic_update_slice_in_dim``; ``position`` may be traced).
        """
        cache_index = check_cache_index(self.position, keys.shape[2], self.keys.shape[2])
        return KVCache(lax.dynamic_update_slice_in_dim(self.keys, keys, cache_index, axis=2),
                       lax.dynamic_update_slice_in_dim(self.values, values, cache_index, axis=2),
                       _written_beams(self.beams, cache_index, keys.shape[2]), cache_index + keys.shape[2])


def at_position(cache: tuple, position: int | jax.Array) -> tuple:
    """The decoder's caches (:meth:`.model.Transformer.init_cache`) with every self-attention cache's next write at
    ``position``: the positions before it are the prefix decoded so far.
    """
    return tuple((own._replace(position=position), memory) for own, memory in cache)


def decoder_cache(model: Any, memory: jax.Array, capacity: int) -> tuple[tuple[KVCache, KVCache], ...]:
    """The caches of ``model``'s decoder (:meth:`.model.Transformer.init_cache`) for ``capacity`` target positions: per
    layer an empty self-attention cache and the memory's keys and values -- section 3.2.3.

    Shape: memory (B, S, D) -> per layer (B, H, C, d_k), (B, H, S, d_k).
    """
    memory = checked_memory(memory, None, model.config.d_model, model.param_dtype.name)
    checks.check_cache_capacity(capacity, model.config.max_len)
    return tuple((self_attention_cache(layer.self_attn, memory.shape[0], capacity),
                  memory_cache(layer.cross_attn, memory)) for layer in model.decoder.layers)


def self_attention_cache(attention: Any, batch: int, capacity: int) -> KVCache:
    """An empty self-attention cache of ``capacity`` positions for ``attention`` (a :class:`.model.MultiHeadAttention`).

    Shape: keys and values (B, H, C, d_k), zeros.
    """
    d_k = attention.q_proj.out_features // attention.n_heads
    dtype = rounding(attention.k_proj.dtype, attention.k_proj.param_dtype)   # the projections' P, or the model's
    empty = jnp.zeros((batch, attention.n_heads, capacity, d_k), dtype)      # (B, H, C, d_k)
    return KVCache(empty, empty, position=0)


def memory_cache(attention: Any, memory: jax.Array) -> KVCache:
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


def _keys_values(attention: Any, key: jax.Array, value: jax.Array,
                 cache: KVCache | None) -> tuple[jax.Array, jax.Array, KVCache | None]:
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


def _attend(attention: Any, query: jax.Array, memory: jax.Array, mask: jax.Array | None, cache: KVCache | None,
            kept: list) -> jax.Array:
    """``attention`` of ``query`` over ``memory``; with a ``cache``, the cache it returns appended to ``kept``."""
    if cache is None:
        return attention(query, memory, memory, mask)
    out, cache = attention(query, memory, memory, mask, cache=cache)
    kept.append(cache)
    return out


def _beam_table(cache: KVCache | None) -> jax.Array | None:
    """The cache's ``beams`` table, checked against its keys; None without one."""
    if cache is None or isinstance(cache.beams, tuple):
        return None
    check_beams(cache.beams, cache.keys.shape[0], cache.keys.shape[2])
    return cache.beams


def _cached_causal_mask(cache_index: int | jax.Array, length: int, capacity: int) -> jax.Array:
    """New position q (absolute position cache_index + q) may attend to cache positions j <= cache_index + q -- section
    3.2.3; later positions, not yet written, are hidden.

    Shape: mask (1, 1, T_new, C), bool, True = may attend.
    """
    return (jnp.arange(capacity) <= cache_index + jnp.arange(length)[:, None])[None, None]


@computed_wide
def beam_attention(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, beams: jax.Array, *,
                   dtype: DTypeLike | None = None) -> tuple[jax.Array, jax.Array]:
    """Eq. (1) along each beam hypothesis (section 6.1): row b*K + j's queries attend over the keys and values of its
    own hypothesis, position c read from row b*K + beams[b, j, c] (:class:`KVCache`).

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), mask broadcastable to (N, H, Tq, C), beams (B, K, C) ->
    output (N, H, Tq, d_k), weights (N, H, Tq, C).

    JAX: without gathering keys and values (:func:`.speed.beam_scores`, :func:`.speed.beam_mix`); ``dtype`` P
    computes by the autocast recipe.
    """
    scores = attention_product(functools.partial(speed.beam_scores, beams=beams), query, key, dtype)  # (N, H, Tq, C)
    if mask is not None:
        mask = checked_mask("mask", mask, scores.shape)
    weights = masked_softmax(scores, mask, query.shape[-1])
    out = attention_product(functools.partial(speed.beam_mix, beams=beams), weights, value, dtype)
    return zero_fully_masked_rows(out, mask), weights


def _along_beams(attention: Attention, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None,
                 beams: jax.Array | None, dtype: DTypeLike | None) -> tuple[jax.Array, jax.Array]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over ``key`` and ``value`` under
    ``mask``: Eq. (1) itself without a beam table, along each hypothesis (:func:`beam_attention`) with ``beams``.

    JAX: ``dtype`` P computes by the autocast recipe.
    """
    if beams is None:
        return attention(query, key, value, mask, dtype=dtype)
    return beam_attention(query, key, value, mask, beams, dtype=dtype)


def _attend_cache(attention: Attention, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None,
                  cache: KVCache | None, position: int | jax.Array, return_weights: bool,
                  dtype: DTypeLike | None) -> tuple[jax.Array, jax.Array | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions ``position`` .. ``position`` +
    Tq - 1 over a ``cache``: the memory's keys and values (:func:`_attend_memory`), or a self-attention cache that
    holds the new positions, without a ``mask`` causally over its written positions (:func:`_attend_written`); along
    each hypothesis (:func:`beam_attention`) when it holds a beam table.

    JAX: the weights when asked; ``dtype`` P computes by the autocast recipe.
    """
    if cache is not None and cache.is_memory:
        return _attend_memory(attention, query, key, value, mask, dtype)
    beams = _beam_table(cache)
    if mask is None:
        return _attend_written(attention, query, key, value, beams, position, return_weights, dtype)
    return _along_beams(attention, query, key, value, mask, beams, dtype)


def _attend_memory(attention: Attention, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None,
                   dtype: DTypeLike | None) -> tuple[jax.Array, jax.Array]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the queries over the memory's cached keys and
    values: Eq. (1) itself when they have a row per query row; the memory of B sentences read by N = B * K rows (a
    beam search's K hypotheses of each sentence, section 6.1) is attended by each sentence's K * Tq queries at once
    (:func:`_by_sentence`), so that its keys and values are projected and read once per sentence, not once per beam.

    Shape: query (N, H, Tq, d_k), key and value (B, H, S, d_k), mask broadcastable to (N, H, Tq, S) -> output
    (N, H, Tq, d_k), weights (N, H, Tq, S).

    JAX: ``dtype`` P computes by the autocast recipe.
    """
    rows, _, length, _ = query.shape
    batch = key.shape[0]
    if rows == batch:
        return attention(query, key, value, mask, dtype=dtype)
    if mask is not None:
        heads = mask.shape[-3] if mask.ndim > 2 else 1                                   # 1 or H
        mask = _by_sentence(jnp.broadcast_to(mask, (rows, heads, length, key.shape[2])), batch)  # (B, 1 or H, K*Tq, S)
    out, weights = attention(_by_sentence(query, batch), key, value, mask, dtype=dtype)
    return _by_row(out, rows), _by_row(weights, rows)


def _by_sentence(x: jax.Array, batch: int) -> jax.Array:
    """The N = B * K rows of B sentences as B rows, each holding its sentence's K rows one after the other along
    the third axis. Shape: (N, H, T, Z) -> (B, H, K*T, Z)."""
    rows, heads, length, width = x.shape
    x = x.reshape(batch, rows // batch, heads, length, width).transpose(0, 2, 1, 3, 4)   # (B, H, K, T, Z)
    return x.reshape(batch, heads, -1, width)


def _by_row(x: jax.Array, rows: int) -> jax.Array:
    """:func:`_by_sentence` undone. Shape: (B, H, K*T, Z) -> (N, H, T, Z)."""
    batch, heads, _, width = x.shape
    x = x.reshape(batch, heads, rows // batch, -1, width).transpose(0, 2, 1, 3, 4)       # (B, K, H, T, Z)
    return x.reshape(rows, heads, -1, width)


def _attend_written(attention: Attention, query: jax.Array, key: jax.Array, value: jax.Array,
                    beams: jax.Array | None, cache_index: int | jax.Array, return_weights: bool,
                    dtype: DTypeLike | None) -> tuple[jax.Array, jax.Array | None]:
    """``attention`` (:func:`.model.scaled_dot_product_attention`) of the new positions cache_index .. cache_index + Tq
    - 1 over a self-attention cache, causally (:func:`_cached_causal_mask`), reading only its first W positions
    (``attended_width``: the rest are not yet written), along each hypothesis with ``beams`` (:func:`beam_attention`);
    the weights (N, H, Tq, C), zero after W.

    Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), beams (B, K, C) or None.

    JAX: at a traced ``cache_index`` ``lax.switch`` picks the branch of W among ``attended_widths``; the weights when
    asked.
    """
    capacity, length = key.shape[2], query.shape[2]
    cache_index = check_cache_index(cache_index, length, capacity)     # an int, unless traced

    def over(width: int) -> tuple[jax.Array, jax.Array | None]:
        key_w, value_w, mask = key[:, :, :width], value[:, :, :width], _cached_causal_mask(cache_index, length, width)
        beams_w = None if beams is None else beams[:, :, :width]
        heads, weights = _along_beams(attention, query, key_w, value_w, mask, beams_w, dtype)
        return heads, jnp.pad(weights, [(0, 0)] * 3 + [(0, capacity - width)]) if return_weights else None

    if isinstance(cache_index, int):
        return over(attended_width(capacity, cache_index + length))
    widths = attended_widths(capacity)
    branch = jnp.searchsorted(jnp.asarray(widths), cache_index + length)      # the narrowest W >= written
    return lax.switch(branch, [functools.partial(over, width) for width in widths])


def _written_beams(beams: jax.Array | tuple, index: int | jax.Array, length: int) -> jax.Array | tuple:
    """The ``beams`` table (B, K, C) with positions index .. index + length - 1 each row's own
    (what the keys' write wrote there); ``()`` stays ``()``.

    JAX: a new array (``jnp.where``; ``index`` may be traced).
    """
    if isinstance(beams, tuple):
        return beams
    position = jnp.arange(beams.shape[2]) - index                        # (C,)
    own = jnp.arange(beams.shape[1], dtype=beams.dtype)[None, :, None]   # (1, K, 1)
    return jnp.where((position >= 0) & (position < length), own, beams)
