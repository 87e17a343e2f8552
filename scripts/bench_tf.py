"""Benchmark of the TensorFlow/Keras port (float32, the ``base`` preset of Table 3).

* this machine's float32 matmul rate (tf.matmul, n x n by n x n, in a tf.function);
* the compiled forward pass (``compiled_forward``) on batch 8 x 128 source x 128 target
  tokens: tracing time separately, then the median time after warm-up, the achieved GFLOP/s
  (matmul FLOPs counted analytically, formula printed) and its ratio to the matmul rate;
* greedy decoding of one sentence for 128 and 256 output tokens, with the key/value cache
  (``use_cache=True``, XLA) and without it (the whole prefix recomputed at every step).
  The forward pass is timed with XLA (``jit_compile=True``, the default) and without.

Usage: python scripts/bench_tf.py [--quick]. Other work on the same cores skews the numbers:
run it alone (the project runs it under ``flock /tmp/bench.lock``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import transformer_tf  # noqa: E402  (refuses a Keras configured for another backend)
from reference_numpy.config import TransformerConfig  # noqa: E402
from reference_numpy.decoding import EXTRA_OUTPUT_LENGTH  # noqa: E402
from transformer_cli.timing import cpu_name, forward_flops, gflop_rate, matmul_rate, measure, timed  # noqa: E402
from transformer_tf.model import compiled_forward  # noqa: E402

FORWARD_FLOPS = ("2 x multiply-adds of every matmul, masked attention entries included:\n"
                 "  encoder  N (8 B S D^2 + 4 B S^2 D + 4 B S D F)\n"
                 "  decoder  N (8 B T D^2 + 4 B T^2 D + 4 B T D^2 + 4 B S D^2 + 4 B T S D + 4 B T D F)\n"
                 "  output   2 B T D V")


def tf_product(n: int):
    """One float32 n x n ``tf.matmul`` in a ``tf.function``, blocking until done."""
    a, b = (tf.random.stateless_uniform((n, n), seed=(s, 0)) for s in (1, 2))
    matmul = tf.function(tf.matmul)
    return lambda: matmul(a, b).numpy()


def bench_forward(model, cfg, batch: int, length: int, repeats: int, jit_compile: bool | None) -> dict:
    rng = np.random.default_rng(0)
    src = rng.integers(3, cfg.src_vocab_size, (batch, length))
    tgt = rng.integers(3, cfg.tgt_vocab_size, (batch, length))
    forward = compiled_forward(model, jit_compile=jit_compile)
    trace, _ = timed(lambda: forward(src, tgt).numpy())
    median = measure(lambda: forward(src, tgt).numpy(), repeats).median      # after a warm-up call
    flops = forward_flops(cfg, batch, length, length)
    return {"trace": trace, "median": median, "gflop": flops / 1e9, "rate": gflop_rate(flops, median)}


def bench_greedy(model, cfg, tokens: int, use_cache: bool, repeats: int) -> dict:
    """One sentence whose output budget is ``tokens`` (source length = tokens - 50)."""
    src = np.random.default_rng(1).integers(3, cfg.src_vocab_size, (1, tokens - EXTRA_OUTPUT_LENGTH))
    timing = measure(lambda: transformer_tf.greedy_decode(model, src, use_cache=use_cache), repeats)
    return {"first": timing.first, "median": timing.median, "produced": timing.result.shape[1]}


def machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = tf.config.list_physical_devices("GPU")
    return (f"{cpu_name()}, {cores} usable cores, {len(gpus)} GPU; Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}, NumPy {np.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke test)")
    args = parser.parse_args()
    cfg = TransformerConfig.preset("base")
    batch, length, repeats = (2, 32, 2) if args.quick else (8, 128, 5)
    decode_lengths = (64, 96) if args.quick else (128, 256)
    matmul_n = 1024 if args.quick else 2048

    print(f"machine: {machine()}")
    peak = matmul_rate(tf_product(matmul_n), matmul_n, repeats)
    print(f"float32 matmul {matmul_n}x{matmul_n}: {peak:.1f} GFLOP/s")

    model = transformer_tf.Transformer(cfg, dtype="float32")   # Keras initializers: timing only
    print(f"forward FLOPs = {FORWARD_FLOPS}")
    for jit_compile, label in ((True, "XLA (the default)"), (False, "graph executor, no XLA")):
        fwd = bench_forward(model, cfg, batch, length, repeats, jit_compile)
        print(f"forward base float32, batch {batch} x {length} x {length}, {label}: tracing {fwd['trace']:.2f} s "
              f"(first call), median {fwd['median'] * 1e3:.1f} ms, {fwd['gflop']:.1f} GFLOP -> "
              f"{fwd['rate']:.1f} GFLOP/s = {fwd['rate'] / peak:.0%} of the matmul rate (target >= 70%)")

    results = {}
    for tokens in decode_lengths:
        for use_cache in (True, False):
            run = bench_greedy(model, cfg, tokens, use_cache, 1 if (args.quick or not use_cache) else 3)
            results[tokens, use_cache] = run
            print(f"greedy {tokens} tokens, cache={use_cache}: first call {run['first']:.2f} s (tracing"
                  f"{' + XLA' if use_cache else ''}), median {run['median']:.2f} s, "
                  f"{run['produced']} tokens produced, {run['produced'] / run['median']:.1f} tokens/s")
    longest = decode_lengths[-1]
    speedup = results[longest, False]["median"] / results[longest, True]["median"]
    print(f"cache speed-up at {longest} tokens: {speedup:.1f}x (target >= 5x)")


if __name__ == "__main__":
    main()
