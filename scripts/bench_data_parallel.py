"""Data-parallel training throughput of every installed backend, side by side: the numbers task's model
(``transformer_tasks.numbers``: d_model 128, 3 + 3 layers, 1.4M parameters) in float32 on its batches of 128
sentences, one process (each backend's ``train_step``) against N = 1, 2, ... replicas on the framework's own engine
(``train_data_parallel``: PyTorch DDP over N processes with gloo, a JAX mesh of N host devices, a TensorFlow
MirroredStrategy over N logical CPUs; the reference's shards one after another).

Each configuration runs ``--warm-up`` steps and then ``--steps`` timed steps; the time per step is the median of
the intervals between consecutive steps' progress callbacks, so the engine's start-up (processes, tracing) is left
out. Target tokens per second = the batches' non-pad labels / that time. On a machine with fewer cores than
replicas, the replicas share the cores: the numbers show the engines' overhead, not a speed-up.

    python scripts/bench_data_parallel.py [--backends numpy,torch,jax,tf] [--replicas 1,2] [--steps 20]

The timed part holds an exclusive lock on /tmp/bench.lock, as the other benchmark scripts do.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends  # noqa: E402
from equivalence.runtime import jax_host_devices  # noqa: E402
from reference_numpy import init_params  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from transformer_tasks.batches import CountedBatches  # noqa: E402
from transformer_tasks.numbers import DEFAULTS, NumbersTask  # noqa: E402

LOCK = "/tmp/bench.lock"


def step_seconds(stamps: list[float], warm_up: int) -> float:
    """The median interval between consecutive steps after the first ``warm_up`` steps."""
    return statistics.median(np.diff(stamps[warm_up:]))


def one_process(adapter, config, params, batches: CountedBatches, steps: int) -> list[float]:
    """Timestamps after each of ``steps`` single-process steps (``train_step``)."""
    model = adapter.build(config, params, "float32", "cpu")
    optimizer = adapter.optimizer(model, TrainingConfig(warmup_steps=DEFAULTS["warmup_steps"]))
    stamps = [time.perf_counter()]
    for step in range(steps):
        adapter.train_step(model, optimizer, **batches(step))
        stamps.append(time.perf_counter())
    return stamps


def replicated(adapter, config, params, batches: CountedBatches, steps: int, replicas: int) -> list[float]:
    """Timestamps after each of ``steps`` data-parallel steps over ``replicas`` replicas."""
    stamps = [time.perf_counter()]
    adapter.train_data_parallel(config, params, TrainingConfig(warmup_steps=DEFAULTS["warmup_steps"]), None,
                                batches, 0, steps, replicas, "float32", "cpu",
                                progress=lambda step, loss: stamps.append(time.perf_counter()))
    return stamps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(backends.BACKENDS))
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=3)
    args = parser.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    jax_host_devices(max(counts))                         # before JAX is imported
    adapters, missing = backends.load(tuple(args.backends.split(",")))
    if "tf" in adapters:
        from transformer_tf.data_parallel import logical_cpus
        logical_cpus(max(counts))                         # before TensorFlow initialises
    task = NumbersTask()
    config = task.config()
    task = task.with_tokenizer(config)
    params = init_params(config, seed=0, dtype=np.float32)
    total = args.warm_up + args.steps
    print(f"numbers-task model, float32, batches of {DEFAULTS['batch_size']} sentences; {os.cpu_count()} CPU cores; "
          f"median of {args.steps} steps after {args.warm_up}")
    print(f"{'backend':<8} {'replicas':>8} {'ms/step':>9} {'tokens/s':>9} {'vs one process':>15}")
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, adapter in adapters.items():
            batches = CountedBatches(task, config, DEFAULTS["batch_size"], 0)
            seconds = step_seconds(one_process(adapter, config, params, batches, total), args.warm_up)
            tokens = np.mean(list(batches.tokens.values()))
            print(f"{name:<8} {'-':>8} {1e3 * seconds:>9.1f} {tokens / seconds:>9,.0f} {'1.00':>15}", flush=True)
            for count in counts:
                replica_seconds = step_seconds(replicated(adapter, config, params, batches, total, count),
                                               args.warm_up)
                print(f"{name:<8} {count:>8} {1e3 * replica_seconds:>9.1f} {tokens / replica_seconds:>9,.0f} "
                      f"{seconds / replica_seconds:>15.2f}", flush=True)
    for item in missing:
        print(f"{item.name}: {item.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
