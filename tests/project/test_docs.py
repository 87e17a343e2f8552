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

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = r"```python\n(.*?)```"
# The documents whose examples compile programs (each port's forward pass, decoders, gradient and training steps;
# torch.compile; the data-parallel runs): over ~10 s alone. Each takes over 30 s in a whole run, beside the other
# worker (with the compilation cache filled: distributed.md 56 s, tf.md 48, jax.md 47, README.md 35, torch.md 34; on a
# clean clone jax.md 138 s, distributed.md 65, README.md 61, tf.md 54, torch.md 50): a document runs in a fresh
# interpreter, as a reader's session does, which shares none of its compilations with the tests that make the same
# ones.
SLOW = {"README.md", "distributed.md", "jax.md", "tf.md", "torch.md"}

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


@pytest.fixture(scope="module")
def reader_environment() -> dict[str, str]:
    """The examples' environment (a value the user set is kept): the repository on the path; one OpenMP thread
    (PyTorch's intra-op threads, OpenBLAS's), since the examples' ``tiny`` models gain nothing from a second thread,
    which only spins on a CPU shared with another test process (beside one busy process, torch.md took 22 s of CPU
    on two threads, 13 s on one); and the run's JAX persistent compilation cache (tests/conftest.py), so that a
    program compiled again is read back (jax.md resumes training on a loaded model: the same training step under
    another NNX GraphDef, which nnx.jit traces again)."""
    settings = {"OMP_NUM_THREADS": "1"}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**settings, **os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
                                  for p in DOCUMENTS if python_blocks(p)])
def test_examples_run(path, tmp_path, reader_environment):
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS, str(path)], cwd=tmp_path, env=reader_environment,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


def test_a_failing_block_is_reported_by_its_number(tmp_path):
    """The runner above can fail, and names the block."""
    document = tmp_path / "doc.md"
    document.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS, str(document)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().endswith("doc.md, python block 2 fails: AssertionError: x is 1")
