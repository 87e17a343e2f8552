"""``bench --peers``' report on the tiny preset, every cell, anchor and ratio recomputed here, and the command's bar
chart of it (``transformer_cli.plots``); the peers themselves against the reference: tests/benchmarks/test_peers.py."""

from __future__ import annotations

import importlib.util
import json

import pytest
from support import require

from reference_numpy import TransformerConfig
from transformer_bench import bench as bench_module
from transformer_bench import timing
from transformer_cli import plots


def test_bench_peers_report(monkeypatch, tmp_path):
    """``bench --peers`` end to end on the tiny preset (NumPy and PyTorch backends, small anchors): every cell,
    the anchors, and every ratio equal to its value over its anchor, recomputed here."""
    require("torch", "torch")
    from transformer_bench import peers

    monkeypatch.setattr(bench_module, "MATMUL_SIZE", 64)
    monkeypatch.setattr(bench_module, "BANDWIDTH_MIB", 4)
    monkeypatch.setattr(timing, "PRODUCTS", {name: timing.PRODUCTS[name] for name in ("numpy", "torch")})
    shapes = {"batch": 2, "src_len": 6, "tgt_len": 5, "decode_tokens": 51}
    report = bench_module.bench("tiny", **shapes, names=("numpy", "torch"), repeats=2, peers=True)
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    installed = [name for name, (_, modules, _) in peers.PEERS.items()
                 if all(importlib.util.find_spec(m) for m in modules)]
    cells = {(m["backend"], m["task"]) for m in data["measurements"]}
    expected = {("numpy", "forward"), *(("torch", task) for task in bench_module.PEER_TASKS)}
    expected |= {(peer, task) for peer in installed for task in bench_module.PEER_TASKS
                 if (peer, task) != ("torch.nn.Transformer", "beam 4 batch 1") and peer != "transformers"}
    assert cells == expected
    missing = {(m["name"], m["reason"].split(":")[0]) for m in data["missing"]}
    if "torch.nn.Transformer" in installed:
        assert ("torch.nn.Transformer", "beam 4 batch 1") in missing
    if "transformers" in installed:                      # the preset's epsilon of 1e-6: the export refuses it
        assert ("transformers", "cannot run this config") in missing

    anchors = data["anchors"]
    assert set(anchors["gemm_gflops"]) == {"numpy", "torch"}
    assert anchors["best_gemm"]["gflops"] == max(anchors["gemm_gflops"].values()) > 0
    assert anchors["gemm_gflops"][anchors["best_gemm"]["framework"]] == anchors["best_gemm"]["gflops"]
    bandwidth = anchors["bandwidth"]["gb_per_s"]
    config, source = TransformerConfig.preset("tiny"), shapes["decode_tokens"] - 50
    for task, rows in (("greedy batch 1", 1), ("greedy batch 8", 8), ("beam 4 batch 1", 4)):
        assert anchors["step_bytes"][task] == timing.decode_step_bytes(config, rows, source, shapes["decode_tokens"])
        assert anchors["bound_seconds_per_step"][task] == pytest.approx(anchors["step_bytes"][task] / bandwidth / 1e9)

    for m in data["measurements"]:
        assert m["min_seconds"] <= m["seconds"] <= m["max_seconds"] and m["compile_seconds"] >= 0
        assert m["gflops"] == pytest.approx(m["flops"] / m["seconds"] / 1e9)
        same_task_peers = [p["unit_seconds"] for p in data["measurements"] if p["kind"] == "peer" and
                           p["task"] == m["task"]]
        if m["task"] == "forward":
            assert m["tokens"] is None and m["unit_seconds"] == m["seconds"] and m["ratio_to_bound"] is None
            assert m["ratio_to_best_gemm"] == pytest.approx(m["gflops"] / anchors["best_gemm"]["gflops"])
        else:
            assert 1 <= m["tokens"] <= shapes["decode_tokens"] and m["ratio_to_best_gemm"] is None
            assert m["unit_seconds"] == pytest.approx(m["seconds"] / m["tokens"])
            bound = anchors["bound_seconds_per_step"][m["task"]]
            assert m["ratio_to_bound"] == pytest.approx(m["unit_seconds"] / bound)
        if m["kind"] == "peer" and m["task"] != "forward":
            assert m["tokens"] == shapes["decode_tokens"]                 # forced to the same length
        if same_task_peers:
            assert m["ratio_to_best_peer"] == pytest.approx(m["unit_seconds"] / min(same_task_peers))
        assert m["task"] in data["computes"][m["backend"]]
        uncached = m["backend"] == "torch.nn.Transformer" and m["task"].startswith("greedy")
        assert m["repeats"] == (1 if uncached else 2)                      # decoding without a cache: timed once
    text = bench_module.format_bench(report)
    for heading in ("forward", "greedy batch 1 per token", "greedy batch 8 per step", "best float32 GEMM",
                    "memory bandwidth", "what each timed call computes"):
        assert heading in text
    require("matplotlib", "cli")
    plots.plot_bench(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
