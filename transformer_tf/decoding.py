"""Greedy decoding and beam search (section 6.1) for the TensorFlow port, compiled.

The rules are the reference's, word for word (``reference_numpy/decoding.py``): maximum output length = non-pad source
tokens + 50 (or ``config.decoding.max_output_length``) capped at ``max_len``; output after the start token
``config.start_id``, without it, right-padded with pad_id; the tokens of ``config.never_emitted`` are never emitted
(their log-probabilities are set to -inf before choosing), nor the held-back tokens
(``config.decoding.min_output_length``, ``config.decoding.no_repeat_ngram_size``: :func:`constrain`); the forced tokens
(``forced_bos_id``, ``config.decoding.forced_eos``) are the reference's; the decoder reads its prefix under the causal
mask alone; greedy ties go to the lowest token id; beam candidates are ranked by summed log-probability (model dtype;
float32 for bfloat16 and float16), ties to the lower beam then the lower token; eos finishes a hypothesis only among the
first ``beam_size`` ranks; the search stops at the maximum length (live beams are then scored as finished, in rank
order, after that step's eos hypotheses), when no live beam is left, or by the length normalization's rule
(``config.decoding.length_normalization``: "gnmt", when no live beam can beat the best finished one; "hf",
``config.decoding.early_stopping`` over the ``beam_size`` best finished scores, :func:`_stops`); the best score wins, a
tie going to the hypothesis finished first. Beam rows that hold no live beam (only one exists at first; none when only
eos can follow) score -inf: they never finish, and when all of a sentence's rows do, the stopping rule (-inf <= best
finished score) ends its search.

Each search is one ``tf.function`` holding a ``tf.while_loop`` over output positions, for the
whole batch at once (beam search keeps B x beam_size rows):

* ``use_cache=True``: the decoder runs one position per step through the model's key/value
  cache (``model.init_cache``, ``model.decode(..., cache=)``): each layer's
  self-attention keys and values live in a preallocated (rows, H, L, d_k) buffer written at
  step t, and the encoder-decoder attention's keys and values are projected once from the
  encoder output. Every shape is static, so the loop is XLA-compiled (``jit_compile=True``; XLA
  on CPU supports float64 for every op used).
* ``use_cache=False``: the reference's way, each step reruns the decoder on the whole prefix.
  The prefix grows, so this graph runs without XLA.

What a step does not redo, the result being the same: the generator's (D, V) weight is read once
per search and passed to the compiled loop (with shared embeddings the embedding is transposed
once; transposed inside the loop, it costs a pass over the whole table at every step, which XLA
does not hoist). Beam search ranks candidates with ``tf.math.top_k`` (the 2K best of K x V, not
a sort of all of them) and never moves the self-attention caches' keys and values: each row keeps
its cache, and a table of which row holds each position of each hypothesis (``KVCache.beams``)
follows the beams instead -- (N, C) integers a step, where gathering the keys and values moved
12.7 MB a step for ``base`` (and XLA copied them once more into the loop's buffers); the attention
reads each position from the row the table names (``model.scaled_dot_product_attention``). The
memory's keys and values are the same for every beam of a sentence and stay where they are.

A bfloat16 or float16 model decodes by the reference's recipe: its caches hold P, its log-probabilities and beam
scores are float32 (``reference_numpy.precision.score_dtype``); the generator's weight is made float32 once per
search (exactly), not at every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from numpy.typing import ArrayLike

from reference_numpy.checks import check_tokens
from reference_numpy.config import TransformerConfig
from reference_numpy.decoding import (
    BEAM_SIZE,
    EXTRA_OUTPUT_LENGTH,
    check_decoding_args,
    check_forced_bos,
    length_penalty,
)
from reference_numpy.precision import score_dtype

from .device import model_device
from .incremental import Index, KVCache, at_position
from .model import Transformer, _logits, causal_mask, log_softmax, padding_mask
from .precision import wide
from .speed import _xla_keeps_roundings

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {search key: tf.function}

Cache = tuple[tuple[KVCache, KVCache], ...]   # per decoder layer (self-attention, encoder-decoder attention); (): none


def max_output_lengths(model: Transformer, src: tf.Tensor) -> tf.Tensor:
    """Per-sequence output budget: non-pad source tokens + 50 (section 6.1), or ``config.decoding.max_output_length``
    when set, capped at ``max_len``, computed in-graph. Shape: (B,)."""
    cfg = model.config
    lengths = tf.reduce_sum(tf.cast(tf.not_equal(src, cfg.pad_id), tf.int32), axis=1)
    budgets = lengths + EXTRA_OUTPUT_LENGTH if cfg.decoding.max_output_length is None else tf.fill(
        tf.shape(lengths), cfg.decoding.max_output_length)
    return tf.minimum(budgets, cfg.max_len)


def next_token_log_probs(model: Transformer, tgt: tf.Tensor, memory: tf.Tensor, src_mask: tf.Tensor | None,
                         cache: Cache = (), cache_index: Index | None = None) -> tf.Tensor | tuple[tf.Tensor, Cache]:
    """Log-probabilities of the token after ``tgt``, with the tokens of ``config.never_emitted`` set to
    -inf so that they are never chosen.

    Without a cache (``()``) ``tgt`` is the whole prefix, read under the causal mask alone: tgt (B, T) ->
    (B, V). With a ``cache``
    (``model.init_cache``) ``tgt`` holds the new positions only, starting at ``cache_index``,
    and the result is ``(log_probs (B, V), cache)``.
    """
    return _next_token(_log_probs_at, model, tgt, memory, src_mask, cache, cache_index)


def next_token_logits(model: Transformer, tgt: tf.Tensor, memory: tf.Tensor, src_mask: tf.Tensor | None,
                      cache: Cache = (), cache_index: Index | None = None) -> tf.Tensor | tuple[tf.Tensor, Cache]:
    """The generator's logits (``Generator.logits``: before its log-softmax, nothing suppressed) of the token after the
    last position of ``tgt``, what greedy decoding's repetition penalty reads (the reference's ``next_token_logits``);
    ``tgt``, ``cache`` and ``cache_index`` as for :func:`next_token_log_probs`. Shape: tgt (B, T) -> logits (B, V)."""
    return _next_token(_logits_at, model, tgt, memory, src_mask, cache, cache_index)


def _next_token(read: Callable[..., tf.Tensor], model: Transformer, tgt: tf.Tensor, memory: tf.Tensor,
                src_mask: tf.Tensor | None, cache: Cache, cache_index: Index | None) -> Any:
    """What ``read`` (``_log_probs_at`` or ``_logits_at``) gives at the last position of the decoder's
    output after ``tgt``: the body of :func:`next_token_log_probs` and :func:`next_token_logits`, their arguments as
    there."""
    weight = model.generator._weight()
    if not cache:
        out = model.decode(tgt, memory, src_mask, causal_mask(tf.shape(tgt)[1]))           # (B, T, D)
        return read(model, out, tf.shape(out)[1] - 1, weight)
    cache = cache if cache_index is None else at_position(cache, cache_index)
    out, cache = model.decode(tgt, memory, src_mask, cache=cache)
    return read(model, out, tf.shape(out)[1] - 1, weight), cache


def reorder_cache(cache: tuple[tuple[KVCache, ...], ...], beams: tf.Tensor) -> tuple[tuple[KVCache, ...], ...]:
    """Every layer's caches follow their beams: row i of the result holds the hypothesis of row
    ``beams[i]`` (beam search keeps the caches of the hypotheses it extends). A
    :class:`~.incremental.KVCache` without a ``beams`` table is gathered along the batch axis; one with
    a table keeps its keys and values where they are and gathers the table's rows (beams never
    move between sentences).

    Shape: beams (N,) int; every keys/values tensor (N, H, C, d_k); a table (N / K, K, C).
    """
    return tuple(tuple(_follow(layer_cache, beams) for layer_cache in layer) for layer in cache)


def _follow(cache: KVCache, beams: tf.Tensor) -> KVCache:
    """One :class:`~.incremental.KVCache` of :func:`reorder_cache`."""
    if isinstance(cache.beams, tuple):
        return cache._replace(keys=tf.gather(cache.keys, beams), values=tf.gather(cache.values, beams))
    table = tf.reshape(cache.beams, (-1, cache.beams.shape[2]))            # (N, C)
    return cache._replace(beams=tf.reshape(tf.gather(table, beams), cache.beams.shape))


def penalize(config: TransformerConfig, scores: tf.Tensor, history: tf.Tensor, step: Index) -> tf.Tensor:
    """The scores of the token at (traced) ``step`` with ``config.decoding.repetition_penalty`` p applied (the
    reference's ``penalize``): every token of the prefix ``history[:, :step]`` has its score divided by p where > 0
    and multiplied by p where < 0. ``scores`` unchanged when p is 1.
    Shape: scores (N, V), history (N, L + 1) -> (N, V)."""
    penalty, vocab = config.decoding.repetition_penalty, scores.shape[1]
    if penalty == 1.0:
        return scores
    tokens = tf.where(tf.range(history.shape[1]) < step, history, tf.constant(vocab, tf.int64))   # column V: no token
    rows = tf.broadcast_to(tf.range(tf.shape(history, tf.int64)[0])[:, None], tf.shape(tokens))
    shape = tf.stack([tf.shape(history, tf.int64)[0], vocab + 1])                           # (N, V + 1)
    counts = tf.scatter_nd(tf.reshape(tf.stack([rows, tokens], axis=2), (-1, 2)), tf.ones(tf.size(tokens), tf.int32),
                           shape)
    penalized = tf.where(scores < 0, scores * penalty, scores / penalty)
    return tf.where(counts[:, :vocab] > 0, penalized, scores)


def constrain(config: TransformerConfig, log_probs: tf.Tensor, history: tf.Tensor, step: Index) -> tf.Tensor:
    """The log-probabilities of the token at (traced) ``step`` with the reference's held-back tokens at -inf (its
    ``constrain``): eos below ``config.decoding.min_output_length``; with ``config.decoding.no_repeat_ngram_size`` n,
    each token that would complete an n-gram of the prefix ``history[:, :step]`` (the windows of the buffer that lie in
    the prefix and whose first n - 1 tokens are its last n - 1 name it); then, with ``config.decoding.renormalize``, a
    log-softmax of them (at every step of a config with either setting). ``log_probs`` unchanged without them.
    Shape: log_probs (N, V), history (N, L + 1) -> (N, V)."""
    n, vocab = config.decoding.no_repeat_ngram_size, log_probs.shape[1]
    if not (config.decoding.min_output_length or n):
        return log_probs
    never = tf.constant(-np.inf, log_probs.dtype)
    held = (tf.range(vocab) == config.eos_id) & (step < config.decoding.min_output_length)    # (V,)
    log_probs = tf.where(held, never, log_probs)
    width = history.shape[1] - n + 1                                                       # windows of the buffer
    if n and width > 0:
        windows = tf.stack([history[:, j:j + width] for j in range(n)], axis=2)              # (N, width, n)
        tail = tf.gather(history, tf.maximum(step - n + 1, 0) + tf.range(n - 1), axis=1)     # (N, n - 1)
        matches = tf.reduce_all(windows[:, :, :-1] == tail[:, None, :], axis=2) & (tf.range(width) < step - n + 1)
        rows = tf.broadcast_to(tf.range(tf.shape(history, tf.int64)[0])[:, None], tf.shape(matches))
        columns = tf.where(matches, windows[:, :, -1], tf.constant(vocab, tf.int64))       # column V: no token
        shape = tf.stack([tf.shape(history, tf.int64)[0], vocab + 1])                       # (N, V + 1)
        counts = tf.scatter_nd(tf.reshape(tf.stack([rows, columns], axis=2), (-1, 2)),
                               tf.ones(tf.size(matches), tf.int32), shape)
        log_probs = tf.where(counts[:, :vocab] > 0, never, log_probs)
    return log_softmax(log_probs) if config.decoding.renormalize else log_probs


def forced_tokens(config: TransformerConfig, step: Index, limits: tf.Tensor,
                  forced_bos_id: int | None) -> tf.Tensor:
    """The token each row is forced to emit at (traced) ``step`` (the reference's ``forced_tokens``):
    ``forced_bos_id`` at step 1, ``config.forced_last_id`` at the row's last step with
    ``config.decoding.forced_eos``, -1 where none. Shape: limits (N,) -> (N,) int64."""
    first = tf.constant(-1 if forced_bos_id is None else forced_bos_id, tf.int64)
    forced = tf.fill(tf.shape(limits), tf.where(tf.equal(step, 1), first, tf.constant(-1, tf.int64)))
    last = tf.constant(config.forced_last_id, tf.int64)
    return tf.where(tf.equal(step, limits) & config.decoding.forced_eos, last, forced)


def force(log_probs: tf.Tensor, forced: tf.Tensor) -> tf.Tensor:
    """Where a token is forced, it gets the log-probability 0 and every other -inf (the reference's ``force``).
    Shape: log_probs (N, V), forced (N,) -> (N, V)."""
    one_hot = tf.range(log_probs.shape[1], dtype=tf.int64) == forced[:, None]
    forcing = tf.where(one_hot, tf.constant(0.0, log_probs.dtype), tf.constant(-np.inf, log_probs.dtype))
    return tf.where(forced[:, None] >= 0, forcing, log_probs)


def _log_probs_at(model: Transformer, out: tf.Tensor, position: Index, weight: tf.Tensor) -> tf.Tensor:
    """The generator's log-probabilities (section 3.4) at one (possibly traced) position of the decoder
    output, the tokens of ``config.never_emitted`` set to -inf: the decoder never emits them (with
    ``config.decoding.renormalize``, a log-softmax of the others: the reference's ``_emittable``).
    Shape: out (N, T, D) -> (N, V).
    ``weight`` is the generator's (D, V) weight (``Generator._weight``, float32 for a low precision),
    given so that a search reads it once, not at every step (TensorFlow only: XLA does not hoist it)."""
    return _emittable(model.config, log_softmax(_logits(out[:, position], weight, model.generator._bias())))  # (N, V)


def _logits_at(model: Transformer, out: tf.Tensor, position: Index, weight: tf.Tensor) -> tf.Tensor:
    """The generator's logits (before its log-softmax) at one (possibly traced) position of the decoder output, nothing
    suppressed. Shape: out (N, T, D) -> (N, V). ``weight`` as for :func:`_log_probs_at`."""
    return _logits(out[:, position], weight, model.generator._bias())


def _emittable(config: TransformerConfig, scores: tf.Tensor) -> tf.Tensor:
    """The scores with the tokens of ``config.never_emitted`` at -inf and, with ``config.decoding.renormalize``, a
    log-softmax of them (the reference's ``_emittable``). Shape: (N, V) -> (N, V)."""
    never = list(config.never_emitted) or [-1]                                              # -1: no token
    forbidden = tf.reduce_any(tf.range(scores.shape[-1])[:, None] == never, axis=1)         # (V,)
    scores = tf.where(forbidden, tf.constant(-np.inf, scores.dtype), scores)
    return log_softmax(scores) if config.decoding.renormalize else scores


def _step(model: Transformer, tokens: tf.Tensor, step: Index, memory: tf.Tensor, src_mask: tf.Tensor,
          cache: Cache, weight: tf.Tensor, greedy: bool) -> tuple[tf.Tensor, Cache]:
    """One decoding step: the scores (N, V) of the token at (traced) position ``step`` after ``tokens[:, :step]`` (the
    start token at position 0), and the cache: the log-probabilities; with a ``repetition_penalty`` p != 1 (the
    reference's ``_scores``), :func:`penalize` first, on the logits in greedy decoding (``greedy``) and on the
    log-probabilities in beam search, then :func:`_emittable`. With a cache only the token at ``step - 1`` runs through
    the decoder (``cache_index = step - 1``); with ``()`` (no cache) the whole prefix does, as in the reference.
    ``weight`` as for :func:`_log_probs_at`. Shape: tokens (N, L + 1)."""
    cfg = model.config
    penalized = cfg.decoding.repetition_penalty != 1.0
    read = _logits_at if penalized else _log_probs_at
    if not cache:
        out = model.decode(tokens[:, :step], memory, src_mask, causal_mask(step))           # (N, step, D)
        scores = read(model, out, step - 1, weight)
    else:
        out, cache = model.decode(tokens[:, step - 1, None], memory, src_mask, cache=at_position(cache, step - 1))
        scores = read(model, out, 0, weight)                                               # out (N, 1, D)
    if penalized:
        scores = _emittable(cfg, penalize(cfg, scores if greedy else log_softmax(scores), tokens, step))
    return scores, cache


def _checked_source(model: Transformer, src: ArrayLike) -> tf.Tensor:
    """The source after the reference's checks (ids too, before any compiled code), as int64."""
    cfg = model.config
    return tf.constant(check_tokens("src", src, cfg.src_vocab_size, cfg.max_len), tf.int64)


def _start_tokens(config: TransformerConfig, rows: int, max_steps: int) -> tf.Tensor:
    """The token buffer: the start token (``config.start_id``), then pad_id up to position L (``max_steps``,
    :func:`_buffer_length`). Shape: (rows, L + 1)."""
    return tf.concat([tf.fill([rows, 1], tf.constant(config.start_id, tf.int64)),
                      tf.fill([rows, max_steps], tf.constant(config.pad_id, tf.int64))], axis=1)


def _put(tokens: tf.Tensor, token: tf.Tensor, t: Index) -> tf.Tensor:
    """TensorFlow only: tokens[..., t] = token, as a select (a tensor has no item assignment; PyTorch writes
    in place, JAX uses ``.at[].set``). Shape: tokens (..., W), token (...)."""
    return tf.where(tf.range(tokens.shape[-1]) == t, token[..., None], tokens)


def _buffer_length(model: Transformer, src: tf.Tensor) -> int:
    """TensorFlow only: L, the static bound on every output length (source width + 50, or
    ``max_output_length``, capped at ``max_len``), known when tracing; the per-sequence budgets are computed
    in-graph (:func:`max_output_lengths`). PyTorch and JAX read the budgets' maximum on the host."""
    cfg = model.config
    return min(src.shape[1] + EXTRA_OUTPUT_LENGTH if cfg.decoding.max_output_length is None else
               cfg.decoding.max_output_length, cfg.max_len)


# ----------------------------------------------------------------------------- greedy

def greedy_decode(model: Transformer, src: ArrayLike, use_cache: bool = True,
                  forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id; ``forced_bos_id`` the forced first token.

    Shape: src (B, S) -> tokens (B, L), without the start token, right-padded with pad_id.
    """
    forced_bos_id = check_forced_bos(model.config, forced_bos_id)
    src = _checked_source(model, src)
    with tf.device(model_device(model)):
        greedy = _compiled(model, ("greedy", use_cache, forced_bos_id), _greedy)
        tokens, steps = greedy(src, wide(model.generator._weight()))
    return tokens.numpy()[:, 1:int(steps) + 1]


def _greedy(model: Transformer, use_cache: bool, forced_bos_id: int | None, src: tf.Tensor,
            weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """TensorFlow only: the ``tf.function`` loop of :func:`greedy_decode` (:func:`_compiled`; JAX's ``_greedy``
    is a jitted loop with its own plumbing; PyTorch loops in ``greedy_decode``). Returns the token buffer
    (B, L + 1) (bos first) and the number of steps taken. ``weight`` is the generator's (D, V) weight
    (``Generator._weight``, float32 for a low precision), read once per search."""
    cfg = model.config
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src)                              # (B,)
    length = _buffer_length(model, src)
    memory = model.encode(src, src_mask)
    cache = model.init_cache(memory, length) if use_cache else ()
    pad = tf.constant(cfg.pad_id, tf.int64)

    def body(t, tokens, done, cache):
        log_probs, cache = _step(model, tokens, t, memory, src_mask, cache, weight, greedy=True)   # (B, V)
        log_probs = constrain(cfg, log_probs, tokens, t)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, t, limits, forced_bos_id))
        token = tf.argmax(log_probs, axis=-1, output_type=tf.int64)        # ties: the lowest id
        token = tf.where(done, pad, token)
        done = done | (token == cfg.eos_id) | (t >= limits)
        return t + 1, _put(tokens, token, t), done, cache

    start = (tf.constant(1), _start_tokens(cfg, src.shape[0], length), tf.zeros(src.shape[0], tf.bool), cache)
    t, tokens, _, _ = tf.while_loop(lambda t, tokens, done, cache: ~tf.reduce_all(done), body, start)
    return tokens, t - 1


# ----------------------------------------------------------------------------- beam search

def beam_search(model: Transformer, src: ArrayLike, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the config's length normalization (alpha: None is ``config.decoding.length_penalty``), the
    forced first token ``forced_bos_id`` and the tie-break of this module's docstring.

    Shape: src (B, S) -> tokens (B, L) without the start token, right-padded with pad_id, and the
    length-normalized scores (B,) (float64, like the reference's Python floats; computed in float32 for a
    bfloat16 or float16 model).
    """
    cfg = model.config
    beam_size, alpha = check_decoding_args(beam_size, alpha, cfg)
    forced_bos_id = check_forced_bos(cfg, forced_bos_id)
    src = _checked_source(model, src)
    penalties = [length_penalty(n, alpha, cfg.decoding.length_normalization)
                 for n in range(_buffer_length(model, src) + 1)]
    search = _compiled(model, ("beam", use_cache, beam_size, forced_bos_id), _beam)
    with tf.device(model_device(model)):
        tokens, lengths, scores = search(src, tf.constant(penalties, score_dtype(model.compute_dtype)),
                                         wide(model.generator._weight()))
    return tokens.numpy()[:, :int(tf.reduce_max(lengths))], scores.numpy().astype(np.float64)


def _beam(model: Transformer, use_cache: bool, beam_size: int, forced_bos_id: int | None, src: tf.Tensor,
          penalties: tf.Tensor, weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """TensorFlow only: the ``tf.function`` search of :func:`beam_search` (:func:`_compiled`; JAX's ``_beam``
    is a jitted search with its own plumbing; PyTorch searches in ``beam_search``). Returns the best
    hypotheses (B, L) pad-filled, their lengths (B,) and scores (B,).

    ``penalties[n]`` is lp(n) in the scores' dtype; ``weight`` as for :func:`_greedy`. Rows are
    (sentence, beam) pairs, N = B * K.
    """
    cfg, batch, k = model.config, src.shape[0], beam_size
    dtype = score_dtype(model.compute_dtype)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src)                              # (B,)
    length = _buffer_length(model, src)
    memory = model.encode(src, src_mask)                                  # (B, S, D)
    cache = _in_place(model.init_cache(memory, length) if use_cache else (), batch, k)
    memory = tf.repeat(memory, k, axis=0)                                  # (N, S, D)
    src_mask = tf.repeat(src_mask, k, axis=0)                              # (N, 1, 1, S)
    first_row = tf.range(batch)[:, None] * k                               # (B, 1): row of beam 0
    limit_penalty = tf.gather(penalties, limits)                           # (B,)
    row_limits = tf.repeat(limits, k)                                      # (N,)
    never = tf.constant(-np.inf, dtype)                                    # the score of what does not finish

    def body(t, history, live_scores, cache, best, kept, done):
        log_probs, cache = _step(model, history, t, memory, src_mask, cache, weight, greedy=False)   # (N, V)
        log_probs = constrain(cfg, log_probs, history, t)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, t, row_limits, forced_bos_id))
        candidates = live_scores[:, :, None] + tf.reshape(log_probs, (batch, k, -1))   # (B, K, V)
        scores, beams, tokens, finishing, keep = _select(candidates, cfg.eos_id, k)
        rows = _put(tf.gather(history, first_row + beams), tokens, t)         # (B, 2K, L + 1)
        ended = tf.where(finishing & ~done[:, None], scores / penalties[t], never)
        best = _keep_best(best, ended, rows, t)
        if cfg.decoding.length_normalization == "hf":                     # the gnmt rule reads best alone
            kept = tf.math.top_k(tf.concat([kept, ended], axis=1), k).values  # (B, K): best finished scores
        live_scores = tf.gather(scores, keep, batch_dims=1)                  # (B, K), descending
        rows = tf.gather(rows, keep, batch_dims=1)                           # (B, K, L + 1)
        cache = _reorder_own(cache, tf.reshape(first_row + tf.gather(beams, keep, batch_dims=1), [-1]))
        last = ~done & (t == limits)                                         # (B,)
        best = _keep_best(best, tf.where(last[:, None], live_scores / penalties[t], never), rows, t)
        done = done | last | _stops(cfg, live_scores[:, 0], best[0], kept, penalties[t], limit_penalty)
        return t + 1, tf.reshape(rows, (batch * k, -1)), live_scores, cache, best, kept, done

    alive = tf.constant([0.0] + [-np.inf] * (k - 1), dtype)               # (K,): only beam 0 exists at first
    no_best = (tf.fill([batch], never), _start_tokens(cfg, batch, length),
               tf.zeros([batch], tf.int32))                                # score, row (B, L + 1), length
    start = (tf.constant(1), _start_tokens(cfg, batch * k, length), tf.tile(alive[None], [batch, 1]), cache,
             no_best, tf.fill([batch, k], never), tf.zeros([batch], tf.bool))
    *_, (score, row, lengths), _, _ = tf.while_loop(lambda *carry: ~tf.reduce_all(carry[-1]), body, start)
    return row[:, 1:], lengths, score


def _stops(config: TransformerConfig, best_live: tf.Tensor, best: tf.Tensor, kept: tf.Tensor, penalty: tf.Tensor,
           limit_penalty: tf.Tensor) -> tf.Tensor:
    """Which sentences stop by the normalization's rule after a step (the reference's ``search_ends``): "gnmt",
    no live beam can beat the best finished score, best_live / lp(limit) <= best; "hf", once ``beam_size``
    hypotheses have finished (``kept``, the best finished scores, full), ``config.decoding.early_stopping``: True at
    once, else best_live / lp(bound) <= the worst kept score, bound = this step's length (``penalty``) or, for
    "never", the limit. A sentence with no live beam left (best_live -inf) stops.
    Shape: best_live, best (B,); kept (B, K); penalty (); limit_penalty (B,) -> (B,) bool."""
    if config.decoding.length_normalization == "gnmt":
        return best_live / limit_penalty <= best
    full = kept[:, -1] > -np.inf
    if config.decoding.early_stopping is True:
        return full | (best_live == -np.inf)
    bound = limit_penalty if config.decoding.early_stopping == "never" else penalty
    return (full & (best_live / bound <= kept[:, -1])) | (best_live == -np.inf)


def _in_place(cache: Cache, batch: int, beam_size: int) -> Cache:
    """The caches of a beam search's N = B * K rows from the decoder's caches of its B sentences: each self-attention
    cache K rows per sentence with a ``beams`` table in which every row holds its own positions (:func:`reorder_cache`
    then reorders tables, not keys and values); the memory's keys and values one row per sentence, read by its K rows
    (``incremental._attend_memory``). ``()``, no cache, stays ``()``.
    Shape: each self-attention cache (N, H, C, d_k), its table (B, K, C)."""
    own_rows = tf.range(beam_size)[None, :, None]                          # (1, K, 1)

    def rows(own: KVCache) -> KVCache:
        keys = tf.zeros((batch * beam_size, *own.keys.shape[1:]), own.keys.dtype)   # (N, H, C, d_k)
        beams = tf.broadcast_to(own_rows, (batch, beam_size, own.keys.shape[2]))
        return own._replace(keys=keys, values=keys, beams=beams)
    return tuple((rows(own), memory) for own, memory in cache)


def _reorder_own(cache: Cache, beams: tf.Tensor) -> Cache:
    """:func:`reorder_cache` of each layer's self-attention cache only: the memory's keys and values are the
    same for every beam of a sentence, so they stay where they are (``()``, no cache, stays ``()``)."""
    kept = reorder_cache(tuple((own,) for own, _ in cache), beams)
    return tuple((own, memory) for (own,), (_, memory) in zip(kept, cache))


def _select(candidates: tf.Tensor, eos_id: int,
            beam_size: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """One step's choices for every sentence (the reference's ``select_candidates``): the 2K best
    (beam b, token v) candidates, best first, ties to the lower b, then the lower v (the order of
    the reference's stable sort); an eos among the first K ranks finishes a hypothesis; the first K
    non-eos ranks are the next live beams, in rank order (each beam has one eos, so they are among
    the first 2K).

    ``tf.math.top_k`` of the flat beam-major scores (index b * V + v) ranks them: it documents that
    of equal values the lower index comes first. -0.0 is made +0.0 first: under XLA, top_k (like
    a sort) ranks +0.0 above -0.0, which NumPy's sort holds equal.

    Shape: candidates (B, K, V) -> value, beam, token, finishing (B, 2K) in rank order; keep (B, K),
    the ranks of the next live beams.
    """
    batch, vocab, k = candidates.shape[0], candidates.shape[2], beam_size
    flat = tf.reshape(candidates, (batch, k * vocab))                      # (B, K*V), beam-major
    value, ranking = tf.math.top_k(tf.where(flat == 0, tf.zeros_like(flat), flat), 2 * k)   # (B, 2K) each
    beam, token = ranking // vocab, tf.cast(ranking % vocab, tf.int64)
    is_eos = token == eos_id
    rank = tf.range(2 * k)[None, :]                                        # (1, 2K)
    keep = tf.math.top_k(-tf.where(is_eos, rank + 2 * k, rank), k).indices   # (B, K): distinct keys, no ties
    return value, beam, token, is_eos & (rank < k), keep


def _keep_best(best: tuple[tf.Tensor, tf.Tensor, tf.Tensor], scores: tf.Tensor, rows: tf.Tensor,
               length: Index) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Replace each sentence's ``best`` = (score, row, length) by its first candidate of highest score,
    only if that score is strictly greater (so earlier finished hypotheses win ties). The first maximum is
    found explicitly: ``tf.argmax`` does not promise which of equal values it returns.

    Shape: best ((B,), (B, L + 1), (B,)); scores (B, C) in rank order, -inf for candidates that do not
    finish; rows (B, C, L + 1).
    """
    top = tf.reduce_max(scores, axis=1, keepdims=True)                     # (B, 1)
    first = tf.reduce_min(tf.where(scores == top, tf.range(scores.shape[1]), scores.shape[1] - 1), axis=1)  # (B,)
    score, row = tf.gather(scores, first, batch_dims=1), tf.gather(rows, first, batch_dims=1)   # (B,), (B, L + 1)
    better = score > best[0]
    return (tf.where(better, score, best[0]), tf.where(better[:, None], row, best[1]),
            tf.where(better, length, best[2]))


def _compiled(model: Transformer, key: tuple, search: Callable[..., Any]) -> Callable[..., Any]:
    """TensorFlow only: one ``tf.function`` per model and search ``key`` = (name, use_cache, *options): the
    search called as ``search(model, use_cache, *options, *inputs)``, XLA-compiled when using
    the cache (a float32 or float64 model: :func:`.speed._xla_keeps_roundings`), traced once per input
    shape (without AutoGraph: the searches are written with
    ``tf.while_loop`` and need no conversion, which only slows tracing). The function refers to
    the model weakly, so the model can still be freed."""
    functions = _COMPILED.setdefault(model, {})
    if key not in functions:
        ref = weakref.ref(model)
        functions[key] = tf.function(lambda *inputs: search(ref(), *key[1:], *inputs),
                                     jit_compile=key[1] and _xla_keeps_roundings(model), autograph=False)
    return functions[key]
