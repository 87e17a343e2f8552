"""Training, section 5: the label-smoothed loss (5.4) and its gradients by ``tf.GradientTape``, Keras's
Adam made to compute the paper's update with the learning rate of Eq. (3) as a Keras
``LearningRateSchedule`` (5.3), one training step with dropout (5.4), and the run's state for a
checkpoint. The parallel text of ``reference_numpy/training.py``.

A bfloat16 or float16 model has a float32 loss and P gradients, by ``tf.GradientTape`` through the recipe's casts
(``precision.wide``, ``precision.narrow``): each concept's backward runs in float32 and its gradients are rounded to
P where its forward pass made its P inputs float32, and gradients that meet add in P. It is not trained itself
(``reference_numpy.precision.check_trainable``): a float32 model trains in P with ``optimizer(model, dtype=...)``,
**mixed precision** (``docs/training.md``): the model's float32 variables are the master weights and Adam's moments
are float32; each step differentiates a second model in P, the masters rounded to P, and applies its gradients
widened to float32. float16 scales the loss with Keras' ``LossScaleOptimizer``; bfloat16 does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf

from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy import precision
from reference_numpy.checkpoint import LossScaleState, TrainingState
from reference_numpy.config import TrainingConfig
from reference_numpy.precision import check_trainable, is_low, training_dtype, uses_loss_scaling
from reference_numpy.training import (
    LABEL_SMOOTHING,
    PAPER,
    check_batch,
    check_next_step,
    check_token_count,
    resumed_loss_scale,
)

from . import checkpoint
from . import device as _device
from .layers import register
from .model import Transformer
from .precision import autocast_dtype, narrow, wide

Batch: TypeAlias = "tf.Tensor | npt.ArrayLike"   # token ids (src, tgt, labels): a tensor, or anything NumPy reads


def label_smoothed_cross_entropy(log_probs: tf.Tensor, labels: tf.Tensor, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING, tokens: int | None = None) -> tf.Tensor:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes. ``tokens`` divides the sum by that many labels instead of
    this batch's non-pad count: a shard of a larger batch divides by the whole batch's count, so
    that the shards' losses add up to the whole batch's (data parallelism, ``data_parallel.py``).
    Eager, ``tokens`` is a Python int checked by the reference's rule; traced, the labels' values are
    unknown (``train_step`` and ``data_parallel.train_step`` check them before) and ``tokens`` may be a
    scalar tensor, so that a new count does not trace the step again.

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, pad_id, epsilon, tokens)
    real = tf.cast(labels != pad_id, log_probs.dtype)                       # (B, T)
    count = tf.reduce_sum(real) if tokens is None else tf.cast(tokens, log_probs.dtype)
    picked = tf.gather(log_probs, labels, batch_dims=2)                     # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * tf.reduce_mean(log_probs, axis=-1)
    return tf.reduce_sum(per_token * real) / count


def _check_labels(labels: tf.Tensor, pad_id: int, epsilon: float, tokens: int | None = None) -> None:
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    if not tf.is_symbolic_tensor(labels):
        check_token_count(int(np.sum(labels.numpy() != pad_id)), tokens)


def loss(model: Transformer, src: Batch, tgt: Batch, labels: Batch, epsilon: float = LABEL_SMOOTHING,
         tokens: int | None = None,
         training: bool = False) -> tf.Tensor:
    """The training loss of one batch; ``tokens`` as in :func:`label_smoothed_cross_entropy`. Eager inputs are
    checked first (the reference's ``check_batch``); symbolic ones were checked by the entry point that traced the
    call. Shape: src (B, S), tgt and labels (B, T) -> scalar."""
    if not tf.is_symbolic_tensor(labels):
        src, tgt, labels = _check_batch(model, src, tgt, labels)
    return label_smoothed_cross_entropy(model(src, tgt, training=training), labels, model.config.pad_id, epsilon,
                                        tokens)


def _check_batch(model: Transformer, src: Batch, tgt: Batch, labels: Batch) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The reference's ``check_batch`` on the host; the labels as int64 ids, as the model makes src and tgt
    (``tf.gather`` takes no unsigned indices)."""
    src, tgt, labels = check_batch(model, src, tgt, labels)
    return src, tgt, tf.constant(labels, tf.int64)


def gradients(model: Transformer, src: Batch, tgt: Batch, labels: Batch,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off and its gradient for every checkpoint tensor, in checkpoint
    layout and the model's dtype (tied weights receive the sum over their uses); a bfloat16 or float16 model's
    gradients are P, by the recipe (its loss float32)."""
    variables = model.trainable_variables
    with tf.device(_device.model_device(model)), tf.GradientTape() as tape:
        value = loss(model, src, tgt, labels, epsilon)
    grads = tape.gradient(value, variables)
    return float(value), checkpoint.to_checkpoint_layout(model, {v.path: _dense(g) for v, g in zip(variables, grads)})


def _dense(grad: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """A variable's gradient as a dense tensor. An embedding's is ``tf.IndexedSlices``, one row per position holding
    a token; the rows of one token are summed wide and rounded once, by the recipe (``reference_numpy/backward.py``,
    ``embeddings``), where TensorFlow's own conversion (``unsorted_segment_sum`` in the gradient's dtype) adds them
    one by one in P and loses most of them past a few hundred (in bfloat16 256 + 1 = 256). float32 and float64: the
    same sum as TensorFlow's conversion.

    Shape: values (N, D) for N positions, indices (N,) -> (V, D).
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows = tf.math.unsorted_segment_sum(wide(grad.values), grad.indices, grad.dense_shape[0])   # (V, D)
    return narrow(rows, grad.values.dtype)


def learning_rate_schedule(d_model: int, config: TrainingConfig = PAPER
                           ) -> keras.optimizers.schedules.LearningRateSchedule:
    """Eq. (3) as a Keras schedule. Keras calls it with ``optimizer.iterations``, the number of steps
    already taken (0 before the first update), so it returns lrate(iterations + 1), in float64."""
    return _Schedule(d_model, config)


@register
class _Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """lrate(iterations + 1) of :func:`learning_rate`; its config is what Keras saves of it in a ``.keras`` file."""

    def __init__(self, d_model: int, config: TrainingConfig | dict):
        self.d_model, self.config = d_model, TrainingConfig.from_dict(config) if isinstance(config, dict) else config

    def __call__(self, step):
        return learning_rate(tf.cast(step, tf.float64) + 1.0, self.d_model, self.config)

    def get_config(self) -> dict:
        return {"d_model": self.d_model, "config": self.config.to_dict()}


def learning_rate(step: int | tf.Tensor, d_model: int, config: TrainingConfig = PAPER) -> tf.Tensor:
    """lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)  -- Eq. (3), section 5.3,
    times ``config.learning_rate_scale``; ``step`` (an int or a tensor) counts from 1. Float64."""
    step = tf.cast(step, tf.float64)
    return config.learning_rate_scale * d_model ** -0.5 * tf.minimum(step ** -0.5, step * config.warmup_steps ** -1.5)


@register
class _Adam(keras.optimizers.Adam):
    """``keras.optimizers.Adam`` computing Kingma & Ba's Algorithm 1 as section 5.3 uses it.

    Keras 3.15's ``Adam.update_step`` (``keras/src/optimizers/adam.py``) folds both bias corrections
    into the step size, theta -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + eps), so epsilon meets
    the uncorrected sqrt(v): an effective eps / sqrt(1 - b2^t) (7.1e-9 at t = 1 for b2 = 0.98, not
    1e-9). This ``update_step`` corrects m and v first, theta -= lr m_hat / (sqrt(v_hat) + eps), with
    t = iterations + 1; the scalars lr, 1 - b1^t and 1 - b2^t are computed in float64 and cast once
    to the variable's dtype. Its m and v are its own (:meth:`build`, by the public ``add_variable_from_reference``),
    not Keras' ``Adam`` internals (``_momentums``, ``_velocities``); Keras 3 has no public lookup of a variable's
    optimizer variables (Keras 2's ``get_slot`` is gone) and calls ``update_step`` with the backend's own variable,
    so :meth:`moments` finds them by the one private index every Keras optimizer keeps for that
    (``_get_variable_index``).
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, config: TrainingConfig,
                 name: str = "adam"):
        super().__init__(schedule, config.beta1, config.beta2, config.epsilon, name=name)
        self.schedule, self.config = schedule, config
        self.slots: list[tuple] = []

    def get_config(self) -> dict:
        """What a ``.keras`` file holds of the optimizer (``model.save`` of a compiled model, ``ModelCheckpoint``):
        the schedule (d_model and the training config) and the name; :meth:`from_config` builds it again."""
        return {"name": self.name, "schedule": keras.saving.serialize_keras_object(self.schedule)}

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> _Adam:
        schedule = keras.saving.deserialize_keras_object(config["schedule"], custom_objects)
        return cls(schedule, schedule.config, config["name"])

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        """Keras' ``apply`` with every gradient dense (:func:`_dense`): Keras' own ``fit`` hands an embedding's
        gradient over as ``tf.IndexedSlices``, which :meth:`update_step`'s arithmetic would make dense by
        TensorFlow's conversion (the sum in P that :func:`_dense` avoids)."""
        return super().apply([_dense(grad) for grad in grads], trainable_variables)

    def build(self, variables: list[keras.Variable],
              moments: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """The base optimizer's ``build`` (its step count, learning rate and variable index), then m and v of every
        variable (Keras' own ``Adam.build`` is skipped: its pair would be a second one, unused): zeros, or a
        resumed run's ``moments`` (``variable.path`` -> (m, v) in the variable's layout), taken as they are
        (:func:`_taken`)."""
        if self.built:
            return
        super(keras.optimizers.Adam, self).build(variables)
        start = lambda variable, i: "zeros" if moments is None else _taken(moments[variable.path][i])
        self.slots = [(self.add_variable_from_reference(variable, "momentum", start(variable, 0)),
                       self.add_variable_from_reference(variable, "velocity", start(variable, 1)))
                      for variable in variables]

    def moments(self, variable: keras.Variable) -> tuple[keras.Variable, keras.Variable]:
        """Adam's m and v (not bias-corrected) of one model variable: Keras variables."""
        return self.slots[self._get_variable_index(variable)]

    def update_step(self, gradient, variable, learning_rate):
        t = tf.cast(self.iterations + 1, tf.float64)
        lr, c1, c2 = (tf.cast(x, variable.dtype) for x in (learning_rate, 1 - self.beta_1 ** t,
                                                            1 - self.beta_2 ** t))
        m, v = self.moments(variable)
        self.assign(m, m * self.beta_1 + (1 - self.beta_1) * gradient)
        self.assign(v, v * self.beta_2 + (1 - self.beta_2) * gradient * gradient)
        self.assign_sub(variable, lr * (m / c1) / (tf.sqrt(v / c2) + self.epsilon))


def _taken(array: np.ndarray) -> Callable[[tuple, str], tf.Tensor]:
    """A Keras initializer that gives ``array``'s values: its own memory, without a copy, when TensorFlow can hold
    it as it is (C-contiguous and aligned to 64 bytes, as the reference's ``load_training_state`` reads every
    moment: a variable made from a tensor imported by DLPack keeps that tensor's buffer); else a copy. The variable's
    first update writes a buffer of its own (TensorFlow does not write into memory NumPy holds)."""
    shared = array.flags.c_contiguous and array.ctypes.data % 64 == 0 and array.dtype in (np.float32, np.float64)
    return lambda shape, dtype: (tf.experimental.dlpack.from_dlpack(array.__dlpack__()) if shared
                                 else tf.convert_to_tensor(array))


@dataclass
class Optimizer:
    """The optimizer of section 5.3 as one record, the same fields in every backend (the reference's
    ``Optimizer``): ``adam`` (the paper's Adam, a ``keras.optimizers.Adam``) steps the model's variables with the
    learning rate of ``schedule`` (the Keras schedule of :func:`learning_rate_schedule` it holds) and the settings of
    ``config``; in mixed precision ``low`` is the model in P each step differentiates (the float32 masters rounded to
    P; None: the model itself) and ``loss_scale`` float16's Keras ``LossScaleOptimizer`` around ``adam`` (None for
    any other precision). ``_compiled`` is the traced step (:func:`_step` or :func:`_mixed_precision_step`), set by
    :func:`optimizer`."""

    adam: _Adam
    schedule: keras.optimizers.schedules.LearningRateSchedule
    config: TrainingConfig
    low: Transformer | None = None
    loss_scale: keras.optimizers.LossScaleOptimizer | None = None
    _compiled: Callable | None = field(default=None, init=False, repr=False, compare=False)


def optimizer(model: Transformer, config: TrainingConfig | None = None, state: TrainingState | None = None,
              dtype: npt.DTypeLike | None = None) -> Optimizer:
    """The optimizer of section 5.3 for ``model``: Keras's Adam with the paper's update and the schedule
    of Eq. (3), built on the model's variables, in an :class:`Optimizer`. With ``state`` (from
    ``load_training_state``) the saved run continues where it stopped: its moments (cast to the model's dtype;
    arrays the reference's ``load_training_state`` read are taken without a copy, :func:`_taken`) are the
    optimizer's variables, its step count theirs and, unless ``config`` is given, its training config is
    used. ``dtype`` bfloat16 or float16 (a float32 model only) makes every step compute in that precision over the
    model's float32 master weights (:func:`_mixed_precision`). A model under Keras' mixed policy (``mixed_bfloat16``,
    ``mixed_float16``: the autocast recipe) steps its own float32 variables, each step's loss and gradients its own
    (``mixed_float16``'s loss scaled by a ``LossScaleOptimizer``): ``low`` is the model itself."""
    dtype = training_dtype(model.variable_dtype, dtype)
    moments = None
    if state is not None:
        state = state.astype(model.variable_dtype)
        reference_checkpoint.validate_training_state(
            model.config, reference_checkpoint.parameter_stand_ins(model.config, model.variable_dtype), state)
        first, second = (checkpoint.from_checkpoint_layout(model, arrays)
                         for arrays in (state.first_moments, state.second_moments))
        moments = {path: (first[path], second[path]) for path in first}
    config = config or (state.config if state is not None else PAPER)
    schedule = learning_rate_schedule(model.config.d_model, config)
    adam = _Adam(schedule, config)
    with tf.device(_device.model_device(model)):
        adam.build(model.trainable_variables, moments)
    if state is not None:
        adam.iterations.assign(state.step)
    mixed = None if is_low(dtype) else autocast_dtype(model.dtype_policy)   # Keras' mixed policy: the autocast recipe
    low_and_scale: tuple[Transformer | None, keras.optimizers.LossScaleOptimizer | None]
    if mixed is not None:
        low_and_scale = (model, _loss_scale(model, adam, state) if uses_loss_scaling(mixed.as_numpy_dtype) else None)
    else:
        low_and_scale = _mixed_precision(model, adam, dtype, state) if is_low(dtype) else (None, None)
    result = Optimizer(adam, schedule, config, *low_and_scale)
    step = functools.partial(_mixed_precision_step, result) if result.low is not None \
        else functools.partial(_step, adam)
    # traced once per input shape; without AutoGraph: the step has no tensor-dependent Python control flow (its one
    # branch is a tf.cond), and converting the model's code cost a quarter of the trace (tiny, float32: 6 s -> 4.7 s)
    result._compiled = tf.function(step, autograph=False)
    return result


def _mixed_precision(model: Transformer, adam: _Adam, dtype: np.dtype, state: TrainingState | None
                     ) -> tuple[Transformer, keras.optimizers.LossScaleOptimizer | None]:
    """For ``adam`` over the float32 ``model`` (the masters): the model in ``dtype`` built from the masters rounded
    to it, and for float16 a ``LossScaleOptimizer`` around ``adam`` with ``reference_numpy.precision``'s growth
    interval, read at each call, from the scale and good steps of ``resumed_loss_scale`` (its ``dynamic_scale`` and
    ``step_counter``)."""
    with tf.device(_device.model_device(model)):
        low = checkpoint.from_params(model.config, checkpoint.to_params(model), dtype)
    return low, _loss_scale(model, adam, state) if uses_loss_scaling(dtype) else None


def _loss_scale(model: Transformer, adam: _Adam, state: TrainingState | None
                ) -> keras.optimizers.LossScaleOptimizer:
    """float16's ``LossScaleOptimizer`` around ``adam`` with ``reference_numpy.precision``'s growth interval, read
    at each call, from the scale and good steps of ``resumed_loss_scale`` (its ``dynamic_scale`` and
    ``step_counter``)."""
    with tf.device(_device.model_device(model)):
        scale, good_steps = resumed_loss_scale(state)
        loss_scale = keras.optimizers.LossScaleOptimizer(adam, scale, precision.LOSS_SCALE_GROWTH_INTERVAL)
        loss_scale.build(model.trainable_variables)                        # its scale and counter; adam is built
        loss_scale.step_counter.assign(good_steps)
    return loss_scale


def train_step(model: Transformer, optimizer: Optimizer, src: Batch, tgt: Batch, labels: Batch,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One training step of section 5: the loss with dropout on (``training=True``, P_drop =
    ``config.dropout``), its gradient, and Adam's update with lrate(t); returns the loss before the
    update. Compiled (``tf.function``, traced once per optimizer and input shape); the inputs are
    checked before. Keras keeps no mode on the model: ``training=True`` holds for this step's
    forward pass only, every other call stays inference. In mixed precision the loss and gradients are the
    P model's, widened to float32 for the update of the masters (:func:`_mixed_precision_step`). The batch (the
    reference's ``check_batch``) and the step count (``check_next_step``: Keras' int64 ``iterations`` would wrap)
    are checked before."""
    check_trainable(model.variable_dtype)
    src, tgt, labels = _check_batch(model, src, tgt, labels)              # ids cannot be checked once traced
    _check_labels(labels, model.config.pad_id, epsilon)
    check_next_step(int(optimizer.adam.iterations.numpy()))
    with tf.device(_device.model_device(model)):
        compiled = optimizer._compiled
        assert compiled is not None                                          # set by optimizer()
        return float(compiled(model, src, tgt, labels, epsilon))


def _step(optimizer: _Adam, model: Transformer, src: Batch, tgt: Batch, labels: Batch, epsilon: float,
          tokens: int | tf.Tensor | None = None) -> tf.Tensor:
    """Traced: the loss in training mode (over ``tokens`` labels if given), its gradient (an embedding's
    ``IndexedSlices`` made dense) and the optimizer's update (under a ``tf.distribute`` strategy, one replica's:
    the optimizer sums the replicas' gradients first)."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        value = loss(model, src, tgt, labels, epsilon, tokens, training=True)
    optimizer.apply([_dense(grad) for grad in tape.gradient(value, variables)], variables)
    return value


def _mixed_precision_step(mixed: Optimizer, model: Transformer, src: Batch, tgt: Batch, labels: Batch,
                          epsilon: float) -> tf.Tensor:
    """Traced: the P model's loss in training mode and the gradient of the loss (float16: times the current scale)
    by the recipe's backward pass in P, widened to float32; then the update of the float32 masters if every
    gradient is finite, else none (float16: ``LossScaleOptimizer.apply`` divides by the scale, skips the step
    and halves the scale on a non-finite gradient, and doubles it after its growth interval of finite steps);
    then the P model's weights are the masters rounded to P. Returns the unscaled loss."""
    assert mixed.low is not None                                          # the condition of this step
    low, masters = mixed.low.trainable_variables, model.trainable_variables
    with tf.GradientTape() as tape:
        value = loss(mixed.low, src, tgt, labels, epsilon, training=True)
        scaled = value if mixed.loss_scale is None else mixed.loss_scale.scale_loss(value)
    grads = [tf.cast(_dense(grad), tf.float32) for grad in tape.gradient(scaled, low)]
    if mixed.loss_scale is None:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(grad)) for grad in grads])
        tf.cond(finite, lambda: mixed.adam.apply(grads, masters), lambda: None)
    else:
        mixed.loss_scale.apply(grads, masters)
    for variable, master in zip(low, masters):
        if variable is not master:                                       # Keras' mixed policy: the model itself
            variable.assign(tf.cast(master, variable.dtype))             # float32 -> P: rounded once, to nearest even
    return value


def training_state(model: Transformer, optimizer: Optimizer) -> TrainingState:
    """The run's state in checkpoint layout (NumPy, the model's dtype), for
    ``save_checkpoint(..., training=state)``: the config, Adam's step count and moments (mixed precision: the
    float32 masters'), and float16's loss scale (the ``LossScaleOptimizer``'s ``dynamic_scale`` and
    ``step_counter``)."""
    adam, scale, variables = optimizer.adam, optimizer.loss_scale, model.trainable_variables
    first, second = (checkpoint.to_checkpoint_layout(model, {v.path: adam.moments(v)[i] for v in variables})
                     for i in (0, 1))
    return TrainingState(optimizer.config, int(adam.iterations.numpy()), first, second,
                         None if scale is None else LossScaleState(float(scale.dynamic_scale.numpy()),
                                                                   int(scale.step_counter.numpy())))
