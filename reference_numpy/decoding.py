"""Greedy decoding and beam search (section 6.1) for the reference.

The rules, shared by every port so that all backends produce identical tokens
(see ``docs/reference.md``):

* the output starts after the decoder start token ``config.start_id`` (``decoder_start_id``, by default
  ``bos_id``); a sequence ends when it emits ``eos_id`` (kept in the output) or when it has its budget of tokens: its
  number of non-pad source tokens + 50 (section 6.1: "maximum output length ... input length + 50"), or
  ``config.decoding.max_output_length`` for every sentence when set (one budget for all), capped at
  ``config.max_len``;
* outputs are returned without the start token, right-padded with ``pad_id``; the decoder never emits the
  tokens of ``config.never_emitted`` (``suppressed_ids``, by default pad_id and bos_id: their log-probabilities
  are set to -inf before choosing; with ``config.decoding.renormalize`` the log-probabilities are then normalized
  again over the tokens left, a log-softmax of them); the decoder reads its prefix under the causal mask alone (no
  target position is masked: a start token equal to pad is read like any other token);
* the repetition penalty, the first rule applied at a step: with ``config.decoding.repetition_penalty`` p != 1, at each
  step the score of every token already in the hypothesis (its start token included) is divided by p where it is > 0 and
  multiplied by p where it is < 0 (:func:`penalize`), before the never-emitted tokens, the held-back ones, the
  renormalization and the forced tokens below. The score is the generator's logit in greedy decoding and its
  log-probability in beam search (greedy's rules read the logits, beam search's their log-softmax): greedy chooses the
  highest penalized logit, beam search sums penalized log-probabilities (the per-row constant a log-softmax subtracts
  changes which tokens the penalty divides and which it multiplies, so the two are not one rule);
* forced tokens: with ``forced_bos_id`` (an argument of each call, such as a target language's code; without one,
  ``config.decoding.forced_bos_id``) the first output token is it; with ``config.decoding.forced_eos`` the token at
  the budget's last position is ``config.forced_last_id``: eos, or the token ``forced_eos_id`` names when it is not
  eos (a sequence it ends without eos ends there by its budget).
  A forced step gives the forced token the log-probability 0 and every other -inf;
* held-back tokens (:func:`constrain`, applied after the never-emitted tokens and before the forced tokens): eos gets
  -inf at an output step below ``config.decoding.min_output_length``, and with ``config.decoding.no_repeat_ngram_size``
  n > 0 every token that would complete an n-gram already in the hypothesis (read with its start token) gets -inf; with
  ``config.decoding.renormalize`` the log-probabilities are then normalized again over the tokens left (a log-softmax of
  log-probabilities: the same, to rounding, as one normalization after every rule of the step);
* greedy: the next token is the highest log-probability; a tie goes to the **lowest token id**;
* beam search: beam size 4. Candidates (beam b, token v) are ranked by the summed log-probability, ties going to
  the lower b, then the lower v. Walking the ranking, an eos candidate of finite score among the first
  ``beam_size`` ranks finishes a hypothesis (other eos candidates are dropped) and the first ``beam_size`` non-eos
  candidates of finite score are the next live beams (impossible ones, such as pad and bos, never are; a small
  vocabulary can leave fewer than ``beam_size`` beams, or none: when only eos can follow, the eos candidates
  finish and the search ends). At the maximum length the live beams are scored as finished, after that step's
  eos hypotheses. A finished hypothesis scores log P(Y) / lp(|Y|), |Y| counting eos (and a forced first token).
  The best score wins; a tie goes to the hypothesis finished first: the earlier step, then, within a step, the
  eos hypotheses in rank order, then the live beams the maximum length finishes, in rank order.
  ``config.decoding.length_normalization`` chooses lp and when the search stops before the maximum length:

  - "gnmt" (section 6.1): lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016), alpha = 0.6; the search also stops when
    no live beam is left, or as soon as no live beam can beat the best finished one: max_b logP_b / lp(max length)
    <= best finished score (log-probabilities only fall and lp only grows, so stopping never changes the result);
  - "hf": lp(Y) = |Y|^alpha (``length_penalty``). The search keeps the ``beam_size`` best finished hypotheses; once
    there are ``beam_size`` of them it stops, per ``config.decoding.early_stopping``, at once (True), or when the best
    live beam's logP / lp(bound) is <= the worst kept finished score, bound = the current output length (False: a
    heuristic, a later hypothesis might have scored better) or the maximum length ("never": exact); it also stops when
    no live beam is left. Its other rules are the ones above. Ranking the 2 x beam_size best candidates, finishing the
    eos ones among the first beam_size and continuing the first beam_size others is the same search; so is finishing, at
    the maximum length, the first beam_size candidates, eos or not, which has the same best as finishing the live beams
    (a non-eos candidate ranked after them has the same length and a lower sum). Its stopping rule reads one maximum
    length for every sentence: ``config.decoding.max_output_length``, when set, gives every sentence the same budget.

The reference recomputes the whole prefix at each step; the ports use a key/value cache and
must give the same tokens.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .config import LENGTH_PENALTY_ALPHA, TransformerConfig
from .incremental import at_position
from .model import Transformer, causal_mask, log_softmax, padding_mask
from .precision import score_dtype

EXTRA_OUTPUT_LENGTH = 50   # section 6.1: maximum output length = input length + 50
BEAM_SIZE = 4              # section 6.1 (its alpha 0.6, LENGTH_PENALTY_ALPHA, is the config's length_penalty default)


class _Configured(Protocol):
    """A model of any backend, as the shared decoding rules read it: its config."""

    @property
    def config(self) -> TransformerConfig: ...


def max_output_lengths(model: _Configured, src: npt.ArrayLike) -> np.ndarray:
    """Per-sequence output budget: non-pad source tokens + 50 (section 6.1), or ``config.decoding.max_output_length``
    when set, capped at ``max_len``. Shape: (B,)."""
    cfg = model.config
    lengths = (np.asarray(src) != cfg.pad_id).sum(axis=1)
    budgets = lengths + EXTRA_OUTPUT_LENGTH if cfg.decoding.max_output_length is None else np.full_like(
        lengths, cfg.decoding.max_output_length)
    return np.minimum(budgets, cfg.max_len)


def length_penalty(length: int, alpha: float = LENGTH_PENALTY_ALPHA, normalization: str = "gnmt") -> float:
    """The length penalty lp(Y) that divides a finished hypothesis's log-probability: "gnmt",
    ((5 + |Y|) / 6)^alpha (Wu et al., 2016; section 6.1), or "hf", |Y|^alpha (the summed log-probabilities divided by
    the output length to the power alpha)."""
    return ((5.0 + length) / 6.0) ** alpha if normalization == "gnmt" else float(length) ** alpha


def check_decoding_args(beam_size: object, alpha: object, config: TransformerConfig | None = None) -> tuple[int, float]:
    """``beam_size`` and ``alpha`` (None: ``config.decoding.length_penalty``, or section 6.1's 0.6 without a config) as
    a Python int and float, with one-line errors shared by every backend: beam_size is a positive integer (not a bool);
    alpha a finite real number >= 0 (a negative alpha would make lp(Y) shrink with length, and the stopping rules rely
    on it growing)."""
    if alpha is None:
        alpha = LENGTH_PENALTY_ALPHA if config is None else config.decoding.length_penalty
    if not isinstance(beam_size, numbers.Integral) or isinstance(beam_size, bool) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if not isinstance(alpha, numbers.Real) or isinstance(alpha, (bool, np.bool_)) or not 0.0 <= float(alpha) < math.inf:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    return int(beam_size), float(alpha)


def check_forced_bos(config: TransformerConfig, forced_bos_id: object) -> int | None:
    """A call's ``forced_bos_id`` as a Python int, or ``config.decoding.forced_bos_id`` (None: nothing forced) when it
    is None; one error line shared by every backend: a target token id other than eos and pad (an output is padded after
    its eos: a pad first would read as an empty output), such as a target language's code."""
    if forced_bos_id is None:
        return config.decoding.forced_bos_id
    if (not isinstance(forced_bos_id, numbers.Integral) or isinstance(forced_bos_id, (bool, np.bool_))
            or not 0 <= int(forced_bos_id) < config.tgt_vocab_size or forced_bos_id in (config.eos_id, config.pad_id)):
        raise ValueError(f"forced_bos_id must be a target token id below tgt_vocab_size ({config.tgt_vocab_size}), "
                         f"not eos_id or pad_id, got {forced_bos_id!r}")
    return int(forced_bos_id)


def next_token_log_probs(model: Transformer, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray,
                         cache: tuple | None = None, cache_index: int | None = None,
                         ) -> Any:   # (B, V) log-probabilities; with a cache, (them, the new cache)
    """Log-probabilities of the token after the last position of ``tgt``, with the tokens of
    ``config.never_emitted`` set to -inf so that they are never chosen (:func:`_emittable`).

    Without a cache ``tgt`` is the whole prefix (the decoder is recomputed, under
    :func:`.model.causal_mask` alone: no target position is masked); with a ``cache``
    (``model.init_cache``) holding positions 0 .. cache_index - 1, ``tgt`` holds only the new positions,
    from ``cache_index`` on (None: from the cache's own ``position``; under the causal mask of ``Transformer.decode``),
    and the result is
    ``(log_probs, cache)``. The
    reference's decoders below do not use the cache: they recompute the whole prefix at every step.

    Shape: tgt (B, T) -> log_probs (B, V).
    """
    return _next_token(_log_probs_at, model, tgt, memory, src_mask, cache, cache_index)


def next_token_logits(model: Transformer, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray,
                      cache: tuple | None = None, cache_index: int | None = None,
                      ) -> Any:   # (B, V) logits; with a cache, (them, the new cache)
    """The generator's logits (``Generator.logits``: before its log-softmax, nothing suppressed) of the token after the
    last position of ``tgt``, what greedy decoding's repetition penalty reads (:func:`penalize`); ``tgt``, ``cache``
    and ``cache_index`` as for :func:`next_token_log_probs`. Shape: tgt (B, T) -> logits (B, V)."""
    return _next_token(_logits_at, model, tgt, memory, src_mask, cache, cache_index)


def _next_token(read: Callable[..., np.ndarray], model: Transformer, tgt: np.ndarray, memory: np.ndarray,
                src_mask: np.ndarray, cache: tuple | None, cache_index: int | None) -> Any:
    """What ``read`` (the log-probabilities or the logits) gives at the last position of the decoder's
    output after ``tgt``: the body of :func:`next_token_log_probs` and :func:`next_token_logits`, their arguments as
    there."""
    if cache is None:
        out = model.decode(tgt, memory, src_mask, tgt_mask=causal_mask(tgt.shape[1]))      # (B, T, D)
    else:
        cache = cache if cache_index is None else at_position(cache, cache_index)
        out, cache = model.decode(tgt, memory, src_mask, cache=cache)
    scores = read(model, out[:, -1:])                                                      # (B, V)
    return scores if cache is None else (scores, cache)


def _log_probs_at(model: Transformer, last: np.ndarray) -> np.ndarray:
    """The generator's log-probabilities of the decoder's output ``last``, the never-emitted tokens at -inf
    (:func:`_emittable`). Shape: last (B, 1, D) -> (B, V)."""
    return _emittable(model.config, model.generator(last)[:, 0])


def _logits_at(model: Transformer, last: np.ndarray) -> np.ndarray:
    """The generator's logits (before its log-softmax) of the decoder's output ``last``, nothing suppressed.
    Shape: last (B, 1, D) -> (B, V)."""
    return model.generator.logits(last)[:, 0]


def _scores(model: Transformer, tgt: np.ndarray, memory: np.ndarray, src_mask: np.ndarray, greedy: bool) -> np.ndarray:
    """The scores a step ranks the next token by, after the whole prefix ``tgt``: :func:`next_token_log_probs`; with a
    ``repetition_penalty`` p != 1 (module docstring), :func:`penalize` first, on the logits in greedy decoding
    (``greedy``) and on the log-probabilities in beam search, then the never-emitted tokens' -inf and ``renormalize``
    (:func:`_emittable`). Shape: tgt (B, T) -> (B, V) in the scores' dtype."""
    cfg = model.config
    if cfg.decoding.repetition_penalty == 1.0:
        return next_token_log_probs(model, tgt, memory, src_mask)
    logits = next_token_logits(model, tgt, memory, src_mask)
    scores = (logits if greedy else log_softmax(logits)).astype(score_dtype(model.dtype))
    return _emittable(cfg, penalize(cfg, scores, tgt, tgt.shape[1]))


def _emittable(config: TransformerConfig, log_probs: np.ndarray) -> np.ndarray:
    """The log-probabilities with the tokens of ``config.never_emitted`` set to -inf (in place), and with
    ``config.decoding.renormalize`` normalized again over the others: log p_v - log sum_u p_u, a log-softmax of them.
    Shape: (..., V) -> (..., V)."""
    log_probs[..., list(config.never_emitted)] = -np.inf
    return _renormalized(config, log_probs)


def _renormalized(config: TransformerConfig, log_probs: np.ndarray) -> np.ndarray:
    """With ``config.decoding.renormalize``, the log-probabilities normalized again over the tokens left (a log-softmax
    of them); else as they are. Shape: (..., V) -> (..., V)."""
    return log_softmax(log_probs) if config.decoding.renormalize else log_probs


def penalize(config: TransformerConfig, scores: np.ndarray, history: np.ndarray, step: int) -> np.ndarray:
    """The scores of the token at output ``step`` t with ``config.decoding.repetition_penalty`` p applied (module
    docstring): each token of the prefix ``history[:, :t]`` (the start token and the tokens
    so far), counted once however often it occurs, has its score s divided by p where s > 0 and multiplied by p where
    s < 0 (0 and -inf stay as they are); the others unchanged. ``scores`` unchanged when p is 1.
    Shape: scores (N, V), history (N, W), W >= t -> (N, V)."""
    penalty = config.decoding.repetition_penalty
    if penalty == 1.0:
        return scores
    scores = scores.copy()
    for row, tokens in enumerate(history[:, :step].tolist()):
        for token in set(tokens):
            score = scores[row, token]
            scores[row, token] = score * penalty if score < 0 else score / penalty
    return scores


def constrain(config: TransformerConfig, log_probs: np.ndarray, history: np.ndarray, step: int) -> np.ndarray:
    """The log-probabilities of the token at output ``step`` t, after the prefix ``history[:, :t]`` (the start token
    and the tokens so far), with the held-back tokens of the module docstring at -inf: eos while t <
    ``config.decoding.min_output_length``; with ``config.decoding.no_repeat_ngram_size`` n, each token v such that the
    last n - 1 tokens of the prefix followed by v is an n-gram of the prefix; then, with
    ``config.decoding.renormalize``, normalized again over the others (at every step of a config with either setting).
    Shape: log_probs (N, V), history (N, W), W >= t -> (N, V)."""
    n = config.decoding.no_repeat_ngram_size
    if not (config.decoding.min_output_length or n):
        return log_probs
    log_probs = log_probs.copy()
    if step < config.decoding.min_output_length:
        log_probs[:, config.eos_id] = -np.inf
    for row, tokens in enumerate(history[:, :step].tolist() if n else ()):
        tail = tokens[step - n + 1:]                       # the n - 1 tokens a new n-gram would start with
        for start in range(step - n + 1):                  # every n-gram of the prefix
            if tokens[start:start + n - 1] == tail:
                log_probs[row, tokens[start + n - 1]] = -np.inf
    return _renormalized(config, log_probs)


def forced_tokens(config: TransformerConfig, step: int, limits: np.ndarray, forced_bos_id: int | None) -> np.ndarray:
    """The token each sequence is forced to emit at ``step`` (1 = the first output token), -1 where none: the forced
    first token (``forced_bos_id``), and ``config.forced_last_id`` at the budget's last step with
    ``config.decoding.forced_eos`` (which wins when both fall on one step: the forced last token is applied after
    the forced first one).
    Shape: limits (B,) -> (B,)."""
    forced = np.full(len(limits), -1 if forced_bos_id is None or step != 1 else forced_bos_id, dtype=np.int64)
    return np.where(config.decoding.forced_eos & (step == limits), config.forced_last_id, forced)


def force(log_probs: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """The log-probabilities of a step with :func:`forced_tokens`: where a token is forced, it gets 0 and every
    other token -inf, elsewhere they are unchanged. Shape: (B, V), (B,)."""
    one_hot = np.arange(log_probs.shape[1]) == forced[:, None]
    return np.where(forced[:, None] >= 0, np.where(one_hot, 0.0, -np.inf).astype(log_probs.dtype), log_probs)


def greedy_decode(model: Transformer, src: np.ndarray, forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy decoding; ties go to the lowest token id; ``forced_bos_id`` the forced first token (module docstring).

    Shape: src (B, S) -> tokens (B, L), without the start token, right-padded with pad_id.
    """
    cfg = model.config
    forced_bos_id = check_forced_bos(cfg, forced_bos_id)
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = np.asarray(src)
    src_mask = padding_mask(src, cfg.pad_id)
    limits = max_output_lengths(model, src)
    tgt = np.full((len(src), 1), cfg.start_id, dtype=np.int64)
    done = np.zeros(len(src), dtype=bool)
    for step in range(1, int(limits.max()) + 1):
        log_probs = force(constrain(cfg, _scores(model, tgt, memory, src_mask, greedy=True), tgt, step),
                          forced_tokens(cfg, step, limits, forced_bos_id))          # (B, V)
        token = log_probs.argmax(axis=-1)                                          # first max = lowest id
        token = np.where(done, cfg.pad_id, token)
        tgt = np.concatenate([tgt, token[:, None]], axis=1)
        done |= (token == cfg.eos_id) | (step >= limits)
        if done.all():
            break
    return tgt[:, 1:]


def beam_search(model: Transformer, src: np.ndarray, beam_size: int = BEAM_SIZE, alpha: float | None = None,
                forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam search with the config's length normalization (alpha: None is ``config.decoding.length_penalty``, 0.6 by
    default), the forced first token ``forced_bos_id`` and the tie-break of this module's docstring.

    Shape: src (B, S) -> tokens (B, L) without the start token, right-padded with pad_id, and the
    length-normalized scores (B,).
    """
    results = [best_hypothesis(deque(steps, maxlen=1)[0].finished)                 # each sentence's last step
               for steps in _beam_steps(model, src, beam_size, alpha, forced_bos_id)]
    width = max(len(tokens) for tokens, _ in results)
    tokens = np.full((len(results), width), model.config.pad_id, dtype=np.int64)
    for b, (row, _) in enumerate(results):
        tokens[b, :len(row)] = row
    return tokens, np.array([score for _, score in results])


class _BeamStep(NamedTuple):
    """One step of one source sentence's search (see :func:`_beam_steps`)."""

    candidates: np.ndarray                          # (n_live, V) the summed log-probabilities the step ranked
    finished: tuple[tuple[float, list[int]], ...]   # the hypotheses finished so far, in the order they finished


class _Search(NamedTuple):
    """One beam search's settings: the beam size, the forced first token, lp's alpha and the config's rules."""

    beam_size: int
    forced_bos_id: int | None
    alpha: float
    normalization: str
    early_stopping: bool | str

    def lp(self, length: int) -> float:
        return length_penalty(length, self.alpha, self.normalization)


def _beam_steps(model: Transformer, src: np.ndarray, beam_size: int, alpha: float | None,
                forced_bos_id: int | None = None) -> Iterator[Iterator[_BeamStep]]:
    """The search of :func:`beam_search`, step by step: for each source sentence in turn, the iterator of its
    steps (consume each before the next). Its last step's ``finished`` holds every hypothesis the search scored."""
    cfg = model.config
    beam_size, alpha = check_decoding_args(beam_size, alpha, cfg)
    search = _Search(beam_size, check_forced_bos(cfg, forced_bos_id), alpha, cfg.decoding.length_normalization,
                     cfg.decoding.early_stopping)
    memory = model.encode(src)                        # checks src: shape, dtype, length, ids
    src = np.asarray(src)
    src_mask = padding_mask(src, model.config.pad_id)
    limits = max_output_lengths(model, src)
    for b in range(len(src)):
        yield _sentence_steps(model, memory[b:b + 1], src_mask[b:b + 1], int(limits[b]), search)


def _sentence_steps(model: Transformer, memory: np.ndarray, src_mask: np.ndarray, limit: int,
                    search: _Search) -> Iterator[_BeamStep]:
    """Beam search for one source sentence, one step at a time. memory (1, S, D), src_mask (1, 1, 1, S)."""
    cfg = model.config
    live = np.full((1, 1), cfg.start_id, dtype=np.int64)   # (n_live, t): the start token + generated tokens
    live_scores = np.zeros(1, dtype=score_dtype(model.dtype))   # summed log-probabilities, (n_live,)
    finished: list[tuple[float, list[int]]] = []         # in the order they finished
    for step in range(1, limit + 1):
        n_live = len(live)
        log_probs = constrain(cfg, _scores(model, live, np.repeat(memory, n_live, axis=0),
                                           np.repeat(src_mask, n_live, axis=0), greedy=False), live, step)
        log_probs = force(log_probs, np.repeat(forced_tokens(cfg, step, np.array([limit]), search.forced_bos_id),
                                               n_live))
        candidates = live_scores[:, None] + log_probs                               # (n_live, V)
        step_choice = select_candidates(candidates, cfg.eos_id, search.beam_size)
        for beam, score in step_choice.finishing:
            finished.append((score / search.lp(step), [*live[beam, 1:].tolist(), cfg.eos_id]))
        live = np.concatenate([live[step_choice.beams], step_choice.tokens[:, None]], axis=1)
        live_scores = step_choice.scores
        ends = search_ends(finished, live, live_scores, step, limit, search)
        yield _BeamStep(candidates, tuple(finished))
        if ends:
            return


def search_ends(finished: list, live: np.ndarray, live_scores: np.ndarray, step: int, limit: int,
                search: _Search) -> bool:
    """Whether the search stops after ``step``: at the maximum length (the live beams -- rows of the
    start token + tokens -- are then scored as finished, after this step's eos hypotheses), when no live
    beam is left (every non-eos candidate was impossible, e.g. only eos could follow), or by the
    normalization's rule (module docstring): "gnmt", when no live beam can beat the best finished
    hypothesis, max_b logP_b / lp(limit) <= best finished score; "hf", the config's ``early_stopping``
    rule once ``beam_size`` hypotheses have finished."""
    if step == limit:
        finished += [(score / search.lp(step), row[1:].tolist()) for score, row in zip(live_scores, live)]
        return True
    if len(live_scores) == 0:
        return True
    scores = sorted((score for score, _ in finished), reverse=True)
    if search.normalization == "gnmt":
        return bool(live_scores.max() / search.lp(limit) <= (scores[0] if scores else -np.inf))
    if len(scores) < search.beam_size:
        return False
    bound = limit if search.early_stopping == "never" else step
    worst_kept = scores[search.beam_size - 1]
    return search.early_stopping is True or bool(live_scores.max() / search.lp(bound) <= worst_kept)


def best_hypothesis(finished: Sequence[tuple[float, list[int]]]) -> tuple[list[int], float]:
    """The best-scoring finished hypothesis; a tie goes to the one finished first. None finished (at some step every
    token of every hypothesis was held back or suppressed): the empty output, scored -inf."""
    if not finished:
        return [], -math.inf
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
    ends = is_eos[:beam_size] & np.isfinite(scores[:beam_size])          # a finite eos among the first beam_size
    finishing = [(int(beams[rank]), scores[rank]) for rank in np.flatnonzero(ends)]
    keep = np.flatnonzero(~is_eos & np.isfinite(scores))[:beam_size]      # first beam_size possible non-eos
    return StepChoice(finishing, beams[keep], tokens[keep], scores[keep])

