"""The project as a newcomer meets it: the README's two commands, CI, packaging."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from support import script

import reference_numpy

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = [name for name in PYPROJECT["tool"]["setuptools"]["packages"] if "." not in name]  # subpackages ship inside
# package -> the framework module it needs (None: NumPy only)
FRAMEWORKS = {"reference_numpy": None, "transformer_cli": None, "equivalence": None, "transformer_tasks": None,
              "transformer_export": None, "transformer_bench": None, "transformer_hf": None,
              "transformer_torch": "torch", "transformer_jax": "flax", "transformer_tf": "keras"}


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv .*?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands_main_job_then_tests():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("transformer-reference compare")
    assert commands[1].endswith("python -m pytest")
    assert all("-c constraints.txt" in command for command in commands)


def test_ci_runs_the_readmes_test_command_on_the_whole_suite():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"{readme_commands()[1]} --full" in ci


def collected(*args: str) -> list[str]:
    """The node ids ``pytest --collect-only`` selects with ``args`` (one process, tests/conftest.py's tiers)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n0",
                           *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_default_tier_leaves_out_the_slow_tests_and_full_runs_them():
    """``pytest`` runs the default tier: the tests not marked slow (in their code, by tests/slow_tests.txt, or the
    agreement matrix's other variants); ``--full`` every test; a marker expression (``-m``) chooses for itself, and a
    test named by node id runs whatever its tier."""
    module = "tests/cli/test_export.py"
    tier, full = collected(module), collected(module, "--full")
    slow = collected(module, "-m", "slow")
    assert tier and slow and sorted(tier + slow) == sorted(full)
    assert collected(module, "-m", "not slow") == tier
    assert collected(slow[0]) == [slow[0]]
    from conftest import KEPT_TESTS, entries

    matrix = collected("tests/equivalence/test_agreement.py", "-k",
                       "test_forward_stages and cpu and float64 and ragged_batch")
    assert matrix and all(test.endswith("-tiny]") or test in entries(KEPT_TESTS) for test in matrix)


def test_the_tests_the_default_tier_keeps_exist_and_run_in_it():
    """Each test tests/default_tier.txt names is collected, and in the default tier, which ``-m "not slow"`` selects
    too (a kept test loses the slow marker of its code)."""
    from conftest import KEPT_TESTS, entries

    kept = entries(KEPT_TESTS)
    modules = sorted({test.split("::")[0] for test in kept})
    tier, not_slow = set(collected(*modules)), set(collected(*modules, "-m", "not slow"))
    assert kept and kept <= tier and tier == not_slow, sorted(kept - tier)


def test_packaging_declares_every_backend_and_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert {"torch", "jax", "tf", "all", "test"} <= set(extras)
    packages = project["tool"]["setuptools"]["packages"]
    assert {"reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf"} <= set(packages)
    assert project["project"]["scripts"]["transformer-reference"] == "transformer_cli.main:main"
    assert not any(dep.startswith("torch") for dep in project["project"]["dependencies"])


def test_constraints_pin_the_cpu_torch_only_for_the_test_path():
    constraints = (ROOT / "constraints.txt").read_text()
    assert "torch==2.13.0" in constraints
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "==" not in "".join(extras["torch"])


def test_every_package_has_the_installed_distributions_version():
    """One version, defined in reference_numpy and read by pyproject.toml; every package exposes it."""
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "reference_numpy.__version__"}
    assert reference_numpy.__version__ == importlib.metadata.version("transformer-reference")
    assert set(FRAMEWORKS) == set(PACKAGES)


@pytest.mark.parametrize("package", FRAMEWORKS)
def test_each_package_exposes_the_version(package):
    if FRAMEWORKS[package]:
        pytest.importorskip(FRAMEWORKS[package], reason=f"{package} needs {FRAMEWORKS[package]}, not installed here")
    assert importlib.import_module(package).__version__ == importlib.metadata.version("transformer-reference")


def test_every_package_is_marked_typed():
    """PEP 561: a py.typed marker in every package, declared as package data so that it is installed (beside the
    shipped model)."""
    assert PYPROJECT["tool"]["setuptools"]["package-data"]["*"] == ["py.typed"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package


def test_a_built_wheel_holds_the_markers_and_the_version(tmp_path):
    """The wheel that ``pip install`` installs, built from a copy of the sources with the
    installed setuptools (no network)."""
    pytest.importorskip("setuptools", reason="building a wheel needs setuptools")
    source = tmp_path / "source"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--no-index", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert {f"{package}/py.typed" for package in PACKAGES} <= set(files)
    metadata = zipfile.ZipFile(wheel).read(f"transformer_reference-{reference_numpy.__version__}.dist-info/METADATA")
    assert f"\nVersion: {reference_numpy.__version__}\n" in metadata.decode()


def test_the_code_passes_the_linter_configured_in_pyproject():
    """ruff, with the rules of ``[tool.ruff]`` in pyproject.toml, over every package, script and test."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All checks passed" in result.stdout


# 102 s on a clean clone, beside the other worker (3 s with the .mypy_cache of an earlier run): mypy checks every
# package against the frameworks' own stubs.
def test_the_code_passes_the_type_checker_mypy_configured_in_pyproject():
    """mypy, with ``[tool.mypy]`` in pyproject.toml, over every package: each ships ``py.typed``, so its
    annotations are part of the public API and must be true."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it comes with the `test` extra)")
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success: no issues found")


def imported_modules(node: ast.AST) -> list[str]:
    """The modules an import statement names (``from . import x`` names ``x``); none for any other node."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module else [alias.name for alias in node.names]
    return []


def test_no_test_module_imports_another():
    """What test modules share lives in tests/helpers/support.py (fixtures in conftest.py): a test module imported by
    another runs its module-level code, and its tests' helpers become another file's API."""
    offenders = [f"{path.name}:{node.lineno} imports {module}" for path in sorted((ROOT / "tests").rglob("test_*.py"))
                 for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                 for module in imported_modules(node) if any(part.startswith("test_") for part in module.split("."))]
    assert offenders == [], "move what they use into tests/helpers/support.py: " + "; ".join(offenders)


def project_import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, read with ``ast`` from every module of PACKAGES (imports inside
    functions too): ``from . import x``, ``from .x import y`` and ``import pkg.x`` name ``pkg.x``, or ``pkg.x.y`` when
    ``y`` is a module; an import of a name a module does not have (a class, a function) names the module."""
    def name(path: Path) -> str:
        parts = path.relative_to(ROOT).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}

    def imports(module: str, path: Path) -> set[str]:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                anchor = package.split(".")[:len(package.split(".")) + 1 - node.level] if node.level else []
                base = ".".join([*anchor, *filter(None, [node.module])])
                found |= {f"{base}.{alias.name}" for alias in node.names}
        return {owner for owner in map(project_module, found) if owner and owner != module}

    def project_module(target: str) -> str:
        """The longest prefix of a dotted name that is a project module ("" if none)."""
        while target and target not in files:
            target = target.rpartition(".")[0]
        return target

    return {module: imports(module, path) for module, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle a depth-first search meets, as its path (first module repeated at the end)."""
    cycles, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_no_import_cycle_between_the_projects_modules():
    """A module of the packages never imports, even inside a function, one that imports it back (directly or through
    others): each module has a place below the ones that use it."""
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]   # the search itself
    graph = project_import_graph()
    assert {"reference_numpy.training", "transformer_cli.main"} <= set(graph)
    assert "reference_numpy.model" in graph["reference_numpy.training"]
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_suite_computes_with_the_pinned_openblas_kernel():
    """tests/conftest.py pins OpenBLAS's kernel (OPENBLAS_CORETYPE) before NumPy loads it: the kernel NumPy's
    OpenBLAS reports is the pinned one, so the reference's last bits are the same on every x86-64 host."""
    import ctypes
    import glob
    import os

    import numpy as np

    pinned = os.environ.get("OPENBLAS_CORETYPE")
    libraries = glob.glob(os.path.join(os.path.dirname(np.__path__[0]), "numpy.libs", "libscipy_openblas*"))
    if not pinned or not libraries:
        pytest.skip("no OpenBLAS kernel pinned on this platform, or NumPy is not built with scipy-openblas")
    corename = ctypes.CDLL(libraries[0]).scipy_openblas_get_corename64_
    corename.restype = ctypes.c_char_p
    assert corename().decode().lower() == pinned.lower()


def test_the_run_keeps_its_compiled_programs_for_the_next_one_per_cpu(tmp_path, monkeypatch):
    """tests/conftest.py points JAX at the checkout's cache of this machine's CPU (a user's own directory kept); the
    directory names the CPU; past its limit it starts again empty, under it it is kept; ``clear`` removes every
    machine's."""
    import os

    import compile_cache

    run_cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if run_cache.parent != ROOT / ".compile-cache":
        pytest.skip("the run's JAX compilation cache is the user's own JAX_COMPILATION_CACHE_DIR")
    assert run_cache.name == f"jax-{compile_cache.cpu_fingerprint()}"     # read, not pruned: the run is using it
    with monkeypatch.context() as another_machine:
        another_machine.setattr(Path, "read_text", lambda path: "model name : A\nflags : sse avx2\n")
        other_cpu = compile_cache.cpu_fingerprint()
    monkeypatch.setattr(compile_cache, "ROOT", tmp_path)
    cache = compile_cache.directory()
    assert cache.name == f"jax-{compile_cache.cpu_fingerprint()}" and other_cpu != compile_cache.cpu_fingerprint()
    cache.mkdir()
    (cache / "program-cache").write_bytes(bytes(10))
    monkeypatch.setattr(compile_cache, "LIMIT", 10)
    assert compile_cache.directory() == cache and (cache / "program-cache").exists()        # at the limit: kept
    monkeypatch.setattr(compile_cache, "LIMIT", 9)
    assert compile_cache.directory() == cache and not cache.exists()                       # past it: started again
    (tmp_path / "jax-another-cpu").mkdir()
    compile_cache.clear()
    assert not tmp_path.exists()


def test_the_scripts_pytest_runs_configure_without_the_cache_provider():
    """scripts/kernel_families.py, check_mutations.py and slow_tests.py run pytest with ``-p no:cacheprovider`` (no
    ``--cache-clear`` option then): tests/conftest.py configures all the same, and the selected test runs."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n0",
                           f"{Path(__file__).relative_to(ROOT)}::test_ci_runs_the_readmes_test_command_on_the_whole_suite"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_ci_also_runs_the_numerical_tests_under_another_kernel_family():
    """.ci/run runs scripts/kernel_families.py for a family other than the machine's own (docs/equivalence.md,
    "Portable numerics")."""
    ci = (ROOT / ".ci" / "run").read_text()
    family = re.search(r"scripts/kernel_families\.py --family ([\w-]+)", ci)
    assert family and family.group(1) != "native"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the families cap x86-64 ISAs")
def test_each_kernel_family_caps_what_the_frameworks_select():
    """scripts/kernel_families.py's environments take effect: under "sse" PyTorch runs ATen's default kernels, NumPy
    its baseline loops and oneDNN SSE4.1; under "avx2" none of them reaches AVX-512; the family CI runs
    ("below-native") makes PyTorch select other kernels than it does on this CPU uncapped."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        families = importlib.import_module("kernel_families")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    probes = {name: families.probe(name) for name in ("native", "avx2", "sse")}
    sse, avx2 = probes["sse"], probes["avx2"]
    assert "torch capability: DEFAULT | numpy SIMD: baseline" in sse and "oneDNN: Intel SSE4.1" in sse, sse
    assert not any(isa in avx2 for isa in ("capability: AVX512", "X86_V4", "AVX-512", "AVX10", "AMX")), avx2
    capability = {name: re.search(r"torch capability: (\w+)", found).group(1) for name, found in probes.items()}
    if capability["native"] != "DEFAULT":                  # a CPU without AVX2 has no family below its own
        assert capability[families.below_native()] != capability["native"], probes


def test_the_inner_loop_leaves_out_the_tests_a_durations_report_shows_slow(tmp_path):
    """scripts/slow_tests.py sums each test's set-up, call and teardown in pytest's --durations report (ids with
    spaces included) and lists those at or over the threshold, over several reports; a module with a long set-up
    leaves whole; the list it keeps has only test ids and module paths."""
    slow_tests = script("slow_tests")
    report = ("============ slowest durations ============\n"
              "1.50s setup    tests/test_a.py::test_x[a b]\n"
              "0.60s call     tests/test_a.py::test_x[a b]\n"
              "1.99s call     tests/test_b.py::test_y\n"
              "(3 durations < 0.005s hidden.  Use -vv to show these durations.)\n")
    seconds = slow_tests.durations(report)
    assert seconds == pytest.approx({"tests/test_a.py::test_x[a b]": 2.1, "tests/test_b.py::test_y": 1.99})
    assert slow_tests.slow_tests(seconds, 2.0) == ["tests/test_a.py::test_x[a b]"]
    inner = "12.00s setup    tests/test_c.py::test_z\n0.10s call     tests/test_c.py::test_w\n"
    entries, longest = slow_tests.slow_entries([report, inner], 1.6, 10.0)
    assert entries == ["tests/test_c.py", "tests/test_a.py::test_x[a b]", "tests/test_b.py::test_y"]
    assert longest["tests/test_c.py::test_z"] == 12.0
    listed = [line for line in slow_tests.SLOW_TESTS.read_text().splitlines() if not line.startswith("#")]
    assert listed and all(re.fullmatch(r"tests/\w+/test_\w+\.py(::test_\w+(\[.*\])?)?", line) for line in listed)


def test_the_workers_are_one_per_core_as_many_as_the_memory_holds():
    """tests/conftest.py's worker_count for ``--numprocesses=auto``: a core each, WORKER_MEMORY each, at least one."""
    from conftest import WORKER_MEMORY, worker_count

    assert worker_count(2, 24 * 2**30) == 2
    assert worker_count(16, 4 * WORKER_MEMORY + WORKER_MEMORY // 2) == 4
    assert worker_count(16, WORKER_MEMORY - 1) == worker_count(1, 64 * WORKER_MEMORY) == 1


def test_the_units_of_work_are_handed_out_the_longest_first():
    """tests/conftest.py's longest_first: units ordered by their tests' times from a run before, a guess for a test
    not timed (slow or not), each unit's tests in their own order."""
    from conftest import QUICK_GUESS, SLOW_GUESS, longest_first

    tests = [("tests/test_a.py::test_1", False), ("tests/test_b.py::test_1", True), ("tests/test_a.py::test_2", False),
             ("tests/equivalence/test_agreement.py::test_x[jax-cpu-float32-tiny]", False),
             ("tests/test_c.py::test_1", False)]
    assert longest_first(tests, {}) == [1, 0, 2, 3, 4]                     # b: one slow test; a: two quick ones
    timed = {"tests/test_a.py::test_1": 1.0, "tests/test_c.py::test_1": 40.0,
             "tests/equivalence/test_agreement.py::test_x[jax-cpu-float32-tiny]": SLOW_GUESS + QUICK_GUESS}
    assert longest_first(tests, timed) == [4, 3, 1, 0, 2]                  # c 40 s; the matrix's unit; b; a 1.3 s


def test_a_module_is_one_unit_of_work_and_the_agreement_matrix_one_per_port_and_dtype():
    """tests/conftest.py's work_unit: what one pytest-xdist worker runs whole."""
    from conftest import work_unit

    assert work_unit("tests/ports/test_jax.py::test_x[float32-jax]") == "tests/ports/test_jax.py"
    assert work_unit("tests/cli/test_cli.py::test_y") == "tests/cli/test_cli.py"
    assert work_unit("tests/equivalence/test_agreement.py::test_component[jax-cpu-bfloat16-tiny-attention-none]") == \
        "tests/equivalence/test_agreement.py[jax-bfloat16]"
    assert work_unit("tests/equivalence/test_agreement.py::test_attention_weights[tf-gpu-encoder-float16-pre_ln]") == \
        "tests/equivalence/test_agreement.py[tf-float16]"
    matrix = "tests/equivalence/test_agreement.py"
    assert work_unit(f"{matrix}::test_layer_norm_with_a_large_common_offset_float32[torch-cpu-tiny]") == \
        f"{matrix}[torch-]"


def test_every_plants_selection_names_test_files_that_exist():
    """A planted bug's selection of a moved or renamed test file collects nothing: ``--list`` refuses it."""
    mutations = script("check_mutations")
    assert mutations.missing_test_files(mutations.MUTATIONS) == []
    moved = dataclasses.replace(mutations.MUTATIONS[0], catch=("tests/test_gone.py", "-k", "x"))
    assert mutations.missing_test_files([moved]) == ["tests/test_gone.py"]
