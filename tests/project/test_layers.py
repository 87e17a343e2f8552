"""The packages import only downward (docs/ports.md, "Layers"): the command line over the benchmarks, over the
exporters, over the tasks, over the harness, over the three ports, over the NumPy reference; the ports import
nothing from each other. import-linter checks the layers contract of ``[tool.importlinter]`` in pyproject.toml, on
the sources as they are and on copies into which an import against the layers is planted."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["importlinter"]["root_packages"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                                reason="import-linter is not installed (it comes with the `test` extra)")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` run in ``root``, which it puts first on the import path: the packages it reads are ``root``'s,
    whatever this interpreter has installed."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], capture_output=True, text=True, cwd=root,
                          timeout=120)


def test_the_layers_contract_names_every_package_once():
    """Every package the distribution installs is in exactly one layer, so that none escapes the contract."""
    (contract,) = PYPROJECT["tool"]["importlinter"]["contracts"]
    assert contract["type"] == "layers"
    named = [package.strip() for layer in contract["layers"] for package in layer.split("|")]
    installed = [name for name in PYPROJECT["tool"]["setuptools"]["packages"] if "." not in name]
    assert sorted(named) == sorted(installed) == sorted(PACKAGES)
    assert named[0] == "transformer_cli" and named[-1] == "reference_numpy"


def test_the_packages_import_only_downward():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


# (module, import planted at its top, the import the contract must name): one upward, one between two ports, one
# from the harness up to the exporters
PLANTS = {
    "upward": ("reference_numpy/model.py", "import transformer_cli", "reference_numpy.model -> transformer_cli"),
    "sideways": ("transformer_torch/model.py", "import transformer_jax", "transformer_torch.model -> transformer_jax"),
    "harness": ("equivalence/oracle.py", "from transformer_export import outputs",
                "equivalence.oracle -> transformer_export.outputs"),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_an_import_against_the_layers_breaks_the_contract(tmp_path, plant):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module, line, named = PLANTS[plant]
    path = tmp_path / module
    path.write_text(f"{line}  # noqa\n{path.read_text()}")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 1 broken" in result.stdout and named in result.stdout, result.stdout
