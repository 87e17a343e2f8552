"""``scripts/bench_translate.py --model opus-mt`` end to end on its tiny model (``--tiny``): every engine reports a
row, the same work (output tokens) as transformers' ``generate``, and the ports decode transformers' tokens (the
benchmark hands every engine the checkpoint's conventions: a wrong budget, start token or length penalty would show
here). The engines run in this process (``run`` replaced: a process of each framework's own would add its imports'
seconds) and ``compile_decoding`` is recorded, not run (Inductor compiles for about a minute at any size;
tests/test_export.py checks the compiled decoding). No time is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
from support import FRAMEWORKS

for module in ("torch", "transformers", "ctranslate2", "sentencepiece"):
    pytest.importorskip(module, reason=f"{module} is not installed: the opus-mt benchmark builds its model with "
                                       "transformers (torch), converts it with ctranslate2 and gives it a "
                                       "SentencePiece tokenizer (pip install '.[peers]' transformers sentencepiece)")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_translate.py"
SENTENCES, BATCH = 4, 4


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_translate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed(bench) -> list[str]:
    port = lambda engine: "torch" if engine == bench.COMPILED else engine            # noqa: E731
    return [engine for engine in bench.ENGINES
            if port(engine) not in FRAMEWORKS or importlib.util.find_spec(FRAMEWORKS[port(engine)])]


# About 20 s: each framework's first import and JAX's and TensorFlow's compiling of the one batch's shape
@pytest.mark.slow
def test_the_opus_mt_benchmark_reports_every_engine(bench, tmp_path, monkeypatch, capsys):
    import transformer_torch

    compiled = []
    monkeypatch.setattr(transformer_torch, "compile_decoding", compiled.append)
    monkeypatch.setattr(bench.runtime, "configure", lambda threads: None)
    monkeypatch.setattr(bench, "LOCK", str(tmp_path / "lock"))
    monkeypatch.setattr(bench, "run", lambda engine, threads, args: {
        **bench.measure(argparse.Namespace(**{**vars(args), "worker": engine, "threads": threads})), "load": 0.0})
    engines = installed(bench)
    bench.main(["--model", "opus-mt", "--tiny", "--sentences", str(SENTENCES), "--batch-size", str(BATCH),
                "--repeats", "1", "--engines", ",".join(engines), "--json", str(tmp_path / "rows.json")])
    rows = {row["engine"]: row for row in json.loads((tmp_path / "rows.json").read_text())}
    table = capsys.readouterr().out

    assert list(rows) == engines and all(f"\n{engine} " in table for engine in engines)
    assert len(compiled) == 1
    budget = bench.TINY["max_position_embeddings"]
    hf = rows[bench.HF]
    assert hf["same_as"] == bench.HF and SENTENCES <= hf["tokens"] <= SENTENCES * budget
    for engine, row in rows.items():
        assert row["warm_passes"] == 1 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["warm_s"])
        assert row["x_transformers"] == pytest.approx(row["warm_s"] / hf["warm_s"])
        if engine != bench.PEER:
            assert (row["same"], row["tokens"]) == (SENTENCES, hf["tokens"]), engine
    peer = rows[bench.PEER]
    assert SENTENCES <= peer["tokens"] <= SENTENCES * budget and peer["x_ctranslate2"] == 1.0
