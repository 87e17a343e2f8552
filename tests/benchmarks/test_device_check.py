"""``scripts/device_check.py``, the GPU agreement in one command, run here on the CPU (``--device cpu``: every GPU
hidden from every framework) so that the code a GPU run takes cannot rot while no GPU is around: the quick run
passes with every installed port in every section; a planted port bug (``--perturb``) is a FAIL row and exit status
1; a check that raises is an error row and the run goes on; a backend that is not installed is a skip with its
reason; a run in which no port compared anything fails."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import FRAMEWORKS, script

ROOT = Path(__file__).resolve().parents[2]
device_check = script("device_check")


def run_check(tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    """The script in a process of its own on the CPU, with ``--out``: (exit status, its output, its JSON report)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "--device", "cpu",
                           "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    report = json.loads((tmp_path / "device_check.json").read_text())
    return done.returncode, done.stdout + done.stderr, report


def rows_of(report: dict, **fields: str) -> list[dict]:
    return [row for row in report["rows"] if all(row[key] == value for key, value in fields.items())]


@pytest.mark.slow
def test_the_quick_check_passes_on_the_cpu(tmp_path):
    """``device_check.py --device cpu --quick``: exit 0, one table, every installed port ok in every section, each
    forward precision of the quick subset compared, the environment recorded."""
    status, out, report = run_check(tmp_path, "--quick")
    assert status == 0 and report["ok"] and report["finished"], out[-4000:]
    installed = {port for port, framework in FRAMEWORKS.items() if importlib.util.find_spec(framework)}
    assert installed, "no port installed: nothing to check"
    assert {row["status"] for row in report["rows"]} <= {"ok", "info", "skip"}
    for port in installed:
        sections = {row["section"] for row in rows_of(report, backend=port)}
        assert sections == {"setup", *device_check.SECTIONS}, port
        checks = {row["check"] for row in rows_of(report, backend=port, section="forward", status="ok")}
        assert checks == {f"stages+greedy {dtype}" for dtype in device_check.QUICK_FORWARD_DTYPES}, port
    assert set(report["environment"]["frameworks"]) == installed
    assert "every check agrees" in out and "section     port" in out
    assert (tmp_path / "device_check.txt").read_text().startswith("section")


def test_a_planted_port_bug_is_a_disagreement(tmp_path):
    """One weight of the PyTorch port off by one part in a million: float64's stage agreement fails at the layer
    that reads it, the run exits 1 and says so; float32 and bfloat16, whose bounds are wider than the change, agree
    (the slow test above runs every port unperturbed)."""
    pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")
    status, out, report = run_check(tmp_path, "--quick", "--backends", "torch", "--sections", "forward",
                                    "--perturb", "torch:encoder.layers.0.ffn.linear1.weight")
    assert status == 1 and report["finished"] and not report["ok"]
    (float64,) = rows_of(report, backend="torch", check="stages+greedy float64")
    assert float64["status"] == "FAIL" and float64["error"] > float64["bound"]
    assert "first over its bound: encoder.layers.0" in float64["note"]
    assert [row["status"] for row in rows_of(report, backend="torch", section="forward")[1:]] == ["ok", "ok"]
    assert "DISAGREEMENT" in out


def test_a_check_that_raises_is_an_error_row_and_the_run_goes_on(capsys):
    checks = device_check.Checks("cpu")

    def raising() -> device_check.Outcome:
        raise RuntimeError("CUDA out of memory\nthe rest of the message")

    def disagreeing() -> device_check.Outcome:
        raise AssertionError("loss at step 3: 1.0 vs 2.0")

    error = checks.run("forward", "torch", "stages", raising)
    failed = checks.run("training", "torch", "steps", disagreeing)
    over = checks.run("forward", "jax", "stages", lambda: device_check.Outcome(2.0, 1.0))
    within = checks.run("forward", "jax", "stages", lambda: device_check.Outcome(1.0, 2.0))
    assert (error.status, error.note) == ("error", "RuntimeError: CUDA out of memory")
    assert (failed.status, failed.note) == ("FAIL", "loss at step 3: 1.0 vs 2.0")
    assert (over.status, over.ratio, within.status) == ("FAIL", 2.0, "ok")
    assert "CUDA out of memory" in capsys.readouterr().out                  # printed as it went
    assert device_check.exit_status(checks.rows) == 1
    assert device_check.exit_status([within]) == 0
    assert device_check.exit_status([over]) == 1


def test_a_backend_that_is_not_installed_is_a_skip_with_its_reason(monkeypatch):
    """TensorFlow absent (as on the GPU machine): a skip row naming it, nothing imported; a run in which no port
    compared anything exits 1, whatever the reference's own rows say."""
    from equivalence import backends

    monkeypatch.setattr(backends, "absent_frameworks", lambda name: ["tensorflow", "keras"] if name == "tf" else [])
    checks = device_check.Checks("gpu:0")
    assert device_check.load_ports(checks, ("tf",)) == {}
    (row,) = checks.rows
    assert (row.backend, row.status) == ("tf", "skip") and "tensorflow" in row.note
    reference = device_check.Row("forward", "numpy", "cpu", "reference in every precision", "ok")
    assert device_check.exit_status([*checks.rows, reference]) == 1
