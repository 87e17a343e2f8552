"""``scripts/bench_translate.py --model opus-mt`` end to end on its tiny model (``--tiny``): every engine reports a
row, the same work (output tokens) as transformers' ``generate``, and the ports decode transformers' tokens (the
benchmark hands every engine the checkpoint's conventions: a wrong budget, start token or length penalty would show
here). The engines run in this process (``run`` replaced: a process of each framework's own would add its imports'
seconds) and ``compile_decoding`` is recorded, not run (Inductor compiles for about a minute at any size;
tests/export/test_exporters.py checks the compiled decoding). No time is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import pytest
from support import FRAMEWORKS, script

for module in ("torch", "transformers", "ctranslate2", "sentencepiece"):
    pytest.importorskip(module, reason=f"{module} is not installed: the opus-mt benchmark builds its model with "
                                       "transformers (torch), converts it with ctranslate2 and gives it a "
                                       "SentencePiece tokenizer (pip install '.[peers]' transformers sentencepiece)")

SENTENCES, BATCH = 4, 4


@pytest.fixture(scope="module")
def bench():
    return script("bench_translate")


def installed(bench) -> list[str]:
    port = lambda engine: "torch" if engine in (bench.COMPILED, bench.TORCH_PARALLEL) else engine   # noqa: E731
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
        if engine not in (bench.PEER, bench.PARALLEL):
            assert (row["same"], row["tokens"]) == (SENTENCES, hf["tokens"]), engine
    peer, parallel = rows[bench.PEER], rows[bench.PARALLEL]
    assert SENTENCES <= peer["tokens"] <= SENTENCES * budget and peer["x_ctranslate2"] == 1.0
    # the whole file in one call, batches at once: CTranslate2's same batches, so its same outputs
    assert (parallel["same"], parallel["tokens"]) == (peer["same"], peer["tokens"])
    assert parallel["x_ctranslate2-parallel"] == 1.0


def test_an_xla_profile_is_split_by_the_instructions_of_the_optimised_program(bench, tmp_path):
    """``--profile``'s reading of XLA's trace: each kernel classed by its instruction in the dumped optimised HLO --
    a product (a dot, fused or not), top-k, a copy (a transpose), other work (exp) -- the loop itself not counted
    beside its body's kernels; run here on a small JAX program dumped by its own compiler options."""
    jax = pytest.importorskip("jax", reason="JAX is not installed: XLA's profile of a JAX program")
    import jax.numpy as jnp

    unique = float(time.time_ns() % 2**20)     # a program no compilation cache holds: compiled here, so dumped

    def work(x, w):
        def body(i, y):
            logits = jnp.exp(y @ w)                                               # a product, an exp
            return y + jax.lax.top_k(logits, 2)[0].sum() + jnp.transpose(y)       # top-k, a transpose
        return jax.lax.fori_loop(0, 3, body, x) + unique

    dump, trace = tmp_path / "hlo", tmp_path / "trace"
    program = jax.jit(work, compiler_options={"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True})
    x, w = jnp.ones((64, 64), jnp.float32), jnp.full((64, 64), 1e-3, jnp.float32)
    program(x, w).block_until_ready()
    jax.profiler.start_trace(str(trace))
    program(x, w).block_until_ready()
    jax.profiler.stop_trace()
    kernels = bench.xla_kernels(str(trace), bench.hlo_kinds(dump))

    kinds = {kind for kind, _ in kernels.values()}
    assert kinds == set(bench.PROFILE_KINDS) - {"outside kernels"}, kernels
    products = [label for label, (kind, _) in kernels.items() if kind == "products"]
    assert len(products) == 1 and products[0].endswith(" f32[64,64]"), kernels      # the one dot, x @ w
    assert not any(label.startswith("while") for label in kernels), kernels
    assert all(seconds > 0 for _, seconds in kernels.values())


def test_a_torch_profile_is_split_by_operator(bench):
    """``--profile`` for PyTorch: each operator's own time under ``torch.profiler``, products (a linear map) apart
    from top-k and the rest, the largest kernel named with its shapes, and the kinds summing to the pass."""
    import torch

    weight = torch.ones(256, 64)
    profile = bench.profiled_pass("torch", lambda: torch.topk(torch.nn.functional.linear(torch.ones(8, 64), weight)
                                                              .exp(), 2), None)

    assert set(profile["kinds"]) == set(bench.PROFILE_KINDS)
    assert profile["kinds"]["products"] > 0 and profile["kinds"]["top-k/sort"] > 0
    assert sum(profile["kinds"].values()) == pytest.approx(profile["seconds"])
    assert bench.torch_kind("aten::addmm") == "products" and bench.torch_kind("aten::exp") == "other kernels"
    assert bench.torch_kind("aten::index_select") == "copies"
    assert bench.torch_kind("mkl::_mkl_linear") == "products"          # Inductor's call of MKL's packed product


# About 20 s: the JAX worker's own process (XLA dumps its programs only when told at start) compiling the search
@pytest.mark.slow
def test_profile_reports_each_port_s_pass_by_kind_of_work(bench, tmp_path, monkeypatch, capsys):
    pytest.importorskip("jax", reason="JAX is not installed: the profile of its compiled search")
    monkeypatch.setattr(bench, "LOCK", str(tmp_path / "lock"))
    bench.main(["--model", "opus-mt", "--tiny", "--sentences", str(SENTENCES), "--batch-size", str(BATCH),
                "--repeats", "1", "--engines", "jax", "--profile", "--json", str(tmp_path / "rows.json")])
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    table = capsys.readouterr().out

    profile = row["profile"]
    assert list(profile["kinds"]) == list(bench.PROFILE_KINDS) and "one profiled warm pass" in table
    assert "the machine at 1 thread(s), one decoding step's matrix products" in table
    assert row["products_bound_s"] is None          # the tiny model's outputs end before the budget: no bound
    anchors = row["anchors"]                        # as printed: the step's products in each kernel, the bandwidth
    assert anchors["rows"] == BATCH * bench.BEAM_SIZE and anchors["bandwidth_gb_per_s"] > 0
    assert all(f"{kernel['step_s'] * 1e3:>8.1f} ms" in table for kernel in anchors["kernels"].values())
    assert profile["kinds"]["products"] > 0 and profile["kinds"]["top-k/sort"] > 0
    assert sum(profile["kinds"].values()) == pytest.approx(profile["seconds"])


def test_a_step_s_products_are_the_decoder_s_linear_maps_a_step_runs(bench):
    """The anchors' step (``step_products``) against transformers' own module tree of the tiny model: every linear
    map of its decoder but the cross-attention's key and value projections (applied to the memory once), and the
    output projection (``lm_head``)."""
    import torch
    import transformers

    model = transformers.MarianMTModel(transformers.MarianConfig(**bench.TINY))
    maps = [(module.in_features, module.out_features) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and (name.startswith("model.decoder.") or name == "lm_head")
            and not name.endswith(("encoder_attn.k_proj", "encoder_attn.v_proj"))]
    assert sorted(bench.step_products(bench.TINY)) == sorted(maps)


def test_the_bound_is_the_steps_at_the_fastest_kernel_when_every_step_is_full(bench):
    """``products_bound``: the budget's steps of every batch at the fastest kernel's step; none for a partial batch,
    for outputs short of the budget, or without anchors."""
    args = bench.parse(["--model", "opus-mt", "--sentences", "64", "--batch-size", "16"])
    machine = {"kernels": {"slow": {"step_s": 0.03}, "fast": {"step_s": 0.01}}}
    full = 64 * bench.BUDGET
    assert bench.products_bound(machine, full, args) == pytest.approx(4 * bench.BUDGET * 0.01)
    assert bench.products_bound(machine, full - 1, args) is None
    assert bench.products_bound(None, full, args) is None
    partial = bench.parse(["--model", "opus-mt", "--sentences", "60", "--batch-size", "16"])
    assert bench.products_bound(machine, 60 * bench.BUDGET, partial) is None
