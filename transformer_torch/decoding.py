"""Greedy decoding and beam search (section 6.1) with a key/value cache.

The rules are the reference's, to the letter (``reference_numpy/decoding.py``): the same
maximum output length (non-pad source tokens + 50, capped at ``max_len``), pad_id and bos_id
never emitted, greedy ties to the lowest token id, beam candidates ranked by summed
log-probability (accumulated in the model's dtype) with ties to the lower beam then the lower
token, eos only among the first ``beam_size`` ranks, the same stopping rule, and the final
tie to the hypothesis finished first. Outputs are NumPy arrays in the reference's layout
(no bos, right-padded with pad_id).

With ``use_cache=True`` (the default) each new token costs one decoder step: the model's
key/value cache (``model.init_cache``, :class:`.model.KVCache`) keeps the self-attention keys and
values of earlier positions in preallocated buffers, written in place, and the memory's
encoder-decoder keys and values projected once per sentence; beam search reorders it with
:func:`reorder_cache`, moving the keys and values of the live beams (their number changes from
one at the first step to ``beam_size``; kept in place under a ``beams`` table instead,
``KVCache.beams``, the search measured no faster: docs/benchmarks.md). ``use_cache=False``
recomputes the whole prefix at every step, as the reference does; both give the same
log-probabilities (to rounding) for the rows still being decoded, and the same tokens (a
finished greedy row only receives pad; with the cache its pad keys are not masked, which
changes nothing it emits).

The model should be in ``eval()`` mode (dropout off); decoding runs in ``torch.inference_mode()`` (no
gradients, and less bookkeeping per operation than ``torch.no_grad()``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from reference_numpy.decoding import (
    BEAM_SIZE,
    LENGTH_PENALTY_ALPHA,
    StepChoice,
    best_hypothesis,
    check_decoding_args,
    length_penalty,
    max_output_lengths,
    search_ends,
)

from .model import KVCache, Transformer, padding_mask


def next_token_log_probs(model: Transformer, tgt: Tensor, memory: Tensor, src_mask: Tensor,
                         cache: tuple | None = None, cache_index: int | None = None):
    """Log-probabilities of the token after the last position of ``tgt``, with pad_id and bos_id
    set to -inf so that they are never chosen.

    Without a cache ``tgt`` is the whole prefix (the decoder is recomputed, under
    :func:`.model.target_mask`); with a ``cache`` (``model.init_cache``) holding positions
    0 .. cache_index - 1, ``tgt`` holds only the new positions, from ``cache_index`` on (under the
    causal mask of ``Transformer.decode``), and the result is ``(log_probs, cache)``.

    Shape: tgt (B, T) -> log_probs (B, V).
    """
    cfg = model.config
    if cache is None:
        out = model.decode(tgt, memory, src_mask)                                          # (B, T, D)
    else:
        out, cache = model.decode(tgt, memory, src_mask, cache=cache, cache_index=cache_index)
    log_probs = model.generator(out[:, -1:])[:, 0]                                         # (B, V)
    log_probs[:, [cfg.pad_id, cfg.bos_id]] = -torch.inf
    return log_probs if cache is None else (log_probs, cache)


def reorder_cache(cache: tuple, beams: Tensor) -> tuple:
    """Every layer's caches follow their beams: row i of the result holds the hypothesis of row
    ``beams[i]`` (beam search: the beam that the i-th next live beam extends). A
    :class:`.model.KVCache` without a ``beams`` table keeps batch rows ``beams``; one with a table
    keeps its keys and values where they are and gathers the table's rows (beams never move
    between sentences).

    Shape: beams (N,) int; every keys/values tensor (N, H, C, d_k); a table (N / K, K, C).
    """
    return tuple(tuple(_follow(layer_cache, beams) for layer_cache in layer) for layer in cache)


def _follow(cache: KVCache, beams: Tensor) -> KVCache:
    """One :class:`.model.KVCache` of :func:`reorder_cache`."""
    if isinstance(cache.beams, tuple):
        return KVCache(cache.keys.index_select(0, beams), cache.values.index_select(0, beams))
    table = cache.beams.reshape(-1, cache.beams.shape[2])                 # (N, C)
    return cache._replace(beams=table.index_select(0, beams).reshape(cache.beams.shape))


def _log_probs(model: Transformer, tgt: Tensor, memory: Tensor, src_mask: Tensor,
               cache: tuple | None) -> tuple[Tensor, tuple | None]:
    """:func:`next_token_log_probs` after the prefix ``tgt``: the whole prefix without a cache, its
    last position with a cache holding the others."""
    if cache is None:
        return next_token_log_probs(model, tgt, memory, src_mask), None
    return next_token_log_probs(model, tgt[:, -1:], memory, src_mask, cache, tgt.shape[1] - 1)


@torch.inference_mode()
def greedy_decode(model: Transformer, src, use_cache: bool = True) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id (``torch.argmax`` returns the first maximum).

    Shape: src (B, S) -> tokens (B, L) NumPy int64, without bos, right-padded with pad_id.
    """
    cfg = model.config
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = torch.as_tensor(src).to(device=model.device, dtype=torch.long)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src.cpu().numpy())
    cache = model.init_cache(memory, int(limits.max())) if use_cache else None
    limits = torch.as_tensor(limits, device=src.device)
    tgt = torch.full((len(src), 1), cfg.bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(len(src), dtype=torch.bool, device=src.device)
    for step in range(1, int(limits.max()) + 1):
        log_probs, cache = _log_probs(model, tgt, memory, src_mask, cache)
        token = log_probs.argmax(dim=-1)                                   # (B,)
        token = torch.where(done, cfg.pad_id, token)
        tgt = torch.cat([tgt, token[:, None]], dim=1)                      # (B, step + 1)
        done |= (token == cfg.eos_id) | (step >= limits)
        if bool(done.all()):
            break
    return tgt[:, 1:].cpu().numpy()


@torch.inference_mode()
def beam_search(model: Transformer, src, beam_size: int = BEAM_SIZE, alpha: float = LENGTH_PENALTY_ALPHA,
                use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the GNMT length penalty and the reference's tie-break (module docstring).

    Shape: src (B, S) -> tokens (B, L) NumPy int64 without bos, right-padded with pad_id, and
    the length-normalized scores (B,).
    """
    beam_size, alpha = check_decoding_args(beam_size, alpha)
    cfg = model.config
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = torch.as_tensor(src).to(device=model.device, dtype=torch.long)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src.cpu().numpy())
    results = [_beam_search_one(model, memory[b:b + 1], src_mask[b:b + 1], int(limits[b]), beam_size, alpha,
                                use_cache) for b in range(len(src))]
    width = max(len(tokens) for tokens, _ in results)
    tokens = np.full((len(src), width), cfg.pad_id, dtype=np.int64)
    for b, (row, _) in enumerate(results):
        tokens[b, :len(row)] = row
    return tokens, np.array([score for _, score in results])


def _beam_search_one(model: Transformer, memory: Tensor, src_mask: Tensor, limit: int, beam_size: int,
                     alpha: float, use_cache: bool) -> tuple[list[int], float]:
    """Beam search for one source sentence. memory (1, S, D), src_mask (1, 1, 1, S)."""
    cfg = model.config
    live = torch.full((1, 1), cfg.bos_id, dtype=torch.long, device=memory.device)  # (n_live, t)
    live_scores = torch.zeros(1, dtype=model.dtype, device=memory.device)  # summed log-probabilities, (n_live,)
    finished: list[tuple[float, list[int]]] = []                        # in the order they finished
    cache = model.init_cache(memory, limit) if use_cache else None
    for step in range(1, limit + 1):
        n_live = len(live)
        log_probs, cache = _log_probs(model, live, memory.expand(n_live, -1, -1),
                                      src_mask.expand(n_live, -1, -1, -1), cache)
        step_choice = _select_candidates(live_scores[:, None] + log_probs, cfg.eos_id, beam_size)
        for beam, score in step_choice.finishing:
            finished.append((score / length_penalty(step, alpha), [*live[beam, 1:].tolist(), cfg.eos_id]))
        index = torch.as_tensor(step_choice.beams, device=live.device)
        live = torch.cat([live[index], torch.as_tensor(step_choice.tokens, device=live.device)[:, None]], dim=1)
        live_scores = torch.as_tensor(step_choice.scores, device=live.device)
        if cache is not None:
            cache = _reorder_own(cache, index)
        if search_ends(finished, live, step_choice.scores, step, limit, alpha):
            break
    return best_hypothesis(finished)


def _reorder_own(cache: tuple, beams: Tensor) -> tuple:
    """:func:`reorder_cache` of the self-attention caches only: the encoder-decoder keys and values
    of the one sentence searched (batch 1) are the same for every beam and broadcast over them."""
    kept = reorder_cache(tuple((own,) for own, _ in cache), beams)
    return tuple((own, memory) for (own,), (_, memory) in zip(kept, cache))


def _select_candidates(candidates: Tensor, eos_id: int, beam_size: int) -> StepChoice:
    """The reference's ``select_candidates`` (its rules and result, NumPy arrays in the candidates'
    dtype) without sorting all n_live x V candidates: only the first K + n_live ranks can matter
    (K = ``beam_size``; each beam has one eos, so K non-eos candidates are always among them: 2K
    ranks when K beams are live).

    ``torch.topk`` finds the (K + n_live)-th largest value but promises no order among equal values,
    so it only sets the boundary: the first K + n_live ranks are every candidate above it and, of
    those equal to it, the ones of lowest flat (beam-major) index; a stable descending sort of these
    is the reference's ranking (ties: the lower beam b, then the lower token v).

    Shape: candidates (n_live, V), summed log-probabilities in the model's dtype.
    """
    flat = candidates.reshape(-1)                                          # (n_live * V,), index b * V + v
    top = min(beam_size + len(candidates), flat.numel())
    values, chosen = torch.topk(flat, top, sorted=False)                  # (top,) each
    boundary = values.min()                                                # the top-th largest value
    if int((flat == boundary).sum()) > int((values == boundary).sum()):   # topk left out equal candidates
        above = chosen[values > boundary]
        level = torch.nonzero(flat == boundary)[:top - len(above), 0]     # the lowest indices at the boundary
        chosen = torch.cat([above, level])
    chosen = chosen.sort().values                                          # index order: lower b, then lower v
    ranking = chosen[torch.sort(flat[chosen], descending=True, stable=True).indices]
    scores, ranking = flat[ranking].cpu().numpy(), ranking.cpu().numpy()  # descending
    beams, tokens = np.divmod(ranking, candidates.shape[1])
    is_eos = tokens == eos_id
    finishing = [(int(beams[rank]), scores[rank]) for rank in np.flatnonzero(is_eos[:beam_size])]
    keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]      # first beam_size possible non-eos
    return StepChoice(finishing, beams[keep], tokens[keep], scores[keep])
