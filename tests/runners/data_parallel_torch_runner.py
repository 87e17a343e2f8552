"""Helpers of ``tests/ports/test_data_parallel_torch.py`` that the spawned ranks must import (a batch function that
fails on one rank), and the training-throughput measurement of ``transformer_torch.data_parallel.train``:

    .venv/bin/python tests/runners/data_parallel_torch_runner.py [--steps 20] [--warmup 3] [--world-sizes 1,2]

prints one JSON line per world size: the numbers task's model (``NumbersTask().config()``), float32, a batch of 128,
the median over ``--steps`` timed steps (after ``--warmup`` untimed ones) of the batch's target tokens per second.
The timed runs hold an exclusive lock on /tmp/bench.lock, as the benchmark scripts under scripts/ do.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import time
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

LOCK = "/tmp/bench.lock"


@dataclass(frozen=True)
class FailingOnRank:
    """``batches[step]``, except on rank ``rank`` at step ``step``, where it raises: a child's error."""

    batches: list
    rank: int
    step: int

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        if dist.is_initialized() and dist.get_rank() == self.rank and step == self.step:
            raise ArithmeticError(f"planted failure on rank {self.rank} at step {step}")
        return self.batches[step]


@dataclass(frozen=True)
class NumbersBatches:
    """The numbers task's batch of each step (picklable: the ranks draw the same batches)."""

    task: object
    config: object
    batch_size: int
    seed: int = 0

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        return self.task.batch(self.config, self.batch_size, step, self.seed)


def throughput(world_size: int, steps: int, warmup: int, batch_size: int = 128) -> dict:
    """Tokens per second of ``data_parallel.train`` over ``world_size`` processes: the median of the timed steps'
    target tokens / seconds between consecutive ``progress`` calls (rank 0 ends a step after the all-reduce)."""
    from reference_numpy.checkpoint import init_params
    from reference_numpy.config import TrainingConfig
    from transformer_tasks.numbers import NumbersTask
    from transformer_torch import data_parallel

    task = NumbersTask()
    config = task.config()
    task = task.with_tokenizer(config)
    batches = NumbersBatches(task, config, batch_size)
    tokens = [int((batches(step)["labels"] != config.pad_id).sum()) for step in range(warmup + steps)]
    ends: list[float] = []
    began = time.perf_counter()
    data_parallel.train(config, init_params(config, seed=0), TrainingConfig(), None, batches, 0,
                        warmup + steps, world_size, "float32", progress=lambda step, loss: ends.append(
                            time.perf_counter()))
    seconds = np.diff(ends)[warmup - 1:]                                    # the steps warmup .. warmup + steps - 1
    rates = np.array(tokens[warmup:]) / seconds
    return {"world_size": world_size, "batch_size": batch_size, "timed_steps": steps,
            "median_tokens_per_second": float(np.median(rates)), "median_step_seconds": float(np.median(seconds)),
            "wall_seconds_with_start_up": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-sizes", default="1,2")
    args = parser.parse_args()
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for world_size in map(int, args.world_sizes.split(",")):
            print(json.dumps(throughput(world_size, args.steps, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
