"""``scripts/bench_revisions.py`` end to end on the tiny preset, the NumPy reference alone, HEAD against itself: each
revision's processes report the backend's task, the record and the table say the same, and a result file is never
replaced. No time is asserted."""

from __future__ import annotations

import json

import pytest
from support import script

ARGS = ["HEAD", "HEAD", "--rounds", "1", "--repeats", "1", "--preset", "tiny", "--length", "60",
        "--backends", "numpy"]


@pytest.fixture(scope="module")
def bench():
    return script("bench_revisions")


def test_both_revisions_are_timed_and_recorded(bench, tmp_path):
    out = tmp_path / "result"
    assert bench.main([*ARGS, "--out", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert [(row["backend"], row["task"]) for row in record["rows"]] == [("numpy", "forward")]
    row = record["rows"][0]
    assert row["before"] > 0 and row["after"] > 0
    assert row["ratio"] == pytest.approx(row["after"] / row["before"], rel=1e-12)
    assert row["before_range"] == [row["before"], row["before"]]       # one process of each revision
    table = out.with_suffix(".md").read_text()
    assert f"| numpy | forward | {row['before'] * 1e3:,.1f} (" in table
    assert f"| {row['ratio']:.3f} |" in table


def test_a_result_file_is_never_replaced(bench, tmp_path, capsys):
    out = tmp_path / "result"
    out.with_suffix(".md").write_text("kept\n")
    with pytest.raises(SystemExit) as stop:
        bench.main([*ARGS, "--out", str(out)])
    assert stop.value.code == 2
    assert "never replaced" in capsys.readouterr().err
    assert out.with_suffix(".md").read_text() == "kept\n"
    assert not out.with_suffix(".json").exists()
