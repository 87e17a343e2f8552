"""The shipped model's held-out sentences and the float64 reference's answers on them, shared by the exporters' tests
(tests/export/) and the export command's (tests/cli/): the artefacts and compiled programs are held to these."""

from __future__ import annotations

import functools

import numpy as np

from equivalence import tolerance
from equivalence.margins import beam_margins
from reference_numpy import Transformer, beam_search, greedy_decode
from reference_numpy.checkpoint import load_checkpoint
from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA
from reference_numpy.tokenizer import pad_rows
from transformer_tasks.numbers import NumbersTask, english, french
from transformer_tasks.translation import SHIPPED, load_translator

SHIPPED_TEXTS = 32                 # held-out sentences of the shipped model, every length of the test split


# Number words in no English number's order, on which the shipped model's beam search (size 4, alpha 0.6) and greedy
# decoding part (on the held-out sentences they agree): "treize" against greedy's "treize mille huit".
BEAM_TEXTS = ("thirteen seventy thirteen eight three", "sixty and thirteen thirty and",
              "six twelve thirty hundred four seventy", "ten thirteen thirteen seventy thirteen hundred",
              "four fifty hundred eight seven seventy", "eleven five thirteen and", "six ten twenty seventy eighty and")


def shipped_numbers() -> np.ndarray:
    """Numbers spread over the shipped model's test split (3 to 6 digits)."""
    numbers = NumbersTask().split.held_out("test")
    return numbers[::len(numbers) // SHIPPED_TEXTS][:SHIPPED_TEXTS]


def shipped_texts() -> list[str]:
    return [english(n) for n in shipped_numbers()]


@functools.cache
def reference_greedy() -> np.ndarray:
    """The float64 reference's ``greedy_decode`` tokens on :func:`shipped_texts`."""
    config, params, tokenizer = load_translator()
    return greedy_decode(Transformer(config, params), tokenizer.batch(shipped_texts()))


@functools.cache
def shipped_batches() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """A ragged batch of 8 held-out sentences (src = ids + eos, tgt = bos + the French ids, both right-padded),
    and one sentence with a target of one position (bos): a batch and lengths no export was traced with."""
    config, _, tokenizer = load_translator()
    numbers = shipped_numbers()[::4]
    src = tokenizer.batch([english(n) for n in numbers])
    tgt = pad_rows([[config.bos_id, *tokenizer.encode(french(n))] for n in numbers], config.pad_id)
    return (src, tgt), (src[-1:, :int((src[-1] != config.pad_id).sum())], tgt[:1, :1])


@functools.cache
def reference_log_probs() -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """The float64 and the float32 reference's log-probabilities on each of :func:`shipped_batches`."""
    config, params = load_checkpoint(SHIPPED)
    models = Transformer(config, params), Transformer(config, params, np.float32)
    return tuple((models[0](src, tgt), models[1](src, tgt)) for src, tgt in shipped_batches())


def check_against_reference(target: str, log_probs: list[np.ndarray], agreement) -> None:
    for i, ((src, tgt), out, (ref64, ref32)) in enumerate(zip(shipped_batches(), log_probs, reference_log_probs())):
        agreement(out, ref64, ref32, port=target, device="cpu", dtype="float32",
                  what=f"log-probs of the exported forward pass: shipped model, batch {i} {src.shape} {tgt.shape}")


def beam_source() -> np.ndarray:
    """:func:`shipped_texts` and :data:`BEAM_TEXTS` as source ids."""
    return load_translator()[2].batch([*shipped_texts(), *BEAM_TEXTS])


@functools.cache
def reference_beams() -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference's beam-4 tokens on :func:`beam_source`, and which rows the float32 token rule compares
    whole (no near-tie: ``tolerance.beam_row_is_decisive`` with the float32 bound of the log-probabilities along
    them; one held-out sentence has a step margin of 3e-4 against 7.7e-4), after checking that those include every
    row of :data:`BEAM_TEXTS` and that there beam search parts from greedy decoding."""
    config, params, _ = load_translator()
    model64, model32, src = Transformer(config, params), Transformer(config, params, np.float32), beam_source()
    tokens = beam_search(model64, src, BEAM_SIZE, LENGTH_PENALTY_ALPHA)[0]
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), tokens[:, :-1]], axis=1)
    bound = tolerance.float32_bound(model64(src, tgt), model32(src, tgt))
    decisive = np.array([tolerance.beam_row_is_decisive(row, bound) for row in beam_margins(model64, src)])
    greedy = greedy_decode(model64, src)
    assert decisive[-len(BEAM_TEXTS):].all() and decisive.sum() >= len(src) - 2
    assert all(not np.array_equal(greedy[i], tokens[i]) for i in range(len(src) - len(BEAM_TEXTS), len(src)))
    return tokens, decisive

