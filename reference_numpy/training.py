"""The training objective of section 5.4: cross-entropy with label smoothing (epsilon_ls = 0.1).

The reference defines the loss; the ports differentiate it (autograd, ``jax.grad``,
``tf.GradientTape``) and are checked against each other and against central finite differences
of this function.
"""

from __future__ import annotations

import numpy as np

from .model import Transformer

LABEL_SMOOTHING = 0.1  # section 5.4


def label_smoothed_cross_entropy(log_probs: np.ndarray, labels: np.ndarray, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING) -> np.ndarray:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1" (Szegedy et al., 2016);
    the smoothing mass is spread uniformly over all V classes.

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    labels = np.asarray(labels)
    real = labels != pad_id                                                 # (B, T)
    if not real.any():
        raise ValueError("labels hold no non-pad token; the loss is undefined")
    picked = np.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]  # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(axis=-1)
    return (per_token * real).sum() / real.sum()


def loss(model: Transformer, src: np.ndarray, tgt: np.ndarray, labels: np.ndarray,
         epsilon: float = LABEL_SMOOTHING) -> np.ndarray:
    """The training loss of one batch (dropout off: the reference computes inference).

    Shape: src (B, S), tgt (B, T) the shifted-right input, labels (B, T) the next tokens -> scalar.
    """
    return label_smoothed_cross_entropy(model(src, tgt), labels, model.config.pad_id, epsilon)
