"""tests/ mirrors the code (docs/testing.md, "The layout"): a folder of tests for each layer it checks, the project's
own checks in tests/project/, and the helpers and runners the tests share apart from them; the command line is driven
from tests/cli/ alone, as only the command line imports it (pyproject.toml's layers, tests/project/test_layers.py)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Each folder of tests and the packages whose code it checks; project: the repository itself (its documents, layers,
# parallel texts, packaging).
FOLDERS = {"reference": ("reference_numpy",), "ports": ("transformer_torch", "transformer_jax", "transformer_tf"),
           "equivalence": ("equivalence",), "families": ("transformer_hf",), "export": ("transformer_export",),
           "tasks": ("transformer_tasks",), "benchmarks": ("transformer_bench",), "cli": ("transformer_cli",),
           "project": ()}
# What the tests share (tests/helpers: support.py, compile_cache.py, shipped.py) and the scripts they start in
# processes of their own (tests/runners): on pytest's path (pyproject.toml's pythonpath), never collected.
APART = ("helpers", "runners")


def modules(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def imports_the_command_line(path: Path) -> bool:
    """Whether ``path`` imports ``transformer_cli`` (anywhere in the module, a function's own imports included)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name == "transformer_cli" or name.startswith("transformer_cli.") for name in names):
            return True
    return False


def test_every_folder_of_tests_checks_a_layer_or_holds_what_they_share():
    folders = {path.name for path in TESTS.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders - {*FOLDERS, *APART} == set(), "a folder of tests/ that is neither a layer's nor the helpers'"
    assert all((ROOT / package / "__init__.py").is_file() for packages in FOLDERS.values() for package in packages)
    tests = [path.relative_to(TESTS) for path in TESTS.rglob("test_*.py")]
    assert tests and all(len(path.parts) == 2 and path.parts[0] in FOLDERS for path in tests), \
        [str(path) for path in tests if len(path.parts) != 2 or path.parts[0] not in FOLDERS]
    assert not [path for folder in APART for path in (TESTS / folder).glob("test_*.py")]


def test_test_modules_have_names_of_their_own():
    """pytest imports each test module by its name alone (rootdir-relative folders are not packages): two of one
    name in different folders would clash."""
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []


def test_only_the_tests_of_the_command_line_import_it():
    """Every other folder checks its layer through the layer's own functions; a helper that imports the command
    line lives in tests/cli/ too."""
    importing = [path.relative_to(TESTS) for path in modules(TESTS) if imports_the_command_line(path)]
    assert importing and {path.parts[0] for path in importing} == {"cli"}, [str(path) for path in importing]


def test_the_import_finder_sees_every_kind_of_import(tmp_path):
    """What the check above takes for an import of the command line, and what not."""
    module = tmp_path / "module.py"
    for code, found in (("import transformer_cli.main", True), ("from transformer_cli import plots", True),
                        ("def f():\n    from transformer_cli.main import main", True),
                        ("import transformer_clinic", False), ('NAME = "transformer_cli"', False),
                        ("from support import cli", False)):
        module.write_text(code + "\n")
        assert imports_the_command_line(module) == found, code
