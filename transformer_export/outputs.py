"""What a command or an exporter may write: never over one of its inputs, whatever the link or the name it is
given by (a shipped model's name stands for its file), even with ``--force``."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from reference_numpy.checkpoint import SHIPPED_MODELS


def input_file(value: str) -> str:
    """The file a command reads for the input ``value``: the path itself, or, when no file has that name, the
    shipped model it names (``numbers-en-fr``: :func:`reference_numpy.checkpoint.resolve_checkpoint`'s rule)."""
    if not os.path.lexists(value) and value in SHIPPED_MODELS:
        return os.fspath(SHIPPED_MODELS[value])
    return value


def replaces(output: str, source: str) -> bool:
    """Whether writing ``output`` replaces the existing file ``source``: the same file through any symbolic or hard
    link (the same device and inode), or a directory holding it. An output that does not exist replaces nothing."""
    try:
        target, status = os.stat(output), os.stat(source)
    except (OSError, ValueError):                   # nothing there, a dangling link, or a name no file can have
        return False
    if os.path.samestat(target, status):
        return True
    return stat.S_ISDIR(target.st_mode) and any(os.path.samestat(target, os.stat(parent))
                                               for parent in Path(os.path.realpath(source)).parents)


def refuse_input(output: str, inputs: Iterable[str], flag: str) -> None:
    """A ``ValueError`` naming ``flag``, the output and the input if writing ``output`` would replace one of the
    command's ``inputs`` (:func:`replaces`; an input given as a shipped model's name is its file): never done,
    even with ``--force``. Every command checks each file it writes with it, before any work."""
    for source in inputs:
        path = input_file(source)
        if replaces(output, path):
            shipped = f" (the shipped model {path!r})" if path != source else ""
            raise ValueError(f"{flag}: writing {output!r} would replace the input {source!r}{shipped}; write "
                             "elsewhere")
