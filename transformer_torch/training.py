"""The training objective of section 5.4: cross-entropy with label smoothing (epsilon_ls = 0.1),
and its gradients by autograd. The parallel text of ``reference_numpy/training.py``."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from reference_numpy.training import LABEL_SMOOTHING

from . import checkpoint
from .model import Transformer


def label_smoothed_cross_entropy(log_probs: Tensor, labels: Tensor, pad_id: int,
                                 epsilon: float = LABEL_SMOOTHING) -> Tensor:
    """Mean over non-pad labels of -sum_k q(k) log p(k), with q = (1 - epsilon) one_hot(label) + epsilon / V.

    Section 5.4: "we employed label smoothing of value epsilon_ls = 0.1"; the smoothing mass is
    spread uniformly over all V classes.

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    real = labels != pad_id                                                 # (B, T)
    if not bool(real.any()):
        raise ValueError("labels hold no non-pad token; the loss is undefined")
    picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)        # (B, T)
    per_token = -(1.0 - epsilon) * picked - epsilon * log_probs.mean(dim=-1)
    return (per_token * real).sum() / real.sum()


def loss(model: Transformer, src: Tensor, tgt: Tensor, labels: Tensor, epsilon: float = LABEL_SMOOTHING) -> Tensor:
    """The training loss of one batch. Shape: src (B, S), tgt and labels (B, T) -> scalar."""
    return label_smoothed_cross_entropy(model(src, tgt), labels, model.config.pad_id, epsilon)


def gradients(model: Transformer, src, tgt, labels,
              epsilon: float = LABEL_SMOOTHING) -> tuple[float, dict[str, np.ndarray]]:
    """The loss with dropout off (eval mode) and its gradient for every checkpoint tensor, in
    checkpoint layout (tied weights receive the sum over their uses)."""
    model.eval().zero_grad(set_to_none=True)
    as_tokens = lambda values: torch.as_tensor(np.asarray(values), device=model.device)
    value = loss(model, as_tokens(src), as_tokens(tgt), as_tokens(labels), epsilon)
    value.backward()
    return value.item(), checkpoint._checkpoint_layout(model, {path: parameter.grad
                                                               for path, parameter in model.named_parameters()})
