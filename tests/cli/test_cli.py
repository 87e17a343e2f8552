"""The ``transformer-reference`` command through its real entry point (the installed console
script), on a small checkpoint so that the run stays short; its error paths and exit codes
in-process through ``transformer_cli.main.main`` (NumPy only, no framework imported)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from in_process import cli
from safetensors import safe_open

from equivalence import backends
from reference_numpy import TransformerConfig, init_params, load_checkpoint, parameter_shapes, save_checkpoint
from reference_numpy.checkpoint import load_training_state
from transformer_bench import compare as compare_module
from transformer_bench import timing
from transformer_cli import main as cli_main
from transformer_cli.main import EXIT_DISAGREEMENT, EXIT_INTERNAL, EXIT_OK, EXIT_USAGE
from transformer_tasks.progress import progress_bar

ROOT = Path(__file__).resolve().parents[2]
TINY = TransformerConfig.preset("tiny")

SCRIPT = shutil.which("transformer-reference", path=str(Path(sys.executable).parent))
pytestmark = pytest.mark.skipif(SCRIPT is None, reason="the package is not installed (pip install -e .), "
                                                       "so the transformer-reference script does not exist")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    result = run("init", "tiny.safetensors", "--preset", "tiny", "--seed", "3", cwd=path)
    assert result.returncode == 0, result.stderr
    return path


def installed_port() -> str:
    adapters, _ = backends.load()
    if not adapters:
        pytest.skip("no port framework is installed: a broken port weight needs a port to break")
    return next(iter(adapters))


# 30 to 70 s: the installed command in a fresh interpreter importing every framework, each backend's forward pass in
# float64 and float32 and its greedy decoding (JAX's and TensorFlow's compiled): the one run of `compare` through the
# console script, whose exit status, stdout and plot file only a process shows.
def test_compare_prints_the_table_and_succeeds(workdir):
    result = run("compare", "tiny.safetensors", "--plot", "errors.png", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    for row in ("src_embed", "encoder.layers.0", "encoder.layers.1", "encoder", "decoder.layers.2", "log_probs",
                "worst error/bound", "first over bound", "first non-finite", "greedy identical", "forward ms",
                "forward path", "status"):
        assert f"\n{row} " in table, f"row {row!r} missing from:\n{table}"
    assert "numpy/cpu/f32" in table
    for port in backends.load()[0]:
        assert f"{port}/cpu/f64" in table and f"{port}/cpu/f32" in table
    for missing in backends.load()[1]:
        assert f"{missing.name}: not installed (" in table and "missing): pip install 'transformer-reference[" in table
    assert "all backends agree with the reference" in table and "nan" not in table
    png = (workdir / "errors.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_a_broken_port_weight_fails_at_its_stage(workdir):
    port = installed_port()
    result = run("compare", "tiny.safetensors", "--json", "--backends", port,
                 "--perturb", f"{port}:decoder.layers.1.ffn.linear1.bias", cwd=workdir)
    assert result.returncode == EXIT_DISAGREEMENT, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"checkpoint", "config", "policy", "ok", "runs", "missing", "translations", "runtime"}
    assert report["ok"] is False and report["policy"] == {"float64_relative": 1e-12, "float32_factor": 8,
                                                          "low_precision_factor": 8}
    runs = {(run["backend"], run["device"], run["dtype"]): run for run in report["runs"]}
    broken = runs[(port, "cpu", "float64")]
    assert broken["ok"] is False and broken["first_failing_stage"] == "decoder.layers.1"
    assert broken["first_non_finite_stage"] is None
    assert [stage["ok"] for stage in broken["stages"][:broken_index(broken)]] == [True] * broken_index(broken)
    assert set(broken["stages"][0]) == {"stage", "max_abs_error", "max_relative_error", "bound", "ok", "non_finite",
                                        "added"}
    assert broken["stages"][broken_index(broken)]["added"] is False      # what the broken layer adds fails too
    assert runs[("numpy", "cpu", "float32")]["ok"] is True


def broken_index(run: dict) -> int:
    return [stage["stage"] for stage in run["stages"]].index("decoder.layers.1")


DEVICE_COMMANDS = {"compare": ["compare", "--preset", "tiny"],
                   "bench": ["bench", "--preset", "tiny", "--src-len", "8", "--tgt-len", "8", "--decode-tokens", "60"],
                   "translate": ["translate", "one"], "train": ["train", "--steps", "1"],
                   "plot attention": ["plot", "attention", "--preset", "tiny", "--out", "a.png"]}


@pytest.mark.parametrize("command", list(DEVICE_COMMANDS))
def test_every_command_that_runs_a_model_takes_a_device_and_checks_it_first(command, in_workdir, capsys):
    """``--device cpu|gpu:N`` places the ports; a device the backend does not have here is one line naming the
    devices it has, before any work; a name that is not a device is argparse's one line."""
    port = installed_port()
    backend_flag = ["--backend", port] if command == "translate" else ["--backends", port]
    absent = f"gpu:{len(backends.load((port,))[0][port].devices())}"        # one past the GPUs present here
    status, out, err = cli(capsys, *DEVICE_COMMANDS[command], *backend_flag, "--device", absent)
    assert status == EXIT_USAGE and out == "", err
    assert f"error: --device {absent}: {port} has cpu" in err and len(err.strip().splitlines()) == 1
    status, _, err = cli(capsys, *DEVICE_COMMANDS[command], "--device", "tpu")
    assert status == EXIT_USAGE and "a device is cpu or gpu:N (N = 0, 1, ...), got 'tpu'" in err
    assert not (in_workdir / "a.png").exists()


def test_bad_input_is_one_line_and_exit_status_2(workdir):
    result = run("compare", "missing.safetensors", cwd=workdir)
    assert result.returncode == EXIT_USAGE == 2 and result.stdout == ""
    assert result.stderr.startswith("transformer-reference: error: checkpoint 'missing.safetensors'")
    assert len(result.stderr.strip().splitlines()) == 1


# 30 to 60 s: the installed command in a fresh interpreter timing every backend's forward pass and decoders (JAX's and
# TensorFlow's compiled first) and the machine's GEMM and bandwidth anchors: the one end-to-end run of `bench`.
def test_bench_reports_json_and_a_bar_chart(workdir):
    result = run("bench", "--preset", "tiny", "--batch", "2", "--src-len", "6", "--tgt-len", "5",
                 "--decode-tokens", "55", "--repeats", "1", "--json", "--plot", "bench.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    anchors = report["anchors"]
    assert anchors["best_gemm"]["gflops"] == max(anchors["gemm_gflops"].values()) > 0
    assert anchors["bandwidth"]["gb_per_s"] > 0 and report["machine"]["cores"] >= 1 and not report["peers"]
    tasks = {(m["backend"], m["task"]) for m in report["measurements"]}
    assert ("numpy", "forward") in tasks and ("numpy", "greedy (uncached)") in tasks
    for port in backends.load()[0]:
        assert {(port, "forward"), (port, "greedy (cached)"), (port, "greedy (uncached)")} <= tasks
    for measurement in report["measurements"]:
        assert measurement["seconds"] > 0 and measurement["gflops"] > 0 and measurement["compile_seconds"] >= 0
        assert measurement["min_seconds"] <= measurement["seconds"] <= measurement["max_seconds"]
        assert set(measurement) >= {"backend", "device", "task", "first_call_seconds", "flops", "ratio_to_best_gemm",
                                    "ratio_to_bound", "ratio_to_best_peer", "tokens", "kind"}
        assert measurement["ratio_to_best_peer"] is None                  # no peers without --peers
    assert (workdir / "bench.png").read_bytes().startswith(b"\x89PNG")


# ----------------------------------------------------------------------------- error paths, in-process

@pytest.fixture
def in_workdir(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def refuse_backend_work(names, *_):
    pytest.fail(f"a backend was loaded ({names}) although the command line was wrong")


# (arguments, the flag or argument the message must name); each must fail before any backend loads
USAGE_ERRORS = [
    (["compare", "tiny.safetensors", "--backends", ""], "--backends"),
    (["compare", "tiny.safetensors", "--backends", " , "], "--backends"),
    (["compare", "tiny.safetensors", "--backends", "numpy,pytorch"], "--backends"),
    (["compare", "tiny.safetensors", "--plot", "no/such/directory/errors.png"], "--plot"),
    (["compare", "tiny.safetensors", "--plot", "."], "--plot"),
    (["compare", "tiny.safetensors", "--plot", "errors.txt"], "--plot"),
    (["compare", "tiny.safetensors", "--dtype", "float8"], "--dtype"),
    (["compare", "tiny.safetensors", "--dtype", ","], "--dtype"),
    (["compare", "tiny.safetensors", "--precision-report", "drift.txt"], "--precision-report"),
    (["compare", "tiny.safetensors", "--precision-report", "drift.png", "--dtype", "float64"], "--precision-report"),
    (["compare", "tiny.safetensors", "--perturb", "torch"], "--perturb"),
    (["compare", "tiny.safetensors", "--perturb", "torch:no.such.tensor"], "--perturb"),
    (["bench", "--dtype", "int8"], "--dtype"),
    (["bench", "--peers", "--dtype", "bfloat16"], "--peers"),
    (["bench", "--compiled", "--dtype", "bfloat16"], "--compiled"),
    (["translate", "--dtype", "float8", "twelve"], "--dtype"),
    (["bench", "--batch", "0"], "--batch"),
    (["bench", "--batch", "-2"], "--batch"),
    (["bench", "--batch", "two"], "--batch"),
    (["bench", "--src-len", "0"], "--src-len"),
    (["bench", "--tgt-len", "-1"], "--tgt-len"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--decode-tokens", "0"], "--decode-tokens"),
    (["bench", "--decode-tokens", "50"], "--decode-tokens"),     # budget = source length + 50 >= 51
    (["bench", "--preset", "tiny", "--src-len", str(TINY.max_len + 1), "--tgt-len", "4", "--decode-tokens", "60"],
     "--src-len"),
    (["bench", "--preset", "tiny", "--src-len", "4", "--tgt-len", "4", "--decode-tokens", str(TINY.max_len + 1)],
     "--decode-tokens"),
    (["bench", "--preset", "huge"], "--preset"),
    (["bench", "tiny.safetensors", "--preset", "tiny"], "--preset"),
    (["bench", "tiny.safetensors", "--src-len", str(TINY.max_len + 1), "--tgt-len", "4", "--decode-tokens", "60"],
     "--src-len"),
    (["bench", "--backends", ""], "--backends"),
    (["bench", "--plot", "no/such/directory/bench.png"], "--plot"),
    (["plot", "pe", "--length", "0"], "--length"),
    (["plot", "pe", "--d-model", "7"], "--d-model"),
    (["plot", "pe", "--d-model", "0"], "--d-model"),
    (["plot", "pe", "--out", "no/such/directory/pe.png"], "--out"),
    (["plot", "attention", "tiny.safetensors", "--layer", "-1"], "--layer"),
    (["plot", "attention", "tiny.safetensors", "--out", "fresh.png", "--kind", "encoder",
      "--layer", str(TINY.n_encoder_layers)], "--layer"),                   # fresh.png: attention.png is the workdir's
    (["plot", "attention", "tiny.safetensors", "--out", "fresh.png", "--kind", "decoder_self",
      "--layer", str(TINY.n_decoder_layers)], "--layer"),
    (["plot", "attention", "tiny.safetensors", "--head", "-1"], "--head"),
    (["plot", "attention", "tiny.safetensors", "--out", "fresh.png", "--head", str(TINY.n_heads)], "--head"),
    (["plot", "attention", "tiny.safetensors", "--out", "attention"], "--out"),
    (["plot", "attention", "tiny.safetensors", "--backends", "numpy,nope"], "--backends"),
    (["init", "new.safetensors", "--seed", "-1"], "--seed"),
    (["init", "new.safetensors", "--preset", "huge"], "--preset"),
    (["init", "no/such/directory/new.safetensors"], "OUT"),
    (["init", "."], "OUT"),
    (["train", "--steps", "0"], "--steps"),
    (["train", "--batch-size", "0"], "--batch-size"),
    (["train", "--symbols", "0"], "--symbols"),
    (["train", "--learning-rate-scale", "0"], "--learning-rate-scale"),
    (["train", "--learning-rate-scale", "nan"], "--learning-rate-scale"),
    (["train", "--dropout", "1"], "--dropout"),
    (["train", "--label-smoothing", "-0.1"], "--label-smoothing"),
    (["train", "--warmup-steps", "0"], "--warmup-steps"),
    (["train", "--stop-at", "1.5"], "--stop-at"),
    (["train", "--backends", "numpy,nope"], "--backends"),
    (["train", "--plot", "curves.txt"], "--plot"),
    (["train", "--backends", "numpy,torch", "--out", "run.safetensors"], "--out"),
    (["train", "--out", "tiny.safetensors"], "--out"),                      # exists: kept without --force
    (["train", "--out", "no/such/directory/run.safetensors"], "--out"),
    (["train", "--resume", "tiny.safetensors"], "--resume"),                # weights without a training state
    (["train", "--resume", "no-such-run.safetensors"], "checkpoint"),
]


@pytest.mark.parametrize("args, flag", USAGE_ERRORS, ids=[" ".join(args[:2]) + f" {flag}#{number}"
                                                           for number, (args, flag) in enumerate(USAGE_ERRORS)])
def test_a_usage_error_names_its_flag_before_any_work(args, flag, in_workdir, monkeypatch, capsys):
    monkeypatch.setattr(backends, "load", refuse_backend_work)
    status, out, err = cli(capsys, *args)
    assert status == EXIT_USAGE, err
    assert "Traceback" not in err and out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("transformer-reference") and "error: " in last and flag in last, err
    assert not (in_workdir / "new.safetensors").exists()


def test_compare_in_low_precision_and_the_precision_report(in_workdir, capsys):
    """``--dtype`` picks the precisions; the reference runs in each below float64 (its own error is the yardstick)
    and the precision report draws one panel per precision."""
    status, out, err = cli(capsys, "compare", "tiny.safetensors", "--backends", "numpy", "--dtype",
                           "bfloat16,float16", "--json")
    assert status == EXIT_OK, err
    report = json.loads(out)
    assert [(run["backend"], run["dtype"]) for run in report["runs"]] == [("numpy", "bfloat16"), ("numpy", "float16")]
    assert report["policy"]["low_precision_factor"] == 8
    for run in report["runs"]:                                   # 8 x the reference's own error: ratio 1/8 exactly
        assert max(stage["max_abs_error"] / stage["bound"] for stage in run["stages"]) == 0.125
    status, out, err = cli(capsys, "compare", "tiny.safetensors", "--backends", "numpy", "--precision-report",
                           "drift.png")
    assert status == EXIT_OK, err
    assert "numpy/cpu/bf16" in out and "numpy/cpu/f16" in out and "numpy/cpu/f32" in out
    assert "bfloat16, float16 error <= 8 x max(the reference's own error" in out
    assert (in_workdir / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_comparison_of_nothing_fails(in_workdir, monkeypatch, capsys):
    """Requested backends none of which is installed compare nothing: an error, never agreement."""
    monkeypatch.setitem(backends.BACKENDS, "torch",
                        ("equivalence.backends.torch", ("no_such_framework_here",), "torch"))
    for args in (["compare", "tiny.safetensors", "--backends", "torch"],
                 ["bench", "--preset", "tiny", "--src-len", "4", "--tgt-len", "4", "--decode-tokens", "60",
                  "--backends", "torch"],
                 ["plot", "attention", "tiny.safetensors", "--backends", "torch", "--out", "nothing.png"]):
        status, out, err = cli(capsys, *args)
        assert status == EXIT_USAGE and out == "" and "Traceback" not in err, err
        assert err.startswith("transformer-reference: error: --backends: none of the requested backends is installed")
        assert "torch: not installed (no_such_framework_here missing)" in err
    status, out, err = cli(capsys, "compare", "tiny.safetensors", "--backends", "numpy",
                           "--perturb", "jax:src_embed.weight")
    assert status == EXIT_USAGE and out == "" and "--perturb names backend 'jax'" in err
    assert compare_module.Report("nothing", TINY, runs=[], missing=[]).ok is False


def test_init_never_replaces_a_file_without_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    trained = tmp_path / "trained.safetensors"
    trained.write_bytes(b"weights that took a week")
    dangling = tmp_path / "link.safetensors"
    dangling.symlink_to(tmp_path / "elsewhere.safetensors")
    for name in ("trained.safetensors", "link.safetensors"):
        status, out, err = cli(capsys, "init", name)
        assert status == EXIT_USAGE and out == "" and "Traceback" not in err
        assert err == f"transformer-reference: error: OUT: {name!r} already exists; pass --force to replace it\n"
    assert trained.read_bytes() == b"weights that took a week"
    assert dangling.is_symlink() and not (tmp_path / "elsewhere.safetensors").exists()
    status, out, err = cli(capsys, "init", "trained.safetensors", "--force", "--seed", "4")
    assert status == EXIT_OK and out.startswith("wrote trained.safetensors"), err
    config, params = load_checkpoint(trained)
    expected = init_params(TINY, seed=4, dtype=np.float32)
    assert config == TINY and all(np.array_equal(params[name], value) for name, value in expected.items())


def huge_checkpoint(path: Path, scale: float, dtype, prefix: str = "") -> str:
    """The tiny checkpoint with every matrix whose name starts with ``prefix`` scaled by ``scale``."""
    params = init_params(TINY, seed=0, dtype=dtype)
    save_checkpoint(path, TINY, {name: value * dtype(scale) if value.ndim == 2 and name.startswith(prefix) else value
                                 for name, value in params.items()})
    return str(path)


def test_a_non_finite_stage_is_named_not_printed_as_a_number(tmp_path, capsys):
    """Decoder matrices scaled by 1e20 in float32: the decoder's queries and keys are ~1e20, their
    dot products ~1e40 overflow float32's 3.4e38, and the softmax of inf - inf is NaN; the
    encoder and the target embedding never touch those matrices and stay finite and in bound.
    float64 (max 1.8e308) computes the same model finitely, so the oracle exists."""
    path = huge_checkpoint(tmp_path / "huge.safetensors", 1e20, np.float32, prefix="decoder.")

    def reject(constant):
        raise AssertionError(f"--json printed a bare {constant}, which is not JSON")

    status, out, err = cli(capsys, "compare", path, "--backends", "numpy", "--json")
    assert status == EXIT_DISAGREEMENT and "Traceback" not in err, err
    report = json.loads(out, parse_constant=reject)
    (run,) = report["runs"]
    assert (run["backend"], run["dtype"], run["ok"], report["ok"]) == ("numpy", "float32", False, False)
    assert run["first_non_finite_stage"] == run["first_failing_stage"] == "decoder.layers.0"
    stages = {stage["stage"]: stage for stage in run["stages"]}
    for name in ("src_embed", "encoder.layers.0", "encoder.layers.1", "encoder", "tgt_embed"):
        assert stages[name]["ok"] and stages[name]["non_finite"] is None and stages[name]["max_abs_error"] >= 0
    assert stages["decoder.layers.0"]["non_finite"] == "nan" and stages["decoder.layers.0"]["max_abs_error"] is None

    status, out, _ = cli(capsys, "compare", path, "--backends", "numpy")
    assert status == EXIT_DISAGREEMENT
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["decoder.layers.0"].split()[1:] == ["nan", "in", "output!"]
    assert re.search(r"^first non-finite\s+decoder\.layers\.0$", out, re.M)
    assert "first gives non-finite values (NaN or inf) at decoder.layers.0" in out
    assert "SOME BACKENDS DISAGREE" in out and "agree with the reference" not in out


def test_a_checkpoint_that_overflows_float64_is_an_input_error(tmp_path, capsys):
    """Matrices scaled by 1e200: products of two of them (~1e400) overflow even float64, so there
    is no reference to compare against."""
    path = huge_checkpoint(tmp_path / "huge64.safetensors", 1e200, np.float64)
    status, out, err = cli(capsys, "compare", path, "--backends", "numpy")
    assert status == EXIT_USAGE and out == "" and "Traceback" not in err
    assert err.startswith("transformer-reference: error: the float64 reference itself gives nan at stage encoder.")


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(in_workdir, monkeypatch, capsys):
    def full_disk(*_):
        raise OSError(28, "No space left on device", "new.safetensors")

    monkeypatch.setattr(cli_main, "save_checkpoint", full_disk)
    status, out, err = cli(capsys, "init", "new.safetensors")
    assert status == EXIT_USAGE and "Traceback" not in err
    assert err == "transformer-reference: error: [Errno 28] No space left on device: 'new.safetensors'\n"

    def bug(*_, **__):
        raise RuntimeError("a planted internal bug")

    monkeypatch.setattr(compare_module, "compare", bug)
    status, out, err = cli(capsys, "compare", "tiny.safetensors", "--backends", "numpy")
    assert status == EXIT_INTERNAL and out == ""
    assert "Traceback" in err and "RuntimeError: a planted internal bug" in err
    assert err.strip().splitlines()[-1].startswith("transformer-reference: internal error")


def test_exit_codes_are_documented(capsys):
    """Each exit code is in ``--help`` and in the exit-code table of docs/cli.md."""
    table = (ROOT / "docs" / "cli.md").read_text()
    for args in (["--help"], ["compare", "--help"]):
        status, out, _ = cli(capsys, *args)
        assert status == EXIT_OK
        for code in (EXIT_OK, EXIT_DISAGREEMENT, EXIT_USAGE, EXIT_INTERNAL):
            assert re.search(rf"^  {code}  \S", out, re.M), out
            assert re.search(rf"^\| `{code}` \| \S", table, re.M)
    assert (EXIT_OK, EXIT_DISAGREEMENT, EXIT_USAGE, EXIT_INTERNAL) == (0, 1, 2, 3)


# ----------------------------------------------------------------------------- optional parts of an installation

CLI_EXTRA = ("tqdm", "matplotlib", "pygments")
REFUSE_CLI_EXTRA = f'''
import sys


class NotInstalled:
    """Refuses the cli extra's modules as Python does a module that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {CLI_EXTRA!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
'''


def test_the_command_runs_without_the_cli_extra(workdir, tmp_path):
    """An installation without the ``cli`` extra (``pip install 'transformer-reference[torch]'``):
    the real entry point, with a ``sitecustomize`` that refuses tqdm, matplotlib and Pygments.
    compare and bench run (no progress bar); a picture or the page is a one-line error naming the
    missing module and the extra, exit status 2, before any work."""
    (tmp_path / "sitecustomize.py").write_text(REFUSE_CLI_EXTRA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for module in CLI_EXTRA:
        refused = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert refused.returncode == 1 and f"No module named '{module}'" in refused.stderr
    without = lambda *args: subprocess.run([SCRIPT, *args], capture_output=True, text=True, cwd=workdir, env=env,
                                           timeout=900)

    result = without("compare", "tiny.safetensors", "--backends", "numpy")
    assert result.returncode == EXIT_OK, result.stderr
    assert "all backends agree with the reference" in result.stdout and "Traceback" not in result.stderr
    result = without("bench", "--preset", "tiny", "--batch", "2", "--src-len", "6", "--tgt-len", "5",
                     "--decode-tokens", "55", "--repeats", "1", "--backends", "numpy", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    assert {m["task"] for m in json.loads(result.stdout)["measurements"]} == {"forward", "greedy (uncached)"}

    for args, needs in ((["plot", "pe", "--out", "x.png"], "--out: drawing 'x.png' needs matplotlib"),
                        (["compare", "tiny.safetensors", "--backends", "numpy", "--plot", "x.png"],
                         "--plot: drawing 'x.png' needs matplotlib"),
                        (["side-by-side", "--out", "page"], "side-by-side needs pygments")):
        result = without(*args)
        assert result.returncode == EXIT_USAGE and result.stdout == "" and "Traceback" not in result.stderr, result
        assert f"{needs}: pip install 'transformer-reference[cli]'" in result.stderr.strip().splitlines()[-1]
    assert not (workdir / "x.png").exists() and not (workdir / "page").exists()


def test_the_progress_bar_is_tqdm_when_installed_and_nothing_without_it(monkeypatch):
    tqdm = pytest.importorskip("tqdm", reason="tqdm (the cli extra) is not installed")
    items = [1, 2, 3]
    bar = progress_bar("compare", "run", quiet=False)(items)
    assert isinstance(bar, tqdm.tqdm) and list(bar) == items
    bar.close()
    assert progress_bar("compare", "run", quiet=True)(items) is items
    monkeypatch.setitem(sys.modules, "tqdm", None)                     # as if not installed
    assert progress_bar("compare", "run", quiet=False)(items) is items


@pytest.mark.parametrize("name, module", [("torch", "torch"), ("jax", "jax"), ("jax", "flax"), ("jax", "optax"),
                                          ("tf", "tensorflow"), ("tf", "keras")])
def test_a_backend_missing_any_module_it_needs_is_not_installed(name, module, monkeypatch):
    """Each backend's probe checks every framework module its port imports: with one of them not
    importable the backend is reported, naming the module and the extra, and never imported."""
    monkeypatch.setitem(sys.modules, module, None)                     # as if not installed
    adapters, missing = backends.load((name,))
    assert adapters == {}
    assert missing == [backends.Missing(name, f"not installed ({module} missing): "
                                              f"pip install 'transformer-reference[{name}]'")]


def test_version_is_the_installed_distributions(capsys):
    status, out, _ = cli(capsys, "--version")
    assert status == EXIT_OK and out == f"transformer-reference {importlib.metadata.version('transformer-reference')}\n"


# ----------------------------------------------------------------------------- FLOP counts

# the pre-softmax projection: its own matrix, or the shared embedding transposed (section 3.4)
OUTPUT_PROJECTIONS = ("generator.weight", "shared_embed.weight")


def counted_macs(config: TransformerConfig, batch: int, weight_positions, attentions) -> int:
    """Multiply-adds counted from the checkpoint's own list of matrices (docs/checkpoint-format.md):
    each projection matrix applied at ``weight_positions(name)`` positions (embedding tables are
    looked up, not multiplied, except a shared one as the output projection), and per attention
    sublayer (``attentions``: (queries, keys) pairs) the scores and the weighted sum of every head,
    2 x queries x keys x d_k x h (eq. 1)."""
    macs = sum(weight_positions(name) * shape[0] * shape[1] for name, shape in parameter_shapes(config).items()
               if len(shape) == 2 and (not name.endswith("embed.weight") or name in OUTPUT_PROJECTIONS))
    return batch * (macs + sum(2 * queries * keys * config.d_model for queries, keys in attentions))


def forward_positions(name: str, src_len: int, tgt_len: int) -> int:
    return src_len if name.startswith("encoder.") or ".cross_attn.k_proj" in name or ".cross_attn.v_proj" in name \
        else tgt_len


SHAPES = [("tiny", 1, 1, 1), ("tiny", 3, 7, 5), ("base", 2, 32, 17), ("big", 1, 5, 9)]


@pytest.mark.parametrize("preset, batch, src_len, tgt_len", SHAPES)
def test_forward_flops_count_every_matrix_product(preset, batch, src_len, tgt_len):
    config = TransformerConfig.preset(preset)
    attentions = ([(src_len, src_len)] * config.n_encoder_layers
                  + [(tgt_len, tgt_len), (tgt_len, src_len)] * config.n_decoder_layers)
    macs = counted_macs(config, batch, lambda name: forward_positions(name, src_len, tgt_len), attentions)
    assert timing.forward_flops(config, batch, src_len, tgt_len) == 2 * macs
    encoder = counted_macs(config, batch, lambda name: src_len * name.startswith("encoder."),
                           [(src_len, src_len)] * config.n_encoder_layers)
    assert timing.encode_flops(config, batch, src_len) == 2 * encoder


@pytest.mark.parametrize("preset, batch, src_len, steps", SHAPES)
def test_decoding_flops_count_every_step(preset, batch, src_len, steps):
    """Step t: uncached, the decoder over all t positions, the memory's keys and values again, the
    output projection for the newest position only; cached, one position over t keys, the memory's
    keys and values once before the first step. The encoder is not included."""
    config = TransformerConfig.preset(preset)
    cross_keys_values = lambda name: ".cross_attn.k_proj" in name or ".cross_attn.v_proj" in name
    memory = counted_macs(config, batch, lambda name: src_len * cross_keys_values(name), [])

    def step(queries: int, keys: int) -> int:
        """``queries`` positions through the decoder over ``keys`` target positions, then the
        output projection for the newest one; the memory's keys and values not included."""
        positions = lambda name: (0 if name.startswith("encoder.") or cross_keys_values(name)
                                  else 1 if name in OUTPUT_PROJECTIONS else queries)
        return counted_macs(config, batch, positions, [(queries, keys), (queries, src_len)] * config.n_decoder_layers)

    uncached = sum(step(t, t) + memory for t in range(1, steps + 1))
    cached = memory + sum(step(1, t) for t in range(1, steps + 1))
    assert timing.decode_flops(config, batch, src_len, steps, cached=False) == 2 * uncached
    assert timing.decode_flops(config, batch, src_len, steps, cached=True) == 2 * cached


def test_measure_times_a_warm_up_then_the_median_of_the_repeats(monkeypatch):
    durations = iter([5.0, 1.0, 3.0, 2.0])                            # warm-up, then the three timed calls
    monkeypatch.setattr(timing, "timed", lambda function: (next(durations), function()))
    calls = []
    result = timing.measure(lambda: calls.append("call") or len(calls), 3, warm_up=lambda: calls.append("warm-up"))
    assert calls == ["warm-up", "call", "call", "call"]
    assert result == timing.Timing(first=5.0, median=2.0, result=4, times=(1.0, 3.0, 2.0))
    assert (result.minimum, result.maximum) == (1.0, 3.0)


def test_round_robin_runs_every_call_once_per_round(monkeypatch):
    """A warm-up round, then rounds in which each call runs once in turn (a call with fewer repeats drops out)."""
    durations = iter([9.0, 8.0, 1.0, 4.0, 3.0, 2.0, 5.0])
    monkeypatch.setattr(timing, "timed", lambda function: (next(durations), function()))
    order = []
    calls = {name: (lambda name=name: order.append(name) or len(order)) for name in ("a", "b")}
    result = timing.round_robin(calls, {"a": 3, "b": 2})
    assert order == ["a", "b", "a", "b", "a", "b", "a"]
    assert result["a"] == timing.Timing(first=9.0, median=3.0, result=7, times=(1.0, 3.0, 5.0))
    assert result["b"] == timing.Timing(first=8.0, median=3.0, result=6, times=(4.0, 2.0))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("preset, batch, src_len, steps", SHAPES)
def test_decode_step_bytes_count_every_tensor_a_step_reads(preset, batch, src_len, steps, norm_first):
    """The weights of a cached step from the checkpoint's own list of tensors (docs/checkpoint-format.md): every
    decoder tensor but the cross-attention's key and value projections (applied to the memory once), and the
    output projection; per row the self-attention keys and values of t positions at step t (averaged over the
    steps) and the memory's (src_len positions), in every decoder layer. float32: 4 bytes."""
    config = TransformerConfig.preset(preset, norm_first=norm_first)
    read = lambda name: (name.startswith("decoder.") and ".cross_attn.k_proj" not in name
                         and ".cross_attn.v_proj" not in name) or name in OUTPUT_PROJECTIONS
    weights = sum(int(np.prod(shape)) for name, shape in parameter_shapes(config).items() if read(name))
    prefixes = sum(range(1, steps + 1)) / steps
    caches = batch * config.n_decoder_layers * 2 * config.d_model * (prefixes + src_len)
    assert timing.decode_step_bytes(config, batch, src_len, steps) == pytest.approx(4 * (weights + caches), rel=1e-12)


@pytest.mark.parametrize("norm_first", [False, True])
def test_read_every_step_picks_the_decoder_weights_a_step_reads(norm_first):
    """On every checkpoint name, and on the same names written as a port's slash-separated paths:
    every decoder tensor but the cross-attention's key and value projections (the rule of the test above)."""
    config = TransformerConfig.preset("tiny", norm_first=norm_first)
    for name in parameter_shapes(config):
        expected = (name.startswith("decoder.") and ".cross_attn.k_proj" not in name
                    and ".cross_attn.v_proj" not in name)
        assert timing.read_every_step(name) == expected, name
        assert timing.read_every_step("transformer/" + name.replace(".", "/")) == expected, name


# ----------------------------------------------------------------------------- train

def train_json(capsys, *args: str) -> list[dict]:
    status, out, err = cli(capsys, "train", "--json", *args)
    assert status == EXIT_OK, err
    return json.loads(out)


def test_train_learns_saves_its_state_and_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """The reference (NumPy only) on a small copy task: the loss falls, the saved run holds its training state, and
    a run resumed from it gives exactly the losses of one run that never stopped (same batches, same arithmetic)."""
    monkeypatch.chdir(tmp_path)
    task = ["--symbols", "4", "--max-length", "4", "--batch-size", "16", "--warmup-steps", "20", "--eval-size", "8"]
    whole = train_json(capsys, *task, "--steps", "40")[0]
    assert whole["backend"] == "numpy" and whole["steps"] == 40 and whole["losses"][-1] < 0.75 * whole["losses"][0]
    first = train_json(capsys, *task, "--steps", "25", "--out", "run.safetensors")[0]
    state = load_training_state(tmp_path / "run.safetensors")
    assert state.step == 25 and state.config.warmup_steps == 20
    rest = train_json(capsys, *task, "--steps", "15", "--resume", "run.safetensors", "--out", "rest.safetensors")[0]
    assert rest["first_step"] == 25 and first["losses"] + rest["losses"] == whole["losses"]
    assert load_training_state(tmp_path / "rest.safetensors").step == 40
    assert 0.0 <= rest["accuracy"] <= 1.0


def test_train_in_bfloat16_keeps_float32_masters_and_saves_them(tmp_path, monkeypatch, capsys):
    """``--dtype bfloat16``: the same copy task in mixed precision (each step in bfloat16, float32 masters and
    moments) learns too, and the saved run is float32, resumable in float32."""
    monkeypatch.chdir(tmp_path)
    task = ["--symbols", "4", "--max-length", "4", "--batch-size", "16", "--warmup-steps", "20", "--eval-size", "8"]
    run = train_json(capsys, *task, "--steps", "40", "--dtype", "bfloat16", "--out", "run.safetensors")[0]
    assert run["steps"] == 40 and run["losses"][-1] < 0.75 * run["losses"][0]
    state = load_training_state(tmp_path / "run.safetensors")
    assert state.step == 40 and all(m.dtype == np.float32 for m in state.first_moments.values())
    with safe_open(tmp_path / "run.safetensors", "np") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {np.dtype(np.float32)}
    status, _, err = cli(capsys, "train", "--dtype", "float16", "--data-parallel", "2", "--steps", "1")
    assert status == EXIT_USAGE and "--data-parallel trains in float32 or float64; --dtype float16" in err


def test_train_stops_once_the_validation_set_is_copied(tmp_path, monkeypatch, capsys):
    """Every 100 steps greedy decoding copies the validation sequences; the run stops at the first check that
    reaches --stop-at, and not before."""
    monkeypatch.chdir(tmp_path)
    result = train_json(capsys, "--symbols", "2", "--max-length", "2", "--batch-size", "16", "--warmup-steps", "20",
                        "--eval-size", "20", "--steps", "2000", "--stop-at", "0.6")[0]
    checks = result["validation"]
    assert [check["step"] for check in checks] == list(range(100, result["steps"] + 1, 100)) and result["steps"] < 2000
    assert checks[-1]["exact"] >= 0.6 and all(check["exact"] < 0.6 for check in checks[:-1])
    assert all(check["loss"] > 0 for check in checks)


def test_train_never_replaces_a_run_without_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.safetensors").write_bytes(b"precious")
    status, _, err = cli(capsys, "train", "--steps", "1", "--out", "run.safetensors")
    assert status == EXIT_USAGE and "--force" in err
    assert (tmp_path / "run.safetensors").read_bytes() == b"precious"


def test_train_in_two_backends_draws_their_curves_side_by_side(workdir):
    """Through the installed command: the reference and one port from the same weights on the same batches, one
    checkpoint each (``{backend}`` in --out), a progress bar's worth of output and the picture."""
    port = installed_port()
    result = run("train", "--backends", f"numpy,{port}", "--steps", "3", "--batch-size", "4", "--eval-size", "4",
                 "--out", "run-{backend}.safetensors", "--force", "--plot", "curves.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^numpy\s+1-3\s", result.stdout, re.M) and re.search(rf"^{port}\s+1-3\s", result.stdout, re.M)
    for name in ("numpy", port):
        assert load_training_state(workdir / f"run-{name}.safetensors").step == 3
    assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_are_written(in_workdir, capsys):
    """In this process (the plots are drawn by the reference and matplotlib: a process shows nothing more)."""
    assert cli(capsys, "plot", "pe", "--length", "40", "--d-model", "32", "--out", "pe.png")[0] == EXIT_OK
    status, _, err = cli(capsys, "plot", "attention", "tiny.safetensors", "--kind", "decoder_cross", "--layer", "1",
                         "--head", "3", "--src", "5 6 7 2", "--tgt", "1 8 9", "--out", "attention.png")
    assert status == EXIT_OK, err
    for name in ("pe.png", "attention.png"):
        png = (in_workdir / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5_000
