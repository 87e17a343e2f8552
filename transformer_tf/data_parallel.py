"""Data-parallel training (section 5) with TensorFlow's own engine, ``tf.distribute.MirroredStrategy``: the
parallel text of ``reference_numpy/data_parallel.py``.

The model and its optimizer are created under ``strategy.scope()``, so every weight and Adam moment is a mirrored
variable with one copy per replica. Replica r gets rows r B/N .. (r + 1) B/N - 1 of the batch (the reference's
``shard``) and computes the gradient of its shard's loss summed over labels and divided by the WHOLE batch's n
non-pad labels (``loss(..., tokens=n)``, section 5.4); Keras 3's optimizer under a strategy all-reduces the
replicas' gradients with ``ReduceOp.SUM`` (``TFOptimizer._all_reduce_sum_gradients`` in
``keras/src/backend/tensorflow/optimizer.py``) before one Adam update per replica, so the sum is the whole batch's
gradient and the replicas stay equal. On CPU the N replicas are N logical CPU devices of one process
(:func:`logical_cpus`), which must be made before TensorFlow initialises.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf

from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import check_steps, shard, shard_rows, token_count
from reference_numpy.precision import check_trainable
from reference_numpy.training import LABEL_SMOOTHING, check_batch, check_next_step

from . import checkpoint
from .model import Transformer
from .precision import parse_dtype
from .training import Optimizer, _check_labels, _step, optimizer, training_state

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # optimizer -> (strategy, its compiled step)


def train(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
          state: TrainingState | None, batches: Callable[[int], dict[str, np.ndarray]], first_step: int, steps: int,
          world_size: int, dtype: str = "float32", device: str = "cpu", epsilon: float = LABEL_SMOOTHING,
          progress: Callable[[int, float], object] | None = None
          ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A data-parallel run of section 5 over ``world_size`` replicas: the model of ``config`` from checkpoint-layout
    ``params`` and the optimizer of section 5.3 (a new run's ``training`` config, or ``state`` to resume, as in
    ``training.optimizer``), created under the strategy's scope; then :func:`train_step` on ``batches(step)``, the whole
    batch of each global step ``first_step .. first_step + steps - 1``, calling ``progress(step, loss)`` after each (a
    true return ends the run after that step). Returns the final weights (checkpoint layout, NumPy), the run's
    ``TrainingState`` and the losses. A bfloat16 or float16 ``dtype`` is refused (``check_trainable``) before any
    work."""
    check_trainable(parse_dtype(dtype))
    check_steps(first_step, steps)
    mirrored = strategy(world_size, device)
    with mirrored.scope():
        model = checkpoint.from_params(config, params, dtype)
        adam = optimizer(model, training, state)
    losses = []
    for step in range(first_step, first_step + steps):
        losses.append(train_step(model, adam, **batches(step), strategy=mirrored, epsilon=epsilon))
        if progress is not None and progress(step, losses[-1]):
            break
    return checkpoint.to_params(model), training_state(model, adam), losses


def train_step(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike,
               labels: npt.ArrayLike, strategy: tf.distribute.Strategy,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One data-parallel training step of section 5, dropout as the model's config says: ``strategy.run`` of the
    single-process step on each replica's shard (:func:`distribute`) with the loss over the whole batch's n labels,
    the engine's summed gradients, one Adam update; returns the whole batch's loss before the update (the replicas'
    losses summed). The model and ``optimizer`` (``training.optimizer``) must have been created under
    ``strategy.scope()``. Framework idiom: the reference's ``world_size`` is the ``strategy`` here (its
    ``num_replicas_in_sync`` replicas). Compiled (``tf.function``: traced once per optimizer and once more for the
    first batch of new lengths, see :func:`_compiled`); the inputs are checked before, with the single-process
    step's errors."""
    check_trainable(model.compute_dtype)
    if not strategy.extended.variable_created_in_scope(model.trainable_variables[0].value):
        raise ValueError("model: its variables were not created under strategy.scope(); build the model and its "
                         "optimizer inside `with strategy.scope():`")
    src_ids, tgt_ids, label_ids = check_batch(model, src, tgt, labels)    # ids cannot be checked once traced
    _check_labels(tf.constant(label_ids), model.config.pad_id, epsilon)
    check_next_step(int(optimizer.adam.iterations.numpy()))
    batch = distribute({"src": src_ids.numpy(), "tgt": tgt_ids.numpy(), "labels": label_ids}, strategy)
    tokens = tf.constant(token_count(label_ids, model.config.pad_id), model.compute_dtype)  # a tensor: no retrace per n
    return float(_compiled(strategy, optimizer.adam)(model, batch, tokens, epsilon))


def _compiled(strategy: tf.distribute.Strategy, optimizer: keras.optimizers.Optimizer) -> Callable:
    """The compiled step of ``optimizer`` under ``strategy``, made once. Tracing N replicas is slow, so: without
    AutoGraph (the model has no tensor-dependent Python control flow), and with ``reduce_retracing`` (batches of
    new lengths share one graph of unknown lengths instead of one graph each)."""
    if _COMPILED.get(optimizer, (None,))[0] is not strategy:
        _COMPILED[optimizer] = strategy, tf.function(functools.partial(_replicated_step, strategy, optimizer),
                                                     autograph=False, reduce_retracing=True)
    return _COMPILED[optimizer][1]


def _replicated_step(strategy: tf.distribute.Strategy, optimizer: keras.optimizers.Optimizer, model: Transformer,
                     batch: dict, tokens: tf.Tensor,
                     epsilon: float) -> tf.Tensor:
    """Traced: the single-process step on every replica's shard with the loss over ``tokens`` labels (Keras's
    optimizer sums the gradients across replicas), and the replicas' losses summed: the whole batch's."""
    losses = strategy.run(_step, args=(optimizer, model, batch["src"], batch["tgt"], batch["labels"], epsilon, tokens))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


def distribute(batch: dict[str, np.ndarray], strategy: tf.distribute.Strategy) -> dict:
    """The whole ``batch`` as per-replica values: replica r holds the reference's ``shard(batch, N, r)``, rows
    r B/N .. (r + 1) B/N - 1 of every array, placed on its device. Under a multi-worker strategy every worker passes
    the whole batch and gets its own replicas' shards (r counts the replicas of all workers). A batch that does not
    split into N equal shards is the reference's ``ValueError``."""
    world_size = strategy.num_replicas_in_sync
    shard_rows(len(batch["labels"]), world_size, 0)                         # the split check, before any copy
    devices = strategy.extended.worker_devices                              # this worker's, in replica order

    def replica_shard(context: tf.distribute.experimental.ValueContext) -> dict[str, tf.Tensor]:
        rank = context.replica_id_in_sync_group
        with tf.device(devices[rank % len(devices)]):
            return {name: tf.constant(rows) for name, rows in shard(batch, world_size, rank).items()}

    return strategy.experimental_distribute_values_from_function(replica_shard)


def strategy(world_size: int, device: str = "cpu") -> tf.distribute.MirroredStrategy:
    """A ``MirroredStrategy`` over ``world_size`` replicas. On "cpu": logical CPU devices (:func:`logical_cpus`),
    the gradients summed by ``ReductionToOneDevice`` (``add_n`` on the first device, then a copy to each: a fixed
    order); TensorFlow's default there, ring collectives, numbers its groups from 1 in every strategy, so that two
    strategies of different sizes in one process collide. On "gpu": the first ``world_size`` GPUs, TensorFlow's
    default all-reduce (NCCL)."""
    shard_rows(world_size, world_size, 0)                                   # checks world_size (an int >= 1)
    if device == "cpu":
        logical_cpus(world_size)
        return tf.distribute.MirroredStrategy([f"/CPU:{i}" for i in range(world_size)],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    if device != "gpu":
        raise ValueError(f"device must be 'cpu' or 'gpu' (every replica one device), got {device!r}")
    visible = len(tf.config.list_physical_devices("GPU"))
    if visible < world_size:
        raise ValueError(f"world_size {world_size} needs {world_size} GPUs; TensorFlow sees {visible}")
    return tf.distribute.MirroredStrategy([f"/GPU:{i}" for i in range(world_size)])


def logical_cpus(n: int) -> None:
    """Split the CPU into at least ``n`` logical devices (``tf.config.set_logical_device_configuration``), one per
    replica. TensorFlow allows it only before it initialises (its first op or device listing): a process that has
    already started with fewer gets a ``ValueError``; call this first thing, or start a new process."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or ()) >= n:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:                                                    # TensorFlow has initialised
        have = len(tf.config.list_logical_devices("CPU"))
        if have < n:
            raise ValueError(f"world_size {n} needs {n} logical CPU devices, but TensorFlow has already initialised "
                             f"with {have}; call data_parallel.logical_cpus({n}) before TensorFlow runs anything, "
                             f"in a new process") from None
