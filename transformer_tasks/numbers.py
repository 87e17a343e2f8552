"""A real translation task made offline: English number words to French number words.

Both sides are written by ``num2words`` from the same integer, so the pairs follow each language's real rules
("four hundred and ninety-seven" -> "quatre cent quatre-vingt-dix-sept"; "eighty" -> "quatre-vingts" but
"eighty thousand" -> "quatre-vingt mille"; "seventy-one" -> "soixante et onze"). The integers run from 0 to
999,999.

Numbers come in kinds (:func:`zero_pattern`: which digits are zero, ``x00,00x`` is "one hundred thousand and
two"), and a kind is learned or missed as a whole; a uniform sample of the integers holds few of the rare kinds
(numbers of the pattern ``x00,00x`` are 81 in a million). So the split is stratified by pattern, fixed by
``SPLIT_SEED``: from every pattern of 81 numbers or more (all of 3 to 6 digits) a seeded shuffle puts
``min(TEST_PER_PATTERN, n // 8)`` numbers in the test set, ``min(VALIDATION_PER_PATTERN, n // 16)`` in the
validation set and the rest in the training pool, so no test or validation number ever occurs in training; the
numbers below 100 (the words of the languages) and the patterns of 9 numbers (``x00``, ``x,000``, ...) are all in
training. Training batch ``s`` is drawn from its own stream ``PCG64([seed, s])`` (a resumed run sees the batches
the uninterrupted run would have seen): each number, with probability 1/2 from a length of ``k`` digits chosen
with probability ``DIGIT_WEIGHTS[k] / sum`` (then uniformly among its numbers), otherwise from a pattern chosen
uniformly among the 64 (then uniformly among its numbers in the pool).

The tokenizer is a shared BPE vocabulary (section 5.1) learned from ``TOKENIZER_TEXTS`` training pairs, both
languages together; it is saved inside every checkpoint the ``train`` command writes for this task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import Tokenizer, pad_rows
from transformer_tasks.copy import TEST, VALIDATION  # the held-out splits every task names alike

SPLIT_SEED = 1706_03762                                    # the paper's arXiv number
DIGITS = range(1, 7)                                       # 0 .. 999,999
TEST_PER_PATTERN, VALIDATION_PER_PATTERN = 16, 8           # from each pattern of HELD_OUT_FROM numbers or more
HELD_OUT_FROM = 81
DIGIT_WEIGHTS = {1: 1, 2: 2, 3: 4, 4: 4, 5: 4, 6: 4}
TOKENIZER_TEXTS, VOCAB_SIZE = 20_000, 384
# The model and recipe of the shipped checkpoint (docs/training.md); training stops once greedy decoding translates
# STOP_AT of VALIDATION_SIZE validation numbers exactly, checked every EVAL_EVERY steps
DEFAULTS = dict(steps=3000, batch_size=128, warmup_steps=400, learning_rate_scale=0.5, stop_at=0.995, eval_every=250,
                validation_size=400)
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


def zero_pattern(number: int) -> str:
    """The kind of a number: its digits written as ``x`` (not zero) or ``0``, thousands apart -- 100002 is
    ``x00,00x`` ("one hundred thousand and two"), 971000 ``xxx,000``. Numbers of one pattern are written alike in
    both languages, so a pattern is what a model learns or misses as a whole (64 patterns from 0 to 999,999)."""
    return "".join("0" if digit == "0" else "x" if digit.isdigit() else digit for digit in f"{int(number):,}")


def patterns() -> dict[str, np.ndarray]:
    """Every integer from 0 to 999,999 by :func:`zero_pattern`, shortest patterns first."""
    numbers = np.arange(10 ** max(DIGITS))
    length = np.maximum(1, np.floor(np.log10(np.maximum(numbers, 1))).astype(int) + 1)
    nonzero = sum(((numbers // 10 ** k) % 10 != 0).astype(int) << k for k in range(max(DIGITS)))
    key = length * 2 ** max(DIGITS) + nonzero                                # the pattern, as one integer
    order = np.argsort(key, kind="stable")
    starts = np.flatnonzero(np.diff(key[order], prepend=-1))
    return {zero_pattern(group[0]): group for group in np.split(numbers[order], starts[1:])}


@dataclass(frozen=True)
class Split:
    """The test, validation and training numbers; the training pool by zero pattern."""

    test: np.ndarray
    validation: np.ndarray
    pool: dict[str, np.ndarray] = field(repr=False)

    @classmethod
    def make(cls, seed: int = SPLIT_SEED) -> Split:
        rng = np.random.Generator(np.random.PCG64(seed))
        test, validation, pool = [], [], {}
        for pattern, numbers in patterns().items():
            if len(numbers) >= HELD_OUT_FROM and numbers[0] >= 100:
                numbers = rng.permutation(numbers)
                n_test = min(TEST_PER_PATTERN, len(numbers) // 8)
                n_valid = min(VALIDATION_PER_PATTERN, len(numbers) // 16)
                test.append(numbers[:n_test])
                validation.append(numbers[n_test:n_test + n_valid])
                numbers = np.sort(numbers[n_test + n_valid:])
            pool[pattern] = numbers
        return cls(np.sort(np.concatenate(test)), np.sort(np.concatenate(validation)), pool)

    def held_out(self, split: str) -> np.ndarray:
        if split not in (TEST, VALIDATION):
            raise ValueError(f"split must be {TEST!r} or {VALIDATION!r}, got {split!r}")
        return self.test if split == TEST else self.validation

    @cached_property
    def _choices(self) -> tuple[list[str], np.ndarray]:
        """The pool's patterns and the probability of drawing each: half by ``DIGIT_WEIGHTS`` over lengths (a
        pattern then in proportion to its numbers), half uniform over patterns."""
        names = list(self.pool)
        sizes = np.array([len(self.pool[p]) for p in names], dtype=float)
        lengths = np.array([len(p.replace(",", "")) for p in names])
        by_length = np.array([DIGIT_WEIGHTS[k] for k in lengths], dtype=float)
        by_length *= sizes / np.array([sizes[lengths == k].sum() for k in lengths])
        return names, 0.5 * by_length / by_length.sum() + 0.5 / len(names)

    def training_numbers(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` training numbers: a pattern by :attr:`_choices`, then a number of it from the pool."""
        names, p = self._choices
        chosen = rng.choice(len(names), size=count, p=p)
        return np.array([self.pool[names[i]][rng.integers(len(self.pool[names[i]]))] for i in chosen])


@dataclass(frozen=True)
class NumbersTask:
    """English number words to French number words, for ``train --task numbers``. ``tokenizer`` is the run's
    (from its checkpoint when resuming); by default one is learned from the training pool."""

    tokenizer: Tokenizer | None = None
    name: str = "numbers"

    @cached_property
    def split(self) -> Split:
        return Split.make()

    @property
    def learned(self) -> Tokenizer:
        return learned_tokenizer(self.tokenizer, self.name)

    def config(self, **changes: Any) -> TransformerConfig:
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
        return teacher_forcing(self.learned, sources, targets)

    def held_out_batch(self, config: TransformerConfig, count: int, split: str,
                       seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
        """``count`` pairs of the test or validation set (the same ones whatever ``seed``: the split is fixed):
        teacher-forced (src (B, S), tgt and labels (B, T)) and the French references."""
        numbers = self.split.held_out(split)
        if not 1 <= count <= len(numbers):
            raise ValueError(f"the {split} set holds {len(numbers)} pairs; {count} were asked for (at least 1)")
        numbers = numbers[np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(len(numbers))[:count]]
        sources, targets = self.pairs(numbers)
        return teacher_forcing(self.learned, sources, targets), targets

    def held_out(self, config: TransformerConfig, count: int, split: str, seed: int) -> tuple[np.ndarray, list[str]]:
        """Source ids (B, S) and French references of :meth:`held_out_batch`."""
        batch, references = self.held_out_batch(config, count, split, seed)
        return batch["src"], references

    def held_out_size(self, split: str) -> int:
        """The pairs the test or validation set holds (the split is fixed)."""
        return len(self.split.held_out(split))

    def score(self, config: TransformerConfig, decoded: np.ndarray, references: list[str]) -> dict[str, float]:
        """Exact match (the whole French text) and corpus BLEU (sacrebleu, its default 13a tokenisation)."""
        hypotheses = [self.learned.decode(row) for row in decoded]
        return {"exact": float(np.mean([h == r for h, r in zip(hypotheses, references)])),
                "bleu": bleu(hypotheses, references)}


def learned_tokenizer(tokenizer: Tokenizer | None, task: str) -> Tokenizer:
    """A task's tokenizer, which its batches and scores need: its ``with_tokenizer`` learns one."""
    if tokenizer is None:
        raise ValueError(f"the {task} task has no tokenizer yet: with_tokenizer learns one")
    return tokenizer


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
