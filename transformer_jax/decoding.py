"""Greedy decoding and beam search (section 6.1) for the JAX/Flax port, compiled.

The rules are the reference's (``reference_numpy/decoding.py``) and give the same tokens: the output budget is the
non-pad source length + 50 (or ``config.decoding.max_output_length``) capped at ``max_len``; the output starts after
``config.start_id``; the tokens of ``config.never_emitted`` are never emitted (their log-probabilities are set to -inf),
nor the held-back tokens (``config.decoding.min_output_length``, ``config.decoding.no_repeat_ngram_size``:
:func:`constrain`); the forced tokens (``forced_bos_id``, ``config.decoding.forced_eos``) are the reference's; the
decoder reads its prefix under the causal mask alone; greedy ties go to the lowest token id; beam candidates are ranked
by summed log-probability (in the score dtype: the model's, float32 for bfloat16 and float16) with ties to the lower
beam, then the lower token (the order of a stable sort of the negated flat scores); an eos among the first ``beam_size``
ranks finishes a hypothesis, the first ``beam_size`` non-eos candidates are the next live beams; the search stops at the
budget (live beams then finish, in rank order, after that step's eos hypotheses), when no live beam is left, or by the
length normalization's rule (``config.decoding.length_normalization``: "gnmt", when no live beam can beat the best
finished one; "hf", ``config.decoding.early_stopping`` over the ``beam_size`` best finished scores, :func:`_stops`); the
best score wins, ties going to the hypothesis finished first. Outputs are NumPy, without bos, pad-filled. A bfloat16 or
float16 model decodes with its key/value caches in its own dtype and float32 log-probabilities and scores.

How it runs:
* the encoder runs once; with ``use_cache=True`` the model's key/value caches
  (``model.init_cache``: per decoder layer a :class:`.incremental.KVCache` of self-attention keys/values
  (N, H, M, d_k), M = the longest budget, and one of the memory's keys/values projected once) go
  through ``model.decode(token, memory, src_mask, cache=)``, which writes the new
  position's keys/values and attends up to it; beam search, as in every port, keeps each row's
  self-attention keys and values where they are, and a ``beams`` table of which row holds each
  position of each hypothesis (``KVCache.beams``, :func:`_in_place`) follows the beams
  (:func:`reorder_cache` reorders the table; the memory's keys and values are the same for every
  beam of a sentence). Under XLA that made TensorFlow's search much faster than moving the keys
  and values; JAX's loop copies its caches either way (docs/benchmarks.md, "What beam search adds");
* the whole search is one ``lax.while_loop`` inside ``jax.jit`` of the model's split state
  (split once per model by ``speed._split``, not at every call as ``nnx.jit`` does): it is traced and
  compiled once per model structure, batch size, source length, budget M and beam size, never per token;
* beam candidates are ranked by ``lax.top_k`` (2K of the K * V candidates), not a full sort;
* ``use_cache=False`` (no cache: ``()``, as in every port) recomputes the decoder over the whole
  fixed-size target buffer at every step (later positions are masked), the reference's
  recomputation, compiled, for comparison;
* beam search advances every sentence's beams in one loop, as the TensorFlow port does: rows are
  (sentence, beam) pairs, N = B * K; a sentence that has stopped is still computed but changes
  nothing (its best is no longer replaced) until every sentence has stopped. (One search per
  sentence under ``jax.vmap`` was slower: a loop whose condition is batched becomes one whose every
  carry, caches included, is selected anew at each step; docs/benchmarks.md, "What beam search adds".)
  Beam slots not yet filled (the first step has one live beam) hold the score -inf, so they rank after every real
  candidate and never finish. A step whose non-eos candidates are all
  impossible (only eos can follow) leaves every slot at -inf, and the stopping rule
  (-inf <= best finished score) ends the search, as "no live beam left" does in the reference.

Shape legend: B batch, S source length, N rows decoded together (B, or B * K), M budget,
V target vocabulary, K beam_size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx
from jax import lax

from reference_numpy.config import TransformerConfig
from reference_numpy.decoding import (
    BEAM_SIZE,
    check_decoding_args,
    check_forced_bos,
    length_penalty,
    max_output_lengths,
)
from reference_numpy.precision import score_dtype

from .checks import check_tokens
from .incremental import KVCache, at_position
from .model import Transformer, causal_mask, log_softmax, padding_mask
from .speed import _EXACT_ROUNDING, _split, _Structure

_TOKEN_DTYPE = jnp.int32
# each sentence's best finished hypothesis: score (B,), row (B, M + 1), length (B,)
_Best = tuple[jax.Array, jax.Array, jax.Array]


def next_token_log_probs(model: Transformer, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array,
                         cache: tuple = (), cache_index: int | jax.Array | None = None,
                         ) -> Any:   # (N, V) log-probabilities; with a cache, (them, the new cache)
    """Log-probabilities of the token after the last position of ``tgt``, with the tokens of
    ``config.never_emitted`` set to -inf so that they are never chosen.

    Without a cache (``()``) ``tgt`` is the whole prefix (the decoder is recomputed, under the causal mask
    alone); with one (see
    ``Transformer.decode``) ``tgt`` holds only the new positions, at ``cache_index`` .., and the
    result is ``(log_probs, cache)``.

    Shape: tgt (N, T), memory (N, S, D) -> log_probs (N, V).
    """
    return _next_token(_log_probs_at, model, tgt, memory, src_mask, cache, cache_index)


def next_token_logits(model: Transformer, tgt: jax.Array, memory: jax.Array, src_mask: jax.Array,
                      cache: tuple = (), cache_index: int | jax.Array | None = None,
                      ) -> Any:   # (N, V) logits; with a cache, (them, the new cache)
    """The generator's logits (``Generator.logits``: before its log-softmax, nothing suppressed) of the token after the
    last position of ``tgt``, what greedy decoding's repetition penalty reads (the reference's ``next_token_logits``);
    ``tgt``, ``cache`` and ``cache_index`` as for :func:`next_token_log_probs`. Shape: tgt (N, T) -> logits (N, V)."""
    return _next_token(_logits_at, model, tgt, memory, src_mask, cache, cache_index)


def _next_token(read: Callable[..., jax.Array], model: Transformer, tgt: jax.Array, memory: jax.Array,
                src_mask: jax.Array, cache: tuple, cache_index: int | jax.Array | None) -> Any:
    """What ``read`` (``_log_probs_at`` or ``_logits_at``) gives at the last position of the decoder's
    output after ``tgt``: the body of :func:`next_token_log_probs` and :func:`next_token_logits`, their arguments as
    there."""
    if not cache:
        out = model.decode(tgt, memory, src_mask, causal_mask(tgt.shape[1]), deterministic=True)   # (N, T, D)
        return read(model, out, out.shape[1] - 1)
    cache = cache if cache_index is None else at_position(cache, cache_index)
    out, cache = model.decode(tgt, memory, src_mask, cache=cache, deterministic=True)
    return read(model, out, out.shape[1] - 1), cache


def reorder_cache(cache: tuple, beams: jax.Array) -> tuple:
    """Every layer's caches follow their beams: row i of the result holds the hypothesis of row
    ``beams[i]`` (beam search keeps the caches of the hypotheses it extends). A
    :class:`.incremental.KVCache` without a ``beams`` table is gathered along the batch axis; one with
    a table keeps its keys and values where they are and gathers the table's rows (beams never
    move between sentences).

    Shape: beams (N,) int; every keys/values array (N, H, C, d_k); a table (N / K, K, C).
    """
    return tuple(tuple(_follow(layer_cache, beams) for layer_cache in layer) for layer in cache)


def _follow(cache: KVCache, beams: jax.Array) -> KVCache:
    """One :class:`.incremental.KVCache` of :func:`reorder_cache`."""
    if isinstance(cache.beams, tuple):
        return cache._replace(keys=cache.keys[beams], values=cache.values[beams])
    table = cache.beams.reshape(-1, cache.beams.shape[2])                # (N, C)
    return cache._replace(beams=table[beams].reshape(cache.beams.shape))


def penalize(config: TransformerConfig, scores: jax.Array, history: jax.Array, step: jax.Array) -> jax.Array:
    """The scores of the token at (traced) ``step`` with ``config.decoding.repetition_penalty`` p applied (the
    reference's ``penalize``): every token of the prefix ``history[:, :step]`` has its score divided by p where > 0
    and multiplied by p where < 0. ``scores`` unchanged when p is 1.
    Shape: scores (N, V), history (N, M + 1) -> (N, V)."""
    penalty, vocab = config.decoding.repetition_penalty, scores.shape[1]
    if penalty == 1.0:
        return scores
    tokens = jnp.where(jnp.arange(history.shape[1]) < step, history, vocab)               # column V: no token
    seen = jnp.zeros((len(scores), vocab + 1), bool).at[jnp.arange(len(scores))[:, None], tokens].set(True)
    return jnp.where(seen[:, :vocab], jnp.where(scores < 0, scores * penalty, scores / penalty), scores)


def constrain(config: TransformerConfig, log_probs: jax.Array, history: jax.Array, step: jax.Array) -> jax.Array:
    """The log-probabilities of the token at (traced) ``step`` with the reference's held-back tokens at -inf (its
    ``constrain``): eos below ``config.decoding.min_output_length``; with ``config.decoding.no_repeat_ngram_size`` n,
    each token that would complete an n-gram of the prefix ``history[:, :step]`` (the windows of the buffer that lie in
    the prefix and whose first n - 1 tokens are its last n - 1 name it); then, with ``config.decoding.renormalize``, a
    log-softmax of them (at every step of a config with either setting). ``log_probs`` unchanged without them.
    Shape: log_probs (N, V), history (N, M + 1) -> (N, V)."""
    n, vocab = config.decoding.no_repeat_ngram_size, log_probs.shape[1]
    if not (config.decoding.min_output_length or n):
        return log_probs
    held = (jnp.arange(vocab) == config.eos_id) & (step < config.decoding.min_output_length)   # (V,)
    log_probs = jnp.where(held, -jnp.inf, log_probs)
    width = history.shape[1] - n + 1                                                       # windows of the buffer
    if n and width > 0:
        windows = jnp.stack([history[:, j:j + width] for j in range(n)], axis=2)             # (N, width, n)
        tail = lax.dynamic_slice_in_dim(history, jnp.maximum(step - n + 1, 0), n - 1, axis=1)   # (N, n - 1)
        matches = (windows[:, :, :-1] == tail[:, None, :]).all(axis=2) & (jnp.arange(width) < step - n + 1)
        rows = jnp.arange(len(log_probs))[:, None]
        banned = jnp.zeros((len(log_probs), vocab + 1), bool).at[rows, jnp.where(matches, windows[:, :, -1],
                                                                                   vocab)].set(True)
        log_probs = jnp.where(banned[:, :vocab], -jnp.inf, log_probs)                      # column V: no token
    return log_softmax(log_probs) if config.decoding.renormalize else log_probs


def forced_tokens(config: TransformerConfig, step: jax.Array, limits: jax.Array,
                  forced_bos_id: int | None) -> jax.Array:
    """The token each row is forced to emit at (traced) ``step`` (the reference's ``forced_tokens``):
    ``forced_bos_id`` at step 1, ``config.forced_last_id`` at the row's last step with
    ``config.decoding.forced_eos``, -1 where none. Shape: limits (N,) -> (N,)."""
    first = -1 if forced_bos_id is None else forced_bos_id
    forced = jnp.broadcast_to(jnp.where(step == 1, first, -1), limits.shape).astype(limits.dtype)
    return jnp.where((step == limits) & config.decoding.forced_eos, config.forced_last_id, forced)


def force(log_probs: jax.Array, forced: jax.Array) -> jax.Array:
    """Where a token is forced, it gets the log-probability 0 and every other -inf (the reference's ``force``).
    Shape: log_probs (N, V), forced (N,) -> (N, V)."""
    one_hot = jnp.arange(log_probs.shape[1]) == forced[:, None]
    forcing = jnp.where(one_hot, 0.0, -jnp.inf).astype(log_probs.dtype)
    return jnp.where(forced[:, None] >= 0, forcing, log_probs)


def _log_probs_at(model: Transformer, out: jax.Array, position: int | jax.Array) -> jax.Array:
    """The generator's log-probabilities (section 3.4) at one (possibly traced) position of the decoder
    output, the tokens of ``config.never_emitted`` set to -inf: the decoder never emits them (with
    ``config.decoding.renormalize``, a log-softmax of the others: the reference's ``_emittable``).
    Shape: out (N, T, D) -> (N, V)."""
    log_probs = model.generator(lax.dynamic_slice_in_dim(out, position, 1, axis=1))[:, 0]   # (N, V)
    return _emittable(model.config, log_probs)


def _logits_at(model: Transformer, out: jax.Array, position: int | jax.Array) -> jax.Array:
    """The generator's logits (before its log-softmax) at one (possibly traced) position of the decoder output, nothing
    suppressed. Shape: out (N, T, D) -> (N, V)."""
    return model.generator.logits(lax.dynamic_slice_in_dim(out, position, 1, axis=1))[:, 0]


def _emittable(config: TransformerConfig, scores: jax.Array) -> jax.Array:
    """The scores with the tokens of ``config.never_emitted`` at -inf and, with ``config.decoding.renormalize``, a
    log-softmax of them (the reference's ``_emittable``). Shape: (N, V) -> (N, V)."""
    scores = scores.at[:, jnp.array(config.never_emitted, dtype=_TOKEN_DTYPE)].set(-jnp.inf)
    return log_softmax(scores) if config.decoding.renormalize else scores


def _step(model: Transformer, tokens: jax.Array, step: jax.Array, memory: jax.Array, src_mask: jax.Array,
          cache: tuple, greedy: bool) -> tuple[jax.Array, tuple]:
    """One decoding step: the scores (N, V) of the token at (traced) position ``step`` after ``tokens[:, :step]`` (the
    start token at position 0), and the cache: the log-probabilities; with a ``repetition_penalty`` p != 1 (the
    reference's ``_scores``), :func:`penalize` first, on the logits in greedy decoding (``greedy``) and on the
    log-probabilities in beam search, then :func:`_emittable`. With a cache only the token at ``step - 1`` runs through
    the decoder (:func:`next_token_log_probs` or :func:`next_token_logits` at ``cache_index = step - 1``); with ``()``
    (no cache) the decoder reruns over the whole fixed-size buffer, the reference's recomputation (later positions are
    masked), and reads position ``step - 1``. Shape: tokens (N, M + 1)."""
    cfg = model.config
    penalized = cfg.decoding.repetition_penalty != 1.0
    if not cache:
        width = tokens.shape[1] - 1
        out = model.decode(tokens[:, :-1], memory, src_mask, causal_mask(width), deterministic=True)   # (N, M, D)
        scores = (_logits_at if penalized else _log_probs_at)(model, out, step - 1)
    else:
        token = lax.dynamic_slice_in_dim(tokens, step - 1, 1, axis=1)                      # (N, 1)
        next_token = next_token_logits if penalized else next_token_log_probs
        scores, cache = next_token(model, token, memory, src_mask, cache, step - 1)
    if penalized:
        scores = _emittable(cfg, penalize(cfg, scores if greedy else log_softmax(scores), tokens, step))
    return scores, cache


def _checked_source(model: Transformer, src: npt.ArrayLike) -> jax.Array:
    """The source after the reference's checks (ids too, before any compiled code)."""
    return check_tokens("src", src, model.config.src_vocab_size, model.config.max_len)


def _start_tokens(config: TransformerConfig, rows: int, max_steps: int) -> jax.Array:
    """The token buffer: the start token (``config.start_id``), then pad_id up to position M (``max_steps``).
    Shape: (rows, M + 1)."""
    return jnp.full((rows, max_steps + 1), config.pad_id, _TOKEN_DTYPE).at[:, 0].set(config.start_id)


# ----------------------------------------------------------------------------- greedy

def greedy_decode(model: Transformer, src: npt.ArrayLike, use_cache: bool = True,
                  forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id; ``forced_bos_id`` the forced first token.

    Shape: src (B, S) -> tokens (B, L), without the start token, right-padded with pad_id (NumPy int64).
    """
    forced_bos_id = check_forced_bos(model.config, forced_bos_id)
    src = _checked_source(model, src)
    limits = max_output_lengths(model, np.asarray(src))                          # (B,)
    split = _split(model)
    history, steps = _greedy(split.structure, split.state, src, jnp.asarray(limits), int(limits.max()), use_cache,
                             forced_bos_id)
    return np.asarray(history)[:, 1:int(steps) + 1].astype(np.int64)


@functools.partial(jax.jit, static_argnames=("structure", "max_steps", "use_cache", "forced_bos_id"),
                   compiler_options=_EXACT_ROUNDING)
def _greedy(structure: _Structure[Transformer], state: nnx.State, src: jax.Array, limits: jax.Array, max_steps: int,
            use_cache: bool, forced_bos_id: int | None) -> tuple[jax.Array, jax.Array]:
    """JAX only: the jitted loop of :func:`greedy_decode` (TensorFlow's ``_greedy`` is a ``tf.function`` with
    its own plumbing; PyTorch loops in ``greedy_decode``) for the model ``structure.merge(state)``
    (``speed._split``). Returns the token buffer (B, M + 1) (the start token first) and the number of steps taken."""
    model = structure.merge(state)
    cfg = model.config
    src_mask = padding_mask(src, cfg.pad_id)                                     # (B, 1, 1, S)
    memory = model.encode(src, src_mask, deterministic=True)                     # (B, S, D)
    # the caches' position an int32 array, as the loop's steps write it: a weakly typed 0 would have while_loop
    # trace the step twice
    cache = at_position(model.init_cache(memory, max_steps), jnp.int32(0)) if use_cache else ()

    def running(carry):
        index, _, done, _ = carry
        return (index < max_steps) & ~done.all()

    def advance(carry):
        index, history, done, cache = carry
        log_probs, cache = _step(model, history, index + 1, memory, src_mask, cache, greedy=True)   # (B, V)
        log_probs = constrain(cfg, log_probs, history, index + 1)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, index + 1, limits, forced_bos_id))
        token = jnp.argmax(log_probs, axis=-1).astype(_TOKEN_DTYPE)              # first max = lowest id
        token = jnp.where(done, cfg.pad_id, token)
        history = history.at[:, index + 1].set(token)
        done = done | (token == cfg.eos_id) | (index + 1 >= limits)
        return index + 1, history, done, cache

    start = (jnp.asarray(0, _TOKEN_DTYPE), _start_tokens(cfg, src.shape[0], max_steps),
             jnp.zeros(src.shape[0], bool), cache)
    steps, history, _, _ = lax.while_loop(running, advance, start)
    return history, steps


# ----------------------------------------------------------------------------- beam search

def beam_search(model: Transformer, src: npt.ArrayLike, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the config's length normalization (alpha: None is ``config.decoding.length_penalty``), the
    forced first token ``forced_bos_id`` and the tie-break of this module's docstring.

    Shape: src (B, S) -> tokens (B, L) without the start token, right-padded with pad_id (NumPy int64), and
    the length-normalized scores (B,) (NumPy float64 holding score-dtype values: the model's, float32 for
    bfloat16 and float16).
    """
    cfg = model.config
    beam_size, alpha = check_decoding_args(beam_size, alpha, cfg)
    forced_bos_id = check_forced_bos(cfg, forced_bos_id)
    src = _checked_source(model, src)
    limits = max_output_lengths(model, np.asarray(src))                          # (B,)
    max_steps = int(limits.max())
    # lp(n) for n = 0..M, computed on the host like the reference's Python floats, then
    # rounded to the score dtype exactly as NumPy rounds a Python float in `score / lp`.
    penalties = np.array([length_penalty(n, alpha, cfg.decoding.length_normalization)
                          for n in range(max_steps + 1)]).astype(score_dtype(model.dtype))
    split = _split(model)
    rows, lengths, scores = _beam(split.structure, split.state, src, jnp.asarray(limits), jnp.asarray(penalties),
                                  max_steps, beam_size, use_cache, forced_bos_id)
    width = int(np.max(lengths))
    return np.asarray(rows)[:, :width].astype(np.int64), np.asarray(scores, dtype=np.float64)


@functools.partial(jax.jit, static_argnames=("structure", "max_steps", "beam_size", "use_cache", "forced_bos_id"),
                   compiler_options=_EXACT_ROUNDING)
def _beam(structure: _Structure[Transformer], state: nnx.State, src: jax.Array, limits: jax.Array, penalties: jax.Array,
          max_steps: int, beam_size: int, use_cache: bool,
          forced_bos_id: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """JAX only: the jitted search of :func:`beam_search` (TensorFlow's ``_beam`` is a ``tf.function`` with
    its own plumbing; PyTorch searches in ``beam_search``) over the batch of the model
    ``structure.merge(state)`` (``speed._split``): rows are
    (sentence, beam) pairs, N = B * K, all advanced by one loop until every sentence has stopped.
    Returns the best hypotheses (B, M) without the start token, their lengths (B,) and scores (B,)."""
    model = structure.merge(state)
    cfg, batch, k = model.config, src.shape[0], beam_size
    src_mask = padding_mask(src, cfg.pad_id)                                     # (B, 1, 1, S)
    memory = model.encode(src, src_mask, deterministic=True)                    # (B, S, D)
    cache = _in_place(at_position(model.init_cache(memory, max_steps), jnp.int32(0)) if use_cache else (), batch, k)
    memory = jnp.repeat(memory, k, axis=0)                                      # (N, S, D)
    src_mask = jnp.repeat(src_mask, k, axis=0)                                  # (N, 1, 1, S)
    first_row = jnp.arange(batch)[:, None] * k                                   # (B, 1): row of beam 0
    limit_penalty = penalties[limits]                                            # (B,): lp(limit)
    row_limits = jnp.repeat(limits, k)                                           # (N,)
    scores_dtype = score_dtype(model.dtype)                                      # float32 for P
    alive = jnp.full((batch, k), -jnp.inf, scores_dtype).at[:, 0].set(0.0)       # (B, K): only beam 0 at first
    no_best = (jnp.full(batch, -jnp.inf, scores_dtype), _start_tokens(cfg, batch, max_steps),
               jnp.zeros(batch, _TOKEN_DTYPE))

    def advance(carry):
        index, history, live_scores, cache, best, kept, done = carry
        length = index + 1                                                       # tokens after this step
        log_probs, cache = _step(model, history, length, memory, src_mask, cache, greedy=False)   # (N, V)
        log_probs = constrain(cfg, log_probs, history, length)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, length, row_limits, forced_bos_id))
        candidates = live_scores[:, :, None] + log_probs.reshape(batch, k, -1)   # (B, K, V)
        scores, beams, tokens, finishing, keep = _select(candidates, cfg.eos_id, k)
        rows = history[first_row + beams].at[:, :, length].set(tokens)           # (B, 2K, M + 1)
        ended = jnp.where(finishing & ~done[:, None], scores / penalties[length], -jnp.inf)
        best = _keep_best(best, ended, rows, length)
        if cfg.decoding.length_normalization == "hf":                     # the gnmt rule reads best alone
            kept = lax.top_k(jnp.concatenate([kept, ended], axis=1), k)[0]       # (B, K): best finished scores
        live_scores = jnp.take_along_axis(scores, keep, axis=1)                  # (B, K), descending
        rows = jnp.take_along_axis(rows, keep[:, :, None], axis=1)               # (B, K, M + 1)
        cache = _reorder_own(cache, (first_row + jnp.take_along_axis(beams, keep, axis=1)).reshape(-1))
        last = ~done & (length == limits)                                        # (B,)
        best = _keep_best(best, jnp.where(last[:, None], live_scores / penalties[length], -jnp.inf), rows, length)
        done = done | last | _stops(cfg, live_scores[:, 0], best[0], kept, penalties[length], limit_penalty)
        return length, rows.reshape(batch * k, -1), live_scores, cache, best, kept, done

    start = (jnp.asarray(0, _TOKEN_DTYPE), _start_tokens(cfg, batch * k, max_steps), alive, cache, no_best,
             jnp.full((batch, k), -jnp.inf, scores_dtype), jnp.zeros(batch, bool))
    *_, (score, row, length), _, _ = lax.while_loop(lambda carry: ~carry[-1].all(), advance, start)
    return row[:, 1:], length, score


def _stops(config: TransformerConfig, best_live: jax.Array, best: jax.Array, kept: jax.Array, penalty: jax.Array,
           limit_penalty: jax.Array) -> jax.Array:
    """Which sentences stop by the normalization's rule after a step (the reference's ``search_ends``): "gnmt",
    no live beam can beat the best finished score, best_live / lp(limit) <= best; "hf", once ``beam_size``
    hypotheses have finished (``kept``, the best finished scores, full), ``config.decoding.early_stopping``: True at
    once, else best_live / lp(bound) <= the worst kept score, bound = this step's length (``penalty``) or, for
    "never", the limit. A sentence with no live beam left (best_live -inf) stops.
    Shape: best_live, best (B,); kept (B, K); penalty (); limit_penalty (B,) -> (B,) bool."""
    if config.decoding.length_normalization == "gnmt":
        return best_live / limit_penalty <= best
    full = kept[:, -1] > -jnp.inf
    if config.decoding.early_stopping is True:
        return full | (best_live == -jnp.inf)
    bound = limit_penalty if config.decoding.early_stopping == "never" else penalty
    return (full & (best_live / bound <= kept[:, -1])) | (best_live == -jnp.inf)


def _in_place(cache: tuple, batch: int, beam_size: int) -> tuple:
    """The caches of a beam search's N = B * K rows from the decoder's caches of its B sentences: each self-attention
    cache K rows per sentence with a ``beams`` table in which every row holds its own positions (:func:`reorder_cache`
    then reorders tables, not keys and values); the memory's keys and values one row per sentence, read by its K rows
    (``incremental._attend_memory``). ``()``, no cache, stays ``()``.
    Shape: each self-attention cache (N, H, C, d_k), its table (B, K, C)."""
    own_rows = jnp.arange(beam_size, dtype=_TOKEN_DTYPE)[None, :, None]         # (1, K, 1)

    def rows(own: KVCache) -> KVCache:
        keys = jnp.zeros((batch * beam_size, *own.keys.shape[1:]), own.keys.dtype)   # (N, H, C, d_k)
        beams = jnp.broadcast_to(own_rows, (batch, beam_size, keys.shape[2]))
        return own._replace(keys=keys, values=keys, beams=beams)
    return tuple((rows(own), memory) for own, memory in cache)


def _reorder_own(cache: tuple, beams: jax.Array) -> tuple:
    """:func:`reorder_cache` of each layer's self-attention cache only: the memory's keys and values are the
    same for every beam of a sentence, so they stay where they are (``()``, no cache, stays ``()``)."""
    kept = reorder_cache(tuple((own,) for own, _ in cache), beams)
    return tuple((own, memory) for (own,), (_, memory) in zip(kept, cache))


def _select(candidates: jax.Array, eos_id: int,
            beam_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One step's ranking and choices for every sentence (the reference's ``select_candidates``): the 2K best
    (beam b, token v) candidates by summed log-probability, ties to the lower b, then the lower v, by
    ``lax.top_k`` over the flat beam-major scores (documented: equal values keep the lower index first,
    i.e. the order of a stable sort); zeros are made +0.0 first, since top_k would put +0.0 before -0.0,
    which a sort does not. An eos among the first K ranks finishes; the first K non-eos ranks are the
    next live beams, in rank order (K non-eos candidates are always among 2K: each beam has one eos).

    Shape: candidates (B, K, V) -> scores, beams, tokens and finishing (B, 2K) in rank order; keep (B, K),
    the ranks of the next live beams.
    """
    batch, k, vocab = candidates.shape
    flat = candidates.reshape(batch, k * vocab)                                  # (B, K * V), beam-major
    scores, ranked = lax.top_k(jnp.where(flat == 0, 0.0, flat), min(2 * k, k * vocab))   # (B, 2K) each
    beams, tokens = ranked // vocab, (ranked % vocab).astype(_TOKEN_DTYPE)
    is_eos = tokens == eos_id
    rank = jnp.arange(ranked.shape[1])[None, :]                                  # (1, 2K)
    keep = lax.top_k(-jnp.where(is_eos, rank + ranked.shape[1], rank), beam_size)[1]   # (B, K): distinct keys
    return scores, beams, tokens, is_eos & (rank < beam_size), keep


def _keep_best(best: _Best, scores: jax.Array, rows: jax.Array, length: jax.Array) -> _Best:
    """Replace each sentence's ``best`` = (score, row, length) by its first candidate of highest score,
    only if that score is strictly greater (so earlier finished hypotheses win ties).

    Shape: best ((B,), (B, M + 1), (B,)); scores (B, C) in rank order, -inf for candidates that do not
    finish; rows (B, C, M + 1).
    """
    first = jnp.argmax(scores, axis=1)                                           # (B,)
    score = jnp.take_along_axis(scores, first[:, None], axis=1)[:, 0]
    row = jnp.take_along_axis(rows, first[:, None, None], axis=1)[:, 0]          # (B, M + 1)
    better = score > best[0]
    return (jnp.where(better, score, best[0]), jnp.where(better[:, None], row, best[1]),
            jnp.where(better, length, best[2]))
