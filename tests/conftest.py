"""Shared test plumbing: the agreement checks (the project's one tolerance policy; in low precision also the
roundings it decides) and a summary of the measured error/bound ratios printed at the end of the run."""

from __future__ import annotations

import os
import platform

# One OpenBLAS kernel on every x86-64 machine, set before NumPy loads OpenBLAS (here, or in any process a test
# starts): OpenBLAS picks its kernels by CPU (DYNAMIC_ARCH: AVX-512 "SkylakeX" on some hosts, "Haswell" on others),
# and its summation order decides the last bits of the reference's products, which the fuzzer's overflow cases and
# the float32 reference's own error (the bound of the float32 policy) depend on. A user's value is kept.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import compile_cache  # noqa: E402 - imports NumPy (through the equivalence package), so after OpenBLAS's kernel is set

# One JAX persistent compilation cache for the checkout, kept from run to run (tests/helpers/compile_cache.py), set
# before any process imports JAX: the test processes (xdist's workers inherit it from the controller) and every process
# a test starts (CLI runs, the documents' examples, data-parallel workers) read back a program compiled before -- in an
# earlier run, in another process, or in this one before a module's caches were dropped -- instead of compiling it
# again: the same executable, XLA's key covering the program, its compile options, XLA_FLAGS and jaxlib's version. A
# user's own directory is kept; xdist's workers and the processes a test starts find the controller's set.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache.directory())
# Every program goes into that cache, not only those that took JAX's default of 1 s to compile: the op-by-op
# primitives (eager JAX) and small jitted functions are compiled again in every module after the module's caches are
# dropped (pytest_runtest_teardown below) and in every process a test starts, and reading a program back costs
# less than compiling it again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The commands run by tests keep their other compiled programs (TensorFlow's XLA cache, Inductor's) in the checkout's
# cache too (equivalence/compile_cache.py), never in the user's; cleared with it.
os.environ.setdefault("TRANSFORMER_REFERENCE_CACHE", str(compile_cache.CLI))

# XLA:CPU (JAX's programs, TensorFlow's compiled ones) compiles the suite's programs with LLVM at optimisation level 1
# and its loop emitters instead of the newer fusion emitters, set before any process imports JAX: the same HLO
# programs after the same XLA passes (xla_allow_excess_precision off where the ports ask for it), generated with
# fewer LLVM passes -- about 0.7 times the compile time of a training step, the suite's largest cost, and no bound
# of the suite depends on it (docs/equivalence.md, "Kernel families"). A user's XLA_FLAGS, even an empty one, is
# kept: scripts/kernel_families.py runs the numerical tests under XLA's own defaults (CI included).
# Level 0 is not used: its code rounds float16 differently from XLA's other levels (a compiled float16 loss differed
# from the op-by-op one in the fifth digit).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false")

import functools
import gc
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support import (
    FAMILIES,
    imported_family,
    tiny_bart,
    tiny_m2m100,
    tiny_marian,
    tiny_mbart50,
    tiny_nllb,
    tiny_pegasus,
    tiny_separate_marian,
)

from equivalence import cases, runtime, tolerance
from equivalence.backends import numpy as reference
from reference_numpy.checkpoint import release_freed_memory
from reference_numpy.precision import DTYPES, round_to, score_dtype, spacing

# (port, device, dtype, what) -> list of (error, bound); filled by ``check_agreement``.
AGREEMENT_LOG: dict[tuple[str, str, str, str], list[tuple[float, float]]] = defaultdict(list)
# test -> the seconds it took in this run (set-up, call and tear-down); filled by pytest_runtest_logreport.
RUN_SECONDS: dict[str, float] = defaultdict(float)
# worker -> its peak resident memory, in bytes; filled by pytest_testnodedown.
PEAK_MEMORY: dict[str, int] = {}


def check_agreement(port_out, ref64, ref_same, *, port: str, device: str, dtype: str, what: str,
                    scores: bool = False, added: tuple = (None, None, None)) -> tolerance.Agreement:
    """Assert the policy of :mod:`equivalence.tolerance` for a model in ``dtype``, after checking the port's output
    kept its dtype: ``dtype`` itself, or with ``scores`` (log-probabilities, beam scores) ``score_dtype(dtype)``,
    float32 for bfloat16 and float16 models. ``ref_same`` is the reference's output in ``dtype``; ``added``, for a
    forward stage that is a map of earlier ones: (the map, the port's and the reference's stages), as
    :func:`equivalence.tolerance.stage_agreement` takes them."""
    port_out = np.asarray(port_out)
    expected = score_dtype(dtype) if scores else np.dtype(dtype)
    assert port_out.dtype == expected, f"{what}: {port} returned {port_out.dtype}, expected {expected} ({dtype} model)"
    result = tolerance.stage_agreement(port_out, ref64, ref_same, dtype, *added)
    assert result.ok, f"{port}/{device}/{dtype}/{what}: {result}"
    AGREEMENT_LOG[(port, device, dtype, what.split(":")[0])].append((result.error, result.bound))
    return result


def check_single_rounding(port_out, ref64, ref32, *, port: str, device: str, dtype: str, what: str) -> None:
    """Assert, element by element, that a bfloat16 or float16 concept rounded once is within
    :func:`equivalence.tolerance.single_rounding_bound` of the exact value ``ref64`` (``ref32``: the float32
    reference on the same inputs), after checking the port kept ``dtype``."""
    port_out = np.asarray(port_out)
    assert port_out.dtype == np.dtype(dtype), f"{what}: {port} returned {port_out.dtype}, asked for {dtype}"
    error = np.abs(port_out.astype(np.float64) - ref64)
    bound = tolerance.single_rounding_bound(port_out, ref64, ref32, dtype)
    worst = np.unravel_index(np.argmax(error / bound), error.shape)
    assert np.all(error <= bound), (f"{port}/{device}/{dtype}/{what}: element {worst} is {error[worst]:.3e} from the "
                                    f"exact value, over its single-rounding bound {bound[worst]:.3e}")
    check_decided_roundings(port_out, ref64, ref32, port=port, device=device, dtype=dtype, what=what)
    AGREEMENT_LOG[(port, device, dtype, what.split(":")[0] + " (rounded once)")].append((float(error[worst]),
                                                                                        float(bound[worst])))


def check_decided_roundings(rounded, ref64, ref32, *, port: str, device: str, dtype: str, what: str) -> int:
    """Assert that ``rounded`` (a port's values that the recipe rounds once to ``dtype``) equals the exact values
    ``ref64`` correctly rounded wherever the float32 bound leaves the rounding one answer
    (:func:`equivalence.tolerance.decided_by_rounding`); returns how many elements that held for."""
    decided = tolerance.decided_by_rounding(ref64, ref32, dtype)
    expected = round_to(ref64, dtype).astype(np.float64)
    wrong = decided & (np.asarray(rounded).astype(np.float64) != expected)
    assert not wrong.any(), (f"{port}/{device}/{dtype}/{what}: {int(wrong.sum())} of {int(decided.sum())} elements "
                             f"whose rounding has one answer are not the exact value rounded once, e.g. element "
                             f"{tuple(int(i) for i in np.argwhere(wrong)[0])}")
    assert decided.any(), f"{what}: the float32 bound leaves every rounding undecided; nothing was checked"
    return int(decided.sum())


@functools.cache
def reference_model_in(low: str, variant: str, dtype: str):
    """The NumPy reference in ``dtype`` with the seeded weights of ``cases.FORWARD_VARIANTS[variant]`` rounded to the
    low format ``low``: what a ``low`` model computes, exactly (float64), in float32, and by the recipe (``low``)."""
    config = cases.FORWARD_VARIANTS[variant]
    return rounded_reference(config, cases.seeded_params(config), low, dtype)


def rounded_reference(config, params: dict, low: str, dtype: str):
    """The NumPy reference in ``dtype`` with ``params`` rounded to the low format ``low``."""
    return reference.build(config, {name: round_to(value, low) for name, value in params.items()}, dtype)


def check_logits_rounding(log_probs, x, model_in, dtype: str, what: str) -> None:
    """The generator's logits are one rounding of the recipe. Given the generator's input ``x`` (numbers of
    ``dtype``: a component's input, or a port's own decoder output) and ``model_in(precision)``, the reference in
    ``precision`` with the port's weights (numbers of ``dtype``): where a logit's rounding has one answer
    (``tolerance.decided_by_rounding`` of x W, or x W + b with ``output_bias``, exact and in float32), a port's
    logit is the reference's, and its
    float32 log-probability ``L_i - logsumexp(L)`` the reference generator's on the same ``x`` within the float32
    bound of that computation plus what the row's undecided logits may move the logsumexp: each by one unit of
    ``dtype`` at most, weighted by its probability. A compiler that keeps the logits in float32 (XLA's "excess
    precision") is up to a unit off at decided logits, 10^3-10^4 times that bound."""
    x = np.asarray(x).astype(np.float64)
    exact, wide = model_in("float64").generator, model_in("float32").generator
    logits = x @ exact.weight + (0.0 if exact.bias is None else exact.bias)               # (B, T, V)
    wide_logits = x.astype(np.float32) @ wide.weight + (0.0 if wide.bias is None else wide.bias)
    decided = tolerance.decided_by_rounding(logits, wide_logits, dtype)
    assert decided.any(), f"{what}: no logit's rounding is decided; nothing was checked"
    expected = model_in(dtype).generator(x.astype(dtype))                                 # log_softmax(round(x W))
    undecided = np.sum(np.where(decided, 0.0, np.exp(expected) * spacing(round_to(logits, dtype), dtype)), axis=-1,
                       keepdims=True)                                                      # (B, T, 1)
    bound = tolerance.float32_bound(exact(x), wide(x.astype(np.float32))) + undecided
    error = np.abs(np.asarray(log_probs, dtype=np.float64) - expected)
    wrong = decided & (error > bound)
    assert not wrong.any(), (f"{what}: {int(wrong.sum())} log-probabilities of logits whose rounding has one answer "
                             f"are off the reference's on the same input, by up to {error[wrong].max():.3e} against "
                             f"the float32 bound (plus the undecided logits' share) {bound.max():.3e}")


# The memory one worker needs: its own peak in a whole run (the run's summary prints each worker's,
# pytest_terminal_summary) and the processes its tests start (a data-parallel run's, a document's interpreter, mypy),
# which do not all run at the same moment. ``--numprocesses=auto`` starts no more workers than the
# machine's memory holds at this much each.
WORKER_MEMORY = 8 * 2**30


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """``--numprocesses=auto`` (pyproject.toml): one pytest-xdist worker per core this process may use (its affinity:
    a container's or ``taskset``'s share, not the machine's count), as many as the machine's memory holds at
    :data:`WORKER_MEMORY` each, at least one. pytest-xdist's own ``PYTEST_XDIST_AUTO_NUM_WORKERS`` is kept."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None                                                  # pytest-xdist's own hook reads it
    return worker_count(runtime.visible_cores(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def worker_count(cores: int, memory: int) -> int:
    """Workers for ``cores`` cores and ``memory`` bytes: a core each, :data:`WORKER_MEMORY` each, at least one."""
    return max(1, min(cores, memory // WORKER_MEMORY))


def pytest_configure(config):
    """Each pytest-xdist worker runs on cores of its own (its share of this process's affinity), set before the test
    modules load a framework: PyTorch, XLA and TensorFlow size their thread pools by the cores a process may use,
    and two workers each running as many threads as the machine has cores spin while they wait for one. The CLI's
    ``--threads`` default follows the same affinity, and so do the processes a test starts. ``--cache-clear``
    empties the compilation cache too (in the controller, before any program is compiled)."""
    if config.getoption("cacheclear", default=False) and "PYTEST_XDIST_WORKER" not in os.environ:
        compile_cache.clear()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")
# The tests the default tier keeps whatever slow_tests.txt or a marker in their code says: each the test of a planted
# bug's selection that catches it (scripts/check_mutations.py), so that the default tier catches the plant.
KEPT_TESTS = Path(__file__).with_name("default_tier.txt")
# node id -> why the default tier leaves the test out (:func:`slow_reason`), and the tests this run's default tier
# left out; filled at collection (in pytest-xdist's workers, then handed to the controller).
SLOW_REASONS: dict[str, str] = {}
LEFT_OUT: list[str] = []


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the whole suite: the default tier and the tests marked slow (what CI runs)")


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` the tests ``slow_tests.txt`` names, and every test of a module it names (each took seconds in a
    run: ``scripts/slow_tests.py``), beside those marked in their code, but those ``default_tier.txt`` keeps; then,
    unless the run is whole (:func:`whole_suite`), leave them out: the default tier. In a pytest-xdist worker, put
    the units of work in the order they are handed out: the longest first (:func:`longest_first`), so that no long
    unit starts when the others are nearly done."""
    listed, kept = entries(SLOW_TESTS), entries(KEPT_TESTS)
    for item in items:
        if item.nodeid in kept:                             # -m "not slow" selects it too, as the default tier does
            item.own_markers = [mark for mark in item.own_markers if mark.name != "slow"]
            continue
        reason = slow_reason(item, listed)
        if reason:
            SLOW_REASONS[item.nodeid] = reason
            if item.get_closest_marker("slow") is None:
                item.add_marker(pytest.mark.slow)
    if not whole_suite(config):
        named = tuple(arg for arg in config.args if "::" in arg)
        left = [item for item in items if item.nodeid in SLOW_REASONS and not item.nodeid.startswith(named)]
        if left:
            config.hook.pytest_deselected(items=left)
            LEFT_OUT.extend(item.nodeid for item in left)
            remaining = set(items) - set(left)
            items[:] = [item for item in items if item in remaining]
    if hasattr(config, "workerinput"):
        order = longest_first([(item.nodeid, item.nodeid in SLOW_REASONS) for item in items],
                              config.workerinput["test_seconds"])
        items[:] = [items[index] for index in order]


def entries(listing: Path) -> set[str]:
    """The node ids and modules a list of tests names (one a line; ``#`` starts a comment line)."""
    return {line for line in listing.read_text().splitlines() if line and not line.startswith("#")}


def whole_suite(config) -> bool:
    """Whether every collected test runs: with ``--full``, or when a marker expression (``-m``) chooses for itself.
    Otherwise the run is the default tier: every test not marked ``slow``, and those the command line names by node
    id (``tests/test_x.py::test_y``) whether slow or not."""
    return bool(config.getoption("full") or config.getoption("markexpr"))


def slow_reason(item: pytest.Item, listed: set[str]) -> str | None:
    """Why the default tier leaves ``item`` out (None: it runs in the default tier). ``listed``: the node ids and
    modules ``slow_tests.txt`` names."""
    module = item.nodeid.split("::")[0]
    if item.get_closest_marker("slow") is not None:
        return "marked slow in its code (a whole run, an export, a fresh interpreter)"
    if module in listed:
        return "its module's shared set-up took 10 s or more in a timed run (tests/slow_tests.txt)"
    if item.nodeid in listed:
        return "took 0.7 s or more in a timed run (tests/slow_tests.txt)"
    if other_matrix_variant(item):
        return (f"the agreement matrix on the variant {item.callspec.params['variant']}: the same code the tier "
                f"runs on `tiny`, on another configuration")
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """In the pytest-xdist controller: the tests' times of the run before (one reading of pytest's cache) for every
    worker, so that all of them order their collection alike (pytest-xdist requires the same list from each)."""
    cache = getattr(node.config, "cache", None)
    node.workerinput["test_seconds"] = cache.get(TEST_SECONDS, {}) if cache else {}


# The seconds each test took in the last run that ran it (pytest's cache, .pytest_cache in the checkout), and the
# guesses for a test no run has timed: one marked slow (most take 1-30 s) and any other (most under 0.5 s).
TEST_SECONDS = "transformer-reference/test-seconds"
SLOW_GUESS, QUICK_GUESS = 6.0, 0.3


def longest_first(tests: list[tuple[str, bool]], seconds: dict[str, float]) -> list[int]:
    """The indices of ``tests`` (node id, marked slow) with the units of work (:func:`work_unit`) ordered by the
    time their tests took (``seconds``; a guess for a test not there), the longest first; each unit's tests keep
    their order. pytest-xdist hands the units out in this order (:func:`pytest_xdist_make_scheduler`), so that no
    long unit starts when the other workers are nearly done: with more workers than two, the run ends sooner than in
    pytest-xdist's own order (the units with the most tests first)."""
    units: dict[str, list[int]] = defaultdict(list)
    time: dict[str, float] = defaultdict(float)
    for index, (nodeid, slow) in enumerate(tests):
        unit = work_unit(nodeid)
        units[unit].append(index)
        time[unit] += seconds.get(nodeid, SLOW_GUESS if slow else QUICK_GUESS)
    ranked = sorted(units, key=lambda unit: -time[unit])
    return [index for unit in ranked for index in units[unit]]


def pytest_runtest_logreport(report):
    """In the controller (pytest-xdist's, or the one process of ``-n0``): each test's set-up, call and tear-down."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        RUN_SECONDS[report.nodeid] += report.duration


# The modules split into several units of work, by port and dtype: their parts share no compiled program.
SPLIT_MODULES = ("tests/equivalence/test_agreement.py",)
DTYPE_NAMES = tuple(dtype.name for dtype in DTYPES)                 # the formats a model is stored in


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs whole: a test module, whose tests share their models, compiled programs and
    reference outputs (dropped at its end: :func:`pytest_runtest_teardown`); the agreement matrix by port and dtype
    (each (port, variant, dtype) model compiles programs of its own; the reference's outputs are all they share).
    As one unit, the matrix would keep one worker busy for over half the run while the others ran every other
    module."""
    module, _, test = nodeid.partition("::")
    if module not in SPLIT_MODULES:
        return module
    ids = test.partition("[")[2].rstrip("]").split("-")               # the port's fixture first, then the test's
    return f"{module}[{ids[0]}-{next((name for name in ids if name in DTYPE_NAMES), '')}]"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist=loadfile`` (``pyproject.toml``) by :func:`work_unit`: pytest-xdist's scheduling by scope, the largest
    units first, each worker given a new unit as it finishes one; any other ``--dist`` is pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False               # the order of the collection: longest_first's

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


def other_matrix_variant(item: pytest.Item) -> bool:
    """The agreement matrix (test_agreement.py) on a model variant other than ``tiny``: the same code of every port
    on another configuration (pre-LN, learned positions, the families' choices...), each variant compiling its own
    programs in JAX and TensorFlow (most of the matrix's time). The default tier keeps ``tiny``; the whole suite
    (``--full``) runs every variant."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return item.nodeid.startswith("tests/equivalence/test_agreement.py::") and params.get("variant", "tiny") != "tiny"


def pytest_runtest_teardown(item, nextitem):
    """After the last test of a module in this process: drop what its tests and the shared helpers cached (models,
    their compiled functions, reference outputs) and give the freed memory back, so that a worker running many
    modules holds one module's caches at a time, not all of them: the agreement matrix alone caches ~4 GB, and
    every module's together are more than a worker's share of the machine's memory. What survives the collection
    (the frameworks' modules and their registries: millions of objects by the end of a run) is moved out of the
    collector's sight (``gc.freeze``), so that the next module's collection, and pytest's own two at the end of a
    worker, walk only what was made since: a walk of the whole heap takes seconds, and at the end pytest-xdist stops
    a worker whose last steps take over 5 s with a SIGINT (printed as a KeyboardInterrupt)."""
    if nextitem is not None and getattr(nextitem, "module", None) is getattr(item, "module", None):
        return
    namespaces = (getattr(item, "module", None), sys.modules.get("support"), sys.modules[__name__])
    for namespace in filter(None, namespaces):
        for value in list(vars(namespace).values()):
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    gc.freeze()
    release_freed_memory()


def pytest_sessionfinish(session):
    """In a pytest-xdist worker: hand this worker's agreement log and peak memory to the controller, which prints
    them. In the controller: keep each test's time for the next run's order (:func:`longest_first`)."""
    cache = getattr(session.config, "cache", None)
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["agreement"] = [[list(key), [[float(error), float(bound)] for error, bound in rows]]
                                                    for key, rows in AGREEMENT_LOG.items()]
        session.config.workeroutput["peak_memory"] = peak_memory()
        session.config.workeroutput["tier"] = [SLOW_REASONS, LEFT_OUT]
    elif RUN_SECONDS and cache:
        cache.set(TEST_SECONDS, {**cache.get(TEST_SECONDS, {}), **RUN_SECONDS})


def peak_memory() -> int:
    """This process's peak resident memory, in bytes (``getrusage``: kilobytes on Linux). Not its children's: a
    child forked from it counts every page it shares with the worker as its own."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the pytest-xdist controller: gather a finished worker's agreement log and peak memory."""
    output = getattr(node, "workeroutput", {})
    for key, rows in output.get("agreement", []):
        AGREEMENT_LOG[tuple(key)].extend(tuple(row) for row in rows)
    if "peak_memory" in output:
        PEAK_MEMORY[node.gateway.id] = output["peak_memory"]
    if "tier" in output:                           # every worker collects the whole selection: the same lists
        reasons, left_out = output["tier"]
        SLOW_REASONS.update(reasons)
        LEFT_OUT[:] = left_out


def pytest_terminal_summary(terminalreporter):
    tier_summary(terminalreporter)
    if PEAK_MEMORY:
        peaks = ", ".join(f"{worker} {peak / 2**30:.1f} GiB" for worker, peak in sorted(PEAK_MEMORY.items()))
        terminalreporter.write_line(f"peak memory of each worker: {peaks}")
    if not AGREEMENT_LOG:
        return
    terminalreporter.section("agreement with the reference (worst error / bound)")
    header = ("port", "device", "dtype", "check", "n", "max error", "worst ratio")
    rows = []
    for key, log in sorted(AGREEMENT_LOG.items()):
        errors, bounds = np.array(log).T
        rows.append((*key, str(len(log)), f"{errors.max():.2e}", f"{np.max(errors / bounds):.3f}"))
    widths = [max(len(row[column]) for row in (header, *rows)) for column in range(len(header))]
    for row in (header, *rows):            # text columns to the left, numbers to the right, each as wide as it needs
        terminalreporter.write_line("  ".join(cell.ljust(width) if column < 4 else cell.rjust(width)
                                              for column, (cell, width) in enumerate(zip(row, widths))).rstrip())


def tier_summary(terminalreporter) -> None:
    """Say what the default tier left out, and why each failed test that only the whole suite runs is slow."""
    failed = [report.nodeid for report in terminalreporter.stats.get("failed", []) if report.nodeid in SLOW_REASONS]
    if failed:
        terminalreporter.section("failed tests that the default tier leaves out")
        for nodeid in failed:
            terminalreporter.write_line(f"{nodeid}: {SLOW_REASONS[nodeid]}")
    if LEFT_OUT:
        terminalreporter.write_line(f"default tier: {len(LEFT_OUT)} tests marked slow left out; `pytest --full` runs "
                                    f"the whole suite, as CI does")


@pytest.fixture(autouse=True)
def environment_kept() -> Iterator[None]:
    """Each test leaves the process's environment as it found it. A command run in the test process through
    ``main(argv)`` before JAX's first operation in the process writes its ``--threads`` into the environment
    (``PJRT_NPROC``, ``XLA_FLAGS``: equivalence/runtime.py; ``train --data-parallel``'s host devices too; after
    it, the command leaves them alone), and JAX hashes ``XLA_FLAGS`` into the key of every program it compiles: left
    behind, it would change the keys of every later program in that worker, so that whether a JAX program is read
    back from the compilation cache would depend on which modules had run before in the same process."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        for name in os.environ.keys() - saved.keys():
            del os.environ[name]
        os.environ.update(saved)


@pytest.fixture(scope="session")
def agreement():
    return check_agreement


@pytest.fixture(scope="session")
def single_rounding():
    return check_single_rounding


@pytest.fixture(scope="session")
def logits_rounding():
    return check_logits_rounding


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> dict:
    """A tiny random Marian model with its SentencePiece tokenizer, imported (support.tiny_marian), per module."""
    return tiny_marian(tmp_path_factory.mktemp("marian"))


@pytest.fixture(scope="module")
def m2m100(tmp_path_factory) -> dict:
    """A tiny random M2M100 model with its tokenizer and language codes, imported (support.tiny_m2m100)."""
    return tiny_m2m100(tmp_path_factory.mktemp("m2m100"))


@pytest.fixture(scope="module")
def separate_marian(tmp_path_factory) -> dict:
    """A tiny random Marian model with separate source and target vocabularies, every weight random (its sentences
    translate apart), imported (support.tiny_separate_marian), per module."""
    for library in ("torch", "transformers", "sentencepiece"):
        pytest.importorskip(library, reason=f"{library} is not installed: the Marian directory is built with it")
    return tiny_separate_marian(tmp_path_factory.mktemp("separate-marian"))


@pytest.fixture(scope="module", params=[False, True], ids=["nllb", "nllb-legacy"])
def nllb(request, tmp_path_factory) -> dict:
    """A tiny NLLB model and tokenizer (``legacy_behaviour`` as the parameter), imported (support.tiny_nllb), per
    module."""
    return tiny_nllb(tmp_path_factory.mktemp("nllb"), request.param)


@pytest.fixture(scope="module")
def pegasus(tmp_path_factory) -> dict:
    """A tiny random Pegasus model with its tokenizer, imported (support.tiny_pegasus), per module."""
    return tiny_pegasus(tmp_path_factory.mktemp("pegasus"))


@pytest.fixture(scope="module")
def bart(tmp_path_factory) -> dict:
    """A tiny random BART model with its byte-level BPE tokenizer and bart-large-cnn's generation config, imported
    (support.tiny_bart), per module."""
    return tiny_bart(tmp_path_factory.mktemp("bart"))


@pytest.fixture(scope="module")
def mbart50(tmp_path_factory) -> dict:
    """A tiny random mBART-50 model with its tokenizer, language codes and published generation config, imported
    (support.tiny_mbart50), per module."""
    return tiny_mbart50(tmp_path_factory.mktemp("mbart50"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved_family(request, tmp_path_factory) -> tuple:
    """A tiny random model of each Hugging Face family saved and imported (support.imported_family), per module:
    (family, transformers' model, its save_pretrained directory, the imported checkpoint)."""
    return imported_family(request.param, tmp_path_factory.mktemp(request.param))
