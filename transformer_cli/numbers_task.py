"""A real translation task made offline: English number words to French number words.

Both sides are written by ``num2words`` from the same integer, so the pairs follow each language's real rules
("four hundred and ninety-seven" -> "quatre cent quatre-vingt-dix-sept"; "eighty" -> "quatre-vingts" but
"eighty thousand" -> "quatre-vingt mille"; "seventy-one" -> "soixante et onze"). The integers run from 0 to
999,999.

The split is fixed by ``SPLIT_SEED``: for each length of 3 to 6 digits, a seeded shuffle puts the first numbers in
the test set, the next in the validation set and the rest in the training pool, so no test or validation number
ever occurs in training. The 100 numbers below 100 are the words of the languages and are all in training.
Training batch ``s`` is drawn from its own stream ``PCG64([seed, s])`` (a resumed run sees the batches the
uninterrupted run would have seen): a length of ``k`` digits with probability ``DIGIT_WEIGHTS[k] / sum``, then a
number of that length from the pool.

The tokenizer is a shared BPE vocabulary (section 5.1) learned from ``TOKENIZER_TEXTS`` training pairs, both
languages together; it is saved inside every checkpoint the ``train`` command writes for this task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import Tokenizer, pad_rows

from .copy_task import TEST, VALIDATION  # the held-out splits every task names alike

SPLIT_SEED = 1706_03762                                    # the paper's arXiv number
DIGITS = range(1, 7)                                       # 0 .. 999,999
HELD_OUT_DIGITS = (3, 4, 5, 6)
TEST_PER_LENGTH, VALIDATION_PER_LENGTH = 250, 125          # a test set of 1,000 numbers, a validation set of 500
DIGIT_WEIGHTS = {1: 1, 2: 2, 3: 4, 4: 4, 5: 4, 6: 4}
TOKENIZER_TEXTS, VOCAB_SIZE = 20_000, 384
# The model and recipe of the shipped checkpoint (docs/training.md); training stops once greedy decoding translates
# STOP_AT of VALIDATION_SIZE validation numbers exactly, checked every EVAL_EVERY steps
DEFAULTS = dict(steps=3000, batch_size=128, warmup_steps=400, learning_rate_scale=0.5, stop_at=0.998, eval_every=250,
                validation_size=500)
MODEL = dict(d_model=128, n_heads=4, d_ff=512, n_encoder_layers=3, n_decoder_layers=3, max_len=64,
             share_embeddings=True, dropout=0.0)


def english(number: int) -> str:
    return _num2words()(int(number), lang="en")


def french(number: int) -> str:
    return _num2words()(int(number), lang="fr")


def _num2words():
    try:
        from num2words import num2words
    except ModuleNotFoundError:
        raise ValueError("the numbers task needs num2words: pip install 'transformer-reference[text]'") from None
    return num2words


def numbers_of_length(digits: int) -> np.ndarray:
    """Every integer written with ``digits`` digits (0 counts as one digit)."""
    return np.arange(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits)


@dataclass(frozen=True)
class Split:
    """The test, validation and training numbers; the training pool by number of digits."""

    test: np.ndarray
    validation: np.ndarray
    pool: dict[int, np.ndarray] = field(repr=False)

    @classmethod
    def make(cls, seed: int = SPLIT_SEED) -> Split:
        rng = np.random.Generator(np.random.PCG64(seed))
        test, validation, pool = [], [], {}
        for digits in DIGITS:
            numbers = numbers_of_length(digits)
            if digits in HELD_OUT_DIGITS:
                numbers = rng.permutation(numbers)
                test.append(numbers[:TEST_PER_LENGTH])
                validation.append(numbers[TEST_PER_LENGTH:TEST_PER_LENGTH + VALIDATION_PER_LENGTH])
                numbers = np.sort(numbers[TEST_PER_LENGTH + VALIDATION_PER_LENGTH:])
            pool[digits] = numbers
        return cls(np.concatenate(test), np.concatenate(validation), pool)

    def held_out(self, split: str) -> np.ndarray:
        if split not in (TEST, VALIDATION):
            raise ValueError(f"split must be {TEST!r} or {VALIDATION!r}, got {split!r}")
        return self.test if split == TEST else self.validation

    def training_numbers(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` training numbers: a length by ``DIGIT_WEIGHTS``, then a number of that length."""
        digits = np.array(list(DIGITS))
        weights = np.array([DIGIT_WEIGHTS[d] for d in digits], dtype=float)
        lengths = rng.choice(digits, size=count, p=weights / weights.sum())
        return np.array([self.pool[k][rng.integers(len(self.pool[k]))] for k in lengths])


@dataclass(frozen=True)
class NumbersTask:
    """English number words to French number words, for ``train --task numbers``. ``tokenizer`` is the run's
    (from its checkpoint when resuming); by default one is learned from the training pool."""

    tokenizer: Tokenizer | None = None
    name: str = "numbers"

    @cached_property
    def split(self) -> Split:
        return Split.make()

    def config(self, **changes) -> TransformerConfig:
        """The model of ``MODEL`` over the tokenizer's vocabulary (shared source/target, section 5.1)."""
        return TransformerConfig(**{"src_vocab_size": VOCAB_SIZE, "tgt_vocab_size": VOCAB_SIZE, **MODEL, **changes})

    def with_tokenizer(self, config: TransformerConfig) -> NumbersTask:
        """This task with a tokenizer learned from ``TOKENIZER_TEXTS`` training pairs for ``config``."""
        if self.tokenizer is not None:
            return self
        numbers = self.split.training_numbers(TOKENIZER_TEXTS, np.random.Generator(np.random.PCG64(SPLIT_SEED)))
        texts = [text for n in numbers for text in (english(n), french(n))]
        return NumbersTask(Tokenizer.train(texts, config.src_vocab_size, config))

    def pairs(self, numbers: np.ndarray) -> tuple[list[str], list[str]]:
        return [english(n) for n in numbers], [french(n) for n in numbers]

    def batch(self, config: TransformerConfig, batch_size: int, step: int, seed: int) -> dict[str, np.ndarray]:
        """The training batch of step ``step`` (0-based): src (B, S), tgt and labels (B, T)."""
        numbers = self.split.training_numbers(batch_size, np.random.Generator(np.random.PCG64([seed, step])))
        sources, targets = self.pairs(numbers)
        return teacher_forcing(self.tokenizer, sources, targets)

    def held_out_batch(self, config: TransformerConfig, count: int, split: str,
                       seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
        """``count`` pairs of the test or validation set (the same ones whatever ``seed``: the split is fixed):
        teacher-forced (src (B, S), tgt and labels (B, T)) and the French references."""
        numbers = self.split.held_out(split)
        if not 1 <= count <= len(numbers):
            raise ValueError(f"the {split} set holds {len(numbers)} pairs; {count} were asked for (at least 1)")
        numbers = numbers[np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(len(numbers))[:count]]
        sources, targets = self.pairs(numbers)
        return teacher_forcing(self.tokenizer, sources, targets), targets

    def held_out(self, config: TransformerConfig, count: int, split: str, seed: int) -> tuple[np.ndarray, list[str]]:
        """Source ids (B, S) and French references of :meth:`held_out_batch`."""
        batch, references = self.held_out_batch(config, count, split, seed)
        return batch["src"], references

    def held_out_size(self, split: str) -> int:
        """The pairs the test or validation set holds (the split is fixed)."""
        return len(self.split.held_out(split))

    def score(self, config: TransformerConfig, decoded: np.ndarray, references: list[str]) -> dict[str, float]:
        """Exact match (the whole French text) and corpus BLEU (sacrebleu, its default 13a tokenisation)."""
        hypotheses = [self.tokenizer.decode(row) for row in decoded]
        return {"exact": float(np.mean([h == r for h, r in zip(hypotheses, references)])),
                "bleu": bleu(hypotheses, references)}


def bleu(hypotheses: list[str], references: list[str]) -> float:
    try:
        import sacrebleu
    except ModuleNotFoundError:
        raise ValueError("BLEU needs sacrebleu: pip install 'transformer-reference[text]'") from None
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def teacher_forcing(tokenizer: Tokenizer, sources: list[str], targets: list[str]) -> dict[str, np.ndarray]:
    """src = ids + eos; tgt = bos + ids (the output embeddings offset by one, section 3.1); labels = ids + eos."""
    config = tokenizer.config
    target_ids = [tokenizer.encode(text, "target") for text in targets]
    return {"src": tokenizer.batch(sources, "source"),
            "tgt": pad_rows([[config.bos_id, *ids] for ids in target_ids], config.pad_id),
            "labels": pad_rows([[*ids, config.eos_id] for ids in target_ids], config.pad_id)}
