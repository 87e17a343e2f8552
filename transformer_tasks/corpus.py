"""A user's parallel corpus, for ``train --source SRC.txt --target TGT.txt`` (or ``--corpus PAIRS.tsv``).

**Files.** One sentence per line, UTF-8, line ``i`` of the source file translating line ``i`` of the target file
(or a file of two tab-separated columns, source then target), read as every command reads a text file
(:mod:`transformer_tasks.textfiles`: a line ends at LF, CRLF or a lone CR; a byte-order mark at the start is dropped);
a line empty on both sides is skipped, a line empty on one side only is refused. Every problem -- a missing file,
line counts that differ, a line that is not UTF-8, an empty side, a row of the wrong number of columns, characters
the tokenizer never saw, a sentence longer than the model's ``max_len`` or the batch budget after BPE -- is one
``ValueError`` naming the flag, the file and the line, raised before any training.

**Split.** Without ``--valid-source/--valid-target``, ``--valid-size`` pairs (default ``min(1000, 5%)``) are held
out for validation by a shuffle seeded with ``SPLIT_SEED`` (the same split whatever ``--seed``, so runs of several
seeds validate on the same pairs). The corpus has no test set: ``train`` scores the validation set at the end too
(the ``evaluate`` command scores a test file).

**Tokenizer.** One BPE vocabulary for both languages (section 5.1), learned with Hugging Face ``tokenizers`` from
the training pairs (``--vocab-size`` at most; the model's vocabulary is what was learned) and saved inside every
checkpoint of the run; a resumed run uses its checkpoint's, and a fine-tune (``train --init``) its checkpoint's, the
project's BPE or an imported Hugging Face family's (:class:`transformer_hf.tokenizers.FamilyTokenizer`).

**Sequences** (transformers' convention for a seq2seq model's training, which the project's is a case of): the
source is the tokenizer's ids of the source sentence (``input_ids``: the project's BPE its pieces and eos; a family's
with its language codes); the labels are the target sentence's (``text_target``'s ``labels``: its pieces and eos,
M2M100/NLLB's target language code first); the decoder reads the labels shifted right by one, the model's start
token first (transformers' ``shift_tokens_right`` with ``decoder_start_token_id``, ``config.start_id``: the bos of
section 3.1's "output embeddings are offset by one position", Marian's pad, M2M100/NLLB's eos).

**Batches** (section 5.1: "Sentence pairs were batched together by approximate sequence length. Each training
batch contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target tokens").
A batch holds at most ``--tokens-per-batch`` positions in its source tensor and in its target tensor, padding
included (rows times the longest row, eos or bos counted). Epoch ``e`` shuffles the training pairs with the stream
``PCG64([seed, e])``, sorts them by length (the longer side, then the source, then the target: a stable sort, so
equal lengths stay in shuffled order), cuts the sorted list into the fewest consecutive batches under the budget,
and shuffles the batches' order with the same stream. Every pair is in exactly one batch of each epoch, and every
epoch has as many batches (the sorted lengths are the same), so step ``s`` is batch ``s mod n`` of epoch
``s div n``: a resumed run sees the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import Tokenizer, teacher_forcing
from transformer_hf.tokenizers import FamilyTokenizer
from transformer_tasks.copy import TEST, VALIDATION  # the held-out splits every task names alike
from transformer_tasks.numbers import MODEL as NUMBERS_MODEL
from transformer_tasks.numbers import SPLIT_SEED, bleu, learned_tokenizer
from transformer_tasks.textfiles import read_lines

VALIDATION_SHARE, VALIDATION_MOST = 0.05, 1000     # the held-out split's default size: min(1000, 5%)
VOCAB_SIZE = 8000                                  # --vocab-size's default
MODEL = {**NUMBERS_MODEL, "max_len": 256}          # the default model: the numbers task's, longer sentences
# The recipe (--steps, --tokens-per-batch, ...): the numbers task's optimizer settings; validation every EVAL_EVERY
# steps, never stopping early unless --stop-at asks; validation_size None: min(1000, 5%) of the corpus
DEFAULTS = dict(steps=3000, tokens_per_batch=4096, warmup_steps=400, learning_rate_scale=0.5, stop_at=0.0,
                eval_every=500, validation_size=None)
FILES = ("source", "target", "corpus", "valid_source", "valid_target")           # the flags naming its files
FLAGS = (*FILES, "vocab_size", "tokens_per_batch", "preset")                       # the flags of this task only


@dataclass(frozen=True)
class Pairs:
    """Sentence pairs read from files, each with the line it came from (for errors)."""

    sources: list[str]
    targets: list[str]
    lines: list[int]
    names: tuple[str, str]                         # each side's flag and file, e.g. "--source 'train.en'"
    columns: tuple[str, str] = ("", "")            # each side's column in a two-column file

    def __len__(self) -> int:
        return len(self.sources)

    def at(self, line: int, side: int) -> str:
        """Line ``line`` of side ``side`` (0 source, 1 target) in words: flag, file, line (and column)."""
        return f"{self.names[side]} line {line}{self.columns[side]}"

    def where(self, row: int, side: int) -> str:
        """Where pair ``row``'s side ``side`` came from."""
        return self.at(self.lines[row], side)

    def subset(self, rows: Sequence[int] | np.ndarray) -> Pairs:
        pick = lambda items: [items[i] for i in rows]
        return replace(self, sources=pick(self.sources), targets=pick(self.targets), lines=pick(self.lines))


def read_parallel(source: str, target: str, flags: tuple[str, str] = ("--source", "--target")) -> Pairs:
    """The pairs of a source file and a target file of as many lines."""
    sides = [read_lines(path, flag) for path, flag in zip((source, target), flags)]
    if len(sides[0]) != len(sides[1]):
        raise ValueError(f"{flags[1]} {target!r}: {len(sides[1])} lines, but {flags[0]} {source!r} has "
                         f"{len(sides[0])}; line i of one translates line i of the other")
    return pairs_of(sides[0], sides[1], (f"{flags[0]} {source!r}", f"{flags[1]} {target!r}"))


def read_columns(path: str, flag: str = "--corpus") -> Pairs:
    """The pairs of a file of two tab-separated columns, source then target."""
    rows = read_lines(path, flag)
    for number, row in enumerate(rows, 1):
        if row.strip() and row.count("\t") != 1:
            raise ValueError(f"{flag} {path!r} line {number}: {row.count(chr(9)) + 1} tab-separated columns; a "
                             "corpus file has 2, the source sentence and its translation")
    sides = list(zip(*(row.split("\t") if row.strip() else ("", "") for row in rows))) or [(), ()]
    return pairs_of(list(sides[0]), list(sides[1]), (f"{flag} {path!r}",) * 2, (", column 1", ", column 2"))


def pairs_of(sources: list[str], targets: list[str], names: tuple[str, str],
             columns: tuple[str, str] = ("", "")) -> Pairs:
    """The pairs of two sides line by line: a line empty (or blank) on both sides is skipped, on one side refused."""
    pairs = Pairs([], [], [], names, columns)
    for number, sentences in enumerate(zip(sources, targets), 1):
        empty = [not text.strip() for text in sentences]
        if any(empty) and not all(empty):
            side = empty.index(True)
            raise ValueError(f"{pairs.at(number, side)}: empty, but its translation "
                             f"({pairs.at(number, 1 - side)}) is not")
        if not any(empty):
            pairs.sources.append(sentences[0])
            pairs.targets.append(sentences[1])
            pairs.lines.append(number)
    if not pairs.sources:
        raise ValueError(f"{names[0]}: holds no sentence pair")
    return pairs


def read_corpus(source: str | None, target: str | None, corpus: str | None, valid_source: str | None,
                valid_target: str | None, valid_size: int | None) -> tuple[Pairs, Pairs]:
    """The training and validation pairs the flags name: ``--source``/``--target`` or ``--corpus``; the validation
    files, or ``valid_size`` pairs held out (:func:`held_out_split`)."""
    if corpus and (source or target):
        raise ValueError("--corpus: give either --corpus PAIRS.tsv or --source and --target, not both")
    if not corpus and not (source and target):
        raise ValueError(f"--{'target' if source else 'source'}: a corpus is --source SRC.txt and --target TGT.txt "
                         "(one sentence per line), or --corpus PAIRS.tsv")
    if bool(valid_source) != bool(valid_target):
        raise ValueError(f"--{'valid-target' if valid_source else 'valid-source'}: a validation set is "
                         "--valid-source and --valid-target together")
    if corpus:
        pairs = read_columns(corpus)
    else:
        assert source and target                           # the check above
        pairs = read_parallel(source, target)
    if not (valid_source and valid_target):
        return held_out_split(pairs, valid_size)
    if valid_size is not None:
        raise ValueError(f"--valid-size {valid_size}: the validation set is --valid-source's; leave the flag out")
    return pairs, read_parallel(valid_source, valid_target, ("--valid-source", "--valid-target"))


def held_out_split(pairs: Pairs, size: int | None) -> tuple[Pairs, Pairs]:
    """The pairs to train on and ``size`` pairs held out (default ``min(1000, 5%)``), chosen by a shuffle seeded
    with ``SPLIT_SEED``; each part keeps the file's order."""
    if size is None:
        size = min(VALIDATION_MOST, max(1, round(VALIDATION_SHARE * len(pairs))))
    if size >= len(pairs):
        raise ValueError(f"--valid-size {size}: the corpus holds {len(pairs)} pairs and at least one must be left "
                         "to train on")
    held = np.zeros(len(pairs), dtype=bool)
    held[np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(len(pairs))[:size]] = True
    return pairs.subset(np.flatnonzero(~held)), pairs.subset(np.flatnonzero(held))


@dataclass(frozen=True)
class CorpusTask:
    """A user's parallel corpus, for ``train``: its training and validation pairs, the shared tokenizer (learned by
    :meth:`with_tokenizer`, or a resumed run's), the model (``preset``: a preset's sizes; None: ``MODEL``). The
    sentences' ids (:meth:`fitted`) are ready once the model is known."""

    training: Pairs
    validation: Pairs
    tokenizer: Tokenizer | FamilyTokenizer | None = None
    preset: str | None = None
    name: str = "corpus"
    ids: tuple = field(default=(), repr=False)                  # (training, validation), each (sources, targets)
    epochs: dict = field(default_factory=dict, repr=False, compare=False)   # the latest epochs' batches

    def model(self, vocab_size: int, **changes: Any) -> TransformerConfig:
        """The model over a shared vocabulary of ``vocab_size`` ids: one embedding matrix for source, target and
        the output projection (section 3.4)."""
        sizes = dict(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True, **changes)
        if self.preset:
            return TransformerConfig.preset(self.preset, **sizes)
        return TransformerConfig(**{**MODEL, **sizes})

    def config(self, **changes: Any) -> TransformerConfig:
        """The model over the learned tokenizer's vocabulary (a family's tokenizer comes with its checkpoint's
        model, ``train --init``)."""
        tokenizer = self.learned
        assert isinstance(tokenizer, Tokenizer), "an imported tokenizer's model is its checkpoint's"
        return self.model(tokenizer.vocab_size, **changes)

    @property
    def learned(self) -> Tokenizer | FamilyTokenizer:
        return self.tokenizer if isinstance(self.tokenizer, FamilyTokenizer) else \
            learned_tokenizer(self.tokenizer, self.name)

    @property
    def forced_bos_id(self) -> int | None:
        """The token decoding must emit first (M2M100/NLLB's target language), None for the project's BPE."""
        return getattr(self.tokenizer, "forced_bos_id", None)

    def with_tokenizer(self, vocab_size: int) -> CorpusTask:
        """This task with a BPE vocabulary of at most ``vocab_size`` ids learned from the training pairs, both
        languages together (section 5.1)."""
        texts = [*self.training.sources, *self.training.targets]
        learned = Tokenizer.train(texts, vocab_size, self.model(vocab_size), name="--vocab-size")
        return replace(self, tokenizer=Tokenizer.from_json(learned.to_json(), self.model(learned.vocab_size)))

    def fitted(self, config: TransformerConfig, tokens_per_batch: int) -> CorpusTask:
        """This task with every sentence's ids, each checked: characters the tokenizer knows, at most
        ``config.max_len`` positions with its eos (or bos), and a training pair within one batch's budget."""
        ids = tuple(self.encode(pairs, config) for pairs in (self.training, self.validation))
        for row, width in enumerate(widths(*ids[0]).max(axis=1)):
            if width > tokens_per_batch:
                side = int(len(ids[0][1][row]) > len(ids[0][0][row]))
                raise ValueError(f"{self.training.where(row, side)}: {width} tokens after BPE (with its eos), more "
                                 f"than --tokens-per-batch {tokens_per_batch}, the positions a batch holds")
        return replace(self, ids=ids, epochs={})

    def encode(self, pairs: Pairs, config: TransformerConfig) -> tuple[list[list[int]], list[list[int]]]:
        """The sequences of every pair (sources, labels: the module's docstring), a ``ValueError`` naming the line
        of one the tokenizer cannot encode or the model cannot hold."""
        sides: tuple[list[list[int]], list[list[int]]] = ([], [])
        for row, texts in enumerate(zip(pairs.sources, pairs.targets)):
            for side, text in enumerate(texts):
                ids = self.sequence(text, pairs.where(row, side), ("source", "target")[side], config)
                if len(ids) > config.max_len:
                    raise ValueError(f"{pairs.where(row, side)}: {len(ids)} tokens after BPE (with its eos), "
                                     f"more than the model's max_len {config.max_len}")
                sides[side].append(ids)
        return sides

    def sequence(self, text: str, where: str, side: str, config: TransformerConfig) -> list[int]:
        """One sentence's ids, eos included: a family's ``input_ids`` (``side`` "source") or ``text_target``
        labels (:meth:`FamilyTokenizer.ids`), the project's BPE pieces and eos on either side."""
        tokenizer = self.learned
        ids = tokenizer.encode(text, where)                        # a blank text or unknown characters refused
        return tokenizer.ids(text, side) if isinstance(tokenizer, FamilyTokenizer) else [*ids, config.eos_id]

    def batch(self, config: TransformerConfig, tokens_per_batch: int, step: int, seed: int) -> dict[str, np.ndarray]:
        """The training batch of step ``step`` (0-based): src (B, S), tgt and labels (B, T), with B * S and B * T
        at most ``tokens_per_batch``."""
        epoch, index = divmod(step, len(self.epoch_batches(tokens_per_batch, 0, seed)))
        rows = self.epoch_batches(tokens_per_batch, epoch, seed)[index]
        sources, targets = self.ids[0]
        return teacher_forcing(config, [sources[i] for i in rows], [targets[i] for i in rows])

    def epoch_batches(self, tokens_per_batch: int, epoch: int, seed: int) -> list[np.ndarray]:
        """The training pairs' row indices, batch by batch, of epoch ``epoch`` (the module's docstring says how);
        epoch 0's and the latest epoch's are kept."""
        key = (tokens_per_batch, epoch, seed)
        if key not in self.epochs:
            rng = np.random.Generator(np.random.PCG64([seed, epoch]))
            batches = token_batches(widths(*self.ids[0]), tokens_per_batch, rng.permutation(len(self.training)))
            for old in [old for old in self.epochs if old[1]]:
                del self.epochs[old]
            self.epochs[key] = [batches[i] for i in rng.permutation(len(batches))]
        return self.epochs[key]

    def held_out_batch(self, config: TransformerConfig, count: int, split: str,
                       seed: int) -> tuple[dict[str, np.ndarray], list[str]]:
        """The first ``count`` validation pairs, teacher-forced (src, tgt, labels), and their references as the
        tokenizer normalises them (lower case: the text a translation can match). The corpus has no test set:
        ``split`` TEST names the validation set too."""
        if split not in (TEST, VALIDATION):
            raise ValueError(f"split must be {TEST!r} or {VALIDATION!r}, got {split!r}")
        if not 1 <= count <= len(self.validation):
            raise ValueError(f"the validation set holds {len(self.validation)} pairs; {count} were asked for "
                             "(at least 1)")
        sources, targets = self.ids[1]
        references = [self.reference(text) for text in self.validation.targets[:count]]
        return teacher_forcing(config, sources[:count], targets[:count]), references

    def reference(self, text: str) -> str:
        """A target sentence as a translation can match it: the project's BPE normalises (lower case), a family's
        decoding gives back the text."""
        tokenizer = self.learned
        return tokenizer.decode(tokenizer.ids(text, "target")) if isinstance(tokenizer, FamilyTokenizer) \
            else tokenizer.normalize(text)

    def held_out(self, config: TransformerConfig, count: int, split: str, seed: int) -> tuple[np.ndarray, list[str]]:
        """Source ids (B, S) and references of :meth:`held_out_batch`."""
        batch, references = self.held_out_batch(config, count, split, seed)
        return batch["src"], references

    def held_out_size(self, split: str) -> int:
        """The pairs the validation set holds (the test split names it too)."""
        return len(self.validation)

    def score(self, config: TransformerConfig, decoded: np.ndarray, references: list[str]) -> dict[str, float]:
        """Exact match (the whole normalised text) and corpus BLEU (sacrebleu, its default 13a tokenisation)."""
        hypotheses = [self.learned.decode(row) for row in decoded]
        return {"exact": float(np.mean([h == r for h, r in zip(hypotheses, references)])),
                "bleu": bleu(hypotheses, references)}


def widths(sources: list[list[int]], targets: list[list[int]]) -> np.ndarray:
    """Each pair's source and target positions in a batch (its sequences, eos included): (N, 2)."""
    return np.array([[len(s), len(t)] for s, t in zip(sources, targets)], dtype=np.int64).reshape(-1, 2)


def token_batches(widths: np.ndarray, budget: int, order: np.ndarray | None = None) -> list[np.ndarray]:
    """Rows batched by length under a budget (section 5.1). ``widths`` (N, 2) holds each row's source and target
    positions; the rows, taken in ``order`` (default: as given) and sorted stably by the longer side, then the
    source, then the target, are cut into the fewest consecutive batches whose rows times their longest side stay
    within ``budget`` (a row wider than the budget is a batch of its own). Returns each batch's row indices."""
    order = np.arange(len(widths)) if order is None else np.asarray(order)
    longest = widths.max(axis=1, initial=0)
    ranked = order[np.lexsort((widths[order, 1], widths[order, 0], longest[order]))]
    batches, start = [], 0
    for end in range(1, len(ranked)):
        if (end + 1 - start) * longest[ranked[end]] > budget:
            batches.append(ranked[start:end])
            start = end
    batches.append(ranked[start:])
    return batches


