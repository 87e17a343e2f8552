"""Data parallelism: the math every port's distributed engine must reproduce, computed in one process.

A batch of B sentences is split into N shards of B / N consecutive rows, one per replica (rank r holds rows
r B/N .. (r + 1) B/N - 1). Section 5.4's loss is a mean over the batch's n non-pad labels, not over sentences, and
shards hold different numbers of real labels n_r; so each replica's loss is its shard's sum divided by the whole
batch's n (``label_smoothed_cross_entropy(..., tokens=n)``), and the N gradients are *summed* (the all-reduce):

    sum_r grad(sum_{shard r} l / n) = grad(sum_{batch} l / n) = the single-process gradient.

An engine that averages gradients over replicas (PyTorch DDP) multiplies each replica's loss by N. Then one Adam
update (section 5.3) is applied to identical weights on every replica, so the replicas stay equal.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from . import training as single_process
from .checkpoint import TrainingState
from .config import TrainingConfig, TransformerConfig
from .model import Transformer
from .training import LABEL_SMOOTHING, Optimizer

Batches = Callable[[int], dict[str, np.ndarray]]   # global step (from 0) -> the whole batch of that step


def train(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
          state: TrainingState | None, batches: Batches, first_step: int, steps: int, world_size: int,
          dtype: str = "float32", device: str = "cpu", epsilon: float = LABEL_SMOOTHING,
          progress: Callable[[int, float], object] | None = None
          ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A whole data-parallel run, the reference's way: ``steps`` steps from ``first_step`` (``batches(step)`` is the
    whole batch of each; every step is :func:`train_step` over ``world_size`` shards, one after another in this
    process), from ``params`` with a new optimizer (``training``) or a saved run's ``state``. ``progress`` gets (step,
    whole batch's loss) after each step; a true return ends the run after that step. Returns the weights (checkpoint
    layout), the run's state and the losses. (The reference runs on the CPU: ``device`` is accepted for the ports'
    signature.)"""
    if device != "cpu":
        raise ValueError(f"device: the reference runs on the CPU only, got {device!r}")
    check_steps(first_step, steps)
    model = Transformer(config, params, dtype=np.dtype(dtype))
    optimizer = single_process.optimizer(model, training, state)
    losses = []
    for step in range(first_step, first_step + steps):
        losses.append(train_step(model, optimizer, **batches(step), world_size=world_size, epsilon=epsilon))
        if progress is not None and progress(step, losses[-1]):
            break
    return {name: np.array(value) for name, value in model.params.items()}, single_process.training_state(
        model, optimizer), losses


def check_steps(first_step: int, steps: int) -> None:
    """A run's ``first_step`` and ``steps``: ints >= 0, one ``ValueError`` naming the argument otherwise (every
    backend's ``train`` checks them so, before any work)."""
    for name, value in (("first_step", first_step), ("steps", steps)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def train_step(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike, labels: npt.ArrayLike,
               world_size: int,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One data-parallel training step of section 5: :func:`gradients` (the shards' sum), one Adam update.
    Returns the whole batch's loss before the update."""
    single_process.check_next_step(optimizer.adam.step)
    value, grads = gradients(model, src, tgt, labels, world_size, epsilon)
    optimizer.adam.update(grads)
    return value


def shard_rows(batch_size: int, world_size: int, rank: int) -> slice:
    """The rows of replica ``rank`` among ``world_size``: B / N consecutive rows. A batch that does not split
    into equal shards is a ``ValueError`` naming both numbers."""
    for name, value, minimum in (("world_size", world_size, 1), ("batch_size", batch_size, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if batch_size % world_size:
        raise ValueError(f"a batch of {batch_size} sentences does not split into {world_size} equal shards; "
                         f"choose a batch size divisible by {world_size}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    size = batch_size // world_size
    return slice(rank * size, (rank + 1) * size)


def shard(batch: dict[str, np.ndarray], world_size: int, rank: int) -> dict[str, np.ndarray]:
    """Replica ``rank``'s rows of every array of ``batch`` (src, tgt, labels: (B, ...) -> (B / N, ...))."""
    rows = shard_rows(len(batch["labels"]), world_size, rank)
    return {name: np.asarray(values)[rows] for name, values in batch.items()}


def token_count(labels: npt.ArrayLike, pad_id: int) -> int:
    """n: the whole batch's non-pad labels, the denominator of every replica's loss."""
    return int((np.asarray(labels) != pad_id).sum())


def gradients(model: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike, labels: npt.ArrayLike, world_size: int,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The whole batch's loss and gradient, as N replicas compute them: per shard, the gradient of its
    mean loss (the hand-written backward pass) weighted by n_r / n, then summed over shards (a shard without
    real labels contributes nothing). The whole batch is checked first (``training.check_batch``)."""
    batch = dict(zip(("src", "tgt", "labels"), single_process.check_batch(model, src, tgt, labels)))
    total = token_count(labels, model.config.pad_id)
    single_process.check_token_count(total, None)
    value, summed = 0.0, {name: np.zeros_like(weight) for name, weight in model.params.items()}
    for rank in range(world_size):
        part = shard(batch, world_size, rank)
        weight = token_count(part["labels"], model.config.pad_id) / total         # n_r / n
        if weight:
            shard_loss, grads = single_process.gradients(model, **part, epsilon=epsilon)
            value += weight * shard_loss
            for name, grad in grads.items():
                summed[name] += weight * grad
    return value, summed
