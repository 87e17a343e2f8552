"""Every repository file the documentation and the code's own prose name exists: the paths in README.md and
docs/*.md (and their relative links, and the links of the result files in docs/results/), and in the docstrings and
comments of every module of the packages, the scripts and the tests. A renamed or moved file leaves no reference to
its old name behind.

The documents explain what is: a measurement lives in a dated result file in docs/results/, which some document
cites, and no document outside docs/results/ keeps a run's history (past targets, before/after comparisons, earlier
versions' runs)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The top-level folders whose files the prose names; a path is one of them, then names and subfolders, globs (``*``)
# and brace alternatives (``test_data_parallel_{torch,jax,tf}.py``), ending in a name (never in the sentence's
# punctuation).
FOLDERS = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf", "transformer_tasks",
           "transformer_export", "transformer_bench", "transformer_cli", "equivalence", "tests", "scripts", "docs",
           ".ci")
PART = r"(?:[\w.*/-]|\{[\w.,-]+\})"
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, FOLDERS))})/{PART}*(?:[\w*]|\{{[\w.,-]+\}}))")
# A Markdown link or image to a local file, relative to the document: ``](equivalence.md#anchor)``.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
# The placeholders the prose uses for "some test module" (a node id's form, a --durations line's form) and for a
# result file a script writes (its name's date to come).
PLACEHOLDER = re.compile(r"tests/test_x\.py|docs/results/DATE-[\w.-]+")
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The recorded runs: each file one run's date, machine, command and output, cited by a document.
RESULTS = sorted(path for path in (ROOT / "docs" / "results").iterdir() if path.is_file())
# Phrases that only a run's history uses: a document that needs one is telling what happened, not what is.
HISTORY = re.compile("|".join([
    r"\bprevious (?:runs?|versions?|search|commit)\b", r"\bearlier (?:runs?|versions?)\b", r"\bthis version's\b",
    r"\buntil this version\b", r"\bissue \d+'s\b", r"\b(?:targets|yardsticks) of issue \d+", r"\bbefore issue \d+",
    r"\bbefore and after\b", r"\ba first trial\b", r"\(was \d"]), re.IGNORECASE)
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
    return PATH.findall(text) + (local_links(text, document) if document is not None else [])


def local_links(text: str, document: Path) -> list[str]:
    """The local files the Markdown links of ``document`` point to, as paths from the repository root."""
    return [(document.parent / link).resolve().relative_to(ROOT).as_posix() for link in LINK.findall(text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", link)]                   # http:, mailto:...: not a file


def all_references() -> list[tuple[str, str]]:
    """(where, path) for every reference of the documents and of the modules' prose, and every local link of the
    result files (whose other paths name files as they were when the run was made)."""
    named = [(document.name, path) for document in DOCUMENTS
             for path in references(document.read_text(encoding="utf-8"), document)]
    linked = [(result.relative_to(ROOT).as_posix(), path) for result in RESULTS if result.suffix == ".md"
              for path in local_links(result.read_text(encoding="utf-8"), result)]
    return named + linked + [(module.relative_to(ROOT).as_posix(), path) for module in MODULES
                             for path in references(prose(module))]


def test_every_file_reference_names_a_file_that_exists():
    found = all_references()
    assert len(found) > 500 and len({path for _, path in found}) > 100, f"only {len(found)} references found"
    assert {"README.md", "cli.md", "testing.md", "equivalence/contract.py", "tests/conftest.py"} <= \
        {where for where, _ in found}
    broken = sorted({f"{where}: {path}" for where, path in found
                     if not PLACEHOLDER.fullmatch(path) and not names_a_file(path)})
    assert broken == [], "references to files that do not exist:\n" + "\n".join(broken)


def test_the_reference_finder_reads_paths_links_and_prose(tmp_path):
    """What the finder takes for a reference, and what not: the check above cannot pass by finding nothing."""
    text = ("See `tests/reference/test_oracle.py::test_x`, tests/helpers/compile_cache.py, scripts/bench_*.py and "
            "tests/ports/test_data_parallel_{torch,jax,tf}.py. [cli](docs/cli.md#exit-codes) "
            "https://example.org/docs/y.md [site](https://example.org) [here](#tests)")
    assert references(text, ROOT / "README.md") == [
        "tests/reference/test_oracle.py", "tests/helpers/compile_cache.py", "scripts/bench_*.py",
        "tests/ports/test_data_parallel_{torch,jax,tf}.py", "docs/cli.md", "docs/cli.md"]
    assert all(map(names_a_file, references(text, ROOT / "README.md")))
    assert not names_a_file("tests/test_data_parallel_{torch,mxnet}.py") and not names_a_file("docs/nothing.md")
    module = tmp_path / "module.py"
    module.write_text('"""Checked by tests/test_a.py."""\nPATH = "tests/test_b.py"  # and tests/test_c.py\n')
    assert references(prose(module)) == ["tests/test_c.py", "tests/test_a.py"]



def history(text: str) -> list[str]:
    """The lines of ``text`` that use a phrase of a run's history, each with its number."""
    return [f"{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), start=1)
            if HISTORY.search(line)]


def test_documents_state_what_is_and_cite_their_measurements():
    """No document outside docs/results/ tells a run's history, and every result file is cited by a document."""
    told = {document.name: history(document.read_text(encoding="utf-8")) for document in DOCUMENTS}
    assert {name: lines for name, lines in told.items() if lines} == {}, "history outside docs/results/"
    cited = {path for document in DOCUMENTS for path in references(document.read_text(encoding="utf-8"), document)}
    assert len(RESULTS) > 10
    uncited = [result.name for result in RESULTS if result.relative_to(ROOT).as_posix() not in cited]
    assert uncited == [], "result files no document cites: " + ", ".join(uncited)


def test_the_history_finder_tells_history_from_explanation():
    """The phrases the check above rejects are found, and explanation that shares their words is not."""
    told = ("Issue 15's targets, as ratios\nThe same run before and after the split\nin the two previous runs\n"
            "A first trial on the step module\nan earlier version's 5,552 in 36:34\npeak 1.04 x (was 2.24 x)\n"
            "against the yardsticks of issue 15\nBefore issue 27's work the peaks were")
    assert [line.split(": ", 1)[0] for line in history(told)] == [str(number) for number in range(1, 9)]
    explained = ("a tie goes to the earlier step\nthe earlier positions, as Hugging Face's past_key_values_length\n"
                 "a layer of its stack's previous output\nread back in this run or an earlier one\n"
                 "the latest run, its date and machine in docs/results/")
    assert history(explained) == []
