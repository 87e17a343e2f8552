"""The label-smoothed cross-entropy of section 5.4 against a computation by hand, in every backend.

The convention (``reference_numpy/training.py``, docs/torch.md): the target distribution of a
real position with label y is q(k) = (1 - epsilon) [k = y] + epsilon / V over **all** V classes
(the pad class included); positions whose label is pad_id are ignored; the loss is the sum of
-sum_k q(k) log p(k) over real positions divided by their number n. Its gradient with respect
to the logits z (p = softmax(z)) is (p - q) / n at real positions and 0 at pad positions.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from support import FRAMEWORKS, float64_inference, port_backend

from equivalence.cases import VARIANTS, seeded_params, training_inputs
from equivalence.tolerance import assert_agrees, finite_difference_bound
from reference_numpy import Transformer
from reference_numpy.training import label_smoothed_cross_entropy, loss

EPS, V, PAD = 0.1, 4, 0
# Next-token distributions (B=2, T=3, V=4); each row sums to 1. Labels: two pad positions
# (whose distributions would add a large loss if they were counted).
PROBS = np.array([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]],
                  [[0.05, 0.05, 0.6, 0.3], [0.4, 0.3, 0.2, 0.1], [0.01, 0.01, 0.01, 0.97]]])
LABELS = np.array([[2, 3, 0], [3, 1, 0]])
# The logits: log PROBS shifted by a different constant per position (softmax ignores it).
LOGITS = np.log(PROBS) + np.array([[0.0, 3.0, -2.0], [1.5, -0.5, 7.0]])[..., None]

# By hand: the label receives 1 - 0.1 + 0.1/4 = 0.925, every class (the label too) 0.1/4 = 0.025;
# four real positions.
HAND = (-(0.9 * math.log(0.3) + 0.025 * (math.log(0.1) + math.log(0.2) + math.log(0.3) + math.log(0.4)))
        - (0.9 * math.log(0.25) + 0.025 * 4 * math.log(0.25))
        - (0.9 * math.log(0.3) + 0.025 * (math.log(0.05) + math.log(0.05) + math.log(0.6) + math.log(0.3)))
        - (0.9 * math.log(0.3) + 0.025 * (math.log(0.4) + math.log(0.3) + math.log(0.2) + math.log(0.1)))) / 4
# The smoothed targets q, written out; pad positions have none (their gradient is 0).
Q = np.array([[[0.025, 0.025, 0.925, 0.025], [0.025, 0.025, 0.025, 0.925], [0, 0, 0, 0]],
              [[0.025, 0.025, 0.025, 0.925], [0.025, 0.925, 0.025, 0.025], [0, 0, 0, 0]]])
REAL = np.array([[1, 1, 0], [1, 1, 0]])[..., None]
CLOSED_FORM_GRADIENT = (PROBS - Q) * REAL / 4


def log_softmax(z):
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_the_hand_computation_is_what_it_claims():
    """The test's own numbers: distributions sum to 1, q sums to 1 at real positions, and the
    hand value is the sum of -q log p over real positions over their number."""
    np.testing.assert_allclose(PROBS.sum(axis=-1), 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(Q.sum(axis=-1), REAL[..., 0], rtol=0, atol=1e-15)
    assert math.isclose(HAND, -(Q * np.log(PROBS)).sum() / 4, rel_tol=1e-14)


def test_reference_loss_equals_the_hand_computation():
    assert_agrees(label_smoothed_cross_entropy(np.log(PROBS), LABELS, PAD, EPS), HAND, what="reference loss")
    assert_agrees(label_smoothed_cross_entropy(log_softmax(LOGITS), LABELS, PAD, EPS), HAND,
                  what="reference loss from logits")


def test_reference_loss_gradient_matches_the_closed_form():
    """<(p - q)/n, d> against the Richardson-extrapolated central difference of the reference's
    loss of log_softmax(z) along random unit directions d, within tolerance.finite_difference_bound."""
    value = lambda z: float(label_smoothed_cross_entropy(log_softmax(z), LABELS, PAD, EPS))
    rng, step = np.random.default_rng(5), 1e-3
    for _ in range(3):
        d = rng.standard_normal(LOGITS.shape)
        d /= np.linalg.norm(d)
        central = lambda h: (value(LOGITS + h * d) - value(LOGITS - h * d)) / (2 * h)
        fd_h, fd_half = central(step), central(step / 2)
        bound = finite_difference_bound(fd_h, fd_half, HAND, step)
        assert abs(float((CLOSED_FORM_GRADIENT * d).sum()) - (4 * fd_half - fd_h) / 3) <= bound


def test_reference_model_loss_is_the_smoothed_cross_entropy_of_its_log_probs():
    """``training.loss`` wires the model's log-probabilities to the labels: a loop over positions
    with the convention above, on a ragged batch (pad labels included)."""
    config = VARIANTS["tiny"]
    model, batch = Transformer(config, seeded_params(config)), training_inputs(config)
    log_probs = model(batch["src"], batch["tgt"])
    terms = [-sum(((1 - EPS) * (k == label) + EPS / config.tgt_vocab_size) * log_probs[b, t, k]
                  for k in range(config.tgt_vocab_size))
             for (b, t), label in np.ndenumerate(batch["labels"]) if label != config.pad_id]
    assert_agrees(loss(model, **batch), math.fsum(terms) / len(terms), what="reference model loss")


def port_loss_and_logit_gradient(port: str, logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """The port's ``training.label_smoothed_cross_entropy`` of its framework's log_softmax of
    ``logits``, and its gradient with respect to the logits by the port's autodiff (float64)."""
    port_backend(port)                               # a skip with its reason if missing
    training = importlib.import_module(f"transformer_{port}.training")
    if port == "torch":
        import torch
        z = torch.tensor(logits, requires_grad=True)
        value = training.label_smoothed_cross_entropy(torch.log_softmax(z, dim=-1), torch.tensor(labels), PAD, EPS)
        value.backward()
        return value.item(), z.grad.numpy()
    if port == "jax":
        import jax
        with float64_inference(port):
            value, grad = jax.value_and_grad(
                lambda z: training.label_smoothed_cross_entropy(jax.nn.log_softmax(z), labels, PAD, EPS))(logits)
        return float(value), np.asarray(grad)
    import tensorflow as tf
    z = tf.Variable(logits)
    with tf.GradientTape() as tape:
        value = training.label_smoothed_cross_entropy(tf.nn.log_softmax(z), tf.constant(labels), PAD, EPS)
    return float(value), tape.gradient(value, z).numpy()


@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_port_loss_and_logit_gradient_equal_the_hand_computation(port):
    value, grad = port_loss_and_logit_gradient(port, LOGITS, LABELS)
    assert_agrees(np.float64(value), HAND, what=f"{port} loss")
    assert grad.dtype == np.float64
    assert_agrees(grad, CLOSED_FORM_GRADIENT, what=f"{port} d loss / d logits")
