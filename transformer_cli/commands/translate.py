"""``transformer-reference translate``: text in, text out, in any backend, with the tokenizer saved inside the
checkpoint (section 5.1's shared BPE vocabulary) and section 6.1's decoding (greedy, or beam search with a length
penalty). The default checkpoint is the model shipped with the package: English number words to French.

Sentences are decoded in batches of similar length (sorted by source tokens, as section 5.1 batches training
pairs), their order kept. A file (``--input``, or standard input redirected from a file) is read whole and batched;
standard input that is a terminal or a pipe is translated line by line as each line arrives (a pipe may be a
conversation: a program writing a line and waiting for its translation). A line that cannot be encoded is reported
with its number and gives an empty output line; the rest is still translated (docs/translate.md)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import IO, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from reference_numpy import TransformerConfig, load_checkpoint
from reference_numpy.checkpoint import SHIPPED_MODELS, load_tokenizer
from reference_numpy.checks import check_token_layout
from reference_numpy.hf_tokenizer import FamilyTokenizer
from reference_numpy.tokenizer import Tokenizer, pad_rows
from transformer_cli import backends
from transformer_cli.textfiles import decode, lines_of, stream_chunks

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
    ``length_penalty``; ``forced_bos_id`` the forced first token of every output (M2M100/NLLB's target language),
    None for none."""

    def __init__(self, adapter: ModuleType, model: Any, tokenizer: Tokenizer | FamilyTokenizer,
                 beam_size: int | None = None, alpha: float | None = None, batch_size: int = BATCH_SIZE,
                 forced_bos_id: int | None = None) -> None:
        self.adapter, self.model, self.tokenizer = adapter, model, tokenizer
        self.beam_size = model.config.beam_size if beam_size is None else beam_size
        if alpha is not None and self.beam_size == 1:
            raise ValueError(f"--alpha {alpha}: the length penalty is beam search's; greedy decoding (beam size 1) "
                             "has none (pass --beam K > 1)")
        self.alpha = model.config.length_penalty if alpha is None else alpha
        self.batch_size = batch_size
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
        first (``progress`` wraps the list of batches, e.g. in a progress bar)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))            # stable: ties keep their order
        outputs: list = [None] * len(rows)
        for batch in progress([order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]):
            for i, ids in zip(batch, self.token_ids([rows[i] for i in batch])):
                outputs[i] = ids
        return outputs

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


def read_lines(stream: IO) -> Iterator[Line]:
    """The numbered lines of a stream (a file, standard input's buffer), each as soon as it has arrived, split as
    every command splits a text file (:mod:`transformer_cli.textfiles`: at LF, CRLF or a lone CR) and decoded as
    UTF-8 whatever the locale; a line that is not UTF-8 is one with its problem."""
    for number, raw in enumerate(lines_of(stream_chunks(stream)), 1):
        try:
            yield Line(number, decode(raw))
        except ValueError as err:
            yield Line(number, "", str(err))


def is_file(stream: IO) -> bool:
    """Whether ``stream`` reads a regular file (standard input redirected from one: read whole and batched)
    rather than a terminal or a pipe (read line by line)."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):                   # no file descriptor (io.UnsupportedOperation), or closed
        return False


def refuse_stdin_as_output(stream: IO, output: str) -> None:
    """``--output`` naming the file standard input is redirected from is refused, even with ``--force``."""
    if is_file(stream) and os.path.exists(output) and os.path.samestat(os.fstat(stream.fileno()), os.stat(output)):
        raise ValueError(f"--output: writing {output!r} would replace the input (standard input reads it); write "
                         "elsewhere")


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8 through a ``.partial`` file renamed over it, so that ``path`` holds the
    old file or the whole new one, never a part (an interrupted run leaves the old file as it was)."""
    target = Path(os.path.realpath(path))
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def open_input(path: str | None, stdin: IO) -> tuple[contextlib.AbstractContextManager[IO[bytes]], str, bool]:
    """The byte stream to translate (a context manager: a file is closed after, standard input is not), its name
    for messages, and whether it is read whole and batched (a file) or line by line (standard input from a terminal
    or a pipe). ``path`` that cannot be read is a ``ValueError``."""
    if path is None:
        return contextlib.nullcontext(getattr(stdin, "buffer", stdin)), "standard input", is_file(stdin)
    try:
        return open(path, "rb"), repr(path), True
    except OSError as err:
        raise ValueError(f"--input: cannot read {path!r}: {err.strerror or err}") from None


def write_translations(results: Iterable[Translation], output: str | None, stdout: IO[str],
                       report: Callable[[str], None]) -> int:
    """Each translation to ``stdout`` as it comes, or to the file ``output`` once all are done (:func:`write_text`),
    each problem to ``report``; returns how many lines had one."""
    problems, texts = 0, []
    for result in results:
        if result.problem:
            problems += 1
            report(result.problem)
        if output is None:
            print(result.text, file=stdout, flush=True)
        texts.append(result.text)
    if output is not None:
        write_text(output, "".join(f"{text}\n" for text in texts))
    return problems


def translator(adapter: ModuleType, checkpoint: str | Path | None = None, dtype: str = "float32",
               beam_size: int | None = None, alpha: float | None = None, device: str = "cpu",
               batch_size: int = BATCH_SIZE, source_lang: str | None = None,
               target_lang: str | None = None, max_output_length: int | None = None) -> Translator:
    """A :class:`Translator` for ``checkpoint`` (a file or a shipped model's name; default: the shipped model) in
    one backend on ``device`` (``cpu``, ``gpu:N``), from ``source_lang`` into ``target_lang`` where the model's
    tokenizer needs them; ``max_output_length`` the output budget of every sentence in place of the checkpoint's
    (:class:`~reference_numpy.config.TransformerConfig`'s ``max_output_length``), None keeps it."""
    if adapter.NAME == "numpy" and device != "cpu":            # device_for places the ports only
        raise ValueError(f"--device {device}: the numpy reference runs on the CPU only (--device places a port)")
    device = backends.device_for(adapter, device)
    config, params, tokenizer = load_translator(checkpoint, source_lang=source_lang, target_lang=target_lang)
    if max_output_length is not None:
        config = config.replace(max_output_length=max_output_length)
    return Translator(adapter, adapter.build(config, params, dtype, device), tokenizer, beam_size, alpha, batch_size)
