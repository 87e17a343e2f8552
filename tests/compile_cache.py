"""Where the test run keeps JAX's persistent compilation cache (tests/conftest.py): a directory of the checkout,
``.compile-cache/jax-<CPU>``, kept from run to run, so that a run reads back the programs an earlier run compiled.
Its name holds the machine's CPU (:func:`cpu_fingerprint`); past :data:`LIMIT` bytes it starts again empty;
``pytest --cache-clear`` empties it (:func:`clear`). Imports nothing but the standard library: conftest.py sets the
cache before any framework loads."""

from __future__ import annotations

import hashlib
import platform
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / ".compile-cache"
LIMIT = 2 * 2**30                    # bytes: a whole run writes about 117 MB


def cpu_fingerprint() -> str:
    """The CPU's model and instruction-set extensions, hashed (Linux's /proc/cpuinfo; elsewhere ``platform``'s
    description): XLA:CPU compiles for the host's instruction set, so a checkout on a disk that machines with other
    CPUs share reads back only programs compiled on a CPU like its own."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        description = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        description = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(description.encode()).hexdigest()[:16]


def directory() -> Path:
    """This machine's cache directory, removed first if its files hold more than :data:`LIMIT` bytes (called once
    a run, by the run's first process)."""
    cache = ROOT / f"jax-{cpu_fingerprint()}"
    if cache.is_dir() and sum(entry.stat().st_size for entry in cache.iterdir() if entry.is_file()) > LIMIT:
        shutil.rmtree(cache, ignore_errors=True)
    return cache


def clear() -> None:
    """Every machine's cache directory removed."""
    shutil.rmtree(ROOT, ignore_errors=True)
