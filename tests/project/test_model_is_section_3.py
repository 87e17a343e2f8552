"""Each backend's model.py holds section 3's concepts and nothing of the machinery beside them (docs/ports.md,
"Layout"): a file short enough to read beside the paper, Eq. (1) a formula of a few lines, and no argument that
carries a beam table, a stage list or more than one cache through the concepts. Read with ``ast``; nothing imported.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf")
MAX_LINES = 450                 # model.py with its docstrings
MAX_ATTENTION_CODE_LINES = 12   # scaled_dot_product_attention: the formula and the mask
# Machinery that does not pass through the paper's concepts: the beam table, the captured stages.
FORBIDDEN_PARAMETERS = {"beams", "return_intermediates"}


def parameters(function: ast.FunctionDef) -> list[str]:
    """Every parameter name of ``function``, ``*args`` and ``**kwargs`` included."""
    arguments = function.args
    named = arguments.posonlyargs + arguments.args + arguments.kwonlyargs
    return [argument.arg for argument in [*named, arguments.vararg, arguments.kwarg] if argument is not None]


def misplaced_parameters(source: str) -> list[str]:
    """``function: parameter`` for each parameter that is forbidden, or names a cache other than one ``cache``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"{node.name}: {name}" for name in parameters(node)
                      if name in FORBIDDEN_PARAMETERS or ("cache" in name.lower() and name != "cache")]
    return found


def code_lines(source: str, name: str) -> int:
    """The lines of the top-level function ``name`` that hold code: its signature and body, without its docstring,
    blank lines and comment lines."""
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == name)
    lines = source.splitlines()[function.lineno - 1:function.end_lineno]
    docstring = function.body[0]
    if isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant) \
            and isinstance(docstring.value.value, str):
        first, last = docstring.lineno - function.lineno, docstring.end_lineno - function.lineno
        lines = lines[:first] + lines[last + 1:]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def model_source(package: str) -> str:
    return (ROOT / package / "model.py").read_text(encoding="utf-8")


@pytest.mark.parametrize("package", PACKAGES)
def test_model_py_is_at_most_450_lines(package):
    lines = len(model_source(package).splitlines())
    assert lines <= MAX_LINES, f"{package}/model.py has {lines} lines; section 3 is to be read in {MAX_LINES}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_concept_takes_a_beam_table_stages_or_caches(package):
    assert misplaced_parameters(model_source(package)) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_scaled_dot_product_attention_is_the_formula_in_a_few_lines(package):
    lines = code_lines(model_source(package), "scaled_dot_product_attention")
    assert lines <= MAX_ATTENTION_CODE_LINES, f"{package}: Eq. (1) in {lines} lines of code"


PLANTED = textwrap.dedent('''
    def scaled_dot_product_attention(q, k, v,
                                     mask=None):
        """Eq. (1).

        Shape: ...
        """
        # a comment is not code

        s = q @ k
        return s @ v


    def step(x, cache, cache_position, beams, *, return_intermediates=False):
        return x
''')


def test_the_counts_see_what_they_look_for():
    """The checks above, on a text written to fail them: four code lines (the docstring, the comment and the blank
    line not counted), and each misplaced parameter named -- the one ``cache`` allowed."""
    assert code_lines(PLANTED, "scaled_dot_product_attention") == 4
    assert misplaced_parameters(PLANTED) == ["step: cache_position", "step: beams", "step: return_intermediates"]
