"""Where the test run keeps JAX's persistent compilation cache (tests/conftest.py): a directory of the checkout,
``.compile-cache/jax-<CPU>``, kept from run to run, so that a run reads back the programs an earlier run compiled.
Its name holds the machine's CPU (``equivalence.compile_cache.cpu_fingerprint``, as the command line's cache
names its own); past :data:`LIMIT` bytes it starts again empty; ``pytest --cache-clear`` empties it (:func:`clear`).
Imports no framework: conftest.py sets the cache before any framework loads. :data:`CLI` is the command line's cache
of compiled programs for the test run (``TRANSFORMER_REFERENCE_CACHE``), so that no test writes to the user's."""

from __future__ import annotations

import shutil
from pathlib import Path

from equivalence.compile_cache import cpu_fingerprint

ROOT = Path(__file__).resolve().parents[2] / ".compile-cache"
LIMIT = 2 * 2**30                    # bytes: a whole run writes about 117 MB
CLI = ROOT / "cli"


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
