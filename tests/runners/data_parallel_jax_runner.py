"""The JAX port's data-parallel runs for ``tests/ports/test_data_parallel_jax.py``, in a process of its own: JAX creates
its CPU devices once, at start-up, so the test starts this file with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (``python tests/runners/data_parallel_jax_runner.py OUT_DIR``).

Every run is float64 with dropout 0 on the ``tiny`` model from the seeded weights, on :func:`batch`. Each run's end is
saved to ``OUT_DIR/<run>.safetensors`` (weights and training state, the shared format); the losses, the rows each
device holds and the errors of bad requests are printed as one JSON object. The three compiled steps (one device,
meshes of 2 and 4) are compiled concurrently, one thread each; everything after reuses them. Importing this module
imports NumPy and the reference only (the test builds its oracle from :func:`batch`).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from reference_numpy.config import TrainingConfig, TransformerConfig

CONFIG = TransformerConfig.preset("tiny", dropout=0.0)
# The paper's Adam and schedule (section 5.3): small first learning rates keep the drift between backends second
# order, as ``equivalence.tolerance.TrainingBound`` assumes (tests/equivalence/test_training.py uses the same).
TRAINING = TrainingConfig()
STEPS, HALF, BATCH = 10, 5, 4
DEVICES = 4


def batch(step: int) -> dict[str, np.ndarray]:
    """The whole batch of global step ``step``: 4 sentences whose labels hold 1, 2, 5 and 6 tokens (6, 5, 2, 1 on
    odd steps), so the halves hold 3 and 11 real labels (11 and 3) and the quarters 1, 2, 5, 6; at the last step the
    first half holds none (0, 0, 4, 6). Sources of 5, 3, 4 and 2 tokens. Deterministic and picklable."""
    rng = np.random.default_rng(step)
    lengths = np.array([1, 2, 5, 6] if step % 2 == 0 else [6, 5, 2, 1])
    if step == STEPS - 1:
        lengths = np.array([0, 0, 4, 6])
    width = 6
    tokens = rng.integers(3, CONFIG.tgt_vocab_size, size=(BATCH, width))
    labels = np.where(np.arange(width) < lengths[:, None], tokens, CONFIG.pad_id)
    shifted = np.concatenate([np.full((BATCH, 1), CONFIG.bos_id), tokens[:, :-1]], axis=1)
    tgt = np.where(np.arange(width) < np.maximum(lengths, 1)[:, None], shifted, CONFIG.pad_id)
    src = np.where(np.arange(5) < np.array([5, 3, 4, 2])[:, None],
                   rng.integers(3, CONFIG.src_vocab_size, size=(BATCH, 5)), CONFIG.pad_id)
    return {"src": src, "tgt": tgt, "labels": labels}


def main(out: Path) -> dict:
    """Every run, saved under ``out``; returns what the test reads besides the files."""
    import jax

    from equivalence.cases import seeded_params
    from reference_numpy.checkpoint import load_run, save_checkpoint
    from transformer_jax import checkpoint, data_parallel, training

    params = seeded_params(CONFIG)
    losses: dict[str, list[float]] = {}
    calls: list[tuple[int, float]] = []

    def save(name, weights, state, run_losses):
        save_checkpoint(out / f"{name}.safetensors", CONFIG, weights, state)
        losses[name] = run_losses

    def single(name, weights, state, first, steps, saves=()):
        """The port's own single-process run (``training.train_step``), saving after the steps in ``saves``."""
        with jax.enable_x64(True):
            model = checkpoint.from_params(CONFIG, weights)
            adam = training.optimizer(model, None if state else TRAINING, state)
            run_losses = []
            for step in range(first, first + steps):
                run_losses.append(training.train_step(model, adam, **batch(step)))
                if step + 1 in saves:
                    save(f"{name}-{step + 1}", checkpoint.to_params(model), training.training_state(model, adam),
                         list(run_losses))

    def parallel(name, world_size, weights, state, first, steps, progress=None):
        weights, state, run_losses = data_parallel.train(CONFIG, weights, None if state else TRAINING, state, batch,
                                                         first, steps, world_size, "float64", progress=progress)
        save(name, weights, state, run_losses)

    with ThreadPoolExecutor(3) as pool:                        # the three compilations at once
        jobs = [pool.submit(single, "single", params, None, 0, STEPS, saves=(1, HALF, STEPS)),
                pool.submit(parallel, "dp2-10", 2, params, None, 0, STEPS, lambda *call: calls.append(call)),
                pool.submit(parallel, "dp4-10", 4, params, None, 0, STEPS)]
        for job in jobs:
            job.result()
    parallel("dp2-1", 2, params, None, 0, 1)
    parallel("dp2-5", 2, params, None, 0, HALF)
    _, weights, state = load_run(out / f"single-{HALF}.safetensors")
    parallel("single-then-dp2", 2, weights, state, HALF, STEPS - HALF)
    _, weights, state = load_run(out / f"dp2-{HALF}.safetensors")
    single("dp2-then-single", weights, state, HALF, STEPS - HALF, saves=(STEPS,))
    return {"devices": jax.device_count(), "losses": losses, "progress": calls,
            "rows": {n: rows(data_parallel, n) for n in (2, 4)}, "errors": errors(data_parallel, params),
            "replicated": replicated(params)}


def rows(data_parallel, world_size: int) -> list[list]:
    """The labels each device of a mesh of ``world_size`` holds after ``shard``, in mesh order."""
    with_labels = data_parallel.shard(batch(0), data_parallel.mesh(world_size))["labels"]
    held = {piece.device: np.asarray(piece.data).tolist() for piece in with_labels.addressable_shards}
    return [held[device] for device in data_parallel.mesh(world_size).devices]


def replicated(params) -> list[bool]:
    """Whether every array of a model's and its optimizer's state lies replicated on a mesh of 2 devices, before and
    after the first step of ``train_step`` (model built on one device)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from transformer_jax import checkpoint, data_parallel, training
    with jax.enable_x64(True):
        model = checkpoint.from_params(CONFIG, params, device="cpu")
        adam, grid = training.optimizer(model, TRAINING), data_parallel.mesh(2)
        everywhere = lambda: all(leaf.sharding == NamedSharding(grid, P())
                                 for leaf in jax.tree.leaves(nnx.state((model, adam))))
        before = everywhere()
        data_parallel.train_step(model, adam, **batch(0), mesh=grid)
        return [before, everywhere()]


def errors(data_parallel, params) -> dict[str, str]:
    """The message of each bad request (or "no error")."""
    all_pad = {**batch(0), "labels": np.full((BATCH, 6), CONFIG.pad_id)}
    requests = {
        "too many devices": lambda: data_parallel.mesh(DEVICES + 4),
        "world_size 0": lambda: data_parallel.mesh(0),
        "device": lambda: data_parallel.mesh(2, "tpu"),
        "uneven split": lambda: data_parallel.train(CONFIG, params, TRAINING, None, batch, 0, 1, 3, "float64"),
        "all pad": lambda: data_parallel.train(CONFIG, params, TRAINING, None, lambda step: all_pad, 0, 1, 2,
                                               "float64"),
        "steps": lambda: data_parallel.train(CONFIG, params, TRAINING, None, batch, 0, -1, 2, "float64"),
    }
    messages = {}
    for name, request in requests.items():
        try:
            request()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    return messages


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
