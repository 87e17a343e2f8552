"""Greedy decoding and beam search (section 6.1) with a key/value cache.

The rules are the reference's, to the letter (``reference_numpy/decoding.py``): the same maximum output length (non-pad
source tokens + 50, or ``config.decoding.max_output_length``, capped at ``max_len``), the same start token
(``config.start_id``), the tokens of ``config.never_emitted`` never emitted, the same held-back tokens
(``config.decoding.min_output_length``, ``config.decoding.no_repeat_ngram_size``: :func:`constrain`), the same forced
tokens (``forced_bos_id``, ``config.decoding.forced_eos``), the decoder reading its prefix under the causal mask alone,
greedy ties to the lowest token id, beam candidates ranked by summed log-probability (accumulated in the model's dtype;
float32 for a bfloat16 or float16 model, whose log-probabilities are float32, ``reference_numpy.precision.score_dtype``)
with ties to the lower beam then the lower token, eos only among the first ``beam_size`` ranks, the same length
normalization and stopping rule (``config.decoding.length_normalization``, ``config.decoding.early_stopping``: "hf"
keeps the ``beam_size`` best finished scores of each sentence, :func:`_stops`), and the final tie to the hypothesis
finished first. Outputs are NumPy arrays in the reference's layout (no start token, right-padded with pad_id).

With ``use_cache=True`` (the default) each new token costs one decoder step: the model's
key/value cache (``model.init_cache``, :class:`.incremental.KVCache`) keeps the self-attention keys and
values of earlier positions in preallocated buffers, written in place, and the memory's
encoder-decoder keys and values projected once per sentence. Beam search has the design of the JAX
and TensorFlow ports, helper for helper: it keeps each row's self-attention keys and values where
they are and a ``beams`` table of which row holds each position of each hypothesis
(``KVCache.beams``, :func:`_in_place`) follows the beams (:func:`reorder_cache` reorders the table,
not the keys and values: under XLA, TensorFlow's search is much faster so; docs/benchmarks.md). It
advances every sentence's beams together: rows are (sentence, beam) pairs, N = B * K; slots not yet filled (the first
step has one live beam) hold the score -inf, rank after every real candidate and never finish; a
sentence that has stopped is still computed but changes nothing until every sentence has stopped.
Candidates are ranked by ``torch.topk`` (2K of the K * V), not a full sort. ``use_cache=False``
(no cache: ``()``, as in every port) recomputes the whole prefix at every step, as the reference
does; both give the same log-probabilities (to rounding) for the rows still being decoded, and the same tokens (a
finished greedy row only receives pad; with the cache its pad keys are not masked, which
changes nothing it emits).

The model should be in ``eval()`` mode (dropout off); decoding runs in ``torch.inference_mode()`` (no
gradients, and less bookkeeping per operation than ``torch.no_grad()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reference_numpy.config import TransformerConfig
from reference_numpy.decoding import (
    BEAM_SIZE,
    check_decoding_args,
    check_forced_bos,
    length_penalty,
    max_output_lengths,
)

from . import speed
from .checks import check_tokens
from .incremental import KVCache, at_position
from .model import Transformer, causal_mask, log_softmax, padding_mask
from .precision import LOW


def next_token_log_probs(model: Transformer, tgt: Tensor, memory: Tensor, src_mask: Tensor,
                         cache: tuple = (), cache_index: int | None = None,
                         ) -> Any:   # (B, V) log-probabilities; with a cache, (them, the new cache)
    """Log-probabilities of the token after the last position of ``tgt``, with the tokens of
    ``config.never_emitted`` set to -inf so that they are never chosen.

    Without a cache (``()``) ``tgt`` is the whole prefix (the decoder is recomputed, under
    :func:`.model.causal_mask` alone); with a ``cache`` (``model.init_cache``) holding positions
    0 .. cache_index - 1, ``tgt`` holds only the new positions, from ``cache_index`` on (under the
    causal mask of ``Transformer.decode``), and the result is ``(log_probs, cache)``.

    Shape: tgt (B, T) -> log_probs (B, V).
    """
    return _next_token(_log_probs_at, model, tgt, memory, src_mask, cache, cache_index)


def next_token_logits(model: Transformer, tgt: Tensor, memory: Tensor, src_mask: Tensor,
                      cache: tuple = (), cache_index: int | None = None,
                      ) -> Any:   # (B, V) logits; with a cache, (them, the new cache)
    """The generator's logits (``Generator.logits``: before its log-softmax, nothing suppressed) of the token after the
    last position of ``tgt``, what greedy decoding's repetition penalty reads (the reference's ``next_token_logits``);
    ``tgt``, ``cache`` and ``cache_index`` as for :func:`next_token_log_probs`. Shape: tgt (B, T) -> logits (B, V)."""
    return _next_token(_logits_at, model, tgt, memory, src_mask, cache, cache_index)


def _next_token(read: Callable[..., Tensor], model: Transformer, tgt: Tensor, memory: Tensor,
                src_mask: Tensor, cache: tuple, cache_index: int | None) -> Any:
    """What ``read`` (``_log_probs_at`` or ``_logits_at``) gives at the last position of the decoder's
    output after ``tgt``: the body of :func:`next_token_log_probs` and :func:`next_token_logits`, their arguments as
    there."""
    if not cache:
        out = model.decode(tgt, memory, src_mask, tgt_mask=causal_mask(tgt.shape[1], tgt.device))   # (B, T, D)
        return read(model, out, out.shape[1] - 1)
    cache = cache if cache_index is None else at_position(cache, cache_index)
    out, cache = model.decode(tgt, memory, src_mask, cache=cache)
    return read(model, out, out.shape[1] - 1), cache


def reorder_cache(cache: tuple, beams: Tensor) -> tuple:
    """Every layer's caches follow their beams: row i of the result holds the hypothesis of row
    ``beams[i]`` (beam search: the beam that the i-th next live beam extends). A
    :class:`.incremental.KVCache` without a ``beams`` table keeps batch rows ``beams``; one with a table
    keeps its keys and values where they are and gathers the table's rows (beams never move
    between sentences).

    Shape: beams (N,) int; every keys/values tensor (N, H, C, d_k); a table (N / K, K, C).
    """
    return tuple(tuple(_follow(layer_cache, beams) for layer_cache in layer) for layer in cache)


def _follow(cache: KVCache, beams: Tensor) -> KVCache:
    """One :class:`.incremental.KVCache` of :func:`reorder_cache`."""
    if isinstance(cache.beams, tuple):
        return cache._replace(keys=cache.keys.index_select(0, beams), values=cache.values.index_select(0, beams))
    table = cache.beams.reshape(-1, cache.beams.shape[2])                 # (N, C)
    return cache._replace(beams=table.index_select(0, beams).reshape(cache.beams.shape))


def penalize(config: TransformerConfig, scores: Tensor, history: Tensor, step: int) -> Tensor:
    """The scores of the token at ``step`` with ``config.decoding.repetition_penalty`` p applied (the reference's
    ``penalize``): every token of the prefix ``history[:, :step]`` has its score divided by p where > 0 and multiplied
    by p where < 0. ``scores`` unchanged when p is 1. Shape: scores (N, V), history (N, W), W >= step -> (N, V)."""
    penalty = config.decoding.repetition_penalty
    if penalty == 1.0:
        return scores
    seen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, history[:, :step], True)
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def constrain(config: TransformerConfig, log_probs: Tensor, history: Tensor, step: int) -> Tensor:
    """The log-probabilities of the token at ``step`` with the reference's held-back tokens at -inf (its ``constrain``):
    eos below ``config.decoding.min_output_length``; with ``config.decoding.no_repeat_ngram_size`` n, each token that
    would complete an n-gram of the prefix ``history[:, :step]`` (the windows of the prefix whose first n - 1 tokens are
    its last n - 1 name it); then, with ``config.decoding.renormalize``, a log-softmax of them (at every step of a
    config with either setting). ``log_probs`` unchanged without them.
    Shape: log_probs (N, V), history (N, W), W > step -> (N, V)."""
    n, vocab = config.decoding.no_repeat_ngram_size, log_probs.shape[1]
    if not (config.decoding.min_output_length or n):
        return log_probs
    if step < config.decoding.min_output_length:
        log_probs = log_probs.clone()
        log_probs[:, config.eos_id] = -torch.inf
    if n and step >= n:
        windows = history[:, :step].unfold(1, n, 1)                                # (N, step - n + 1, n)
        tail = history[:, step - n + 1:step]                                        # (N, n - 1)
        matches = (windows[:, :, :-1] == tail[:, None, :]).all(dim=2)               # (N, step - n + 1)
        banned = torch.zeros((len(log_probs), vocab + 1), dtype=torch.bool, device=log_probs.device)
        banned.scatter_(1, torch.where(matches, windows[:, :, -1], vocab), True)    # column V: no token
        log_probs = log_probs.masked_fill(banned[:, :vocab], -torch.inf)
    return log_softmax(log_probs) if config.decoding.renormalize else log_probs


def forced_tokens(config: TransformerConfig, step: int, limits: Tensor, forced_bos_id: int | None) -> Tensor:
    """The token each row is forced to emit at ``step`` (the reference's ``forced_tokens``): ``forced_bos_id`` at
    step 1, ``config.forced_last_id`` at the row's last step with ``config.decoding.forced_eos``, -1 where none.
    Shape: limits (N,) -> (N,)."""
    forced = torch.full_like(limits, -1 if forced_bos_id is None or step != 1 else forced_bos_id)
    return torch.where((limits == step) & config.decoding.forced_eos, config.forced_last_id, forced)


def force(log_probs: Tensor, forced: Tensor) -> Tensor:
    """Where a token is forced, it gets the log-probability 0 and every other -inf (the reference's ``force``);
    ``log_probs`` as they are at a step that forces nothing (most steps: eager PyTorch skips two passes over the
    vocabulary there, 8% of a beam step on a 58k vocabulary). Shape: log_probs (N, V), forced (N,) -> (N, V)."""
    if not bool((forced >= 0).any()):
        return log_probs
    one_hot = torch.arange(log_probs.shape[1], device=log_probs.device) == forced[:, None]
    forcing = torch.where(one_hot, 0.0, -torch.inf).to(log_probs.dtype)
    return torch.where(forced[:, None] >= 0, forcing, log_probs)


def _log_probs_at(model: Transformer, out: Tensor, position: int) -> Tensor:
    """The generator's log-probabilities (section 3.4) at one position of the decoder output, the tokens of
    ``config.never_emitted`` set to -inf: the decoder never emits them (with ``config.decoding.renormalize``,
    a log-softmax of the others: the reference's ``_emittable``). Shape: out (N, T, D) -> (N, V)."""
    return _emittable(model.config, model.generator(out[:, position:position + 1])[:, 0])


def _logits_at(model: Transformer, out: Tensor, position: int) -> Tensor:
    """The generator's logits (before its log-softmax) at one position of the decoder output, nothing suppressed.
    Shape: out (N, T, D) -> (N, V)."""
    return model.generator.logits(out[:, position:position + 1])[:, 0]


def _emittable(config: TransformerConfig, scores: Tensor) -> Tensor:
    """The scores with the tokens of ``config.never_emitted`` at -inf (in place) and, with
    ``config.decoding.renormalize``, a log-softmax of them (the reference's ``_emittable``). Shape: (N, V) -> (N, V)."""
    scores[:, list(config.never_emitted)] = -torch.inf
    return log_softmax(scores) if config.decoding.renormalize else scores


def _step(model: Transformer, tokens: Tensor, step: int, memory: Tensor, src_mask: Tensor,
          cache: tuple, greedy: bool) -> tuple[Tensor, tuple]:
    """One decoding step: the scores (N, V) of the token at position ``step`` after ``tokens[:, :step]`` (the start
    token at position 0), and the cache: the log-probabilities; with a ``repetition_penalty`` p != 1 (the reference's
    ``_scores``), :func:`penalize` first, on the logits in greedy decoding (``greedy``) and on the log-probabilities in
    beam search, then :func:`_emittable`. With a cache only the token at ``step - 1`` runs through the decoder
    (:func:`next_token_log_probs` or :func:`next_token_logits` at ``cache_index = step - 1``); with ``()`` (no cache)
    the whole prefix does, as in the reference; a model given to ``speed.compile_decoding`` runs the cached step as its
    compiled program (``speed.decoding_step``). Shape: tokens (N, W), W > step."""
    cfg = model.config
    penalized = cfg.decoding.repetition_penalty != 1.0
    next_token = next_token_logits if penalized else next_token_log_probs
    if not cache:
        scores = next_token(model, tokens[:, :step], memory, src_mask)
    else:
        scores, cache = speed.decoding_step(model, next_token)(tokens[:, step - 1:step], memory, src_mask, cache,
                                                               step - 1)
    if penalized:
        scores = _emittable(cfg, penalize(cfg, scores if greedy else log_softmax(scores), tokens, step))
    return scores, cache


def _checked_source(model: Transformer, src: Tensor | np.ndarray) -> Tensor:
    """The source after the reference's checks (shape, dtype, ids), as int64 on the model's device."""
    return check_tokens("src", src, model.config.src_vocab_size, model.config.max_len, model.device)


def _start_tokens(config: TransformerConfig, rows: int, max_steps: int, device: torch.device) -> Tensor:
    """The token buffer: the start token (``config.start_id``), then pad_id up to position M (``max_steps``).
    Shape: (rows, M + 1)."""
    tokens = torch.full((rows, max_steps + 1), config.pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = config.start_id
    return tokens


# ----------------------------------------------------------------------------- greedy

@torch.inference_mode()
def greedy_decode(model: Transformer, src: Tensor | np.ndarray, use_cache: bool = True,
                  forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id (``torch.argmax`` returns the first maximum);
    ``forced_bos_id`` the forced first token.

    Shape: src (B, S) -> tokens (B, L) NumPy int64, without the start token, right-padded with pad_id.
    """
    cfg = model.config
    forced_bos_id = check_forced_bos(cfg, forced_bos_id)
    src = _checked_source(model, src)
    memory = model.encode(src)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = torch.as_tensor(max_output_lengths(model, src.cpu().numpy()), device=src.device)    # (B,)
    max_steps = int(limits.max())
    cache = model.init_cache(memory, max_steps) if use_cache else ()
    tokens = _start_tokens(cfg, len(src), max_steps, src.device)               # (B, M + 1)
    done = torch.zeros(len(src), dtype=torch.bool, device=src.device)
    for step in range(1, max_steps + 1):
        log_probs, cache = _step(model, tokens, step, memory, src_mask, cache, greedy=True)
        log_probs = constrain(cfg, log_probs, tokens, step)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, step, limits, forced_bos_id))
        token = log_probs.argmax(dim=-1)                                   # (B,)
        token = torch.where(done, cfg.pad_id, token)
        tokens[:, step] = token
        done |= (token == cfg.eos_id) | (step >= limits)
        if bool(done.all()):
            break
    return tokens[:, 1:step + 1].cpu().numpy()


# ----------------------------------------------------------------------------- beam search

@torch.inference_mode()
def beam_search(model: Transformer, src: Tensor | np.ndarray, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the config's length normalization (alpha: None is ``config.decoding.length_penalty``), the
    forced first token ``forced_bos_id`` and the reference's tie-break (module docstring).

    Rows are (sentence, beam) pairs, N = B * K, advanced together until every sentence has stopped.

    Shape: src (B, S) -> tokens (B, L) NumPy int64 without the start token, right-padded with pad_id, and
    the length-normalized scores (B,).
    """
    cfg = model.config
    beam_size, alpha = check_decoding_args(beam_size, alpha, cfg)
    forced_bos_id, k = check_forced_bos(cfg, forced_bos_id), beam_size
    src = _checked_source(model, src)
    memory = model.encode(src)
    batch, device = len(src), memory.device
    scores_dtype = torch.float32 if model.dtype in LOW else model.dtype     # the log-probabilities'
    limits = torch.as_tensor(max_output_lengths(model, src.cpu().numpy()), device=device)        # (B,)
    max_steps = int(limits.max())
    # lp(n) for n = 0..M rounded to the scores' dtype, as NumPy rounds a Python float in `score / lp`
    penalties = torch.tensor([length_penalty(n, alpha, cfg.decoding.length_normalization)
                              for n in range(max_steps + 1)], dtype=torch.float64).to(device, scores_dtype)
    cache = _in_place(model.init_cache(memory, max_steps) if use_cache else (), batch, k)
    memory = memory.repeat_interleave(k, dim=0)                                  # (N, S, D)
    src_mask = padding_mask(src, cfg.pad_id).repeat_interleave(k, dim=0)         # (N, 1, 1, S)
    limit_penalty = penalties[limits]                                            # (B,): lp(limit)
    row_limits = limits.repeat_interleave(k)                                     # (N,)
    kept = torch.full((batch, k), -torch.inf, dtype=scores_dtype, device=device)   # (B, K): best finished scores
    first_row = torch.arange(batch, device=device)[:, None] * k                  # (B, 1): row of beam 0
    live_scores = torch.full((batch, k), -torch.inf, dtype=scores_dtype, device=device)
    live_scores[:, 0] = 0.0                                                      # (B, K): only beam 0 at first
    history = _start_tokens(cfg, batch * k, max_steps, device)                  # (N, M + 1)
    best = (torch.full((batch,), -torch.inf, dtype=scores_dtype, device=device), history[::k].clone(),
            torch.zeros(batch, dtype=torch.long, device=device))                # score, row, length
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(1, max_steps + 1):
        log_probs, cache = _step(model, history, step, memory, src_mask, cache, greedy=False)   # (N, V)
        log_probs = constrain(cfg, log_probs, history, step)
        if forced_bos_id is not None or cfg.decoding.forced_eos:           # nothing to force: no work
            log_probs = force(log_probs, forced_tokens(cfg, step, row_limits, forced_bos_id))
        candidates = log_probs.view(batch, k, -1).add_(live_scores[:, :, None])  # (B, K, V)
        scores, beams, tokens, finishing, keep = _select(candidates, cfg.eos_id, k)
        rows = history[first_row + beams]                                        # (B, 2K, M + 1)
        rows[:, :, step] = tokens
        ended = torch.where(finishing & ~done[:, None], scores / penalties[step], -torch.inf)
        best = _keep_best(best, ended, rows, step)
        if cfg.decoding.length_normalization == "hf":                     # the gnmt rule reads best alone
            kept = torch.cat([kept, ended], dim=1).topk(k, dim=1).values         # (B, K), descending
        live_scores = scores.gather(1, keep)                                     # (B, K), descending
        rows = rows.gather(1, keep[:, :, None].expand(-1, -1, rows.shape[2]))    # (B, K, M + 1)
        cache = _reorder_own(cache, (first_row + beams.gather(1, keep)).view(-1))
        last = ~done & (step == limits)                                          # (B,)
        best = _keep_best(best, torch.where(last[:, None], live_scores / penalties[step], -torch.inf), rows, step)
        done |= last | _stops(cfg, live_scores[:, 0], best[0], kept, penalties[step], limit_penalty)
        history = rows.view(batch * k, -1)
        if bool(done.all()):
            break
    score, row, length = best
    return row[:, 1:int(length.max()) + 1].cpu().numpy(), score.cpu().numpy().astype(np.float64)


def _stops(config: TransformerConfig, best_live: Tensor, best: Tensor, kept: Tensor, penalty: Tensor,
           limit_penalty: Tensor) -> Tensor:
    """Which sentences stop by the normalization's rule after a step (the reference's ``search_ends``): "gnmt",
    no live beam can beat the best finished score, best_live / lp(limit) <= best; "hf", once ``beam_size``
    hypotheses have finished (``kept``, the best finished scores, full), ``config.decoding.early_stopping``: True at
    once, else best_live / lp(bound) <= the worst kept score, bound = this step's length (``penalty``) or, for
    "never", the limit. A sentence with no live beam left (best_live -inf) stops.
    Shape: best_live, best (B,); kept (B, K); penalty () ; limit_penalty (B,) -> (B,) bool."""
    if config.decoding.length_normalization == "gnmt":
        return best_live / limit_penalty <= best
    full = kept[:, -1] > -torch.inf
    if config.decoding.early_stopping is True:
        return full | (best_live == -torch.inf)
    bound = limit_penalty if config.decoding.early_stopping == "never" else penalty
    return (full & (best_live / bound <= kept[:, -1])) | (best_live == -torch.inf)


def _in_place(cache: tuple, batch: int, beam_size: int) -> tuple:
    """The caches of a beam search's N = B * K rows from the decoder's caches of its B sentences: each self-attention
    cache K rows per sentence with a ``beams`` table in which every row holds its own positions (:func:`reorder_cache`
    then reorders tables, not keys and values); the memory's keys and values one row per sentence, read by its K rows
    (``incremental._attend_memory``). ``()``, no cache, stays ``()``.
    Shape: each self-attention cache (N, H, C, d_k), its table (B, K, C), written in place by the attention."""
    def rows(own: KVCache) -> KVCache:
        keys = own.keys.new_zeros((batch * beam_size, *own.keys.shape[1:]))          # (N, H, C, d_k)
        beams = torch.arange(beam_size, device=keys.device)[None, :, None].repeat(batch, 1, keys.shape[2])
        return own._replace(keys=keys, values=torch.zeros_like(keys), beams=beams)
    return tuple((rows(own), memory) for own, memory in cache)


def _reorder_own(cache: tuple, beams: Tensor) -> tuple:
    """:func:`reorder_cache` of each layer's self-attention cache only: the memory's keys and values are the
    same for every beam of a sentence, so they stay where they are (``()``, no cache, stays ``()``)."""
    kept = reorder_cache(tuple((own,) for own, _ in cache), beams)
    return tuple((own, memory) for (own,), (_, memory) in zip(kept, cache))


def _select(candidates: Tensor, eos_id: int, beam_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step's ranking and choices for every sentence (the reference's ``select_candidates``): the 2K best
    (beam b, token v) candidates by summed log-probability, ties to the lower b, then the lower v; an eos
    among the first K ranks finishes; the first K non-eos ranks are the next live beams, in rank order
    (K non-eos candidates are always among 2K: each beam has one eos).

    ``torch.topk`` (by :func:`.speed.top_k`) finds the 2K-th largest value of a sentence but promises no order
    among equal values, so it only sets the boundary: the first 2K ranks are every candidate above it and, of those
    equal to it, the ones of lowest flat (beam-major) index; a stable descending sort of these, taken in index
    order, is the reference's ranking. A candidate equal to the boundary is left out exactly when the
    (2K + 1)-th largest value equals the 2K-th, which the same ``topk`` finds (one pass over K x V, not two).

    Shape: candidates (B, K, V) -> scores, beams, tokens and finishing (B, 2K) in rank order; keep (B, K),
    the ranks of the next live beams.
    """
    batch, k, vocab = candidates.shape
    flat = candidates.reshape(batch, k * vocab)                                  # (B, K * V), index b * V + v
    top = min(2 * k, k * vocab)
    values, chosen = speed.top_k(flat, min(top + 1, k * vocab))                 # (B, 2K + 1) each, descending
    boundary = values[:, top - 1:top]                                            # (B, 1): the 2K-th largest
    short = torch.zeros(batch, dtype=torch.bool, device=flat.device) if top == k * vocab else \
        values[:, top] == boundary[:, 0]                                         # topk left out equal candidates
    values, chosen = values[:, :top], chosen[:, :top]                            # (B, 2K) each
    for b in torch.nonzero(short)[:, 0].tolist():
        above = chosen[b][values[b] > boundary[b]]
        level = torch.nonzero(flat[b] == boundary[b])[:top - len(above), 0]     # the lowest indices at the boundary
        chosen[b] = torch.cat([above, level])
    chosen = chosen.sort(dim=1).values                                           # index order: lower b, then lower v
    ranked = chosen.gather(1, torch.sort(flat.gather(1, chosen), dim=1, descending=True, stable=True).indices)
    beams, tokens = ranked // vocab, ranked % vocab
    is_eos = tokens == eos_id
    rank = torch.arange(top, device=candidates.device)[None, :]                 # (1, 2K)
    keep = torch.sort(torch.where(is_eos, rank + top, rank), dim=1).indices[:, :beam_size]   # distinct keys
    return flat.gather(1, ranked), beams, tokens, is_eos & (rank < beam_size), keep


def _keep_best(best: tuple, scores: Tensor, rows: Tensor, length: int) -> tuple:
    """Replace each sentence's ``best`` = (score, row, length) by its first candidate of highest score,
    only if that score is strictly greater (so earlier finished hypotheses win ties).

    Shape: best ((B,), (B, M + 1), (B,)); scores (B, C) in rank order, -inf for candidates that do not
    finish; rows (B, C, M + 1).
    """
    first = scores.argmax(dim=1)                                                 # (B,): the first maximum
    score = scores.gather(1, first[:, None])[:, 0]
    row = rows[torch.arange(len(rows), device=rows.device), first]               # (B, M + 1)
    better = score > best[0]
    return (torch.where(better, score, best[0]), torch.where(better[:, None], row, best[1]),
            torch.where(better, length, best[2]))
