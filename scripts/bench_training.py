"""Training throughput of every installed backend, side by side (section 5): one optimizer step of the ``base``
model (Table 3) in float32 on a batch of about 4,000 target tokens, dropout as the paper (P_drop = 0.1; the NumPy
reference has no dropout), label smoothing 0.1, Adam with the schedule of Eq. (3).

Each backend runs through its adapter (``equivalence/backends``): ``train_step`` = forward, loss, gradient (the
reference's hand-written backward pass, the ports' autodiff) and the framework's own Adam. The first step
(tracing/compilation) is reported apart; the time is the median of ``--repeats`` further steps. FLOPs: a training
step is counted as 3 x the forward pass's matrix products (the backward pass computes two products for each
forward one: the input's and the weight's gradients), from ``transformer_bench.timing.forward_flops``;
"of matmul" is
the achieved rate over this machine's float32 matrix-multiply rate, measured in the same run (NumPy, 2048^2).

    python scripts/bench_training.py [--backends numpy,torch,jax,tf] [--repeats 3] [--write FILE.md]

The timed part holds an exclusive lock on /tmp/bench.lock, as the other benchmark scripts do.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends  # noqa: E402
from reference_numpy import TransformerConfig, init_params  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from transformer_bench.timing import cpu_name, forward_flops, gflop_rate, matmul_rate, numpy_product  # noqa: E402

LOCK = "/tmp/bench.lock"
BATCH, SRC_LEN, TGT_LEN = 32, 128, 128          # 4,096 target tokens (and as many source tokens) per step
STEP_FLOPS = "training step FLOPs = 3 x forward FLOPs (forward products, then two backward products for each)"


def batch(config: TransformerConfig) -> dict[str, np.ndarray]:
    """Random token ids without padding: every position is a real token."""
    rng = np.random.default_rng(0)
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(first, config.src_vocab_size, (BATCH, SRC_LEN))
    labels = rng.integers(first, config.tgt_vocab_size, (BATCH, TGT_LEN))
    tgt = np.concatenate([np.full((BATCH, 1), config.bos_id), labels[:, :-1]], axis=1)
    return {"src": src, "tgt": tgt, "labels": labels}


def time_steps(adapter, config: TransformerConfig, repeats: int) -> tuple[float, float]:
    """(first step's seconds, median seconds of ``repeats`` more steps) of one backend."""
    model = adapter.build(config, init_params(config, seed=0, dtype=np.float32), "float32", "cpu")
    optimizer = adapter.optimizer(model, TrainingConfig())
    inputs = batch(config)
    seconds = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        adapter.train_step(model, optimizer, **inputs)
        seconds.append(time.perf_counter() - began)
    return seconds[0], statistics.median(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(backends.BACKENDS), help="comma-separated backends")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the first")
    parser.add_argument("--write", type=Path, help="also write the report (Markdown) to this file")
    args = parser.parse_args()
    adapters, missing = backends.load(tuple(args.backends.split(",")))
    config = TransformerConfig.preset("base")
    flops = 3 * forward_flops(config, BATCH, SRC_LEN, TGT_LEN)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rate = matmul_rate(numpy_product(2048), 2048, 5)
        rows = [(name, *time_steps(adapter, config, args.repeats)) for name, adapter in adapters.items()]
    lines = [f"preset base, float32, batch {BATCH} x {SRC_LEN} source x {TGT_LEN} target tokens "
             f"({BATCH * TGT_LEN:,} target tokens per step), dropout 0.1 (not in numpy), Adam + Eq. (3)",
             f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}; "
             f"float32 matmul rate (NumPy, 2048^2): {rate:.1f} GFLOP/s",
             f"{STEP_FLOPS}: {flops / 1e12:.2f} TFLOP per step", "",
             f"{'backend':<8} {'step':>9} {'first step':>10} {'tokens/s':>9} {'GFLOP/s':>8} {'of matmul':>9}"]
    for name, first, median in rows:
        achieved = gflop_rate(flops, median)
        lines.append(f"{name:<8} {median * 1e3:>7.0f}ms {first:>9.1f}s {BATCH * TGT_LEN / median:>9,.0f} "
                     f"{achieved:>8.1f} {100 * achieved / rate:>8.0f}%")
    lines += [f"{m.name}: {m.reason}" for m in missing]
    report = "\n".join(lines)
    print(report)
    if args.write:
        args.write.write_text(f"```\n{report}\n```\n")


if __name__ == "__main__":
    main()
