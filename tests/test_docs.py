"""Every Python example in the README and docs/ runs as written (blocks of one file in order,
sharing one namespace, in a scratch directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [p for p in DOCUMENTS if python_blocks(p)], ids=lambda p: p.name)
def test_examples_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    for number, block in enumerate(python_blocks(path), start=1):
        try:
            exec(compile(block, f"{path.name} block {number}", "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - report which block failed
            raise AssertionError(f"{path.name}, python block {number} fails: {type(err).__name__}: {err}") from err
