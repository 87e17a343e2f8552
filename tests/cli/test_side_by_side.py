"""The side-by-side page (``transformer-reference side-by-side``): every piece of code is an exact
cut of its source file, the page's style makes long lines wrap inside four equal columns, a real
browser at 1400 pixels renders four non-empty aligned columns per concept with nothing cut off,
and the committed ``docs/side-by-side.html`` is the page the current sources give."""

from __future__ import annotations

import ast
import copy
import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from transformer_cli.commands import side_by_side
from transformer_cli.commands.side_by_side import BACKENDS, CONCEPTS, MACHINERY, PAPER
from transformer_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "side-by-side.html"
UPDATE = "run `transformer-reference side-by-side --out docs` to update it"
CHROMIUM = shutil.which("chromium")
WIDTH, HEIGHT = 1400, 2000  # the width the page must be readable at
HEADINGS = {"numpy": "NumPy", "torch": "PyTorch", "jax": "JAX/Flax", "tf": "TensorFlow/Keras"}
PACKAGES = {backend: package for backend, _, package in BACKENDS}


@pytest.fixture(scope="module")
def page() -> str:
    return side_by_side.render_page()


# ----------------------------------------------------------------------------- the code is the source's

def without_docstrings(node: ast.AST) -> ast.AST:
    """``node`` with the docstring of every definition in it removed (unless it is the whole body)."""
    node = copy.deepcopy(node)
    for inner in list(ast.walk(node)):
        if (isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and ast.get_docstring(inner, clean=False) is not None and len(inner.body) > 1):
            inner.body = inner.body[1:]
    return node


def defined(module: ast.Module, name: str) -> ast.stmt:
    for node in module.body:
        names = [getattr(node, "name", None)] + [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                                                 if isinstance(t, ast.Name)]
        if name in names:
            return node
    raise AssertionError(f"{name} is not defined at the top level")


@pytest.mark.parametrize("concept", CONCEPTS, ids=lambda c: c.anchor)
def test_every_piece_of_code_is_its_definition_in_the_source_file(concept):
    """Parsed again, each piece of code is the named definitions of its file (docstrings aside),
    and every line of it is a line of that file, in the file's order, within the stated lines."""
    assert set(concept.code) == set(HEADINGS), f"{concept.title}: a backend has no code"
    for backend, entries in concept.code.items():
        blocks = side_by_side.cell_blocks(backend, entries)
        assert blocks, f"{concept.title}/{backend}: no code"
        for block in blocks:
            label, _, span = block.where.rpartition(":")
            assert label.startswith(PACKAGES[backend] + "/"), block.where
            first, last = map(int, span.split("\u2013"))
            source = (ROOT / label).read_text()
            shown = ast.parse(block.code).body
            top, _, members = block.names.partition(": ")
            original = defined(ast.parse(source), top)
            if members:
                chosen = [defined(original, m) for m in members.split(", ")]
                assert [ast.dump(n) for n in shown[0].body] == [ast.dump(without_docstrings(n)) for n in chosen]
                assert (shown[0].name, [ast.dump(b) for b in shown[0].bases]) == \
                    (original.name, [ast.dump(b) for b in original.bases]), block.where
            else:
                assert [ast.dump(n) for n in shown] == [ast.dump(without_docstrings(original))], block.where
            file_lines = source.splitlines()[first - 1:last]
            code_lines = [line for line in block.code.splitlines() if line and "# ... not shown here:" not in line]
            position = iter(file_lines)
            assert all(any(line == candidate for candidate in position) for line in code_lines), \
                f"{block.where}: a line is not the file's, or out of order"
            assert (code_lines[0], code_lines[-1]) == (file_lines[0], file_lines[-1]), \
                f"{block.where}: the stated first or last line is not shown"


def test_a_name_missing_from_a_port_is_a_clear_error():
    with pytest.raises(ValueError, match=r"torch transformer_torch/model\.py has no 'NoSuchAttention'"):
        side_by_side.cell_blocks("torch", ("model.py:NoSuchAttention",))
    with pytest.raises(ValueError, match=r"jax transformer_jax/model\.py class DecoderLayer has no 'no_step'"):
        side_by_side.cell_blocks("jax", ("model.py:DecoderLayer.no_step",))
    with pytest.raises(ValueError, match=r"tf has no file transformer_tf/caching\.py"):
        side_by_side.cell_blocks("tf", ("caching.py:step",))


# ----------------------------------------------------------------------------- the page as a file

class Tags(HTMLParser):
    """Every start tag with its attributes."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_the_page_is_self_contained_and_the_same_each_time(page):
    tags = Tags()
    tags.feed(page)
    assert not {tag for tag, _ in tags.tags} & {"script", "link", "img", "iframe", "object", "embed"}
    assert not [attrs for _, attrs in tags.tags if "src" in attrs]
    assert all(attrs["href"].startswith("#") for tag, attrs in tags.tags if tag == "a")
    assert "@import" not in page and "url(" not in page
    assert str(ROOT) not in page and str(Path.home()) not in page
    assert side_by_side.render_page() == page


def test_the_command_writes_the_page_and_never_replaces_a_foreign_file(tmp_path, page, capsys):
    assert main(["side-by-side", "--out", str(tmp_path / "new")]) == 0
    written = tmp_path / "new" / "side-by-side.html"
    assert written.read_text() == page and f"wrote {written}" in capsys.readouterr().out
    assert main(["side-by-side", "--out", str(tmp_path / "new")]) == 0                # its own page: replaced
    foreign = tmp_path / "side-by-side.html"
    foreign.write_text("<p>my notes</p>")
    assert main(["side-by-side", "--out", str(tmp_path)]) == 2
    assert "was not written by transformer-reference side-by-side" in capsys.readouterr().err
    assert foreign.read_text() == "<p>my notes</p>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "side-by-side.html"]  # no temporary left


def test_the_committed_copy_is_current(page):
    assert COMMITTED.exists(), f"docs/side-by-side.html is missing: {UPDATE}"
    assert COMMITTED.read_bytes() == page.encode("utf-8"), f"docs/side-by-side.html is out of date: {UPDATE}"


# ----------------------------------------------------------------------------- the page's layout, read from its source

def style_rules(page: str) -> dict[str, dict[str, str]]:
    """The page's CSS as {selector: {property: value}}."""
    css = re.sub(r"/\*.*?\*/", "", re.search(r"<style>(.*?)</style>", page, re.S).group(1))
    rules: dict[str, dict[str, str]] = {}
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css):
        declarations = dict(tuple(part.strip() for part in d.split(":", 1)) for d in body.split(";") if ":" in d)
        for selector in selectors.split(","):
            rules.setdefault(" ".join(selector.split()), {}).update(declarations)
    return rules


def test_the_style_wraps_long_lines_inside_equal_columns(page):
    """What keeps code from being cut off at any width: the columns share the row equally and may
    shrink below their content (minmax(0, 1fr), min-width 0), and code wraps (pre-wrap, long words
    broken) with a hanging indent instead of scrolling."""
    rules = style_rules(page)
    for selector in (".row", ".columns"):
        assert {"display": "grid", "grid-auto-flow": "column", "grid-auto-columns": "minmax(0, 1fr)",
                "width": "100%"}.items() <= rules[selector].items(), selector
    assert rules[".cell"]["min-width"] == "0"
    code = rules[".highlight pre"]
    assert (code["white-space"], code["overflow-wrap"]) == ("pre-wrap", "anywhere")
    assert not [p for r in rules.values() for p in r if p.startswith("overflow-x")], "something scrolls sideways"
    line = rules[".highlight pre .line"]
    assert line["display"] == "block"
    assert line["text-indent"] == f"calc(-1 * ({line['padding-left'].removeprefix('calc(').removesuffix(')')}))"


def test_each_concept_row_has_one_cell_per_backend_and_one_block_per_source_line(page):
    """Every row: the concept's name and the paper's section in its heading, then one cell per
    backend in the columns' order, each line of each piece of code its own wrapping block."""
    sections = re.findall(r'<section class="concept" id="([^"]+)">\n<h2>(.*?)</h2>(.*?)</section>', page, re.S)
    assert [anchor for anchor, _, _ in sections] == [concept.anchor for concept in CONCEPTS]
    for (_, heading, body), concept in zip(sections, CONCEPTS):
        assert heading.startswith(concept.title) and heading.endswith(f"{concept.source}</span>")
        cells = re.findall(r'<div class="cell" data-backend="(\w+)">\n(.*?)</div>\n(?=<div class="cell"|</div>)',
                           body, re.S)
        assert [backend for backend, _ in cells] == list(HEADINGS), concept.title
        for backend, cell in cells:
            code_lines = sum(len(b.code.splitlines()) for b in side_by_side.cell_blocks(backend, concept.code[backend]))
            assert cell.count('<span class="line" ') == code_lines, (concept.title, backend)


def test_each_backend_has_a_checkbox_that_hides_its_column(page):
    tags = Tags()
    tags.feed(page)
    boxes = [attrs for tag, attrs in tags.tags if tag == "input"]
    assert [(b["type"], b["id"], "checked" in b) for b in boxes] == \
        [("checkbox", f"show-{backend}", True) for backend in HEADINGS]
    rules = style_rules(page)
    for backend in HEADINGS:
        assert rules[f'body:has(#show-{backend}:not(:checked)) [data-backend="{backend}"]'] == {"display": "none"}


# ----------------------------------------------------------------------------- the page in a browser

class Rows(HTMLParser):
    """The rendered DOM as data: the column headings and, per concept section, its title,
    equation, and per cell its backend and text."""

    def __init__(self):
        super().__init__()
        self.headings: list[str] = []
        self.rows: list[dict] = []
        self.stack: list[str] = []  # the role of each open element, "" for others

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        role = ""
        if "columns" in classes:
            role = "columns"
        elif "columns" in self.stack[-1:] and "data-backend" in attrs:
            role = "heading"
            self.headings.append("")
        elif tag == "section" and "concept" in classes:
            role = "section"
            self.rows.append({"title": "", "source": "", "equation": "", "cells": []})
        elif tag == "h2" and "section" in self.stack:
            role = "title"
        elif "source" in classes and "title" in self.stack:
            role = "source"
        elif "equation" in classes:
            role = "equation"
        elif "cell" in classes:
            role = "cell"
            self.rows[-1]["cells"].append({"backend": attrs.get("data-backend"), "where": "", "code": ""})
        elif "where" in classes:
            role = "where"
        elif tag == "pre" and "cell" in self.stack:
            role = "code"
        if tag not in {"meta", "br", "hr", "img", "input", "link"}:
            self.stack.append(role)

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        roles = set(self.stack)
        if "heading" in roles:
            self.headings[-1] += data
        if "title" in roles:
            self.rows[-1]["source" if "source" in roles else "title"] += data
        if "equation" in roles:
            self.rows[-1]["equation"] += data
        for field in ("where", "code"):
            if field in roles:
                self.rows[-1]["cells"][-1][field] += data


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: install Debian's package (apt-get install chromium) to render the page")
    work = tmp_path_factory.mktemp("browser")
    path = side_by_side.write_page(work)
    screenshot = work / "screenshot.png"
    chromium(f"--screenshot={screenshot}", path.as_uri(), profile=work / "profile")
    dom = chromium("--dump-dom", path.as_uri(), profile=work / "profile").stdout
    return screenshot, dom


def test_the_browser_shows_every_concept_with_four_non_empty_columns(rendered):
    _, dom = rendered
    parsed = Rows()
    parsed.feed(dom)
    assert parsed.headings == list(HEADINGS.values())
    assert [row["title"].strip() for row in parsed.rows] == [concept.title for concept in CONCEPTS]
    for row, concept in zip(parsed.rows, CONCEPTS):
        assert row["source"] == f"\u2014 {concept.source}" and row["equation"].strip(), row["title"]
        assert [cell["backend"] for cell in row["cells"]] == list(HEADINGS), row["title"]
        for cell in row["cells"]:
            assert cell["where"].startswith(PACKAGES[cell["backend"]] + "/"), (row["title"], cell["where"])
            assert cell["code"].strip(), f"{row['title']}: the {cell['backend']} column is empty"


def test_the_screenshot_shows_four_aligned_columns_of_highlighted_code(rendered):
    import matplotlib.image

    screenshot, _ = rendered
    image = matplotlib.image.imread(screenshot)[:, :, :3]                  # (HEIGHT, WIDTH, 3), floats in [0, 1]
    assert image.shape == (HEIGHT, WIDTH, 3)
    inked = (image < 0.99).any(axis=2)                                     # not the white page
    # The first concept's cells: the first band of at least 40 pixel rows that are mostly cell.
    full = np.flatnonzero(inked.mean(axis=1) > 0.9)
    starts = np.flatnonzero(np.diff(np.r_[-2, full]) > 1)
    bands = [(full[a], full[b - 1]) for a, b in zip(starts, [*starts[1:], len(full)])]
    top, bottom = next((a, b) for a, b in bands if b - a >= 40)
    in_cell = inked[top:bottom].mean(axis=0) > 0.9                          # per pixel column
    edges = np.flatnonzero(np.diff(np.r_[0, in_cell.astype(int), 0]))
    columns = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a > 150]
    assert len(columns) == 4, f"expected four columns side by side, found {columns}"
    widths = [b - a for a, b in columns]
    assert max(widths) - min(widths) <= 2, f"columns of unequal widths {widths}"
    gaps = [(b, a) for (_, b), (a, _) in zip(columns, columns[1:])]
    assert not any(inked[top:bottom, a:b].any() for a, b in gaps), "code runs out of its column (no scrolling)"
    for (a, b), backend in zip(columns, HEADINGS):
        cell = image[top:bottom, a:b]
        dark = (cell.min(axis=2) < 0.6).mean()                              # text
        coloured = (np.ptp(cell, axis=2) > 0.25).mean()                     # not grey: highlighted tokens
        assert dark > 0.01, f"the {backend} column shows no text"
        assert coloured > 0.002, f"the {backend} column is not highlighted ({coloured:.4f} of it in colour)"


MEASURE = """<script>
function measure() {
  const rows = [...document.querySelectorAll(".row")].map(row => {
    const box = row.getBoundingClientRect();
    return [...row.querySelectorAll(".cell")].filter(cell => cell.offsetParent !== null).map(cell => {
      const r = cell.getBoundingClientRect();
      return [cell.dataset.backend, r.left - box.left, r.right - box.left, box.width];
    });
  });
  const cut = [...document.querySelectorAll(".cell pre")].filter(pre => pre.scrollWidth > pre.clientWidth)
    .map(pre => pre.closest("section").id + " " + pre.closest(".cell").dataset.backend);
  const lineHeight = parseFloat(getComputedStyle(document.querySelector(".cell pre")).lineHeight);
  const wrapped = [...document.querySelectorAll(".cell pre .line")]
    .filter(line => line.getBoundingClientRect().height > 1.5 * lineHeight).length;
  const lines = Object.fromEntries([...document.querySelectorAll("section.concept")].map(section => [section.id,
    [...section.querySelectorAll(".cell")].filter(cell => cell.offsetParent !== null).map(cell => [
      cell.dataset.backend, [...cell.querySelectorAll("pre")]
        .reduce((sum, pre) => sum + Math.round(pre.getBoundingClientRect().height / lineHeight), 0)])]));
  const order = [...document.querySelectorAll("section.concept, h2.part")].map(node => node.id);
  return {rows, cut, wrapped, lines, order, page: [document.documentElement.scrollWidth, window.innerWidth]};
}
const all = measure();
for (const backend of ["numpy", "tf"]) document.getElementById("show-" + backend).checked = false;
document.body.insertAdjacentHTML("beforeend", '<pre id="measured"></pre>');
document.getElementById("measured").textContent = JSON.stringify({all, two: measure()});
</script>
"""


@pytest.fixture(scope="module")
def measured(rendered, tmp_path_factory) -> dict:
    """The page measured in Chromium at 1400 pixels by :data:`MEASURE`: with every backend shown ("all"), then with
    NumPy and TensorFlow unticked ("two")."""
    work = tmp_path_factory.mktemp("measured")
    page = work / "measured.html"
    page.write_text(side_by_side.render_page().replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = chromium("--dump-dom", page.as_uri(), profile=work / "profile").stdout
    return json.loads(html.unescape(re.findall(r"<pre id=\"measured\">(.*?)</pre>", dom, re.S)[-1]))


def test_at_1400_pixels_nothing_is_cut_off_and_two_backends_can_share_the_width(measured):
    """Measured in Chromium at 1400 pixels: no code box scrolls sideways (long lines wrap, and some
    do), the page is no wider than the window, each row's cells are one per backend, equally wide,
    inside the row; with two boxes unticked, the two other backends share the row half and half."""
    everything, two = measured["all"], measured["two"]
    assert everything["cut"] == [], f"code cut off at {WIDTH} pixels: {everything['cut']}"
    assert everything["page"][0] <= everything["page"][1] == WIDTH, "the page scrolls sideways"
    assert everything["wrapped"] > 0, "no line wrapped: the test does not exercise wrapping"
    for shown, backends in ((everything, list(HEADINGS)), (two, ["torch", "jax"])):
        assert len(shown["rows"]) == len(CONCEPTS)
        for cells in shown["rows"]:
            assert [backend for backend, *_ in cells] == backends
            widths = [right - left for _, left, right, _ in cells]
            row_width = cells[0][3]
            assert max(widths) - min(widths) < 1 and sum(widths) > 0.95 * row_width, widths
            assert all(0 <= left and right <= row_width + 0.5 for _, left, right, _ in cells), cells
    assert two["cut"] == []


def test_eq_1_reads_in_25_lines_and_the_paper_ends_before_the_machinery(measured):
    """Measured in Chromium at 1400 pixels: each backend's Eq. (1) is at most 25 rendered lines (wrapped lines
    counted as what the reader sees); every concept of section 3 comes before the part beside the paper, every piece
    of machinery after it."""
    everything = measured["all"]
    eq_1 = dict(everything["lines"][PAPER[0].anchor])
    assert list(eq_1) == list(HEADINGS) and all(0 < lines <= 25 for lines in eq_1.values()), eq_1
    assert everything["order"] == [c.anchor for c in PAPER] + ["beside-the-paper"] + [c.anchor for c in MACHINERY]
