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
from typing import IO

from transformer_tasks.textfiles import decode, lines_of, stream_chunks
from transformer_tasks.translation import Line, Translation


def read_lines(stream: IO) -> Iterator[Line]:
    """The numbered lines of a stream (a file, standard input's buffer), each as soon as it has arrived, split as
    every command splits a text file (:mod:`transformer_tasks.textfiles`: at LF, CRLF or a lone CR) and decoded as
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
