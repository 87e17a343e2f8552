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
case must come out the same.
"""

from __future__ import annotations

import functools
import importlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ScriptedModel

from equivalence.tolerance import assert_agrees, float64_bound
from reference_numpy import TransformerConfig, beam_search, greedy_decode, init_params
from transformer_cli.backends import numpy as reference

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


def simulate_beam(script, limit: int, beam_size: int, alpha: float, early_stopping: bool = True):
    """The beam rules of docs/reference.md, literally. Returns the finished hypotheses
    [(score, tokens)] in the order they finished, and the number of steps taken."""
    live = [((), 0.0)]                                          # (tokens, summed log-prob), rank order
    finished = []
    for step in range(1, limit + 1):
        candidates = [(total + log_prob, beam, token) for beam, (tokens, total) in enumerate(live)
                      for token, log_prob in enumerate(emitted_log_probs(script, tokens))]
        candidates.sort(key=lambda candidate: (-candidate[0], candidate[1], candidate[2]))
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

FRAMEWORKS = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}
DTYPES = ("float64", "float32")


@pytest.fixture(params=["numpy", *FRAMEWORKS])
def backend(request):
    """The backend adapter of the reference or of a port (skipped, with the reason, when its
    framework is not installed)."""
    if request.param == "numpy":
        return reference
    framework = FRAMEWORKS[request.param]
    pytest.importorskip(framework, reason=f"{framework} is not installed (pip install '.[{request.param}]')")
    return importlib.import_module(f"transformer_cli.backends.{request.param}")


@functools.cache
def constant_logits_model(backend, logits: tuple[float, ...], dtype: str):
    """A tiny post-LN model whose next-token logits are exactly ``logits`` at every step, in every
    framework and dtype: the decoder's last LayerNorm has gain 0 and bias e_0, so it outputs e_0
    whatever its input, and row 0 of the output projection holds ``logits`` (products by 1 and 0
    are exact in any summation order). Equal logits are bitwise-equal log-probabilities: exact
    ties. One layer per stack (quick to compile); the maximum output length is 4 (``max_len``).
    Cached: the compiled ports trace once per model."""
    config = TransformerConfig.preset("tiny", tgt_vocab_size=len(logits), max_len=4, n_encoder_layers=1,
                                      n_decoder_layers=1)
    params = init_params(config, seed=0, perturb=0.1)
    last_norm = f"decoder.layers.{config.n_decoder_layers - 1}.ffn_norm"
    params[f"{last_norm}.weight"] = np.zeros(config.d_model)
    params[f"{last_norm}.bias"] = np.eye(config.d_model)[0]
    params["generator.weight"] = np.zeros((config.d_model, len(logits)))
    params["generator.weight"][0] = logits
    return backend.build(config, params, dtype)


def constant_script(logits: tuple[float, ...]):
    """The oracles' view of :func:`constant_logits_model`: softmax(logits) after every prefix."""
    probabilities = np.exp(np.array(logits) - max(logits))
    return lambda prefix: probabilities / probabilities.sum()


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
