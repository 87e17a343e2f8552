"""The ``transformer-reference`` command through its real entry point (the installed console
script), on a small checkpoint so that the run stays short."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_cli import backends

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


def test_compare_prints_the_table_and_succeeds(workdir):
    result = run("compare", "tiny.safetensors", "--plot", "errors.png", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    for row in ("src_embed", "encoder.layers.0", "encoder.layers.1", "encoder", "decoder.layers.2", "log_probs",
                "worst error/bound", "first over bound", "greedy identical", "forward ms", "status"):
        assert f"\n{row} " in table, f"row {row!r} missing from:\n{table}"
    assert "numpy/cpu/f32" in table
    for port in backends.load()[0]:
        assert f"{port}/cpu/f64" in table and f"{port}/cpu/f32" in table
    for missing in backends.load()[1]:
        assert f"{missing.name}: not installed: pip install 'transformer-reference[" in table
    assert "all backends agree with the reference" in table
    png = (workdir / "errors.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_a_broken_port_weight_fails_at_its_stage(workdir):
    port = installed_port()
    result = run("compare", "tiny.safetensors", "--json", "--backends", port,
                 "--perturb", f"{port}:decoder.layers.1.ffn.linear1.bias", cwd=workdir)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"checkpoint", "config", "policy", "ok", "runs", "missing"}
    assert report["ok"] is False and report["policy"] == {"float64_relative": 1e-12, "float32_factor": 8}
    runs = {(run["backend"], run["device"], run["dtype"]): run for run in report["runs"]}
    broken = runs[(port, "cpu", "float64")]
    assert broken["ok"] is False and broken["first_failing_stage"] == "decoder.layers.1"
    assert [stage["ok"] for stage in broken["stages"][:broken_index(broken)]] == [True] * broken_index(broken)
    assert set(broken["stages"][0]) == {"stage", "max_abs_error", "max_relative_error", "bound", "ok"}
    assert runs[("numpy", "cpu", "float32")]["ok"] is True


def broken_index(run: dict) -> int:
    return [stage["stage"] for stage in run["stages"]].index("decoder.layers.1")


def test_bad_input_is_one_line_and_exit_status_2(workdir):
    result = run("compare", "missing.safetensors", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: checkpoint") and len(result.stderr.strip().splitlines()) == 1
    result = run("compare", "tiny.safetensors", "--perturb", "torch:no.such.tensor", cwd=workdir)
    assert result.returncode == 2 and "no.such.tensor" in result.stderr


def test_bench_reports_json_and_a_bar_chart(workdir):
    result = run("bench", "--preset", "tiny", "--batch", "2", "--src-len", "6", "--tgt-len", "5",
                 "--decode-tokens", "55", "--repeats", "1", "--json", "--plot", "bench.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["matmul_gflops"] > 0 and report["machine"]["cores"] >= 1
    tasks = {(m["backend"], m["task"]) for m in report["measurements"]}
    assert ("numpy", "forward") in tasks and ("numpy", "greedy (uncached)") in tasks
    for port in backends.load()[0]:
        assert {(port, "forward"), (port, "greedy (cached)"), (port, "greedy (uncached)")} <= tasks
    for measurement in report["measurements"]:
        assert measurement["seconds"] > 0 and measurement["gflops"] > 0 and measurement["compile_seconds"] >= 0
        assert set(measurement) >= {"backend", "device", "task", "first_call_seconds", "flops",
                                    "fraction_of_matmul_rate", "tokens"}
    assert (workdir / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_plots_are_written(workdir):
    assert run("plot", "pe", "--length", "40", "--d-model", "32", "--out", "pe.png", cwd=workdir).returncode == 0
    result = run("plot", "attention", "tiny.safetensors", "--kind", "decoder_cross", "--layer", "1", "--head", "3",
                 "--src", "5 6 7 2", "--tgt", "1 8 9", "--out", "attention.png", cwd=workdir)
    assert result.returncode == 0, result.stderr
    for name in ("pe.png", "attention.png"):
        png = (workdir / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5_000
    bad = run("plot", "attention", "tiny.safetensors", "--head", "9", cwd=workdir)
    assert bad.returncode == 2 and "head must be in [0, 4)" in bad.stderr
