"""Training in every backend against the reference (section 5): ten optimizer steps from one checkpoint on the
same batches, dropout off, give the reference's weights, Adam moments and losses (float64 within
``equivalence.tolerance.TrainingBound``, float32 under the float32 rule applied to the update); a run saved after
five steps in one backend and resumed in another for five more ends where ten reference steps end, for every
ordered pair of backends."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import itertools
import json

import numpy as np
import pytest
from support import BACKENDS, FRAMEWORKS, STEPS, TRAINING, backend, batches, config_of, copied

from equivalence import tolerance
from equivalence.backends import numpy as reference
from equivalence.cases import seeded_params
from equivalence.training_runs import Run, assert_float64_run, assert_precision_run
from equivalence.training_runs import reference_run as reference_float64_run
from reference_numpy import precision
from reference_numpy.checkpoint import LossScaleState, TrainingState, load_training_state
from reference_numpy.config import TrainingConfig
from reference_numpy.precision import round_to
from reference_numpy.training import LossScale, learning_rate

TRAINING_VARIANTS = ("tiny", "shared_embeddings")        # separate and tied embeddings (one pair of moments)


def run(name: str, variant: str, dtype: str, steps=range(STEPS), state: TrainingState | None = None,
        params: dict[str, np.ndarray] | None = None, compute: str | None = None) -> Run:
    """``steps`` training steps in backend ``name`` from ``params`` (default: the seeded weights) and ``state``; with
    ``compute`` (bfloat16, float16) a float32 model trains in mixed precision."""
    return stages(name, variant, dtype, steps, (steps.stop,), state, params, compute)[0]


def stages(name: str, variant: str, dtype: str, steps: range, stops: tuple[int, ...],
           state: TrainingState | None = None, params: dict[str, np.ndarray] | None = None,
           compute: str | None = None) -> tuple[Run, ...]:
    """The run of :func:`run` as it stood after each step count in ``stops`` (copies: its losses so far, weights
    and training state), one model and one optimizer throughout."""
    module, config = backend(name), config_of(variant)
    model = module.build(config, seeded_params(config) if params is None else params, dtype, "cpu")
    optimizer = module.optimizer(model, TRAINING if state is None else None, state, compute)
    inputs, losses, kept = batches(variant), [], []
    for step in steps:
        losses.append(module.train_step(model, optimizer, **inputs[step]))
        if step + 1 in stops:
            kept.append(copied(losses, module.export_params(model), module.training_state(model, optimizer)))
    return tuple(kept)


@functools.cache
def halves(name: str, variant: str, dtype: str = "float64", compute: str | None = None) -> tuple[Run, Run]:
    """Ten steps from the seeded weights in backend ``name``: the run after five of them (where
    test_a_run_moves_between_backends saves it) and after all ten."""
    return stages(name, variant, dtype, range(STEPS), (STEPS // 2, STEPS), compute=compute)


def reference_run(variant: str, dtype: str = "float64", compute: str | None = None) -> Run:
    return halves("numpy", variant, dtype, compute)[1]


def backend_run(name: str, variant: str, dtype: str, compute: str | None = None) -> Run:
    return halves(name, variant, dtype, compute)[1]


@functools.cache
def float64_bound(variant: str) -> tolerance.TrainingBound:
    """The reference's run, step by step, accounted for by :class:`TrainingBound`."""
    config = config_of(variant)
    return reference_float64_run(config, seeded_params(config), TRAINING, batches(variant))[1]


@pytest.mark.slow
@pytest.mark.parametrize("variant", TRAINING_VARIANTS)
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_ten_steps_match_the_reference_in_float64(name, variant):
    assert_float64_run(backend_run(name, variant, "float64"), reference_run(variant), float64_bound(variant), name)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tiny"])
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_ten_steps_match_the_reference_in_float32(name, variant):
    """The float32 rule on what training changes: each tensor's update (weights after minus weights before), each
    moment and each step's loss, against k x the float32 reference's own error. (Tied weights' moments: float64.)"""
    assert_run_agrees(backend_run(name, variant, "float32"), variant, "float32", name)


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_ten_mixed_precision_steps_match_the_reference(name, compute):
    """Mixed precision (float32 master weights and moments, each step's loss and gradients in P by the recipe,
    float16's loss scaled): each tensor's update, each moment and each loss under the low-precision rule, against
    the reference's mixed-precision run (its hand-written backward pass in P) as the yardstick of P's own error."""
    assert_run_agrees(backend_run(name, "tiny", "float32", compute), "tiny", compute, name)


def assert_run_agrees(result: Run, variant: str, precision: str, name: str) -> None:
    """``result`` (a float32 model's run, computing in ``precision``) within the policy for ``precision`` of the
    float64 reference's run, the reference's own run in that precision being the yardstick."""
    assert_precision_run(result, reference_run(variant), reference_run(variant, "float32",
                                                                       None if precision == "float32" else precision),
                         seeded_params(config_of(variant)), precision, name)


def test_the_bound_is_tight_enough_to_decide():
    """The float64 bound must not swallow what it guards. After ten steps a weight with a gradient has moved by the
    learning rate times an Adam update of order 1; its bound is a millionth of that move or less for most entries
    (a wrong epsilon placement, a step counted from 0 or a float32 learning rate change moves by 1e-6 of themselves
    or more). Entries whose gradient is zero in exact arithmetic do not move, or move by rounding noise divided by
    Adam's epsilon, and their bound allows that noise: embedding rows of tokens no batch holds, and key-projection
    biases (a key bias shifts all of a query's scores equally, which the softmax ignores)."""
    bound, expected, initial = float64_bound("tiny"), reference_run("tiny"), seeded_params(config_of("tiny"))
    for name, before in initial.items():
        if name.endswith("k_proj.bias"):
            continue
        moved = np.abs(expected.params[name] - before)
        assert np.median(bound.weight_bound(name, before)[moved > 0] / moved[moved > 0]) < 1e-6, name


@pytest.mark.parametrize("step", [1, 2, 10, 4000])
def test_adams_largest_ratio_is_reached_and_never_passed(step):
    """``tolerance.adam_ratio_limit`` (the cap of TrainingBound's per-step update change) against Adam's moments
    computed by a loop over the gradients (Algorithm 1, section 5.3's betas): the gradient sequence proportional to
    a_i / b_i reaches it, and no random sequence (signs, scales over 12 decades, zeros) passes it."""
    beta1, beta2 = TRAINING.beta1, TRAINING.beta2

    def ratio(grads: np.ndarray) -> float:
        m = v = 0.0
        for g in grads:
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        return abs(m / (1 - beta1 ** len(grads))) / np.sqrt(v / (1 - beta2 ** len(grads)))

    limit = tolerance.adam_ratio_limit(step, beta1, beta2)
    i = np.arange(1, step + 1)
    assert ratio((beta1 / beta2) ** (step - i)) == pytest.approx(limit, rel=1e-12)
    rng = np.random.default_rng(step)
    for _ in range(200):
        grads = rng.standard_normal(step) * 10.0 ** rng.uniform(-6, 6, step) * (rng.random(step) < 0.9)
        assert not grads.any() or ratio(grads) <= limit * (1 + 1e-12)


def test_the_carried_bound_holds_for_every_gradient_within_its_deltas():
    """``tolerance.TrainingBound``'s carriage of per-entry gradient bounds through Adam, against Adam run by a loop
    (Algorithm 1, section 5.3's betas and epsilon): ten steps of gradients over 12 decades (zeros and sign changes
    among them), each entry's bound delta_t drawn per step from 1e-3 to 10 times the gradient, and another run
    whose gradients differ by at most delta_t (at the extremes +-delta_t, or anywhere between): its weights and both
    moments never leave the bound (with its float64 floor, for the loops' own rounding)."""
    beta1, beta2, epsilon = TRAINING.beta1, TRAINING.beta2, TRAINING.epsilon
    rng, shape, steps = np.random.default_rng(0), (400,), 10

    def adam(grads: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple]]:
        w, m, v, states = np.zeros(shape), np.zeros(shape), np.zeros(shape), []
        for t, g in enumerate(grads, 1):
            m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            w = w - learning_rate(t, 16) * (m / (1 - beta1 ** t)) / (np.sqrt(v / (1 - beta2 ** t)) + epsilon)
            states.append((m, v))
        return w, m, v, states

    for _ in range(20):
        grads = [rng.standard_normal(shape) * 10.0 ** rng.uniform(-9, 3, shape) * (rng.random(shape) < 0.9)
                 for _ in range(steps)]
        deltas = [np.abs(g) * 10.0 ** rng.uniform(-3, 1, shape) + 1e-12 for g in grads]
        w, m, v, states = adam(grads)
        bound = tolerance.TrainingBound({"w": np.zeros(shape)})
        for t, (g, delta, (m_t, v_t)) in enumerate(zip(grads, deltas, states), 1):
            bound.step(0.0, {"w": g}, {"w": m_t}, {"w": v_t}, t, learning_rate(t, 16), beta1, beta2, epsilon,
                       deltas={"w": delta})
        for extreme in (True, False):
            moves = [rng.choice([-1.0, 1.0], shape) if extreme else rng.uniform(-1, 1, shape) for _ in grads]
            w2, m2, v2, _ = adam([g + move * delta for g, move, delta in zip(grads, moves, deltas)])
            assert np.all(np.abs(w2 - w) <= bound.weight_bound("w", w))
            assert np.all(np.abs(m2 - m) <= bound.first_moment_bound("w", m))
            assert np.all(np.abs(v2 - v) <= bound.second_moment_bound("w", v))


@pytest.mark.parametrize("pair", list(itertools.permutations(BACKENDS, 2)), ids="-then-".join)
def test_a_run_moves_between_backends(pair, tmp_path):
    """Five steps in one backend, saved with its training state, five more in another: the ten reference steps.
    (Each port's own tests resume in the same backend, bit for bit.)"""
    first, second = pair
    variant, path = "shared_embeddings", tmp_path / "run.safetensors"
    halfway = halves(first, variant)[0]             # the first five of the run test_ten_steps_... checks
    module = backend(first)
    module.save(module.build(config_of(variant), halfway.params, "float64", "cpu"), path, halfway.state)
    state = load_training_state(path)
    assert state.step == STEPS // 2 and state.config == TRAINING
    resumed = run(second, variant, "float64", steps=range(STEPS // 2, STEPS), state=state,
                  params=backend(second).export_params(backend(second).load(path)))
    resumed.losses = halfway.losses + resumed.losses
    assert_float64_run(resumed, reference_run(variant), float64_bound(variant), f"{first} then {second}")


PACKAGES = {"numpy": "reference_numpy", "torch": "transformer_torch", "jax": "transformer_jax", "tf": "transformer_tf"}


@pytest.mark.parametrize("compute", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("name", BACKENDS)
def test_the_optimizer_is_one_record_with_the_same_fields_in_every_backend(name, compute):
    """``training.optimizer`` gives the backend's ``training.Optimizer``, whether the precision is mixed or not: a
    dataclass with the reference's fields, the run's config in it, a P model only in mixed precision and a loss
    scale only in float16."""
    module, config = backend(name), config_of("tiny")
    model = module.build(config, seeded_params(config), "float32", "cpu")
    optimizer = module.optimizer(model, TRAINING, None, compute)
    assert type(optimizer) is importlib.import_module(f"{PACKAGES[name]}.training").Optimizer
    public = [field.name for field in dataclasses.fields(optimizer) if not field.name.startswith("_")]
    assert public == ["adam", "schedule", "config", "low", "loss_scale"]
    assert optimizer.config == TRAINING
    assert (optimizer.low is None) == (compute is None) and (optimizer.loss_scale is None) == (compute != "float16")


# ----------------------------------------------------------------------------- the reference's optimizer, closed forms

def test_the_schedule_is_eq_3_at_its_landmarks():
    """lrate = d^-0.5 min(t^-0.5, t w^-1.5): linear to its peak d^-0.5 w^-0.5 at t = w, then t^-0.5 decay."""
    d, w = 512, 4000
    assert learning_rate(1, d) == pytest.approx(1 / (d ** 0.5 * w ** 1.5), rel=1e-15)
    assert learning_rate(w, d) == pytest.approx(1 / (d * w) ** 0.5, rel=1e-15)
    assert learning_rate(4 * w, d) == pytest.approx(learning_rate(w, d) / 2, rel=1e-15)
    assert learning_rate(w // 2, d) == pytest.approx(learning_rate(w, d) / 2, rel=1e-15)
    assert learning_rate(7, 16, TrainingConfig(warmup_steps=4, learning_rate_scale=3.0)) == \
        pytest.approx(3.0 / (16 ** 0.5 * 7 ** 0.5), rel=1e-15)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="step must be an int >= 1"):
            learning_rate(bad, d)


def test_the_first_adam_step_is_the_sign_like_closed_form():
    """From zero moments the bias-corrected m_hat = g and v_hat = g^2, so the first update is
    -lrate(1) g / (|g| + eps) (Kingma & Ba, section 2)."""
    config = config_of("tiny")
    model = reference.build(config, seeded_params(config))
    before = reference.export_params(model)
    inputs = batches("tiny")[0]
    _, grads = reference.gradients(model, **inputs)
    reference.train_step(model, reference.optimizer(model, TRAINING), **inputs)
    lrate = (config.d_model ** -0.5) * TRAINING.warmup_steps ** -1.5
    for name, value in reference.export_params(model).items():
        expected = before[name] - lrate * grads[name] / (np.abs(grads[name]) + TRAINING.epsilon)
        assert tolerance.max_abs(value, expected) <= tolerance.float64_bound(before[name]), name


def test_adam_with_constant_gradients_takes_steps_of_the_learning_rate():
    """A gradient that never changes has m_hat = g and v_hat = g^2 at every step (the bias corrections undo the
    moving averages exactly), so each step moves every weight by lrate(t) g / (|g| + eps): a closed form of the
    whole run, step counting and bias correction included."""
    from reference_numpy.training import Adam
    rng = np.random.default_rng(0)
    grad = {"w": rng.standard_normal((3, 4))}
    params = {"w": np.zeros((3, 4))}
    settings = TrainingConfig(warmup_steps=3)
    optimizer = Adam(params, lambda t: learning_rate(t, 16, settings), settings)
    for _ in range(6):
        optimizer.update(grad)
    total = sum(learning_rate(t, 16, settings) for t in range(1, 7))
    expected = -total * grad["w"] / (np.abs(grad["w"]) + 1e-9)
    assert tolerance.max_abs(params["w"], expected) <= tolerance.float64_bound(expected)
    assert optimizer.step == 6


def test_the_loss_scale_halves_on_overflow_and_doubles_after_the_growth_interval():
    """Dynamic loss scaling as the recipe states it (precision.py): x 1/2 on a non-finite step, which also restarts
    the count; x 2 once ``growth_interval`` finite steps have followed one another."""
    scale = LossScale(1024.0, growth_interval=3)
    seen = []
    for finite in (True, True, True, True, False, True, True, True):
        scale.update(finite)
        seen.append(scale.value)
    assert seen == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 2048.0]


def test_mixed_precision_keeps_float32_masters_and_differentiates_their_rounding():
    """After a step the model's weights (the masters) are float32, Adam's moments float32, and the P model that the
    next step differentiates holds exactly the masters rounded to P."""
    config = config_of("tiny")
    model = reference.build(config, seeded_params(config), "float32", "cpu")
    mixed = reference.optimizer(model, TRAINING, None, "bfloat16")
    reference.train_step(model, mixed, **batches("tiny")[0])
    assert mixed.adam.step == 1
    for name, master in model.params.items():
        assert master.dtype == np.float32 and mixed.adam.first_moments[name].dtype == np.float32, name
        assert np.array_equal(mixed.low.params[name], round_to(master, "bfloat16"), equal_nan=True), name


@pytest.mark.parametrize("name", BACKENDS)
def test_a_float16_step_whose_gradients_overflow_is_skipped(name, monkeypatch):
    """A loss scale of 2^60 makes every float16 gradient overflow: the step changes no weight and no moment, does
    not count (t stays 0), and halves the scale; every backend alike."""
    monkeypatch.setattr(precision, "LOSS_SCALE", 2.0 ** 60)
    module, config = backend(name), config_of("tiny")
    model = module.build(config, seeded_params(config), "float32", "cpu")
    optimizer = module.optimizer(model, TRAINING, None, "float16")
    before = module.export_params(model)
    module.train_step(model, optimizer, **batches("tiny")[0])
    state = module.training_state(model, optimizer)
    assert state.step == 0 and module.loss_scale(optimizer) == 2.0 ** 59
    for tensor, value in module.export_params(model).items():
        assert np.array_equal(value, before[tensor]), tensor
        assert not state.first_moments[tensor].any() and not state.second_moments[tensor].any(), tensor


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_the_float16_loss_scale_doubles_after_the_growth_interval(name, monkeypatch):
    """With a growth interval of 2, two finite float16 steps double the scale (2^15 -> 2^16) and both count."""
    monkeypatch.setattr(precision, "LOSS_SCALE_GROWTH_INTERVAL", 2)
    module, config = backend(name), config_of("tiny")
    model = module.build(config, seeded_params(config), "float32", "cpu")
    optimizer = module.optimizer(model, TRAINING, None, "float16")
    scales = []
    for inputs in batches("tiny")[:3]:
        module.train_step(model, optimizer, **inputs)
        scales.append(module.loss_scale(optimizer))
    assert scales == [2.0 ** 15, 2.0 ** 16, 2.0 ** 16] and module.training_state(model, optimizer).step == 3
    assert module.loss_scale(module.optimizer(model, TRAINING, None, "bfloat16")) is None


# ----------------------------------------------------------------------------- float16's loss scale, saved and resumed

# With a first scale of 2^16 and a growth interval of 2, six float16 steps of "tiny" take the scale 2^16 -> 2^17 (two
# finite steps) -> 2^18 (two more), at which the fifth step's gradients overflow (the reference's gradients times
# 2^17 are finite, times 2^18 not): it is skipped and the scale halves. Saved after three steps (2^17, one good step),
# a run resumed without its scale would start again from 2^16 and overflow nowhere; without its good step, it
# would not double at the fourth.
FLOAT16_STEPS, FLOAT16_HALFWAY = 6, 3
FLOAT16_RESUMES = [(name, name) for name in BACKENDS] + [("numpy", "torch"), ("torch", "jax"), ("jax", "tf"),
                                                         ("tf", "numpy")]


def scale_float16_as_above(patch: pytest.MonkeyPatch) -> None:
    patch.setattr(precision, "LOSS_SCALE", 2.0 ** 16)
    patch.setattr(precision, "LOSS_SCALE_GROWTH_INTERVAL", 2)


@pytest.fixture
def float16_scaling(monkeypatch):
    scale_float16_as_above(monkeypatch)


@functools.cache
def float16_halves(name: str) -> tuple[Run, Run]:
    """FLOAT16_STEPS float16 steps of "tiny" in backend ``name``, scaled as above: the run after FLOAT16_HALFWAY
    steps and after all of them."""
    with pytest.MonkeyPatch.context() as patch:
        scale_float16_as_above(patch)
        return stages(name, "tiny", "float32", range(FLOAT16_STEPS), (FLOAT16_HALFWAY, FLOAT16_STEPS),
                      compute="float16")


# Up to 41 s for the first pair ending in TensorFlow (36 in a whole run): it runs the six uninterrupted float16 steps
# (float16_halves, then cached for the module), then the resumed three on the model it loads, TensorFlow tracing its
# loss-scaled step for each new model and optimizer; the other pairs take 0.6-16 s.
@pytest.mark.slow
@pytest.mark.parametrize("pair", FLOAT16_RESUMES, ids="-then-".join)
def test_a_float16_run_resumes_with_its_loss_scale(pair, float16_scaling, tmp_path):
    """Three float16 steps in one backend, saved with the training state, three more in another: the same loss
    scale, good steps and step count as six uninterrupted steps in the second backend (one of them skipped), and
    in one backend the same losses, weights and moments bit for bit."""
    first, second = pair
    whole = float16_halves(second)[1]
    assert whole.state.step == FLOAT16_STEPS - 1 and whole.state.loss_scale == LossScaleState(2.0 ** 17, 1)
    halfway = float16_halves(first)[0]
    module, path = backend(first), tmp_path / "run.safetensors"
    module.save(module.build(config_of("tiny"), halfway.params, "float32", "cpu"), path, halfway.state)
    state = load_training_state(path)
    assert state.step == FLOAT16_HALFWAY and state.loss_scale == LossScaleState(2.0 ** 17, 1)
    resumed = run(second, "tiny", "float32", steps=range(FLOAT16_HALFWAY, FLOAT16_STEPS), state=state,
                  params=backend(second).export_params(backend(second).load(path, "float32")), compute="float16")
    assert (resumed.state.step, resumed.state.loss_scale) == (whole.state.step, whole.state.loss_scale)
    losses = halfway.losses + resumed.losses
    if first != second:       # two frameworks' float16 steps agree to P's precision (test_ten_mixed_precision_...)
        np.testing.assert_allclose(losses, whole.losses, rtol=1e-2)
        return
    assert losses == whole.losses
    for tensor, value in whole.params.items():
        assert np.array_equal(resumed.params[tensor], value), tensor
        assert np.array_equal(resumed.state.first_moments[tensor], whole.state.first_moments[tensor]), tensor
        assert np.array_equal(resumed.state.second_moments[tensor], whole.state.second_moments[tensor]), tensor


@pytest.mark.parametrize("name", BACKENDS)
def test_only_a_float16_run_has_a_loss_scale_and_an_old_state_starts_from_the_first(name, float16_scaling):
    """float32 and bfloat16 runs save none; a float16 run resumed from a state without one (a float32 run's, or a
    file saved before the scale was kept) starts from ``LOSS_SCALE`` with no good steps."""
    module, config = backend(name), config_of("tiny")
    model = module.build(config, seeded_params(config), "float32", "cpu")
    for compute in (None, "bfloat16"):
        assert module.training_state(model, module.optimizer(model, TRAINING, None, compute)).loss_scale is None
    state = module.training_state(model, module.optimizer(model, TRAINING))
    resumed = module.optimizer(model, None, state, "float16")
    assert module.training_state(model, resumed).loss_scale == LossScaleState(2.0 ** 16, 0)
    assert module.loss_scale(resumed) == 2.0 ** 16


BAD_LOSS_SCALES = [
    (LossScaleState(-1.0, 0), "training loss_scale.value must be a finite float32 number > 0, got -1.0"),
    (LossScaleState(0.0, 0), "training loss_scale.value must be a finite float32 number > 0, got 0.0"),
    (LossScaleState(float("inf"), 0), "training loss_scale.value must be a finite float32 number > 0, got inf"),
    (LossScaleState(float("nan"), 0), "training loss_scale.value must be a finite float32 number > 0, got nan"),
    (LossScaleState(1e39, 0), "training loss_scale.value must be a finite float32 number > 0, got 1e+39"),
    (LossScaleState(0.1, 0), "training loss_scale.value must be a finite float32 number > 0, got 0.1"),
    (LossScaleState(2.0 ** 15, -1),
     "training loss_scale.good_steps must be an int in [0, 2) (the growth interval), got -1"),
    (LossScaleState(2.0 ** 15, 2),
     "training loss_scale.good_steps must be an int in [0, 2) (the growth interval), got 2"),
    (LossScaleState(2.0 ** 15, 1.0),
     "training loss_scale.good_steps must be an int in [0, 2) (the growth interval), got 1.0"),
]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_bad_loss_scale_is_refused_alike_in_every_backend(name, float16_scaling):
    """One ``ValueError`` naming the field, the reference's (``validate_loss_scale``), before any framework work."""
    module, config = backend(name), config_of("tiny")
    model = module.build(config, seeded_params(config), "float32", "cpu")
    state = module.training_state(model, module.optimizer(model, TRAINING))
    for bad, message in BAD_LOSS_SCALES:
        with pytest.raises(ValueError) as caught:
            module.optimizer(model, None, state._replace(loss_scale=bad), "float16")
        assert str(caught.value) == message


def test_a_bad_loss_scale_in_a_file_is_refused_naming_the_file_and_the_field(float16_scaling, tmp_path):
    """A file whose ``training`` record holds a bad scale (written around ``save_checkpoint``, which refuses one),
    or a malformed one, is refused when read: one ``ValueError``."""

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    config = config_of("tiny")
    model = reference.build(config, seeded_params(config), "float32", "cpu")
    good = tmp_path / "good.safetensors"
    reference.save(model, good, reference.training_state(model, reference.optimizer(model, TRAINING, None,
                                                                                     "float16")))
    with safe_open(good, "numpy") as handle:
        metadata = handle.metadata()
    record = json.loads(metadata["training"])
    assert record["loss_scale"] == {"value": 2.0 ** 16, "good_steps": 0}
    for index, (scale, problem) in enumerate([({"value": -1.0, "good_steps": 0}, BAD_LOSS_SCALES[0][1]),
                                              ({"value": float("inf"), "good_steps": 0}, BAD_LOSS_SCALES[2][1]),
                                              ({"value": 2.0 ** 15, "good_steps": 2}, BAD_LOSS_SCALES[7][1]),
                                              ({"value": 2.0 ** 15},
                                               "training record field 'loss_scale.good_steps' is missing"),
                                              ([2.0 ** 15, 0], "training record field 'loss_scale' must be a JSON "
                                                               "object, got [32768.0, 0]")]):
        bad = tmp_path / f"bad{index}.safetensors"
        save_file(load_file(good), bad, {**metadata, "training": json.dumps({**record, "loss_scale": scale})})
        with pytest.raises(ValueError) as caught:
            load_training_state(bad)
        assert str(caught.value).startswith(f"checkpoint {str(bad)!r}: {problem}"), str(caught.value)


# ----------------------------------------------------------------------------- the weights a model holds

@pytest.mark.parametrize("name", BACKENDS)
def test_a_model_owns_its_weights_so_training_leaves_the_callers_arrays_alone(name):
    """A step of a model built from a dictionary changes that model's weights only: the dictionary, and a second
    model built from it, stay as they were -- the reference as every port (its Adam updates the model's arrays in
    place, which were the caller's when their dtype matched)."""
    adapter = backend(name)
    config, batch = config_of("tiny"), batches("tiny")[0]
    params = seeded_params(config)
    before = {tensor: value.copy() for tensor, value in params.items()}
    trained, untouched = adapter.build(config, params), adapter.build(config, params)
    adapter.train_step(trained, adapter.optimizer(trained, TRAINING), batch["src"], batch["tgt"], batch["labels"])
    moved = adapter.export_params(trained)
    assert any(not np.array_equal(moved[tensor], before[tensor]) for tensor in before)
    kept = adapter.export_params(untouched)
    for tensor, value in before.items():
        assert np.array_equal(params[tensor], value) and np.array_equal(kept[tensor], value), tensor


def test_the_reference_takes_the_callers_arrays_when_asked_and_never_rounds_into_them():
    """``copy=False`` (a loader handing its arrays over) holds the caller's arrays already in the model's dtype; a
    model in another dtype holds its own roundings either way."""
    from reference_numpy import Transformer

    config = config_of("tiny")
    params = seeded_params(config)
    assert all(value is params[tensor] for tensor, value in Transformer(config, params, copy=False).params.items())
    for copy in (True, False):
        model = Transformer(config, params, np.float32, copy=copy)
        assert not any(np.may_share_memory(value, params[tensor]) for tensor, value in model.params.items())
    assert not any(np.may_share_memory(value, params[tensor])
                   for tensor, value in Transformer(config, params).params.items())
