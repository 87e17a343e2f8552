"""The training API's inputs, the same in every backend: bad labels get the reference's one-line ValueError naming
``labels`` from ``loss``, ``gradients`` and ``train_step`` (before any work: the optimizer and the weights are left
as they were), and a run's step count is an int64 everywhere -- saved and resumed at 2**24 + 1 (past float32's
exact integers), 2**31 (past int32) and 2**63 - 2, and refused past 2**63 - 1 (docs/training.md, "Bad input" and
"The step count"). Every case runs the NumPy reference and every installed port through its adapter
(``equivalence.backends``), which calls the port's public functions.
"""

from __future__ import annotations

import functools
import importlib
import re

import numpy as np
import pytest

from equivalence import cases
from reference_numpy.checkpoint import TrainingState, load_training_state
from reference_numpy.config import TrainingConfig

FRAMEWORKS = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}
BACKENDS = ("numpy", "torch", "jax", "tf")
CONFIG = cases.VARIANTS["tiny"].replace(dropout=0.0)   # tgt vocabulary 23, d_model 16; no dropout: steps comparable
SRC = np.array([[5, 6, 7, 2], [8, 9, 2, 0]])           # (B, S) = (2, 4); 0 is pad_id
TGT = np.array([[1, 4, 5], [1, 6, 0]])                 # (B, T) = (2, 3)
LABELS = np.array([[4, 5, 2], [6, 2, 0]])              # the next tokens, padded like TGT
MAX_STEP = 2 ** 63 - 1                                 # the largest int64


@functools.cache
def adapter(name: str):
    if name in FRAMEWORKS:
        framework = FRAMEWORKS[name]
        pytest.importorskip(framework, reason=f"{framework} is not installed (pip install '.[{name}]')")
    return importlib.import_module(f"equivalence.backends.{name}")


def build(name: str):
    return adapter(name).build(CONFIG, cases.seeded_params(CONFIG), "float64")


@functools.cache
def refusing_model(name: str):
    """One model per backend for the refusals' wording (that a refused step leaves its model as it was:
    test_a_refused_step_changes_neither_the_weights_nor_the_step_count, on a model of its own)."""
    return build(name)


def caught(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


# ----------------------------------------------------------------------------- labels

def with_label(value: int) -> np.ndarray:
    labels = LABELS.copy()
    labels[0, 1] = value
    return labels


OUTSIDE = re.escape("labels holds token ids outside [0, 23)") + "$"
BAD_LABELS = {
    "negative label": (with_label(-1), OUTSIDE),
    "label = vocabulary size": (with_label(23), OUTSIDE),
    "label 1000": (with_label(1000), OUTSIDE),
    "float labels": (LABELS.astype(np.float32), re.escape("labels must hold integer token ids, got dtype float32")),
    "bool labels": (LABELS > 0, re.escape("labels must hold integer token ids, got dtype bool")),
    "labels of batch 1 for batch 2": (LABELS[:1], re.escape("labels must have tgt's shape (2, 3), got (1, 3)")),
    "labels of batch 3 for batch 2": (np.concatenate([LABELS, LABELS[:1]]),
                                      re.escape("labels must have tgt's shape (2, 3), got (3, 3)")),
    "labels shorter than tgt": (LABELS[:, :2], re.escape("labels must have tgt's shape (2, 3), got (2, 2)")),
    "labels of rank 1": (LABELS[0], re.escape("labels must have shape (batch, length), got (3,)")),
    "ragged label lists": ([[4, 5, 2], [6, 2]],
                           re.escape("labels must be a rectangular array, got nested sequences of different lengths")),
}
ENTRY_POINTS = {
    "loss": lambda module, model, labels: module.loss(model, SRC, TGT, labels),
    "gradients": lambda module, model, labels: module.gradients(model, SRC, TGT, labels),
    "train_step": lambda module, model, labels: module.train_step(model, module.optimizer(model), SRC, TGT, labels),
}


@functools.cache
def reference_message(case: str, entry: str) -> str:
    module = adapter("numpy")
    return str(caught(lambda: ENTRY_POINTS[entry](module, refusing_model("numpy"), BAD_LABELS[case][0])))


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(BAD_LABELS))
@pytest.mark.parametrize("name", BACKENDS)
def test_bad_labels_get_the_reference_one_line_value_error(name, case, entry):
    module, (labels, message) = adapter(name), BAD_LABELS[case]
    error = caught(lambda: ENTRY_POINTS[entry](module, refusing_model(name), labels))
    assert type(error) is ValueError, f"{name}: {type(error).__name__}: {error}"
    assert "\n" not in str(error) and re.match(message, str(error)), f"{name}: {str(error)!r}"
    assert str(error) == reference_message(case, entry), f"{name} and the reference word it differently"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_refused_step_changes_neither_the_weights_nor_the_step_count(name):
    module = adapter(name)
    model = build(name)
    optimizer = module.optimizer(model)
    before = module.export_params(model)
    with pytest.raises(ValueError, match="^labels holds token ids outside"):
        module.train_step(model, optimizer, SRC, TGT, with_label(-1))
    assert module.training_state(model, optimizer).step == 0
    for key, value in module.export_params(model).items():
        np.testing.assert_array_equal(value, before[key], err_msg=f"{name}: {key}")


def test_bad_labels_in_the_ports_own_tensors_are_refused_alike():
    """The public functions of each port with its own tensor type (not NumPy): the reference's message."""
    want = "labels holds token ids outside [0, 23)"
    for name, tensor in (("torch", lambda a: __import__("torch").as_tensor(a)),
                         ("jax", lambda a: __import__("jax.numpy").numpy.asarray(a)),
                         ("tf", lambda a: __import__("tensorflow").constant(a))):
        module = adapter(name)
        port = importlib.import_module(f"transformer_{name}.training")
        model = build(name)
        for call in (lambda: port.loss(model, SRC, TGT, tensor(with_label(23))),
                     lambda: module.train_step(model, module.optimizer(model), SRC, TGT, tensor(with_label(-1)))):
            assert str(caught(call)) == want, name


@pytest.mark.parametrize("name", BACKENDS)
def test_labels_of_any_integer_dtype_give_the_int64_result(name):
    module = adapter(name)
    model = build(name)
    want = module.loss(model, SRC, TGT, LABELS)
    for dtype in (np.uint8, np.int32, np.uint64):
        assert module.loss(model, SRC, TGT, LABELS.astype(dtype)) == want, f"{name}: {dtype.__name__}"


# ----------------------------------------------------------------------------- the step count

def eq3(step: int, d_model: int = CONFIG.d_model, warmup: int = TrainingConfig().warmup_steps) -> float:
    """Eq. (3) of section 5.3, written out here (not the code under test)."""
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def next_rate(name: str, optimizer) -> float:
    """The learning rate ``optimizer`` (the backend's ``training.Optimizer``) holds for its next step, read off the
    backend's own schedule object."""
    if name == "numpy":
        return eq3(optimizer.adam.step + 1)
    if name == "torch":
        rates = {optimizer.schedule.get_last_lr()[0]} | {group["lr"] for group in optimizer.adam.param_groups}
        assert len(rates) == 1, rates
        return rates.pop()
    if name == "jax":
        import jax
        from flax import nnx

        with jax.enable_x64(True):
            counts = {int(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
                nnx.as_pure(optimizer.adam.opt_state))[0] if "count" in jax.tree_util.keystr(path)}
            assert len(counts) == 1, counts                                  # Adam's and the schedule's
            return float(optimizer.schedule(counts.pop()))
    return float(optimizer.adam.learning_rate)


def zero_state(step: int) -> TrainingState:
    zeros = {key: np.zeros_like(value) for key, value in cases.seeded_params(CONFIG).items()}
    return TrainingState(TrainingConfig(), step, zeros, zeros)


@functools.cache
def gradients() -> dict[str, np.ndarray]:
    """The batch's gradient by the reference's hand-written backward pass, which every port's autodiff agrees with
    (tests/equivalence/test_gradients.py), computed once."""
    return adapter("numpy").gradients(build("numpy"), SRC, TGT, LABELS)[1]


def adam_step(grad: np.ndarray, t: int) -> np.ndarray:
    """The change of a weight in Adam's step t from zero moments with gradient ``grad`` (Kingma & Ba, Algorithm 1,
    the paper's betas and epsilon), written out here."""
    m_hat, v_hat = 0.1 * grad / (1 - 0.9 ** t), 0.02 * grad * grad / (1 - 0.98 ** t)
    return -eq3(t) * m_hat / (np.sqrt(v_hat) + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("step", [2 ** 24 + 1, 2 ** 31, MAX_STEP - 1], ids=["2^24+1", "2^31", "2^63-2"])
@pytest.mark.parametrize("name", BACKENDS)
def test_a_run_resumes_and_saves_at_large_step_counts(name, step, tmp_path):
    module = adapter(name)
    model = build(name)
    optimizer = module.optimizer(model, state=zero_state(step))
    assert next_rate(name, optimizer) == pytest.approx(eq3(step + 1), rel=1e-12)
    before, grads = module.export_params(model), gradients()
    module.train_step(model, optimizer, SRC, TGT, LABELS)
    for key, value in module.export_params(model).items():                  # the update of step t = step + 1
        decided = np.abs(grads[key]) > 1e-10       # not rounding noise (a key bias's gradient is 0 up to noise)
        np.testing.assert_allclose((value - before[key])[decided], adam_step(grads[key], step + 1)[decided],
                                   rtol=1e-5, atol=1e-15 * np.abs(before[key]).max(), err_msg=f"{name}: {key}")
    module.save(model, tmp_path / "run.safetensors", training=module.training_state(model, optimizer))
    state = load_training_state(tmp_path / "run.safetensors")
    assert state.step == step + 1
    loaded = module.load(tmp_path / "run.safetensors")
    resumed = module.optimizer(loaded, state=state)
    assert module.training_state(loaded, resumed).step == step + 1
    assert next_rate(name, resumed) == pytest.approx(eq3(step + 2), rel=1e-12)


@pytest.mark.parametrize("name", BACKENDS)
def test_the_largest_step_count_loads_and_cannot_step(name):
    module = adapter(name)
    model = build(name)
    optimizer = module.optimizer(model, state=zero_state(MAX_STEP))
    before = module.export_params(model)
    error = caught(lambda: module.train_step(model, optimizer, SRC, TGT, LABELS))
    assert type(error) is ValueError and str(error) == (
        "optimizer has taken 9223372036854775807 steps, the most an int64 count holds (2**63 - 1); "
        "it cannot take another"), f"{name}: {error!r}"
    assert module.training_state(model, optimizer).step == MAX_STEP
    for key, value in module.export_params(model).items():
        np.testing.assert_array_equal(value, before[key], err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", BACKENDS)
def test_a_step_count_past_int64_is_refused(name):
    module = adapter(name)
    error = caught(lambda: module.optimizer(build(name), state=zero_state(MAX_STEP + 1)))
    assert type(error) is ValueError and str(error) == (
        "training step must be <= 2**63 - 1 (an int64 count in every backend), got 9223372036854775808"), repr(error)
