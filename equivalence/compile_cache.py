"""The per-user cache of compiled programs (docs/cli.md, "The cache of compiled programs"): what a command's
framework compiles is kept on disk, so that the next process reads it back instead of compiling it again -- JAX's
persistent compilation cache, TensorFlow's persistent XLA cache of its ``jit_compile`` functions, Inductor's cache
of compiled PyTorch (eager PyTorch and the NumPy reference compile nothing).

It lives in ``$TRANSFORMER_REFERENCE_CACHE``, else ``$XDG_CACHE_HOME/transformer-reference``, else
``~/.cache/transformer-reference``: one directory per framework, its version and the machine's CPU
(``jax-<jaxlib version>-<CPU>``; XLA:CPU compiles for the host's instruction set). Within one, each framework keys
a program by the program itself (its HLO or graph, shapes, compile options, flags): weights are the programs'
arguments, never part of them, so a changed checkpoint runs its own weights and a changed shape compiles anew.
Deleting it is always safe: what is missing is compiled again.

:func:`use` sets it through the frameworks' environment variables, read when a framework is imported, so it runs
before any is (``main`` calls it once the arguments are parsed); a framework already imported in this process keeps
its own setting. A user's own setting of a framework's cache (``JAX_COMPILATION_CACHE_DIR``, a
``--tf_xla_persistent_cache_directory`` in ``TF_XLA_FLAGS``, ``TORCHINDUCTOR_CACHE_DIR``) is kept.
Imports nothing beyond the standard library (and the package's own ``__init__``): tests/helpers/compile_cache.py names
the test run's JAX cache by :func:`cpu_fingerprint` before any framework loads.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

ENVIRONMENT = "TRANSFORMER_REFERENCE_CACHE"       # the cache's directory, if set
NAME = "transformer-reference"                   # its directory's name under $XDG_CACHE_HOME or ~/.cache
TF_FLAG = "--tf_xla_persistent_cache_directory"
# framework -> (its module, the distributions that install it, the first installed one giving its version)
FRAMEWORKS = {"jax": ("jaxlib", ("jaxlib",)),
              "tf": ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos")),
              "torch": ("torch", ("torch",))}


def root() -> Path:
    """The cache's directory (created by the first framework that writes to it)."""
    if given := os.environ.get(ENVIRONMENT):
        return Path(given).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / NAME


def cpu_fingerprint() -> str:
    """The CPU's model and instruction-set extensions, hashed (Linux's /proc/cpuinfo; elsewhere ``platform``'s
    description): XLA:CPU compiles for the host's instruction set, so a cache on a disk that machines with other
    CPUs share reads back only programs compiled on a CPU like its own."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        description = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        description = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(description.encode()).hexdigest()[:16]


def framework_version(framework: str) -> str | None:
    """The installed version of ``framework`` (a key of :data:`FRAMEWORKS`), without importing it: its
    distribution's, else the modification time of its module (which a reinstall changes); None if not installed."""
    module, distributions = FRAMEWORKS[framework]
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    spec = importlib.util.find_spec(module)
    return None if spec is None or spec.origin is None else f"file-{os.stat(spec.origin).st_mtime_ns}"


def directory(framework: str) -> Path | None:
    """The directory of ``framework``'s programs, None if it is not installed."""
    version = framework_version(framework)
    return None if version is None else root() / f"{framework}-{version}-{cpu_fingerprint()}"


def use(enabled: bool = True) -> None:
    """Point every installed framework at its directory (:func:`directory`), or, not ``enabled`` (``--no-cache``),
    turn JAX's persistent cache off and point no framework at one: nothing is read or written."""
    if not enabled:
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        return
    if jax := directory("jax"):
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(jax))
        # every program, not only those that took JAX's default of 1 s to compile: translating one sentence
        # compiles a few programs, each under a second, and reading one back costs less than compiling it
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    tf_flags = os.environ.get("TF_XLA_FLAGS", "")
    if TF_FLAG not in tf_flags and (tf := directory("tf")):
        os.environ["TF_XLA_FLAGS"] = f"{tf_flags} {TF_FLAG}={tf}".strip()
    if torch := directory("torch"):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(torch))
