"""The project's one tolerance policy (``docs/equivalence.md`` gives the reasoning).

* float64: ``max|port - ref64| <= FLOAT64_RELATIVE * max(1, max|ref64|)``.
* float32: ``max|port - ref64| <= FLOAT32_FACTOR * max(max|ref32 - ref64|, ulp32(max|ref64|))``,
  where ``ref32`` is the float32 NumPy reference on the same inputs: a port may be at most
  ``FLOAT32_FACTOR`` times as wrong as float32 arithmetic itself is, and the floor of one
  float32 ulp at the output's scale keeps an exactly-representable result from demanding
  exactness.

* bfloat16 and float16 (the recipe of ``reference_numpy/precision.py``): ``max|port - ref64| <= LOW_PRECISION_FACTOR
  * max(max|refP - ref64|, ulpP(max|ref64|))``, where ``refP`` is the reference in the same format P. The reference
  rounds every value correctly, at the recipe's points (its wide arithmetic is float64); a port rounds the same
  values at the same points from float32 sums, and differs by one unit of P where a float32 sum falls across a
  rounding boundary -- differences that spread through a deep network (a fifth of the shipped model's decoder
  values in float16), so that its error is a different draw of the same size, as in float32: the same factor.
  A component with a single rounding point (attention, Eq. (1); LayerNorm), given inputs and weights that are
  numbers of P, is held to more: ``|port - ref64| <= the float32 bound + half a unit of P at the port's value``,
  element by element (:func:`single_rounding_bound`): the wide value is float32 arithmetic, within the float32
  policy of the exact one, and rounding it moves it by half a unit at most. And where every value within that
  float32 bound rounds to the same number of P (:func:`decided_by_rounding`: nearly everywhere), the port must give
  exactly that number, so that a rounding skipped (a compiler keeping excess precision) is seen too.

A forward stage that is a map f of earlier stages (a layer, a stack's output, the log-probabilities) and fails the
bound on its total error is held instead to what it adds to its inputs': ``|port - f(port's stages)|`` within the
bound of what the reference adds, ``|ref_P - f(ref_P's stages)|`` (:func:`stage_agreement`, :func:`stage_maps`), and
where f ends with a LayerNorm, at least FLOAT32_FACTOR times float32 arithmetic's own error in that LayerNorm in
either order kernels use (:func:`layer_norm_floor`: the reference subtracts the mean first, and a fused
``x * s + t`` cancels where the mean is large against the spread).

Two ports are compared with each other through the reference: by the triangle inequality
their difference is at most the sum of their two bounds (:func:`pair_bound`).

Gradients (float64): two ports' gradients of the same loss agree to ``GRADIENT_RELATIVE``
times the gradient's scale, and each port's gradient matches central finite differences of
the reference's loss within :func:`finite_difference_bound`. Where the gradient is ill-conditioned (weights
scaled far from any trained model's, docs/equivalence.md "The configuration space"), the bound is at least
``CONDITION_FACTOR`` times the reference's own sensitivity: how far its gradient moves when every weight and every
value of its forward pass moves by one float64 rounding (:func:`rounding_sensitivity`) -- the error any float64
implementation may make there.

Training (float64): a port's weights, Adam moments and losses after each optimizer step stay within the
reference's by the gradient bound carried through Adam's update (:class:`TrainingBound`); float32: the update
``weights_after - weights_before`` under the float32 rule above; mixed-float16: every weight and moment entry by entry
within :class:`TrainingBound` carrying a per-entry gradient bound (:func:`recipe_gradient_bound`).

Nothing else in the project chooses a tolerance.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar
from unittest import mock

import numpy as np
import numpy.typing as npt

from reference_numpy import backward, precision
from reference_numpy import model as reference_model
from reference_numpy.model import DecoderLayer, EncoderLayer, LayerNorm, Transformer, padding_mask, target_mask
from reference_numpy.precision import is_low, parse_precision, round_to, spacing

FLOAT64_RELATIVE = 1e-12
FLOAT32_FACTOR = 8
LOW_PRECISION_FACTOR = 8
GRADIENT_RELATIVE = 1e-10
CONDITION_FACTOR = 8     # as FLOAT32_FACTOR: a port may be this many times as sensitive as the reference


@dataclass(frozen=True)
class Agreement:
    """The outcome of one comparison: the error, the bound and whether it holds."""

    error: float
    bound: float
    scale: float
    added: bool = False     # the error the stage adds to its inputs' (:func:`stage_agreement`), not its total

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    @property
    def relative_error(self) -> float:
        return self.error / max(1.0, self.scale)

    def __str__(self) -> str:
        what = "max abs error added to its inputs'" if self.added else "max abs error"
        return f"{what} {self.error:.3e} {'<=' if self.ok else '>'} bound {self.bound:.3e}"


def max_abs(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    """max |a - b| in float64 (0 for empty arrays); shapes must match."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b), initial=0.0))


def float64_bound(ref64: npt.ArrayLike) -> float:
    """FLOAT64_RELATIVE x max(1, max|ref64|)."""
    return FLOAT64_RELATIVE * max(1.0, float(np.max(np.abs(ref64), initial=0.0)))


def float32_bound(ref64: npt.ArrayLike, ref32: npt.ArrayLike) -> float:
    """FLOAT32_FACTOR x max(error of the float32 reference, one float32 ulp at the output's scale)."""
    scale = float(np.max(np.abs(ref64), initial=0.0))
    ulp = float(np.spacing(np.float32(scale)))
    return FLOAT32_FACTOR * max(max_abs(ref32, ref64), ulp)


def low_precision_bound(ref64: npt.ArrayLike, ref_low: npt.ArrayLike, dtype: npt.DTypeLike) -> float:
    """LOW_PRECISION_FACTOR x max(error of the reference in ``dtype`` (bfloat16 or float16), one unit in the last
    place of ``dtype`` at the output's scale)."""
    scale = float(np.max(np.abs(ref64), initial=0.0))
    return LOW_PRECISION_FACTOR * max(max_abs(ref_low, ref64), float(spacing(scale, dtype)))


def bound_for(dtype: npt.DTypeLike, ref64: npt.ArrayLike, ref_same: npt.ArrayLike | None = None) -> float:
    """The policy's bound for an output computed in ``dtype``; float32, bfloat16 and float16 need ``ref_same``, the
    reference's output in that same precision (a low-precision model's log-probabilities are float32 arrays, but
    their precision is the model's). A mixed precision ("mixed-bfloat16", "mixed-float16": the autocast recipe) is
    held to its P's rule, ``ref_same`` then being the reference in that recipe."""
    stored, mixed = parse_precision(dtype)
    dtype = stored if mixed is None else mixed
    if dtype == np.float64:
        return float64_bound(ref64)
    if ref_same is None:
        raise ValueError(f"a {dtype.name} comparison needs the reference's output in {dtype.name}")
    return float32_bound(ref64, ref_same) if dtype == np.float32 else low_precision_bound(ref64, ref_same, dtype)


def pair_bound(dtype: npt.DTypeLike, ref64: npt.ArrayLike, ref_same: npt.ArrayLike | None = None) -> float:
    """Two ports each within the bound of the reference are within twice it of each other."""
    return 2 * bound_for(dtype, ref64, ref_same)


def single_rounding_bound(port: npt.ArrayLike, ref64: npt.ArrayLike, ref32: npt.ArrayLike,
                          dtype: npt.DTypeLike) -> np.ndarray:
    """Element-wise bound for a concept the recipe computes wide and rounds once to ``dtype`` (bfloat16 or float16),
    on inputs and weights that are numbers of ``dtype``: the float32 policy's bound on the wide value plus half a
    unit in the last place of ``dtype`` at the port's value (one correct-or-not rounding moves a value by no more;
    the unit above |port| is at least the unit at the wide value it was rounded from)."""
    if not is_low(dtype):
        raise ValueError(f"single_rounding_bound is for bfloat16 or float16, got {np.dtype(dtype).name}")
    return float32_bound(ref64, ref32) + spacing(np.asarray(port, dtype=np.float64), dtype) / 2


def decided_by_rounding(ref64: npt.ArrayLike, ref32: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """Where one rounding to ``dtype`` has a single answer for every wide value within the float32 bound of the
    exact value ``ref64`` (``ref32``: the float32 reference on the same inputs): the elements whose interval
    ``ref64 +- bound`` rounds to one number at both ends (rounding is monotonic, so everything between does too).
    There a port that rounds once, as the recipe says, gives exactly ``round_to(ref64, dtype)``; one that skips
    the rounding, or rounds twice, or computes in P, generally does not. Elsewhere a correct port may give either
    neighbour. Returns a bool array shaped like ``ref64``."""
    delta = float32_bound(ref64, ref32)
    ref64 = np.asarray(ref64, dtype=np.float64)
    below, above = round_to(ref64 - delta, dtype), round_to(ref64 + delta, dtype)
    return below.astype(np.float64) == above.astype(np.float64)


def gradient_bound(grads_a: dict, grads_b: dict, sensitivity: float = 0.0) -> float:
    """GRADIENT_RELATIVE x the gradient's scale: the largest |entry| over every tensor of both; at least
    CONDITION_FACTOR x ``sensitivity`` (:func:`rounding_sensitivity`; 0: a well-conditioned case).

    The scale is the whole gradient's, not each tensor's: some gradients are zero in exact
    arithmetic (a key bias shifts every score of a query equally, which the softmax ignores),
    and their computed values are rounding noise with no scale of their own.
    """
    scale = max(float(np.max(np.abs(grad), initial=0.0)) for grads in (grads_a, grads_b) for grad in grads.values())
    return max(GRADIENT_RELATIVE * scale, CONDITION_FACTOR * sensitivity)


def gradient_determined(grads: dict, sensitivity: float) -> bool:
    """Whether a float64 gradient is determined by the weights at all: one rounding of the weights and of the values
    computed from them (:func:`rounding_sensitivity`) moves it by less than its scale. Past that, its leading digit
    is rounding's choice (at weights x1e9 one-ulp perturbations move the reference's own gradient between 2e10 and
    1e69), so there is no value to agree on and no bound can be derived: such a gradient is outside the claim,
    reported as not compared, never passed."""
    scale = max(float(np.max(np.abs(grad), initial=0.0)) for grad in grads.values())
    return sensitivity < scale


def rounding_sensitivity(gradients: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                         params: dict[str, np.ndarray], draws: int = 64) -> float:
    """How far the reference's float64 gradient moves when every weight and every value its forward pass computes
    (each linear map's, attention's and LayerNorm's output) moves by one rounding: the largest max |g' - g| over
    ``draws`` seeded draws of w' = w (1 +- 2^-52) and the same for those values (random signs);
    ``gradients(params) -> {name: array}`` runs the reference's backward pass (:mod:`reference_numpy.backward`).

    A float64 implementation's forward error is its backward error (a few roundings of the weights and
    activations) times the condition of the gradient; this measures the product at one rounding directly. The
    activations count where the weights do not: two source positions whose encoder outputs are equal in the
    reference (their difference absorbed by a larger term) stay equal under any rounding of the weights, but a
    port's own roundings may leave their keys equal and their values one unit apart, and the gradient into the keys
    of the half-and-half softmax that follows is then that unit times the queries' scale (docs/equivalence.md, "The
    configuration space").

    The largest move is a maximum over every choice of signs, which the draws sample: where it takes a particular
    alignment of many signs, few draws reach it. 64 draws: in a fuzzed case of weights x1e3
    (tests/equivalence/test_fuzz.py, ``MOVED_BY_FEW_DRAWS``), 7.5% of draws move the gradient by 2.8e-3 and the rest by
    at most 7.6e-9; eight draws missed it (every port then 100 times over the bound), 64 miss such a move with
    probability 0.7%."""
    rng, exact = np.random.default_rng(0), gradients(params)
    moved = 0.0
    for _ in range(draws):
        nudged = {name: _one_rounding(value, rng) for name, value in params.items()}
        with _rounded_activations(rng):
            moved = max(moved, max(max_abs(grad, exact[name]) for name, grad in gradients(nudged).items()))
    return moved


def _one_rounding(value: npt.ArrayLike, rng: np.random.Generator) -> np.ndarray:
    """``value`` (1 +- 2^-52), a random sign per entry: one float64 rounding."""
    return value * (1 + np.ldexp(1.0, -52) * rng.choice([-1.0, 1.0], np.shape(value)))


@contextmanager
def _rounded_activations(rng: np.random.Generator) -> Iterator[None]:
    """While open, the outputs of the reference backward pass's linear maps, attention and LayerNorms carry one
    rounding each (:func:`_one_rounding`); their backward functions are the exact ones."""
    def rounded(concept):
        def call(*args, **kwargs):
            out, concept_backward = concept(*args, **kwargs)
            return _one_rounding(out, rng), concept_backward
        return call

    concepts = {name: rounded(getattr(backward, name)) for name in ("linear", "attention", "layer_norm")}
    with mock.patch.multiple(backward, **concepts):
        yield


def recipe_gradient_bound(grads64: dict[str, np.ndarray], runs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The bound of a port's gradient at one training step in a mixed precision, entry by entry: LOW_PRECISION_FACTOR
    x the largest |g - g64| over ``runs``, the reference's gradients at that step in the recipe -- its own run and
    runs whose every rounding to P was a random one (:func:`random_roundings`) -- against the float64 reference's
    ``grads64``.

    Why: the low-precision rule (a port is at most k times as wrong as the reference in P, :func:`low_precision_bound`)
    taken per entry instead of per tensor. A port rounds the recipe's values at the same points from float32 sums, so
    that where a sum falls across a rounding boundary of P it takes the other neighbour, and the difference spreads
    through the layers and the steps (a weight's Adam update at the first step is the sign of its gradient: a
    gradient below P's noise, computed with the other sign, puts the entry 2 lrate(1) apart). One run of the
    reference is one draw of those choices, and at an entry it may be right by chance; the runs with random roundings
    are independent draws, so that the largest error over them is the entry's own noise, the steps before it included
    (each run is a whole run: its weights drift as a port's do). The tensor's largest error is no yardstick for an
    entry: it exceeds most entries' gradients, and a port negating its updates would pass."""
    return {name: LOW_PRECISION_FACTOR * np.max([np.abs(np.asarray(run[name], dtype=np.float64) - grad)
                                                 for run in runs], axis=0)
            for name, grad in grads64.items()}


@contextmanager
def random_roundings(rng: np.random.Generator) -> Iterator[None]:
    """While open, every rounding of the reference to bfloat16 or float16 (``precision.round_to``, which the recipe's
    products, casts and roundings of the forward and backward passes all call) is a random one: stochastic rounding,
    to the number of P below the wide value or to the one above it, the one above with probability the value's
    distance from the one below in units of P (a number of P is kept). Each rounding's error is then independent of
    the reference's own (round to nearest) and of the same size (at most one unit instead of half a unit; a root
    mean square sqrt(2) times as large): a run under it is another draw of P's rounding errors, where a port's differ
    from the reference's at the roundings its float32 sums decide otherwise."""
    exact = precision.round_to

    def moved(x: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
        if not is_low(dtype):
            return exact(x, dtype)
        x = np.asarray(x, dtype=np.float64)
        unit = spacing(x, dtype)                                    # exact powers of two: x / unit is exact
        below = np.floor(x / unit)
        return exact((below + (rng.random(x.shape) < x / unit - below)) * unit, dtype)

    with mock.patch.object(precision, "round_to", moved), mock.patch.object(reference_model, "round_to", moved), \
            mock.patch.object(backward, "round_to", moved):
        yield


class TrainingBound:
    """Per-entry bounds on a port's training run against the reference's, step by step (section 5.3).

    Each step's gradient may differ from the reference's by ``delta_s``, per entry: in float64 the gradient policy,
    ``GRADIENT_RELATIVE x max|g_s|`` (:func:`gradient_bound`); in a mixed precision, :func:`recipe_gradient_bound`.
    Adam's m_hat = sum_i a_i g_i is a weighted mean of past gradients (weights a_i summing to 1), so it moves by at
    most ``dm = sum_i a_i delta_i``; s = sqrt(v_hat) = sqrt(sum_i b_i g_i^2) is a weighted L2 norm, so it moves by at
    most ``ds = sqrt(sum_i b_i delta_i^2)`` (the triangle inequality); both are Adam's own moment recurrences run on
    the deltas, bias-corrected alike. The update u = m_hat / (s + eps) then moves by at most ``dm / (s' + eps) +
    |m_hat| ds / ((s + eps)(s' + eps))`` with s' = max(s - ds, 0) (u' - u = (m' - m) / (s' + eps) + m (s - s') / ((s
    + eps)(s' + eps))), and by no more than ``|u| + adam_ratio_limit(t)``, the largest |u'| any gradients give
    (:func:`adam_ratio_limit`): a gradient below its bound may take either sign, which at Adam's first step moves the
    update from +1 to -1. A weight moves by the sum over steps of lrate(t) times that. The moments (not
    bias-corrected): ``|dm| <=`` the recurrence m of the deltas, ``|dv| <=`` the recurrence v of ``2 |g| delta +
    delta^2`` (as |g'^2 - g^2| <= 2 |g| delta + delta^2). The loss at a step moves by ``sum |g| |dw|`` through the
    weights it is computed at. (The gradient's own change through the weights' small drift is second order in
    float64, where the drift is ~1e-15 and ``delta`` 1e-10 of the gradient's scale; in a mixed precision the drift is
    inside ``delta``, which is measured on whole runs.)

    Each bound adds a rounding floor at the compared quantity's scale for the precision of the run's masters
    (``dtype``): float64, the float64 policy's; float32 (mixed precision: float32 masters and moments), one float32
    unit per step at the quantity's scale (a step rounds each weight and each moment once, and a weight's
    float32 computation of lrate(t) u is exact to far less than that unit), and one more for the weights'
    float32 start: the weights at the entry's magnitude plus the farthest its updates can have taken it.
    """

    def __init__(self, params: dict[str, np.ndarray], dtype: npt.DTypeLike = np.float64):
        zeros = lambda: {name: np.zeros(np.shape(value)) for name, value in params.items()}
        self.weights, self.reach = zeros(), zeros()
        self.first, self.second, self.squares = zeros(), zeros(), zeros()
        self.dtype, self.steps = np.dtype(dtype), 0
        self.losses: list[float] = []

    def step(self, value: float, grads: dict[str, np.ndarray], first_moments: dict[str, np.ndarray],
             second_moments: dict[str, np.ndarray], step: int, lrate: float, beta1: float, beta2: float,
             epsilon: float, sensitivity: float = 0.0, deltas: dict[str, np.ndarray] | None = None) -> None:
        """Account for one reference step: its loss ``value`` and gradient (at the weights before the step), and its
        moments after the step, which was step number ``step`` with learning rate ``lrate``; ``deltas`` the bound of
        each gradient entry (default: :func:`gradient_bound` with ``sensitivity``, the same for every entry)."""
        self.losses.append(float64_bound(value) + sum(float(np.sum(np.abs(grads[name]) * self.weights[name]))
                                                      for name in grads))
        if deltas is None:
            policy = gradient_bound(grads, grads, sensitivity)
            deltas = {name: np.full(np.shape(grad), policy) for name, grad in grads.items()}
        limit, self.steps = adam_ratio_limit(step, beta1, beta2), self.steps + 1
        for name, grad in grads.items():
            delta = deltas[name]
            self.first[name] = beta1 * self.first[name] + (1.0 - beta1) * delta
            self.squares[name] = beta2 * self.squares[name] + (1.0 - beta2) * delta * delta
            self.second[name] = beta2 * self.second[name] + (1.0 - beta2) * (2 * np.abs(grad) * delta + delta * delta)
            moved_m = self.first[name] / (1.0 - beta1 ** step)
            moved_s = np.sqrt(self.squares[name] / (1.0 - beta2 ** step))
            m_hat = np.abs(first_moments[name]) / (1.0 - beta1 ** step)
            root = np.sqrt(second_moments[name] / (1.0 - beta2 ** step))
            low = np.maximum(root - moved_s, 0.0) + epsilon
            moved = moved_m / low + m_hat * moved_s / ((root + epsilon) * low)
            largest = m_hat / (root + epsilon) + limit
            self.weights[name] = self.weights[name] + lrate * np.minimum(moved, largest)
            self.reach[name] = self.reach[name] + lrate * largest

    def weight_bound(self, name: str, reference: np.ndarray) -> np.ndarray:
        if self.dtype == np.float64:
            return self.weights[name] + float64_bound(reference)
        scale = np.abs(reference) + self.reach[name]
        return self.weights[name] + (self.steps + 1) * np.spacing(scale.astype(self.dtype)).astype(np.float64)

    def first_moment_bound(self, name: str, reference: np.ndarray) -> np.ndarray:
        return self.first[name] + self._floor(reference)

    def second_moment_bound(self, name: str, reference: np.ndarray) -> np.ndarray:
        return self.second[name] + self._floor(reference)

    def _floor(self, reference: np.ndarray) -> float:
        """The moments' rounding floor: the float64 policy's, or one float32 unit per step at the tensor's scale."""
        scale = float(np.max(np.abs(reference), initial=0.0))
        if self.dtype == np.float64:
            return FLOAT64_RELATIVE * scale
        return self.steps * float(np.spacing(np.asarray(scale, dtype=self.dtype)))


def adam_ratio_limit(step: int, beta1: float, beta2: float) -> float:
    """The largest |m_hat| / sqrt(v_hat) of Adam at step ``step`` over every gradient sequence: m_hat = sum_i a_i g_i
    and v_hat = sum_i b_i g_i^2 with a_i = (1 - beta1) beta1^(t-i) / (1 - beta1^t), b_i likewise with beta2, so by
    Cauchy-Schwarz |m_hat| <= sqrt(sum_i a_i^2 / b_i) sqrt(v_hat), with equality for g_i proportional to a_i / b_i.
    1 at the first step (|g| / |g|)."""
    i = np.arange(1, step + 1)
    a = (1.0 - beta1) * beta1 ** (step - i) / (1.0 - beta1 ** step)
    b = (1.0 - beta2) * beta2 ** (step - i) / (1.0 - beta2 ** step)
    return float(np.sqrt(np.sum(a * a / b)))


def finite_difference_bound(fd_h: float, fd_half: float, loss_value: float, step: float) -> float:
    """Error bound of the Richardson estimate (4 fd(h/2) - fd(h)) / 3 of a directional derivative.

    Truncation: the extrapolation is better than fd(h/2), whose error |fd(h) - fd(h/2)| bounds.
    Rounding: each loss is trusted to delta = FLOAT64_RELATIVE x max(1, |loss|) (the float64
    policy); fd(h) = (L(+h) - L(-h)) / 2h carries delta / h, fd(h/2) carries 2 delta / h, and the
    extrapolation (4 e2 + e1) / 3 <= 3 delta / h.
    """
    delta = FLOAT64_RELATIVE * max(1.0, abs(loss_value))
    return abs(fd_h - fd_half) + 3.0 * delta / step


def agreement(port: npt.ArrayLike, ref64: npt.ArrayLike, ref_same: npt.ArrayLike | None = None,
              precision: npt.DTypeLike | None = None) -> Agreement:
    """Compare ``port`` with the float64 reference under the policy for ``precision`` (default: the port's dtype).

    float32, bfloat16 and float16 need ``ref_same``, the reference's output in that precision on the same inputs.
    """
    port = np.asarray(port)
    scale = float(np.max(np.abs(ref64), initial=0.0))
    return Agreement(error=max_abs(port, ref64), bound=bound_for(precision or port.dtype, ref64, ref_same),
                     scale=scale)


def assert_agrees(port: npt.ArrayLike, ref64: npt.ArrayLike, ref_same: npt.ArrayLike | None = None,
                  what: str = "output", precision: npt.DTypeLike | None = None) -> Agreement:
    """Raise ``AssertionError`` naming ``what`` when :func:`agreement` fails; return the result."""
    result = agreement(port, ref64, ref_same, precision)
    if not result.ok:
        raise AssertionError(f"{what}: {result}")
    return result


Stages = dict[str, np.ndarray]


_Layer = TypeVar("_Layer", EncoderLayer, DecoderLayer)


@dataclass(frozen=True)
class StageMap:
    """A forward stage as a map of earlier ones (:func:`stage_maps`): ``step(stages)`` computes it in the float64
    reference; ``ending`` is the LayerNorm its computation ends with (a post-LN layer's last, a pre-LN stack's
    final norm), or None."""

    step: Callable[..., np.ndarray]
    before: str
    ending: LayerNorm | None = None

    def __call__(self, stages: Stages) -> np.ndarray:
        return self.step(_stage(stages, self.before), stages)

    def layer_norm_error(self, stages: Stages) -> float:
        """How far float32 arithmetic is from the stage's ending LayerNorm (0 without one), on the input it is given
        here rounded to float32 (the rows of finite inputs): the largest error of the two orders of operations
        LayerNorm kernels use (:func:`float32_layer_norms`) against the LayerNorm of the exact input, and at least
        one float32 unit at the largest magnitude the fused order reaches, max |x| / sqrt(var + eps) x max|weight| +
        max|bias| -- so that one order's lucky draw does not demand as much of every other."""
        if self.ending is None:
            return 0.0
        seen: list[np.ndarray] = []
        self.step(_stage(stages, self.before), stages, _Recorded(self.ending, seen))
        x = seen[-1][np.isfinite(seen[-1]).all(axis=-1)]                     # (rows, D)
        with np.errstate(all="ignore"):
            exact = self.ending(x)
            deviation = np.sqrt(((x - x.mean(axis=-1, keepdims=True)) ** 2).mean(axis=-1) + self.ending.eps)
            reach = (np.max(np.max(np.abs(x), axis=-1) / deviation, initial=0.0) * np.max(np.abs(self.ending.weight))
                     + np.max(np.abs(self.ending.bias)))
            errors = [float(np.max(np.abs(order - exact), initial=0.0))
                      for order in float32_layer_norms(x, self.ending)]
        worst = max(*errors, float(np.spacing(np.float32(reach))))
        return worst if np.isfinite(worst) else 0.0


def float32_layer_norms(x: np.ndarray, norm: LayerNorm) -> tuple[np.ndarray, np.ndarray]:
    """LayerNorm of ``x`` rounded to float32, in float32, in the two orders of operations kernels use (written out
    here): the mean subtracted first, ``(x - mean) / sqrt(var + eps) * weight + bias``; and fused, ``x * s + t`` with
    s = weight / sqrt(var + eps) and t = bias - mean * s. The mean and the variance are summed left to right, the
    order whose float32 error grows fastest with the width (a blocked or pairwise sum adds fewer terms in sequence).
    Where the mean is large against the spread, the fused order's two products cancel, each rounded at their own
    magnitude, far above the output's."""
    x, weight, bias = (np.asarray(a, dtype=np.float32) for a in (x, norm.weight, norm.bias))
    width = np.float32(x.shape[-1])
    mean = np.cumsum(x, axis=-1)[..., -1:] / width
    centred = x - mean
    deviation = np.sqrt(np.cumsum(centred ** 2, axis=-1)[..., -1:] / width + np.float32(norm.eps))
    scale = weight / deviation
    return centred / deviation * weight + bias, x * scale + (bias - mean * scale)


class _Recorded(LayerNorm):
    """The LayerNorm ``norm``, recording each input it is given in ``seen``."""

    def __init__(self, norm: LayerNorm, seen: list[np.ndarray]):
        vars(self).update(vars(norm))
        self.seen = seen

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.seen.append(x)
        return super().__call__(x)


def stage_maps(model64: Transformer, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: np.ndarray | None = None,
               tgt_mask: np.ndarray | None = None) -> dict[str, StageMap]:
    """Every forward stage that is a map of earlier ones -- each layer of the stacks (section 3.1; a decoder layer
    also reads the encoder's output), a stack's output (its final LayerNorm in pre-LN), the log-probabilities
    (section 3.4) -- as a :class:`StageMap` computing it in the float64 reference ``model64`` from the values of
    those stages in a dict of stages, on the inputs of the forward pass (the default masks where none are given)."""
    config = model64.config
    src_mask = padding_mask(np.asarray(src), config.pad_id) if src_mask is None else src_mask
    tgt_mask = target_mask(np.asarray(tgt), config.pad_id) if tgt_mask is None else tgt_mask

    def encoder_layer(layer: EncoderLayer, x: np.ndarray, stages: Stages, norm: LayerNorm | None = None) -> np.ndarray:
        return _with_ending(layer, norm)(x, src_mask)

    def decoder_layer(layer: DecoderLayer, x: np.ndarray, stages: Stages, norm: LayerNorm | None = None) -> np.ndarray:
        return _with_ending(layer, norm)(x, _stage(stages, "encoder"), src_mask, tgt_mask)

    def stack_output(norm: LayerNorm | None, x: np.ndarray, stages: Stages, recorder: LayerNorm | None = None,
                     ) -> np.ndarray:
        """A stack's output from its last layer's: its final LayerNorm in pre-LN, the same values in post-LN."""
        return x if norm is None else (recorder or norm)(x)

    maps: dict[str, StageMap] = {}
    before = "src_embed"
    for i, encoder in enumerate(model64.encoder.layers):
        maps[f"encoder.layers.{i}"] = StageMap(functools.partial(encoder_layer, encoder), before, _ending(encoder))
        before = f"encoder.layers.{i}"
    maps["encoder"] = StageMap(functools.partial(stack_output, model64.encoder.norm), before, model64.encoder.norm)
    before = "tgt_embed"
    for i, decoder in enumerate(model64.decoder.layers):
        maps[f"decoder.layers.{i}"] = StageMap(functools.partial(decoder_layer, decoder), before, _ending(decoder))
        before = f"decoder.layers.{i}"
    maps["decoder"] = StageMap(functools.partial(stack_output, model64.decoder.norm), before, model64.decoder.norm)
    maps["log_probs"] = StageMap(lambda x, stages: model64.generator(x), "decoder")
    return maps


def _ending(layer: EncoderLayer | DecoderLayer) -> LayerNorm | None:
    """The LayerNorm a layer's computation ends with: post-LN's around the feed-forward network (section 3.1)."""
    return None if layer.norm_first else layer.ffn_norm


def _with_ending(layer: _Layer, norm: LayerNorm | None) -> _Layer:
    """``layer``, or a copy whose ending LayerNorm is ``norm`` (the shared reference model is left as it is)."""
    if norm is None:
        return layer
    changed = copy.copy(layer)
    changed.ffn_norm = norm
    return changed


def _stage(stages: Stages, name: str) -> np.ndarray:
    return np.asarray(stages[name], dtype=np.float64)


def stage_agreement(port: npt.ArrayLike, ref64: npt.ArrayLike, ref_same: npt.ArrayLike | None, dtype: npt.DTypeLike,
                    step: StageMap | Callable[[Stages], np.ndarray] | None = None, port_stages: Stages | None = None,
                    same_stages: Stages | None = None, where: np.ndarray | None = None) -> Agreement:
    """A forward stage of a port against the float64 reference under the policy (:func:`agreement`), over the
    entries ``where`` (default: all). For a stage that is a map ``step`` of earlier stages (:func:`stage_maps`;
    ``port_stages`` and ``same_stages``: the port's and the reference-in-``dtype``'s stages -- ``ref64``'s in
    float64), where the policy fails: the error the stage adds to its inputs', instead,
    ``|port - step(port_stages)| <= bound_for(dtype, step(same_stages), ref_same)``, the policy applied to what the
    reference in ``dtype`` adds there (``step`` in float64).

    Why: a port's error at such a stage is J e + what the stage adds, with e its error at the stages it reads,
    which their bounds hold. The reference's own error is J e' + what it adds, with e' its own draw, in a direction
    its order of operations chose: a LayerNorm removes the mean and the direction of x, so that its gain depends on
    the direction of the error it is given, and where a port's falls in another direction than the reference's
    (d_model 4, inputs of 2.8e9: 1.55 times the gain) the per-stage ratio of 8 can be passed by the input's error
    alone. What a stage answers for is what it adds. A stage that ends with a LayerNorm (``step`` a
    :class:`StageMap`) is allowed at least :func:`layer_norm_floor`: the float32 error of that LayerNorm in
    either order of operations, which the reference's (the mean subtracted first) may not show."""
    port, ref64 = np.asarray(port), np.asarray(ref64)
    where = np.ones(ref64.shape, dtype=bool) if where is None else where
    same = None if ref_same is None else np.asarray(ref_same)[where]
    result = agreement(port[where], ref64[where], same, dtype)
    if result.ok or step is None or not where.any():
        return result
    if port_stages is None or same_stages is None:
        raise ValueError("a stage that is a map of earlier ones needs port_stages and same_stages")
    exact_port, exact_same = step(port_stages)[where], step(same_stages)[where]
    bound = bound_for(dtype, exact_same, same)
    if isinstance(step, StageMap):
        bound = max(bound, layer_norm_floor(dtype, step.layer_norm_error(port_stages)))
    added = Agreement(max_abs(port[where], exact_port), bound, result.scale, added=True)
    return added if added.ok else result


def layer_norm_floor(dtype: npt.DTypeLike, error: float) -> float:
    """The bound of what a stage ending with a LayerNorm adds, at least: FLOAT32_FACTOR x ``error``
    (:meth:`StageMap.layer_norm_error`, float32 arithmetic's own error there) -- a port's LayerNorm may be as many
    times as wrong as float32 arithmetic is, in whichever order it evaluates it -- in every precision but float64
    (bfloat16 and float16 compute a LayerNorm in float32, then round once)."""
    return 0.0 if parse_precision(dtype)[0] == np.float64 else FLOAT32_FACTOR * error


# ----------------------------------------------------------------------------- decoded tokens

def greedy_decisive_steps(margins: np.ndarray, bound: float) -> int | None:
    """Leading greedy steps of one row that float32 must reproduce.

    ``margins`` are the float64 reference's top-two log-probability gaps per step (from
    :func:`equivalence.margins.greedy_margins`); two log-probabilities each off by at most ``bound`` can
    swap only where the gap is below 2 x bound. Returns the index of the first such step, or
    None when every step is decisive (the whole row must match).
    """
    near_ties = np.flatnonzero(np.asarray(margins) < 2 * bound)
    return int(near_ties[0]) if near_ties.size else None


def greedy_tokens_agree(tokens: np.ndarray, ref_tokens: np.ndarray, margins: np.ndarray, bound: float,
                        pad_id: int) -> tuple[bool, str, int]:
    """The rule for greedy tokens under an error bound (float32's, or float64's in the fuzzer), row by row: identical
    up to each row's first near-tie
    (:func:`greedy_decisive_steps`), and entirely in rows without one.

    ``margins`` is (B, steps). Returns (agree, a note naming the first difference or the rows
    cut at a near-tie, the number of rows compared in full).
    """
    notes, full = [], 0
    for row, ref_row in enumerate(ref_tokens):
        port_row = tokens[row] if row < len(tokens) else np.array([], dtype=ref_row.dtype)
        stop = greedy_decisive_steps(margins[row], bound)
        if stop is None:
            if not same_tokens(port_row, ref_row, pad_id):
                return False, f"row {row} differs", full
            full += 1
        elif not np.array_equal(port_row[:stop], ref_row[:stop]):
            return False, f"row {row} differs before its near-tie at step {stop}", full
        else:
            notes.append(f"row {row} compared up to its near-tie at step {stop}")
    return True, "; ".join(notes), full


def same_tokens(row: np.ndarray, ref_row: np.ndarray, pad_id: int) -> bool:
    """Whether two decoded rows are the same tokens: equal once the shorter is right-padded with ``pad_id`` (a batch's
    outputs are as wide as its longest row; a pad inside a row, which a config may let the decoder emit, counts)."""
    width = max(len(row), len(ref_row))
    pad = lambda tokens: np.pad(np.asarray(tokens), (0, width - len(tokens)), constant_values=pad_id)
    return bool(np.array_equal(pad(row), pad(ref_row)))


def beam_row_is_decisive(margins: list[float], bound: float) -> bool:
    """Whether float32 must reproduce a beam-search row exactly.

    ``margins`` come from :func:`equivalence.margins.beam_margins`: one per step, then the final choice.
    Scores at step t sum t log-probabilities, so a step is decisive when its margin is at least
    2 x t x bound, and the final choice when its margin is at least 2 x L x bound (L steps). A
    near-tie anywhere can change the whole chosen hypothesis, so one is enough to exclude the row.
    """
    steps, final = np.asarray(margins[:-1]), margins[-1]
    return bool(np.all(steps >= 2 * np.arange(1, len(steps) + 1) * bound) and final >= 2 * len(steps) * bound)
