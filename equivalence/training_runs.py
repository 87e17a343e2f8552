"""Training runs compared under the float64 policy (section 5): the reference's run with its
:class:`~equivalence.tolerance.TrainingBound`, and the check of another run -- a port's, a data-parallel one --
against it, loss by loss, weight by weight, moment by moment."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from reference_numpy import training as reference
from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.model import Transformer
from reference_numpy.precision import autocast
from reference_numpy.training import learning_rate

from .tolerance import TrainingBound, assert_agrees, random_roundings, recipe_gradient_bound


@dataclass
class Run:
    """A run's losses (one per step, before each update), final weights (checkpoint layout) and state."""

    losses: list[float]
    params: dict[str, np.ndarray]
    state: TrainingState


def reference_run(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig,
                  batches: Iterable[dict[str, np.ndarray]], sensitivities: Sequence[float] = (),
                  recipe: list[list[dict[str, np.ndarray]]] | None = None) -> tuple[Run, TrainingBound]:
    """The float64 reference trained from ``params`` with a new optimizer, one step per batch, and the bound of
    every quantity of another run of the same steps: each step accounted for by :class:`TrainingBound` (the
    gradient at the weights before the step, the moments after it); ``sensitivities``, one per step (the reference's
    :func:`~.tolerance.rounding_sensitivity` at the weights before it), make each step's gradient bound take it into
    account (:func:`~.tolerance.gradient_bound`; none given: every step well-conditioned).
    With ``recipe`` (:func:`recipe_gradients`: runs of the same steps in a mixed precision) the bound is that of a
    mixed-precision run, float32 masters: each step's gradient bound is :func:`~.tolerance.recipe_gradient_bound`."""
    model = Transformer(config, params)
    optimizer = reference.optimizer(model, training)
    bound = TrainingBound(weights_of(model), np.float64 if recipe is None else np.float32)
    losses: list[float] = []
    for step, inputs in enumerate(batches, start=1):
        batch = inputs["src"], inputs["tgt"], inputs["labels"]
        value, grads = reference.gradients(model, *batch)
        sensitivity = sensitivities[step - 1] if sensitivities else 0.0
        losses.append(float(reference.train_step(model, optimizer, *batch)))
        state = reference.training_state(model, optimizer)
        deltas = None if recipe is None else recipe_gradient_bound(grads, [run[step - 1] for run in recipe])
        bound.step(float(value), grads, state.first_moments, state.second_moments, step,
                   learning_rate(step, config.d_model, training), training.beta1, training.beta2, training.epsilon,
                   sensitivity, deltas)
    return Run(losses, weights_of(model), reference.training_state(model, optimizer)), bound


def recipe_gradients(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig,
                     batches: list[dict[str, np.ndarray]], dtype: str, draws: int) -> list[list[dict[str, np.ndarray]]]:
    """The reference's run from ``params`` (a float32 model, one step per batch) under the autocast recipe in
    ``dtype`` (bfloat16, float16: its loss scaled), and ``draws`` more runs with every rounding to P a random one
    (:func:`~.tolerance.random_roundings`, seeds 0, 1, ...): each run's gradient at each step, as Adam receives it
    (float32, divided by the loss scale). A run that skips a step (float16 overflowing) is a ValueError: it has no
    gradient to compare there."""
    def run(roundings: AbstractContextManager) -> list[dict[str, np.ndarray]]:
        model = Transformer(config, {name: np.array(value, dtype=np.float32) for name, value in params.items()},
                            np.float32)
        seen: list[dict[str, np.ndarray]] = []
        with roundings, autocast(dtype):
            optimizer = reference.optimizer(model, training)
            recorded = functools.partial(_recorded, optimizer.adam.update, seen)        # Adam's own, gradients kept
            optimizer.adam.update = recorded                                          # type: ignore[method-assign]
            for inputs in batches:
                reference.train_step(model, optimizer, inputs["src"], inputs["tgt"], inputs["labels"])
        if len(seen) != len(batches):
            raise ValueError(f"a {dtype} run of the reference skipped {len(batches) - len(seen)} of its steps")
        return seen

    return [run(nullcontext())] + [run(random_roundings(np.random.default_rng(seed))) for seed in range(draws)]


def _recorded(update: Callable[[dict[str, np.ndarray]], None], seen: list[dict[str, np.ndarray]],
              grads: dict[str, np.ndarray]) -> None:
    """Adam's ``update`` with ``grads``, a copy of them kept in ``seen``."""
    seen.append({name: np.array(grad) for name, grad in grads.items()})
    update(grads)


def weights_of(model: Transformer) -> dict[str, np.ndarray]:
    """A copy of the reference model's weights (checkpoint layout): what a training step leaves untouched."""
    return {name: np.array(value) for name, value in model.params.items()}


def assert_float64_run(result: Run, expected: Run, bound: TrainingBound, who: str) -> float:
    """``result`` within ``bound`` of the reference's run ``expected``: every loss, weight and moment; an
    ``AssertionError`` naming the quantity, the tensor and the entry otherwise. Returns the largest error / bound."""
    worst = 0.0
    for step, (loss, reference_loss, most) in enumerate(zip(result.losses, expected.losses, bound.losses), 1):
        assert abs(loss - reference_loss) <= most, f"{who}: loss at step {step}: {loss} vs {reference_loss}"
        worst = max(worst, abs(loss - reference_loss) / most)
    return max(worst, assert_weights_and_moments(result, expected, bound, who))


def assert_precision_run(result: Run, ref64: Run, same: Run, start: dict[str, np.ndarray], precision: str,
                         who: str) -> float:
    """``result`` (a float32 model's run from the float64 weights ``start``, computing in ``precision``: float32, or
    bfloat16 or float16 in mixed precision) within the policy for ``precision`` of the float64 reference's run
    ``ref64``, the reference's own run in that precision (``same``) the yardstick: each step's loss, each tensor's
    update (weights after minus weights before, exact in float64) and both Adam moments. An ``AssertionError``
    naming the quantity otherwise; returns the largest error / bound."""
    results = [assert_agrees(np.float32(value), v64, v_same, what=f"{who}: loss at step {step}", precision=precision)
               for step, (value, v_same, v64) in enumerate(zip(result.losses, same.losses, ref64.losses), 1)]
    for tensor, before in start.items():
        update = lambda run, first: np.asarray(run.params[tensor], dtype=np.float64) - first   # noqa: E731
        start32 = before.astype(np.float32).astype(np.float64)                               # where float32 starts
        results.append(assert_agrees(update(result, start32).astype(np.float32), update(ref64, before),
                                     update(same, start32), what=f"{who}: update of {tensor!r}", precision=precision))
        for label, moments in (("first moment", lambda run: run.state.first_moments),
                               ("second moment", lambda run: run.state.second_moments)):
            results.append(assert_agrees(moments(result)[tensor], moments(ref64)[tensor], moments(same)[tensor],
                                         what=f"{who}: {label} of {tensor!r}", precision=precision))
    return max((agreement.error / agreement.bound if agreement.bound else 0.0 for agreement in results), default=0.0)


def assert_weights_and_moments(result: Run, expected: Run, bound: TrainingBound, who: str) -> float:
    """Every weight and both Adam moments of ``result`` within ``bound`` of the reference's run ``expected``, entry by
    entry (the steps taken alike); an ``AssertionError`` naming the quantity, the tensor and the entry otherwise.
    Returns the largest error / bound."""
    assert len(result.losses) == len(expected.losses) and result.state.step == expected.state.step, who
    worst = 0.0
    for name, value in expected.params.items():
        errors = {"weights": (result.params[name], value, bound.weight_bound(name, value)),
                  "first moment": (result.state.first_moments[name], expected.state.first_moments[name],
                                   bound.first_moment_bound(name, expected.state.first_moments[name])),
                  "second moment": (result.state.second_moments[name], expected.state.second_moments[name],
                                    bound.second_moment_bound(name, expected.state.second_moments[name]))}
        for what, (got, want, limit) in errors.items():
            error = np.abs(np.asarray(got, dtype=np.float64) - want)
            limits = np.broadcast_to(limit, error.shape)
            ratio = error / limits
            at = np.unravel_index(np.argmax(ratio), ratio.shape) if ratio.size else ()
            assert np.all(error <= limits), (f"{who}: {what} of {name!r} at {at}: "
                                             f"error {error[at]:.3e} > bound {limits[at]:.3e}")
            worst = max(worst, float(np.max(ratio, initial=0.0)))
    return worst
