"""Greedy decoding and beam search (section 6.1) with a key/value cache.

The rules are the reference's, to the letter (``reference_numpy/decoding.py``): the same
maximum output length (non-pad source tokens + 50, capped at ``max_len``), pad_id and bos_id
never emitted, greedy ties to the lowest token id, beam candidates ranked by summed
log-probability (accumulated in the model's dtype) with ties to the lower beam then the lower
token, eos only among the first ``beam_size`` ranks, the same stopping rule, and the final
tie to the hypothesis finished first. Outputs are NumPy arrays in the reference's layout
(no bos, right-padded with pad_id).

With ``use_cache=True`` (the default) each new token costs one decoder step: the
self-attention keys and values of earlier positions are kept in preallocated buffers
(:class:`AttentionCache`) and the encoder-decoder keys and values of the memory are projected
once per sentence. ``use_cache=False`` recomputes the whole prefix at every step, as the
reference does; both give the same log-probabilities (to rounding) and the same tokens.

The model should be in ``eval()`` mode (dropout off); decoding runs without gradients.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from reference_numpy.decoding import (BEAM_SIZE, LENGTH_PENALTY_ALPHA, best_hypothesis, check_decoding_args,
                                      length_penalty, max_output_lengths, search_ends, select_candidates)

from .model import Transformer, padding_mask


class AttentionCache:
    """Keys and values of one attention sublayer kept between decoding steps.

    ``capacity=None`` (encoder-decoder attention): the memory's keys and values are projected on
    the first call and reused. Otherwise (masked self-attention) the new positions' keys and
    values are written after the cached ones into buffers of ``capacity`` positions, and all
    ``length`` filled positions are attended over.

    Shape: buffers (B, H, capacity, d_k); returns keys and values (B, H, length, d_k).
    """

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.length = 0

    def __call__(self, project: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        if self.capacity is None:
            if self.keys is None:
                self.keys, self.values = project()                          # (B, H, S, d_k)
                self.length = self.keys.shape[2]
            return self.keys, self.values
        k, v = project()                                                    # (B, H, T_new, d_k)
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"cache holds {self.capacity} positions; decoding needs {end}")
        if self.keys is None:
            batch, heads, _, d_k = k.shape
            self.keys = k.new_empty(batch, heads, self.capacity, d_k)         # (B, H, capacity, d_k)
            self.values = v.new_empty(batch, heads, self.capacity, d_k)       # (B, H, capacity, d_k)
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]                 # (B, H, length, d_k)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search: the beams the next live beams extend)."""
        if self.keys is not None:
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)


class DecoderCache:
    """One (self-attention, encoder-decoder attention) :class:`AttentionCache` pair per decoder
    layer; ``length`` is the number of target positions already decoded."""

    def __init__(self, model: Transformer, capacity: int):
        self.layers = [(AttentionCache(capacity), AttentionCache()) for _ in model.decoder.layers]

    @property
    def length(self) -> int:
        return self.layers[0][0].length

    def reorder(self, index: Tensor) -> None:
        for self_cache, cross_cache in self.layers:
            self_cache.reorder(index)
            cross_cache.reorder(index)


def next_token_log_probs(model: Transformer, tgt: Tensor, memory: Tensor, src_mask: Tensor,
                         cache: DecoderCache | None = None) -> Tensor:
    """Log-probabilities of the token after ``tgt``, with pad_id and bos_id set to -inf so that
    they are never chosen. With a ``cache`` only the positions of ``tgt`` after ``cache.length``
    are fed to the decoder; their queries see every earlier key that is not padding (the last row
    of :func:`.model.target_mask`). Shape: tgt (B, T) -> (B, V).
    """
    cfg = model.config
    if cache is None:
        out = model.decode(tgt, memory, src_mask)[:, -1:]                   # (B, 1, D)
    else:
        out = model.decode(tgt[:, cache.length:], memory, src_mask, padding_mask(tgt, cfg.pad_id), cache=cache)
    log_probs = model.generator(out[:, -1:])[:, 0]                          # (B, V)
    log_probs[:, [cfg.pad_id, cfg.bos_id]] = -torch.inf
    return log_probs


@torch.no_grad()
def greedy_decode(model: Transformer, src, use_cache: bool = True) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id (``torch.argmax`` returns the first maximum).

    Shape: src (B, S) -> tokens (B, L) NumPy int64, without bos, right-padded with pad_id.
    """
    cfg = model.config
    src = model._check_tokens("src", src, cfg.src_vocab_size)
    src_mask = padding_mask(src, cfg.pad_id)
    memory = model.encode(src, src_mask)
    limits = max_output_lengths(model, src.cpu().numpy())
    cache = DecoderCache(model, int(limits.max()) + 1) if use_cache else None
    limits = torch.as_tensor(limits, device=src.device)
    tgt = torch.full((len(src), 1), cfg.bos_id, dtype=torch.long, device=src.device)
    done = torch.zeros(len(src), dtype=torch.bool, device=src.device)
    for step in range(1, int(limits.max()) + 1):
        token = next_token_log_probs(model, tgt, memory, src_mask, cache).argmax(dim=-1)  # (B,)
        token = torch.where(done, cfg.pad_id, token)
        tgt = torch.cat([tgt, token[:, None]], dim=1)                      # (B, step + 1)
        done |= (token == cfg.eos_id) | (step >= limits)
        if bool(done.all()):
            break
    return tgt[:, 1:].cpu().numpy()


@torch.no_grad()
def beam_search(model: Transformer, src, beam_size: int = BEAM_SIZE, alpha: float = LENGTH_PENALTY_ALPHA,
                use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the GNMT length penalty and the reference's tie-break (module docstring).

    Shape: src (B, S) -> tokens (B, L) NumPy int64 without bos, right-padded with pad_id, and
    the length-normalized scores (B,).
    """
    beam_size, alpha = check_decoding_args(beam_size, alpha)
    cfg = model.config
    src = model._check_tokens("src", src, cfg.src_vocab_size)
    src_mask = padding_mask(src, cfg.pad_id)
    memory = model.encode(src, src_mask)
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
    score_dtype = np.dtype(str(model.dtype).removeprefix("torch."))
    live = torch.full((1, 1), cfg.bos_id, dtype=torch.long, device=memory.device)  # (n_live, t)
    live_scores = np.zeros(1, dtype=score_dtype)                       # summed log-probabilities, (n_live,)
    finished: list[tuple[float, list[int]]] = []                        # in the order they finished
    cache = DecoderCache(model, limit + 1) if use_cache else None
    for step in range(1, limit + 1):
        n_live = len(live)
        log_probs = next_token_log_probs(model, live, memory.expand(n_live, -1, -1),
                                         src_mask.expand(n_live, -1, -1, -1), cache).cpu().numpy()
        step_choice = select_candidates(live_scores[:, None] + log_probs, cfg.eos_id, beam_size)
        for beam, score in step_choice.finishing:
            finished.append((score / length_penalty(step, alpha), [*live[beam, 1:].tolist(), cfg.eos_id]))
        index = torch.as_tensor(step_choice.beams, device=live.device)
        live = torch.cat([live[index], torch.as_tensor(step_choice.tokens, device=live.device)[:, None]], dim=1)
        live_scores = step_choice.scores
        if cache is not None:
            cache.reorder(index)
        if search_ends(finished, live, live_scores, step, limit, alpha):
            break
    return best_hypothesis(finished)
