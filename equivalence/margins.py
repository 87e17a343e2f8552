"""Decision margins of the float64 reference's decoding: how far each choice was from going the other way.

The token rules of :mod:`equivalence.tolerance` (``greedy_tokens_agree``, ``beam_row_is_decisive``) compare a
backend's tokens only where the reference decided by more than the backend's error can move (float32's bound, or
float64's in the fuzzer). The margins are computed here, from the reference's public model and the step iterator of
its beam search, so that the decoders' public API returns tokens and scores only. They follow every decoding
convention of the config (``reference_numpy/decoding.py``): the start token, the repetition penalty, the suppressed
and held-back tokens, the forced ones (a forced step decides nothing: its token is the rule's) and the length
normalization, with "hf"'s stopping rule.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from reference_numpy.config import TransformerConfig
from reference_numpy.decoding import (
    BEAM_SIZE,
    _beam_steps,
    _emittable,
    beam_search,
    check_decoding_args,
    check_forced_bos,
    constrain,
    forced_tokens,
    greedy_decode,
    length_penalty,
    max_output_lengths,
    penalize,
    select_candidates,
)
from reference_numpy.model import Transformer, causal_mask, padding_mask

from .tolerance import bound_for


class Decisions(NamedTuple):
    """The margins of one decoding and the scale they were decided at: the largest finite |log-probability| (greedy)
    or |summed log-probability| (beam search; every log-probability is <= 0, so none of a sum's terms is larger)."""

    margins: np.ndarray | list[float]
    scale: float


def greedy_decisions(model: Transformer, src: np.ndarray, tokens: np.ndarray,
                     forced_bos_id: int | None = None) -> Decisions:
    """Each greedy step's gap between the best and second-best log-probability, (B, L) for ``tokens`` (B, L) the
    reference's own greedy output (with ``forced_bos_id``); ``inf`` once a row has finished (ended with eos or
    reached its length budget) and at a forced step; 0 where a log-probability is NaN (it decides nothing).

    One teacher-forced pass gives every step's log-probabilities: the decoder is causal (section 3.2.3) and reads its
    prefix under the causal mask alone, so position t sees the start token and the first t tokens, exactly the prefix
    the greedy step saw. The tokens of ``config.never_emitted`` and the held-back ones (``constrain``) are left out, as
    the decoder never emits them (and the others renormalized with ``config.decoding.renormalize``, as the decoder does:
    the gaps are the same, the scale is the decoder's). With a repetition penalty the gaps are those of the penalized
    logits greedy decoding ranks (:func:`_teacher_forced_scores`), at their scale.
    """
    config = model.config
    forced_bos_id = check_forced_bos(config, forced_bos_id)                                 # or the config's
    tgt = np.concatenate([np.full((len(tokens), 1), config.start_id), tokens[:, :-1]], axis=1)   # (B, L)
    scores = _teacher_forced_scores(model, src, tgt)                                       # (B, L, V)
    history = np.concatenate([tgt, tokens[:, -1:]], axis=1)                                # (B, L + 1)
    log_probs = np.stack([constrain(config, _emittable(config, penalize(config, scores[:, t - 1], history, t)),
                                    history, t)
                          for t in range(1, tokens.shape[1] + 1)], axis=1)                  # (B, L, V)
    top_two = np.sort(log_probs, axis=-1)[..., -2:]                                         # (B, L, 2)
    eos = (tokens == config.eos_id).astype(int)                                             # (B, L)
    ended = np.cumsum(eos, axis=1) - eos > 0                                                # an eos before step t
    limits = max_output_lengths(model, src)
    finished = ended | (np.arange(tokens.shape[1]) >= limits[:, None])
    forced = np.stack([forced_tokens(config, step, limits, forced_bos_id) >= 0
                       for step in range(1, tokens.shape[1] + 1)], axis=1)                  # (B, L)
    gaps = np.nan_to_num(top_two[..., 1] - top_two[..., 0], nan=0.0, posinf=np.inf)
    finite = log_probs[np.isfinite(log_probs)]
    return Decisions(np.where(finished | forced, np.inf, gaps), float(np.max(np.abs(finite), initial=0.0)))


def _teacher_forced_scores(model: Transformer, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """What greedy decoding ranks at every position of ``tgt`` (one causal pass): the log-probabilities, or with a
    repetition penalty the generator's logits, which greedy decoding penalizes (``reference_numpy/decoding.py``).
    Shape: src (B, S), tgt (B, L) -> (B, L, V)."""
    if model.config.decoding.repetition_penalty == 1.0:
        return model(src, tgt, tgt_mask=causal_mask(tgt.shape[1]))
    src_mask = padding_mask(src, model.config.pad_id)
    return model.generator.logits(model.decode(tgt, model.encode(src, src_mask), src_mask, causal_mask(tgt.shape[1])))


def greedy_margins(model: Transformer, src: np.ndarray, tokens: np.ndarray,
                   forced_bos_id: int | None = None) -> np.ndarray:
    """The margins of :func:`greedy_decisions`, (B, L)."""
    return np.asarray(greedy_decisions(model, src, tokens, forced_bos_id).margins)


def beam_step_margin(candidates: np.ndarray, eos_id: int, beam_size: int) -> float:
    """The smallest score gap that decides one beam-search step: at the rank-``beam_size`` boundary when an eos is
    near it (does it finish?) and between the last kept and first dropped non-eos candidate. Gaps below
    impossible (-inf) candidates decide nothing and are left out; a NaN among them leaves the step undecided (0).

    ``candidates`` (n_live, V) are the step's summed log-probabilities, ranked as the search ranks them: by score,
    ties to the lower beam, then the lower token.
    """
    if np.isnan(candidates).any():                                        # a NaN score decides nothing
        return 0.0
    ranking = np.argsort(-candidates, axis=None, kind="stable")
    scores = candidates.ravel()[ranking]                                   # descending
    is_eos = ranking % candidates.shape[1] == eos_id
    pairs = []
    if len(scores) > beam_size and is_eos[:beam_size + 1].any():
        pairs.append(scores[beam_size - 1:beam_size + 1])
    live_scores = scores[~is_eos]
    if len(live_scores) > beam_size:
        pairs.append(live_scores[beam_size - 1:beam_size + 1])
    return float(min((high - low for high, low in pairs if np.isfinite(low)), default=np.inf))


def stop_margin(candidates: np.ndarray, finished: tuple[tuple[float, list[int]], ...], step: int,
                config: TransformerConfig, beam_size: int, alpha: float) -> float:
    """The gap that decides whether "hf" beam search with ``early_stopping`` False stops after ``step``: the best
    live beam's logP / lp(step) against the worst of the ``beam_size`` best finished scores (transformers'
    heuristic, ``reference_numpy.decoding.search_ends``). inf where the rule is not consulted: the "gnmt" rule and
    "never" (exact: a later hypothesis cannot beat what they keep, so a near-tie there changes no result), True
    (it counts the finished hypotheses, which the step margins decide), fewer than ``beam_size`` finished or no live
    beam left."""
    decoding = config.decoding
    if decoding.length_normalization != "hf" or decoding.early_stopping is not False or len(finished) < beam_size:
        return np.inf
    live = select_candidates(candidates, config.eos_id, beam_size).scores
    if len(live) == 0:
        return np.inf
    worst_kept = sorted((score for score, _ in finished), reverse=True)[beam_size - 1]
    return float(abs(live.max() / length_penalty(step, alpha, "hf") - worst_kept))


def beam_decisions(model: Transformer, src: np.ndarray, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                   forced_bos_id: int | None = None) -> list[Decisions]:
    """Per source sentence: each step's margin (the smaller of :func:`beam_step_margin` -- scores at step t sum t
    log-probabilities -- and :func:`stop_margin`), then the gap between the best and second-best finished scores
    (the final choice), from the reference's search with these settings (alpha: None is the config's); and the
    largest finite |summed log-probability| the search ranked."""
    config = model.config
    beam_size, alpha = check_decoding_args(beam_size, alpha, config)
    limits = max_output_lengths(model, src)
    decisions = []
    for limit, steps in zip(limits, _beam_steps(model, src, beam_size, alpha, forced_bos_id)):
        sentence: list[float] = []
        scale, finished = 0.0, ()      # type: tuple[float, tuple[tuple[float, list[int]], ...]]
        for step, state in enumerate(steps, start=1):
            margin = beam_step_margin(state.candidates, config.eos_id, beam_size)
            if step < limit:
                margin = min(margin, stop_margin(state.candidates, state.finished, step, config, beam_size, alpha))
            sentence.append(margin)
            finite = state.candidates[np.isfinite(state.candidates)]
            scale, finished = max(scale, float(np.max(np.abs(finite), initial=0.0))), state.finished
        ranked = sorted((score for score, _ in finished), reverse=True)
        sentence.append(float(ranked[0] - ranked[1]) if len(ranked) > 1 else np.inf)
        decisions.append(Decisions(sentence, scale))
    return decisions


def beam_margins(model: Transformer, src: np.ndarray, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                 forced_bos_id: int | None = None) -> list[list[float]]:
    """The margins of :func:`beam_decisions`, per source sentence."""
    return [list(decision.margins) for decision in beam_decisions(model, src, beam_size, alpha, forced_bos_id)]


class DecodingOracle(NamedTuple):
    """What the float64 reference decides on ``src`` (:func:`decoding_oracle`): its tokens (beam search: and scores),
    the margins of its decisions, and the bound of a lower precision's log-probabilities along its output."""

    src: np.ndarray
    tokens: np.ndarray
    scores: np.ndarray | None
    margins: np.ndarray | list[list[float]]
    bound: float


def decoding_oracle(model64: Transformer, model: Transformer, src: np.ndarray, kind: str) -> DecodingOracle:
    """The float64 reference's greedy or beam search (``kind``) of ``src``, its margins, and the bound of the
    log-probabilities of ``model`` (the reference in the precision the tokens are compared in) along its output
    (:func:`teacher_forced_bound`): what the token rules of :mod:`equivalence.tolerance` take."""
    if kind == "greedy":
        tokens, scores = greedy_decode(model64, src), None
        margins: np.ndarray | list[list[float]] = greedy_margins(model64, src, tokens)
    else:
        (tokens, scores), margins = beam_search(model64, src), beam_margins(model64, src)
    return DecodingOracle(src, tokens, scores, margins, teacher_forced_bound(model64, model, src, tokens))


def teacher_forced_bound(model64: Transformer, model: Transformer, src: np.ndarray, tokens: np.ndarray) -> float:
    """The policy's bound for ``model``'s log-probabilities along the float64 reference's own output ``tokens``
    (the decoder fed its start token and the tokens before each step)."""
    tgt = np.concatenate([np.full((len(src), 1), model64.config.start_id), tokens[:, :-1]], axis=1)
    return bound_for(model.dtype, model64(src, tgt), model(src, tgt))
