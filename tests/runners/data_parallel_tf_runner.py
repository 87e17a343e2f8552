"""The TensorFlow data-parallel runs of ``tests/ports/test_data_parallel_tf.py``, in processes of their own: a
``MirroredStrategy`` on CPU needs N logical CPU devices, made before TensorFlow initialises (in the pytest process it
has initialised already). ``python tests/runners/data_parallel_tf_runner.py PART OUT_DIR`` runs one part, writes shared
checkpoints to OUT_DIR and prints one JSON object on stdout; the two parts are independent, so the test runs them at
once, one per core:

* ``library``: the port's single-process run (5 steps, saved), then the library calls of a data-parallel run over
  ``WORLD_SIZE`` replicas (10 steps, saved after 5 and 10, and one more whose first shard holds no real label), then
  the errors bad input gets;
* ``train``: ``data_parallel.train`` over ``RESUMED_WORLD_SIZE`` replicas resuming the reference's single-process
  checkpoint ``reference5.safetensors`` (the test writes it), and the rows each replica holds (N = 2 and 4).

The module imports no framework at the top, so that the test can import :func:`batch` and the constants."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from equivalence.cases import seeded_params
from reference_numpy.config import TrainingConfig, TransformerConfig

CONFIG = TransformerConfig.preset("tiny", dropout=0.0)
TRAINING = TrainingConfig()      # section 5.3's schedule: small first steps (tests/equivalence/test_training.py)
STEPS = 10
HALFWAY = STEPS // 2
LENGTHS = (1, 2, 5, 6)           # real labels per row: shards of 3 and 11 (N = 2), of 1, 2, 5 and 6 (N = 4)
WORLD_SIZE = 2                   # the replicas of the library calls' run
RESUMED_WORLD_SIZE = 4           # the replicas of train(), resumed from a single-process checkpoint


def batch(step: int) -> dict[str, np.ndarray]:
    """The whole batch of global step ``step``: 4 rows holding ``LENGTHS`` real labels, new tokens every step; at
    step ``STEPS``, one past the runs, the first two rows hold none (a shard without real labels, when N = 2)."""
    rng = np.random.default_rng(step)
    rows, width = len(LENGTHS), max(LENGTHS)
    tokens = rng.integers(3, CONFIG.tgt_vocab_size, size=(rows, width))
    real = np.arange(width) < np.array(LENGTHS)[:, None]                                  # (B, T)
    labels = np.where(real, tokens, CONFIG.pad_id)
    tgt = np.where(real, np.concatenate([np.full((rows, 1), CONFIG.bos_id), tokens[:, :-1]], axis=1), CONFIG.pad_id)
    src = rng.integers(3, CONFIG.src_vocab_size, size=(rows, 5))
    if step == STEPS:
        labels[:2] = CONFIG.pad_id
    return {"src": src, "tgt": tgt, "labels": labels}


def library(out: Path) -> dict:
    from transformer_tf import data_parallel

    data_parallel.logical_cpus(WORLD_SIZE)                                  # before TensorFlow initialises
    import transformer_tf

    report = {}
    model = transformer_tf.from_params(CONFIG, seeded_params(CONFIG), "float64")
    adam = transformer_tf.optimizer(model, TRAINING)
    report["single"] = [transformer_tf.train_step(model, adam, **batch(step)) for step in range(HALFWAY)]
    transformer_tf.save_checkpoint(model, out / "single5.safetensors",
                                   training=transformer_tf.training_state(model, adam))
    mirrored = data_parallel.strategy(WORLD_SIZE)
    with mirrored.scope():
        model = transformer_tf.from_params(CONFIG, seeded_params(CONFIG), "float64")
        adam = transformer_tf.optimizer(model, TRAINING)
    report["parallel"] = []
    for step in range(STEPS):
        report["parallel"].append(data_parallel.train_step(model, adam, **batch(step), strategy=mirrored))
        if step + 1 in (HALFWAY, STEPS):
            transformer_tf.save_checkpoint(model, out / f"parallel{step + 1}.safetensors",
                                           training=transformer_tf.training_state(model, adam))
    report["empty_shard"] = data_parallel.train_step(model, adam, **batch(STEPS), strategy=mirrored)
    try:                                                   # NaN weights are refused: the test names the message
        transformer_tf.save_checkpoint(model, out / f"parallel{STEPS + 1}.safetensors",
                                       training=transformer_tf.training_state(model, adam))
    except ValueError as error:
        report["empty_shard"] = str(error)
    report["errors"] = errors(mirrored, model, adam)
    return report


def errors(mirrored, model, adam) -> dict[str, str]:
    """The one-line message of each bad input (the test compares them with the single-process ones)."""
    import transformer_tf
    from transformer_tf import data_parallel

    good = batch(0)
    step = lambda **changes: data_parallel.train_step(**{"model": model, "optimizer": adam, **good,
                                                         "strategy": mirrored, **changes})
    cases = {
        "split": lambda: step(**{name: rows[:3] for name, rows in good.items()}),
        "all_pad": lambda: step(labels=np.full_like(good["labels"], CONFIG.pad_id)),
        "epsilon": lambda: step(epsilon=1.0),
        "src_id": lambda: step(src=np.full_like(good["src"], CONFIG.src_vocab_size)),
        "outside_scope": lambda: step(model=transformer_tf.from_params(CONFIG, seeded_params(CONFIG), "float64")),
        "world_size": lambda: data_parallel.strategy(0),
        "device": lambda: data_parallel.strategy(WORLD_SIZE, "tpu"),
        "too_many_cpus": lambda: data_parallel.strategy(WORLD_SIZE + 1),
        "fewer_cpus": lambda: data_parallel.logical_cpus(1),
        "steps": lambda: data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, batch, 0, -1, WORLD_SIZE),
        "first_step": lambda: data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, batch, True, 1,
                                                  WORLD_SIZE),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def train(out: Path) -> dict:
    from transformer_tf import data_parallel

    data_parallel.logical_cpus(RESUMED_WORLD_SIZE)
    from reference_numpy.checkpoint import load_run, save_checkpoint

    config, params, state = load_run(out / "reference5.safetensors")
    progress = []
    params, state, losses = data_parallel.train(config, params, None, state, batch, state.step, STEPS - HALFWAY,
                                                RESUMED_WORLD_SIZE, "float64",
                                                progress=lambda step, loss: progress.append([step, loss]))
    save_checkpoint(out / "reference5_parallel5.safetensors", config, params, state)
    return {"resumed": losses, "progress": progress,
            "replicas": {world_size: replicas(world_size) for world_size in (WORLD_SIZE, RESUMED_WORLD_SIZE)}}


def replicas(world_size: int) -> dict[str, list]:
    """(device, rows) of every replica of a strategy over ``world_size`` replicas, for each array of ``batch(0)``."""
    from transformer_tf import data_parallel

    mirrored = data_parallel.strategy(world_size)
    shards = data_parallel.distribute(batch(0), mirrored)
    return {name: [[rows.device, rows.numpy().tolist()] for rows in mirrored.experimental_local_results(part)]
            for name, part in shards.items()}


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    print(json.dumps({"library": library, "train": train}[part](out)))
