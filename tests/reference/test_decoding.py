"""The decoding rules of section 6.1, checked on scripted next-token distributions, with
exhaustive search as the oracle for beam search."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
from support import ScriptedModel

from equivalence.cases import VARIANTS
from equivalence.tolerance import assert_agrees
from reference_numpy import Transformer, TransformerConfig, beam_search, greedy_decode, init_params
from reference_numpy.decoding import penalize

PAD, BOS, EOS, A, B = 0, 1, 2, 3, 4


def seeded_script(prefix):
    """A fixed pseudo-random distribution over (pad, bos, eos, a, b) for every prefix."""
    rng = np.random.default_rng(zlib.crc32(repr(prefix).encode()))
    return rng.dirichlet(np.ones(5))


def test_greedy_takes_the_best_token_and_breaks_ties_to_the_lowest_id():
    model = ScriptedModel(lambda prefix: np.array([0.1, 0.1, 0.1, 0.35, 0.35]) if len(prefix) < 2
                          else np.array([0.0, 0.0, 1.0, 0.0, 0.0]))
    np.testing.assert_array_equal(greedy_decode(model, np.array([[A, B]])), [[A, A, EOS]])


def test_greedy_never_emits_pad_or_bos():
    model = ScriptedModel(lambda prefix: np.array([0.4, 0.4, 0.1, 0.05, 0.05]))
    np.testing.assert_array_equal(greedy_decode(model, np.array([[A]])), [[EOS]])


def test_maximum_output_length_is_input_length_plus_50():
    never_ends = ScriptedModel(lambda prefix: np.array([0.0, 0.0, 0.0, 1.0, 0.0]), max_len=1000)
    src = np.array([[A, B, A, PAD, PAD], [A, PAD, PAD, PAD, PAD]])
    out = greedy_decode(never_ends, src)
    assert (out != PAD).sum(axis=1).tolist() == [53, 51]
    tokens, _ = beam_search(never_ends, src)
    assert (tokens != PAD).sum(axis=1).tolist() == [53, 51]


def test_maximum_output_length_is_capped_by_max_len():
    never_ends = ScriptedModel(lambda prefix: np.array([0.0, 0.0, 0.0, 1.0, 0.0]), max_len=20)
    assert greedy_decode(never_ends, np.array([[A, B]])).shape == (1, 20)


def test_finished_rows_are_padded():
    model = ScriptedModel(lambda prefix: np.array([0, 0, 1.0, 0, 0]) if prefix[:1] == (B,) or len(prefix) == 3
                          else np.array([0, 0, 0, 0.6, 0.4]))
    np.testing.assert_array_equal(greedy_decode(model, np.array([[A]])), [[A, A, A, EOS]])


def gnmt_score(log_prob, length, alpha=0.6):
    return log_prob / ((5 + length) / 6) ** alpha


def exhaustive_best(script, limit):
    """Every hypothesis: tokens from {a, b} then eos at step n <= limit, or `limit` tokens without eos."""
    best = None
    for n in range(1, limit + 1):
        for body in itertools.product((A, B), repeat=n - 1):
            endings = [(*body, EOS)] + ([(*body, A), (*body, B)] if n == limit else [])
            for hypothesis in endings:
                log_prob = sum(np.log(script(hypothesis[:t]))[hypothesis[t]] for t in range(len(hypothesis)))
                score = gnmt_score(log_prob, len(hypothesis))
                if best is None or score > best[0]:
                    best = (score, list(hypothesis))
    return best


@pytest.mark.parametrize("max_len", [1, 2, 3, 4, 5])
def test_wide_beam_finds_the_exhaustive_optimum_of_the_length_penalized_score(max_len):
    model = ScriptedModel(seeded_script, max_len=max_len)
    tokens, scores = beam_search(model, np.array([[A, B]]), beam_size=256)
    score, hypothesis = exhaustive_best(seeded_script, max_len)
    assert tokens[0].tolist() == hypothesis
    assert_agrees(scores[0], score, what="beam score vs exhaustive search")


def test_beam_of_one_is_greedy():
    model = ScriptedModel(seeded_script, max_len=8)
    src = np.array([[A, B, A]])
    np.testing.assert_array_equal(beam_search(model, src, beam_size=1)[0], greedy_decode(model, src))


def test_equal_scores_go_to_the_earlier_lower_ranked_hypothesis():
    def script(prefix):
        if not prefix:
            return np.array([0, 0, 1e-9, 0.5, 0.5])                           # a and b tie
        return np.array([0, 0, 0.9, 0.05, 0.05])                              # then eos, equally likely
    tokens, _ = beam_search(ScriptedModel(script), np.array([[A]]))
    assert tokens[0].tolist() == [A, EOS]


def test_eos_outside_the_first_beam_size_ranks_does_not_finish():
    """[eos] scores log(0.2) = -1.609; every two-token hypothesis scores at most
    (log 0.45 + log 0.34) / lp(2) = -1.712. [eos] ranks third at step 1."""
    def script(prefix):
        return np.array([0, 0, 0.2, 0.45, 0.35]) if not prefix else np.array([0, 0, 0.34, 0.33, 0.33])
    model = ScriptedModel(script, max_len=2)
    assert beam_search(model, np.array([[A]]), beam_size=3)[0][0].tolist() == [EOS]
    assert beam_search(model, np.array([[A]]), beam_size=2)[0][0].tolist() == [A, EOS]


@pytest.mark.parametrize("beam_size", [0, True, 2.0])
def test_beam_size_is_validated(beam_size):
    with pytest.raises(ValueError, match="beam_size must be a positive int"):
        beam_search(ScriptedModel(seeded_script), np.array([[A]]), beam_size=beam_size)


def test_impossible_candidates_never_become_beams():
    """Vocabulary of 5 and beam 4: only a and b can continue, so step 1 leaves two live beams,
    and no hypothesis ever contains pad or bos."""
    tokens, scores = beam_search(ScriptedModel(seeded_script, max_len=3), np.array([[A]]), beam_size=4)
    assert np.isfinite(scores).all() and set(tokens[0].tolist()) <= {A, B, EOS, PAD}


def test_a_search_that_finishes_no_hypothesis_gives_the_empty_output_scored_minus_inf():
    """Every token but pad and bos impossible at step 1, and those two never emitted: no beam lives, none finishes;
    the search's result is the empty output with score -inf (what every port gives, the fuzzer compares)."""
    config = ScriptedModel(seeded_script).config
    only_specials = lambda prefix: np.eye(5)[[config.pad_id, config.bos_id]].sum(axis=0) / 2
    tokens, scores = beam_search(ScriptedModel(only_specials, max_len=3), np.array([[A]]), beam_size=2)
    assert tokens.shape == (1, 0) and scores.tolist() == [-np.inf]


def test_real_model_decoding_is_deterministic_and_well_formed():
    config = VARIANTS["tiny"]
    model = Transformer(config, init_params(config, seed=2, perturb=0.1))
    src = np.array([[5, 6, 7, 2], [8, 2, 0, 0]])
    first, second = greedy_decode(model, src), greedy_decode(model, src)
    np.testing.assert_array_equal(first, second)
    tokens, scores = beam_search(model, src)
    assert np.isfinite(scores).all() and not np.isin(tokens[:, :1], [config.pad_id, config.bos_id]).any()


# ----------------------------------------------------------------------------- the repetition penalty

@pytest.mark.parametrize("penalty, expected", [
    (2.0, [[0.5, -1.0, 0.0, 1.5, -np.inf, 2.0], [1.0, -2.0, 0.0, 3.0, -np.inf, 2.0]]),
    (0.5, [[2.0, -1.0, 0.0, 6.0, -np.inf, 2.0], [1.0, -0.5, 0.0, 3.0, -np.inf, 2.0]]),
    (1.0, [[1.0, -1.0, 0.0, 3.0, -np.inf, 2.0], [1.0, -1.0, 0.0, 3.0, -np.inf, 2.0]])])
def test_the_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_seen_tokens(penalty, expected):
    """Written out by hand: at step 4 row 0 has seen 3 (its start token), 0 (twice: once counted) and 4 (-inf stays
    -inf), not 5 (beyond the prefix); row 1 has seen 1, 2 and 4 (0 stays 0). A penalty below 1 raises what it
    touches; 1 touches nothing."""
    config = TransformerConfig(src_vocab_size=6, tgt_vocab_size=6, d_model=2, n_heads=1, d_ff=2, n_encoder_layers=1,
                               n_decoder_layers=1).with_decoding(repetition_penalty=penalty)
    scores = np.array([[1.0, -1.0, 0.0, 3.0, -np.inf, 2.0]] * 2)
    history = np.array([[3, 0, 0, 4, 5, 0], [1, 2, 4, 2, 0, 3]])
    np.testing.assert_array_equal(penalize(config, scores, history, 4), expected)
    np.testing.assert_array_equal(scores, [[1.0, -1.0, 0.0, 3.0, -np.inf, 2.0]] * 2)      # not in place


class _Logits:
    """A scripted generator: ``logits`` the script's, its call their log-softmax (as the model's Generator)."""

    def __init__(self, script):
        self.script = script

    def logits(self, hidden):
        return np.stack([self.script(tuple(int(t) for t in prefix[1:])) for prefix in hidden[:, -1]])[:, None, :]

    def __call__(self, hidden):
        logits = self.logits(hidden)
        return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def test_greedy_penalizes_the_logits_and_beam_search_the_log_probabilities():
    """transformers' greedy search penalizes the logits, its beam search their log-softmax, and the two choose
    differently. After A, the logits (A 2, B 1, the rest -10) penalized 4 times: greedy reads A 2 / 4 = 0.5 < B's 1
    and writes B; beam search (one beam) reads log p(A) = -0.3133 x 4 = -1.253 > log p(B) = -1.3133 and writes A.
    Without the penalty both write A."""
    def script(prefix):
        if len(prefix) == 0:
            return np.array([-10.0, -10.0, -10.0, 3.0, 0.0])
        if len(prefix) == 1:
            return np.array([-10.0, -10.0, -10.0, 2.0, 1.0])
        return np.array([-10.0, -10.0, 10.0, 0.0, 0.0])

    def model(penalty):
        scripted = ScriptedModel(script)
        scripted.config = scripted.config.with_decoding(repetition_penalty=penalty)
        scripted.generator = _Logits(script)
        return scripted

    src = np.array([[A, B]])
    np.testing.assert_array_equal(greedy_decode(model(4.0), src), [[A, B, EOS]])
    np.testing.assert_array_equal(beam_search(model(4.0), src, 1)[0], [[A, A, EOS]])
    np.testing.assert_array_equal(greedy_decode(model(1.0), src), [[A, A, EOS]])
    np.testing.assert_array_equal(beam_search(model(1.0), src, 1)[0], [[A, A, EOS]])
