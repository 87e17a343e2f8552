"""Training, section 5: the label-smoothed loss (5.4) and its gradients by ``nnx.value_and_grad``;
Adam and the learning-rate schedule of section 5.3 by optax (``optax.adam`` with an optax schedule)
inside flax's ``nnx.Optimizer``; one compiled training step with dropout (5.4); the run's state for
a checkpoint. The parallel text of ``reference_numpy/training.py``.

The update is the paper's (Kingma & Ba, Algorithm 1) exactly: ``optax.adam`` with ``eps_root=0``
divides the bias-corrected first moment by ``sqrt(v_hat) + eps``; optax's step count starts at 0,
so the schedule is evaluated at ``count + 1`` and the bias correction uses ``count + 1``. The step
count is int64, as in every backend (``MAX_STEP``; optax and ``nnx.Optimizer`` would count in int32 and
uint32): :func:`optimizer` and :func:`train_step` run with 64-bit JAX on (``jax.enable_x64``, for that call and
thread only; a float32 model stays float32), so the schedule and the bias correction are computed in float64
and cast to the parameters' dtype. Dropout draws its masks from the model's own dropout streams (every
``nnx.Dropout`` holds one, forked from the model's ``rngs``): each step advances them.

A bfloat16 or float16 model's gradients are P (its loss float32): autodiff through the forward pass's roundings
is the reference's backward recipe (each concept's backward wide, float32, its gradients rounded once to P by the
transpose of the cast that widened its inputs; gradients that meet add in P), compiled without excess precision
like the forward pass. Training updates float32 or float64 weights (a P *model* is refused by the reference's
``check_trainable``); **mixed precision** (``optimizer(model, dtype="bfloat16"|"float16")``) keeps a float32
model's weights as the masters and Adam's moments float32, and differentiates a second model, the masters rounded
to P; float16 scales the loss with Flax's ``DynamicScale``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
import optax
from flax import nnx
from flax.training.dynamic_scale import DynamicScale

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
from .device import _check_dtype
from .model import Transformer
from .precision import autocast_dtype, narrow
from .speed import _EXACT_ROUNDING, _split, _streams, _Structure

Labels = np.ndarray | jax.Array   # a batch's labels, checked on the host (NumPy) or placed (a data-parallel shard)


def label_smoothed_cross_entropy(log_probs: jax.Array, labels: jax.Array, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING, tokens: int | None = None) -> jax.Array:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes. ``tokens`` divides the sum by that many labels instead of
    this batch's non-pad count: a shard of a larger batch divides by the whole batch's count, so
    that the shards' losses add up to the whole batch's (data parallelism, ``data_parallel.py``).
    ``tokens`` is a Python int, checked by the reference's rule on the host; traced labels cannot be
    counted there, so then only ``tokens`` itself is checked (and an all-pad batch gives NaN, not an error).

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    labels = jnp.asarray(labels)
    real = labels != pad_id                                                 # (B, T)
    count = _token_count(real, tokens)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(axis=-1)
    return (per_token * real).sum() / count


def loss(model: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike, labels: npt.ArrayLike,
         epsilon: float = LABEL_SMOOTHING, tokens: int | None = None, *,
         deterministic: bool | None = None) -> jax.Array:
    """The training loss of one batch; differentiate it with ``nnx.grad`` / ``nnx.value_and_grad``;
    ``tokens`` as in :func:`label_smoothed_cross_entropy`.

    Concrete inputs are checked first (the reference's ``check_batch``); traced ones were checked by the entry
    point that compiled the call.

    Shape: src (B, S), tgt (B, T) the shifted-right input, labels (B, T) the next tokens -> scalar.
    """
    batch: tuple[Any, Any, Any] = ((src, tgt, labels) if isinstance(labels, jax.core.Tracer)   # traced: checked
                                   else check_batch(model, src, tgt, labels))                 # the model's arrays
    ids, shifted, targets = batch
    return label_smoothed_cross_entropy(model(ids, shifted, deterministic=deterministic), targets,
                                        model.config.pad_id, epsilon, tokens)


def gradients(model: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike, labels: npt.ArrayLike,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off and its gradient for every checkpoint tensor, in checkpoint
    layout (tied weights receive the sum over their uses); a bfloat16 or float16 model's gradients
    are P, by the recipe (its loss float32)."""
    src, tgt, labels = _check_loss_inputs(model, src, tgt, labels)
    split = _split(model)
    value, grads = _value_and_grad(split.structure, split.state, src, tgt, labels, epsilon)
    return float(value), checkpoint.to_checkpoint_layout(model, grads)


def learning_rate_schedule(d_model: int, config: TrainingConfig = PAPER) -> optax.Schedule:
    """Eq. (3) as an optax schedule. optax calls it with the number of updates already made (0 before
    the first), so it returns :func:`learning_rate` at ``count + 1``: the paper's step_num, from 1."""
    return lambda count: learning_rate(count + 1, d_model, config)


def learning_rate(step: int | jax.Array, d_model: int, config: TrainingConfig = PAPER) -> jax.Array:
    """lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)  -- Eq. (3), section 5.3,
    times ``config.learning_rate_scale``; ``step`` (an int or a traced count) counts from 1.

    Computed in JAX's default float dtype: float64 with 64-bit JAX on, as the port's training steps run (optax
    casts it to the parameters' dtype); float32 without it.
    """
    step = jnp.asarray(step, dtype=float)
    return config.learning_rate_scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * config.warmup_steps ** -1.5)


@dataclass
class Optimizer:
    """The optimizer of section 5.3 as one record, the same fields in every backend (the reference's
    ``Optimizer``): ``adam`` (``nnx.Optimizer`` over every ``nnx.Param`` with optax's Adam) steps the model's
    weights with the learning rate of ``schedule`` (the optax schedule of :func:`learning_rate_schedule` inside it)
    and the settings of ``config``; in mixed precision ``low`` is the model in P each step differentiates (the
    float32 masters rounded to P; None: the model itself) and ``loss_scale`` float16's Flax ``DynamicScale`` (None
    for any other precision; a new value after each step)."""

    adam: nnx.Optimizer
    schedule: optax.Schedule
    config: TrainingConfig
    low: Transformer | None = None
    loss_scale: DynamicScale | None = None


def optimizer(model: Transformer, config: TrainingConfig | None = None,
              state: TrainingState | None = None, dtype: npt.DTypeLike | None = None) -> Optimizer:
    """The optimizer of section 5.3 for ``model``: ``nnx.Optimizer`` over every ``nnx.Param`` with
    ``optax.adam(learning_rate_schedule(...), beta1, beta2, epsilon, eps_root=0)``, in an :class:`Optimizer`. With
    ``state`` (from ``load_training_state``) the saved run continues where it stopped: its moments (cast to the
    model's dtype) and step count go into optax's state (an array JAX uses in place, as the reference's
    ``load_training_state`` reads them, without a copy), and, unless ``config`` is given, its training config is
    used. ``dtype`` bfloat16 or float16 (a float32 model only) makes every step compute in that precision over the
    model's float32 master weights: the record holds the model in P (its dropout streams copied from the model's)
    and, for float16, a ``DynamicScale``. A model built with Flax's mixed precision (``dtype=P,
    param_dtype=float32``, the autocast recipe) steps its own float32 parameters, each step's loss and gradients its
    own (float16's loss scaled by the ``DynamicScale``): ``low`` is the model itself. The step count is int64 (built
    with 64-bit JAX on)."""
    dtype = training_dtype(model.param_dtype, dtype)
    _check_dtype(model.param_dtype)
    if state is not None:
        state = state.astype(model.param_dtype)
        reference_checkpoint.validate_training_state(
            model.config, reference_checkpoint.parameter_stand_ins(model.config, model.param_dtype), state)
    config = config or (state.config if state is not None else PAPER)
    with jax.enable_x64(True):
        adam = _new_optimizer(model, _adam(model.config.d_model, config), abstract=state is not None)
        _restore(model, adam, state)
        low = None
        if is_low(dtype):
            low = checkpoint.from_params(model.config, checkpoint.to_params(model), dtype)  # the masters rounded to P
            nnx.update(low, nnx.state(model, nnx.RngState))                         # the model's dropout streams
        elif autocast_dtype(model.dtype, model.param_dtype) is not None:    # Flax's mixed precision: the model itself
            low, dtype = model, model.dtype
        _place_with(model, adam, low)
        return Optimizer(adam, _schedule(model.config.d_model, config), config, low,
                         _dynamic_scale(model, state) if uses_loss_scaling(dtype) else None)


def train_step(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike,
               labels: npt.ArrayLike, epsilon: float = LABEL_SMOOTHING) -> float:
    """One training step of section 5, compiled (once per model structure, optimizer settings and
    batch shape): the loss with dropout as ``model.config.dropout`` says, its gradient and one Adam
    update with the scheduled learning rate. Returns the loss before the update. The model stays in
    inference mode (dropout is on for this step only, by ``deterministic=False``); its dropout
    streams advance. In mixed precision the loss and gradients are the P model's, widened to float32
    for the update of the masters (:func:`_mixed_precision_step`). Checked first (:func:`_check_batch`); run with
    64-bit JAX on, for the int64 step count."""
    src, tgt, labels = _check_batch(model, optimizer, src, tgt, labels)
    with jax.enable_x64(True):
        if optimizer.low is not None:
            return _mixed_precision_step(model, optimizer, src, tgt, labels, epsilon)
        return float(_train_step(model, optimizer.adam, src, tgt, labels, epsilon))


def _mixed_precision_step(model: Transformer, mixed: Optimizer, src: jax.Array, tgt: jax.Array,
                          labels: Labels, epsilon: float) -> float:
    """The P model's loss and the gradient of ``scale`` x the loss (the recipe's backward pass in P), widened to
    float32 and divided by the scale (:func:`_scaled_gradients`); Adam's update of the float32 masters if every
    gradient is finite (:func:`_update_masters`: optax's count and the schedule advance), else the step is skipped
    (float16: ``DynamicScale`` has halved its scale); then the P model is the new masters rounded to P. The P
    model's dropout streams advance."""
    low = mixed.low
    assert low is not None                                                  # train_step's condition for this step
    split = _split(low)
    value, grads, finite, mixed.loss_scale, streams = _scaled_gradients(split.structure, split.state,
                                                                        mixed.loss_scale, src, tgt, labels, epsilon)
    for variable, stream in zip(split.streams, streams):
        variable.set_raw_value(stream)
    if finite:
        _update_masters(model, mixed.adam, low, grads)
    return float(value)


def training_state(model: Transformer, optimizer: Optimizer) -> TrainingState:
    """The run's state in checkpoint layout, for ``save_checkpoint(..., training=state)``: optax's
    Adam moments m_t and v_t (not bias-corrected) and its step count t (mixed precision: the float32
    optimizer's, and float16's loss scale: ``DynamicScale``'s ``scale`` and ``fin_steps``)."""
    scale = optimizer.loss_scale
    adam = optax.tree.get(nnx.as_pure(optimizer.adam.opt_state), "ScaleByAdamState")
    return TrainingState(optimizer.config, int(adam.count), checkpoint.to_checkpoint_layout(model, adam.mu),
                         checkpoint.to_checkpoint_layout(model, adam.nu),
                         None if scale is None else LossScaleState(float(scale.scale), int(scale.fin_steps)))


def _check_batch(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike,
                 labels: npt.ArrayLike) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """A training step's checks: a trainable dtype (the reference's ``check_trainable``), then
    :func:`_check_loss_inputs`, then the optimizer's step count (the reference's ``check_next_step``); the checked
    src, tgt and labels."""
    check_trainable(model.param_dtype)
    checked = _check_loss_inputs(model, src, tgt, labels)
    check_next_step(int(optimizer.adam.step[...]))
    return checked


def _check_loss_inputs(model: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike,
                       labels: npt.ArrayLike) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """The host-side checks of a batch (ids cannot be checked once traced: the reference's ``check_batch``) and of
    64-bit JAX for a float64 model (which would otherwise be truncated to float32); the checked src, tgt and
    labels."""
    _check_dtype(model.param_dtype)
    checked = check_batch(model, src, tgt, labels)
    if not np.any(checked[2] != model.config.pad_id):
        raise ValueError("labels hold no non-pad token; the loss is undefined")
    return checked


def _token_count(real: jax.Array, tokens: int | None) -> jax.Array | int:
    """The loss's denominator by the reference's ``check_token_count``: on concrete labels their non-pad count
    is checked too; traced ones are counted in the graph, and only ``tokens`` is checked (an int >= 1)."""
    if not isinstance(real, jax.core.Tracer):
        return check_token_count(int(real.sum()), tokens)
    return real.sum() if tokens is None else check_token_count(0, tokens)


@functools.cache
def _adam(d_model: int, config: TrainingConfig) -> optax.GradientTransformation:
    """Adam of section 5.3 as optax computes it (Algorithm 1 of Kingma & Ba with ``eps_root=0``); one
    object per setting, so that compiled training steps are reused by every optimizer built with it."""
    return optax.adam(learning_rate=_schedule(d_model, config), b1=config.beta1, b2=config.beta2,
                      eps=config.epsilon, eps_root=0.0)


_schedule = functools.cache(learning_rate_schedule)   # one schedule per setting: the one its cached Adam holds


def _dynamic_scale(model: Transformer, state: TrainingState | None) -> DynamicScale:
    """float16's loss scaling, Flax's ``DynamicScale`` with the reference's numbers (read at each call): the scale
    and good steps of ``resumed_loss_scale`` (a new run: ``LOSS_SCALE`` and 0), halved on a step whose gradients are
    not all finite, doubled after
    ``LOSS_SCALE_GROWTH_INTERVAL`` finite steps in a row. Flax doubles at a finite step that finds
    ``growth_interval`` finite steps already counted, i.e. after ``growth_interval + 1`` of them: hence the
    interval minus one. The scale is float32 and the count int32, on the model's device, so that every step
    runs the same compiled program."""
    value, good_steps = resumed_loss_scale(state)
    scale = DynamicScale(growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=precision.LOSS_SCALE_GROWTH_INTERVAL - 1,
                         fin_steps=np.int32(good_steps),  # type: ignore[arg-type]  # arrays, not the Python
                         scale=np.float32(value))  # type: ignore[arg-type]  # numbers flax annotates: see above
    return jax.device_put(scale, _device(model))


def _device(model: Transformer) -> jax.Device:
    """The device of the model's weights."""
    return next(iter(jax.tree.leaves(nnx.state(model, nnx.Param))[0].devices()))


def _place_with(model: Transformer, *nodes: nnx.Module | nnx.Optimizer | None) -> None:
    """The arrays of the model and of ``nodes`` (its optimizer; in mixed precision the model in P; a None skipped)
    committed to the device of the model's weights. optax and ``nnx.Optimizer`` create their step counters
    uncommitted; beside committed weights, a compiled step whose arguments turn committed after its first call is
    compiled a second time (every run of a placed model compiled its step twice: docs/benchmarks.md, "Training
    throughput")."""
    device = _device(model)
    for node in (model, *(node for node in nodes if node is not None)):
        nnx.update(node, jax.device_put(nnx.state(node), device))


def _new_optimizer(model: Transformer, adam: optax.GradientTransformation, abstract: bool) -> nnx.Optimizer:
    """``nnx.Optimizer`` over the model's parameters; ``abstract``, its state shapes and dtypes only
    (``nnx.eval_shape``), for :func:`_restore` to fill: optax's zero moments, which a resumed run's replace, are
    never allocated."""
    new = lambda model: nnx.Optimizer(model, adam, wrt=nnx.Param)
    return nnx.eval_shape(new, model) if abstract else new(model)


def _restore(model: Transformer, optimizer: nnx.Optimizer, state: TrainingState | None) -> None:
    """Put a validated state's moments and step count (a new run: 0) into optax's state (both the Adam and
    the schedule counters) and the optimizer's own step counter, every count an int64 (with 64-bit JAX on):
    optax's int32 would overflow at 2**31, nnx's uint32 wrap at 2**32."""
    count = jnp.asarray(0 if state is None else state.step, jnp.int64)
    moments = {} if state is None else dict(zip(("mu", "nu"), (
        nnx.as_pure(checkpoint._jax_layout(model, moments, owned=True))
        for moments in (state.first_moments, state.second_moments))))
    nnx.update(optimizer.opt_state, nnx.state(optax.tree.set(nnx.as_pure(optimizer.opt_state), count=count,
                                                             **moments)))
    optimizer.step.set_value(count)


@functools.partial(jax.jit, static_argnames=("structure", "epsilon"), compiler_options=_EXACT_ROUNDING)
def _value_and_grad(structure: _Structure, state: nnx.State, src: jax.Array, tgt: jax.Array, labels: Labels,
                    epsilon: float) -> tuple[jax.Array, nnx.State]:
    """Compiled loss (dropout off) and its gradient with respect to every ``nnx.Param`` (an ``nnx.State``) of the
    model of this structure and state; in P, every rounding of the recipe kept (see ``speed._EXACT_ROUNDING``)."""
    return nnx.value_and_grad(lambda m: loss(m, src, tgt, labels, epsilon, deterministic=True))(structure.merge(state))


@nnx.jit(static_argnames="epsilon")
def _train_step(model: Transformer, optimizer: nnx.Optimizer, src: jax.Array, tgt: jax.Array, labels: Labels,
                epsilon: float) -> jax.Array:
    """Compiled: the loss in training mode, its gradient and the optimizer's update of the model."""
    value, grads = nnx.value_and_grad(lambda m: loss(m, src, tgt, labels, epsilon, deterministic=False))(model)
    optimizer.update(model, grads)
    return value


@functools.partial(jax.jit, static_argnames=("structure", "epsilon"), compiler_options=_EXACT_ROUNDING)
def _scaled_gradients(structure: _Structure, state: nnx.State, loss_scale: DynamicScale | None, src: jax.Array,
                      tgt: jax.Array, labels: Labels, epsilon: float,
                      ) -> tuple[jax.Array, nnx.State, jax.Array, DynamicScale | None, list[jax.Array]]:
    """Compiled, for the P model of this structure and state: its loss in training mode (float32), the gradient of
    the loss times the scale (``DynamicScale.value_and_grad``; bfloat16: unscaled) as float32 divided by the scale
    (an ``nnx.State`` of the P model's parameters), whether every gradient is finite, the loss scale after the step
    and the values of the dropout streams after it (as ``speed._streams`` lists them)."""
    graphdef, params, *rest = nnx.split(structure.merge(state), nnx.Param, ...)

    def value(params: nnx.State) -> tuple[jax.Array, tuple[jax.Array, list[jax.Array]]]:
        low = nnx.merge(graphdef, params, *rest, copy=True)           # Variables of this trace: its streams advance
        out = loss(low, src, tgt, labels, epsilon, deterministic=False)
        return out, (out, [variable.get_raw_value() for variable in _streams(low)])

    if loss_scale is None:
        (_, (out, streams)), grads = jax.value_and_grad(value, has_aux=True)(params)
        grads = jax.tree.map(lambda grad: grad.astype(jnp.float32), grads)
        finite = jnp.stack([jnp.isfinite(grad).all() for grad in jax.tree.leaves(grads)]).all()
    else:
        loss_scale, finite, (_, (out, streams)), grads = loss_scale.value_and_grad(value, has_aux=True)(params)
    return out, grads, finite, loss_scale, streams


@nnx.jit
def _update_masters(model: Transformer, optimizer: nnx.Optimizer, low: Transformer, grads: nnx.State) -> None:
    """Compiled: Adam's update of the float32 masters with the float32 gradients (optax's count and the schedule
    advance), then the P model's weights the new masters rounded to P."""
    optimizer.update(model, grads)
    nnx.update(low, jax.tree.map(lambda master: narrow(master, low.param_dtype), nnx.state(model, nnx.Param)))
