"""``transformer-reference side-by-side --out DIR``: the four backends as parallel texts, one HTML page.

Each row of the page is one concept of the paper, headed by its equation; its four aligned
columns show the code of the NumPy reference and of the PyTorch, JAX/Flax and TensorFlow/Keras
ports. The code is read from the packages' source files and cut at the boundaries of the named
functions, classes, methods and constants with :mod:`ast` (docstrings left out, the rows'
headings carry the equations), then highlighted with Pygments. The page is one self-contained
file, ``DIR/side-by-side.html``: no script, no external resource, and the same bytes for the same
sources (no date, no absolute path), so that ``docs/side-by-side.html`` can be checked to be current.
It reads in a 1400-pixel window: four equal columns, long lines wrapped inside them with a hanging
indent, never cut off; the column headings and each row's concept stay on screen while the row
scrolls; a checkbox per backend (CSS only) hides its column, to compare two on wider columns.

:data:`CONCEPTS` is the table of rows: per backend, ``"file.py:Name"`` entries, where ``Name`` is
a top-level function, class or constant, or ``Class.method``. Consecutive methods of one class are
shown under the class's header line, with a comment naming the methods left out. A name missing
from a file is a ``ValueError`` naming the backend, the file and the name.
"""

from __future__ import annotations

import argparse
import ast
import html
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from transformer_cli.extras import require
from transformer_export.outputs import refuse_input

PAGE_NAME = "side-by-side.html"
GENERATOR = "transformer-reference side-by-side"
STYLE = "default"  # the Pygments colour scheme

# (backend, column heading, package)
BACKENDS = (
    ("numpy", "NumPy", "reference_numpy"),
    ("torch", "PyTorch", "transformer_torch"),
    ("jax", "JAX/Flax", "transformer_jax"),
    ("tf", "TensorFlow/Keras", "transformer_tf"),
)


@dataclass(frozen=True)
class Concept:
    """One row: ``title``, where the paper defines it (``source``), the ``equation`` (HTML), and
    per backend the ``"file.py:Name"`` entries to show."""

    title: str
    source: str
    equation: str
    code: dict[str, tuple[str, ...]]

    @property
    def anchor(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.title.lower()).strip("-")


def _same(*entries: str) -> dict[str, tuple[str, ...]]:
    """The same entries in every backend (the ports keep the reference's names)."""
    return {backend: entries for backend, _, _ in BACKENDS}


# The paper's concepts (section 3), first on the page.
PAPER = (
    Concept("Scaled dot-product attention", "Eq. (1), section 3.2.1",
            "Attention(<i>Q</i>, <i>K</i>, <i>V</i>) = "
            "softmax(<i>QK</i><sup>T</sup> / &radic;<i>d<sub>k</sub></i>) <i>V</i>",
            _same("model.py:scaled_dot_product_attention")),
    Concept("Masked softmax and the fully masked row", "Eq. (1), section 3.2.3",
            "softmax over the keys a query may attend to (masked scores: &minus;&infin;); a row that may attend to "
            "no key: zero weights and a zero output",
            _same("softmax.py:masked_softmax", "softmax.py:zero_fully_masked_rows")),
    Concept("Multi-head attention", "section 3.2.2",
            "MultiHead(<i>Q</i>, <i>K</i>, <i>V</i>) = Concat(head<sub>1</sub>, &hellip;, "
            "head<sub><i>h</i></sub>) <i>W</i><sup><i>O</i></sup>, &nbsp; head<sub><i>i</i></sub> = "
            "Attention(<i>QW<sub>i</sub><sup>Q</sup></i>, <i>KW<sub>i</sub><sup>K</sup></i>, "
            "<i>VW<sub>i</sub><sup>V</sup></i>)",
            {**_same("model.py:MultiHeadAttention"),
             "numpy": ("model.py:Linear", "model.py:MultiHeadAttention"),
             "jax": ("layers.py:_linear", "layers.py:_Linear", "model.py:MultiHeadAttention")}),
    Concept("Position-wise feed-forward network", "Eq. (2), section 3.3",
            "FFN(<i>x</i>) = max(0, <i>xW</i><sub>1</sub> + <i>b</i><sub>1</sub>) <i>W</i><sub>2</sub> + "
            "<i>b</i><sub>2</sub>",
            _same("model.py:PositionwiseFeedForward")),
    Concept("Layer normalization and residual connection", "sections 3.1 and 5.4",
            "LayerNorm(<i>x</i> + Dropout(Sublayer(<i>x</i>))) &nbsp; (pre-LN: <i>x</i> + "
            "Dropout(Sublayer(LayerNorm(<i>x</i>))))",
            _same("model.py:LayerNorm", "model.py:residual", "model.py:add")),
    Concept("Embeddings and softmax", "section 3.4",
            "Embed(<i>x</i>) &middot; &radic;<i>d</i><sub>model</sub>, &nbsp; log softmax(<i>xW</i>) with "
            "<i>W</i> = Embed<sup>T</sup> when shared",
            {**_same("model.py:Embeddings", "model.py:Generator"),
             "numpy": ("model.py:Embeddings", "model.py:Generator", "model.py:log_softmax"),
             "torch": ("model.py:Embeddings", "model.py:Generator", "model.py:log_softmax"),
             "tf": ("model.py:Embeddings", "model.py:Generator", "model.py:log_softmax")}),
    Concept("Positional encoding", "section 3.5",
            "<i>PE</i><sub>(<i>pos</i>, 2<i>i</i>)</sub> = "
            "sin(<i>pos</i> / 10000<sup>2<i>i</i>/<i>d</i><sub>model</sub></sup>), &nbsp; "
            "<i>PE</i><sub>(<i>pos</i>, 2<i>i</i>+1)</sub> = "
            "cos(<i>pos</i> / 10000<sup>2<i>i</i>/<i>d</i><sub>model</sub></sup>)",
            _same("model.py:sinusoidal_positional_encoding", "model.py:PositionalEncoding")),
    Concept("Encoder layer and stack", "section 3.1",
            "<i>x</i> &larr; LayerNorm(<i>x</i> + SelfAttention(<i>x</i>)), &nbsp; <i>x</i> &larr; "
            "LayerNorm(<i>x</i> + FFN(<i>x</i>)), &nbsp; <i>N</i> = 6 layers",
            _same("model.py:EncoderLayer", "model.py:Encoder")),
    Concept("Decoder layer and stack", "sections 3.1 and 3.2.3",
            "<i>y</i> &larr; LayerNorm(<i>y</i> + MaskedSelfAttention(<i>y</i>)), &nbsp; <i>y</i> &larr; "
            "LayerNorm(<i>y</i> + Attention(<i>y</i>, memory, memory)), &nbsp; "
            "<i>y</i> &larr; LayerNorm(<i>y</i> + FFN(<i>y</i>))",
            _same("model.py:DecoderLayer", "model.py:Decoder")),
)

# The machinery beside them (incremental decoding, beam search, checkpoints, stages): a part of its own, after them.
MACHINERY = (
    Concept("Cached decoding step", "section 6.1 (the key/value cache is not in the paper)",
            "log <i>p</i>(<i>y<sub>t</sub></i> | <i>y</i><sub>&lt;<i>t</i></sub>, <i>x</i>): "
            "one new position per step, "
            "earlier keys and values kept (the reference recomputes the prefix)",
            {"numpy": ("incremental.py:KVCache", "incremental.py:_attend_cache", "incremental.py:_attend_written",
                       "model.py:MultiHeadAttention.__call__",
                       "incremental.py:decoder_cache", "incremental.py:self_attention_cache",
                       "incremental.py:memory_cache", "incremental.py:_keys_values", "incremental.py:_attend",
                       "decoding.py:next_token_log_probs"),
             "torch": ("incremental.py:KVCache", "incremental.py:_attend_cache", "incremental.py:_attend_written",
                       "model.py:MultiHeadAttention.forward",
                       "incremental.py:decoder_cache", "incremental.py:self_attention_cache",
                       "incremental.py:memory_cache", "incremental.py:_keys_values", "incremental.py:_attend",
                       "decoding.py:next_token_log_probs",
                       "decoding.py:reorder_cache"),
             "jax": ("incremental.py:KVCache", "incremental.py:_attend_cache", "incremental.py:_attend_written",
                     "model.py:MultiHeadAttention.__call__",
                     "incremental.py:decoder_cache", "incremental.py:self_attention_cache",
                     "incremental.py:memory_cache", "incremental.py:_keys_values", "incremental.py:_attend",
                     "decoding.py:next_token_log_probs", "decoding.py:reorder_cache"),
             "tf": ("incremental.py:KVCache", "incremental.py:_attend_cache", "incremental.py:_attend_written",
                    "model.py:MultiHeadAttention.call",
                    "incremental.py:decoder_cache", "incremental.py:self_attention_cache",
                    "incremental.py:memory_cache", "incremental.py:_keys_values", "incremental.py:_attend",
                    "decoding.py:next_token_log_probs", "decoding.py:reorder_cache")}),
    Concept("Attention over beam hypotheses", "Eq. (1) in a beam search, section 6.1",
            "row <i>b</i>&middot;<i>K</i> + <i>j</i> reads position <i>c</i> of its hypothesis from row "
            "<i>b</i>&middot;<i>K</i> + beams[<i>b</i>, <i>j</i>, <i>c</i>]: the reference gathers the keys and "
            "values, the ports leave them in place",
            {"numpy": ("incremental.py:beam_attention", "incremental.py:_own_hypothesis"),
             "torch": ("incremental.py:beam_attention", "speed.py:beam_scores", "speed.py:beam_mix"),
             "jax": ("incremental.py:beam_attention", "speed.py:beam_scores", "speed.py:beam_mix"),
             "tf": ("incremental.py:beam_attention", "speed.py:beam_scores", "speed.py:beam_mix")}),
    Concept("Precision at the boundaries", "docs/equivalence.md (low precision is not in the paper)",
            "in bfloat16 or float16 a concept is entered wide and left rounded once; under the autocast recipe "
            "Q<i>K</i><sup>T</sup> and weights &middot; <i>V</i> are products in the low precision",
            {"numpy": ("precision.py:computed_wide", "precision.py:attention_product", "precision.py:product"),
             "torch": ("precision.py:computed_wide", "precision.py:wide", "precision.py:narrow"),
             "jax": ("precision.py:computed_wide", "precision.py:attention_product"),
             "tf": ("precision.py:computed_wide", "precision.py:attention_product")}),
    Concept("Beam search", "section 6.1",
            "beam size 4; a finished hypothesis <i>Y</i> scores log <i>P</i>(<i>Y</i>) / <i>lp</i>(<i>Y</i>), "
            "<i>lp</i>(<i>Y</i>) = ((5 + |<i>Y</i>|) / 6)<sup>&alpha;</sup>, &alpha; = 0.6; "
            "the ports keep each row's keys and values in place and move a table of beams",
            {"numpy": ("decoding.py:beam_search", "decoding.py:_sentence_steps", "decoding.py:search_ends",
                       "decoding.py:best_hypothesis", "decoding.py:select_candidates"),
             "torch": ("decoding.py:beam_search", "decoding.py:_in_place", "decoding.py:_reorder_own",
                       "decoding.py:_select", "decoding.py:_keep_best"),
             "jax": ("decoding.py:_beam", "decoding.py:_in_place", "decoding.py:_reorder_own",
                     "decoding.py:_select", "decoding.py:_keep_best"),
             "tf": ("decoding.py:_beam", "decoding.py:_in_place", "decoding.py:_reorder_own",
                    "decoding.py:_select", "decoding.py:_keep_best")}),
    Concept("Checkpoint table", "docs/checkpoint-format.md",
            "one shared file: the reference walks the architecture once (name, shape, kind); each port maps a kind "
            "to its parameter's path and layout; projections stored (in, out), <i>y</i> = <i>xW</i> + <i>b</i>",
            {"numpy": ("checkpoint.py:Parameter", "checkpoint.py:parameters", "checkpoint.py:parameter_shapes"),
             "torch": ("checkpoint.py:_LAYOUT", "checkpoint.py:name_table", "checkpoint.py:transposed",
                       "checkpoint.py:from_params"),
             "jax": ("checkpoint.py:_LAYOUT", "checkpoint.py:name_table", "checkpoint.py:transposed",
                     "checkpoint.py:from_params"),
             "tf": ("checkpoint.py:_LAYOUT", "checkpoint.py:name_table", "checkpoint.py:transposed")}),
    Concept("Intermediate stages", "the stages compare reads (not in the paper)",
            "the embedded inputs, each layer's output, each stack's, the log-probabilities: each the output of one "
            "module, recorded from outside the model by the framework's own capture (no argument of the math)",
            {"numpy": ("capture.py:stage_paths", "capture.py:capture_stages", "capture.py:_Recorder"),
             "torch": ("capture.py:capture_stages", "capture.py:_recorder"),
             "jax": ("capture.py:capture_stages",),
             "tf": ("capture.py:capture_stages", "capture.py:_recorder")}),
)
CONCEPTS = PAPER + MACHINERY


# ----------------------------------------------------------------------------- reading the sources

@dataclass(frozen=True)
class Block:
    """Code cut from one file: ``where`` (``package/file.py:first-last``), ``names`` shown, ``code``."""

    where: str
    names: str
    code: str


def package_dir(package: str) -> Path:
    """The directory of an installed package, found without importing it (nor its framework)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed")
    return Path(spec.submodule_search_locations[0])


def cell_blocks(backend: str, entries: tuple[str, ...], sources: dict | None = None) -> list[Block]:
    """The code of one cell: ``entries`` ("file.py:Name" or "file.py:Class.method") of ``backend``,
    one block per top-level name (consecutive methods of one class share a block). ``sources``
    keeps each file's lines and syntax tree between calls."""
    package = dict((name, package) for name, _, package in BACKENDS)[backend]
    groups: list[tuple[str, str, list[str]]] = []  # (file, top-level name, members)
    for entry in entries:
        file, _, name = entry.partition(":")
        top, _, member = name.partition(".")
        if groups and member and groups[-1][:2] == (file, top) and groups[-1][2]:
            groups[-1][2].append(member)
        else:
            groups.append((file, top, [member] if member else []))
    sources = {} if sources is None else sources
    return [_block(backend, f"{package}/{file}", top, members, sources) for file, top, members in groups]


def _block(backend: str, label: str, name: str, members: list[str], sources: dict) -> Block:
    if label not in sources:
        package, file = label.split("/")
        path = package_dir(package) / file
        if not path.is_file():
            raise ValueError(f"side-by-side: {backend} has no file {label}")
        text = path.read_text(encoding="utf-8")
        sources[label] = text.splitlines(), ast.parse(text)
    lines, tree = sources[label]
    node = _find(tree.body, name, f"{backend} {label}")
    if not members:
        keep = _lines_of(node, lines)
        return Block(f"{label}:{keep[0]}\u2013{keep[-1]}", name, "\n".join(lines[i - 1] for i in keep))
    assert isinstance(node, ast.ClassDef), f"{backend} {label}: {name} is not a class"
    chosen = [_find(node.body, member, f"{backend} {label} class {name}") for member in members]
    header = list(range(_start(node, lines), node.body[0].lineno))    # decorators and the class line
    parts = [_lines_of(child, lines) for child in chosen]
    code = "\n".join(lines[i - 1] for i in header) + "\n" + "\n\n".join(
        "\n".join(lines[i - 1] for i in part) for part in parts)
    left_out = [child.name for child in node.body
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name not in members]
    if left_out:
        code += f"\n\n{' ' * chosen[0].col_offset}# ... not shown here: {', '.join(left_out)}"
    keep = header + [i for part in parts for i in part]
    return Block(f"{label}:{min(keep)}\u2013{max(keep)}", f"{name}: {', '.join(members)}", code)


def _find(body: list[ast.stmt], name: str, where: str) -> ast.stmt:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return node
    raise ValueError(f"side-by-side: {where} has no {name!r}; update CONCEPTS in "
                     "transformer_cli/commands/side_by_side.py")


def _start(node: ast.stmt, lines: list[str]) -> int:
    """First line of ``node``: its decorators and the comment lines right above it included."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    while start > 1 and lines[start - 2].lstrip().startswith("#"):
        start -= 1
    return start


def _lines_of(node: ast.stmt, lines: list[str]) -> list[int]:
    """The line numbers of ``node`` without the docstrings of it and of its nested definitions."""
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _docstring(inner):
            last = _end(inner.body[0])
            end = last + (lines[last].strip() == "")                          # and a blank line after
            docstrings.update(range(inner.body[0].lineno, end + 1))
    return [i for i in range(_start(node, lines), _end(node) + 1) if i not in docstrings]


def _end(node: ast.stmt) -> int:
    """The last line of ``node`` (the parser always sets it)."""
    assert node.end_lineno is not None
    return node.end_lineno


def _docstring(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    """Whether the definition starts with a docstring that can go (it is not the whole body)."""
    first = node.body[0]
    return (len(node.body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str))


# ----------------------------------------------------------------------------- the page

CSS = """
body { font-family: system-ui, sans-serif; margin: .75rem; color: #1f2328; background: #ffffff; }
h1 { font-size: 1.5rem; margin: 0 0 .5rem; }
nav ol { columns: 2; font-size: .9rem; }
code { font-family: ui-monospace, monospace; }
.show label { margin-right: 1rem; white-space: nowrap; }
.columns, .row { display: grid; grid-auto-flow: column; grid-auto-columns: minmax(0, 1fr); gap: .5rem;
                 width: 100%; }
.columns { position: sticky; top: 0; height: 2rem; box-sizing: border-box; align-items: center;
           background: #ffffff; border-bottom: 2px solid #1f2328; font-weight: bold; z-index: 2; }
.concept { margin: 1.25rem 0 2rem; }
.part { font-size: 1.4rem; margin: 2.5rem 0 0; padding-top: .5rem; border-top: 2px solid #1f2328; }
.concept h2 { position: sticky; top: 2rem; z-index: 1; background: #ffffff; font-size: 1.15rem;
              margin: 0; padding: .3rem 0; }
.source { font-family: system-ui, sans-serif; font-size: .85rem; font-weight: normal; color: #57606a; }
.equation { font-family: "Times New Roman", serif; font-size: 1.15rem; margin: 0 0 .5rem; }
.cell { background: BACKGROUND; border: 1px solid #d0d7de; border-radius: 6px; padding: .35rem; min-width: 0; }
.where { font: 11px ui-monospace, monospace; color: #57606a; margin: .3rem 0 .1rem; overflow-wrap: anywhere; }
.highlight pre { font-size: 11.5px; line-height: 1.35; margin: 0; white-space: pre-wrap; overflow-wrap: anywhere; }
.highlight pre .line { display: block; --lead: min(var(--indent), 20ch); padding-left: calc(var(--lead) + 4ch);
                       text-indent: calc(-1 * (var(--lead) + 4ch)); }
.highlight pre .lead { display: inline-block; width: var(--lead); overflow: hidden; vertical-align: top;
                       white-space: pre; text-indent: 0; }
"""
HIDE = 'body:has(#show-{0}:not(:checked)) [data-backend="{0}"] {{ display: none; }}'


def _lines(highlighted: str) -> str:
    """Pygments' lines as one block each that wraps with a hanging indent: a long line continues
    4 characters further in than its own indentation (an indentation deeper than 20 characters, an
    alignment under an opening bracket, is drawn 20 wide, to leave room)."""
    spans = []
    for line in highlighted.removesuffix("\n").split("\n"):
        rest = line.lstrip(" ")   # Pygments leaves the indentation as plain spaces
        indent = len(line) - len(rest)
        spans.append(f'<span class="line" style="--indent: {indent}ch"><span class="lead">{" " * indent}</span>'
                     f"{rest}\n</span>")
    return f'<div class="highlight"><pre>{"".join(spans)}</pre></div>\n'


def render_page() -> str:
    """The whole page, as text (deterministic: the same sources give the same bytes)."""
    highlight = require("pygments", "side-by-side").highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    formatter = HtmlFormatter(style=STYLE, nowrap=True)
    lexer = PythonLexer()
    rows: list[str] = []
    sources: dict[str, tuple[list[str], ast.Module]] = {}
    for concept in CONCEPTS:
        if concept is MACHINERY[0]:
            rows.append('<h2 class="part" id="beside-the-paper">Beside the paper: incremental decoding, beam search, '
                        "checkpoints, stages</h2>\n")
        cells = []
        for backend, _, _ in BACKENDS:
            blocks = "".join(f'<p class="where">{html.escape(b.where)} <b>{html.escape(b.names)}</b></p>\n'
                             f"{_lines(highlight(b.code, lexer, formatter))}"
                             for b in cell_blocks(backend, concept.code[backend], sources))
            cells.append(f'<div class="cell" data-backend="{backend}">\n{blocks}</div>\n')
        rows.append(f'<section class="concept" id="{concept.anchor}">\n'
                    f'<h2>{html.escape(concept.title)} <span class="source">&mdash; '
                    f"{html.escape(concept.source)}</span></h2>\n"
                    f'<p class="equation">{concept.equation}</p>\n'
                    f'<div class="row">\n{"".join(cells)}</div>\n</section>\n')
    toc = "".join(f'<li><a href="#{c.anchor}">{html.escape(c.title)}</a></li>' for c in CONCEPTS)
    headings = "".join(f'<div data-backend="{backend}">{heading}</div>' for backend, heading, _ in BACKENDS)
    toggles = "".join(f'<label><input type="checkbox" id="show-{backend}" checked> {heading}</label>'
                      for backend, heading, _ in BACKENDS)
    sizes = ", ".join(f"{heading} {_line_count(package_dir(package) / 'model.py')}"
                      for _, heading, package in BACKENDS)
    css = (CSS.replace("BACKGROUND", formatter.style.background_color) + formatter.get_style_defs(".highlight")
           + "\n" + "\n".join(HIDE.format(backend) for backend, _, _ in BACKENDS))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f'<meta name="generator" content="{GENERATOR}">\n'
            "<title>The Transformer side by side: NumPy, PyTorch, JAX/Flax, TensorFlow/Keras</title>\n"
            f"<style>{css}\n</style>\n</head>\n<body>\n"
            "<h1>The Transformer side by side</h1>\n"
            "<p>Each row is one concept of <i>Attention Is All You Need</i> (Vaswani et al., 2017), headed by "
            "its name, the paper's section and equation; the columns show the code that implements it in the "
            "NumPy reference and in the PyTorch, JAX/Flax and TensorFlow/Keras ports, read from the source "
            "files (docstrings left out; above each piece, its file and lines). Long lines wrap, continuing "
            "further in. Generated by "
            f"<code>{GENERATOR} --out DIR</code>; do not edit.</p>\n"
            "<p>Each <code>model.py</code> holds the paper's math alone -- the input checks are in "
            "<code>checks.py</code>, the low-precision recipe's casts in <code>precision.py</code>, the kernel "
            "choices and compile machinery in each port's <code>speed.py</code>, the key/value cache in "
            f"<code>incremental.py</code> (shown after the paper's concepts) -- in lines: {sizes}.</p>\n"
            f"<nav><ol>{toc}</ol></nav>\n"
            f'<p class="show">Columns shown (untick some to compare two backends on wider columns): {toggles}</p>\n'
            f'<div class="columns">{headings}</div>\n'
            f"{''.join(rows)}</body>\n</html>\n")


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def source_files() -> list[str]:
    """The source files the page shows (its inputs): each backend's files that :data:`CONCEPTS` names."""
    files = {(package, entry.partition(":")[0]) for concept in CONCEPTS for backend, _, package in BACKENDS
             for entry in concept.code[backend]}
    return sorted(str(package_dir(package) / file) for package, file in files)


def write_page(out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/side-by-side.html`` (creating ``out_dir``), atomically. A file of that name
    that this command did not write is refused, never replaced, and so is one of the source files it shows
    (through any link: :func:`transformer_export.outputs.refuse_input`)."""
    if not os.fspath(out_dir):
        raise ValueError("--out: name a directory (\".\" for this one)")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out: {str(out_dir)!r} is a file; name the directory to write {PAGE_NAME} into")
    path = out_dir / PAGE_NAME
    refuse_input(str(path), source_files(), "--out")
    page = render_page()
    if path.exists() and f'<meta name="generator" content="{GENERATOR}">' not in path.read_text(errors="replace"):
        raise ValueError(f"--out: {path} exists and was not written by {GENERATOR}; "
                         "move it away or choose another directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{PAGE_NAME}.{os.getpid()}.tmp"
    tmp.write_text(page, encoding="utf-8", newline="\n")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- command line

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``side-by-side`` command to ``transformer-reference``'s subcommands."""
    parser = subparsers.add_parser("side-by-side", help="an HTML page of the four backends' code, concept by concept")
    parser.add_argument("--out", required=True, metavar="DIR", help=f"directory to write {PAGE_NAME} into")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Write the page into ``args.out``; exit status 0."""
    print(f"wrote {write_page(args.out)}")
    return 0
