"""An input is never an output (issue 42): every command declares the files it reads -- checkpoints by path or by a
shipped model's name, the shipped model it runs by default, corpora, references, resumed runs, the source files of
the side-by-side page -- and the files it writes -- pictures, translations, checkpoints, averages, export
directories, ``train --save-every``'s step files, the page -- and refuses, before any work and even with
``--force``, an output that is an input: the same file by path, through a symbolic or a hard link, or a directory
holding it (``transformer_export.outputs.refuse_input``).

A table tries each command's each output against each of its inputs, in every way one can be the other, in-process
through ``main(argv)``: one error line naming the output and the input, exit 2, the input's bytes unchanged, no
backend loaded and no work begun. The shipped model is a stand-in there (a tiny checkpoint under its name); the
cases of the issue run against the installed model itself."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from in_process import cli, one_error_line

from equivalence import backends
from reference_numpy import TransformerConfig, init_params, save_checkpoint
from reference_numpy.checkpoint import SHIPPED_MODELS, TrainingState
from reference_numpy.config import TrainingConfig
from transformer_cli.commands import side_by_side
from transformer_cli.commands import train as train_module
from transformer_cli.main import EXIT_OK, EXIT_USAGE, build_parser
from transformer_export import export as export_module
from transformer_export.export import TARGETS
from transformer_tasks.translation import DEFAULT_MODEL

TINY = TransformerConfig.preset("tiny")
RESUMED_STEP = 3                            # the step of the run --resume reads: --save-every saves after it


class Row(NamedTuple):
    """One output of one command against one of its inputs: the command line (``{in}`` the input, ``{out}`` the
    output), the output's name in the refusal, the input's kind (``text``, ``checkpoint``, ``run``: a run with its
    training state; ``default``: the shipped model the command runs when given none; ``source``: a source file the
    side-by-side page shows), the output's suffix, and the file the command writes when the command line does not
    name it (a step file, the page)."""

    name: str
    argv: tuple[str, ...]
    flag: str
    kind: str
    suffix: str = ""
    written: str | None = None

    @property
    def directory(self) -> bool:
        return self.flag == "OUTPUT_DIR"

    @property
    def force(self) -> list[str]:
        """``--force``, for every command that has it (``side-by-side`` replaces only a page it wrote, without it)."""
        return [] if self.argv[0] == "side-by-side" else ["--force"]


CORPUS = ("--source", "en.txt", "--target", "fr.txt")
ROWS = (
    Row("translate --input", ("translate", "--input", "{in}", "--output", "{out}"), "--output", "text", ".txt"),
    Row("translate --checkpoint", ("translate", "eighty", "--checkpoint", "{in}", "--output", "{out}"), "--output",
        "checkpoint", ".txt"),
    Row("translate, its default model", ("translate", "eighty", "--output", "{out}"), "--output", "default", ".txt"),
    Row("compare --plot", ("compare", "{in}", "--plot", "{out}"), "--plot", "checkpoint", ".png"),
    Row("compare --precision-report", ("compare", "{in}", "--precision-report", "{out}"), "--precision-report",
        "checkpoint", ".png"),
    Row("compare, its default model", ("compare", "--plot", "{out}"), "--plot", "default", ".png"),
    Row("bench --plot", ("bench", "{in}", "--plot", "{out}"), "--plot", "checkpoint", ".png"),
    Row("plot attention", ("plot", "attention", "{in}", "--out", "{out}"), "--out", "checkpoint", ".png"),
    Row("plot attention, its default model", ("plot", "attention", "--out", "{out}"), "--out", "default", ".png"),
    *(Row(f"export --to {target}", ("export", "--to", target, "{in}", "{out}"), "OUTPUT_DIR", "checkpoint")
      for target in TARGETS),
    Row("average", ("average", "{out}", "ckpt.safetensors", "{in}"), "OUT", "checkpoint", ".safetensors"),
    Row("train --plot, --source", ("train", "--source", "{in}", "--target", "fr.txt", "--plot", "{out}"), "--plot",
        "text", ".png"),
    Row("train --plot, --corpus", ("train", "--corpus", "{in}", "--plot", "{out}"), "--plot", "text", ".png"),
    Row("train --plot, --valid-target", ("train", *CORPUS, "--valid-source", "en.txt", "--valid-target", "{in}",
                                         "--plot", "{out}"), "--plot", "text", ".png"),
    Row("train --plot, --resume", ("train", "--resume", "{in}", "--plot", "{out}"), "--plot", "run", ".png"),
    Row("train --out, --target", ("train", "--source", "en.txt", "--target", "{in}", "--out", "{out}"), "--out",
        "text", ".safetensors"),
    Row("train --out {backend}, --valid-source", ("train", "--backends", "numpy,torch", *CORPUS, "--valid-source",
                                                  "{in}", "--valid-target", "fr.txt", "--out",
                                                  "run-{backend}.safetensors"), "--out", "text",
        written="run-torch.safetensors"),
    Row("train --save-every, --source", ("train", "--source", "{in}", "--target", "fr.txt", "--out", "RUN.safetensors",
                                         "--save-every", "1", "--steps", "2"), "--save-every", "text",
        written="RUN-step2.safetensors"),
    Row("train --save-every, --resume", ("train", "--resume", "{in}", "--out", "RUN.safetensors", "--save-every", "1",
                                         "--steps", "2"), "--save-every", "run",
        written=f"RUN-step{RESUMED_STEP + 1}.safetensors"),
    Row("side-by-side", ("side-by-side", "--out", "site"), "--out", "source",
        written=os.path.join("site", side_by_side.PAGE_NAME)),
)

# How the output is the input: the same path; the output a symbolic or a hard link to it; the input given through a
# symbolic link to the output; the input a shipped model given by name, the output its file; the output a
# directory holding the input.
HOWS = ("path", "symlink", "hard link", "input symlink", "name", "directory")


def applies(row: Row, how: str) -> bool:
    """Whether ``how`` can make ``row``'s output its input: a picture's name ends in a picture format (the shipped
    model's does not), only a checkpoint is named by a shipped model's name, only an export writes a directory, and
    the page's sources are the package's (no hard link across file systems, no copy at the page's path)."""
    if row.kind == "source":
        return how == "symlink"
    if how == "name":
        return row.kind == "checkpoint"
    if how == "directory":
        return row.directory
    if row.kind == "default":
        return how in ("symlink", "hard link") or (how == "path" and row.suffix != ".png")
    return True


CASES = [pytest.param(row, how, id=f"{row.name} ({how})") for row in ROWS for how in HOWS if applies(row, how)]


@pytest.fixture
def shipped(tmp_path, monkeypatch) -> Path:
    """A stand-in for the shipped model: a tiny checkpoint under its name, which commands resolve as they would the
    installed one (the installed model is never put at risk by a table of 80 cases)."""
    path = tmp_path / "models" / f"{DEFAULT_MODEL}.safetensors"
    path.parent.mkdir()
    save_checkpoint(path, TINY, init_params(TINY, seed=1))
    monkeypatch.setitem(SHIPPED_MODELS, DEFAULT_MODEL, path)
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command loads a backend or begins its work: its refusal must come first."""
    def fail(*args, **kwargs):
        pytest.fail("the command began its work before refusing to write over its input")
    monkeypatch.setattr(backends, "load", fail)
    for module, name in ((export_module, "export"), (train_module, "plan_from"),
                         (train_module, "average_checkpoints"), (side_by_side, "render_page")):
        monkeypatch.setattr(module, name, fail)


def write_input(path: Path, kind: str) -> None:
    """A file of ``kind``: a corpus's lines, a tiny checkpoint, or a tiny run with its training state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        path.write_text("one\ntwo\nthree\n")
        return
    params = init_params(TINY, seed=2)
    zeros = {name: np.zeros_like(value) for name, value in params.items()}
    state = TrainingState(TrainingConfig(), RESUMED_STEP, zeros, zeros) if kind == "run" else None
    save_checkpoint(path, TINY, params, training=state)


def arrange(row: Row, how: str, tmp_path: Path, shipped: Path) -> tuple[list[str], str, str, Path]:
    """Make ``row``'s output its input by ``how``: the command line, the output's path as the refusal names it, the
    input as the command line gives it, and the input's file."""
    out = row.written or f"out{row.suffix}"
    if row.kind == "default" or how == "name":
        given, file = DEFAULT_MODEL, shipped
    elif row.kind == "source":
        file = Path(side_by_side.source_files()[0])
        given = str(file)
    else:
        file = tmp_path / {"path": out, "input symlink": out, "directory": f"data/in{row.suffix}"}.get(
            how, f"in{row.suffix}")
        write_input(file, row.kind)
        given = file.relative_to(tmp_path).as_posix()
    if how in ("path", "name") and file == shipped:
        out = str(shipped) if row.suffix != ".png" else out
    if how == "directory":
        out = str(file.parent) if file == shipped else file.parent.name
    if (how == "symlink" or (how == "name" and row.suffix == ".png")) and not os.path.lexists(tmp_path / out):
        os.makedirs((tmp_path / out).parent, exist_ok=True)
        (tmp_path / out).symlink_to(file)
    if how == "hard link":
        os.link(file, tmp_path / out)
    if how == "input symlink":
        given = f"link{row.suffix}"
        (tmp_path / given).symlink_to(file)
    argv = [arg.replace("{in}", given).replace("{out}", out) for arg in row.argv]
    return argv, out, given, file


@pytest.mark.parametrize("row, how", CASES)
def test_no_output_of_any_command_replaces_one_of_its_inputs(row, how, tmp_path, monkeypatch, shipped, no_work,
                                                             capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("en.txt", "fr.txt"):
        write_input(tmp_path / name, "text")
    write_input(tmp_path / "ckpt.safetensors", "checkpoint")
    argv, out, given, file = arrange(row, how, tmp_path, shipped)
    before = file.read_bytes()
    status, printed, err = cli(capsys, *argv, *row.force)
    assert status == EXIT_USAGE and printed == ""
    line = one_error_line(err, f"{row.flag}: writing {out!r} would replace the input {given!r}", "write elsewhere")
    assert ("(the shipped model" in line) == (given == DEFAULT_MODEL), line
    assert file.read_bytes() == before


def test_the_table_covers_every_command_that_reads_and_writes_files():
    """A command declaring an input beside its outputs is in the table (``plot pe`` and ``init`` read no file,
    ``evaluate`` writes none); so is ``side-by-side``, which checks its page against its sources itself."""
    choices = build_parser()._subparsers._group_actions[0].choices
    pictures = choices["plot"]._subparsers._group_actions[0].choices
    commands = {**choices, **{f"plot {name}": parser for name, parser in pictures.items()}}
    reading = {name for name, parser in commands.items() if parser.get_default("inputs")}
    named = {" ".join(row.argv[:2]) if row.argv[0] == "plot" else row.argv[0] for row in ROWS}
    assert reading == named - {"side-by-side"}


# ----------------------------------------------------------------------------- the cases of issue 42, as written

@pytest.fixture
def installed_model() -> Path:
    """The installed model's file, compared after the test with its bytes before it (and put back, failing the
    test, if a command replaced it)."""
    path = Path(SHIPPED_MODELS[DEFAULT_MODEL])
    before = path.read_bytes()
    yield path
    if path.is_file() and path.read_bytes() == before:
        return
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    path.write_bytes(before)
    pytest.fail(f"{path} was replaced (now put back)")


ISSUE_CASES = {
    "translate --output onto its own checkpoint": (
        ["translate", "--checkpoint", "CKPT", "--input", "en.txt", "--output", "CKPT"], "--output", "CKPT"),
    "translate --output onto the shipped model": (["translate", "--output", "SHIPPED"], "--output", DEFAULT_MODEL),
    "average onto the shipped model named twice": (["average", "SHIPPED", DEFAULT_MODEL, DEFAULT_MODEL], "OUT",
                                                   DEFAULT_MODEL),
    "export --to ctranslate2 onto the shipped model": (["export", "--to", "ctranslate2", DEFAULT_MODEL, "SHIPPED"],
                                                       "OUTPUT_DIR", DEFAULT_MODEL),
    "train --save-every onto --source": (["train", "--source", "RUN-step1.safetensors", "--target", "fr.txt", "--out",
                                          "RUN.safetensors", "--save-every", "1", "--steps", "1"], "--save-every",
                                         "RUN-step1.safetensors"),
    "train --save-every onto --target": (["train", "--source", "en.txt", "--target", "RUN-step1.safetensors", "--out",
                                          "RUN.safetensors", "--save-every", "1", "--steps", "1"], "--save-every",
                                         "RUN-step1.safetensors"),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_the_cases_of_the_issue_are_refused_with_force_and_replace_nothing(case, tmp_path, monkeypatch,
                                                                          installed_model, no_work, capsys):
    """``CKPT`` is a copy of the installed model, ``SHIPPED`` the installed model's own file."""
    monkeypatch.chdir(tmp_path)
    shutil.copyfile(installed_model, tmp_path / "CKPT")
    for name in ("en.txt", "fr.txt", "RUN-step1.safetensors"):
        write_input(tmp_path / name, "text")
    argv, flag, given = ISSUE_CASES[case]
    argv = [str(installed_model) if arg == "SHIPPED" else arg for arg in argv]
    files = {path: path.read_bytes() for path in (tmp_path / "CKPT", tmp_path / "RUN-step1.safetensors")}
    status, out, err = cli(capsys, *argv, "--force")
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, f"{flag}: writing", f"would replace the input {given!r}")
    assert {path: path.read_bytes() for path in files} == files


def test_a_resumed_run_may_be_replaced_by_its_continuation(tmp_path, monkeypatch, capsys):
    """The one output that may be an input, as documented: ``train --resume RUN --out RUN --force`` saves the
    continued run over the run it read (atomically, once it has trained); its step files may not replace it."""
    monkeypatch.chdir(tmp_path)
    train = ["train", "--steps", "1", "--eval-size", "0", "--out", "run.safetensors"]
    assert cli(capsys, *train)[0] == EXIT_OK
    status, _, err = cli(capsys, *train, "--resume", "run.safetensors", "--force")
    assert status == EXIT_OK, err
    os.link("run.safetensors", "run-step3.safetensors")
    status, _, err = cli(capsys, *train, "--resume", "run.safetensors", "--force", "--save-every", "1")
    assert status == EXIT_USAGE
    one_error_line(err, "--save-every: writing 'run-step3.safetensors' would replace the input 'run.safetensors'")
