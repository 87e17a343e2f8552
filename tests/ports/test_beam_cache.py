"""A beam-search cache kept in place (``KVCache.beams``), in every backend.

Beam search leaves each row's self-attention keys and values where they are and moves only a
table of which row holds each position of each hypothesis: the one cache layout of the three
ports' searches (docs/ports.md), which the last test checks. Two checks that share no code with
the attention they test:

* Eq. (1) along each hypothesis against a naive loop: for every query row, its keys and values
  are collected position by position from the rows the table names, and the attention is
  computed with Python floats;
* a cached decoder driven through random beam reorderings: the cache kept in place under a
  table gives, at every step, what the same decoder gives on a cache whose rows are moved (the
  reference's model, rows moved by NumPy indexing written here).

The memory's keys and values are projected once per sentence and read by its K rows
(``incremental._attend_memory``): Eq. (1) of each row over its sentence's memory against a naive loop, and the decoder
above on one memory per sentence against the reference's on a memory repeated per row.
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
from support import FRAMEWORKS, float64_inference, framework_array, port_backend

from equivalence.tolerance import assert_agrees
from reference_numpy import TransformerConfig, init_params
from reference_numpy import model as reference
from reference_numpy.decoding import beam_search as reference_beam_search
from reference_numpy.incremental import at_position

BATCH, BEAMS, HEADS, CAPACITY, D_K = 2, 3, 2, 5, 4
ROWS = BATCH * BEAMS


def port(name: str):
    """(adapter, model module, decoding module, to-tensor) of a port, skipped with the reason when its
    framework is not installed (``port_backend``)."""
    adapter, package = port_backend(name), f"transformer_{name}"
    model, decoding = (importlib.import_module(f"{package}.{part}") for part in ("model", "decoding"))
    return adapter, model, decoding, functools.partial(framework_array, name)


def backend(name: str):
    """(model module, to-tensor) of the reference or a port."""
    if name == "numpy":
        return reference, np.asarray
    _, model, _, convert = port(name)
    return model, convert


def incremental(name: str):
    """The ``incremental`` module of the reference or a port (attention over a cache and over beam hypotheses)."""
    backend(name)                                   # a port whose framework is not installed is skipped
    return importlib.import_module("reference_numpy.incremental" if name == "numpy"
                                   else f"transformer_{name}.incremental")


def naive_attention_along_hypotheses(query, key, value, beams, allowed):
    """Row b*K + j, position c: key and value of row b*K + beams[b, j, c]; Eq. (1) with Python floats,
    query by query. Shape: query (N, H, Tq, d_k), key and value (N, H, C, d_k), allowed (Tq, C)."""
    rows, heads, length, d_k = query.shape
    out = np.zeros(query.shape)
    for row in range(rows):
        sentence, beam = divmod(row, BEAMS)
        holder = [sentence * BEAMS + int(beams[sentence, beam, c]) for c in range(CAPACITY)]
        for h in range(heads):
            for q in range(length):
                seen = [c for c in range(CAPACITY) if allowed[q, c]]
                scores = [sum(float(query[row, h, q, i]) * float(key[holder[c], h, c, i]) for i in range(d_k))
                          / math.sqrt(d_k) for c in seen]
                exps = [math.exp(s - max(scores)) for s in scores]
                for c, e in zip(seen, exps):
                    out[row, h, q] += e / sum(exps) * value[holder[c], h, c]
    return out


@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_attention_along_each_hypothesis_equals_a_naive_loop(name):
    """Two queries per row, a causal mask over the capacity (the first query sees 3 positions, the
    second 4), a table with every row of each sentence used."""
    _, convert = backend(name)
    rng = np.random.default_rng(0)
    query = rng.standard_normal((ROWS, HEADS, 2, D_K))
    key, value = rng.standard_normal((2, ROWS, HEADS, CAPACITY, D_K))
    beams = rng.integers(0, BEAMS, (BATCH, BEAMS, CAPACITY))
    allowed = np.arange(CAPACITY)[None, :] <= np.array([2, 3])[:, None]    # (Tq, C)
    with float64_inference(name):
        out, _ = incremental(name).beam_attention(*map(convert, (query, key, value, allowed, beams)))
    expected = naive_attention_along_hypotheses(query, key, value, beams, allowed)
    assert_agrees(np.asarray(out), expected, what=f"{name}: attention along each hypothesis")


def naive_attention_over_sentences(query, key, value, allowed):
    """Row r reads the memory of sentence r // K: Eq. (1) with Python floats, query by query; the weights too.
    Shape: query (N, H, Tq, d_k), key and value (B, H, S, d_k), allowed (N, 1, Tq, S)."""
    rows, heads, length, d_k = query.shape
    out, weights = np.zeros(query.shape), np.zeros((rows, heads, length, key.shape[2]))
    for row in range(rows):
        sentence = row // BEAMS
        for h in range(heads):
            for q in range(length):
                seen = [s for s in range(key.shape[2]) if allowed[row, 0, q, s]]
                scores = [sum(float(query[row, h, q, i]) * float(key[sentence, h, s, i]) for i in range(d_k))
                          / math.sqrt(d_k) for s in seen]
                exps = [math.exp(score - max(scores)) for score in scores]
                for s, e in zip(seen, exps):
                    weights[row, h, q, s] = e / sum(exps)
                    out[row, h, q] += e / sum(exps) * value[sentence, h, s]
    return out, weights


# each backend's own arguments of incremental._attend_cache after the cache's position: the weights asked for
ATTEND_OPTIONS = {"numpy": {}, "torch": {"return_weights": True}, "jax": {"return_weights": True, "dtype": None},
                  "tf": {"return_weights": True, "dtype": None}}


@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_attention_over_one_memory_per_sentence_equals_a_naive_loop(name):
    """The memory's keys and values of B sentences read by their N = B * K rows, two queries per row, a mask of its
    own for every row and query: each row attends over its own sentence's memory (output and weights)."""
    model, convert = backend(name)
    rng = np.random.default_rng(3)
    length = 5
    query = rng.standard_normal((ROWS, HEADS, 2, D_K))
    key, value = rng.standard_normal((2, BATCH, HEADS, length, D_K))
    allowed = rng.random((ROWS, 1, 2, length)) < 0.6
    allowed[..., 0] = True                                                 # every query sees a key
    module = incremental(name)
    with float64_inference(name):
        memory = module.KVCache(convert(key), convert(value))
        out, weights = module._attend_cache(model.scaled_dot_product_attention, *map(convert, (query, key, value,
                                            allowed)), memory, memory.position, **ATTEND_OPTIONS[name])
    expected, expected_weights = naive_attention_over_sentences(query, key, value, allowed)
    assert_agrees(np.asarray(out), expected, what=f"{name}: attention over one memory per sentence")
    assert_agrees(np.asarray(weights), expected_weights, what=f"{name}: its weights")


@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_a_memory_whose_rows_do_not_divide_the_decoders_gets_the_reference_error(name):
    """Five decoder rows over the memory's keys and values of two sentences: one ValueError naming the cache, the
    reference's words in every backend."""
    model, convert, _ = built(name, TINY, init_params(TINY, seed=0))
    with float64_inference(name):
        memory = model.encode(convert(np.full((5, 4), 3)))
        shared = model.init_cache(model.encode(convert(np.full((2, 4), 3))), CAPACITY)
        cache = tuple((own, mem) for (own, _), (_, mem) in zip(model.init_cache(memory, CAPACITY), shared))
        with pytest.raises(ValueError) as error:
            model.decode(convert(np.full((5, 1), 3)), memory, cache=at_position(cache, 0))
    assert str(error.value) == ("cache: the memory's keys and values have 2 rows; the decoder's 5 rows must be a "
                                "multiple of them (K consecutive rows per sentence)")


def in_place(cache: tuple, convert) -> tuple:
    """A fresh cache's self-attention caches under a table in which every row holds its own positions
    (what each port's ``decoding._in_place`` gives its beam search)."""
    table = convert(np.broadcast_to(np.arange(BEAMS)[None, :, None], (BATCH, BEAMS, CAPACITY)).copy())
    return tuple((own._replace(beams=table), memory) for own, memory in cache)


def reordered(cache: tuple, rows: np.ndarray, reorder_cache) -> tuple:
    """``reorder_cache`` of the self-attention caches only (the memory's keys and values stay)."""
    kept = reorder_cache(tuple((own,) for own, _ in cache), rows)
    return tuple((own, memory) for (own,), (_, memory) in zip(kept, cache))


def reorder_moving_rows(cache: tuple, rows: np.ndarray) -> tuple:
    """The reference's caches (no table) with row i made row ``rows[i]``: the keys and values move."""
    return tuple((reference.KVCache(own.keys[rows], own.values[rows]),) for (own,) in cache)


def reorder_table_rows(cache: tuple, rows: np.ndarray) -> tuple:
    """The reference's caches under a table: row i of the table made row ``rows[i]``."""
    return tuple((own._replace(beams=own.beams.reshape(ROWS, CAPACITY)[rows].reshape(own.beams.shape)),)
                 for (own,) in cache)


def one_memory_per_sentence(model, cache: tuple, src, convert) -> tuple:
    """``cache`` with the memory's keys and values of each sentence once (rows 0, K, 2K, ... of ``src``)."""
    shared = model.init_cache(model.encode(convert(src[::BEAMS])), CAPACITY)
    return tuple((own, memory) for (own, _), (_, memory) in zip(cache, shared))


def decoder_steps(model, src, tgt, parents, convert, reorder_cache, table: bool,
                  shared: bool = False) -> list[np.ndarray]:
    """The decoder's output at each position, one position a step, rows reordered by ``parents``
    after each step (the tokens too); with ``shared``, the memory's keys and values once per sentence."""
    memory = model.encode(convert(src))
    cache = model.init_cache(memory, CAPACITY)
    cache = in_place(cache, convert) if table else cache
    cache = one_memory_per_sentence(model, cache, src, convert) if shared else cache
    outputs = []
    for t, rows in enumerate(parents):
        out, cache = model.decode(convert(tgt[:, t:t + 1]), memory, cache=at_position(cache, t))
        outputs.append(np.asarray(out))
        before = cache
        cache, tgt = reordered(cache, convert(rows), reorder_cache), tgt[rows]
        if table:                                                          # nothing but the table moved
            assert all(new.keys is old.keys and new.values is old.values
                       for (new, _), (old, _) in zip(cache, before))
    return outputs


def built(name: str, config: TransformerConfig, params: dict):
    """(float64 model, to-tensor, reorder_cache) of a backend; the reference's reorder is
    :func:`reorder_table_rows`."""
    if name == "numpy":
        return reference.Transformer(config, params), np.asarray, reorder_table_rows
    adapter, _, decoding, convert = port(name)
    return adapter.build(config, params, "float64"), convert, decoding.reorder_cache


TINY = TransformerConfig.preset("tiny")


@pytest.mark.parametrize("shared", [False, True], ids=["memory-per-row", "memory-per-sentence"])
@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_a_cache_kept_in_place_decodes_as_a_moved_one(name, shared):
    """Five decoder steps of the tiny model in float64, the rows of each sentence reordered at
    random after each step: the backend's cache kept in place under a table (reordered by its
    ``reorder_cache``; the reference's by reordering the table here), the memory's keys and values once per row or
    once per sentence (as the ports' beam searches keep them), gives at every step the reference decoder's output on
    a cache whose keys and values are moved, over the memory repeated per row."""
    params = init_params(TINY, seed=0, perturb=0.1)
    rng = np.random.default_rng(1)
    src = np.repeat(rng.integers(3, TINY.src_vocab_size, (BATCH, 4)), BEAMS, axis=0)   # (N, S)
    tgt = rng.integers(3, TINY.tgt_vocab_size, (ROWS, CAPACITY))
    parents = [np.repeat(np.arange(BATCH) * BEAMS, BEAMS) + rng.integers(0, BEAMS, ROWS) for _ in range(CAPACITY)]
    expected = decoder_steps(reference.Transformer(TINY, params), src, tgt, parents, np.asarray,
                             reorder_moving_rows, table=False)
    model, convert, reorder_cache = built(name, TINY, params)
    with float64_inference(name):
        steps = decoder_steps(model, src, tgt, parents, convert, reorder_cache, table=True, shared=shared)
    for t, (out, ref) in enumerate(zip(steps, expected)):
        assert_agrees(out, ref, what=f"{name}: decoder step {t}, cache kept in place")


@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_a_table_of_the_wrong_shape_gets_the_reference_error(name):
    """A table one position longer than the cache: one ValueError naming ``cache.beams``, the
    reference's words in every backend."""
    model, convert, _ = built(name, TINY, init_params(TINY, seed=0))
    with float64_inference(name):
        memory = model.encode(convert(np.full((ROWS, 4), 3)))
        table = convert(np.zeros((BATCH, BEAMS, CAPACITY + 1), np.int64))
        cache = tuple((own._replace(beams=table), mem) for own, mem in model.init_cache(memory, CAPACITY))
        with pytest.raises(ValueError) as error:
            model.decode(convert(np.full((ROWS, 1), 3)), memory, cache=at_position(cache, 0))
    expected = (f"cache.beams must be an int array (B, K, C) for a cache of {ROWS} rows of {CAPACITY} positions "
                f"(B * K = {ROWS}, C = {CAPACITY}), got int64 of shape ({BATCH}, {BEAMS}, {CAPACITY + 1})")
    assert str(error.value) == expected


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_port_beam_search_moves_tables_not_keys_and_values(name, monkeypatch):
    """The ports' one cache layout: their beam search gives ``reorder_cache`` only self-attention caches
    that carry a ``beams`` table (the keys and values stay in place), from the first step on, keeps the memory's keys
    and values once per sentence, and decodes as the reference does."""
    adapter, _, decoding, convert = port(name)
    params = init_params(TINY, seed=0, perturb=0.1)
    follow, tables, in_place_caches = decoding._follow, [], []
    monkeypatch.setattr(decoding, "_follow", lambda cache, beams: tables.append(cache.beams) or follow(cache, beams))
    own_in_place = decoding._in_place
    monkeypatch.setattr(decoding, "_in_place", lambda cache, batch, k: in_place_caches.append(
        own_in_place(cache, batch, k)) or in_place_caches[-1])
    if name == "jax":
        decoding._beam.clear_cache()                                       # traced anew, through the patch
    src = np.random.default_rng(2).integers(3, TINY.src_vocab_size, (BATCH, 4))
    with float64_inference(name):
        tokens, _ = decoding.beam_search(adapter.build(TINY, params, "float64"), src, BEAMS)
    assert tables and not any(isinstance(table, tuple) for table in tables)
    assert all(tuple(table.shape) == (BATCH, BEAMS, tables[0].shape[2]) for table in tables)
    assert [(own.keys.shape[0], memory.keys.shape[0]) for cache in in_place_caches for own, memory in cache] == \
        [(ROWS, BATCH)] * TINY.n_decoder_layers                            # the memory's keys once per sentence
    np.testing.assert_array_equal(tokens, reference_beam_search(reference.Transformer(TINY, params), src, BEAMS)[0])
