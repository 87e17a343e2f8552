"""Training, section 5: the label-smoothed loss (5.4), its gradient, Adam and the learning-rate
schedule (5.3), one training step, and the run's state for a checkpoint.

The reference differentiates by hand (``reference_numpy/backward.py``, checked against finite
differences of :func:`loss`); the ports differentiate by autodiff and step with their framework's own
optimizer, made to compute the same update. The reference has no dropout: it trains as with P_drop = 0.

**Mixed precision** (``optimizer(model, dtype="bfloat16"|"float16")``, ``docs/training.md``): a float32 model's
weights are the master copy and Adam's moments are float32; each step computes the loss and its gradient in the low
precision P by the recipe of :mod:`.precision` -- the weights rounded to P, the backward pass of
:mod:`.backward` in P -- and widens the P gradients to float32 for Adam. float16 scales the loss
(:class:`LossScale`); bfloat16 does not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from . import backward, checkpoint, precision
from .checkpoint import MAX_STEP, LossScaleState, TrainingState
from .checks import check_tokens
from .config import TrainingConfig, TransformerConfig
from .model import Transformer
from .precision import is_low, training_dtype, uses_loss_scaling

LABEL_SMOOTHING = 0.1  # section 5.4
PAPER = TrainingConfig()  # section 5.3: Adam(0.9, 0.98, 1e-9), warmup_steps = 4000


def label_smoothed_cross_entropy(log_probs: np.ndarray, labels: np.ndarray, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING, tokens: int | None = None) -> np.ndarray:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1" (Szegedy et al., 2016);
    the smoothing mass is spread uniformly over all V classes. ``tokens`` divides the sum by that many
    labels instead of this batch's non-pad count: a shard of a larger batch divides by the whole batch's
    count, so that the shards' losses add up to the whole batch's (data parallelism, ``data_parallel.py``).

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    labels = np.asarray(labels)
    real = labels != pad_id                                                 # (B, T)
    count = check_token_count(int(real.sum()), tokens)
    picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(axis=-1)
    return (per_token * real).sum() / count


def check_token_count(real: int, tokens: int | None) -> int:
    """The loss's denominator: ``tokens`` if given (an int at least ``real`` and at least 1), else ``real``, the
    batch's own non-pad labels (at least 1). One ``ValueError`` otherwise."""
    if tokens is None:
        if real == 0:
            raise ValueError("labels hold no non-pad token; the loss is undefined")
        return real
    if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens < max(real, 1):
        raise ValueError(f"tokens must be an int >= 1 and >= the labels' {real} non-pad tokens, got {tokens!r}")
    return int(tokens)


def loss(model: Transformer, src: np.ndarray, tgt: np.ndarray, labels: np.ndarray,
         epsilon: float = LABEL_SMOOTHING, tokens: int | None = None) -> np.ndarray:
    """The training loss of one batch (dropout off: the reference computes inference); ``tokens`` as in
    :func:`label_smoothed_cross_entropy`.

    Shape: src (B, S), tgt (B, T) the shifted-right input, labels (B, T) the next tokens -> scalar.
    """
    src, tgt, labels = check_batch(model, src, tgt, labels)
    return label_smoothed_cross_entropy(model(src, tgt), labels, model.config.pad_id, epsilon, tokens)


def gradients(model: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike, labels: npt.ArrayLike,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss and its gradient for every checkpoint tensor, in checkpoint layout and the model's dtype
    (tied weights receive the sum over their uses), by the hand-written backward pass; a bfloat16 or float16
    model's gradients are P, by the recipe (its loss float32)."""
    return backward.loss_and_gradients(model, label_smoothed_cross_entropy, *check_batch(model, src, tgt, labels),
                                      epsilon)


def check_batch(model: Any, src: Any, tgt: Any, labels: npt.ArrayLike) -> tuple[Any, Any, np.ndarray]:
    """A training batch's checks, before any work, for the model of any backend: src and tgt by the model's own
    forward-pass checks (``model._check_inputs``: the backend's tensors back), then :func:`check_labels` against the
    checked tgt. Returns (src, tgt, labels), labels as NumPy (a port passes them on the host)."""
    src, tgt = model._check_inputs(src, tgt, None, None)
    return src, tgt, check_labels(labels, tuple(tgt.shape), model.config)


def check_labels(labels: npt.ArrayLike, tgt_shape: tuple, config: TransformerConfig) -> np.ndarray:
    """The labels of a batch (the next target tokens) as a NumPy array: integer ids (bool refused) of tgt's shape
    (B, T), each in [0, tgt_vocab_size) (``pad_id`` included: a padded position). One ``ValueError`` naming
    ``labels`` otherwise, the same in every backend (each calls this on the host before any framework work: an id
    outside the vocabulary would index past the log-probabilities, which NumPy and JAX do silently)."""
    labels = check_tokens("labels", labels, config.tgt_vocab_size, config.max_len)
    if labels.shape != tgt_shape:
        raise ValueError(f"labels must have tgt's shape {tgt_shape}, got {labels.shape}")
    return labels


def learning_rate(step: int, d_model: int, config: TrainingConfig = PAPER) -> float:
    """lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)  -- Eq. (3), section 5.3.

    Rises linearly for the first ``warmup_steps`` steps, then decays as the inverse square root of the
    step number; ``step`` counts from 1 (the first update), times ``config.learning_rate_scale``.
    """
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step must be an int >= 1 (steps count from 1), got {step!r}")
    return config.learning_rate_scale * d_model ** -0.5 * min(step ** -0.5, step * config.warmup_steps ** -1.5)


def check_next_step(step: int) -> None:
    """An optimizer that has taken ``step`` steps may take one more unless ``step`` is ``MAX_STEP`` (2**63 - 1), the
    largest int64 count, which a further step would wrap (TensorFlow) or overflow. One ``ValueError``, the same in
    every backend: each ``train_step`` calls this with its optimizer's count before any work."""
    if step >= MAX_STEP:
        raise ValueError(f"optimizer has taken {step} steps, the most an int64 count holds (2**63 - 1); "
                         "it cannot take another")


class LossScale:
    """Dynamic loss scaling for float16 (Micikevicius et al., 2018, "Mixed precision training"), as torch's
    ``GradScaler``, Keras' ``LossScaleOptimizer`` and Flax's ``DynamicScale`` do it: the backward pass starts from
    ``value`` times the loss and the gradients are divided by ``value`` in float32; a step whose gradients are not
    all finite is skipped (no update, the step count unchanged) and halves ``value``; ``growth_interval`` finite
    steps in a row double it (``good_steps`` counts them)."""

    def __init__(self, value: float, growth_interval: int, good_steps: int = 0):
        self.value, self.growth_interval, self.good_steps = value, growth_interval, good_steps

    def update(self, finite: bool) -> None:
        """After a step: halve on non-finite gradients; double after ``growth_interval`` finite steps in a row."""
        self.good_steps = self.good_steps + 1 if finite else 0
        if not finite:
            self.value /= 2.0
        elif self.good_steps == self.growth_interval:
            self.value, self.good_steps = self.value * 2.0, 0


class Adam:
    """Adam (Kingma & Ba, 2015, Algorithm 1) with beta1 = 0.9, beta2 = 0.98, epsilon = 1e-9 and the
    learning rate of Eq. (3) -- section 5.3. Updates the parameter arrays in place:

        t += 1;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        theta -= lrate(t) * m_hat / (sqrt(v_hat) + eps),  m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)

    """

    def __init__(self, params: dict[str, np.ndarray], schedule: Callable[[int], float], config: TrainingConfig,
                 state: TrainingState | None = None):
        self.params, self.schedule, self.config = params, schedule, config
        self.step = 0 if state is None else int(state.step)
        self.first_moments = {name: _moment(state, 0, name, value) for name, value in params.items()}
        self.second_moments = {name: _moment(state, 1, name, value) for name, value in params.items()}

    def update(self, grads: dict[str, np.ndarray]) -> None:
        """One step with the gradient of every parameter, by checkpoint name."""
        c = self.config
        self.step += 1
        lr = self.schedule(self.step)
        for name, grad in grads.items():
            m, v = self.first_moments[name], self.second_moments[name]
            m *= c.beta1
            m += (1.0 - c.beta1) * grad
            v *= c.beta2
            v += (1.0 - c.beta2) * grad * grad
            m_hat, v_hat = m / (1.0 - c.beta1 ** self.step), v / (1.0 - c.beta2 ** self.step)
            self.params[name] -= lr * m_hat / (np.sqrt(v_hat) + c.epsilon)


def _moment(state: TrainingState | None, which: int, name: str, like: np.ndarray) -> np.ndarray:
    """A private copy of one tensor's saved moment (zeros for a new run), in the parameter's dtype."""
    if state is None:
        return np.zeros_like(like)
    return np.array((state.first_moments, state.second_moments)[which][name], dtype=like.dtype)


@dataclass
class Optimizer:
    """The optimizer of section 5.3 as one record, the same fields in every backend: ``adam`` steps the model's
    weights (Kingma & Ba, Algorithm 1) with the learning rate of ``schedule`` (Eq. (3)) and the settings of ``config``.
    In mixed precision (``docs/training.md``) the model's float32 weights are the masters and Adam's moments float32;
    ``low`` is the model in P each step differentiates (the masters rounded to P; None: the model itself) and
    ``loss_scale`` float16's dynamic loss scaling (None for any other precision)."""

    adam: Adam
    schedule: Callable[[int], float]
    config: TrainingConfig
    low: Transformer | None = None
    loss_scale: LossScale | None = None


def optimizer(model: Transformer, config: TrainingConfig | None = None,
              state: TrainingState | None = None, dtype: npt.DTypeLike | None = None) -> Optimizer:
    """The optimizer of section 5.3 for ``model``: :class:`Adam` with the schedule of Eq. (3) (the update numbered t,
    from 1, uses ``learning_rate(t)``). With ``state`` (from ``load_training_state``) the saved run continues where it
    stopped: its moments (cast to the model's dtype), step count, float16 loss scale and, unless ``config`` is given,
    its training config. ``dtype`` bfloat16 or float16 (a float32 model only) makes every step compute in that
    precision over the model's float32 master weights (mixed precision, above). Built under
    :func:`.precision.autocast` (a float32 model, no ``dtype``) every step is the model's own under the autocast
    recipe (run it under the same block), with float16's loss scaling: ``low`` is the model itself."""
    dtype = training_dtype(model.dtype, dtype)
    if state is not None:
        state = state.astype(model.dtype)                                   # cast once: validated, then copied in
        checkpoint.validate_training_state(model.config, model.params, state)
    config = config or (state.config if state is not None else PAPER)
    schedule = functools.partial(learning_rate, d_model=model.config.d_model, config=config)
    low = Transformer(model.config, model.params, dtype) if is_low(dtype) else None
    mixed = precision.product_dtype(model.dtype) if precision.autocast_dtype() is not None else None
    if mixed is not None and is_low(mixed) and not is_low(dtype):   # built under autocast: the model itself
        low, dtype = model, mixed
    return Optimizer(Adam(model.params, schedule, config, state), schedule, config, low,
                     _loss_scale(state) if uses_loss_scaling(dtype) else None)


def _loss_scale(state: TrainingState | None) -> LossScale:
    """float16's dynamic loss scaling from the scale and good steps of :func:`resumed_loss_scale`, doubling after
    ``LOSS_SCALE_GROWTH_INTERVAL`` finite steps in a row (read now)."""
    value, good_steps = resumed_loss_scale(state)
    return LossScale(value, precision.LOSS_SCALE_GROWTH_INTERVAL, good_steps)


def resumed_loss_scale(state: TrainingState | None) -> tuple[float, int]:
    """The (scale, good steps) a float16 run starts from: the saved run's (``state.loss_scale``), else a new scale
    ``LOSS_SCALE`` with no good steps (a new run, or a state without one: a float32 or bfloat16 run's, or a file saved
    before the scale was kept). Every backend builds its scaler from this."""
    saved = None if state is None else state.loss_scale
    return (precision.LOSS_SCALE, 0) if saved is None else (saved.value, saved.good_steps)


def train_step(model: Transformer, optimizer: Optimizer, src: npt.ArrayLike, tgt: npt.ArrayLike,
               labels: npt.ArrayLike,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One training step of section 5 (no dropout in the reference): the loss before the update. In mixed
    precision the loss and gradients are the P model's, widened to float32 for the update of the masters
    (:func:`_mixed_precision_step`). The batch (:func:`check_batch`) and the step count (:func:`check_next_step`)
    are checked first."""
    src_ids, tgt_ids, label_ids = check_batch(model, src, tgt, labels)
    check_next_step(optimizer.adam.step)
    if optimizer.low is not None:
        return _mixed_precision_step(model, optimizer, src_ids, tgt_ids, label_ids, epsilon)
    value, grads = backward.loss_and_gradients(model, label_smoothed_cross_entropy, src_ids, tgt_ids, label_ids,
                                              epsilon)
    optimizer.adam.update(grads)
    return value


def _mixed_precision_step(model: Transformer, mixed: Optimizer, src: np.ndarray, tgt: np.ndarray,
                          labels: np.ndarray, epsilon: float) -> float:
    """The P model's loss and the gradient of ``scale`` x the loss (the recipe's backward pass in P), widened to
    float32 and divided by the scale; Adam's update of the float32 masters if every gradient is finite, else the step
    is skipped (float16; its scale halves); then the P model is the new masters rounded to P."""
    assert mixed.low is not None                                          # mixed precision: train_step checked
    scale = 1.0 if mixed.loss_scale is None else mixed.loss_scale.value
    with np.errstate(over="ignore", invalid="ignore"):                    # an overflow skips the step (float16)
        value, grads = backward.loss_and_gradients(mixed.low, label_smoothed_cross_entropy, src, tgt, labels, epsilon,
                                                   scale)
        grads = {name: grad.astype(np.float32) / np.float32(scale) for name, grad in grads.items()}
    finite = all(np.isfinite(grad).all() for grad in grads.values())
    if mixed.loss_scale is not None:
        mixed.loss_scale.update(finite)
    if finite:
        mixed.adam.update(grads)
        if mixed.low is not model:                                        # autocast: the model itself, updated
            mixed.low = Transformer(model.config, model.params, mixed.low.dtype)
    return value


def training_state(model: Transformer, optimizer: Optimizer) -> TrainingState:
    """The run's state in checkpoint layout, for ``save_checkpoint(..., training=state)``: the config, Adam's step
    count and moments (mixed precision: the float32 masters'), and float16's loss scale and its good steps."""
    adam, scale = optimizer.adam, optimizer.loss_scale
    copy = lambda moments: {name: np.array(moments[name]) for name in model.params}
    return TrainingState(optimizer.config, adam.step, copy(adam.first_moments), copy(adam.second_moments),
                         None if scale is None else LossScaleState(scale.value, scale.good_steps))
