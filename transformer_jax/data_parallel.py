"""Data-parallel training (section 5) with JAX's own engine: one process, a ``jax.sharding.Mesh`` with one axis
``"data"`` over N devices, the batch sharded by rows (``NamedSharding(mesh, P("data"))``), the model and Adam's
state replicated (``P()``), and the single-process compiled step (:func:`.training.train_step`'s ``nnx.jit`` of
loss -> ``nnx.value_and_grad`` -> optax update) run on those arrays. XLA partitions the step and inserts the
all-reduce itself; nothing here exchanges gradients.

Device r of the mesh holds rows r B/N .. (r + 1) B/N - 1 (``reference_numpy.data_parallel.shard_rows``). The loss
is section 5.4's mean over the WHOLE batch's n non-pad labels: its sum and its count are reduced across devices by
XLA, so the shards' different numbers of real labels are weighted exactly as the reference weights them (each
replica's share is its shard's sum / n, and the shares add up). With dropout on, the masks are drawn for the whole
batch from the model's streams, as in the single-process step, and are the same masks: JAX's partitionable threefry
random bits (``jax_threefry_partitionable``, on by default) do not depend on how an array is sharded.

On CPU the N devices are N host-platform devices, which JAX creates only at start-up: start the process with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import check_steps, shard_rows
from reference_numpy.precision import check_trainable, parse_dtype
from reference_numpy.training import LABEL_SMOOTHING

from . import checkpoint
from .device import _gpus
from .model import Transformer
from .training import Optimizer, _check_batch, _train_step, optimizer, training_state

AXIS = "data"   # the mesh axis the batch is split over


def train(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
          state: TrainingState | None, batches: Callable[[int], dict[str, np.ndarray]], first_step: int, steps: int,
          world_size: int, dtype: str = "float32", device: str = "cpu", epsilon: float = LABEL_SMOOTHING,
          progress: Callable[[int, float], object] | None = None
          ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A whole data-parallel run of section 5 over ``world_size`` devices of ``device`` ("cpu" or "gpu").

    ``params``: checkpoint-layout weights; ``training`` a ``TrainingConfig`` for a new run, or None with ``state`` to
    resume one (as :func:`.training.optimizer`); ``batches(step)`` the whole batch of global step ``step`` (``src``,
    ``tgt``, ``labels``), for steps ``first_step .. first_step + steps - 1``; ``progress(step, loss)`` after each step
    (a true return ends the run after that step). Runs under ``jax.enable_x64(True)`` like the port's adapter (a float32
    model stays float32; a float64 one is possible; bfloat16 and float16 are refused by ``check_trainable`` before any
    work). Returns the final weights (checkpoint layout), the run's ``TrainingState`` and the whole batch's loss at each
    step.
    """
    check_steps(first_step, steps)
    check_trainable(parse_dtype(dtype))
    with jax.enable_x64(True):
        grid = mesh(world_size, device)
        model = checkpoint.from_params(config, params, np.dtype(dtype))
        adam = optimizer(model, training, state)
        losses = []
        for step in range(first_step, first_step + steps):
            losses.append(train_step(model, adam, **batches(step), mesh=grid, epsilon=epsilon))
            if progress is not None and progress(step, losses[-1]):
                break
        return checkpoint.to_params(model), training_state(model, adam), losses


def train_step(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike,
               labels: npt.ArrayLike, mesh: Mesh,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One data-parallel training step of section 5 on the whole batch: :func:`.training.train_step` with the
    batch sharded over ``mesh`` by :func:`shard` and the model and optimizer replicated on its devices. The JAX
    idiom of ``reference_numpy.data_parallel.train_step``: a ``mesh`` (from :func:`mesh`) in place of
    ``world_size``. A model and optimizer not yet replicated there (their embedding table and step counter tell:
    the compiled step keeps its outputs where its inputs are) are moved at the first step, all their state at
    once. Returns the whole batch's loss before the update."""
    src, tgt, labels = _check_batch(model, optimizer, src, tgt, labels)
    with jax.enable_x64(True):                                              # the int64 step count, as train_step
        batch = shard({"src": src, "tgt": tgt, "labels": labels}, mesh)
        everywhere = NamedSharding(mesh, P())
        if any(variable[...].sharding != everywhere for variable in (model.src_embed.embedding, optimizer.adam.step)):
            for node in (model, optimizer.adam):
                nnx.update(node, jax.device_put(nnx.state(node), everywhere))
        return float(_train_step(model, optimizer.adam, batch["src"], batch["tgt"], batch["labels"], epsilon))


def shard(batch: Mapping[str, np.ndarray | jax.Array], mesh: Mesh) -> dict[str, jax.Array]:
    """Every array of ``batch`` (src, tgt, labels: (B, ...)) as one global array split by rows over ``mesh``:
    device r holds rows r B/N .. (r + 1) B/N - 1. A batch that does not split into N equal shards is the
    reference's ``ValueError``."""
    shard_rows(len(batch["labels"]), mesh.shape[AXIS], 0)                 # the reference's split check
    rows = NamedSharding(mesh, P(AXIS))
    return {name: jax.device_put(jnp.asarray(value), rows) for name, value in batch.items()}


def mesh(world_size: int, device: str = "cpu") -> Mesh:
    """A one-axis mesh ``"data"`` over the first ``world_size`` devices of ``device`` ("cpu" or "gpu"), in JAX's
    order: replica r is the r-th. Too few devices is one ``ValueError`` saying how to get them."""
    if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu' for data parallelism, got {device!r}")
    found = jax.devices("cpu") if device == "cpu" else _gpus()
    if len(found) < world_size:
        how = (f"start the process with XLA_FLAGS=--xla_force_host_platform_device_count={world_size} (JAX reads "
               f"it only at start-up)" if device == "cpu" else "run on a machine with that many GPUs")
        raise ValueError(f"world_size {world_size} needs {world_size} {device} devices and JAX sees {len(found)}: "
                         f"{how}")
    return Mesh(np.array(found[:world_size]), (AXIS,))
