"""The training objective of section 5.4: cross-entropy with label smoothing (epsilon_ls = 0.1),
and its gradients by ``nnx.value_and_grad``. The parallel text of ``reference_numpy/training.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_numpy.training import LABEL_SMOOTHING

from . import checkpoint
from .model import Transformer


def label_smoothed_cross_entropy(log_probs: jax.Array, labels: jax.Array, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING) -> jax.Array:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes. (Traced: an all-pad batch gives NaN, not an error.)

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    labels = jnp.asarray(labels)
    real = labels != pad_id                                                 # (B, T)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(axis=-1)
    return (per_token * real).sum() / real.sum()


def loss(model: Transformer, src: jax.Array, tgt: jax.Array, labels: jax.Array,
         epsilon: float = LABEL_SMOOTHING, *, deterministic: bool | None = None) -> jax.Array:
    """The training loss of one batch; differentiate it with ``nnx.grad`` / ``nnx.value_and_grad``.

    Shape: src (B, S), tgt (B, T) the shifted-right input, labels (B, T) the next tokens -> scalar.
    """
    return label_smoothed_cross_entropy(model(src, tgt, deterministic=deterministic), labels,
                                        model.config.pad_id, epsilon)


def gradients(model: Transformer, src, tgt, labels,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off and its gradient for every checkpoint tensor, in checkpoint
    layout (tied weights receive the sum over their uses)."""
    if not np.any(np.asarray(labels) != model.config.pad_id):
        raise ValueError("labels hold no non-pad token; the loss is undefined")
    src, tgt = model._check_inputs(src, tgt, None, None)                    # ids cannot be checked once traced
    value, grads = _value_and_grad(model, src, tgt, labels, epsilon)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return float(value), checkpoint.to_params(nnx.merge(graphdef, grads, rest))


@nnx.jit(static_argnames="epsilon")
def _value_and_grad(model: Transformer, src, tgt, labels, epsilon):
    """Compiled loss and its gradient with respect to every ``nnx.Param`` (an ``nnx.State``)."""
    return nnx.value_and_grad(lambda m: loss(m, src, tgt, labels, epsilon, deterministic=True))(model)
