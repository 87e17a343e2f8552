"""Sentences to sentences with a checkpoint's own tokenizer, in any backend (its adapter,
:mod:`equivalence.backends`): section 6.1's decoding (greedy, or beam search with a length penalty) of sentences
batched by similar length (sorted by source tokens, as section 5.1 batches training pairs), their order kept; a
sentence that cannot be encoded is reported with its line and gives an empty output. ``translate`` and ``evaluate``
run it on text files; the default checkpoint is the shipped model, English number words to French."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from multiprocessing.pool import ThreadPool
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from equivalence import backends, runtime
from reference_numpy import TransformerConfig, load_checkpoint
from reference_numpy.checkpoint import SHIPPED_MODELS
from reference_numpy.checks import check_token_layout
from reference_numpy.tokenizer import Tokenizer, pad_rows
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer

DEFAULT_MODEL = "numbers-en-fr"      # the shipped model a command runs when given none
SHIPPED = SHIPPED_MODELS[DEFAULT_MODEL]
SHIPPED_NAME = "the shipped English-to-French numbers model"
BATCH_SIZE = 64                      # sentences decoded together (translate, evaluate)


def load_translator(checkpoint: str | Path | None = None, dtype: npt.DTypeLike = np.float64,
                    source_lang: str | None = None, target_lang: str | None = None
                    ) -> tuple[TransformerConfig, dict[str, np.ndarray], Tokenizer | FamilyTokenizer]:
    """The config, weights and tokenizer of ``checkpoint`` (a file or a shipped model's name; default: the shipped
    model), the tokenizer set to translate ``source_lang`` into ``target_lang`` (:func:`with_languages`); a
    checkpoint without a tokenizer is refused with a message saying what it can still do."""
    path = SHIPPED if checkpoint is None else checkpoint
    config, params = load_checkpoint(path, dtype=dtype)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"checkpoint {str(path)!r} has no tokenizer, so it reads and writes token ids only "
                         "(compare, plot attention --src); `train --task numbers --out` saves one with its "
                         "tokenizer, the shipped model (the default) has one, and `import` brings a Hugging Face "
                         "model's")
    return config, params, with_languages(tokenizer, source_lang, target_lang)


def with_languages(tokenizer: Tokenizer | FamilyTokenizer, source_lang: str | None, target_lang: str | None
                   ) -> Tokenizer | FamilyTokenizer:
    """``tokenizer`` translating ``source_lang`` into ``target_lang`` (``--source-lang``, ``--target-lang``): a
    Hugging Face family's checks them against what it needs and knows; the project's own BPE takes neither."""
    if isinstance(tokenizer, FamilyTokenizer):
        return tokenizer.with_languages(source_lang, target_lang)
    for flag, value in (("--source-lang", source_lang), ("--target-lang", target_lang)):
        if value is not None:
            raise ValueError(f"{flag}: this model's tokenizer (one shared BPE vocabulary) takes no language")
    return tokenizer


class Line(NamedTuple):
    """One input line: its number (from 1), its text, and why it cannot be translated (None if it can be)."""

    number: int
    text: str
    problem: str | None = None


class Translation(NamedTuple):
    """One output line: the translation ("" for a blank line or one that could not be translated), and the
    problem of that line ("WHERE, line N: ..."), None if there was none."""

    text: str
    problem: str | None = None


class Translator:
    """Sentences to sentences with one backend's model: encode, decode (greedy, or beam search when
    ``beam_size`` > 1) ``batch_size`` sentences of similar length at a time, detokenize. Decoding follows the
    checkpoint's conventions (its config: start token, suppressed tokens, forced eos, length normalization;
    ``reference_numpy/decoding.py``); ``beam_size`` None is the checkpoint's ``beam_size``, ``alpha`` None its
    ``length_penalty``; ``forced_bos_id`` the forced first token of every output (M2M100/NLLB/mBART-50's target
    language), None for none; ``batches_at_once`` batches decoded at the same time, each in a thread of its own on
    its share of the threads (``runtime.shared_by``; CTranslate2's ``inter_threads``), or with 1, one batch at a
    time on all of them. Each batch is decoded as it would be alone: the same outputs, but for the rounding a
    framework's thread count can change."""

    def __init__(self, adapter: ModuleType, model: Any, tokenizer: Tokenizer | FamilyTokenizer,
                 beam_size: int | None = None, alpha: float | None = None, batch_size: int = BATCH_SIZE,
                 forced_bos_id: int | None = None, batches_at_once: int = 1) -> None:
        self.adapter, self.model, self.tokenizer = adapter, model, tokenizer
        self.beam_size = model.config.decoding.beam_size if beam_size is None else beam_size
        if alpha is not None and self.beam_size == 1:
            raise ValueError(f"--alpha {alpha}: the length penalty is beam search's; greedy decoding (beam size 1) "
                             "has none (pass --beam K > 1)")
        self.alpha = model.config.decoding.length_penalty if alpha is None else alpha
        self.batch_size, self.batches_at_once = batch_size, runtime.check_parts(batches_at_once)
        # the target language's id M2M100/NLLB force as the first output token (the tokenizer's, from --target-lang)
        self.forced_bos_id = getattr(tokenizer, "forced_bos_id", None) if forced_bos_id is None else forced_bos_id

    def encode(self, text: str, name: str = "text") -> list[int]:
        """The source ids of ``text``: its tokens and eos (and a family's language code). A ``ValueError`` naming
        ``name`` if the tokenizer cannot encode it, or if it is longer than the model's ``max_len`` positions (the
        reference's check)."""
        ids = self.tokenizer.source(text, name)
        check_token_layout("source", (1, len(ids)), "int64", self.tokenizer.config.max_len)
        return ids

    def token_ids(self, rows: list[list[int]]) -> np.ndarray:
        """Output ids (B, L) of encoded sources (one batch), without bos, right-padded with pad_id."""
        src = pad_rows(rows, self.tokenizer.config.pad_id)
        if self.beam_size == 1:
            return np.asarray(self.adapter.greedy(self.model, src, forced_bos_id=self.forced_bos_id))
        return np.asarray(self.adapter.beam(self.model, src, self.beam_size, self.alpha,
                                            forced_bos_id=self.forced_bos_id)[0])

    def decode_all(self, rows: list[list[int]], progress: Callable[[list], Iterable] = lambda batches: batches
                   ) -> list[np.ndarray]:
        """The output ids of every encoded source, in order, decoded ``batch_size`` at a time, shortest sources
        first, ``batches_at_once`` batches at the same time (``progress`` wraps the list of batches, e.g. in a
        progress bar: it advances as each batch is done, in order)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))            # stable: ties keep their order
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        outputs: list = [None] * len(rows)
        for batch, decoded in zip(progress(batches), self._decoded([[rows[i] for i in batch] for batch in batches])):
            for i, ids in zip(batch, decoded):
                outputs[i] = ids
        return outputs

    def _decoded(self, batches: list[list[list[int]]]) -> Iterator[np.ndarray]:
        """:meth:`token_ids` of each batch, in order: one after the other in this thread, or ``batches_at_once`` at
        a time in threads of their own sharing the threads (``runtime.shared_by``). An error, or Ctrl-C, ends the
        call at once: the batches not yet started are dropped, and the threads are daemons, so that the batches
        running then, whose results nothing reads, hold up neither the caller nor the process's exit."""
        if self.batches_at_once == 1:
            yield from map(self.token_ids, batches)
            return
        with runtime.shared_by(self.batches_at_once):
            pool = ThreadPool(self.batches_at_once)
            try:
                yield from pool.imap(self.token_ids, batches)
            finally:
                pool.terminate()

    def __call__(self, texts: list[str], progress: Callable[[list], Iterable] = lambda batches: batches
                 ) -> list[str]:
        """The translations of ``texts``, in order; one that cannot be encoded is the ``ValueError``, before any
        decoding."""
        return [self.tokenizer.decode(ids) for ids in self.decode_all([self.encode(text) for text in texts],
                                                                       progress)]

    def lines(self, lines: list[Line], where: str,
              progress: Callable[[list], Iterable] = lambda batches: batches) -> list[Translation]:
        """One :class:`Translation` per line, in order: a blank line gives a blank line; a line that cannot be read
        or encoded gives an empty one and its problem, named ``WHERE, line N``; the others are decoded together
        (:meth:`decode_all`)."""
        rows, results = {}, []
        for index, line in enumerate(lines):
            problem = line.problem
            if problem is None and line.text.strip():
                try:
                    rows[index] = self.encode(line.text)
                except ValueError as err:
                    problem = str(err)
            results.append(Translation("", problem and f"{where}, line {line.number}: {problem}"))
        for index, ids in zip(rows, self.decode_all(list(rows.values()), progress)):
            results[index] = Translation(self.tokenizer.decode(ids))
        return results

    def stream(self, lines: Iterable[Line], where: str) -> Iterator[Translation]:
        """:meth:`lines` one line at a time, each translated as soon as it arrives."""
        for line in lines:
            yield from self.lines([line], where)


def translator(adapter: ModuleType, checkpoint: str | Path | None = None, dtype: str = "float32",
               beam_size: int | None = None, alpha: float | None = None, device: str = "cpu",
               batch_size: int = BATCH_SIZE, source_lang: str | None = None,
               target_lang: str | None = None, max_output_length: int | None = None,
               batches_at_once: int = 1) -> Translator:
    """A :class:`Translator` for ``checkpoint`` (a file or a shipped model's name; default: the shipped model) in
    one backend on ``device`` (``cpu``, ``gpu:N``), from ``source_lang`` into ``target_lang`` where the model's
    tokenizer needs them; ``max_output_length`` the output budget of every sentence in place of the checkpoint's
    (:class:`~reference_numpy.config.TransformerConfig`'s ``max_output_length``), None keeps it; ``batches_at_once``
    as for :class:`Translator`."""
    runtime.check_parts(batches_at_once)                        # before the model loads
    if adapter.NAME == "numpy" and device != "cpu":            # device_for places the ports only
        raise ValueError(f"--device {device}: the numpy reference runs on the CPU only (--device places a port)")
    device = backends.device_for(adapter, device)
    config, params, tokenizer = load_translator(checkpoint, source_lang=source_lang, target_lang=target_lang)
    if max_output_length is not None:
        config = config.with_decoding(max_output_length=max_output_length)
    return Translator(adapter, adapter.build(config, params, dtype, device), tokenizer, beam_size, alpha, batch_size,
                      batches_at_once=batches_at_once)
