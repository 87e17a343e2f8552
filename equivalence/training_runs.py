"""Training runs compared under the float64 policy (section 5): the reference's run with its
:class:`~equivalence.tolerance.TrainingBound`, and the check of another run -- a port's, a data-parallel one --
against it, loss by loss, weight by weight, moment by moment."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from reference_numpy import training as reference
from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.model import Transformer
from reference_numpy.training import learning_rate

from .tolerance import TrainingBound, rounding_sensitivity


@dataclass
class Run:
    """A run's losses (one per step, before each update), final weights (checkpoint layout) and state."""

    losses: list[float]
    params: dict[str, np.ndarray]
    state: TrainingState


def reference_run(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig,
                  batches: Iterable[dict[str, np.ndarray]], conditioned: bool = False) -> tuple[Run, TrainingBound]:
    """The float64 reference trained from ``params`` with a new optimizer, one step per batch, and the bound of
    every quantity of another run of the same steps: each step accounted for by :class:`TrainingBound` (the
    gradient at the weights before the step, the moments after it); with ``conditioned``, each step's gradient bound
    takes the gradient's sensitivity to the weights' rounding into account (:func:`~.tolerance.gradient_bound`)."""
    model = Transformer(config, params)
    optimizer = reference.optimizer(model, training)
    bound, losses = TrainingBound(weights_of(model)), []
    for step, inputs in enumerate(batches, start=1):
        batch = inputs["src"], inputs["tgt"], inputs["labels"]
        value, grads = reference.gradients(model, *batch)
        sensitivity = rounding_sensitivity(
            lambda weights: reference.gradients(Transformer(config, weights), *batch)[1],
            weights_of(model)) if conditioned else 0.0
        losses.append(float(reference.train_step(model, optimizer, *batch)))
        state = reference.training_state(model, optimizer)
        bound.step(float(value), grads, state.first_moments, state.second_moments, step,
                   learning_rate(step, config.d_model, training), training.beta1, training.beta2, training.epsilon,
                   sensitivity)
    return Run(losses, weights_of(model), reference.training_state(model, optimizer)), bound


def weights_of(model: Transformer) -> dict[str, np.ndarray]:
    """A copy of the reference model's weights (checkpoint layout): what a training step leaves untouched."""
    return {name: np.array(value) for name, value in model.params.items()}


def assert_float64_run(result: Run, expected: Run, bound: TrainingBound, who: str) -> None:
    """``result`` within ``bound`` of the reference's run ``expected``: every loss, weight and moment; an
    ``AssertionError`` naming the quantity, the tensor and the entry otherwise."""
    for step, (loss, reference_loss, most) in enumerate(zip(result.losses, expected.losses, bound.losses), 1):
        assert abs(loss - reference_loss) <= most, f"{who}: loss at step {step}: {loss} vs {reference_loss}"
    assert len(result.losses) == len(expected.losses) and result.state.step == expected.state.step, who
    errors: dict[str, tuple[np.ndarray, np.ndarray | float]]            # quantity -> (error, its bound)
    for name, value in expected.params.items():
        errors = {"weights": (np.abs(result.params[name] - value), bound.weight_bound(name, value)),
                  "first moment": (np.abs(result.state.first_moments[name] - expected.state.first_moments[name]),
                                   bound.first_moment_bound(expected.state.first_moments[name])),
                  "second moment": (np.abs(result.state.second_moments[name] - expected.state.second_moments[name]),
                                    bound.second_moment_bound(name, expected.state.second_moments[name]))}
        for what, (error, limit) in errors.items():
            limits = np.broadcast_to(limit, error.shape)
            worst = np.unravel_index(np.argmax(error - limits), error.shape)
            assert np.all(error <= limits), (f"{who}: {what} of {name!r} at {worst}: "
                                             f"error {error[worst]:.3e} > bound {limits[worst]:.3e}")
