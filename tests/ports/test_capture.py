"""``capture_stages`` in every backend (each backend's ``capture.py``, docs/ports.md): the stages by the shared names,
in forward order, the last the call's own output, and the model left as it was after the call -- the same modules
in their places, no hook, recorder or sown value left on them -- also after a call that raises. The stages' values
are the agreement suite's to check (tests/equivalence/test_agreement.py, ``test_forward_stages``)."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest
from support import backend

from equivalence import cases
from equivalence.cases import VARIANTS
from reference_numpy.capture import stage_modules, stage_paths

PACKAGES = {"numpy": "reference_numpy", "torch": "transformer_torch", "jax": "transformer_jax", "tf": "transformer_tf"}
CONFIG = VARIANTS["pre_ln"]            # a final LayerNorm in each stack: the stack's output is not its last layer's


def built(name: str):
    """The backend's float64 model, its ``capture_stages`` and the scope its calls run in (JAX: 64-bit on)."""
    model = backend(name).build(CONFIG, cases.seeded_params(CONFIG), "float64")
    capture = importlib.import_module(f"{PACKAGES[name]}.capture").capture_stages
    scope = importlib.import_module("jax").enable_x64 if name == "jax" else lambda _: contextlib.nullcontext()
    return model, capture, scope


def left(name: str, model) -> list:
    """What a capture must leave as it was: each stage's module in its place, and nothing of the capture on it."""
    traces = {"numpy": lambda module: None,
              "torch": lambda module: len(module._forward_hooks),
              "jax": lambda module: hasattr(module, "__captures__"),
              "tf": lambda module: "call" in vars(module)}[name]
    return [(stage, id(module), traces(module)) for stage, module in stage_modules(model).items()]


def as_numpy(value) -> np.ndarray:
    return value.detach().numpy() if hasattr(value, "detach") else np.asarray(value)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_stages_come_by_the_shared_names_in_forward_order(name):
    model, capture, scope = built(name)
    before = left(name, model)
    inputs = cases.model_inputs(CONFIG, "source_padding")
    with scope(True):
        out, stages = capture(model, inputs["src"], inputs["tgt"])
    assert list(stages) == list(stage_paths(CONFIG))
    np.testing.assert_array_equal(as_numpy(stages["log_probs"]), as_numpy(out))
    assert left(name, model) == before


@pytest.mark.parametrize("name", PACKAGES)
def test_a_call_that_raises_leaves_the_model_as_it_was(name):
    model, capture, scope = built(name)
    before = left(name, model)
    inputs = cases.model_inputs(CONFIG, "source_padding")
    with scope(True), pytest.raises(ValueError, match="tgt"):
        capture(model, inputs["src"], inputs["tgt"] + CONFIG.tgt_vocab_size)     # ids past the vocabulary
    assert left(name, model) == before
    with scope(True):
        assert list(capture(model, inputs["src"], inputs["tgt"])[1]) == list(stage_paths(CONFIG))
