"""The training objective of section 5.4: cross-entropy with label smoothing (epsilon_ls = 0.1),
and its gradients by ``tf.GradientTape``. The parallel text of ``reference_numpy/training.py``."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from reference_numpy.training import LABEL_SMOOTHING

from . import checkpoint
from . import device as _device
from .model import Transformer


def label_smoothed_cross_entropy(log_probs: tf.Tensor, labels: tf.Tensor, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING) -> tf.Tensor:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes.

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    labels = tf.convert_to_tensor(labels)
    real = tf.cast(labels != pad_id, log_probs.dtype)                       # (B, T)
    if not tf.reduce_any(real > 0):
        raise ValueError("labels hold no non-pad token; the loss is undefined")
    picked = tf.gather(log_probs, labels, batch_dims=2)                     # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * tf.reduce_mean(log_probs, axis=-1)
    return tf.reduce_sum(per_token * real) / tf.reduce_sum(real)


def loss(model: Transformer, src, tgt, labels, epsilon: float = LABEL_SMOOTHING, training: bool = False) -> tf.Tensor:
    """The training loss of one batch. Shape: src (B, S), tgt and labels (B, T) -> scalar."""
    return label_smoothed_cross_entropy(model(src, tgt, training=training), labels, model.config.pad_id, epsilon)


def gradients(model: Transformer, src, tgt, labels,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off and its gradient for every checkpoint tensor, in checkpoint
    layout (tied weights receive the sum over their uses)."""
    variables = checkpoint._variables(model)
    flipped = checkpoint.transposed(model.config)
    with tf.device(_device.model_device(model)), tf.GradientTape() as tape:
        value = loss(model, src, tgt, labels, epsilon)
    grads = [tf.convert_to_tensor(grad).numpy() for grad in tape.gradient(value, list(variables.values()))]
    return float(value), {name: grad.T if name in flipped else grad for name, grad in zip(variables, grads)}
