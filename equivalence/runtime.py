"""How the frameworks run in this process: the intra-op threads of each (the command line's ``--threads``, so that
one backend cannot oversubscribe cores it shares with others), their log noise, and the versions and thread
settings a result records. The adapters (:mod:`equivalence.backends`), the benchmarks and the exporters import
every framework through :func:`import_framework`.

Each framework reads its setting where it can: XLA (JAX) from the environment when its CPU client starts
(``PJRT_NPROC``, its thread pool's size; with one thread ``--xla_cpu_multi_thread_eigen=false`` too), so
:func:`configure` runs before any framework is imported; PyTorch (``torch.set_num_threads``) and TensorFlow
(``tf.config.threading``, before its first operation) through their APIs, once imported (:func:`apply`, called by
``backends.load``); NumPy's BLAS (the reference's OpenBLAS) through ``threadpoolctl``, which sets the loaded
library's threads (``OPENBLAS_NUM_THREADS`` and the like are read when NumPy is imported, before any flag is parsed).
The C library's allocator keeps freed blocks for reuse (:func:`reuse_freed_memory`): a decoder's large temporaries
then cost no page faults at each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from types import ModuleType

import threadpoolctl

QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}   # TensorFlow's C++ info and warnings (oneDNN, CPU features), read at import
FRAMEWORKS = {"numpy": "numpy", "torch": "torch", "jax": "jax", "flax": "flax", "tensorflow": "tensorflow",
              "keras": "keras"}          # module -> distribution whose version a result records
_requested: int | None = None
# glibc's malloc (``mallopt``): a block above the mmap threshold is a mapping of its own, unmapped when freed, and
# freed memory above the trim threshold at the heap's top goes back to the system; the next block of that size then
# faults in every page again. A beam search's vocabulary-wide scores are such blocks (64 rows x 58,101 float32, 15 MB,
# several a step), whose pages every step would fault in again. Set, both keep freed blocks for reuse; blocks above
# the mmap threshold's largest value (32 MiB on 64-bit systems) are mapped whatever it is.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20


def visible_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of them where the system cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def quiet() -> None:
    """Silence the frameworks' start-up notices (a value the user set is kept)."""
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)


# module -> the modules it imports that no command needs from it, kept out while :func:`import_framework` imports it
# (those not imported already): TensorFlow imports JAX, where installed, for TFLite's conversion of JAX functions
# alone (tensorflow/lite/python/util.py, which takes its absence), about a sixth of TensorFlow's import time.
UNNEEDED = {"equivalence.backends.tf": ("jax",)}
# Lines TensorFlow's C++ logs as errors each time it reads a program back from its persistent XLA cache
# (equivalence/compile_cache.py), though the program runs: the entry is parsed as text before as binary, and the
# loader compares the CPU features XLA compiled for, tuning preferences (prefer-no-gather, prefer-no-scatter)
# included, with the host's, which never list those (the cache's directory already names the CPU).
CACHE_NOTICES = (b"Error parsing text-format tensorflow.XlaSerializedCacheEntry",
                 b"Loading XLA:CPU AOT result. Target machine feature +prefer-no-")
LINES = re.compile(rb"(?<=[\r\n])")      # splits after each line's end, a progress bar's \r included
PIPE_CHUNK = 65536                      # bytes read from the pipe at a time
COPIER_WAIT = 5.0                       # s: how long the end of a command waits for the copier to finish


@contextlib.contextmanager
def start_up_notices_held() -> Iterator[None]:
    """Standard error (file descriptor 2) held aside while frameworks load, when :func:`quiet` is in force (a
    ``TF_CPP_MIN_LOG_LEVEL`` above 0): some TensorFlow builds print their C++ start-up notices (oneDNN) through
    absl before that setting is read. If loading fails, what it printed is written out before the error goes on."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") == "0":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def cache_notices_dropped() -> Iterator[None]:
    """Standard error (file descriptor 2, the frameworks' C++ logs included) passed on as it is written while the
    block runs, but for the lines of :data:`CACHE_NOTICES`, when :func:`quiet` is in force (a
    ``TF_CPP_MIN_LOG_LEVEL`` above 0): it goes through a pipe, which a thread reads and copies out line by line (a
    partial line as it comes, unless it starts as absl's error lines do, with ``E``; a progress bar's ``\r`` ends a
    line)."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") == "0":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    copier = threading.Thread(target=_copy_but_notices, args=(read, saved), daemon=True)
    copier.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)                   # the pipe's last write end closed: the copier reads its end and stops
        copier.join(timeout=COPIER_WAIT)    # (a process started in the block and still running holds it open)
        os.close(saved)


def _copy_but_notices(read: int, out: int) -> None:
    """:func:`cache_notices_dropped`'s copier: from the pipe ``read`` to the file descriptor ``out``."""
    pending = b""
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while chunk := pipe.read(PIPE_CHUNK):
            *lines, pending = LINES.split(pending + chunk)                     # each line with its \n or \r
            kept = [line for line in lines if not any(notice in line for notice in CACHE_NOTICES)]
            if not pending.startswith(b"E"):
                kept.append(pending)
                pending = b""
            os.write(out, b"".join(kept))
    os.write(out, pending)


def import_framework(name: str) -> ModuleType:
    """Import ``name`` (a framework, or a module that imports one) as every command does: its start-up notices held
    (:func:`start_up_notices_held`; TensorFlow's oneDNN lines), the modules :data:`UNNEEDED` names for it kept out,
    and ``--threads`` set in it (:func:`apply`)."""
    kept_out = [unneeded for unneeded in UNNEEDED.get(name, ()) if unneeded not in sys.modules]
    for unneeded in kept_out:
        sys.modules[unneeded] = None  # type: ignore[assignment]  # Python's marker of a module not to import
    try:
        with start_up_notices_held():
            module = importlib.import_module(name)
    finally:
        for unneeded in kept_out:                        # importable again, by a backend that needs it
            del sys.modules[unneeded]
    apply()
    return module


def configure(threads: int) -> None:
    """Use ``threads`` intra-op threads in every framework of this process (and in TensorFlow's inter-op pool): the
    environment now (read by XLA when JAX's CPU client starts), the APIs of the frameworks already imported now, the
    others when ``backends.load`` imports them. Once XLA's client has started (a second command in one process) it
    keeps the pool it started with, as TensorFlow does, and the environment is left as it is: JAX hashes
    ``XLA_FLAGS`` into every program's compilation-cache key, so a changed value would only make each later program
    miss the cache. And the process keeps freed memory for reuse (:func:`reuse_freed_memory`)."""
    global _requested
    _requested = threads
    reuse_freed_memory()
    if not xla_started():
        os.environ["PJRT_NPROC"] = str(threads)
        flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
                 if not flag.startswith("--xla_cpu_multi_thread")]
        os.environ["XLA_FLAGS"] = " ".join([*flags, *(["--xla_cpu_multi_thread_eigen=false"] if threads == 1 else [])])
    apply()


@contextlib.contextmanager
def shared_by(parts: int) -> Iterator[None]:
    """The requested threads (:func:`threads`) shared by ``parts`` computations that run at the same time in threads
    of this process (``translate --batches-at-once``): for the block, PyTorch's intra-op threads and NumPy's BLAS
    threads are ``threads() // parts`` (PyTorch and the BLAS libraries run each operation on that many threads,
    whichever thread calls it), then as they were; TensorFlow's and XLA's pools, fixed when they start, are shared
    by the computations as they are. ``parts`` 1: nothing changes. A ``ValueError`` when ``parts`` is more than the
    threads: each computation needs one of its own (:func:`check_parts`)."""
    if check_parts(parts) == 1:
        yield
        return
    each = threads() // parts
    torch = imported("torch")
    held = torch.get_num_threads() if torch else None
    with threadpoolctl.threadpool_limits(each, user_api="blas"):
        if torch:
            torch.set_num_threads(each)
        try:
            yield
        finally:
            if torch:
                torch.set_num_threads(held)


def check_parts(parts: int) -> int:
    """``parts`` (:func:`shared_by`), checked: a ``ValueError`` naming ``--batches-at-once`` unless 1 <= parts <=
    :func:`threads`."""
    if not 1 <= parts <= threads():
        raise ValueError(f"--batches-at-once {parts}: at most --threads ({threads()}) batches at once, each on a "
                         f"thread of its own")
    return parts


def reuse_freed_memory() -> None:
    """Have glibc's malloc keep freed blocks up to :data:`MMAP_THRESHOLD` each and :data:`TRIM_THRESHOLD` in all for
    reuse, instead of handing them back to the system (the thresholds' comment); nothing where the C library is not
    glibc (no ``mallopt``: its allocator as it is)."""
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def jax_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (``--xla_force_host_platform_device_count``) for a JAX mesh on a machine
    without accelerators; JAX reads the flag when it starts, so this runs before it is imported. Once XLA has
    started (a second command in one process) the environment is left as it is (:func:`configure`), and a mesh
    wider than the devices XLA started with is refused by ``transformer_jax.data_parallel``, naming the flag."""
    if xla_started():
        return
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def xla_started() -> bool:
    """Whether JAX's XLA backends have started in this process (after which they read no environment variable).
    JAX says so only in ``jax._src.xla_bridge``; a JAX without that function is taken as started once imported."""
    if (bridge := imported("jax._src.xla_bridge")) is None:
        return False
    return getattr(bridge, "backends_are_initialized", lambda: True)()


def apply() -> None:
    """Set the requested threads in NumPy's BLAS, and in PyTorch and TensorFlow if they are imported (TensorFlow's
    intra-op pool and its inter-op pool, whose threads run a graph's independent operations side by side: with two,
    ``--threads 1`` would keep two cores busy); silence absl's Python logging. TensorFlow fixes its pools at its
    first operation: asked later (a second command in one process), it keeps them, and :func:`settings` records what
    it has."""
    if absl_logging := imported("absl.logging"):
        absl_logging.set_verbosity("error")
    if _requested is None:
        return
    threadpoolctl.threadpool_limits(_requested, user_api="blas")
    if torch := imported("torch"):
        torch.set_num_threads(_requested)
    if tensorflow := imported("tensorflow"):
        with contextlib.suppress(RuntimeError):
            tensorflow.config.threading.set_intra_op_parallelism_threads(_requested)
            tensorflow.config.threading.set_inter_op_parallelism_threads(_requested)


def imported(name: str) -> ModuleType | None:
    """The module ``name`` if it is imported (None for one not imported or blocked: a None entry in
    ``sys.modules`` is Python's marker of a module that must not be imported)."""
    return sys.modules.get(name)


def blas_threads(threads: int) -> dict[str, str]:
    """The environment that gives a process about to start ``threads`` threads in its BLAS libraries (OpenBLAS,
    MKL, and OpenMP's), which read it when they load: how a benchmark starts a worker whose libraries (a peer
    engine's too) have that many threads from the start."""
    return dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), str(threads))


def threads() -> int:
    """The intra-op threads asked for (``--threads``), or the visible cores if none was."""
    return _requested or visible_cores()


def settings() -> dict:
    """What a result records: the threads asked, the cores visible, and each imported framework's version and
    intra-op threads (where the framework can say)."""
    frameworks = {}
    for module, distribution in FRAMEWORKS.items():
        if imported(module):
            frameworks[module] = {"version": _version(distribution), **_threads_of(module)}
    return {"threads": _requested, "visible_cores": visible_cores(), "frameworks": frameworks}


def _threads_of(module: str) -> dict:
    if module == "numpy":
        return {"blas_threads": {info["internal_api"]: info["num_threads"]
                                 for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"}}
    if module == "torch":
        return {"intra_op_threads": sys.modules["torch"].get_num_threads()}
    if module == "tensorflow":
        threading = sys.modules["tensorflow"].config.threading
        return {"intra_op_threads": threading.get_intra_op_parallelism_threads(),
                "inter_op_threads": threading.get_inter_op_parallelism_threads()}
    if module == "jax":
        return {"PJRT_NPROC": os.environ.get("PJRT_NPROC"), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    return {}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(distribution), "__version__", None)
