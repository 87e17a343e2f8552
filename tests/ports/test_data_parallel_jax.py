"""Data-parallel training in the JAX port (``transformer_jax/data_parallel.py``): a batch sharded over a mesh of 2
and of 4 CPU devices trains as the whole batch in one process (section 5), float64, dropout 0, against the
reference's single-process steps within ``equivalence.tolerance.TrainingBound`` (the derived gradient bound carried
through Adam, as tests/equivalence/test_training.py uses it), on batches whose shards hold different numbers of real
labels; a run moves between single-process and data-parallel through the shared checkpoint. JAX creates its CPU devices
at start-up, so the runs happen in ``tests/runners/data_parallel_jax_runner.py``, in a process of its own."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install '.[jax]')")
pytest.importorskip("flax", reason="Flax is not installed (pip install '.[jax]')")

import data_parallel_jax_runner as runner  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from equivalence import tolerance  # noqa: E402
from equivalence.backends import numpy as reference  # noqa: E402
from equivalence.cases import seeded_params  # noqa: E402
from reference_numpy import data_parallel as reference_data_parallel  # noqa: E402
from reference_numpy import training as reference_training  # noqa: E402
from reference_numpy.checkpoint import load_run  # noqa: E402
from transformer_jax import training  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG, TRAINING, STEPS, HALF = runner.CONFIG, runner.TRAINING, runner.STEPS, runner.HALF
WORST: dict[str, dict[str, float]] = {}     # check -> quantity -> worst error / bound, printed with -s


# About 45 s (71 s on a clean clone, in a whole run), paid by the module's first test: one process with 4 host devices
# (JAX creates them at start-up, so not in a test process) runs every data-parallel run the module checks, once,
# compiling each mesh's step (with the run's own XLA_FLAGS, tests/conftest.py's code generation or a kernel family's,
# beside the device count).
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runner's JSON and the directory of its checkpoints."""
    out = tmp_path_factory.mktemp("data_parallel_jax")
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={runner.DEVICES}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags).strip()}
    done = subprocess.run([sys.executable, runner.__file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["devices"] == runner.DEVICES
    yield result, out
    print("\nworst error / bound of each data-parallel check:", *(
        f"  {check}: " + ", ".join(f"{what} {ratio:.2g}" for what, ratio in worst.items())
        for check, worst in WORST.items()), sep="\n")


def saved(runs, name: str, earlier: str | None = None) -> tuple[dict, object, list[float]]:
    """A run the runner saved: (weights, training state, losses), after the losses of the ``earlier`` run it
    resumed."""
    result, out = runs
    _, params, state = load_run(out / f"{name}.safetensors")
    return params, state, (result["losses"][earlier] if earlier else []) + result["losses"][name]


@functools.cache
def reference_run(steps: int) -> tuple[tuple[dict, object, list[float]], tolerance.TrainingBound]:
    """The reference's single-process run of ``steps`` steps on the runner's batches, as (weights, state, losses),
    and the TrainingBound that accounts for it step by step (gradients before each step, moments after it)."""
    model = reference.build(CONFIG, seeded_params(CONFIG))
    optimizer = reference.optimizer(model, TRAINING)
    bound, losses = tolerance.TrainingBound(reference.export_params(model)), []
    for step in range(1, steps + 1):
        inputs = runner.batch(step - 1)
        value, grads = reference.gradients(model, **inputs)
        losses.append(reference.train_step(model, optimizer, **inputs))
        state = reference.training_state(model, optimizer)
        bound.step(value, grads, state.first_moments, state.second_moments, step,
                   reference_training.learning_rate(step, CONFIG.d_model, TRAINING), TRAINING.beta1, TRAINING.beta2,
                   TRAINING.epsilon)
    return (reference.export_params(model), state, losses), bound


def assert_within_bound(run, expected=None, factor: float = 1.0) -> dict[str, float]:
    """``run`` (weights, state, losses) against the reference's run of as many steps (or against ``expected``, a
    run within the bound of it, with ``factor`` = 2: two runs each within the bound of the reference are within
    twice it of each other): losses, weights and both Adam moments within the TrainingBound. Returns the worst
    error / bound of each."""
    (reference_params, reference_state, reference_losses), bound = reference_run(len(run[2]))
    params, state, losses = expected or (reference_params, reference_state, reference_losses)
    assert run[1].step == len(run[2]) and run[1].config == TRAINING
    worst = {"loss": 0.0, "weights": 0.0, "first moment": 0.0, "second moment": 0.0}
    for step, (value, other, limit) in enumerate(zip(run[2], losses, bound.losses), 1):
        assert abs(value - other) <= factor * limit, f"loss at step {step}: {value} vs {other}"
        worst["loss"] = max(worst["loss"], abs(value - other) / (factor * limit))
    for name, value in reference_params.items():
        limits = {"weights": bound.weight_bound(name, value),
                  "first moment": bound.first_moment_bound(name, reference_state.first_moments[name]),
                  "second moment": bound.second_moment_bound(name, reference_state.second_moments[name])}
        compared = {"weights": (run[0][name], params[name]),
                    "first moment": (run[1].first_moments[name], state.first_moments[name]),
                    "second moment": (run[1].second_moments[name], state.second_moments[name])}
        for what, (got, want) in compared.items():
            ratio = np.abs(got - want) / (factor * np.broadcast_to(limits[what], np.shape(want)))
            at = np.unravel_index(np.argmax(ratio), ratio.shape)
            assert ratio[at] <= 1, f"{what} of {name!r} at {at}: error / bound {ratio[at]:.3g}"
            worst[what] = max(worst[what], float(ratio[at]))
    return worst


def test_one_step_is_the_single_process_step(runs):
    """One step over 2 devices, the halves holding 3 and 11 real labels: the reference's single-process step on the
    whole batch, and the port's own single-process step."""
    parallel, single = saved(runs, "dp2-1"), saved(runs, "single-1")
    WORST["one step, N = 2"] = assert_within_bound(parallel)
    WORST["one step, single process"] = assert_within_bound(single)
    WORST["one step, N = 2 vs single process (2x)"] = assert_within_bound(parallel, single, factor=2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ten_steps_are_the_references(runs, world_size):
    """Ten steps over N devices (shards of different real-label counts; at the last step a shard without any) end
    where ten reference steps end; ``progress`` saw every step's whole-batch loss."""
    run = saved(runs, f"dp{world_size}-{STEPS}")
    WORST[f"ten steps, N = {world_size}"] = assert_within_bound(run)
    if world_size == 2:
        assert runs[0]["progress"] == [[step, loss] for step, loss in enumerate(run[2])]


@pytest.mark.parametrize("first, then", [("single", "dp2"), ("dp2", "single")])
def test_a_run_moves_between_single_process_and_data_parallel(runs, first, then):
    """Five steps, saved in the shared format and read back with ``load_run``, five more the other way: the ten
    reference steps (as the uninterrupted runs, which are within the same bound)."""
    name = f"{first}-then-{then}" + ("" if then == "dp2" else f"-{STEPS}")
    WORST[f"{first} 5 + {then} 5"] = assert_within_bound(saved(runs, name, earlier=f"{first}-{HALF}"))


def test_the_first_step_replicates_the_whole_model_and_optimizer(runs):
    """A model built on one device: after the first step every array of its state and its optimizer's (weights,
    Adam's moments, step counts, dropout streams) lies replicated on every device of the mesh."""
    assert runs[0]["replicated"] == [False, True]


@pytest.mark.parametrize("world_size", [2, 4])
def test_device_r_holds_rows_r_b_over_n_onward(runs, world_size):
    """The shard of the r-th device of the mesh is rows r B/N .. (r + 1) B/N - 1 (the reference's shard)."""
    result, _ = runs
    expected = [reference_data_parallel.shard(runner.batch(0), world_size, rank)["labels"].tolist()
                for rank in range(world_size)]
    assert result["rows"][str(world_size)] == expected


def test_bad_requests_give_one_line_value_errors(runs):
    """Too few devices says how to get them; a batch that does not split, an all-pad batch and a bad count are the
    single-process and the reference's errors."""
    errors = runs[0]["errors"]
    assert errors["too many devices"] == (
        f"world_size {runner.DEVICES + 4} needs {runner.DEVICES + 4} cpu devices and JAX sees {runner.DEVICES}: start "
        f"the process with XLA_FLAGS=--xla_force_host_platform_device_count={runner.DEVICES + 4} (JAX reads it only "
        f"at start-up)")
    with pytest.raises(ValueError) as uneven:
        reference_data_parallel.shard_rows(runner.BATCH, 3, 0)
    assert errors["uneven split"] == str(uneven.value)
    assert errors["world_size 0"] == "world_size must be an int >= 1, got 0"
    assert errors["device"] == "device must be 'cpu' or 'gpu' for data parallelism, got 'tpu'"
    assert errors["all pad"] == "labels hold no non-pad token; the loss is undefined"
    assert errors["steps"] == "steps must be an int >= 0, got -1"
    assert all("\n" not in message for message in errors.values())


# ----------------------------------------------------------------------------- the loss's token count (section 5.4)

def test_the_shards_losses_with_the_batchs_count_add_up_to_the_batchs_loss():
    """sum over shards of loss(shard, tokens=n) = loss(batch) = the reference's loss, eagerly and compiled (traced
    labels); a count below a shard's own real labels is the reference's error where the labels can be counted (not
    traced: then only the count itself is checked). ``loss`` hands ``tokens`` on (a stand-in model returns fixed
    log-probabilities: the model itself is checked elsewhere)."""
    inputs = runner.batch(0)
    n = reference_data_parallel.token_count(inputs["labels"], CONFIG.pad_id)
    logits = np.random.default_rng(0).normal(size=(*inputs["labels"].shape, CONFIG.tgt_vocab_size))
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    expected = reference_training.label_smoothed_cross_entropy(log_probs, inputs["labels"], CONFIG.pad_id)
    halves = [reference_data_parallel.shard_rows(len(log_probs), 2, rank) for rank in range(2)]
    with jax.enable_x64(True):
        labels = jnp.asarray(inputs["labels"])
        compiled = jax.jit(training.label_smoothed_cross_entropy, static_argnames=("pad_id", "tokens"))
        for loss in (training.label_smoothed_cross_entropy, compiled):
            whole = float(loss(jnp.asarray(log_probs), labels, pad_id=CONFIG.pad_id))
            parts = [float(loss(jnp.asarray(log_probs[rows]), labels[rows], pad_id=CONFIG.pad_id, tokens=n))
                     for rows in halves]
            assert abs(whole - expected) <= tolerance.float64_bound(expected)
            assert abs(sum(parts) - expected) <= tolerance.float64_bound(expected)
            with pytest.raises(ValueError, match=r"^tokens must be an int >= 1 and >= the labels' \d+ non-pad tokens, "
                                                 r"got True"):
                loss(jnp.asarray(log_probs), labels, pad_id=CONFIG.pad_id, tokens=True)
        with pytest.raises(ValueError) as reference_error:                  # the first half holds 3 real labels
            reference_training.label_smoothed_cross_entropy(log_probs[halves[0]], inputs["labels"][halves[0]],
                                                            CONFIG.pad_id, tokens=2)
        with pytest.raises(ValueError) as error:
            training.label_smoothed_cross_entropy(jnp.asarray(log_probs[halves[0]]), labels[halves[0]],
                                                  CONFIG.pad_id, tokens=2)
        assert str(error.value) == str(reference_error.value)
        model = StandIn(CONFIG, jnp.asarray(log_probs[halves[1]]))
        value = float(training.loss(model, inputs["src"][halves[1]], inputs["tgt"][halves[1]], labels[halves[1]],
                                    tokens=n))
        assert abs(value - parts[1]) <= tolerance.float64_bound(parts[1])


class StandIn:
    """A model that returns fixed log-probabilities, whatever its input."""

    def __init__(self, config, log_probs):
        self.config, self.log_probs = config, log_probs

    def __call__(self, src, tgt, deterministic=None):
        return self.log_probs

    def _check_inputs(self, src, tgt, src_mask, tgt_mask):
        return jnp.asarray(src), jnp.asarray(tgt)
