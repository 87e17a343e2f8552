"""Nothing lost, nothing silent (issue 29, the command line): Ctrl-C and SIGTERM, flags checked before work, outputs
that never replace a file without ``--force`` (nor an input at all), special-token names as text, standard input
that is not UTF-8, ``--threads``, and the ``.partial`` files a killed save leaves. In-process through
``transformer_cli.main.main`` where it can be; the signals and the C locale through the installed command."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import inspect
import io
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
import threadpoolctl
from in_process import cli

from equivalence import backends, runtime
from reference_numpy import TransformerConfig, init_params, save_checkpoint
from reference_numpy.checkpoint import PARTIAL_SUFFIX, load_training_state
from reference_numpy.tokenizer import Tokenizer
from transformer_cli import plots
from transformer_cli.arguments import RANGES, Range
from transformer_cli.commands.train import saves
from transformer_cli.main import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, build_parser

SCRIPT = shutil.which("transformer-reference", path=str(Path(sys.executable).parent))
needs_script = pytest.mark.skipif(SCRIPT is None, reason="the package is not installed (pip install -e .), so the "
                                                         "transformer-reference script does not exist")
INSTALLED = tuple(backends.load(tuple(backends.BACKENDS))[0])
TINY = TransformerConfig.preset("tiny")


def one_error_line(err: str, *words: str) -> str:
    """The single line of a refusal, checked to name ``words``."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(word in lines[0] for word in words), err
    return lines[0]


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if a command loads a backend: its refusal must come before any work."""
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the flags were checked"))


# ----------------------------------------------------------------------------- usage errors: one line

@pytest.mark.parametrize("args, words", [
    (["train", "--nope"], ["train: error:", "unrecognized arguments: --nope",
                           "(see transformer-reference train --help)"]),
    (["average", "a.safetensors", "--out", "x"], ["average: error:", "--out", "transformer-reference average --help"]),
    (["plot"], ["plot: error:", "required"]),
    (["plot", "pe", "--nope"], ["plot pe: error:", "--nope", "(see transformer-reference plot pe --help)"]),
    (["bench", "--preset", "huge"], ["bench: error:", "--preset", "invalid choice"]),
    (["translate", "--beam", "zero"], ["--beam", "must be an integer"]),
    (["train", "--vocab-size", "1000000000000"], ["--vocab-size", "from 5 to 1,000,000"]),        # was an abort
    (["train", "--vocab-size", "1" + "0" * 30], ["--vocab-size", "from 5 to 1,000,000"]),        # was exit 3
    (["export", "a.safetensors"], ["export: error:", "required"]),
])
def test_a_usage_error_is_one_line_naming_the_flag(args, words, capsys):
    status, out, err = cli(capsys, *args)
    assert status == EXIT_USAGE and out == ""
    assert one_error_line(err, *words).startswith("transformer-reference")


@pytest.mark.parametrize("args, words", [
    (["translate", "--backend", "numpy", "--device", "gpu:3", "eighty"], ["--device gpu:3", "reference", "CPU only"]),
    (["translate", "--alpha", "0.5", "eighty"], ["--alpha 0.5", "greedy decoding", "--beam"]),
    (["evaluate", "numbers-en-fr", "--source", "en.txt", "--reference", "fr.txt", "--beam", "1", "--alpha", "1.0"],
     ["--alpha 1.0", "greedy decoding"]),
])
def test_a_flag_that_would_change_nothing_is_refused(args, words, capsys, tmp_path, monkeypatch):
    """A flag the command would ignore -- a GPU for the CPU-only reference, a length penalty for greedy
    decoding -- is one line naming it, not a silent success."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "en.txt").write_text("eighty\n")
    (tmp_path / "fr.txt").write_text("quatre-vingts\n")
    status, out, err = cli(capsys, *args)
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, *words)


@pytest.mark.parametrize("args", [["init", "{file}/x.safetensors"],
                                  ["translate", "--output", "{file}/fr.txt", "eighty"],
                                  ["export", "--to", "ctranslate2", "m.safetensors", "{file}/model"]])
def test_an_output_inside_a_file_is_refused_as_not_a_directory(args, tmp_path, capsys, no_backend):
    """An output path whose directory is a file: one line saying so (not that the directory does not exist), and
    the file kept."""
    file = tmp_path / "afile"
    file.write_text("a user's file")
    status, out, err = cli(capsys, *[arg.format(file=file) for arg in args])
    assert status == EXIT_USAGE and out == ""
    assert "does not exist" not in one_error_line(err, repr(str(file)), "is not a directory")
    assert file.read_text() == "a user's file"


# ----------------------------------------------------------------------------- every numeric flag in its range

def numeric_flags(parser: argparse.ArgumentParser | None = None, words: tuple[str, ...] = ()) -> list:
    """(the command's words, the flag's action) of every numeric flag of every command: those typed by a range."""
    found = []
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [flag for name, sub in action.choices.items() for flag in numeric_flags(sub, (*words, name))]
        elif isinstance(getattr(action.type, "__self__", None), Range):
            found.append((words, action))
    return found


NUMERIC_FLAGS = [pytest.param(words, action, id=" ".join([*words, action.option_strings[0]]))
                 for words, action in numeric_flags()]


def refused_values(bounds: Range) -> list[str]:
    """What a user can type that ``bounds`` refuses: past each end, huge, negative, not a number, nan and inf, a
    fraction or an exponent for an integer, an odd number for an even one."""
    huge = "1" + "0" * 30
    values = ["", "abc", huge, f"-{huge}", "9" * 400, "9" * 5000, "-1", "nan", "inf", "-inf", "1e400", "0x10"]
    if bounds.real:
        return [*values, f"{bounds.low if bounds.open_low else bounds.low - 0.5:g}",
                f"{bounds.high if bounds.open_high else bounds.high + 0.5:g}"]
    return [*values, str(bounds.low - 1), str(bounds.high + 1), "1.5", "1e3", *([str(bounds.low + 1)] * bounds.even)]


@pytest.mark.parametrize("words, action", NUMERIC_FLAGS)
def test_every_numeric_flag_refuses_a_value_outside_its_range_in_one_line_naming_it(words, action, capsys):
    flag = action.option_strings[0]
    bounds = RANGES[flag]
    for value in refused_values(bounds):
        status, out, err = cli(capsys, *words, f"{flag}={value}")
        assert status == EXIT_USAGE and out == "", (value, err)
        one_error_line(err, f"argument {flag}: must be {bounds}")


@pytest.mark.parametrize("words, action", NUMERIC_FLAGS)
def test_every_numeric_flag_takes_its_ends_and_shows_its_range(words, action):
    bounds = RANGES[action.option_strings[0]]
    middle = (bounds.low + bounds.high) / 2                               # in place of an end the range leaves out
    for value in (middle if bounds.open_low else bounds.low, middle if bounds.open_high else bounds.high):
        assert bounds.parse(f"{value:g}" if bounds.real else str(value)) == value
    assert action.default is None or bounds.holds(action.default)
    assert str(bounds) in action.help


def test_every_range_belongs_to_a_flag_and_every_number_flag_has_one():
    """The table has no range of a flag that is gone, and no option takes a number without a range."""
    actions = [action for _, action in numeric_flags()]
    assert {action.option_strings[0] for action in actions} == set(RANGES)
    parsers = [build_parser()]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            elif action.type in (int, float) or (type(action.default) in (int, float) and action.nargs != 0):
                assert action in actions or isinstance(getattr(action.type, "__self__", None), Range), action


def test_the_cli_docs_list_every_numeric_flag_with_its_range():
    """docs/cli.md, "Flags and their ranges": a row per flag of ``RANGES``, with its range as ``--help`` says it."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    for flag, bounds in RANGES.items():
        assert re.search(rf"^\| `{re.escape(flag)}` \| [^|]+ \| {re.escape(str(bounds))} \|", docs, re.M), flag


def test_vocab_size_below_the_corpus_alphabet_is_refused_naming_the_flag(tmp_path, monkeypatch, no_backend, capsys):
    monkeypatch.chdir(tmp_path)
    Path("src.txt").write_text("one two three\nfour five\n" * 20)
    Path("tgt.txt").write_text("un deux trois\nquatre cinq\n" * 20)
    status, out, err = cli(capsys, "train", "--source", "src.txt", "--target", "tgt.txt", "--preset", "tiny",
                           "--vocab-size", "5")
    assert status == EXIT_USAGE and out == ""
    needed = re.search(r"give at least (\d+)", one_error_line(err, "--vocab-size 5 is below"))
    assert needed and int(needed.group(1)) > 5


@pytest.mark.parametrize("every, first, steps", [(every, first, steps) for every in (1, 3, 4) for first in (0, 2, 8)
                                                 for steps in (1, 4, 10)])
def test_saves_counts_the_checkpoints_a_run_saves(every, first, steps):
    last = first + steps
    assert saves(every, first, steps) == len({step for step in range(first + 1, last + 1) if step % every == 0}
                                             | {last})


def test_average_of_more_checkpoints_than_the_run_saves_is_refused_before_work(tmp_path, monkeypatch, no_backend,
                                                                                capsys):
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", "--steps", "10", "--save-every", "4", "--average", "4", "--out",
                           "run.safetensors")
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, "--average 4", "--steps 10 with --save-every 4 give 3 checkpoints")
    assert list(tmp_path.iterdir()) == []


def test_running_out_of_memory_is_one_line_and_a_usage_error(tmp_path, monkeypatch, capsys):
    def exhausted(*args):
        raise MemoryError
    monkeypatch.setattr(plots, "plot_positional_encoding", exhausted)
    status, out, err = cli(capsys, "plot", "pe", "--length", "10000", "--out", str(tmp_path / "pe.png"))
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, "error: out of memory")


# ----------------------------------------------------------------------------- flags checked before any work

def test_train_checks_eval_size_and_max_length_before_any_work(tmp_path, monkeypatch, no_backend, capsys):
    monkeypatch.chdir(tmp_path)
    began = time.perf_counter()
    status, _, err = cli(capsys, "train", "--task", "numbers", "--eval-size", "5000")
    assert status == EXIT_USAGE and time.perf_counter() - began < 5          # no tokenizer learned, no model built
    one_error_line(err, "--eval-size 5000", "812")
    status, _, err = cli(capsys, "train", "--max-length", str(TINY.max_len))   # + eos: one position too many
    assert status == EXIT_USAGE
    one_error_line(err, f"--max-length {TINY.max_len}", f"max_len {TINY.max_len}")


@pytest.mark.parametrize("flag, value, saved", [("--warmup-steps", "50", "7"), ("--learning-rate-scale", "2", "0.5"),
                                                ("--dropout", "0.1", "0.0"), ("--layer-norm-eps", "1e-05", "1e-06")])
def test_resume_refuses_the_flags_it_would_ignore(flag, value, saved, tmp_path, monkeypatch, capsys):
    """A value other than the saved one is refused naming both; the saved value itself is accepted."""
    monkeypatch.chdir(tmp_path)
    assert cli(capsys, "train", "--steps", "1", "--eval-size", "0", "--warmup-steps", "7", "--learning-rate-scale",
               "0.5", "--out", "run.safetensors")[0] == EXIT_OK
    resume = ["train", "--resume", "run.safetensors", "--steps", "1", "--eval-size", "0"]
    assert cli(capsys, *resume, flag, saved)[0] == EXIT_OK
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the flags were checked"))
    status, out, err = cli(capsys, *resume, flag, value)
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, f"{flag} {value}", "run.safetensors", f"saved with {saved}")


def test_plot_attention_refuses_text_with_token_ids(tmp_path, monkeypatch, no_backend, capsys):
    monkeypatch.chdir(tmp_path)
    for ids in (["--src", "5 6 2"], ["--tgt", "1 5"]):
        status, _, err = cli(capsys, "plot", "attention", "--text", "eighty", *ids, "--out", "a.png")
        assert status == EXIT_USAGE
        one_error_line(err, "--text", "--src")
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("flag", ["--src", "--tgt"])
@pytest.mark.parametrize("ids", ["5 x 2", "5,6", "5 99999999999999999999999"])
def test_plot_attention_refuses_ids_that_are_not_int64_naming_the_flag(flag, ids, tmp_path, monkeypatch, no_backend,
                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "plot", "attention", "--preset", "tiny", flag, ids, "--out", "a.png")
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, f"{flag} must be space-separated integer token ids", repr(ids))
    assert not (tmp_path / "a.png").exists()


# ----------------------------------------------------------------------------- files: --force, and never an input

EXISTING_OUTPUTS = [
    (["plot", "pe", "--length", "4", "--d-model", "4", "--out", "mine.png"], "--out"),
    (["plot", "attention", "--preset", "tiny", "--out", "mine.png"], "--out"),
    (["compare", "--preset", "tiny", "--plot", "mine.png"], "--plot"),
    (["compare", "--preset", "tiny", "--precision-report", "mine.png"], "--precision-report"),
    (["bench", "--preset", "tiny", "--plot", "mine.png"], "--plot"),
    (["train", "--steps", "1", "--plot", "mine.png"], "--plot"),
]


@pytest.mark.parametrize("args, flag", EXISTING_OUTPUTS, ids=[" ".join(a[:2]) + " " + f for a, f in EXISTING_OUTPUTS])
def test_an_existing_file_is_replaced_only_with_force(args, flag, tmp_path, monkeypatch, no_backend, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.png").write_bytes(b"a user's picture")
    status, out, err = cli(capsys, *args)
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, flag, "'mine.png' already exists", "--force")
    assert (tmp_path / "mine.png").read_bytes() == b"a user's picture"


def test_plot_with_force_replaces_its_picture(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pe.png").write_bytes(b"old")
    status, _, err = cli(capsys, "plot", "pe", "--length", "4", "--d-model", "4", "--out", "pe.png", "--force")
    assert status == EXIT_OK, err
    assert (tmp_path / "pe.png").read_bytes().startswith(b"\x89PNG")


def test_an_input_is_never_replaced_even_with_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_checkpoint("mine.safetensors", TINY, init_params(TINY, seed=0))
    before = (tmp_path / "mine.safetensors").read_bytes()
    (tmp_path / "models").mkdir()
    save_checkpoint("models/inner.safetensors", TINY, init_params(TINY, seed=0))
    for args, flag in ((["export", "--to", "ctranslate2", "mine.safetensors", "mine.safetensors"], "OUTPUT_DIR"),
                       (["export", "--to", "ctranslate2", "models/inner.safetensors", "models"], "OUTPUT_DIR"),
                       (["export", "--to", "ctranslate2", "mine.safetensors", "./mine.safetensors"], "OUTPUT_DIR")):
        status, out, err = cli(capsys, *args, "--force")
        assert status == EXIT_USAGE and out == ""
        one_error_line(err, flag, "would replace the input")
    assert (tmp_path / "mine.safetensors").read_bytes() == before
    assert (tmp_path / "models" / "inner.safetensors").is_file()
    (tmp_path / "curve.png").write_bytes(b"not a checkpoint")
    status, _, err = cli(capsys, "plot", "attention", "curve.png", "--out", "curve.png", "--force")
    assert status == EXIT_USAGE
    one_error_line(err, "--out", "would replace the input 'curve.png'")
    assert (tmp_path / "curve.png").read_bytes() == b"not a checkpoint"


def test_side_by_side_refuses_an_empty_or_file_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing.html").write_text("mine")
    for out, words in (("", ["--out", "name a directory"]), ("existing.html", ["--out", "is a file"])):
        status, stdout, err = cli(capsys, "side-by-side", "--out", out)
        assert status == EXIT_USAGE and stdout == ""
        one_error_line(err, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.html"]
    assert (tmp_path / "existing.html").read_text() == "mine"


# ----------------------------------------------------------------------------- a save killed mid-write

def test_the_next_save_removes_a_killed_saves_partial_file_but_not_a_live_one(tmp_path):
    target = tmp_path / "run.safetensors"
    abandoned = tmp_path / f"run.safetensors.0badc0de{PARTIAL_SUFFIX}"
    abandoned.write_bytes(b"half a checkpoint")                      # its writer was killed: no lock held
    live = tmp_path / f"run.safetensors.1234abcd{PARTIAL_SUFFIX}"
    live.write_bytes(b"a save in progress")
    other = tmp_path / f"other.safetensors.0badc0de{PARTIAL_SUFFIX}"
    other.write_bytes(b"another file's")
    with open(live, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                             # as a living save holds it
        save_checkpoint(target, TINY, init_params(TINY, seed=0))
    assert not abandoned.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])


# ----------------------------------------------------------------------------- text: special tokens, UTF-8

@pytest.mark.parametrize("backend", INSTALLED)
def test_a_special_tokens_name_in_text_is_text_not_its_id(backend, capsys):
    """The shipped model's vocabulary has no '<', '/', '>': the text is refused naming them, never cut at eos."""
    status, out, err = cli(capsys, "translate", "--backend", backend, "seventy-one </s> eighty")
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, "seventy-one </s> eighty", "never seen", "'<'", "'/'", "'>'")


def test_special_token_names_round_trip_as_text_through_a_tokenizer_that_has_their_characters():
    pytest.importorskip("tokenizers")
    texts = ["x < y / z > w", "a <b> c", "one two three", "s and /s", "pad"] * 5
    config = TransformerConfig.preset("tiny", src_vocab_size=60, tgt_vocab_size=60)
    tokenizer = Tokenizer.train(texts, 60, config)
    for text in ("a </s> b", "<s> x", "y <pad>"):
        ids = tokenizer.encode(text)
        assert not {config.pad_id, config.bos_id, config.eos_id} & set(ids), (text, ids)
        assert tokenizer.decode(ids) == text


def test_stdin_that_is_not_utf8_is_one_line_naming_its_line(monkeypatch, capsys):
    stdin = io.TextIOWrapper(io.BytesIO(b"seventy-one\neighty\ntwo \xff hundred\nsixty\n"), encoding="latin-1")
    monkeypatch.setattr(sys, "stdin", stdin)
    status, out, err = cli(capsys, "translate")
    assert status == EXIT_USAGE
    assert out.splitlines() == ["soixante et onze", "quatre-vingts", "", "soixante"]   # an empty line in its place
    one_error_line(err, "standard input, line 3", "not UTF-8", "0xff")


@pytest.mark.parametrize("level, fails", [("2", False), ("2", True), ("0", False)])
def test_start_up_notices_are_held_unless_loading_fails_or_asked_for(capfd, monkeypatch, level, fails):
    """What a framework's native code writes to file descriptor 2 while it loads: dropped when quiet, written out
    when the load fails (so the error keeps its context) or when the user asked for TensorFlow's logs (level 0)."""
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", level)
    with pytest.raises(ImportError) if fails else contextlib.nullcontext():
        with runtime.start_up_notices_held():
            os.write(2, b"a native notice\n")
            if fails:
                raise ImportError("no such library")
    shown = capfd.readouterr().err
    assert shown == ("a native notice\n" if fails or level == "0" else "")
    os.write(2, b"after\n")                                       # descriptor 2 is stderr again
    assert capfd.readouterr().err == "after\n"


@needs_script
@pytest.mark.skipif("tf" not in INSTALLED, reason="TensorFlow is not installed: its notices cannot be checked")
def test_stdin_that_is_not_utf8_in_the_c_locale_and_no_tensorflow_notices(tmp_path):
    """One subprocess: under LC_ALL=C, bad bytes are the same one line; TensorFlow prints nothing of its own."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run([SCRIPT, "translate", "--backend", "tf"], input=b"eighty\n\xe9t\xe9\n", env=env,
                            capture_output=True, cwd=tmp_path, timeout=600)
    assert result.returncode == EXIT_USAGE
    assert result.stdout.decode() == "quatre-vingts\n\n"                  # an empty line for the line refused
    assert result.stderr.decode() == ("transformer-reference: error: standard input, line 2: not UTF-8 text "
                                      "(byte 0xe9 at offset 0)\n")


# ----------------------------------------------------------------------------- threads and versions

def openblas_threads() -> int | None:
    """What NumPy's OpenBLAS itself says its threads are (Linux): the symbol of the library NumPy loaded, read apart
    from ``threadpoolctl``, which ``runtime`` sets them with; None where NumPy loaded no OpenBLAS. Other packages map
    their own OpenBLAS (SciPy's, 32-bit integers, other symbols): NumPy's is the one in NumPy's wheel, ``numpy.libs``,
    or else the only one mapped."""
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.split()[-1].lower()})
    wheel = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    own = [path for path in mapped if os.path.dirname(path) == wheel] or mapped
    if len(own) != 1:
        return None
    library = ctypes.CDLL(own[0])
    names = [name for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                               "scipy_openblas_get_num_threads", "openblas_get_num_threads") if hasattr(library, name)]
    return getattr(library, names[0])() if names else None


OPENBLAS_THREADS = (f"import ctypes, os\nimport numpy as np\n{inspect.getsource(openblas_threads)}\n"
                    "print(openblas_threads())")
OPENBLAS = sys.platform.startswith("linux") and openblas_threads() is not None
WITHOUT_OPENBLAS = "reads the threads of the OpenBLAS NumPy loaded, from /proc/self/maps: Linux, NumPy with OpenBLAS"


@pytest.fixture
def restore_threads(monkeypatch):
    """``--threads`` changes the process's frameworks: put them back for the tests after this one."""
    monkeypatch.setattr(runtime, "_requested", None)
    for name in ("PJRT_NPROC", "XLA_FLAGS"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch else None
    blas = openblas_threads() if OPENBLAS else None
    yield
    if torch:
        torch.set_num_threads(before)
    if blas:
        threadpoolctl.threadpool_limits(blas, user_api="blas")


@pytest.mark.parametrize("command", [["compare", "--preset", "tiny", "--json", "--dtype", "float32"],
                                     ["train", "--steps", "1", "--eval-size", "0", "--json"]])
def test_threads_are_set_in_each_framework_and_recorded_with_the_versions(command, restore_threads, capsys):
    names = ",".join(name for name in INSTALLED if name in ("numpy", "torch", "jax"))
    status, out, err = cli(capsys, *command, "--backends", names, "--threads", "1")
    assert status == EXIT_OK, err
    report = json.loads(out)
    recorded = (report if isinstance(report, dict) else report[0])["runtime"]
    assert recorded["threads"] == 1 and recorded["visible_cores"] == len(os.sched_getaffinity(0))
    assert recorded["frameworks"]["numpy"]["version"] == np.__version__
    if OPENBLAS:                                      # NumPy's BLAS, as OpenBLAS itself says, and as recorded
        assert openblas_threads() == 1 and recorded["frameworks"]["numpy"]["blas_threads"] == {"openblas": 1}
    if "torch" in INSTALLED:
        import torch
        assert recorded["frameworks"]["torch"] == {"version": torch.__version__, "intra_op_threads": 1}
        assert torch.get_num_threads() == 1
    if "jax" in INSTALLED:                              # what XLA started with: the next test's concern
        assert recorded["frameworks"]["jax"] == {"version": recorded["frameworks"]["jax"]["version"],
                                                 "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
                                                 "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


@pytest.mark.skipif("jax" not in INSTALLED, reason="JAX is not installed: XLA's start-up settings need it")
@pytest.mark.parametrize("started", [False, True])
def test_xla_threads_go_into_the_environment_until_xla_starts_and_never_after(started, restore_threads,
                                                                              monkeypatch):
    """Before XLA's client starts, ``--threads 1`` is written where XLA reads it; after, the environment is left
    alone, since XLA reads it no more and JAX hashes ``XLA_FLAGS`` into its compilation-cache keys."""
    import jax.numpy as jnp
    jnp.zeros(1).block_until_ready()
    assert runtime.xla_started()                                           # JAX's own account, after an operation
    level = "--xla_backend_optimization_level=1"
    monkeypatch.setenv("PJRT_NPROC", "7")
    monkeypatch.setenv("XLA_FLAGS", f"{level} --xla_cpu_multi_thread_eigen=true")
    monkeypatch.setattr(runtime, "xla_started", lambda: started)
    runtime.configure(1)
    expected = ({"PJRT_NPROC": "7", "XLA_FLAGS": f"{level} --xla_cpu_multi_thread_eigen=true"} if started else
                {"PJRT_NPROC": "1", "XLA_FLAGS": f"{level} --xla_cpu_multi_thread_eigen=false"})
    assert {name: os.environ[name] for name in expected} == expected
    assert runtime.threads() == 1


# A fresh process (glibc's thresholds as it starts): 15 MB blocks allocated, written and freed two at a time, as a
# beam search's (rows, vocabulary) scores are; prints the page faults of each round, counted by the kernel.
FREED_MEMORY = """import json, resource, sys
import numpy as np
from equivalence import runtime
if sys.argv[1] == "reuse":
    runtime.reuse_freed_memory()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    first, second = np.ones((64, 58101), np.float32), np.ones((64, 58101), np.float32)
    del first, second
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[2:]))"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and Linux's fault counts")
def test_freed_memory_is_reused_without_page_faults():
    """runtime.reuse_freed_memory (called by ``configure``): blocks of a decoding step's size, freed and allocated
    again, fault in fewer than 64 pages a round after the first rounds (a Python arena of 256 KiB at most), where
    glibc's own thresholds, the control, fault in more every round (the memory it handed back at the heap's top)."""
    rounds = {how: json.loads(subprocess.run([sys.executable, "-c", FREED_MEMORY, how], capture_output=True,
                                             text=True, check=True).stdout)
              for how in ("reuse", "glibc")}
    assert max(rounds["reuse"]) < 64, rounds
    assert min(rounds["glibc"]) >= 64, rounds


# A fresh process: TensorFlow fixes its pools at its first operation. Its inter-op pool's threads are named
# tf_Compute (as the operating system lists them): counted apart from what TensorFlow's API or runtime report.
TF_POOLS = """import collections, json, os, sys
from equivalence import runtime
runtime.configure(int(sys.argv[1]))
tf = runtime.import_framework("tensorflow")
tf.function(lambda x: tf.matmul(x, x) + tf.matmul(x + 1, x))(tf.ones((8, 8)))
tasks = os.listdir("/proc/self/task")
names = collections.Counter(open(f"/proc/self/task/{task}/comm").read().strip() for task in tasks)
print(json.dumps({"tf_Compute": names["tf_Compute"], "recorded": runtime.settings()["frameworks"]["tensorflow"]}))"""


@pytest.mark.slow
@pytest.mark.skipif("tf" not in INSTALLED or not sys.platform.startswith("linux"),
                    reason="counts TensorFlow's threads in /proc: Linux, TensorFlow installed")
@pytest.mark.parametrize("threads", [1, 2])
def test_tensorflow_runs_a_graph_s_operations_on_as_many_threads_as_asked(threads):
    """``--threads N`` sets TensorFlow's inter-op pool too, whose threads run a graph's independent operations side by
    side (with its default, one per core, ``--threads 1`` would keep two cores busy), and records both of its pools."""
    done = subprocess.run([sys.executable, "-c", TF_POOLS, str(threads)], capture_output=True, text=True, check=True,
                          timeout=300)
    pools = json.loads(done.stdout.strip().splitlines()[-1])
    assert pools["tf_Compute"] == threads
    assert pools["recorded"]["intra_op_threads"] == pools["recorded"]["inter_op_threads"] == threads


@pytest.mark.skipif(not OPENBLAS, reason=WITHOUT_OPENBLAS)
@pytest.mark.parametrize("cores", [False, True])
def test_a_worker_started_with_blas_threads_has_that_many_in_numpy_s_blas(cores):
    """``runtime.blas_threads``: the environment a benchmark's worker starts with, its BLAS libraries' threads from
    the start (one thread, and as many as the visible cores: OpenBLAS takes no more)."""
    threads = runtime.visible_cores() if cores else 1
    done = subprocess.run([sys.executable, "-c", OPENBLAS_THREADS], capture_output=True, text=True, check=True,
                          env=os.environ | runtime.blas_threads(threads))
    assert int(done.stdout) == threads


def test_threads_default_to_the_visible_cores_and_zero_is_refused(capsys):
    status, _, err = cli(capsys, "translate", "--threads", "0", "one")
    assert status == EXIT_USAGE
    one_error_line(err, "--threads", "from 1 to")
    assert runtime.visible_cores() == len(os.sched_getaffinity(0))


def test_bench_warns_when_its_repeats_spread(monkeypatch, capsys):
    from transformer_bench import bench as bench_module
    from transformer_bench.bench import BUSY_SPREAD, Measurement

    steady = Measurement("numpy", "cpu", "forward", 1.0, 1.2, 1e9, min_seconds=0.95, max_seconds=1.05, repeats=3)
    busy = Measurement("torch", "cpu", "forward", 1.0, 1.2, 1e9, min_seconds=0.5, max_seconds=2.0, repeats=3)
    report = bench_module.BenchReport("tiny", {}, {}, None, [steady], [])
    assert report.busy is None and steady.spread == pytest.approx(0.1) and steady.spread < BUSY_SPREAD
    report.measurements.append(busy)
    assert "torch forward spread 150%" in report.busy and "busy" in report.busy
    monkeypatch.setattr(bench_module, "bench", lambda *_, **__: report)
    monkeypatch.setattr(bench_module, "format_bench", lambda _: "table")
    status, out, err = cli(capsys, "bench", "--preset", "tiny")
    assert status == EXIT_OK and out == "table\n"
    one_error_line(err, "bench: warning:", "torch forward spread 150%")


# ----------------------------------------------------------------------------- Ctrl-C and SIGTERM

def signalled(args: list[str], cwd: Path, signum: int, steps: int) -> tuple[int, str, str, list[int]]:
    """Run the command in a process group of its own with stderr on a terminal (so its progress bar shows), send
    ``signum`` to the whole group once the bar shows ``steps`` steps done or more (as a terminal's Ctrl-C reaches
    every process of the command, its workers too); (exit status, stdout, stderr, the group's processes still
    alive once it has exited)."""
    done = lambda text: any(int(n) >= steps for n in re.findall(rb"\| *(\d+)/\d+ ", text))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 0 columns: tqdm draws nothing
    process = subprocess.Popen([SCRIPT, *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=follower, start_new_session=True)
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 600
    try:
        while not done(seen) and time.monotonic() < deadline and process.poll() is None:
            if select.select([leader], [], [], 1)[0]:
                seen += os.read(leader, 65536)
        os.killpg(process.pid, signum)
        out = process.stdout.read()
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:                                           # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
        status = process.wait(timeout=600)
        return status, out.decode(), seen.decode(errors="replace").replace("\r", "\n"), left_in_group(process.pid)
    finally:
        os.close(leader)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)                    # whatever a failed test left running


def left_in_group(group: int, seconds: float = 10.0) -> list[int]:
    """The processes of process group ``group`` still alive (not zombies) after up to ``seconds``: a helper that
    ends when its parent does (multiprocessing's resource tracker) gets that long."""
    deadline = time.monotonic() + seconds
    while (alive := [pid for pid, fields in _processes().items() if fields[2] == str(group) and fields[0] != "Z"]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _processes() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after its name: state, parent, process group, ..."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            found[int(entry)] = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
    return found


INTERRUPTED = re.compile(r"transformer-reference: interrupted: (\w+) saved (\S+) at step (\d+) "
                         r"\(continue with --resume \S+\)$")


@pytest.mark.slow
@needs_script
@pytest.mark.parametrize("backend", INSTALLED)
def test_ctrl_c_during_train_saves_the_run_at_its_last_step_and_it_resumes_elsewhere(backend, tmp_path, monkeypatch,
                                                                                      capsys):
    signum = signal.SIGINT if INSTALLED.index(backend) % 2 == 0 else signal.SIGTERM     # both, across backends
    status, out, err, left = signalled(["train", "--backends", backend, "--steps", "100000", "--eval-size", "0",
                                        "--out", "run.safetensors"], tmp_path, signum, 3)
    assert status == EXIT_INTERRUPTED and not left, err
    assert out == "" and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    match = INTERRUPTED.match(line)
    assert match and match.group(1) == backend and match.group(2) == "run.safetensors", err
    step = int(match.group(3))
    assert step >= 3 and load_training_state(tmp_path / "run.safetensors").step == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.safetensors"]        # no .partial left behind
    other = INSTALLED[(INSTALLED.index(backend) + 1) % len(INSTALLED)]
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", "--backends", other, "--resume", "run.safetensors", "--steps", "1",
                           "--eval-size", "0", "--json")
    assert status == EXIT_OK, err
    assert json.loads(out)[0]["first_step"] == step


ENGINES = tuple(name for name in INSTALLED if name != "numpy")          # the ports: each its own data-parallel engine


# A process per engine: the signal goes to the command's whole process group, as a terminal's Ctrl-C does, and
# PyTorch's replicas are processes of their own; an engine's start-up, compilation and steps take 20 to 60 s
@pytest.mark.slow
@needs_script
@pytest.mark.parametrize("engine", ENGINES)
def test_ctrl_c_during_data_parallel_training_saves_its_last_step_and_stops_the_workers(engine, tmp_path, monkeypatch,
                                                                                        capsys):
    signum = signal.SIGINT if ENGINES.index(engine) % 2 == 0 else signal.SIGTERM       # both, across engines
    status, out, err, left = signalled(["train", "--backends", engine, "--data-parallel", "2", "--steps", "100000",
                                        "--batch-size", "8", "--eval-every", "0", "--eval-size", "0", "--threads",
                                        "1", "--out", "run.safetensors"], tmp_path, signum, 2)
    assert status == EXIT_INTERRUPTED and out == "" and "Traceback" not in err, err
    assert not left, f"processes of the run still alive: {left}"
    match = INTERRUPTED.match(err.strip().splitlines()[-1])
    assert match and match.group(1) == engine, err
    step = int(match.group(3))                       # within the piece of 100000 steps: the engine stopped early
    assert 2 <= step < 100000 and load_training_state(tmp_path / "run.safetensors").step == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.safetensors"]
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", "--backends", "numpy", "--resume", "run.safetensors", "--steps", "1",
                           "--eval-size", "0", "--json")
    assert status == EXIT_OK and json.loads(out)[0]["first_step"] == step, err


@needs_script
def test_sigterm_during_another_command_is_one_line_and_130(tmp_path):
    process = subprocess.Popen([SCRIPT, "translate"], cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdin.write("eighty\n")
    process.stdin.flush()
    assert process.stdout.readline() == "quatre-vingts\n"             # the model is loaded, waiting for a line
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == EXIT_INTERRUPTED and out == ""
    assert err == "transformer-reference: interrupted\n"
