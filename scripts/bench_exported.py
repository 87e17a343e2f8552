"""Benchmark of the exported artefacts' cached greedy decoding against CTranslate2 (float32, CPU).

1. The preset's seeded weights (``init_params(seed=0)``, as ``transformer-reference bench --peers`` makes them), saved
   to a temporary checkpoint and exported to each target (``transformer_export.export.export``: SavedModel,
   jax.export, torch.export, ONNX); the export time reported.
2. Each artefact loaded in this process as ``export --check`` loads it (``LOADERS`` and ``STEPS`` of
   ``transformer_export.check``; ONNX Runtime sessions with ``intra_op_num_threads`` = ``--threads``,
   ``inter_op_num_threads`` = 1) and greedy-decoded through ``encode`` and exactly ``--steps`` calls of ``step`` (no
   early stop, the argmax fed back, pad and bos excluded; the caches start as ``CACHED_GREEDY``'s zeros of capacity
   ``--steps``), for each ``--batch`` size. Beside them: CTranslate2 on the same weights (``CTranslate2Peer`` in a
   process of its own, ``intra_threads`` = ``--threads``, exactly ``--steps`` tokens), and, for reference, the
   ports' own cached greedy decoding (``equivalence.backends``: section 6.1's rules, it stops at eos or after source
   length + 50 tokens, so its step count is reported).
3. Every call timed interleaved (``timing.round_robin``: a warm-up round reported apart, then ``--repeats`` rounds),
   medians with their min-max, in ms per step (the call's time over its steps, the encoder included), as a ratio to
   CTranslate2's and to the bandwidth lower bound of a cached step (``timing.decode_step_bytes`` over the measured
   memory bandwidth, the anchor ``bench`` uses, timed in every round).
4. ``--profile``: one warm batch-1 step at index ``--steps`` // 2 of the torch.export program (``torch.profiler``,
   the self time of aten::mm/addmm/bmm/baddbmm/matmul/linear) and of the ONNX model (ONNX Runtime's profiling, the
   MatMul/Gemm/FusedMatMul nodes): the matrix products' ms against everything else of the step's unprofiled time,
   both as ratios to CTranslate2's whole batch-1 step, and the other operators that take the most.

    python scripts/bench_exported.py [--preset base] [--threads 2] [--steps 128] [--batch 1,8] [--repeats 5]
        [--targets savedmodel,jax-export,torch-export,onnx] [--no-ports] [--json FILE] [--profile]

The timed part holds an exclusive lock on /tmp/bench.lock, as the other ``scripts/bench_*.py`` do.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends, runtime  # noqa: E402
from reference_numpy import TransformerConfig, init_params  # noqa: E402
from reference_numpy.checkpoint import save_checkpoint  # noqa: E402
from transformer_bench.bench import BANDWIDTH, BANDWIDTH_MIB, bench_inputs  # noqa: E402
from transformer_bench.peers import CTranslate2Peer, OwnProcess  # noqa: E402
from transformer_bench.timing import (  # noqa: E402
    Timing,
    bench_lock,
    cpu_name,
    decode_step_bytes,
    memory_read,
    round_robin,
    timed,
)
from transformer_export.check import CACHED_GREEDY, LOADERS, STEPS  # noqa: E402
from transformer_export.export import WRITERS, export  # noqa: E402

CT2 = "ctranslate2"
FRAMEWORKS = {"savedmodel": ("tensorflow",), "jax-export": ("jax",), "torch-export": ("torch",),
              "onnx": ("torch", "onnxruntime")}          # what each target's export and loading import
PORTS = ("torch", "jax", "tf")
PROFILED_STEPS = 10
TORCH_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
ORT_PRODUCTS = {"MatMul", "Gemm", "FusedMatMul"}


def load_artefact(target: str, directory: Path, threads: int) -> dict[str, Any]:
    """The namespace in which ``LOADERS[target]``, ``STEPS[target]`` and ``CACHED_GREEDY`` ran on the artefact in
    ``directory`` (its ``encode``, ``step`` and ``empty_caches``); ONNX Runtime's sessions get
    ``threads`` intra-op threads and one inter-op thread."""
    namespace: dict[str, Any] = {"np": np, "sys": SimpleNamespace(argv=["", str(directory)])}
    with contextlib.ExitStack() as stack:
        if target == "onnx":
            onnxruntime, options = ort_options(threads)
            stack.enter_context(mock.patch.object(onnxruntime, "InferenceSession", functools.partial(
                onnxruntime.InferenceSession, sess_options=options)))
        exec(LOADERS[target] + STEPS[target] + CACHED_GREEDY, namespace)   # noqa: S102 - the project's own text
    return namespace


def ort_options(threads: int) -> tuple[Any, Any]:
    """onnxruntime, and session options of ``threads`` intra-op threads and one inter-op thread."""
    import onnxruntime  # type: ignore[import-untyped]  # ships no type information
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return onnxruntime, options


def fixed_greedy(namespace: dict[str, Any], config: TransformerConfig, src: np.ndarray, steps: int) -> np.ndarray:
    """``encode`` once, then exactly ``steps`` calls of ``step``, each fed the previous step's argmax (pad and bos
    excluded, as ``CACHED_GREEDY``), no early stop: the tokens (B, steps)."""
    encode, step = namespace["encode"], namespace["step"]
    memory, cross_keys, cross_values = encode(src)
    self_keys, self_values = namespace["empty_caches"](cross_keys, steps)
    token, tokens = np.full((len(src), 1), config.bos_id, dtype=np.int64), []
    for index in range(steps):
        log_probs, self_keys, self_values = step(token, index, memory, src, self_keys, self_values, cross_keys,
                                                 cross_values)
        log_probs = np.array(log_probs)
        log_probs[:, [config.pad_id, config.bos_id]] = -np.inf
        token = log_probs.argmax(axis=-1)[:, None]
        tokens.append(token)
    return np.concatenate(tokens, axis=1)


def step_arguments(namespace: dict[str, Any], config: TransformerConfig, src: np.ndarray, index: int,
                   capacity: int) -> tuple:
    """The arguments of one ``step`` call at ``index`` on ``src``'s memory, caches of ``capacity`` positions."""
    memory, cross_keys, cross_values = namespace["encode"](src)
    self_keys, self_values = namespace["empty_caches"](cross_keys, capacity)
    token = np.full((len(src), 1), config.eos_id, dtype=np.int64)
    return token, index, memory, src, self_keys, self_values, cross_keys, cross_values


def profile_step(target: str, namespace: dict[str, Any], arguments: tuple, step_ms: float) -> dict[str, Any]:
    """One warm batch-1 step (``arguments``: :func:`step_arguments`): the matrix products' ms (mean over
    PROFILED_STEPS profiled steps) and the operators outside them that take the most, against the step's unprofiled
    median ``step_ms``."""
    token, index = arguments[:2]
    for _ in range(3):
        namespace["step"](*arguments)
    per_op: dict[str, float] = defaultdict(float)           # operator -> ms per step
    if target == "torch-export":
        import torch
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for _ in range(PROFILED_STEPS):
                namespace["step"](*arguments)
        for event in profiler.key_averages():
            per_op[event.key] += event.self_cpu_time_total / 1e3 / PROFILED_STEPS
        products = TORCH_PRODUCTS
    else:
        onnxruntime, options = ort_options(runtime.threads())
        options.enable_profiling = True
        with tempfile.TemporaryDirectory() as directory:
            options.profile_file_prefix = str(Path(directory) / "step")
            session = onnxruntime.InferenceSession(namespace["sys"].argv[1] + "/step.onnx", sess_options=options,
                                                   providers=["CPUExecutionProvider"])
            feeds = dict(zip([argument.name for argument in session.get_inputs()],
                             (token, np.array(index, np.int64), *arguments[2:])))
            for _ in range(3 + PROFILED_STEPS):
                session.run(None, feeds)
            events = json.loads(Path(session.end_profiling()).read_text())
        runs = [event for event in events if event.get("name") == "model_run"][3:]      # the warm-up runs apart
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and \
                    event["ts"] >= runs[0]["ts"]:
                per_op[event["args"]["op_name"]] += event["dur"] / 1e3 / PROFILED_STEPS
        products = ORT_PRODUCTS
    product_ms = sum(ms for op, ms in per_op.items() if op in products)
    others = sorted(((op, ms) for op, ms in per_op.items() if op not in products), key=lambda item: -item[1])
    return {"index": index, "step_ms": step_ms, "products_ms": product_ms, "rest_ms": step_ms - product_ms,
            "operators_ms": sum(per_op.values()), "top_others": others[:4]}


def step_median(namespace: dict[str, Any], arguments: tuple, repeats: int = 10) -> float:
    """The median ms of one warm ``step`` call on ``arguments`` (:func:`step_arguments`; NumPy in and out),
    unprofiled."""
    call = lambda: namespace["step"](*arguments)
    call()
    return 1e3 * float(np.median([timed(call)[0] for _ in range(repeats)]))


def progress(schedule: list) -> Iterator:
    """The round-robin's calls, each announced on standard error with the seconds since the first."""
    start = time.perf_counter()
    for turn, key in schedule:
        print(f"[{time.perf_counter() - start:7.1f} s] round {turn}: {key[0]} batch {key[1]}", file=sys.stderr,
              flush=True)
        yield turn, key


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--targets", default=",".join(WRITERS))
    parser.add_argument("--no-ports", action="store_true", help="leave out the ports' own greedy decoding")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    targets = args.targets.split(",")
    unknown = [target for target in targets if target not in WRITERS]
    if unknown:
        raise ValueError(f"--targets: {unknown[0]!r} is not one of {', '.join(WRITERS)}")
    config = TransformerConfig.preset(args.preset)
    if args.steps > config.max_len:
        raise ValueError(f"--steps {args.steps}: the step's cache holds max_len = {config.max_len} positions")

    runtime.quiet()
    runtime.configure(args.threads)                 # before JAX starts: XLA reads its threads at start-up
    with runtime.start_up_notices_held():
        for module in dict.fromkeys(m for target in targets for m in FRAMEWORKS[target]):
            importlib.import_module(module)
    runtime.apply()

    params = init_params(config, seed=0, dtype=np.float32)
    _, _, decode_src = bench_inputs(config, 1, 1, 1, args.steps, max(batches))
    sources = {batch: decode_src[:batch] for batch in batches}
    lines = [f"preset {args.preset}, float32, {args.threads} threads; greedy decoding of exactly {args.steps} steps, "
             f"source length {decode_src.shape[1]}, batch {', '.join(map(str, batches))}; the caches' capacity "
             f"{args.steps}",
             f"machine: {cpu_name()}; repeats {args.repeats} after a warm-up round, interleaved"]
    exports: dict[str, float] = {}
    calls: dict[tuple[str, int], Callable[[], object]] = {}
    namespaces: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work, bench_lock():
        checkpoint = Path(work) / "seeded.safetensors"
        save_checkpoint(checkpoint, config, params)
        for target in targets:
            start = time.perf_counter()
            export(target, checkpoint, Path(work) / target)
            exports[target] = time.perf_counter() - start
            namespaces[target] = load_artefact(target, Path(work) / target, args.threads)
        runtime.apply()
        lines.append("export time: " + ", ".join(f"{target} {seconds:.1f} s" for target, seconds in exports.items()))
        for name, namespace in namespaces.items():
            for batch, src in sources.items():
                calls[(name, batch)] = functools.partial(fixed_greedy, namespace, config, src, args.steps)
        ct2 = OwnProcess(CTranslate2Peer, config, params, args.threads)
        for batch, src in sources.items():
            calls[(CT2, batch)] = functools.partial(ct2.greedy, src, args.steps)
        if not args.no_ports:
            adapters, missing = backends.load(PORTS)
            for name, adapter in adapters.items():
                model = adapter.build(config, params, "float32", "cpu")
                for batch, src in sources.items():
                    calls[(f"port: {name}", batch)] = functools.partial(adapter.greedy, model, src)
            lines += [f"port {m.name}: {m.reason}" for m in missing]
        read, read_bytes = memory_read(BANDWIDTH_MIB)
        calls[(BANDWIDTH, 0)] = read
        timings = round_robin(calls, args.repeats, progress)
        bandwidth = read_bytes / timings.pop((BANDWIDTH, 0)).median / 1e9
        results = tabulate(timings, config, sources, bandwidth, args.steps, lines)
        profiles = {}
        if args.profile:
            src, index = sources[batches[0]][:1], args.steps // 2
            ct2_step = next(r["ms_per_step"] for r in results if r["engine"] == CT2 and r["batch"] == 1) \
                if 1 in batches else 1e3 * timed(lambda: ct2.greedy(src, args.steps))[0] / args.steps
            for target in ("torch-export", "onnx"):
                if target in namespaces:
                    arguments = step_arguments(namespaces[target], config, src, index, args.steps)
                    profiles[target] = profile_step(target, namespaces[target], arguments,
                                                    step_median(namespaces[target], arguments))
            lines += ["", f"profile of one warm batch-1 step at index {index} (operators: mean of {PROFILED_STEPS} "
                          "profiled steps; step: its unprofiled median, NumPy in and out; rest = step - products; "
                          f"CTranslate2's whole step {ct2_step:.2f} ms)",
                      f"  {'artefact':<14}{'step':>9}{'products':>10}{'other ops':>11}{'rest':>9}{'products/CT2':>14}"
                      f"{'rest/CT2':>10}  largest other operators (ms)"]
            for target, p in profiles.items():
                others = ", ".join(f"{op} {ms:.2f}" for op, ms in p["top_others"])
                p["ct2_step_ms"] = ct2_step
                lines.append(f"  {target:<14}{p['step_ms']:>9.2f}{p['products_ms']:>10.2f}"
                             f"{p['operators_ms'] - p['products_ms']:>11.2f}{p['rest_ms']:>9.2f}"
                             f"{p['products_ms'] / ct2_step:>14.2f}{p['rest_ms'] / ct2_step:>10.2f}  {others}")
        ct2.close()
    print("\n".join(lines))
    report = {"preset": args.preset, "threads": args.threads, "steps": args.steps, "batches": batches,
              "source_length": int(decode_src.shape[1]), "machine": {"cpu": cpu_name(), **runtime.settings()},
              "export_seconds": exports, "bandwidth_gb_per_s": bandwidth, "results": results, "profile": profiles}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def tabulate(timings: dict[tuple[str, int], Timing], config: TransformerConfig, sources: dict[int, np.ndarray],
             bandwidth: float, steps: int, lines: list[str]) -> list[dict[str, Any]]:
    """One table per batch size: ms per step (median, min-max), the warm-up call, steps, x CTranslate2,
    x the bandwidth bound; appended to ``lines``, returned as rows."""
    rows = []
    for batch, src in sources.items():
        bound = decode_step_bytes(config, batch, src.shape[1], steps) / (bandwidth * 1e9)
        ct2 = timings[(CT2, batch)]
        ct2_step = ct2.median / np.shape(np.asarray(ct2.result))[1]
        lines += ["", f"greedy batch {batch}, ms per step (bandwidth bound {1e3 * bound:.3g} ms at {bandwidth:.1f} "
                      "GB/s)",
                  f"  {'engine':<32}{'median':>9}{'min-max':>17}{'first call':>12}{'steps':>7}{'x CT2':>8}"
                  f"{'x bound':>9}"]
        for (name, b), timing in timings.items():
            if b != batch:
                continue
            tokens = int(np.shape(np.asarray(timing.result))[1])
            per_step = timing.median / tokens
            row = {"engine": name, "batch": batch, "steps": tokens, "ms_per_step": 1e3 * per_step,
                   "min_ms": 1e3 * timing.minimum / tokens, "max_ms": 1e3 * timing.maximum / tokens,
                   "first_call_s": timing.first, "x_ctranslate2": per_step / ct2_step, "x_bound": per_step / bound}
            rows.append(row)
            spread = f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
            lines.append(f"  {name:<32}{row['ms_per_step']:>9.2f}{spread:>17}{timing.first:>11.2f}s{tokens:>7}"
                         f"{row['x_ctranslate2']:>8.2f}{row['x_bound']:>9.2f}")
    return rows


if __name__ == "__main__":
    main()
