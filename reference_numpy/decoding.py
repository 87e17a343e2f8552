"""Greedy decoding and beam search (section 6.1) for the reference.

The rules, shared by every port so that all backends produce identical tokens
(see ``docs/reference.md``):

* the output starts after ``bos_id``; a sequence ends when it emits ``eos_id`` (kept in the
  output) or when it has ``max_output_length`` tokens: its number of non-pad source tokens
  + 50, capped at ``config.max_len`` (section 6.1: "maximum output length ... input length + 50");
* outputs are returned without ``bos_id``, right-padded with ``pad_id``; the decoder never emits
  ``pad_id`` or ``bos_id`` (their log-probabilities are set to -inf before choosing);
* greedy: the next token is the highest log-probability; a tie goes to the **lowest token id**;
* beam search: beam size 4 and length penalty lp(Y) = ((5 + |Y|) / 6)^alpha, alpha = 0.6
  (Wu et al., 2016); a finished hypothesis scores log P(Y) / lp(Y), |Y| counting eos.
  Candidates (beam b, token v) are ranked by the summed log-probability, ties going to the
  lower b, then the lower v. Walking the ranking, an eos candidate among the first
  ``beam_size`` ranks finishes a hypothesis (other eos candidates are dropped) and the first
  ``beam_size`` non-eos candidates of finite score are the next live beams (impossible ones,
  such as pad and bos, never are; a small vocabulary can leave fewer than ``beam_size`` beams,
  or none: when only eos can follow, the eos candidates finish and the search ends). Search
  stops at the maximum length (the live beams are then scored as finished, after that step's
  eos hypotheses), when no live beam is left, or as soon as no live beam can beat the best
  finished one: max_b logP_b / lp(max length) <= best finished score (log-probabilities only
  fall and lp only grows, so stopping never changes the result). The best score wins; a tie
  goes to the hypothesis finished first: the earlier step, then, within a step, the eos
  hypotheses in rank order, then the live beams the maximum length finishes, in rank order.

The reference recomputes the whole prefix at each step; the ports use a key/value cache and
must give the same tokens.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .config import TransformerConfig
from .model import Transformer, padding_mask
from .precision import score_dtype

EXTRA_OUTPUT_LENGTH = 50   # section 6.1: maximum output length = input length + 50
BEAM_SIZE = 4              # section 6.1
LENGTH_PENALTY_ALPHA = 0.6  # section 6.1


class _Configured(Protocol):
    """A model of any backend, as the shared decoding rules read it: its config."""

    @property
    def config(self) -> TransformerConfig: ...


def max_output_lengths(model: _Configured, src: npt.ArrayLike) -> np.ndarray:
    """Per-sequence output budget: non-pad source tokens + 50, capped at ``max_len``. Shape: (B,)."""
    lengths = (np.asarray(src) != model.config.pad_id).sum(axis=1)
    return np.minimum(lengths + EXTRA_OUTPUT_LENGTH, model.config.max_len)


def length_penalty(length: int, alpha: float = LENGTH_PENALTY_ALPHA) -> float:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016; section 6.1)."""
    return ((5.0 + length) / 6.0) ** alpha


def check_decoding_args(beam_size: object, alpha: object) -> tuple[int, float]:
    """``beam_size`` and ``alpha`` as a Python int and float, with one-line errors shared by every
    backend: beam_size is a positive integer (not a bool); alpha a finite real number >= 0 (a
    negative alpha would make lp(Y) shrink with length, and the stopping rule relies on it growing)."""
    if not isinstance(beam_size, numbers.Integral) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if not isinstance(alpha, numbers.Real) or isinstance(alpha, (bool, np.bool_)) or not 0.0 <= float(alpha) < math.inf:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    return int(beam_size), float(alpha)


def next_token_log_probs(model: Transformer, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray,
                         cache: tuple | None = None, cache_index: int | None = None,
                         ) -> Any:   # (B, V) log-probabilities; with a cache, (them, the new cache)
    """Log-probabilities of the token after the last position of ``tgt``, with pad_id and bos_id
    set to -inf so that they are never chosen.

    Without a cache ``tgt`` is the whole prefix (the decoder is recomputed, under
    :func:`.model.target_mask`); with a ``cache`` (``model.init_cache``) holding positions
    0 .. cache_index - 1, ``tgt`` holds only the new positions, from ``cache_index`` on (under the
    causal mask of ``Transformer.decode``), and the result is ``(log_probs, cache)``. The
    reference's decoders below do not use the cache: they recompute the whole prefix at every step.

    Shape: tgt (B, T) -> log_probs (B, V).
    """
    if cache is None:
        out = model.decode(tgt, memory, src_mask)                                          # (B, T, D)
    else:
        out, cache = model.decode(tgt, memory, src_mask, cache=cache, cache_index=cache_index)
    log_probs = model.generator(out[:, -1:])[:, 0]                                         # (B, V)
    log_probs[:, [model.config.pad_id, model.config.bos_id]] = -np.inf
    return log_probs if cache is None else (log_probs, cache)


def greedy_decode(model: Transformer, src: np.ndarray) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id.

    Shape: src (B, S) -> tokens (B, L), without bos, right-padded with pad_id.
    """
    cfg = model.config
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = np.asarray(src)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src)
    tgt = np.full((len(src), 1), cfg.bos_id, dtype=np.int64)
    done = np.zeros(len(src), dtype=bool)
    for step in range(1, int(limits.max()) + 1):
        log_probs = next_token_log_probs(model, tgt, memory, src_mask)             # (B, V)
        token = log_probs.argmax(axis=-1)                                          # first max = lowest id
        token = np.where(done, cfg.pad_id, token)
        tgt = np.concatenate([tgt, token[:, None]], axis=1)
        done |= (token == cfg.eos_id) | (step >= limits)
        if done.all():
            break
    return tgt[:, 1:]


def beam_search(model: Transformer, src: np.ndarray, beam_size: int = BEAM_SIZE,
                alpha: float = LENGTH_PENALTY_ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the GNMT length penalty and the tie-break of this module's docstring.

    Shape: src (B, S) -> tokens (B, L) without bos, right-padded with pad_id, and the
    length-normalized scores (B,).
    """
    results = [best_hypothesis(deque(steps, maxlen=1)[0].finished)                 # each sentence's last step
               for steps in _beam_steps(model, src, beam_size, alpha)]
    width = max(len(tokens) for tokens, _ in results)
    tokens = np.full((len(results), width), model.config.pad_id, dtype=np.int64)
    for b, (row, _) in enumerate(results):
        tokens[b, :len(row)] = row
    return tokens, np.array([score for _, score in results])


class _BeamStep(NamedTuple):
    """One step of one source sentence's search (see :func:`_beam_steps`)."""

    candidates: np.ndarray                          # (n_live, V) the summed log-probabilities the step ranked
    finished: tuple[tuple[float, list[int]], ...]   # the hypotheses finished so far, in the order they finished


def _beam_steps(model: Transformer, src: np.ndarray, beam_size: int, alpha: float) -> Iterator[Iterator[_BeamStep]]:
    """The search of :func:`beam_search`, step by step: for each source sentence in turn, the iterator of its
    steps (consume each before the next). Its last step's ``finished`` holds every hypothesis the search scored."""
    beam_size, alpha = check_decoding_args(beam_size, alpha)
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = np.asarray(src)
    src_mask = padding_mask(src, model.config.pad_id)
    limits = max_output_lengths(model, src)
    for b in range(len(src)):
        yield _sentence_steps(model, memory[b:b + 1], src_mask[b:b + 1], int(limits[b]), beam_size, alpha)


def _sentence_steps(model: Transformer, memory: np.ndarray, src_mask: np.ndarray, limit: int,
                    beam_size: int, alpha: float) -> Iterator[_BeamStep]:
    """Beam search for one source sentence, one step at a time. memory (1, S, D), src_mask (1, 1, 1, S)."""
    cfg = model.config
    live = np.full((1, 1), cfg.bos_id, dtype=np.int64)   # (n_live, t): bos + generated tokens
    live_scores = np.zeros(1, dtype=score_dtype(model.dtype))   # summed log-probabilities, (n_live,)
    finished: list[tuple[float, list[int]]] = []         # in the order they finished
    for step in range(1, limit + 1):
        n_live = len(live)
        log_probs = next_token_log_probs(model, live, np.repeat(memory, n_live, axis=0),
                                         np.repeat(src_mask, n_live, axis=0))
        candidates = live_scores[:, None] + log_probs                               # (n_live, V)
        step_choice = select_candidates(candidates, cfg.eos_id, beam_size)
        for beam, score in step_choice.finishing:
            finished.append((score / length_penalty(step, alpha), [*live[beam, 1:].tolist(), cfg.eos_id]))
        live = np.concatenate([live[step_choice.beams], step_choice.tokens[:, None]], axis=1)
        live_scores = step_choice.scores
        ends = search_ends(finished, live, live_scores, step, limit, alpha)
        yield _BeamStep(candidates, tuple(finished))
        if ends:
            return


def search_ends(finished: list, live: np.ndarray, live_scores: np.ndarray, step: int, limit: int, alpha: float) -> bool:
    """Whether the search stops after ``step``: at the maximum length (the live beams -- rows of
    bos + tokens -- are then scored as finished, after this step's eos hypotheses), when no live
    beam is left (every non-eos candidate was impossible, e.g. only eos could follow), or when no
    live beam can beat the best finished hypothesis, max_b logP_b / lp(limit) <= best finished score."""
    if step == limit:
        finished += [(score / length_penalty(step, alpha), row[1:].tolist()) for score, row in zip(live_scores, live)]
        return True
    if len(live_scores) == 0:
        return True
    best_finished = max((score for score, _ in finished), default=-np.inf)
    return bool(live_scores.max() / length_penalty(limit, alpha) <= best_finished)


def best_hypothesis(finished: Sequence[tuple[float, list[int]]]) -> tuple[list[int], float]:
    """The best-scoring finished hypothesis; a tie goes to the one finished first."""
    best = max(range(len(finished)), key=lambda i: (finished[i][0], -i))
    score, hypothesis = finished[best]
    return hypothesis, float(score)


class StepChoice(NamedTuple):
    """One beam-search step's decisions (see :func:`select_candidates`)."""

    finishing: list[tuple[int, float]]   # (beam, summed log-probability) of each finishing eos, in rank order
    beams: np.ndarray                     # (n_next,) the live beam each next beam extends
    tokens: np.ndarray                    # (n_next,) the token it appends
    scores: np.ndarray                    # (n_next,) its summed log-probability, descending


def select_candidates(candidates: np.ndarray, eos_id: int, beam_size: int) -> StepChoice:
    """Rank the (beam, token) candidates of one step and apply the rules of this module's docstring.

    Shape: candidates (n_live, V), summed log-probabilities in the model's dtype.
    """
    ranking = np.argsort(-candidates, axis=None, kind="stable")           # ties: lower b, then lower v
    beams, tokens = np.divmod(ranking, candidates.shape[1])               # (n_live * V,) each
    scores = candidates.ravel()[ranking]                                  # descending
    is_eos = tokens == eos_id
    finishing = [(int(beams[rank]), scores[rank]) for rank in np.flatnonzero(is_eos[:beam_size])]
    keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]      # first beam_size possible non-eos
    return StepChoice(finishing, beams[keep], tokens[keep], scores[keep])

