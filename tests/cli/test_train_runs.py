"""``train``'s runs through the command: ``--resume`` continuing a run bit for bit in every backend and across
``--data-parallel``, handing the port's optimizer the file's moments without a copy, and refusing a bad saved run
(its record from the file's header, before any backend loads; its values in each backend)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from in_process import cli
from support import BACKENDS, FRAMEWORKS, adam_moment_memory, backend, checkpoint_with

from equivalence.training_runs import Run, assert_float64_run, reference_run
from reference_numpy import init_params
from reference_numpy.checkpoint import load_run, load_training_state
from reference_numpy.config import TrainingConfig
from transformer_cli.commands import train as train_command
from transformer_cli.main import EXIT_USAGE, build_parser, main
from transformer_tasks.copy import CopyTask

COPY_RUN = ("--symbols", "4", "--max-length", "4", "--batch-size", "8", "--warmup-steps", "20", "--eval-size", "0")


def train_cli(capsys, *args: str) -> dict:
    status = main(["train", "--json", *COPY_RUN, *args])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)[0]


# The JAX case takes about 30 s: it compiles the copy model's training step twice, for the model the command builds
# and for the one it loads to resume (a loaded model's graph also holds its tokenizer), about 15 s each.
@pytest.mark.slow
@pytest.mark.parametrize("name", BACKENDS)
def test_train_resume_continues_the_run_bit_for_bit(name, tmp_path, monkeypatch, capsys):
    """``train --resume`` in each backend (its own loader and ``load_training_state``): two steps saved and two
    resumed give the losses of four steps in one run, bit for bit, and the resumed run saves step 4."""
    backend(name)
    monkeypatch.chdir(tmp_path)
    whole = train_cli(capsys, "--backends", name, "--steps", "4")
    first = train_cli(capsys, "--backends", name, "--steps", "2", "--out", "run.safetensors")
    rest = train_cli(capsys, "--backends", name, "--steps", "2", "--resume", "run.safetensors", "--out",
                     "rest.safetensors")
    assert rest["first_step"] == 2 and first["losses"] + rest["losses"] == whole["losses"]
    assert load_training_state(tmp_path / "rest.safetensors").step == 4


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_train_resume_gives_the_optimizer_the_files_moments_held_once(name, tmp_path, monkeypatch, capsys):
    """``train --resume`` holds no NumPy copy of the run: the plan keeps the file's path and its header's training
    record (no arrays), and the port's optimizer is set up with the very state its ``load_training_state`` read, its
    Adam's m and v living where that state's arrays do and equal to the file's, bit for bit."""
    adapter = backend(name)
    monkeypatch.chdir(tmp_path)
    train_cli(capsys, "--steps", "3", "--out", "run.safetensors")                     # the reference's run
    saved = load_training_state(tmp_path / "run.safetensors")
    args = build_parser().parse_args(["train", "--backends", name, "--resume", "run.safetensors", "--steps", "1",
                                      *COPY_RUN])
    plan = train_command.plan_from(args)
    assert plan.start == train_command.Resumed("run.safetensors", train_command.TrainingRecord(saved.config, 3, None))
    assert plan.first_step == 3
    seen: dict = {}
    load, optimizer = adapter.load_training_state, adapter.optimizer

    def loading(path, dtype=None):
        seen["read"] = load(path, dtype)
        return seen["read"]

    def setting_up(model, config=None, state=None, dtype=None):
        made = optimizer(model, config, state, dtype)
        seen.update(given=state, memory=adam_moment_memory(name, model, made),
                    resumed=adapter.training_state(model, made))
        return made

    monkeypatch.setattr(adapter, "load_training_state", loading)
    monkeypatch.setattr(adapter, "optimizer", setting_up)
    result, _, _ = train_command.train(adapter, plan)
    assert result.first_step == 3 and len(result.losses) == 1
    read = seen["read"]
    assert seen["given"] is read
    assert seen["memory"] == {tensor: (read.first_moments[tensor].ctypes.data, read.second_moments[tensor].ctypes.data)
                              for tensor in saved.first_moments}
    assert seen["resumed"].step == 3
    for moments, expected in ((seen["resumed"].first_moments, saved.first_moments),
                              (seen["resumed"].second_moments, saved.second_moments)):
        for tensor, value in expected.items():
            assert moments[tensor].dtype == value.dtype and moments[tensor].tobytes() == value.tobytes(), tensor


def test_train_resume_checks_the_saved_run_before_any_backend_and_its_values_in_each(tmp_path, monkeypatch, capsys):
    """A bad training record (and a missing moment) is refused from the file's header, before any backend loads; a
    moment that is not finite is refused by each backend as it reads it: the reference's message, naming the file and
    the tensor, in every backend."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    monkeypatch.chdir(tmp_path)
    train_cli(capsys, "--steps", "1", "--out", "run.safetensors")
    with safe_open("run.safetensors", "numpy") as handle:
        metadata = handle.metadata()
    tensors, record = load_file("run.safetensors"), json.loads(metadata["training"])
    save_file(tensors, "step.safetensors", {**metadata, "training": json.dumps({**record, "step": -1})})
    save_file({k: v for k, v in tensors.items() if k != "adam.m.generator.weight"}, "missing.safetensors", metadata)
    tensors["adam.v.generator.weight"][0, 0] = np.nan
    save_file(tensors, "nan.safetensors", metadata)
    for path, problem in (("step.safetensors", "training step must be an int >= 0, got -1"),
                          ("missing.safetensors", "missing tensor 'adam.m.generator.weight'")):
        assert main(["train", "--backends", "numpy", "--resume", path, "--steps", "1", *COPY_RUN]) != 0
        assert f"checkpoint {path!r}: {problem}" in capsys.readouterr().err
    for name in [name for name in BACKENDS if name == "numpy" or importlib.util.find_spec(FRAMEWORKS[name])]:
        assert main(["train", "--backends", name, "--resume", "nan.safetensors", "--steps", "1", *COPY_RUN]) != 0
        err = capsys.readouterr().err
        assert ("checkpoint 'nan.safetensors': tensor 'adam.v.generator.weight' holds non-finite or negative "
                "values") in err, (name, err)


def test_train_data_parallel_in_the_reference_continues_a_single_process_run(tmp_path, capsys):
    """``train --data-parallel 2`` (the reference's shards, in pieces between validation checks): its losses are
    the single-process run's, and it resumes a single-process run's checkpoint and is resumed by one."""

    def run(*args: str) -> list[float]:
        assert main(["train", "--symbols", "4", "--max-length", "4", "--batch-size", "8", "--warmup-steps", "20",
                     "--eval-size", "0", "--dtype", "float64", "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)[0]["losses"]

    path = str(tmp_path / "run.safetensors")
    whole = run("--steps", "6", "--out", str(tmp_path / "whole.safetensors"))
    first = run("--steps", "2", "--out", path)
    middle = run("--steps", "2", "--data-parallel", "2", "--resume", path, "--out", path, "--force")
    last = run("--steps", "2", "--resume", path, "--out", path, "--force")
    task, training_config = CopyTask(4, 4), TrainingConfig(warmup_steps=20, learning_rate_scale=0.5)
    config = task.config(dropout=0.0)
    expected, bound = reference_run(config, init_params(config, seed=0), training_config,
                                    [task.batch(config, 8, step, 0) for step in range(6)])
    _, params, state = load_run(path)
    assert_float64_run(Run(first + middle + last, params, state), expected, bound, "reference: 2 + 2 shards + 2")
    assert whole == expected.losses                      # the command's single-process run is the reference's


@pytest.mark.parametrize("backend", BACKENDS)
def test_resuming_a_run_whose_record_is_a_list_is_one_line_before_any_backend_loads(backend, tmp_path, monkeypatch,
                                                                                     capsys):
    """The AttributeError of issue 42 (an internal error): ``train --resume`` reads the record from the header."""
    from equivalence import backends
    monkeypatch.chdir(tmp_path)
    checkpoint_with(tmp_path / "run.safetensors", training=json.dumps([3, {}]))
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the record was read"))
    status, out, err = cli(capsys, "train", "--backends", backend, "--resume", "run.safetensors", "--steps", "1")
    assert status == EXIT_USAGE and out == ""
    assert err == ("transformer-reference: error: checkpoint 'run.safetensors': training record must be a JSON "
                   "object, got [3, {}]\n")
