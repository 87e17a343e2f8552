"""``--dtype`` through the command: ``compare`` and ``translate`` in the autocast recipe (``mixed-bfloat16``,
``mixed-float16``; tests/ports/test_mixed_precision.py checks the recipe in every backend), ``train`` in it in the
reference and PyTorch alike, resumed from its saved loss scale, and a precision that is no name refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from in_process import cli


# About 30 s: every backend's forward pass and greedy decoding under its framework's mixed-precision switch, compiled
# for the recipe (programs of their own), as the command runs them.
@pytest.mark.slow
def test_compare_dtype_mixed_bfloat16_exits_0(capsys):
    """``compare --dtype mixed-bfloat16``: every installed backend under its framework's switch agrees with the
    reference in the recipe (exit 0), its column named ``mixed-bf16``."""
    status, out, err = cli(capsys, "compare", "--preset", "tiny", "--dtype", "mixed-bfloat16", "--threads", "1")
    assert status == 0, out + err
    assert "numpy/cpu/mixed-bf16" in out and "all backends agree with the reference" in out


def test_translate_and_an_unknown_precision(capsys):
    """``translate --dtype mixed-float16`` writes the shipped model's French; a precision that is no name is one
    line naming the flag and every choice, exit 2."""
    status, out, _ = cli(capsys, "translate", "--dtype", "mixed-float16", "--threads", "1",
                         "eighty thousand and eighty")
    assert status == 0 and out.strip() == "quatre-vingt mille quatre-vingts"
    status, _, err = cli(capsys, "translate", "--dtype", "mixed-float32", "eighty")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "--dtype" in err and "'mixed-bfloat16', 'mixed-float16'" in err


@pytest.mark.slow
def test_train_dtype_mixed_float16(capsys, tmp_path):
    """``train --dtype mixed-float16``: the reference and PyTorch (torch.autocast with a GradScaler) take the same
    steps to the same loss, and each saved run holds float32 weights and float16's loss scale, from which
    ``--resume`` goes on."""
    from reference_numpy.checkpoint import load_checkpoint, load_training_state

    out = str(tmp_path / "run-{backend}.safetensors")
    arguments = ["--task", "copy", "--dtype", "mixed-float16", "--backends", "numpy,torch", "--eval-size", "0",
                 "--threads", "1", "--json"]
    status, text, err = cli(capsys, "train", "--steps", "2", "--out", out, *arguments)
    assert status == 0, err
    for name in ("numpy", "torch"):
        path = out.format(backend=name)
        _, params = load_checkpoint(path)
        state = load_training_state(path)
        assert {value.dtype for value in params.values()} == {np.dtype(np.float32)}
        assert state is not None and state.step == 2 and state.loss_scale is not None
    resumed = str(tmp_path / "more-{backend}.safetensors")
    status, _, err = cli(capsys, "train", "--steps", "1", "--resume", out.format(backend="torch"), "--out", resumed,
                         *arguments)
    assert status == 0, err
    assert load_training_state(resumed.format(backend="numpy")).step == 3
