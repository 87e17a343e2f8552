"""The project as a newcomer meets it: the README's two commands, CI, packaging."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv .*?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands_main_job_then_tests():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("transformer-reference compare")
    assert commands[1].endswith("python -m pytest")
    assert all("-c constraints.txt" in command for command in commands)


def test_ci_runs_the_readmes_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


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
    assert "==" not in "".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"])
