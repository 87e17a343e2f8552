"""Argument types of ``transformer-reference``: each checks one flag's value while the command
line is parsed, before any work, so that a mistake is a usage error naming the flag (exit 2)."""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from reference_numpy.checkpoint import SHIPPED_MODELS
from reference_numpy.precision import DTYPE_NAMES
from transformer_cli import backends
from transformer_cli.extras import require


def integer(minimum: int, even: bool = False) -> Callable[[str], int]:
    """An int flag of at least ``minimum`` (and even, if asked)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if even and value % 2:
            raise argparse.ArgumentTypeError(f"must be even, got {value}")
        return value
    return parse


def backend_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of known backends, at least one."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"names no backend; choose from {', '.join(backends.BACKENDS)}")
    unknown = [name for name in names if name not in backends.BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend {unknown[0]!r}; choose from {', '.join(backends.BACKENDS)}")
    return names


def device_name(text: str) -> str:
    """``--device``: ``cpu`` or ``gpu:N`` (whether the backend has it here is checked by ``backends.device_for``)."""
    if text != "cpu" and not re.fullmatch(r"gpu:\d+", text):
        raise argparse.ArgumentTypeError(f"a device is cpu or gpu:N (N = 0, 1, ...), got {text!r}")
    return text


def dtype_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of precisions (float64, float32, bfloat16, float16), at least one."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in DTYPE_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{'unknown dtype ' + repr(unknown[0]) if unknown else 'names no dtype'}; "
                                         f"choose from {', '.join(DTYPE_NAMES)}")
    return names


def output_file(text: str) -> str:
    """A file path that can be written: not a directory, in an existing writable directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(directory)!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


def image_file(text: str) -> str:
    """An :func:`output_file` whose suffix names a picture format matplotlib writes (matplotlib
    being installed: the ``cli`` extra)."""
    try:
        formats = require("matplotlib.backend_bases", f"drawing {text!r}").FigureCanvasBase.get_supported_filetypes()
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if Path(text).suffix.lower().lstrip(".") not in formats:
        raise argparse.ArgumentTypeError(f"{text!r} does not end in a picture format matplotlib writes "
                                         f"({', '.join(sorted(formats))})")
    return output_file(text)


def real(minimum: float, below: float | None = None, inclusive: bool = True) -> Callable[[str], float]:
    """A finite float flag of at least ``minimum`` (strictly above it unless ``inclusive``) and below ``below``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'at least' if inclusive else 'above'} {minimum}, got {text}")
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"must be below {below}, got {text}")
        return value
    return parse


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


def refuse_existing(path: str, flag: str, force: bool) -> None:
    """A ``ValueError`` naming ``flag`` if ``path`` exists and ``--force`` was not given."""
    if os.path.lexists(path) and not force:
        raise ValueError(f"{flag}: {path!r} already exists; pass --force to replace it")
