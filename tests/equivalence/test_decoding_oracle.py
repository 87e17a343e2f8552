"""Greedy decoding and beam search against oracles that share no code with the decoders.

Three oracles, written from the rules of ``docs/reference.md`` and the GNMT length penalty of
Wu et al. (2016), eq. (14), never from ``reference_numpy/decoding.py``:

* :func:`greedy_chain`: the argmax chain, ties to the lowest token id;
* :func:`every_hypothesis`: exhaustive enumeration of every hypothesis up to the maximum length,
  the best by score, a tie going to the one a beam that never prunes finishes first;
* :func:`simulate_beam`: the documented beam rules step by step on plain Python lists (ranking,
  eos among the first ``beam_size`` ranks, impossible candidates, early stopping, ties).

Beam search is not exhaustive search: a beam of size k can miss the global best, so brute force
is the oracle only where nothing is pruned (a beam wider than every step's candidates); the
simulation is the oracle for every beam size, and is itself checked against brute force.

Scripted models (``next-token distribution = f(prefix)``) drive the reference and, through it,
the beam rules the PyTorch port shares. Real tiny checkpoints whose next-token logits are exact
constants drive every backend's own decoding, where exact ties and the "only eos can follow"
case must come out the same. Real tiny checkpoints whose logits follow the last token (bigrams
set by hand) drive every backend through section 6.1's corners -- an eos at every rank the
search sees, dropped outside the beam, hypotheses finishing at different steps, sources of every
kind in one batch -- and through the output budget ("input length + 50") of a run that never
emits eos.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FRAMEWORKS, ScriptedModel, constant_logits_params, port_backend

from equivalence.backends import numpy as reference
from equivalence.margins import beam_step_margin
from equivalence.tolerance import assert_agrees, beam_row_is_decisive, float64_bound
from reference_numpy import TransformerConfig, beam_search, greedy_decode, init_params

PAD, BOS, EOS, A, B = 0, 1, 2, 3, 4
IMPOSSIBLE = -math.inf


def lp(length: int, alpha: float) -> float:
    """GNMT length penalty, Wu et al. (2016) eq. (14): (5 + |Y|)^alpha / (5 + 1)^alpha."""
    return (5 + length) ** alpha / (5 + 1) ** alpha


def emitted_log_probs(script, prefix: tuple) -> list[float]:
    """The decoder's view of a script: log-probabilities, pad and bos impossible."""
    with np.errstate(divide="ignore"):
        log_probs = [float(x) for x in np.log(script(prefix))]
    log_probs[PAD] = log_probs[BOS] = IMPOSSIBLE
    return log_probs


# ----------------------------------------------------------------------------- the oracles

def greedy_chain(script, limit: int) -> tuple:
    """The highest log-probability at every step, ties to the lowest id, until eos or ``limit`` tokens."""
    tokens: tuple = ()
    while len(tokens) < limit and EOS not in tokens:
        log_probs = emitted_log_probs(script, tokens)
        best = max(log_probs)
        tokens += (log_probs.index(best),)                      # the first (lowest) id of the best
    return tokens


def every_hypothesis(script, limit: int, alpha: float) -> list[tuple[float, tuple, tuple]]:
    """Every possible hypothesis, best first: (score, tokens, order), order being the position in
    which a beam that never prunes finishes it (its step, eos before the ones the length limit
    ends, then its rank: summed log-probability, then its prefix's rank, then its last token)."""
    found = []

    def grow(prefix: tuple, total: float, rank: tuple) -> None:
        log_probs = emitted_log_probs(script, prefix)
        for token in range(EOS, len(log_probs)):
            summed = total + log_probs[token]                   # accumulated step by step, as decoders do
            if summed == IMPOSSIBLE:
                continue
            tokens, token_rank = prefix + (token,), (-summed, rank, token)
            if token == EOS or len(tokens) == limit:
                found.append((summed / lp(len(tokens), alpha), tokens, (len(tokens), token != EOS, token_rank)))
            else:
                grow(tokens, summed, token_rank)

    grow((), 0.0, ())
    return sorted(found, key=lambda found: (-found[0], found[2]))


def simulate_beam(script, limit: int, beam_size: int, alpha: float, early_stopping: bool = True,
                  trace: list | None = None):
    """The beam rules of docs/reference.md, literally. Returns the finished hypotheses
    [(score, tokens)] in the order they finished, and the number of steps taken. A ``trace`` list
    receives each step's ranking: every (summed log-prob, beam, token) candidate, best first."""
    live = [((), 0.0)]                                          # (tokens, summed log-prob), rank order
    finished = []
    for step in range(1, limit + 1):
        candidates = [(total + log_prob, beam, token) for beam, (tokens, total) in enumerate(live)
                      for token, log_prob in enumerate(emitted_log_probs(script, tokens))]
        candidates.sort(key=lambda candidate: (-candidate[0], candidate[1], candidate[2]))
        if trace is not None:
            trace.append(candidates)
        next_live = []
        for rank, (summed, beam, token) in enumerate(candidates):
            tokens = live[beam][0] + (token,)
            if token == EOS and rank < beam_size:
                finished.append((summed / lp(step, alpha), tokens))
            elif token != EOS and summed != IMPOSSIBLE and len(next_live) < beam_size:
                next_live.append((tokens, summed))
        live = next_live
        if step == limit:
            finished += [(total / lp(step, alpha), tokens) for tokens, total in live]
            return finished, step
        if not live:
            return finished, step
        best = max((score for score, _ in finished), default=IMPOSSIBLE)
        if early_stopping and max(total for _, total in live) / lp(limit, alpha) <= best:
            return finished, step
    raise AssertionError("unreachable: the last step returns")


def best_finished(finished: list) -> list[tuple[float, tuple]]:
    """Finished hypotheses best first; a tie goes to the one finished first (a stable sort)."""
    return sorted(finished, key=lambda entry: -entry[0])


def assert_chooses(tokens, score, ranked: list) -> None:
    """``tokens``/``score`` is the oracle's choice ``ranked[0]`` = (score, tokens, ...). Another
    hypothesis is accepted only if its score differs from the best by less than the float64
    bound without being equal: the two penalty formulas may round such a near-tie either way."""
    best_score = ranked[0][0]
    bound = float64_bound(best_score)
    allowed = [entry[1] for entry in ranked[:1] + [entry for entry in ranked[1:]
                                                   if entry[0] != best_score and best_score - entry[0] <= bound]]
    emitted = tuple(int(t) for t in tokens if t != PAD)
    assert emitted in allowed, f"decoded {emitted}, expected {allowed[0]} (score {best_score})"
    assert_agrees(score, ranked[allowed.index(emitted)][0], what="beam score vs oracle")


# ----------------------------------------------------------------------------- scripted models

def table_script(table: dict, vocab: int = 5):
    """Probabilities over (pad, bos, eos, a, b, ...) per prefix; a prefix not in ``table`` ends with eos."""
    return lambda prefix: np.array(table.get(prefix, [0, 0, 1] + [0] * (vocab - 3)), dtype=float)


def decode(script, limit: int, beam_size: int | None = None, alpha: float | None = None, vocab: int = 5):
    """The reference on a scripted model with maximum output length ``limit``: greedy (no
    ``beam_size``) or beam search (default alpha when ``alpha`` is None). Returns the emitted
    tokens, the score and the number of steps (the longest prefix the model was asked about + 1)."""
    asked: list[int] = []
    model = ScriptedModel(lambda prefix: asked.append(len(prefix)) or script(prefix), max_len=limit, vocab=vocab)
    src = np.array([[A]])
    if beam_size is None:
        tokens, score = greedy_decode(model, src)[0], None
    else:
        options = {} if alpha is None else {"alpha": alpha}
        tokens, scores = beam_search(model, src, beam_size=beam_size, **options)
        tokens, score = tokens[0], float(scores[0])
    return tuple(int(t) for t in tokens if t != PAD), score, max(asked) + 1


# Three hypotheses worth having: [eos] (log P = log .37 = -0.994), [a, a, eos]
# (log .63 + log .999 + log .53 = -1.098) and [a, a, b, b, eos] (log .63 + log .999 + log .47
# + log .87 = -1.357). Divided by lp = ((5 + |Y|) / 6)^alpha: alpha 0 keeps the raw order, alpha
# 0.6 gives -0.994, -0.924, -0.999 and alpha 1.5 gives -0.994, -0.713, -0.631.
THREE_LENGTHS = table_script({
    (): [0, 0, 0.37, 0.63, 0],
    (A,): [0, 0, 0.001, 0.999, 0],
    (A, A): [0, 0, 0.53, 0, 0.47],
    (A, A, B): [0, 0, 0.001, 0.129, 0.87],
})


@pytest.mark.parametrize("alpha,expected", [(0.0, (EOS,)), (0.6, (A, A, EOS)), (1.5, (A, A, B, B, EOS)),
                                            (None, (A, A, EOS))], ids=["0", "0.6", "1.5", "default"])
def test_the_length_penalty_decides_which_length_wins(alpha, expected):
    alpha_value = 0.6 if alpha is None else alpha
    ranked = every_hypothesis(THREE_LENGTHS, 6, alpha_value)
    assert ranked[0][1] == expected
    tokens, score, _ = decode(THREE_LENGTHS, 6, beam_size=4, alpha=alpha)
    assert_chooses(tokens, score, ranked)
    assert best_finished(simulate_beam(THREE_LENGTHS, 6, 4, alpha_value)[0])[0][1] == expected


def test_a_beam_that_ends_leaves_room_for_the_others():
    """Beam 2. Step 2 ranks [a, eos] (.22), [a, a] (.21), [b, b] (.2): [a, eos] finishes
    (log .22 / lp(2) = -1.380) and frees its slot, so [b, b] lives on and ends as [b, b, eos]
    (log .2 / lp(3) = -1.354), which wins. A search that kept [a, eos] as a live beam would
    have dropped [b, b]."""
    script = table_script({
        (): [0.05, 0, 0, 0.5, 0.45],
        (A,): [0, 0, 0.44, 0.42, 0.14],
        (B,): [0.5555555555555556, 0, 0, 0, 0.4444444444444444],
        (A, A): [0, 0, 0.5, 0.5, 0],
    })
    tokens, score, steps = decode(script, 4, beam_size=2)
    assert tokens == (B, B, EOS)
    assert_chooses(tokens, score, best_finished(simulate_beam(script, 4, 2, 0.6)[0]))
    assert steps == 3 == simulate_beam(script, 4, 2, 0.6)[1]


def test_an_eos_ranked_outside_the_beam_is_dropped_not_kept_alive():
    """Beam 2, alpha 2. Step 2 ranks [a, eos] (.30), [a, a] (.15), [b, eos] (.12), [b, a] (.105):
    [a, eos] finishes at rank 1 (log .3 / lp(2) = -0.885); [b, eos] ranks 3, outside the beam, and
    is dropped, so the second live beam is [b, a], which goes on to [b, a, a, a, eos]
    (log .105 / lp(5) = -0.811) and wins. Had [b, eos] become a live beam in the free slot, it would
    have been extended past its eos ([b, eos, eos]: -1.193) and [b, a] lost: [a, eos] would win."""
    script = table_script({
        (): [0, 0, 0.2, 0.5, 0.3],
        (A,): [0, 0, 0.6, 0.3, 0.1],
        (B,): [0, 0, 0.4, 0.35, 0.25],
        (A, A): [0, 0, 1.0, 0, 0],
        (B, A): [0, 0, 0, 1.0, 0],
        (B, A, A): [0, 0, 0, 1.0, 0],
    })
    trace: list = []
    finished, steps = simulate_beam(script, 6, 2, 2.0, trace=trace)
    assert eos_ranks(trace[1]) == [1, 3]
    tokens, score, decoded_steps = decode(script, 6, beam_size=2, alpha=2.0)
    assert tokens == (B, A, A, A, EOS) and decoded_steps == steps == 5
    assert_chooses(tokens, score, best_finished(finished))


def test_early_stopping_uses_the_penalty_of_the_maximum_length():
    """alpha 1.5, limit 6. Step 1 finishes [eos] at log .5 = -0.693 and keeps [a] at log .3 = -1.204.
    [a] continues with certainty to [a, a, a, a, eos]: -1.204 / lp(5) = -0.560, the best.
    The rule max logP / lp(6) = -0.485 > -0.693 keeps searching; lp(1) = 1 in its place would
    have stopped at step 1 with [eos]. After [a, a, a, a] only eos can follow: no live beam is
    left and the search ends after step 5."""
    script = table_script({(): [0.2, 0, 0.5, 0.3, 0], (A,): [0, 0, 0, 1.0, 0], (A, A): [0, 0, 0, 1.0, 0],
                           (A, A, A): [0, 0, 0, 1.0, 0]})
    tokens, score, steps = decode(script, 6, beam_size=2, alpha=1.5)
    assert (tokens, steps) == ((A, A, A, A, EOS), 5)
    assert_chooses(tokens, score, every_hypothesis(script, 6, 1.5))


def test_the_search_stops_as_soon_as_no_live_beam_can_win():
    """alpha 0: after step 3 the best live beam [a, a, b] (log P = -1.218) cannot beat [eos]
    (-0.994): the search stops there, and its answer is the one of a search that never stops."""
    tokens, score, steps = decode(THREE_LENGTHS, 6, beam_size=4, alpha=0.0)
    finished, simulated_steps = simulate_beam(THREE_LENGTHS, 6, 4, 0.0)
    assert (tokens, steps, simulated_steps) == ((EOS,), 3, 3)
    assert best_finished(simulate_beam(THREE_LENGTHS, 6, 4, 0.0, early_stopping=False)[0])[0][1] == tokens


# ----------------------------------------------------------------------------- exact ties

def test_equal_candidates_rank_by_beam_then_token_and_equal_hypotheses_by_rank():
    """Every step is a four-way tie: [a] and [b] at step 1, [a, a], [a, b], [b, a], [b, b] at
    step 2, where beam 2 keeps the two of beam 0 (lower beam, then lower token). Both end with
    eos at the same score; [a, a, eos] ranks first. A reversed token rule would give
    [b, b, eos], a reversed beam rule [b, a, eos], a tie to the later hypothesis [a, b, eos]."""
    script = table_script({(): [0, 0, 0, 0.5, 0.5], (A,): [0, 0, 0, 0.5, 0.5], (B,): [0, 0, 0, 0.5, 0.5]})
    assert decode(script, 4, beam_size=2)[0] == (A, A, EOS)
    assert best_finished(simulate_beam(script, 4, 2, 0.6)[0])[0][1] == (A, A, EOS)


def test_at_the_maximum_length_eos_hypotheses_finish_before_the_live_beams():
    """Limit 2, beam 2: [a, a] (beam 0) and [b, eos] (beam 1) tie at log .5 + log .6. [b, eos]
    finishes at rank 1; [a, a] is finished by the length limit after it, and the tie goes to
    [b, eos], although [a, a] ranked better."""
    script = table_script({(): [0, 0, 0, 0.5, 0.5], (A,): [0, 0, 0.1, 0.6, 0.3], (B,): [0, 0, 0.6, 0.4, 0]})
    assert decode(script, 2, beam_size=2)[0] == (B, EOS)
    assert best_finished(simulate_beam(script, 2, 2, 0.6)[0])[0][1] == (B, EOS)


def test_a_tie_between_steps_goes_to_the_hypothesis_finished_first():
    """alpha 1, so lp(1) = 1 and lp(2) = 7/6 in both penalty formulas. [eos] scores log .3 at
    step 1; [a, eos] scores (log .3 + log q) / (7/6), q chosen so that this is bitwise log .3.
    [a] (log .3 / lp(3) > log .3) keeps the search going; the tie goes to [eos]."""
    q = 0.8181888230000268
    script = table_script({(): [0.4, 0, 0.3, 0.3, 0], (A,): [0, 0, q, 0, 1 - q]})
    ranked = every_hypothesis(script, 3, 1.0)
    assert ranked[0][0] == ranked[1][0] and [entry[1] for entry in ranked[:2]] == [(EOS,), (A, EOS)]
    tokens, score, steps = decode(script, 3, beam_size=2, alpha=1.0)
    assert (tokens, steps) == ((EOS,), 2)
    assert score == ranked[0][0]


def test_greedy_ties_go_to_the_lowest_id_at_every_step():
    script = table_script({(): [0, 0, 0.2, 0.4, 0.4], (A,): [0, 0, 0.4, 0.2, 0.4], (A, EOS): [0, 0, 1, 0, 0]})
    assert decode(script, 5)[0] == greedy_chain(script, 5) == (A, EOS)


# ----------------------------------------------------------------------------- only eos can follow

@pytest.mark.parametrize("beam_size", [1, 2, 4])
def test_when_only_eos_can_follow_the_finished_hypotheses_decide(beam_size):
    """A vocabulary of pad, bos and eos: eos is the only possible token, so no live beam remains
    after step 1 and [eos] is the answer, with score log P(eos) / lp(1)."""
    script = table_script({(): [0.3, 0.3, 0.4]}, vocab=3)
    tokens, score, steps = decode(script, 5, beam_size=beam_size, vocab=3)
    assert (tokens, steps) == ((EOS,), 1)
    assert_agrees(score, math.log(0.4), what="[eos] score")
    assert decode(script, 5, vocab=3)[0] == (EOS,)


@pytest.mark.parametrize("beam_size", [1, 2, 3])
def test_when_every_live_beam_can_only_end_the_search_ends(beam_size):
    """After [a] or [b] only eos can follow: step 2 leaves no live beam. Beam 3 finishes [eos]
    at step 1 (rank 2, log .2 = -1.609) and it wins over [a, eos] ((log .5 + log .3) / lp(2) =
    -1.729); beams 1 and 2 leave [eos] out and [a, eos] wins."""
    script = table_script({(): [0, 0, 0.2, 0.5, 0.3], (A,): [0.7, 0, 0.3, 0, 0], (B,): [0.9, 0, 0.1, 0, 0]})
    tokens, score, steps = decode(script, 5, beam_size=beam_size)
    assert steps == 2
    assert tokens == ((EOS,) if beam_size == 3 else (A, EOS))
    assert_chooses(tokens, score, best_finished(simulate_beam(script, 5, beam_size, 0.6)[0]))


# ----------------------------------------------------------------------------- random scripts

def random_script(data, vocab: int):
    """A distribution per prefix drawn on first use, from integer weights 0..3 so that exact ties
    are common (eos 0..1 at step 1, or most searches would end there); at least one token other
    than pad and bos is possible."""
    table: dict = {}

    def script(prefix):
        if prefix not in table:
            weights = data.draw(st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab), label=f"{prefix}")
            weights[EOS] = weights[EOS] if prefix else min(weights[EOS], 1)
            if not any(weights[EOS:]):
                weights[EOS] = 1
            table[prefix] = np.array(weights) / sum(weights)
        return table[prefix]
    return script


ALPHAS = st.sampled_from([0.0, 0.6, 1.0, 1.5])


@settings(max_examples=80, deadline=None, derandomize=True)
@given(data=st.data(), vocab=st.integers(4, 6), limit=st.integers(1, 6))
def test_greedy_is_the_argmax_chain(data, vocab, limit):
    script = random_script(data, vocab)
    assert decode(script, limit, vocab=vocab)[0] == greedy_chain(script, limit)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(data=st.data(), vocab=st.integers(4, 6), limit=st.integers(1, 4), alpha=ALPHAS)
def test_a_beam_that_never_prunes_finds_the_exhaustive_optimum(data, vocab, limit, alpha):
    """Beam size vocab^limit exceeds every step's candidates: the best of every hypothesis,
    exact ties included (the first finished); the simulation agrees with brute force too."""
    script = random_script(data, vocab)
    ranked = every_hypothesis(script, limit, alpha)
    tokens, score, _ = decode(script, limit, beam_size=vocab ** limit, alpha=alpha, vocab=vocab)
    assert_chooses(tokens, score, ranked)
    simulated = best_finished(simulate_beam(script, limit, vocab ** limit, alpha)[0])[0]
    assert_chooses(simulated[1], simulated[0], ranked)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(data=st.data(), vocab=st.integers(4, 6), limit=st.integers(1, 6), beam_size=st.integers(1, 4),
       alpha=ALPHAS)
def test_beam_search_follows_the_documented_rules(data, vocab, limit, beam_size, alpha):
    """Any beam size: the simulation's answer and its number of steps; early stopping never
    changes the answer (the simulation without it agrees)."""
    script = random_script(data, vocab)
    finished, steps = simulate_beam(script, limit, beam_size, alpha)
    tokens, score, decoded_steps = decode(script, limit, beam_size=beam_size, alpha=alpha, vocab=vocab)
    assert_chooses(tokens, score, best_finished(finished))
    assert decoded_steps == steps
    assert best_finished(simulate_beam(script, limit, beam_size, alpha, early_stopping=False)[0])[0][1] == \
        best_finished(finished)[0][1]


# ----------------------------------------------------------------------------- every backend

DTYPES = ("float64", "float32")


@pytest.fixture(params=["numpy", *FRAMEWORKS])
def backend(request):
    """The backend adapter of the reference or of a port (skipped, with the reason, when its
    framework is not installed)."""
    return reference if request.param == "numpy" else port_backend(request.param)


@functools.cache
def constant_logits_model(backend, logits: tuple[float, ...], dtype: str):
    """A model whose next-token logits are exactly ``logits`` at every step
    (``support.constant_logits_params``): equal logits are bitwise-equal log-probabilities, exact
    ties. The maximum output length is 4 (``max_len``). Cached: the compiled ports trace once per model."""
    return backend.build(*constant_logits_params(logits, max_len=4), dtype)


def softmax(logits) -> np.ndarray:
    """The next-token distribution of ``logits`` (all of them: pad and bos take their share before the
    decoder sets their log-probabilities to -inf)."""
    probabilities = np.exp(np.array(logits) - max(logits))
    return probabilities / probabilities.sum()


def constant_script(logits: tuple[float, ...]):
    """The oracles' view of :func:`constant_logits_model`: softmax(logits) after every prefix."""
    return lambda prefix: softmax(logits)


# eos, 4 and 6 tie at the top (log-probability 2 - log(3e^2 + 4) = -1.2645 each), so every step
# of greedy and beam search is an exact tie. With alpha 5 an n-token hypothesis scores
# -1.2645 n / ((5 + n) / 6)^5 = -1.26, -1.17, -0.90, -0.67 for n = 1..4: the longest wins, and the
# tie rules alone decide what it holds. Documented: (4, 4, 4, eos) -- reversing the token rule,
# the beam rule, the tie between hypotheses, or finishing the live beams before the eos ones
# at the maximum length each gives another answer.
TIED_LOGITS = (0.0, 0.0, 2.0, 0.0, 2.0, 0.0, 2.0)
SOURCES = np.array([[3, 4, 2], [5, 2, 0]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_backend_breaks_exact_ties_by_the_documented_rules(backend, dtype):
    """Greedy: eos, the lowest of the tied ids. Beam 4, alpha 5: the simulation's (4, 4, 4, eos).
    Scores (float64 arrays holding model-dtype values) are compared in the model's dtype."""
    model = constant_logits_model(backend, TIED_LOGITS, dtype)
    script = constant_script(TIED_LOGITS)
    assert greedy_chain(script, 4) == (EOS,)
    np.testing.assert_array_equal(backend.greedy(model, SOURCES), [[EOS], [EOS]])
    ranked = best_finished(simulate_beam(script, 4, 4, 5.0)[0])
    assert ranked[0][1] == (4, 4, 4, EOS)
    tokens, scores = backend.beam(model, SOURCES, beam_size=4, alpha=5.0)
    np.testing.assert_array_equal(tokens, [ranked[0][1]] * 2)
    ref32 = reference.beam(constant_logits_model(reference, TIED_LOGITS, "float32"), SOURCES, beam_size=4, alpha=5.0)[1]
    assert_agrees(scores.astype(dtype), [ranked[0][0]] * 2, ref32, what=f"{backend.NAME} {dtype} beam scores")


def test_every_backend_ends_the_search_when_only_eos_can_follow(backend):
    """A target vocabulary of pad, bos and eos: eos is the only token the decoder may emit.
    Every backend returns [eos] with score log P(eos) / lp(1) = 1 - log(2 + e), beam 1 or 4.
    (float64 only: nothing here depends on the dtype, and each one compiles three searches.)"""
    logits, dtype = (0.0, 0.0, 1.0), "float64"
    model = constant_logits_model(backend, logits, dtype)
    np.testing.assert_array_equal(backend.greedy(model, SOURCES), [[EOS], [EOS]])
    for beam_size in (1, 4):
        tokens, scores = backend.beam(model, SOURCES, beam_size=beam_size)
        np.testing.assert_array_equal(tokens, [[EOS], [EOS]])
        ref32 = reference.beam(constant_logits_model(reference, logits, "float32"), SOURCES, beam_size=beam_size)[1]
        assert_agrees(scores.astype(dtype), [1 - math.log(2 + math.e)] * 2, ref32,
                      what=f"{backend.NAME} {dtype} beam {beam_size} [eos] scores")


# ----------------------------------------------------------------------------- the corners, in every backend
#
# Ties need exact logits, which only the constant-logit models above give every backend; a search whose
# next-token distribution changes with the prefix needs a model that remembers it. The bigram models below
# remember the last token, within a few float64 roundings, so their corners are chosen where every decision is
# clear by far more than float64 can move it (``decisive``).

def hadamard(n: int) -> np.ndarray:
    """Sylvester's n x n Hadamard matrix (n a power of 2): entries +-1, rows orthogonal (H H^T = n I),
    every row but the first summing to 0."""
    rows = np.ones((1, 1))
    while len(rows) < n:
        rows = np.block([[rows, rows], [rows, -rows]])
    return rows


@functools.cache
def bigram_model(backend, table: tuple[tuple[float, ...], ...], dtype: str):
    """A tiny pre-LN model (one layer per stack, learned positions, ``max_len`` 64) whose next-token
    logits are ``table[u]``, u the last token of the prefix (bos for the first step), whatever the
    source: its decoder's three sublayers output 0 (their output projections are zero) and its
    positions are 0, so the final LayerNorm sees sqrt(d_model) E[u] = 4 * 2^15 h_u, h_u row u + 1 of
    the 16 x 16 Hadamard matrix: mean 0, variance 2^34 (which swallows epsilon), normalized h_u; the
    output projection W = H^T table / 16 maps h_u to table[u]. The source is encoded and attended to,
    and changes nothing but the budget. Cached: the compiled ports trace once per model."""
    config = TransformerConfig.preset("tiny", tgt_vocab_size=len(table), n_encoder_layers=1, n_decoder_layers=1,
                                      norm_first=True, positional_encoding="learned")
    params = init_params(config, seed=0, perturb=0.1)
    rows = hadamard(config.d_model)[1:len(table) + 1]                              # (V, D)
    for sublayer in ("self_attn.o_proj", "cross_attn.o_proj", "ffn.linear2"):
        name = f"decoder.layers.0.{sublayer}"
        params[f"{name}.weight"], params[f"{name}.bias"] = 0 * params[f"{name}.weight"], np.zeros(config.d_model)
    params["tgt_pos_embed.weight"] = 0 * params["tgt_pos_embed.weight"]
    params["tgt_embed.weight"] = rows * 2.0 ** 15
    params["decoder.norm.weight"], params["decoder.norm.bias"] = np.ones(config.d_model), np.zeros(config.d_model)
    params["generator.weight"] = rows.T @ np.array(table) / config.d_model
    return backend.build(config, params, dtype)


def bigram_script(table):
    """The oracles' view of :func:`bigram_model`: softmax(table[last token]), bos before the first."""
    return lambda prefix: softmax(table[prefix[-1] if prefix else BOS])


# Sources of every kind, and section 6.1's budget for each as docs/reference.md counts it -- the
# source's non-pad tokens, its eos included, + 50 (max_len 64 caps none of them): no padding
# without and with a trailing eos, padding without and with one, an eos alone, padding alone.
EVERY_SOURCE = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
                         [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, EOS],
                         [5, 6, 7, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
                         [5, 6, 7, EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
                         [EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
                         [PAD] * 12])
BUDGETS = (62, 62, 53, 54, 51, 50)


def emitted(row) -> tuple:
    """A decoded row without its padding."""
    return tuple(int(t) for t in row if t != PAD)


def test_the_budget_is_what_docs_reference_says():
    """The table above against the documented rule, written out."""
    assert BUDGETS == tuple(min(sum(token != PAD for token in row) + 50, 64) for row in EVERY_SOURCE)


# Never eos: after token u, token 3 + (u - 2) mod 5 has logit 0 (bos is followed by 7, 7 by 3, 3 by 4,
# ...), the other tokens -1 and eos -30, so greedy decoding cycles through 7, 3, 4, 5, 6 and no
# beam-search step ranks an eos among its first 4 * 4 candidates. (pad and bos, logit 0, take their
# share of the softmax and are never emitted.)
NEVER_ENDS = tuple(tuple(0.0 if v == 3 + (u - 2) % 5 else -30.0 if v == EOS else 0.0 if v < EOS else -1.0
                         for v in range(8)) for u in range(8))


def test_every_backend_stops_a_run_without_eos_at_its_budget(backend):
    """Section 6.1, "maximum output length to input length + 50": a model that never emits eos
    decodes each source, greedy and beam, to exactly its budget (:data:`BUDGETS`), then pads."""
    model, script = bigram_model(backend, NEVER_ENDS, "float64"), bigram_script(NEVER_ENDS)
    greedy = backend.greedy(model, EVERY_SOURCE)
    tokens, scores = backend.beam(model, EVERY_SOURCE)
    assert greedy.shape[1] == tokens.shape[1] == max(BUDGETS)
    for row, budget in enumerate(BUDGETS):
        assert emitted(greedy[row]) == greedy_chain(script, budget) and len(emitted(greedy[row])) == budget, row
        ranked = best_finished(simulate_beam(script, budget, 4, 0.6)[0])
        assert len(ranked[0][1]) == budget and EOS not in ranked[0][1]
        assert_chooses(tokens[row], scores[row], ranked)
        assert not greedy[row, budget:].any() and not tokens[row, budget:].any(), f"row {row} not padded after"


# The corners: the logits after pad (never an input), bos, eos, a, b, c, d, e -- a table drawn to 0.01
# and kept for what its searches do (beam 4; alpha 0.6, 1 and 5; the budgets of EVERY_SOURCE), as
# test_the_corner_model_reaches_every_corner checks: an eos stands at each rank 1..8 of some step (the
# 2K ranks the ports' selection sees), finishing at ranks 1..4 and dropped at 5..8 -- in some steps
# after an eos of the same step finished (step 2: ranks 1 and 5), where a rule that let the dropped one
# become a live beam would change the answer at alpha 1 (scripts/check_mutations.py); hypotheses finish
# at every step; alpha 0.6 stops at step 14 to 18 with [c, eos], while at alpha 1 and 5 the answer
# [b, e, e, ...] runs to the budget, so that each source gets its own. d and e mostly repeat
# themselves: the long searches meet no two hypotheses of equal probability (the same transitions in
# another order) near a decision.
CORNERS = ((0.0,) * 8,
           (0.0, 0.0, -0.27, -1.5, -0.63, 0.62, -3.34, -3.8),
           (0.0, 0.0, -2.29, -2.27, 0.32, -0.98, -1.91, 1.89),
           (0.0, 0.0, -2.69, -2.61, -3.13, -0.61, -1.28, -1.29),
           (0.0, 0.0, 0.62, -3.29, 1.54, 0.7, -2.47, 0.52),
           (0.0, 0.0, 1.14, -3.99, -1.92, 0.27, -2.0, -2.97),
           (0.0, 0.0, -4.29, -7.36, -6.29, -6.05, 2.84, -0.23),
           (0.0, 0.0, -2.93, -7.41, -7.37, -7.35, -8.42, 2.33))
CORNER_ALPHAS = (0.6, 1.0, 5.0)


@functools.cache
def corner_search(alpha: float, budget: int) -> tuple[list, list]:
    """The simulation's finished hypotheses (best first) and its ranking at every step, for the
    corner table, beam 4."""
    trace: list = []
    finished, _ = simulate_beam(bigram_script(CORNERS), budget, 4, alpha, trace=trace)
    return best_finished(finished), trace


def eos_ranks(ranking: list) -> list[int]:
    """The ranks (from 1) of a step's eos candidates."""
    return [rank for rank, (_, _, token) in enumerate(ranking, 1) if token == EOS]


def decisive(ranked: list, trace: list, log_probs) -> bool:
    """Whether float64 rounding cannot change the search (``tolerance.beam_row_is_decisive``): each
    step's margin at its decisions (``margins.beam_step_margin`` of the candidates, beam by token) and
    the final choice's margin against the float64 bound of the log-probabilities, summed step by step."""
    steps = []
    for ranking in trace:
        candidates = np.empty((1 + max(beam for _, beam, _ in ranking), 1 + max(token for *_, token in ranking)))
        for summed, beam, token in ranking:
            candidates[beam, token] = summed
        steps.append(beam_step_margin(candidates, EOS, 4))
    final = ranked[0][0] - ranked[1][0] if len(ranked) > 1 else math.inf
    return beam_row_is_decisive([*steps, final], float64_bound(np.abs(log_probs)))


def test_the_corner_model_reaches_every_corner():
    """What :data:`CORNERS` is kept for, on the oracle's side."""
    script = bigram_script(CORNERS)
    log_probs = [lp for row in CORNERS[1:] for lp in emitted_log_probs(script, (CORNERS.index(row),)) if lp > -math.inf]
    ranks, finishing, outside_after_finish, answers = set(), set(), False, {}
    for alpha in CORNER_ALPHAS:
        for budget in BUDGETS:
            ranked, trace = corner_search(alpha, budget)
            assert decisive(ranked, trace, log_probs), (alpha, budget)
            for ranking in trace:
                step_ranks = eos_ranks(ranking)
                ranks |= {rank for rank in step_ranks if rank <= 8}
                outside_after_finish |= min(step_ranks) <= 4 < max(step_ranks)
            finishing |= {len(tokens) for _, tokens in ranked if tokens[-1] == EOS}
            answers[alpha, budget] = ranked[0][1]
    assert ranks == set(range(1, 9)) and outside_after_finish
    assert len(finishing) > 2
    assert all(len(answers[alpha, budget]) == budget for alpha in (1.0, 5.0) for budget in BUDGETS)


def test_every_backend_follows_the_oracle_in_the_corners(backend):
    """Beam 4 on the corner model for every source of :data:`EVERY_SOURCE` (in one batch: each row's
    own budget) at alpha 0.6, 1 and 5: the simulation's tokens, and its score within the float64 bound."""
    model = bigram_model(backend, CORNERS, "float64")
    for alpha in CORNER_ALPHAS:
        tokens, scores = backend.beam(model, EVERY_SOURCE, beam_size=4, alpha=alpha)
        for row, budget in enumerate(BUDGETS):
            assert_chooses(tokens[row], scores[row], corner_search(alpha, budget)[0])
