"""Benchmark of the TensorFlow/Keras port (float32, the ``base`` preset of Table 3; a script, not a test).

* this machine's float32 matmul rate (``transformer_bench.timing.tf_product``: tf.linalg.matmul,
  n x n by n x n);
* ``from_params`` of ``base`` (seeded weights of the reference's ``init_params``), first and second call;
* the compiled forward pass (``compiled_forward``) on batch 8 x 128 source x 128 target tokens,
  with XLA (``jit_compile=True``, the default) and with TensorFlow's graph executor: tracing
  time separately, then the median time after warm-up, the achieved GFLOP/s (matmul FLOPs
  counted analytically, formula printed) and its ratio to the matmul rate;
* the same forward pass cut after each part (the encoder, the decoder, then the output projection and the
  log-softmax: the whole pass), each XLA-compiled alone, timed interleaved with CTranslate2's whole forward pass on the
  same weights (``bench --peers``'s engine, in a process of its own; when ``ctranslate2`` is installed): what
  the gap to CTranslate2 is made of, as ratios;
* greedy decoding of one sentence for 128 and 256 output tokens, with the key/value cache
  (``use_cache=True``, XLA) and without it (the whole prefix recomputed at every step);
* cached greedy decoding of batch 1 and batch 8 (ms per step) and beam search (beam 4, alpha 0.6)
  over 128 steps, interleaved (``transformer_bench.timing.round_robin``), with each first call
  (tracing and XLA compilation);
* the batch-1 cached step's matrix-vector products alone (the weights it reads, in one XLA loop):
  how much of a step is reading the weights, and at what rate.

The sources have (tokens - 50) non-pad tokens, so that the budget of section 6.1 is exactly the
number of tokens; the script checks that decoding ran to it. Times are medians of ``--repeats``
runs after a warm-up call (the first call is reported separately); uncached decoding, which is
slow, runs once. ``--quick`` runs a small version (for checking the script). Other work on the
same cores skews the numbers: run it alone (the project runs it under ``flock /tmp/bench.lock``).

    flock /tmp/bench.lock python scripts/bench_tf.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import transformer_tf  # noqa: E402  (refuses a Keras configured for another backend)
from reference_numpy import init_params  # noqa: E402
from reference_numpy.config import TransformerConfig  # noqa: E402
from reference_numpy.decoding import EXTRA_OUTPUT_LENGTH  # noqa: E402
from transformer_bench.bench import bench_inputs  # noqa: E402
from transformer_bench.peers import CTranslate2Peer, OwnProcess  # noqa: E402
from transformer_bench.timing import (  # noqa: E402
    cpu_name,
    forward_flops,
    gflop_rate,
    matmul_rate,
    measure,
    read_every_step,
    round_robin,
    tf_product,
    timed,
)
from transformer_tf.model import padding_mask  # noqa: E402
from transformer_tf.speed import compiled_forward  # noqa: E402

FORWARD_FLOPS = ("2 x multiply-adds of every matmul, masked attention entries included:\n"
                 "  encoder  N (8 B S D^2 + 4 B S^2 D + 4 B S D F)\n"
                 "  decoder  N (8 B T D^2 + 4 B T^2 D + 4 B T D^2 + 4 B S D^2 + 4 B T S D + 4 B T D F)\n"
                 "  output   2 B T D V")


def bench_forward(model, cfg, batch: int, length: int, repeats: int, jit_compile: bool) -> dict:
    rng = np.random.default_rng(0)
    src = rng.integers(3, cfg.src_vocab_size, (batch, length))
    tgt = rng.integers(3, cfg.tgt_vocab_size, (batch, length))
    forward = compiled_forward(model, jit_compile=jit_compile)
    trace, _ = timed(lambda: forward(src, tgt).numpy())
    median = measure(lambda: forward(src, tgt).numpy(), repeats).median      # after a warm-up call
    flops = forward_flops(cfg, batch, length, length)
    return {"trace": trace, "median": median, "gflop": flops / 1e9, "rate": gflop_rate(flops, median)}


PARTS = ("encoder", "+ decoder", "+ output projection and log-softmax")


def bench_forward_parts(model, cfg, params, batch: int, length: int, repeats: int) -> dict:
    """The XLA-compiled forward pass cut after each of :data:`PARTS` (the last is the whole pass), each compiled
    alone, and CTranslate2's forward pass on the same weights and ids (``bench --peers``'s inputs and call), timed
    interleaved: part -> timing."""
    src, tgt, _ = bench_inputs(cfg, batch, length, length, length)

    def cut(part: str):
        @tf.function(jit_compile=True, autograph=False)
        def run(src, tgt):
            mask = padding_mask(src, cfg.pad_id)
            memory = model.encode(src, mask, training=False)
            if part == "encoder":
                return memory
            out = model.decode(tgt, memory, mask, training=False)
            return out if part == "+ decoder" else model.generator(out)
        return lambda: run(src, tgt).numpy()

    calls = {part: cut(part) for part in PARTS}
    peer = (OwnProcess(CTranslate2Peer, cfg, params, threads=len(os.sched_getaffinity(0)))
            if importlib.util.find_spec("ctranslate2") else None)
    if peer is not None:
        calls["ctranslate2 (whole pass)"] = lambda: peer.forward(src, tgt)
    try:
        return round_robin(calls, repeats)
    finally:
        if peer is not None:
            peer.close()


def sources(cfg, rows: int, tokens: int, seed: int) -> np.ndarray:
    """(rows, tokens - 50) non-pad ids: the output budget of section 6.1 is exactly ``tokens``."""
    return np.random.default_rng(seed).integers(3, cfg.src_vocab_size, (rows, tokens - EXTRA_OUTPUT_LENGTH))


def ran_to_budget(name: str, tokens: np.ndarray, budget: int) -> None:
    if tokens.shape[1] != budget:
        raise RuntimeError(f"{name} stopped after {tokens.shape[1]} of {budget} tokens")


def bench_greedy(model, cfg, tokens: int, use_cache: bool, repeats: int) -> dict:
    """One sentence whose output budget is ``tokens``."""
    src = sources(cfg, 1, tokens, 1)
    timing = measure(lambda: transformer_tf.greedy_decode(model, src, use_cache=use_cache), repeats)
    ran_to_budget(f"greedy {tokens}", timing.result, tokens)
    return {"first": timing.first, "median": timing.median}


def bench_decoding(model, cfg, steps: int, repeats: int) -> dict:
    """Cached greedy decoding of batch 1 and 8 and beam search (beam 4, alpha 0.6), each ``steps`` steps."""
    one, eight = sources(cfg, 1, steps, 3), sources(cfg, 8, steps, 4)
    timings = round_robin({"greedy batch 1": lambda: transformer_tf.greedy_decode(model, one),
                           "greedy batch 8": lambda: transformer_tf.greedy_decode(model, eight),
                           "beam 4, batch 1": lambda: transformer_tf.beam_search(model, one, 4, 0.6)}, repeats)
    for name, timing in timings.items():
        ran_to_budget(name, timing.result[0] if name.startswith("beam") else timing.result, steps)
    return timings


def step_weights(model) -> list:
    """The (in, out) matrices a cached decoding step reads once: every decoder layer's self-attention
    and feed-forward weights, the cross-attention's query and output projections, the generator's."""
    return [v for v in model.weights if len(v.shape) == 2 and read_every_step(v.path)] + [model.generator._weight()]


def bench_step_products(model, steps: int, repeats: int) -> tuple[float, float]:
    """The cached batch-1 step's matrix-vector products alone, ``steps`` times in one XLA loop (each
    step's input depends on the previous step's products, so nothing is hoisted): (ms per step, MB
    read per step)."""
    weights = step_weights(model)

    @tf.function(jit_compile=True, autograph=False)
    def loop(x):
        def body(i, x):
            total = tf.add_n([tf.reduce_sum(tf.matmul(x[:, :w.shape[0]], w)) for w in weights])
            return i + 1, x + 1e-30 * total
        return tf.while_loop(lambda i, x: i < steps, body, (0, x))[1]

    x = tf.ones((1, max(w.shape[0] for w in weights)), model.compute_dtype)
    seconds = measure(lambda: loop(x).numpy(), repeats).median
    return seconds * 1e3 / steps, sum(int(np.prod(w.shape)) for w in weights) * 4 / 1e6


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = tf.config.list_physical_devices("GPU")
    return (f"{cpu_name()}, {cores} usable cores, {len(gpus)} GPU; Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}, NumPy {np.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 5, quick 1)")
    args = parser.parse_args()
    cfg = TransformerConfig.preset("base")
    repeats = args.repeats or (1 if args.quick else 5)
    batch, length, short, long, matmul_n = (2, 32, 64, 96, 1024) if args.quick else (8, 128, 128, 256, 2048)

    print(f"machine: {machine()}")
    peak = matmul_rate(tf_product(matmul_n), matmul_n, repeats)
    print(f"float32 matmul {matmul_n}x{matmul_n}: {peak:.1f} GFLOP/s")

    params = init_params(cfg, dtype=np.float32)
    for turn in ("first", "second"):
        seconds, model = timed(lambda: transformer_tf.from_params(cfg, params, "float32"))
        print(f"from_params base float32, {turn} call: {seconds:.2f} s")

    print(f"forward FLOPs = {FORWARD_FLOPS}")
    for jit_compile, label in ((True, "XLA (the default)"), (False, "graph executor, no XLA")):
        fwd = bench_forward(model, cfg, batch, length, repeats, jit_compile)
        print(f"forward base float32, batch {batch} x {length} x {length}, {label}: tracing {fwd['trace']:.2f} s "
              f"(first call), median {fwd['median'] * 1e3:.1f} ms, {fwd['gflop']:.1f} GFLOP -> "
              f"{fwd['rate']:.1f} GFLOP/s = {fwd['rate'] / peak:.0%} of the matmul rate (target >= 70%)")

    parts = bench_forward_parts(model, cfg, params, batch, length, repeats)
    whole = parts.get("ctranslate2 (whole pass)")
    for part, timing in parts.items():
        ratio = f", {timing.median / whole.median:.2f}x CTranslate2's whole pass" if whole else ""
        print(f"forward cut after: {part}: {timing.median * 1e3:.0f} ms{ratio}")

    results = {}
    for tokens in (short, long):
        for use_cache in (True, False):
            run = bench_greedy(model, cfg, tokens, use_cache, repeats if use_cache else 1)
            results[tokens, use_cache] = run
            print(f"greedy batch 1, {tokens} tokens, cache={use_cache}: first call {run['first']:.2f} s (tracing"
                  f"{' + XLA' if use_cache else ''}), median {run['median']:.2f} s "
                  f"({run['median'] * 1e3 / tokens:.2f} ms/token)")
    speedup = results[long, False]["median"] / results[long, True]["median"]
    print(f"cache speed-up at {long} tokens: {speedup:.1f}x (target >= 5x)")

    for name, timing in bench_decoding(model, cfg, short, repeats).items():
        per = "" if name.startswith("beam") else f" ({timing.median * 1e3 / short:.2f} ms/step)"
        print(f"{name}, {short} steps: first call {timing.first:.2f} s, median {timing.median * 1e3:.0f} ms{per}")
    ms, megabytes = bench_step_products(model, short, repeats)
    print(f"the batch-1 step's matrix-vector products alone ({megabytes:.1f} MB of weights): {ms:.2f} ms/step, "
          f"{megabytes / ms:.1f} GB/s")



if __name__ == "__main__":
    main()
