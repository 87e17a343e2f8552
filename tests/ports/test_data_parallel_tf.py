"""Data parallelism in the TensorFlow port (``transformer_tf/data_parallel.py``: a ``MirroredStrategy`` over logical
CPU devices, Keras's optimizer summing the replicas' gradients) against the reference's single-process training
(section 5), float64, dropout off, on batches whose shards hold different numbers of real labels (section 5.4's mean
is over the whole batch's labels): weights, both Adam moments and every step's loss within
``equivalence.tolerance.TrainingBound``, the derived bound of tests/equivalence/test_training.py.

The runs happen in two subprocesses (``tests/runners/data_parallel_tf_runner.py``): the logical devices must be made
before TensorFlow initialises. The reference runs here, in NumPy."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from data_parallel_tf_runner import CONFIG, HALFWAY, RESUMED_WORLD_SIZE, STEPS, TRAINING, WORLD_SIZE, batch

from equivalence import tolerance, training_runs
from equivalence.cases import seeded_params
from equivalence.training_runs import Run
from reference_numpy import Transformer, data_parallel, training
from reference_numpy.checkpoint import load_run, save_checkpoint

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="tensorflow is not installed (pip install '.[tf]')")

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "runners" / "data_parallel_tf_runner.py"
PARTS = ("library", "train")
WORST: dict[str, dict[str, float]] = {}     # check -> quantity -> worst error / bound, printed with -s


@functools.cache
def expected(steps: int) -> tuple[Run, tolerance.TrainingBound]:
    """The reference's single-process run of the first ``steps`` batches and its float64 bound."""
    return training_runs.reference_run(CONFIG, seeded_params(CONFIG), TRAINING, [batch(step) for step in range(steps)])


def resumed_reference(path: Path) -> Run:
    """The reference continuing the run saved at ``path`` to step ``STEPS``."""
    config, params, state = load_run(path)
    model = Transformer(config, params)
    optimizer = training.optimizer(model, None, state)
    losses = [training.train_step(model, optimizer, **batch(step)) for step in range(state.step, STEPS)]
    return Run(losses, model.params, training.training_state(model, optimizer))


# About 55 s alone (up to 2 minutes in a whole run, beside the other worker: 116 s with the compilation cache filled,
# 132 s on a clean clone), paid by the module's first test: two processes (one per core, each importing TensorFlow and
# tracing its training step) run every data-parallel run the module checks, once; a test process cannot host them,
# since TensorFlow fixes its logical CPU devices at start-up.
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[tuple[Path, dict]]:
    """Both parts of the runner at once (one per core), after the reference's halfway checkpoint is written; the
    worst error / bound of every check is printed at the end (``-s``)."""
    out = tmp_path_factory.mktemp("data_parallel_tf")
    halfway = expected(HALFWAY)[0]
    save_checkpoint(out / "reference5.safetensors", CONFIG, halfway.params, halfway.state)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [subprocess.Popen([sys.executable, str(RUNNER), part, str(out)], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in PARTS]
    try:
        outputs = [child.communicate(timeout=600) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    report = {}
    for part, child, (stdout, stderr) in zip(PARTS, children, outputs):
        assert child.returncode == 0, f"runner part {part!r} failed:\n{stderr[-4000:]}"
        report.update(json.loads(stdout.splitlines()[-1]))
    yield out, report
    print("\nworst error / bound of each TensorFlow data-parallel check:", *(
        f"  {who}: " + ", ".join(f"{what} {ratio:.2g}" for what, ratio in ratios.items())
        for who, ratios in WORST.items()), sep="\n")


def saved(out: Path, name: str, losses: list[float]) -> Run:
    """A run the runner saved as ``name``, with its ``losses``."""
    _, params, state = load_run(out / f"{name}.safetensors")
    return Run(losses, params, state)


def assert_within_bound(result: Run, reference: Run, bound: tolerance.TrainingBound, who: str) -> None:
    """``result`` within ``bound`` of ``reference`` (every loss, weight and Adam moment,
    ``training_runs.assert_float64_run``); the worst error / bound of each quantity is kept for the printout."""
    training_runs.assert_float64_run(result, reference, bound, who)
    worst = {"loss": max(abs(a - b) / limit for a, b, limit in zip(result.losses, reference.losses, bound.losses))}
    for name, value in reference.params.items():
        pairs = {"weights": (result.params[name], value, bound.weight_bound(name, value)),
                 "first moment": (result.state.first_moments[name], reference.state.first_moments[name],
                                  bound.first_moment_bound(name, reference.state.first_moments[name])),
                 "second moment": (result.state.second_moments[name], reference.state.second_moments[name],
                                   bound.second_moment_bound(name, reference.state.second_moments[name]))}
        for what, (mine, theirs, limit) in pairs.items():
            worst[what] = max(worst.get(what, 0.0), float(np.max(np.abs(mine - theirs) / limit)))
    WORST[who] = worst


def test_the_batches_shards_hold_different_numbers_of_real_labels():
    """The premise of every check here: each replica's own count differs from the whole batch's share."""
    labels = batch(0)["labels"]
    for world_size in (WORLD_SIZE, RESUMED_WORLD_SIZE):
        counts = [data_parallel.token_count(data_parallel.shard(batch(0), world_size, rank)["labels"], CONFIG.pad_id)
                  for rank in range(world_size)]
        assert len(set(counts)) == world_size and sum(counts) == data_parallel.token_count(labels, CONFIG.pad_id)


def test_data_parallel_steps_are_the_single_process_steps(runs):
    """Five steps over two replicas == five steps of the port's own single-process ``train_step`` on the whole batch
    == five reference steps; every step's loss too."""
    out, report = runs
    parallel = saved(out, "parallel5", report["parallel"][:HALFWAY])
    reference, bound = expected(HALFWAY)
    assert_within_bound(parallel, saved(out, "single5", report["single"]), bound,
                        f"{WORLD_SIZE} replicas vs single-process TensorFlow, 5 steps")
    assert_within_bound(parallel, reference, bound, f"{WORLD_SIZE} replicas vs the reference, 5 steps")


def test_ten_data_parallel_steps_are_ten_reference_steps(runs):
    out, report = runs
    assert_within_bound(saved(out, "parallel10", report["parallel"]), *expected(STEPS),
                        f"{WORLD_SIZE} replicas vs the reference, 10 steps")


def test_train_resumes_a_single_process_checkpoint(runs):
    """``data_parallel.train`` over four replicas (one row each) from the reference's checkpoint after five steps:
    the uninterrupted ten reference steps; ``progress`` saw every global step and its loss."""
    out, report = runs
    reference, bound = expected(STEPS)
    resumed = saved(out, "reference5_parallel5", reference.losses[:HALFWAY] + report["resumed"])
    assert_within_bound(resumed, reference, bound, f"train() over {RESUMED_WORLD_SIZE} replicas, resumed at step 5")
    assert report["progress"] == [[step, loss] for step, loss in zip(range(HALFWAY, STEPS), report["resumed"])]


def test_a_single_process_run_resumes_a_data_parallel_checkpoint(runs):
    """The data-parallel run's checkpoint after five steps is the shared format: the reference continues it to the
    uninterrupted ten reference steps."""
    out, report = runs
    resumed = resumed_reference(out / "parallel5.safetensors")
    resumed.losses = report["parallel"][:HALFWAY] + resumed.losses
    assert_within_bound(resumed, *expected(STEPS), "the reference resumed from a data-parallel checkpoint")


def test_a_shard_without_real_labels_adds_nothing(runs):
    """An eleventh step whose first shard holds no real label: the reference's eleven steps."""
    out, report = runs
    assert data_parallel.token_count(data_parallel.shard(batch(STEPS), WORLD_SIZE, 0)["labels"], CONFIG.pad_id) == 0
    assert isinstance(report["empty_shard"], float), report["empty_shard"]     # else the error saving the weights
    assert_within_bound(saved(out, f"parallel{STEPS + 1}", report["parallel"] + [report["empty_shard"]]),
                        *expected(STEPS + 1), f"{WORLD_SIZE} replicas, a shard without real labels")


def test_each_replica_holds_consecutive_rows_on_its_own_device(runs):
    """Replica r holds rows r B/N .. (r + 1) B/N - 1 (the reference's ``shard``). Parity alone cannot show it: the
    shards' summed gradient is the same for any split of the rows (and with N = B any split is one row each)."""
    _, report = runs
    for world_size, arrays in report["replicas"].items():
        world_size = int(world_size)                                         # a JSON key
        for name, replicas in arrays.items():
            assert len(replicas) == world_size
            for rank, (device, rows) in enumerate(replicas):
                assert device.endswith(f"/device:CPU:{rank}"), (world_size, name, rank, device)
                np.testing.assert_array_equal(rows, data_parallel.shard(batch(0), world_size, rank)[name])


def test_bad_input_gets_the_single_process_errors(runs):
    _, report = runs
    errors = report["errors"]
    expected = {"split": raised(data_parallel.shard_rows, 3, WORLD_SIZE, 0),
                "all_pad": raised(training.check_token_count, 0, None),
                "epsilon": raised(training.label_smoothed_cross_entropy, np.zeros((1, 1, 2)), np.ones((1, 1), int), 0,
                                  1.0),
                "src_id": raised(Transformer(CONFIG, seeded_params(CONFIG)),
                                 np.full_like(batch(0)["src"], CONFIG.src_vocab_size), batch(0)["tgt"]),
                "world_size": raised(data_parallel.shard_rows, 1, 0, 0)}
    assert {name: errors[name] for name in expected} == expected
    assert errors["device"] == "device must be 'cpu' or 'gpu' (every replica one device), got 'tpu'"
    assert errors["too_many_cpus"].startswith(f"world_size {WORLD_SIZE + 1} needs {WORLD_SIZE + 1} logical CPU "
                                              f"devices, but TensorFlow has already initialised with {WORLD_SIZE}")
    assert errors["outside_scope"].startswith("model: its variables were not created under strategy.scope()")
    assert errors["fewer_cpus"] == "no error"                       # 1 logical CPU of the 2 made is enough
    assert errors["steps"] == "steps must be an int >= 0, got -1"
    assert errors["first_step"] == "first_step must be an int >= 0, got True"
    assert all("\n" not in message for message in errors.values())


def raised(function, *args) -> str:
    with pytest.raises(ValueError) as error:
        function(*args)
    return str(error.value)
