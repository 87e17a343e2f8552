"""Argument types of ``transformer-reference``: each checks one flag's value while the command
line is parsed, before any work, so that a mistake is a usage error naming the flag (exit 2). Every numeric flag
of every command has its range in one table, :data:`RANGES` (:func:`add_number` adds such a flag)."""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from equivalence import backends
from reference_numpy.config import MAX_BEAM_SIZE, MAX_LEN_LIMIT
from reference_numpy.decoding import EXTRA_OUTPUT_LENGTH
from reference_numpy.precision import AUTOCAST_NAMES, DTYPE_NAMES
from transformer_cli.extras import require

PRECISION_NAMES = DTYPE_NAMES + AUTOCAST_NAMES   # --dtype: a model in a dtype, or a float32 one under autocast


@dataclass(frozen=True)
class Range:
    """The values a numeric flag takes: integers (``real``: finite numbers) from ``low`` to ``high``, each bound
    included unless ``open_low`` / ``open_high``, even ones only if ``even``; ``then`` names a bound checked once
    the command knows it (the model's, the corpus's), before any work too."""

    low: float
    high: float
    real: bool = False
    open_low: bool = False
    open_high: bool = False
    even: bool = False
    then: str = ""

    def __str__(self) -> str:
        if self.real:
            opening, closing = "(" if self.open_low else "[", ")" if self.open_high else "]"
            return f"a number in {opening}{self.low:g}, {self.high:g}{closing}"
        return f"{'an even' if self.even else 'an'} integer from {self.low:,} to {self.high:,}"

    def parse(self, text: str) -> int | float:
        """``text`` as the flag's value; anything else (out of range, not a number, nan, inf) is an
        ``ArgumentTypeError`` saying the range, which argparse reports naming the flag."""
        try:
            value = float(text) if self.real else int(text)
        except ValueError:
            value = None
        if value is None or not self.holds(value):
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(f"must be {self}, got {shown!r}")
        return value

    def holds(self, value: float) -> bool:
        """Whether ``value`` (an int of any size, or a float: nan and inf are in no range) is in the range."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below and not (self.even and value % 2)


# Every numeric flag of every command and its range, checked while the command line is parsed (:func:`add_number`);
# the bounds keep each command's memory and time finite whatever is typed (docs/cli.md, "Flags and their ranges")
STEPS = 100_000_000
RANGES: dict[str, Range] = {
    "--threads": Range(1, 1024),
    "--batch": Range(1, 1024),                                               # bench
    "--src-len": Range(1, MAX_LEN_LIMIT, then="at most the model's max_len"),
    "--tgt-len": Range(1, MAX_LEN_LIMIT, then="at most the model's max_len"),
    "--decode-tokens": Range(EXTRA_OUTPUT_LENGTH + 1, MAX_LEN_LIMIT, then="at most the model's max_len"),
    "--repeats": Range(1, 1000),
    "--length": Range(1, 10_000),                                            # plot pe
    "--d-model": Range(2, 4096, even=True),
    "--layer": Range(0, 1023, then="a layer of the model"),                  # plot attention
    "--head": Range(0, 1023, then="a head of the model"),
    "--seed": Range(0, 2 ** 32 - 1),                                         # init, train
    "--steps": Range(1, STEPS),                                              # train
    "--batch-size": Range(1, 4096),                                          # train; translate, evaluate
    "--tokens-per-batch": Range(2, 100_000, then="at least a training pair's positions"),
    "--vocab-size": Range(5, 1_000_000, then="at least the corpus's characters and 4 special tokens"),
    "--valid-size": Range(1, 100_000, then="fewer than the corpus's pairs"),
    "--eval-size": Range(0, 100_000, then="at most the held-out pairs"),
    "--symbols": Range(1, 10_000),
    "--max-length": Range(1, MAX_LEN_LIMIT, then="below the model's max_len"),
    "--warmup-steps": Range(1, STEPS),
    "--learning-rate-scale": Range(0, 100, real=True, open_low=True),
    "--dropout": Range(0, 1, real=True, open_high=True),
    "--layer-norm-eps": Range(0, 1, real=True, open_low=True),
    "--label-smoothing": Range(0, 1, real=True, open_high=True),
    "--eval-every": Range(0, STEPS),
    "--stop-at": Range(0, 1, real=True),
    "--data-parallel": Range(1, 16, then="dividing --batch-size"),
    "--save-every": Range(1, STEPS),
    "--keep": Range(1, 1000),
    "--average": Range(2, 1000, then="at most the checkpoints the run saves and --keep"),
    "--beam": Range(1, MAX_BEAM_SIZE),                                       # translate, evaluate
    "--alpha": Range(0, 10, real=True),
    "--max-output-length": Range(1, MAX_LEN_LIMIT, then="capped at the model's max_len"),   # translate, evaluate
    "--batches-at-once": Range(1, 256, then="at most --threads"),                             # translate, evaluate
}


def add_number(parser: argparse.ArgumentParser, flag: str, **options: Any) -> None:
    """Add the numeric flag ``flag`` to ``parser`` with its range of :data:`RANGES` as its type, checked while the
    command line is parsed, and shown at the end of its help."""
    bounds = RANGES[flag]
    shown = f"{bounds}{'; ' + bounds.then if bounds.then else ''}"
    parser.add_argument(flag, type=bounds.parse, help=f"{options.pop('help', '')} [{shown}]".lstrip(), **options)


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
    """A comma-separated list of precisions (float64, float32, bfloat16, float16, and the autocast recipe's
    mixed-bfloat16, mixed-float16), at least one."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in PRECISION_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{'unknown dtype ' + repr(unknown[0]) if unknown else 'names no dtype'}; "
                                         f"choose from {', '.join(PRECISION_NAMES)}")
    return names


def output_file(text: str) -> str:
    """A file path that can be written: not a directory, in an existing writable directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"{str(directory)!r} is not a directory" if directory.exists()
                                         else f"directory {str(directory)!r} does not exist")
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


def refuse_existing(path: str, flag: str, force: bool) -> None:
    """A ``ValueError`` naming ``flag`` if ``path`` exists and ``--force`` was not given."""
    if os.path.lexists(path) and not force:
        raise ValueError(f"{flag}: {path!r} already exists; pass --force to replace it")
