"""Data parallelism (``reference_numpy/data_parallel.py``): the shards' summed gradients equal the whole
batch's, also when shards hold different numbers of real labels, and bad splits are refused. The ports'
engines (DDP, a JAX mesh, a MirroredStrategy) are checked against this in their own files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from equivalence import backends, tolerance
from equivalence.cases import seeded_params
from equivalence.training_runs import Run, assert_float64_run, reference_run
from reference_numpy import Transformer, TransformerConfig, data_parallel, init_params, training
from reference_numpy.checkpoint import load_run
from reference_numpy.config import TrainingConfig
from transformer_tasks.copy import CopyTask

CONFIG = TransformerConfig.preset("tiny", dropout=0.0)
TRAINING = TrainingConfig(warmup_steps=20)       # large enough steps that Adam's update is far from round-off


def uneven_batch(config: TransformerConfig = CONFIG, batch: int = 4) -> dict[str, np.ndarray]:
    """A batch whose two halves hold 3 and 11 real labels (rows of 1, 2, 5 and 6 tokens)."""
    rng = np.random.default_rng(5)
    lengths = np.array([1, 2, 5, 6])[:batch]
    tokens = rng.integers(3, config.tgt_vocab_size, size=(batch, 6))
    real = np.arange(6) < lengths[:, None]
    labels = np.where(real, tokens, config.pad_id)
    tgt = np.where(real, np.concatenate([np.full((batch, 1), config.bos_id), tokens[:, :-1]], axis=1), config.pad_id)
    src = rng.integers(3, config.src_vocab_size, size=(batch, 5))
    return {"src": src, "tgt": tgt, "labels": labels}


def test_the_shards_summed_gradients_are_the_whole_batchs():
    """n_r / n-weighted shard gradients summed = the gradient of the mean over all n tokens (section 5.4); the
    unweighted mean of shard means (what averaging per-sentence-mean losses gives) is not."""
    batch = uneven_batch()
    model = Transformer(CONFIG, seeded_params(CONFIG))
    whole_loss, whole = training.gradients(model, **batch)
    for world_size in (1, 2, 4):
        loss, grads = data_parallel.gradients(model, **batch, world_size=world_size)
        assert abs(loss - whole_loss) <= tolerance.float64_bound(np.array(whole_loss))
        for name, grad in grads.items():
            assert tolerance.max_abs(grad, whole[name]) <= tolerance.float64_bound(whole[name]), name
    halves = [data_parallel.shard(batch, 2, rank) for rank in range(2)]
    naive = [training.gradients(model, **half)[1] for half in halves]
    name = "decoder.layers.0.ffn.linear1.weight"
    assert tolerance.max_abs((naive[0][name] + naive[1][name]) / 2, whole[name]) > 1e3 * tolerance.float64_bound(
        whole[name])


def test_data_parallel_steps_are_the_single_process_steps():
    """Three steps over 2 shards = three single-process steps: losses, weights and Adam's moments within the
    derived training bound (``equivalence.tolerance.TrainingBound``)."""
    batch = uneven_batch()
    expected, bound = reference_run(CONFIG, seeded_params(CONFIG), TRAINING, [batch] * 3)
    model = Transformer(CONFIG, seeded_params(CONFIG))
    optimizer = training.optimizer(model, TRAINING)
    losses = [data_parallel.train_step(model, optimizer, **batch, world_size=2) for _ in range(3)]
    assert_float64_run(Run(losses, model.params, training.training_state(model, optimizer)), expected, bound,
                       "reference, 2 shards")


def test_a_run_ends_after_the_step_where_progress_returns_true():
    """``train``'s ``progress`` returning true after step 1 (0-based): the run ends there, with two steps done --
    the weights, Adam's state and losses of a two-step run."""
    batch = uneven_batch()
    expected, bound = reference_run(CONFIG, seeded_params(CONFIG), TRAINING, [batch] * 2)
    seen = []

    def progress(step: int, loss: float) -> bool:
        seen.append(step)
        return step == 1

    params, state, losses = data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, lambda step: batch, 0,
                                                 5, 2, "float64", progress=progress)
    assert seen == [0, 1] and state.step == 2
    assert_float64_run(Run(losses, params, state), expected, bound, "reference, 2 shards, stopped after 2 of 5 steps")


def test_a_shard_without_real_labels_adds_nothing():
    batch = uneven_batch()
    batch["labels"][:2] = CONFIG.pad_id                                  # the first shard: no real label
    model = Transformer(CONFIG, seeded_params(CONFIG))
    whole_loss, whole = training.gradients(model, **batch)
    loss, grads = data_parallel.gradients(model, **batch, world_size=2)
    assert abs(loss - whole_loss) <= tolerance.float64_bound(np.array(whole_loss))
    assert all(tolerance.max_abs(grads[name], whole[name]) <= tolerance.float64_bound(whole[name]) for name in grads)


def test_the_loss_with_a_token_count_is_the_shards_share():
    """sum over shards of loss(shard, tokens=n) = loss(batch); tokens below the shard's count is refused."""
    batch = uneven_batch()
    model = Transformer(CONFIG, seeded_params(CONFIG))
    n = data_parallel.token_count(batch["labels"], CONFIG.pad_id)
    parts = [float(training.loss(model, **data_parallel.shard(batch, 2, rank), tokens=n)) for rank in range(2)]
    whole = float(training.loss(model, **batch))
    assert abs(sum(parts) - whole) <= tolerance.float64_bound(np.array(whole))
    with pytest.raises(ValueError, match="tokens must be an int >= 1 and >= the labels' 3 non-pad tokens"):
        training.loss(model, **data_parallel.shard(batch, 2, 0), tokens=2)


@pytest.mark.parametrize("batch_size, world_size, rank, message", [
    (5, 2, 0, "a batch of 5 sentences does not split into 2 equal shards"),
    (4, 0, 0, "world_size must be an int >= 1"),
    (4, 2, 2, r"rank must be an int in \[0, 2\)"),
    (0, 1, 0, "batch_size must be an int >= 1"),
])
def test_bad_splits_are_refused(batch_size, world_size, rank, message):
    with pytest.raises(ValueError, match=message):
        data_parallel.shard_rows(batch_size, world_size, rank)
    assert data_parallel.shard_rows(6, 3, 1) == slice(2, 4)


@pytest.mark.parametrize("first_step, steps, message", [(-1, 2, "first_step must be an int >= 0, got -1"),
                                                         (0, 1.5, "steps must be an int >= 0, got 1.5"),
                                                         (0, True, "steps must be an int >= 0, got True")])
def test_a_run_with_bad_steps_is_refused_before_any_work(first_step, steps, message):
    batches = lambda step: pytest.fail("a batch was drawn")
    with pytest.raises(ValueError, match=f"^{message}$"):
        data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, batches, first_step, steps, 2)


# About 30 s: the installed command, a process per engine run, each starting its replicas (PyTorch: two worker
# processes) and compiling its step: what a process shows (the command, its replicas and exit status) is checked.
def test_train_data_parallel_runs_on_each_frameworks_engine(tmp_path):
    """``train --data-parallel 2`` through the installed command, every installed port in one process (the command
    asks XLA for host devices before JAX starts; TensorFlow splits its CPU): each run's losses, weights and moments
    are the single-process reference's within the training bound, and each checkpoint is the shared format."""
    script = shutil.which("transformer-reference", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the package is not installed (pip install -e .), so the transformer-reference script does not "
                    "exist")
    ports = tuple(backends.load()[0])
    if not ports:
        pytest.skip("no port framework is installed: data parallelism runs on a framework's engine")
    result = subprocess.run([script, "train", "--backends", ",".join(ports), "--data-parallel", "2", "--symbols", "4",
                             "--max-length", "4", "--batch-size", "8", "--warmup-steps", "20", "--steps", "3",
                             "--eval-size", "0", "--stop-at", "0", "--dtype", "float64", "--json",
                             "--out", str(tmp_path / "run-{backend}.safetensors")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    task, training_config = CopyTask(4, 4), TrainingConfig(warmup_steps=20, learning_rate_scale=0.5)
    config = task.config(dropout=0.0)
    expected, bound = reference_run(config, init_params(config, seed=0), training_config,
                                    [task.batch(config, 8, step, 0) for step in range(3)])
    for run in json.loads(result.stdout):
        _, params, state = load_run(tmp_path / f"run-{run['backend']}.safetensors")
        assert_float64_run(Run(run["losses"], params, state), expected, bound, f"{run['backend']}, 2 replicas")
