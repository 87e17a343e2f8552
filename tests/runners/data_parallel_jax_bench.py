"""Training tokens/s of the JAX port's data-parallel ``train`` with N = 1 and N = 2 CPU devices, on the model of
``transformer-reference train --task numbers`` (float32, batches of 128 pairs): the median over 20 steps after 3
warm-up steps (the first compiles). Not a test (speed is never measured in tests); run it by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/runners/data_parallel_jax_bench.py

It prints one JSON object. The 23 batches are padded to the longest of them, so that XLA compiles the step once
per N (a new shape would compile it again); the tokens counted are the real (non-pad) labels.
"""

from __future__ import annotations

import json
import time

import numpy as np

from reference_numpy.checkpoint import init_params
from reference_numpy.config import TrainingConfig
from transformer_tasks.numbers import DEFAULTS, NumbersTask

WARM_UP, MEASURED, BATCH, SEED = 3, 20, DEFAULTS["batch_size"], 0


def padded_batches(task: NumbersTask, config, count: int) -> list[dict[str, np.ndarray]]:
    """The task's first ``count`` training batches, each array padded on the right to the widest of them."""
    batches = [task.batch(config, BATCH, step, SEED) for step in range(count)]
    widths = {name: max(b[name].shape[1] for b in batches) for name in batches[0]}
    return [{name: np.pad(value, ((0, 0), (0, widths[name] - value.shape[1])), constant_values=config.pad_id)
             for name, value in b.items()} for b in batches]


def tokens_per_second(world_size: int, config, batches: list[dict[str, np.ndarray]]) -> dict:
    """Median tokens/s of the measured steps of one ``train`` call over ``world_size`` devices."""
    from transformer_jax import data_parallel
    stamps = []
    training = TrainingConfig(warmup_steps=DEFAULTS["warmup_steps"],
                              learning_rate_scale=DEFAULTS["learning_rate_scale"])
    began = time.perf_counter()
    data_parallel.train(config, init_params(config, seed=SEED), training, None, batches.__getitem__, 0,
                        WARM_UP + MEASURED, world_size, "float32",
                        progress=lambda step, loss: stamps.append(time.perf_counter()))
    seconds = np.diff(stamps)[WARM_UP - 1:]                              # steps WARM_UP .. WARM_UP + MEASURED - 1
    tokens = np.array([(b["labels"] != config.pad_id).sum() for b in batches[WARM_UP:]])
    return {"world_size": world_size, "median_tokens_per_second": float(np.median(tokens / seconds)),
            "median_step_seconds": float(np.median(seconds)), "first_step_seconds": stamps[0] - began}


def main() -> dict:
    import jax
    task = NumbersTask()
    config = task.config()
    task = task.with_tokenizer(config)
    batches = padded_batches(task, config, WARM_UP + MEASURED)
    return {"jax": jax.__version__, "devices": jax.device_count(), "batch": BATCH,
            "shape": {name: list(value.shape) for name, value in batches[0].items()},
            "runs": [tokens_per_second(n, config, batches) for n in (1, 2)]}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
