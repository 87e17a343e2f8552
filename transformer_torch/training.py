"""Training, section 5: the label-smoothed loss (5.4) and its gradients by autograd, Adam and the
learning-rate schedule of section 5.3 as torch's own ``torch.optim.Adam`` and
``torch.optim.lr_scheduler.LambdaLR``, one training step with dropout, and the run's state for a
checkpoint. The parallel text of ``reference_numpy/training.py``.

``torch.optim.Adam`` computes the paper's update (Kingma & Ba, Algorithm 1) as it stands: its step
count starts at 0 and is incremented before use (the first update is t = 1), m and v are not
bias-corrected in its state, and epsilon is added after the bias correction,
``param -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``. It is built with
``foreach=False``: the per-tensor loop, one arithmetic on every device (torch picks it on the CPU
anyway; the multi-tensor kernels it picks on a GPU order some operations differently). The learning
rate is a Python float (float64) that ``LambdaLR`` sets as ``1.0 * lambda(count)``: the base rate is 1
and the lambda is Eq. (3) at count + 1, since the scheduler's count is 0 at construction and one
more after each step.

**Mixed precision** (``optimizer(model, dtype="bfloat16"|"float16")``, ``docs/training.md``): a float32 model's
weights are the master copy and Adam's moments are float32; each step runs autograd through a second model in the
low precision P (the masters rounded to P, the recipe of ``reference_numpy/precision.py``), whose P gradients,
widened to float32, become the masters' ``grad``. float16 scales the loss with ``torch.amp.GradScaler``; bfloat16
does not. :func:`gradients` of a P model are P tensors by the same autograd (its loss float32); a P *model* is not
trained: :func:`optimizer` and :func:`train_step` refuse it with the reference's ``check_trainable`` error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy import precision
from reference_numpy.checkpoint import LossScaleState, TrainingState
from reference_numpy.config import TrainingConfig
from reference_numpy.precision import check_trainable, is_low, parse_dtype, training_dtype, uses_loss_scaling
from reference_numpy.training import (
    LABEL_SMOOTHING,
    PAPER,
    check_batch,
    check_next_step,
    check_token_count,
    learning_rate,
    resumed_loss_scale,
)

from . import checkpoint
from .model import Transformer
from .precision import dtype_name

Batch = Tensor | npt.ArrayLike   # token ids (src, tgt, labels): a tensor, or anything NumPy reads


def label_smoothed_cross_entropy(log_probs: Tensor, labels: Tensor, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING, tokens: int | None = None) -> Tensor:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes. ``tokens`` divides the sum by that many labels instead of this
    batch's non-pad count: a shard of a larger batch divides by the whole batch's count, so that the shards'
    losses add up to the whole batch's (data parallelism, ``data_parallel.py``). The count is checked on the
    host (``check_token_count``, the reference's ``ValueError``).

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    real = labels != pad_id                                                 # (B, T)
    count = check_token_count(int(real.sum()), tokens)
    picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)        # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(dim=-1)
    return (per_token * real).sum() / count


def loss(model: Transformer, src: Batch, tgt: Batch, labels: Batch, epsilon: float = LABEL_SMOOTHING,
         tokens: int | None = None) -> Tensor:
    """The training loss of one batch; ``tokens`` as in :func:`label_smoothed_cross_entropy`. The batch is checked
    first by the reference's ``check_batch`` (labels read on the host).
    Shape: src (B, S), tgt and labels (B, T) -> scalar."""
    src, tgt, checked = check_batch(model, src, tgt, labels.cpu() if isinstance(labels, Tensor) else labels)
    index = torch.as_tensor(checked, device=model.device, dtype=torch.long)   # gather's index: int64
    return label_smoothed_cross_entropy(model(src, tgt), index, model.config.pad_id, epsilon, tokens)


def gradients(model: Transformer, src: Batch, tgt: Batch, labels: Batch,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off (eval mode) and its gradient for every checkpoint tensor, in
    checkpoint layout (tied weights receive the sum over their uses); a bfloat16 or float16 model's
    gradients are P, by autograd through its recipe (its loss float32)."""
    model.eval().zero_grad(set_to_none=True)
    value = loss(model, src, tgt, labels, epsilon)
    value.backward()
    grads = {path: parameter.grad for path, parameter in model.named_parameters()}
    return value.item(), checkpoint.to_checkpoint_layout(model, grads)  # type: ignore[arg-type]  # backward() set all


def learning_rate_schedule(d_model: int, config: TrainingConfig) -> _Schedule:
    """Eq. (3) of section 5.3 as ``LambdaLR``'s multiplier of a base learning rate of 1: ``count ->
    learning_rate(count + 1, d_model, config)``. ``LambdaLR`` counts from 0 at construction and adds one
    after each optimizer step, so the update numbered t (from 1) uses lrate(t)."""
    return _Schedule(d_model, config)


@dataclass(frozen=True)
class _Schedule:
    """A callable object rather than a lambda: ``LambdaLR.state_dict`` keeps its fields."""

    d_model: int
    config: TrainingConfig

    def __call__(self, count: int) -> float:
        return learning_rate(count + 1, self.d_model, self.config)


@dataclass
class Optimizer:
    """The optimizer of section 5.3 as one record, the same fields in every backend (the reference's
    ``Optimizer``): ``adam`` (``torch.optim.Adam``, base learning rate 1) steps the model's weights, ``schedule``
    (``LambdaLR`` of :func:`learning_rate_schedule`) sets its learning rate, ``config`` the run's settings; in mixed
    precision ``low`` is the model in P each step differentiates (the float32 masters rounded to P; None: the model
    itself) and ``loss_scale`` float16's ``torch.amp.GradScaler`` (None for any other precision)."""

    adam: torch.optim.Adam
    schedule: LambdaLR
    config: TrainingConfig
    low: Transformer | None = None
    loss_scale: torch.amp.GradScaler | None = None


def optimizer(model: Transformer, config: TrainingConfig | None = None, state: TrainingState | None = None,
              dtype: npt.DTypeLike | None = None) -> Optimizer:
    """The optimizer of section 5.3 for ``model``: a ``torch.optim.Adam`` (beta1, beta2, epsilon of
    ``config``; base learning rate 1) driven by a ``LambdaLR`` of :func:`learning_rate_schedule` (torch's pair,
    stepped together by :func:`train_step`), in an :class:`Optimizer`. Tied weights are one parameter with one pair
    of moments.

    With ``state`` (from ``load_training_state``) the saved run continues where it stopped: its moments
    (cast to the model's dtype, checked by ``validate_training_state``), step count and, unless
    ``config`` is given, its training config, restored by ``optimizer.load_state_dict`` and
    ``scheduler.load_state_dict``: the next step is t + 1 with lrate(t + 1). Moments in memory torch allocated
    (:func:`.checkpoint.load_training_state`'s) become Adam's own without a copy, and change as it steps; any other
    state is copied.

    ``dtype`` bfloat16 or float16 (a float32 model only; the reference's ``training_dtype`` errors otherwise) adds
    the model in P over the float32 masters and, for float16, a ``GradScaler`` with the reference's
    ``LOSS_SCALE_GROWTH_INTERVAL`` and the saved run's scale (else ``LOSS_SCALE``). Built under
    ``torch.autocast(device_type, dtype)`` (a float32 model, no ``dtype``), each step differentiates the model itself
    under autocast (run :func:`train_step` under the same block: torch's automatic mixed precision), float16's loss
    scaled by the ``GradScaler``: ``low`` is the model.
    """
    dtype = training_dtype(dtype_name(model.dtype), dtype)
    if state is not None:
        stored = parse_dtype(dtype_name(model.dtype))
        state = state.astype(stored)
        reference_checkpoint.validate_training_state(model.config,
                                                     reference_checkpoint.parameter_stand_ins(model.config, stored),
                                                     state)
    config = config or (state.config if state is not None else PAPER)
    adam = torch.optim.Adam(model.parameters(), lr=1.0, betas=(config.beta1, config.beta2), eps=config.epsilon,
                            foreach=False)
    schedule = LambdaLR(adam, learning_rate_schedule(model.config.d_model, config))
    _restore(model, schedule, state)
    low = None
    if is_low(dtype):
        low = checkpoint.from_params(model.config, checkpoint.to_params(model), dtype, model.device)
    elif torch.is_autocast_enabled(model.device.type) and dtype == np.float32:
        low, dtype = model, parse_dtype(dtype_name(torch.get_autocast_dtype(model.device.type)))   # autocast
    return Optimizer(adam, schedule, config, low,
                     _loss_scale(model.device, state) if uses_loss_scaling(dtype) else None)


def _loss_scale(device: torch.device, state: TrainingState | None) -> torch.amp.GradScaler:
    """float16's dynamic loss scaling: x 1/2 and the step skipped on a non-finite gradient, x 2 after
    ``LOSS_SCALE_GROWTH_INTERVAL`` finite steps in a row (the reference's constant, read now), from the scale and
    good steps of the reference's ``resumed_loss_scale`` (``GradScaler``'s ``scale`` and ``_growth_tracker``)."""
    scale, good_steps = resumed_loss_scale(state)
    scaler = torch.amp.GradScaler(device.type, init_scale=scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=precision.LOSS_SCALE_GROWTH_INTERVAL)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": good_steps})
    return scaler


def _restore(model: Transformer, schedule: LambdaLR, state: TrainingState | None) -> None:
    """Adam's moments and step count (torch's ``exp_avg``, ``exp_avg_sq``, ``step``) and the schedule's
    count and learning rate from a validated ``state`` (a new run: zeros and 0), through torch's own
    ``load_state_dict``s. The step count is an int64 tensor: torch's own is float32, which counts exactly only to
    2**24 (a run resumed past it lost steps), and every backend counts in int64 (``MAX_STEP``)."""
    adam, step = schedule.optimizer, 0 if state is None else state.step
    first, second = ({path: torch.zeros_like(parameter) for path, parameter in model.named_parameters()}
                     for _ in range(2)) if state is None else (
        checkpoint._torch_layout(model, moments, model.dtype, model.device, owned=_torch_memory(moments))
        for moments in (state.first_moments, state.second_moments))
    rate = schedule.lr_lambdas[0](step)                                     # base rate 1: lrate(t + 1)
    saved = adam.state_dict()                                               # parameters numbered in model order
    saved["state"] = {index: {"step": torch.tensor(step, dtype=torch.int64), "exp_avg": first[path],
                              "exp_avg_sq": second[path]}
                      for index, (path, _) in enumerate(model.named_parameters())}
    saved["param_groups"] = [{**group, "lr": rate} for group in saved["param_groups"]]
    adam.load_state_dict(saved)
    schedule.load_state_dict({**schedule.state_dict(), "last_epoch": step, "_last_lr": [rate]})


def _torch_memory(arrays: dict[str, np.ndarray]) -> bool:
    """Whether every array is a view of a torch tensor (:func:`.checkpoint.load_training_state` reads the moments
    into tensors torch allocated), which Adam may take as its state as it is."""
    def owner(value: object) -> object:
        while isinstance(value, np.ndarray):
            value = value.base
        return value

    return all(isinstance(owner(value), torch.Tensor) for value in arrays.values())


def train_step(model: Transformer, optimizer: Optimizer, src: Batch, tgt: Batch, labels: Batch,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One training step of section 5: the loss with dropout on (train mode, P_drop = ``config.dropout``),
    its gradient by autograd, Adam's update t with lrate(t), then the schedule advanced. The model is
    left in eval mode. Returns the loss before the update. In mixed precision the loss and gradients are the
    P model's (:func:`_mixed_precision_step`). The batch (the reference's ``check_batch``, in :func:`loss`) and the
    step count (``check_next_step``) are checked before any work."""
    check_trainable(dtype_name(model.dtype))
    check_batch(model, src, tgt, labels.cpu() if isinstance(labels, Tensor) else labels)
    check_next_step(optimizer.schedule.last_epoch)
    if optimizer.low is not None:
        return _mixed_precision_step(model, optimizer, src, tgt, labels, epsilon)
    optimizer.adam.zero_grad(set_to_none=True)
    value = _backward(model, src, tgt, labels, epsilon)
    optimizer.adam.step()
    optimizer.schedule.step()
    return value.item()


def _backward(model: Transformer, src: Batch, tgt: Batch, labels: Batch, epsilon: float,
              scaler: torch.amp.GradScaler | None = None) -> Tensor:
    """The loss in train mode, back-propagated (from the loss times ``scaler``'s scale); the model left in eval
    mode."""
    model.train()
    try:
        value = loss(model, src, tgt, labels, epsilon)
        (value if scaler is None else scaler.scale(value)).backward()
    finally:
        model.eval()
    return value


def _mixed_precision_step(model: Transformer, mixed: Optimizer, src: Batch, tgt: Batch, labels: Batch,
                          epsilon: float) -> float:
    """The P model's loss and, by autograd through the recipe, the P gradient of the loss times the scale
    (float16), widened to float32 as the masters' ``grad``; ``GradScaler.step`` divides them by the scale and steps
    Adam unless one is not finite (bfloat16: checked here). A step taken advances the schedule and rounds the new
    masters to P into the P model; a skipped one changes nothing but the scale (halved by ``update``), so Adam's
    t and the schedule stay together."""
    low, scaler = mixed.low, mixed.loss_scale
    assert low is not None                                                  # train_step's condition for this step
    low.zero_grad(set_to_none=True)
    value = _backward(low, src, tgt, labels, epsilon, scaler)
    pairs = list(zip(model.parameters(), low.parameters()))                 # the same Transformer(config) twice
    for master, parameter in pairs:
        master.grad = _grad(parameter).float()                              # P -> float32, exactly (autocast: itself)
    if scaler is None:
        taken = all(bool(_grad(master).isfinite().all()) for master, _ in pairs)
        if taken:
            mixed.adam.step()
    else:
        scale = scaler.get_scale()
        scaler.step(mixed.adam)                                             # unscale_, then Adam's step if finite
        scaler.update()
        taken = scaler.get_scale() >= scale                                 # a skipped step halved the scale
    if taken:
        mixed.schedule.step()
        with torch.no_grad():
            for master, parameter in pairs:
                if parameter is not master:                                 # autocast: the model itself
                    parameter.copy_(master)                                 # float32 -> P, rounded once
    return value.item()


def _grad(parameter: Tensor) -> Tensor:
    """A parameter's gradient, which the backward pass just gave it (every parameter has one)."""
    assert parameter.grad is not None
    return parameter.grad


def training_state(model: Transformer, optimizer: Optimizer) -> TrainingState:
    """The run's state for ``save_checkpoint(..., training=state)``: Adam's m_t and v_t (``exp_avg`` and
    ``exp_avg_sq``, not bias-corrected) in checkpoint layout (NumPy, the model's dtype) and t (mixed precision:
    the float32 Adam's, and float16's loss scale from ``GradScaler.state_dict``)."""
    scaler, parameters = optimizer.loss_scale, dict(model.named_parameters())
    slots = {path: optimizer.adam.state.get(parameter, {}) for path, parameter in parameters.items()}
    steps = {int(slot["step"]) if slot else 0 for slot in slots.values()} | {optimizer.schedule.last_epoch}
    if len(steps) != 1:
        raise ValueError(f"the Adam step counts and the schedule's count differ ({sorted(steps)}); "
                         "step them together (train_step)")
    moments = lambda key: checkpoint.to_checkpoint_layout(
        model, {path: slot.get(key, torch.zeros_like(parameters[path])) for path, slot in slots.items()})
    saved = None if scaler is None else scaler.state_dict()
    return TrainingState(optimizer.config, steps.pop(), moments("exp_avg"), moments("exp_avg_sq"),
                         None if saved is None else LossScaleState(saved["scale"], saved["_growth_tracker"]))
