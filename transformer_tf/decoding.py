"""Greedy decoding and beam search (section 6.1) for the TensorFlow port, compiled.

The rules are the reference's, word for word (``reference_numpy/decoding.py``): maximum
output length = non-pad source tokens + 50 capped at ``max_len``; output without bos,
right-padded with pad_id; pad_id and bos_id are never emitted (their log-probabilities are set
to -inf before choosing); greedy ties go to the lowest token id; beam candidates are ranked by
summed log-probability (model dtype), ties to the lower beam then the lower token; eos finishes
a hypothesis only among the first ``beam_size`` ranks; the search stops at the maximum length
(live beams are then scored as finished, in rank order, after that step's eos hypotheses), when
no live beam is left, or when no live beam can beat the best finished one; the best score wins,
a tie going to the hypothesis finished first. Beam rows that hold no live beam (only one exists
at first; none when only eos can follow) score -inf: they never finish, and when all of a
sentence's rows do, the stopping rule (-inf <= best finished score) ends its search.

Each search is one ``tf.function`` holding a ``tf.while_loop`` over output positions, for the
whole batch at once (beam search keeps B x beam_size rows):

* ``use_cache=True``: the decoder runs one position per step. Each layer's self-attention
  keys and values live in a preallocated (rows, H, L, d_k) cache written at step t, and the
  cross-attention keys and values are computed once from the encoder output. Every shape is
  static, so the loop is XLA-compiled (``jit_compile=True``; XLA on CPU supports float64
  for every op used).
* ``use_cache=False``: the reference's way, each step reruns the decoder on the whole prefix.
  The prefix grows, so this graph runs without XLA.
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from reference_numpy.decoding import (BEAM_SIZE, EXTRA_OUTPUT_LENGTH, LENGTH_PENALTY_ALPHA, check_decoding_args,
                                      length_penalty)

from .device import model_device
from .model import DecoderLayer, Transformer, padding_mask, residual

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {search key: tf.function}


def greedy_decode(model: Transformer, src, use_cache: bool = True) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id.

    Shape: src (B, S) -> tokens (B, L), without bos, right-padded with pad_id.
    """
    src = model._check_tokens("src", src, model.config.src_vocab_size)
    with tf.device(model_device(model)):
        tokens, steps = _compiled(model, ("greedy", use_cache), _greedy)(src)
    return tokens.numpy()[:, 1:int(steps) + 1]


def beam_search(model: Transformer, src, beam_size: int = BEAM_SIZE, alpha: float = LENGTH_PENALTY_ALPHA,
                use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the GNMT length penalty and the tie-break of this module's docstring.

    Shape: src (B, S) -> tokens (B, L) without bos, right-padded with pad_id, and the
    length-normalized scores (B,) (float64, like the reference's Python floats).
    """
    beam_size, alpha = check_decoding_args(beam_size, alpha)
    src = model._check_tokens("src", src, model.config.src_vocab_size)
    penalties = [length_penalty(n, alpha) for n in range(_buffer_length(model, src) + 1)]
    search = _compiled(model, ("beam", use_cache, beam_size), _beam)
    with tf.device(model_device(model)):
        tokens, lengths, scores = search(src, tf.constant(penalties, model.compute_dtype))
    return tokens.numpy()[:, :int(tf.reduce_max(lengths))], scores.numpy().astype(np.float64)


def cached_log_probs(model: Transformer, src, tgt) -> np.ndarray:
    """Teacher-forced log-probabilities computed one position at a time through the key/value
    cache, exactly as the cached searches compute them (for checking the cache).

    Shape: src (B, S), tgt (B, T) -> (B, T, V), like ``model(src, tgt)``.
    """
    src = model._check_tokens("src", src, model.config.src_vocab_size)
    tgt = model._check_tokens("tgt", tgt, model.config.tgt_vocab_size)
    src_mask = padding_mask(src, model.config.pad_id)
    state, step = _stepper(model, model.encode(src, src_mask), src_mask, tgt.shape[1], use_cache=True)
    log_probs = []
    for t in range(1, tgt.shape[1] + 1):
        step_log_probs, state = step(tgt, tf.constant(t), state)
        log_probs.append(step_log_probs)
    return tf.stack(log_probs, axis=1).numpy()


# ----------------------------------------------------------------------------- the searches

def _greedy(model: Transformer, use_cache: bool, src):
    """Returns the token buffer (B, L + 1) (bos first) and the number of steps taken."""
    cfg = model.config
    src_mask = padding_mask(src, cfg.pad_id)
    limits = _max_output_lengths(model, src)                              # (B,)
    length = _buffer_length(model, src)
    state, step = _stepper(model, model.encode(src, src_mask), src_mask, length, use_cache)
    pad = tf.constant(cfg.pad_id, tf.int64)

    def body(t, tokens, done, state):
        log_probs, state = step(tokens, t, state)
        log_probs = _never_emitted(cfg, log_probs)                         # (B, V)
        token = tf.argmax(log_probs, axis=-1, output_type=tf.int64)        # ties: the lowest id
        token = tf.where(done, pad, token)
        done = done | (token == cfg.eos_id) | (t >= limits)
        return t + 1, _put(tokens, token, t), done, state

    start = (tf.constant(1), _start_tokens(cfg, src.shape[0], length), tf.zeros(src.shape[0], tf.bool), state)
    t, tokens, _, _ = tf.while_loop(lambda t, tokens, done, state: ~tf.reduce_all(done), body, start)
    return tokens, t - 1


def _beam(model: Transformer, use_cache: bool, beam_size: int, src, penalties):
    """Returns the best hypotheses (B, L) pad-filled, their lengths (B,) and scores (B,).

    ``penalties[n]`` is lp(n) in the model dtype. Rows are (sentence, beam) pairs, N = B * K.
    """
    cfg, batch, k = model.config, src.shape[0], beam_size
    dtype = model.compute_dtype
    src_mask = padding_mask(src, cfg.pad_id)
    limits = _max_output_lengths(model, src)                              # (B,)
    length = _buffer_length(model, src)
    memory = model.encode(src, src_mask)
    state, step = _stepper(model, tf.repeat(memory, k, axis=0), tf.repeat(src_mask, k, axis=0), length,
                           use_cache)
    first_row = tf.range(batch)[:, None] * k                               # (B, 1): row of beam 0
    rank = tf.range(2 * k)[None, :]                                        # (1, 2K)
    limit_penalty = tf.gather(penalties, limits)                           # (B,)

    def body(t, tokens, scores, state, done, best):
        log_probs, state = step(tokens, t, state)
        log_probs = _never_emitted(cfg, log_probs)                         # (N, V)
        vocab = log_probs.shape[-1]
        candidates = scores[:, :, None] + tf.reshape(log_probs, (batch, k, vocab))   # (B, K, V)
        flat = tf.reshape(candidates, (batch, k * vocab))                 # (B, K*V), beam-major
        # Stable sort of the negated scores: ties go to the lower beam, then the lower token.
        # The first 2K ranks hold the first K non-eos candidates (each beam has one eos).
        ranking = tf.argsort(-flat, axis=-1, stable=True)[:, :2 * k]       # (B, 2K)
        value = tf.gather(flat, ranking, batch_dims=1)                     # (B, 2K), descending
        beam, token = ranking // vocab, tf.cast(ranking % vocab, tf.int64)
        is_eos = token == cfg.eos_id
        active = ~done
        # Finished hypotheses, in rank order, replace the best only on a strictly greater score;
        # at this step all share lp(t), so the first eos among the first K ranks is the one to try.
        finishing = is_eos & (rank < k)
        first = tf.argmax(tf.cast(finishing, tf.int32), axis=-1, output_type=tf.int32)   # (B,)
        parent = tf.gather(tokens, first_row[:, 0] + tf.gather(beam, first, batch_dims=1))  # (B, L+1)
        best = _keep_better(best, active & tf.reduce_any(finishing, axis=-1),
                            tf.gather(value, first, batch_dims=1) / penalties[t],
                            _put(parent, tf.fill([batch], tf.constant(cfg.eos_id, tf.int64)), t)[:, 1:], t)
        # The first K non-eos candidates are the next live beams, in rank order.
        keep = tf.argsort(tf.where(is_eos, rank + 2 * k, rank), axis=-1, stable=True)[:, :k]   # (B, K)
        rows = tf.reshape(first_row + tf.gather(beam, keep, batch_dims=1), [-1])           # (N,)
        tokens = _put(tf.gather(tokens, rows), tf.reshape(tf.gather(token, keep, batch_dims=1), [-1]), t)
        scores = tf.gather(value, keep, batch_dims=1)                      # (B, K), descending
        state = tf.nest.map_structure(lambda cache: tf.gather(cache, rows), state)
        # At the maximum length the live beams finish too (beam 0 ranks first and scores highest).
        at_limit = active & (t >= limits)
        best = _keep_better(best, at_limit, scores[:, 0] / penalties[t],
                            tf.gather(tokens, first_row[:, 0])[:, 1:], t)
        stop = at_limit | (scores[:, 0] / limit_penalty <= best[0])
        return t + 1, tokens, scores, state, done | (active & stop), best

    alive = tf.constant([0.0] + [-np.inf] * (k - 1), dtype)               # only beam 0 exists at first
    best = (tf.fill([batch], tf.constant(-np.inf, dtype)),                 # score
            tf.fill([batch, length], tf.constant(cfg.pad_id, tf.int64)),   # tokens (B, L)
            tf.zeros([batch], tf.int32))                                   # length
    start = (tf.constant(1), _start_tokens(cfg, batch * k, length), tf.tile(alive[None], [batch, 1]), state,
             tf.zeros([batch], tf.bool), best)
    *_, best = tf.while_loop(lambda t, tokens, scores, state, done, best: ~tf.reduce_all(done), body, start)
    score, tokens, lengths = best
    return tokens, lengths, score


def _keep_better(best, candidate, score, tokens, t):
    """Replace the best (score, tokens, length) where ``candidate`` and strictly better."""
    better = candidate & (score > best[0])
    return (tf.where(better, score, best[0]), tf.where(better[:, None], tokens, best[1]),
            tf.where(better, t, best[2]))


# ----------------------------------------------------------------------------- one decoder step

def _stepper(model: Transformer, memory, src_mask, length: int, use_cache: bool):
    """The decoder one output position at a time, for ``memory`` rows.

    Returns ``(state, step)``; ``step(tokens, t, state) -> (log_probs (N, V), state)`` gives the
    log-probabilities of the token at position t from tokens[:, :t] (bos at position 0), as
    ``model(src, tokens)`` would at position t - 1. ``state`` is the key/value cache (one (k, v)
    pair of (N, H, L, d_k) per layer) or ``()`` when the whole prefix is recomputed.
    """
    if not use_cache:
        def prefix_step(tokens, t, state):
            return model.generator(model.decode(tokens[:, :t], memory, src_mask)[:, -1:])[:, 0], state
        return (), prefix_step

    cfg = model.config
    cross = tuple((layer.cross_attn._split_heads(layer.cross_attn.k_proj(memory)),    # (N, H, S, d_k)
                   layer.cross_attn._split_heads(layer.cross_attn.v_proj(memory)))
                  for layer in model.decoder.layers)
    empty = tf.zeros((tf.shape(memory)[0], cfg.n_heads, length, cfg.d_k), model.compute_dtype)  # (N, H, L, d_k)

    def cached_step(tokens, t, cache):
        position = t - 1                                                   # of the input token
        x = model.tgt_pos(model.tgt_embed(tf.gather(tokens, [position], axis=1)), offset=position,
                          training=False)                                  # (N, 1, D)
        visible = tf.not_equal(tokens[:, :length], cfg.pad_id) & (tf.range(length) <= position)
        self_mask = visible[:, None, None, :]                              # (N, 1, 1, L)
        new_cache = []
        for layer, (k_cache, v_cache), (cross_k, cross_v) in zip(model.decoder.layers, cache, cross):
            x, k_cache, v_cache = _decoder_layer_step(layer, x, k_cache, v_cache, position, self_mask,
                                                      cross_k, cross_v, src_mask)
            new_cache.append((k_cache, v_cache))
        if model.decoder.norm is not None:
            x = model.decoder.norm(x)
        return model.generator(x)[:, 0], tuple(new_cache)

    return tuple((empty, empty) for _ in model.decoder.layers), cached_step


def _decoder_layer_step(layer: DecoderLayer, x, k_cache, v_cache, position, self_mask, cross_k, cross_v,
                        src_mask):
    """``DecoderLayer.call`` for one position (inference): the new key and value are written
    into the cache at ``position`` and the query attends to the cache.

    Shape: x (N, 1, D), caches (N, H, L, d_k), cross keys/values (N, H, S, d_k).
    """
    written = {}

    def self_attn(h):
        attn = layer.self_attn
        written["k"] = _write(k_cache, attn._split_heads(attn.k_proj(h)), position)
        written["v"] = _write(v_cache, attn._split_heads(attn.v_proj(h)), position)
        return attn.attend(attn._split_heads(attn.q_proj(h)), written["k"], written["v"], self_mask)

    def cross_attn(h):
        attn = layer.cross_attn
        return attn.attend(attn._split_heads(attn.q_proj(h)), cross_k, cross_v, src_mask)

    x = residual(x, self_attn, layer.self_attn_norm, layer.norm_first, tf.identity)
    x = residual(x, cross_attn, layer.cross_attn_norm, layer.norm_first, tf.identity)
    x = residual(x, layer.ffn, layer.ffn_norm, layer.norm_first, tf.identity)
    return x, written["k"], written["v"]


# ----------------------------------------------------------------------------- helpers

def _never_emitted(cfg, log_probs):
    """pad_id and bos_id are never chosen: their log-probabilities become -inf. Shape: (N, V)."""
    forbidden = tf.reduce_any(tf.range(log_probs.shape[-1])[:, None] == [cfg.pad_id, cfg.bos_id], axis=1)
    return tf.where(forbidden, tf.constant(-np.inf, log_probs.dtype), log_probs)


def _write(cache, new, position):
    """cache[:, :, position] = new. Shape: cache (N, H, L, d_k), new (N, H, 1, d_k)."""
    at = tf.range(cache.shape[2]) == position
    return tf.where(at[None, None, :, None], new, cache)


def _put(tokens, token, t):
    """tokens[:, t] = token. Shape: tokens (N, W), token (N,)."""
    return tf.where(tf.range(tokens.shape[1])[None, :] == t, token[:, None], tokens)


def _start_tokens(cfg, rows: int, length: int) -> tf.Tensor:
    """The token buffer: bos, then pad_id up to position L. Shape: (rows, L + 1)."""
    return tf.concat([tf.fill([rows, 1], tf.constant(cfg.bos_id, tf.int64)),
                      tf.fill([rows, length], tf.constant(cfg.pad_id, tf.int64))], axis=1)


def _max_output_lengths(model: Transformer, src) -> tf.Tensor:
    """Per-sequence output budget: non-pad source tokens + 50, capped at ``max_len``. Shape: (B,)."""
    lengths = tf.reduce_sum(tf.cast(tf.not_equal(src, model.config.pad_id), tf.int32), axis=1)
    return tf.minimum(lengths + EXTRA_OUTPUT_LENGTH, model.config.max_len)


def _buffer_length(model: Transformer, src) -> int:
    """L, the static bound on every output length: source width + 50, capped at ``max_len``."""
    return min(src.shape[1] + EXTRA_OUTPUT_LENGTH, model.config.max_len)


def _compiled(model: Transformer, key: tuple, search):
    """One ``tf.function`` per model and search ``key`` = (name, use_cache, *options): the
    search called as ``search(model, use_cache, *options, *inputs)``, XLA-compiled when using
    the cache. The function refers to the model weakly, so the model can still be freed."""
    functions = _COMPILED.setdefault(model, {})
    if key not in functions:
        ref = weakref.ref(model)
        functions[key] = tf.function(lambda *inputs: search(ref(), *key[1:], *inputs), jit_compile=key[1])
    return functions[key]
