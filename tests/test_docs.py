"""Every Python example in the README and docs/ runs as written (blocks of one file in order, sharing one
namespace, in a scratch directory). Each file runs in an interpreter of its own, as a reader's session would: an
example that sets process-wide state (``jax_enable_x64``, thread counts) leaves the test process untouched."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = r"```python\n(.*?)```"

# Run in a fresh interpreter: argv[1] the document; a failing block is named on stderr, exit status 1.
RUN_BLOCKS = f"""
import re, sys
from pathlib import Path
path = Path(sys.argv[1])
namespace = {{"__name__": "__doc_example__"}}
for number, block in enumerate(re.findall({BLOCKS!r}, path.read_text(), flags=re.S), start=1):
    try:
        exec(compile(block, f"{{path.name}} block {{number}}", "exec"), namespace)
    except Exception as err:
        sys.exit(f"{{path.name}}, python block {{number}} fails: {{type(err).__name__}}: {{err}}")
"""


def python_blocks(path: Path) -> list[str]:
    return re.findall(BLOCKS, path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [p for p in DOCUMENTS if python_blocks(p)], ids=lambda p: p.name)
def test_examples_run(path, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS, str(path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_failing_block_is_reported_by_its_number(tmp_path):
    """The runner above can fail, and names the block."""
    document = tmp_path / "doc.md"
    document.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS, str(document)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().endswith("doc.md, python block 2 fails: AssertionError: x is 1")
