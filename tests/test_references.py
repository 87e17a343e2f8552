"""Every repository file the documentation and the code's own prose name exists: the paths in README.md and
docs/*.md (and their relative links), and in the docstrings and comments of every module of the packages, the
scripts and the tests. A renamed or moved file leaves no reference to its old name behind."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The top-level folders whose files the prose names; a path is one of them, then names, globs (``*``) and brace
# alternatives (``test_data_parallel_{torch,jax,tf}.py``), ending in a name (never in the sentence's punctuation).
FOLDERS = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf", "transformer_cli",
           "equivalence", "tests", "scripts", "docs", ".ci")
PART = r"(?:[\w.*-]|\{[\w.,-]+\})"
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, FOLDERS))})/{PART}*(?:[\w*]|\{{[\w.,-]+\}}))")
# A Markdown link or image to a local file, relative to the document: ``](equivalence.md#anchor)``.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
# The placeholder the prose uses for "some test module" (a node id's form, a --durations line's form).
PLACEHOLDER = "tests/test_x.py"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = [path for folder in FOLDERS[:-2] for path in sorted((ROOT / folder).rglob("*.py"))]


def alternatives(path: str) -> list[str]:
    """``path`` with each brace group expanded: ``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    group = re.search(r"\{([^}]*)\}", path)
    if group is None:
        return [path]
    return [expanded for choice in group.group(1).split(",")
            for expanded in alternatives(path[:group.start()] + choice + path[group.end():])]


def names_a_file(path: str) -> bool:
    """Whether every alternative of ``path`` is a file or folder of the repository (a glob: matches one)."""
    return all(any(ROOT.glob(each)) if "*" in each else (ROOT / each).exists() for each in alternatives(path))


def prose(path: Path) -> str:
    """The comments and docstrings of a Python module (not its code: a string the code builds is no reference). A
    docstring is a string token that begins a statement: after a NEWLINE, INDENT or DEDENT, or first in the file."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    significant = [token for token in tokens if token.type not in (tokenize.NL, tokenize.COMMENT)]
    docstrings = [token.string for before, token in zip([None, *significant], significant)
                  if token.type == tokenize.STRING and (before is None or before.type in starts)]
    return "\n".join([*(token.string for token in tokens if token.type == tokenize.COMMENT), *docstrings])


def references(text: str, document: Path | None = None) -> list[str]:
    """The repository paths ``text`` names; with ``document`` (a Markdown file) its local links too, as paths from
    the repository root."""
    found = PATH.findall(text)
    if document is not None:
        for link in LINK.findall(text):
            if not re.match(r"[a-z][a-z0-9+.-]*:", link):                    # http:, mailto:...: not a file
                found.append((document.parent / link).resolve().relative_to(ROOT).as_posix())
    return found


def all_references() -> list[tuple[str, str]]:
    """(where, path) for every reference of the documents and of the modules' prose."""
    named = [(document.name, path) for document in DOCUMENTS
             for path in references(document.read_text(encoding="utf-8"), document)]
    return named + [(module.relative_to(ROOT).as_posix(), path) for module in MODULES
                    for path in references(prose(module))]


def test_every_file_reference_names_a_file_that_exists():
    found = all_references()
    assert len(found) > 500 and len({path for _, path in found}) > 100, f"only {len(found)} references found"
    assert {"README.md", "cli.md", "testing.md", "equivalence/contract.py", "tests/conftest.py"} <= \
        {where for where, _ in found}
    broken = sorted({f"{where}: {path}" for where, path in found if path != PLACEHOLDER and not names_a_file(path)})
    assert broken == [], "references to files that do not exist:\n" + "\n".join(broken)


def test_the_reference_finder_reads_paths_links_and_prose(tmp_path):
    """What the finder takes for a reference, and what not: the check above cannot pass by finding nothing."""
    text = ("See `tests/test_oracle.py::test_x`, tests/compile_cache.py, scripts/bench_*.py and "
            "tests/test_data_parallel_{torch,jax,tf}.py. [cli](docs/cli.md#exit-codes) "
            "https://example.org/docs/y.md [site](https://example.org) [here](#tests)")
    assert references(text, ROOT / "README.md") == [
        "tests/test_oracle.py", "tests/compile_cache.py", "scripts/bench_*.py",
        "tests/test_data_parallel_{torch,jax,tf}.py", "docs/cli.md", "docs/cli.md"]
    assert all(map(names_a_file, references(text, ROOT / "README.md")))
    assert not names_a_file("tests/test_data_parallel_{torch,mxnet}.py") and not names_a_file("docs/nothing.md")
    module = tmp_path / "module.py"
    module.write_text('"""Checked by tests/test_a.py."""\nPATH = "tests/test_b.py"  # and tests/test_c.py\n')
    assert references(prose(module)) == ["tests/test_c.py", "tests/test_a.py"]
