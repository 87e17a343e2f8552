"""One reading of text files for every command that reads sentences: ``translate`` (``--input``, standard input),
``evaluate`` (``--source``, ``--reference``) and ``train`` (``--source``, ``--target``, ``--corpus``, the validation
files).

A file is UTF-8, one sentence a line. A line ends at a line feed (LF, ``\\n``), a carriage return and line feed
(CRLF, ``\\r\\n``) or a carriage return alone (CR, ``\\r``: old Mac files); the last line's end is optional, and a
byte-order mark at the start of the file is dropped. So a file has the same lines whichever system wrote it, and
every command reads it alike (no other character, such as a form feed or U+2028, ends a line)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

LINE_END = re.compile(rb"\r\n|\r|\n")
BYTE_ORDER_MARK = b"\xef\xbb\xbf"
CHUNK = 1 << 16                     # bytes a stream is read by: whatever has arrived, up to this


def lines_of(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a text arriving in ``chunks``, without their ends nor a byte-order mark at the start, each as
    soon as its end has arrived."""
    lines = _split(chunks)
    first = next(lines, None)
    if first is not None:
        yield first.removeprefix(BYTE_ORDER_MARK)
        yield from lines


def _split(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of ``chunks`` at LF, CRLF and CR; a CR ends its line at once (an LF right after it, in the next
    chunk or not, belongs to it), so that a line typed or piped is read without waiting for the next one."""
    rest, after_cr = b"", False
    for chunk in chunks:
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        data = rest + chunk
        *lines, rest = LINE_END.split(data)
        after_cr = data.endswith(b"\r")
        yield from lines
    if rest:
        yield rest


def stream_chunks(stream: IO) -> Iterator[bytes]:
    """What ``stream`` holds, chunk by chunk as it arrives, never waiting for more than has arrived (a pipe may be
    a conversation): a byte stream's ``read1``; a text stream's lines (with no bytes beneath), in UTF-8."""
    if hasattr(stream, "read1"):
        return iter(lambda: stream.read1(CHUNK), b"")
    return (line.encode("utf-8") for line in iter(stream.readline, ""))


def decode(line: bytes) -> str:
    """A line's text; a ``ValueError`` saying where it is not UTF-8 (the caller names the file and the line)."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not UTF-8 text (byte {line[err.start]:#04x} at offset {err.start})") from None


def read_lines(path: str, flag: str) -> list[str]:
    """The lines of the UTF-8 text file ``path`` (:func:`lines_of`); a file that cannot be read, or a line that is
    not UTF-8, is one ``ValueError`` naming ``flag``, the file (and the line)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {path!r}: {err.strerror or err}") from None
    texts = []
    for number, line in enumerate(lines_of([data]), 1):
        try:
            texts.append(decode(line))
        except ValueError as err:
            raise ValueError(f"{flag} {path!r}, line {number}: {err}") from None
    return texts
