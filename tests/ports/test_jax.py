"""Tests of the JAX/Flax port beyond the shared agreement matrix (tests/equivalence/test_agreement.py) and what every
port must do (tests/ports/test_every_port.py):
checkpoint I/O against the reference, the name table, float64 and x64, bfloat16 and float16 (rounding once,
checkpoints, mixed-precision training and its loss scale), the fully masked row, the key/value cache's layout and
the compiled decoding loop, dropout, devices, and training (section 5:
optax's Adam and schedule against the paper's, written out here; dropout's statistics; resuming a saved run).

The port is used directly in float64 here, so this module enables x64 for the pytest process
(the library itself never does: a subprocess test checks that importing the port and its adapter
leaves it off); float32 models must still compute in float32, which the dtype assertions check.
"""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install '.[jax]')")
pytest.importorskip("flax", reason="Flax is not installed (pip install '.[jax]')")
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from equivalence import cases, tolerance  # noqa: E402
from equivalence.backends import jax as backend  # noqa: E402
from equivalence.backends import numpy as reference  # noqa: E402
from equivalence.cases import VARIANTS  # noqa: E402
from reference_numpy import checkpoint as reference_checkpoint  # noqa: E402
from reference_numpy import precision  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from reference_numpy.decoding import select_candidates  # noqa: E402
from reference_numpy.model import log_softmax as reference_log_softmax  # noqa: E402
from reference_numpy.model import scaled_dot_product_attention as reference_attention  # noqa: E402
from reference_numpy.precision import round_to  # noqa: E402
from reference_numpy.training import PAPER  # noqa: E402
from reference_numpy.training import learning_rate as reference_learning_rate  # noqa: E402
from transformer_jax import checkpoint, decoding, device, training  # noqa: E402
from transformer_jax.capture import capture_stages  # noqa: E402
from transformer_jax.incremental import at_position, memory_cache, self_attention_cache  # noqa: E402
from transformer_jax.model import (  # noqa: E402
    PositionalEncoding,
    Transformer,
    log_softmax,
    narrow,
    scaled_dot_product_attention,
)
from transformer_jax.speed import forward  # noqa: E402
from transformer_jax.training import loss  # noqa: E402

NO_GPU = "no GPU present: JAX sees only the CPU here, the GPU tests need a CUDA/ROCm jaxlib and a GPU"
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def port_model(variant: str, dtype: str = "float64", params: str = "seeded") -> Transformer:
    return backend.build(VARIANTS[variant], cases.PARAMS[params](VARIANTS[variant]), dtype)


@functools.cache
def reference_model(variant: str, dtype: str = "float64", params: str = "seeded"):
    return reference.build(VARIANTS[variant], cases.PARAMS[params](VARIANTS[variant]), dtype)


# ----------------------------------------------------------------------------- checkpoint

def test_bad_params_give_the_reference_errors():
    config = VARIANTS["tiny"]
    params = cases.seeded_params(config)
    params["decoder.layers.2.cross_attn.v_proj.weight"] = np.zeros((config.d_model, config.d_model + 2))
    with pytest.raises(ValueError) as expected:
        reference_checkpoint.validate_params(config, params)
    with pytest.raises(ValueError, match="v_proj.weight") as port_error:
        checkpoint.from_params(config, params)
    assert str(port_error.value) == str(expected.value)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_name_table_covers_every_parameter_exactly_once(variant):
    config = VARIANTS[variant]
    model = Transformer(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    table = checkpoint.name_table(config)
    assert list(table) == list(reference_checkpoint.parameter_shapes(config))
    state = {".".join(map(str, keys)): variable for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert sorted(table.values()) == sorted(state)                   # every parameter, each exactly once
    for name, path in table.items():
        assert state[path].shape == reference_checkpoint.parameter_shapes(config)[name]
    assert checkpoint.transposed(config) == ()


def test_a_wrong_transpose_list_is_caught_by_the_shape_check(monkeypatch):
    monkeypatch.setattr(checkpoint, "transposed", lambda config: ("encoder.layers.0.ffn.linear1.weight",))
    expected = ("tensor 'encoder.layers.0.ffn.linear1.weight' has shape (40, 16); "
                "the NNX parameter encoder.layers.0.ffn.linear1.kernel has shape (16, 40)")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        checkpoint.from_params(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]))


def test_a_parameter_missing_from_the_name_table_is_refused(monkeypatch):
    table = checkpoint.name_table
    monkeypatch.setattr(checkpoint, "name_table", lambda config: dict(list(table(config).items())[:-1]))
    with pytest.raises(ValueError, match=r"^the name table and the NNX parameters differ: \['generator\.weight'\]$"):
        checkpoint.from_params(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_load_checkpoint_keeps_the_file_dtype(tmp_path, dtype):
    config, path = VARIANTS["learned_pe"], tmp_path / "model.safetensors"
    params = cases.seeded_params(config)
    reference_checkpoint.save_checkpoint(path, config, {name: value.astype(dtype) for name, value in params.items()})
    model = checkpoint.load_checkpoint(path)
    assert model.dtype == np.dtype(dtype)
    for name, value in checkpoint.to_params(model).items():
        assert value.dtype == np.dtype(dtype) and np.array_equal(value, params[name].astype(dtype)), name
    assert checkpoint.load_checkpoint(path, dtype=jnp.float32).dtype == np.float32


def test_a_loaded_model_shares_the_structure_and_compilations_of_a_new_one():
    """The file's tokenizer is read beside the model, never held by it: NNX's graph holds every attribute of a
    module, so a text attribute would give a loaded model and a new one of the same structure different compilations
    of every compiled function (a training step: 18 CPU-s for ``tiny``). The shipped model, whose file holds a
    tokenizer, loads with the structure of a new model of its config."""
    loaded = checkpoint.load_checkpoint("numbers-en-fr")
    new = Transformer(loaded.config, dtype=loaded.dtype, rngs=nnx.Rngs(params=1, dropout=1))
    assert reference_checkpoint.load_tokenizer_json("numbers-en-fr") is not None
    assert nnx.graphdef(loaded) == nnx.graphdef(new)


# ----------------------------------------------------------------------------- dtypes, x64, bad input

def test_float32_stays_float32_with_x64_on():
    model = port_model("tiny", "float32")
    assert {value.dtype for value in backend.export_params(model).values()} == {np.dtype(np.float32)}
    stages = backend.forward(model, **cases.model_inputs(VARIANTS["tiny"], "ragged_batch"))
    assert {value.dtype for value in stages.values()} == {np.dtype(np.float32)}


def test_the_library_never_turns_x64_on(tmp_path):
    """In a fresh process with x64 off: importing the port and its adapter leaves it off; the port
    refuses float64 with a clear error; the adapter runs float64 models (each call under
    ``jax.enable_x64``) with float64 results, compiling its loops once, and leaves x64 off."""
    path = tmp_path / "tiny.safetensors"
    reference_checkpoint.save_checkpoint(path, VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]))
    script = f"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import transformer_jax, {backend.__name__} as adapter
from transformer_jax import Transformer, decoding, load_checkpoint, model as port
from equivalence.cases import VARIANTS, decoding_inputs, model_inputs
assert not jax.config.read("jax_enable_x64"), "importing the port or its adapter turned x64 on"
for make in (lambda: Transformer(VARIANTS["tiny"], dtype=jnp.float64, rngs=nnx.Rngs(0)),
             lambda: load_checkpoint({str(path)!r})):
    try:
        make()
    except ValueError as err:
        print(err)
    else:
        raise SystemExit("float64 was accepted with x64 off")
print(load_checkpoint({str(path)!r}, dtype=jnp.float32).encoder.layers[0].ffn.linear1.kernel.dtype)
traces = []
for owner, name in ((port.Transformer, "__call__"), (decoding, "next_token_log_probs")):
    def counting(*args, _original=getattr(owner, name), _name=name, **kwargs):
        traces.append(_name)
        return _original(*args, **kwargs)
    setattr(owner, name, counting)
model = adapter.load({str(path)!r})
inputs, src = model_inputs(VARIANTS["tiny"], "ragged_batch"), decoding_inputs(VARIANTS["tiny"])
for _ in range(2):
    stages = adapter.forward(model, **inputs)
    tokens, scores = adapter.beam(model, src)
assert {{value.dtype for value in stages.values()}} == {{np.dtype("float64")}}, "float64 stages lost"
assert tokens.shape[1] > 1 and scores.dtype == np.float64
assert traces == ["__call__", "next_token_log_probs"], traces
assert not jax.config.read("jax_enable_x64"), "an adapter call left x64 on"
print("ok")
"""
    env = {**os.environ, "JAX_ENABLE_X64": "0", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 4 and lines[2:] == ["float32", "ok"], run.stdout
    for message in lines[:2]:
        assert "float64" in message and "jax_enable_x64" in message


def test_bad_arguments_give_one_line_value_errors():
    model = port_model("tiny")
    inputs = cases.model_inputs(VARIANTS["tiny"], "causal")
    bad = [
        (lambda: forward(model, inputs["src"] + 100, inputs["tgt"]), "src holds token ids outside"),
        (lambda: forward(model, inputs["src"], inputs["tgt"].astype(float)), "tgt must hold integer"),
        (lambda: forward(model, inputs["src"][0], inputs["tgt"]), r"src must have shape \(batch, length\)"),
        (lambda: forward(model, inputs["src"], inputs["tgt"], np.ones((3, 1, 1, 7), int)), "mask must be boolean"),
        (lambda: forward(model, inputs["src"], inputs["tgt"], np.ones((3, 1, 1, 5), bool)), "does not broadcast"),
        (lambda: scaled_dot_product_attention(*[jnp.ones((3, 1, 6, 4))] * 3, np.ones((2, 3, 1, 1, 6), bool)),
         "does not broadcast"),                                        # a mask may not enlarge the scores
        (lambda: backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]), "int8"),
         "^dtype must be one of float64, float32, bfloat16, float16, mixed-bfloat16, mixed-float16, got 'int8'$"),
        (lambda: Transformer(VARIANTS["tiny"], dtype=jnp.float8_e4m3fn, rngs=nnx.Rngs(0)),
         "^dtype must be one of float64, float32, bfloat16, float16, got float8_e4m3fn$"),
        (lambda: backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]), "float64", "gpu:7"),
         "device 'gpu:7' is not available"),
        (lambda: decoding.beam_search(model, inputs["src"], beam_size=0), "beam_size must be a positive int"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- bfloat16 and float16

LOW = ("bfloat16", "float16")


@pytest.mark.parametrize("dtype", ["float32", *LOW])
def test_narrow_rounds_float32_once_to_nearest_even(dtype):
    """The recipe's one rounding of a wide result (XLA's convert, compiled) is the reference's ``round_to``, bit for
    bit: values across the range, halfway cases (ties to even), subnormals of the format and overflow."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20_000) * np.exp(rng.uniform(-25, 12, 20_000))).astype(np.float32)
    halfway = (np.arange(1, 513, dtype=np.float64) + 0.5) * 2.0 ** -7                # ties of bfloat16 and float16
    x = np.concatenate([x, halfway.astype(np.float32), -x[:100], np.float32([7e4, 3.4e38, -3.4e38, 0.0, -0.0])])
    out = np.asarray(jax.jit(lambda v: narrow(v, np.dtype(dtype)))(jnp.asarray(x)))
    want = round_to(x, dtype)
    assert out.dtype == want.dtype and np.array_equal(out.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_model_s_log_probs_are_its_forward_pass_s_last_stage(dtype):
    """The adapter's ``log_probs`` and ``forward`` run one compiled program: the same float32 log-probabilities, bit
    for bit (where each stage is stored, every port: tests/ports/test_every_port.py)."""
    model, inputs = port_model("tiny", dtype), cases.model_inputs(VARIANTS["tiny"], "ragged_batch")
    assert np.array_equal(backend.log_probs(model, **inputs), backend.forward(model, **inputs)["log_probs"])


def test_a_bf16_file_loads_in_its_format_and_any_other(tmp_path):
    """A BF16 file keeps its numbers exactly (in bfloat16 and float32); an F64 file loaded in bfloat16 is rounded
    once (``round_to``), not twice through float32 as NumPy's cast would."""
    config = VARIANTS["learned_pe"]
    params = cases.seeded_params(config)
    stored = {name: round_to(value, "bfloat16") for name, value in params.items()}
    bf16, f64 = tmp_path / "bf16.safetensors", tmp_path / "f64.safetensors"
    reference_checkpoint.save_checkpoint(bf16, config, stored)
    reference_checkpoint.save_checkpoint(f64, config, params)
    model = checkpoint.load_checkpoint(bf16)
    assert model.dtype == np.dtype("bfloat16")
    for name, value in checkpoint.to_params(model).items():
        assert value.dtype == stored[name].dtype and np.array_equal(value.view(np.uint16), stored[name].view(np.uint16))
    widened = checkpoint.to_params(checkpoint.load_checkpoint(bf16, dtype="float32"))
    assert all(np.array_equal(widened[name], stored[name].astype(np.float32)) for name in stored)
    rounded = checkpoint.to_params(checkpoint.load_checkpoint(f64, dtype=jnp.bfloat16))
    assert all(np.array_equal(rounded[name].view(np.uint16), stored[name].view(np.uint16)) for name in stored)
    twice = sum(int(np.sum(value.astype(np.dtype("bfloat16")) != stored[name])) for name, value in params.items())
    assert twice > 0                                                    # the file holds double-rounding cases


@pytest.mark.parametrize("dtype", LOW)
def test_a_low_precision_model_saves_its_format_and_reloads_bitwise(tmp_path, dtype):
    path = tmp_path / f"{dtype}.safetensors"
    model = port_model("shared_embeddings", dtype)
    backend.save(model, path)
    _, stored = reference_checkpoint.load_checkpoint(path)
    saved = checkpoint.to_params(model)
    assert {value.dtype for value in stored.values()} == {np.dtype(dtype)}
    again = checkpoint.to_params(backend.load(path, dtype))
    for name, value in saved.items():
        assert np.array_equal(stored[name].view(np.uint16), value.view(np.uint16)), name
        assert np.array_equal(again[name].view(np.uint16), value.view(np.uint16)), name


def mixed_precision_run(dtype: str) -> tuple[Transformer, training.Optimizer]:
    """A float32 model from the seeded weights and its mixed-precision optimizer in ``dtype``."""
    config = VARIANTS["tiny"].replace(dropout=0.0)
    model = checkpoint.from_params(config, cases.seeded_params(config), "float32")
    return model, backend.optimizer(model, TRAINING, dtype=dtype)


def assert_low_is_the_rounded_masters(model: Transformer, mixed: training.Optimizer) -> None:
    """The masters are float32 and the P model holds them rounded to P (``round_to``), bit for bit."""
    masters, low = checkpoint.to_params(model), checkpoint.to_params(mixed.low)
    for name, master in masters.items():
        assert master.dtype == np.float32, name
        assert np.array_equal(low[name].view(np.uint16), round_to(master, mixed.low.dtype).view(np.uint16)), name


# 20 to 40 s: the mixed-precision training step (bfloat16 forward and backward, float32 update) compiled (XLA:CPU takes
# some 20 s of CPU for a `tiny` training step).
def test_a_bfloat16_step_updates_the_float32_masters():
    """bfloat16 has no loss scaling; a step moves the float32 masters (Adam's moments float32, t = 1) and the
    bfloat16 model is the new masters rounded; ``training_state`` is the float32 optimizer's."""
    model, mixed = mixed_precision_run("bfloat16")
    assert mixed.low is not None and backend.loss_scale(mixed) is None
    assert backend.loss_scale(backend.optimizer(port_model("tiny", "float32"))) is None
    assert_low_is_the_rounded_masters(model, mixed)
    before = checkpoint.to_params(model)
    assert np.isfinite(backend.train_step(model, mixed, **cases.training_inputs(model.config)))
    state = backend.training_state(model, mixed)
    assert state.step == 1
    assert {m.dtype for m in (*state.first_moments.values(), *state.second_moments.values())} == {np.dtype("float32")}
    assert max(np.abs(weight - before[name]).max() for name, weight in checkpoint.to_params(model).items()) > 1e-3
    assert_low_is_the_rounded_masters(model, mixed)


# 20 to 40 s: the float16 training step with its DynamicScale compiled (XLA:CPU takes some 20 s of CPU for a `tiny`
# training step).
def test_a_float16_step_that_overflows_is_skipped_and_finite_steps_grow_the_scale(monkeypatch):
    """Flax's DynamicScale with the reference's numbers. A gradient that overflows float16 (the scale set to 1e30)
    skips the step: the weights, Adam's moments and step count unchanged, the scale halved; the loss returned is
    unscaled (the next step's, at the same weights and scale 2^15). With the growth interval monkeypatched to 2,
    two finite steps in a row double the scale, and Adam counts two steps."""
    monkeypatch.setattr(precision, "LOSS_SCALE_GROWTH_INTERVAL", 2)
    model, mixed = mixed_precision_run("float16")
    assert backend.loss_scale(mixed) == precision.LOSS_SCALE
    inputs = cases.training_inputs(model.config)
    before, state = checkpoint.to_params(model), backend.training_state(model, mixed)
    mixed.loss_scale = mixed.loss_scale.replace(scale=jnp.full_like(mixed.loss_scale.scale, 1e30))
    value = backend.train_step(model, mixed, **inputs)
    assert np.isfinite(value)
    assert backend.loss_scale(mixed) == float(np.float32(1e30)) / 2
    after = backend.training_state(model, mixed)
    assert after.step == state.step == 0
    for name, weight in checkpoint.to_params(model).items():
        np.testing.assert_array_equal(weight, before[name], err_msg=name)
        for which in (2, 3):
            np.testing.assert_array_equal(after[which][name], state[which][name], err_msg=name)
    assert_low_is_the_rounded_masters(model, mixed)
    mixed.loss_scale = mixed.loss_scale.replace(scale=jnp.full_like(mixed.loss_scale.scale, precision.LOSS_SCALE))
    assert backend.train_step(model, mixed, **inputs) == value
    scales = [backend.loss_scale(mixed)]
    backend.train_step(model, mixed, **cases.training_inputs(model.config, seed=1))
    assert scales + [backend.loss_scale(mixed)] == [precision.LOSS_SCALE, 2 * precision.LOSS_SCALE]
    assert backend.training_state(model, mixed).step == 2
    assert_low_is_the_rounded_masters(model, mixed)


# ----------------------------------------------------------------------------- log-softmax

def exact_log_softmax(x: np.ndarray) -> np.ndarray:
    """Section 3.4's log softmax of each row by Python's math, the sum exactly rounded (math.fsum)."""
    out = []
    for row in x.reshape(-1, x.shape[-1]).astype(np.float64).tolist():
        top = max(row)
        log_total = math.log(math.fsum(math.exp(value - top) for value in row))
        out.append([value - top - log_total for value in row])
    return np.array(out).reshape(x.shape)


@pytest.mark.parametrize("classes", [37_000, 2_000, 1_031, 20])   # chunks of 1,000; of 1,000; none (prime); one
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_softmax_sums_by_chunks_at_the_plain_sums_precision(classes, dtype):
    """The chunked sum of exp (and the fallback for a row with no chunk) against exactly rounded sums:
    float64 within 1e-12, float32 within the policy's multiple of NumPy's float32 error."""
    x = np.random.default_rng(classes).normal(0, 4, size=(2, 3, classes))
    out = np.asarray(log_softmax(jnp.asarray(x, dtype)))
    assert out.dtype == dtype and out.shape == x.shape
    tolerance.assert_agrees(out, exact_log_softmax(x), reference_log_softmax(x.astype(np.float32)),
                            what=f"log_softmax over {classes} classes")


def test_log_softmax_gradient_is_the_closed_form():
    """d/dx sum(w * log_softmax(x)) = w - softmax(x) sum(w), through the chunked sum (float64)."""
    rng = np.random.default_rng(1)
    x, w = rng.normal(0, 4, size=(3, 2_000)), rng.normal(size=(3, 2_000))
    grad = np.asarray(jax.grad(lambda x: jnp.sum(w * log_softmax(x)))(jnp.asarray(x)))
    softmax = np.exp(exact_log_softmax(x))
    tolerance.assert_agrees(grad, w - softmax * w.sum(axis=-1, keepdims=True), what="log_softmax gradient")


# ----------------------------------------------------------------------------- attention

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fully_masked_row_gives_zeros_and_finite_gradients(dtype):
    inputs = {name: value[:, None] if name != "mask" else value          # (B, 1, T, D): one head
              for name, value in cases.attention_inputs(VARIANTS["tiny"], "fully_masked_row").items()}
    q, k, v = (jnp.asarray(inputs[name], dtype) for name in ("query", "key", "value"))
    out, weights = scaled_dot_product_attention(q, k, v, inputs["mask"])
    assert out.dtype == dtype and out.shape == q.shape
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.asarray(weights[1]) == 0)   # batch row 1 sees no key
    assert np.all(np.asarray(out[0]) != 0) and np.all(np.isfinite(np.asarray(out)))
    ref64, _ = reference_attention(inputs["query"], inputs["key"], inputs["value"], inputs["mask"])
    ref32, _ = reference_attention(*(inputs[name].astype(np.float32) for name in ("query", "key", "value")),
                                   inputs["mask"])
    tolerance.assert_agrees(np.asarray(out), ref64, ref32)
    grads = jax.grad(lambda q, k, v: scaled_dot_product_attention(q, k, v, inputs["mask"])[0].sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert all(np.all(np.asarray(g[1]) == 0) and np.any(np.asarray(g[0]) != 0) for g in grads)


def test_a_fully_masked_source_row_runs_through_the_whole_model():
    inputs = cases.model_inputs(VARIANTS["tiny"], "fully_masked_row")
    stages = backend.forward(port_model("tiny"), **inputs)
    assert all(np.all(np.isfinite(value)) for value in stages.values())
    tolerance.assert_agrees(stages["log_probs"], reference_model("tiny")(**inputs))


# ----------------------------------------------------------------------------- key/value cache and decoding

def test_cache_layout_and_a_concrete_index_outside_it():
    model = port_model("tiny")
    config, attention = model.config, model.decoder.layers[0].self_attn
    cache = self_attention_cache(attention, 2, 4)
    assert cache.keys.shape == cache.values.shape == (2, config.n_heads, 4, config.d_k)
    assert cache.keys.dtype == model.dtype and not np.any(np.asarray(cache.keys))
    memory = jnp.ones((2, 5, config.d_model), model.dtype)
    cross_cache = memory_cache(model.decoder.layers[0].cross_attn, memory)
    assert cross_cache.keys.shape == (2, config.n_heads, 5, config.d_k)
    x = jnp.ones((2, 1, config.d_model), model.dtype)
    for index, message in ((4, "cache holds 4 positions; decoding needs 5"),
                           (-1, "cache.position must be an int >= 0, got -1")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            attention(x, x, x, cache=cache._replace(position=index))
    with pytest.raises(ValueError, match=r"^cache.position must be an int >= 0, got None$"):
        model.decode(np.ones((2, 1), int), memory, cache=at_position(model.init_cache(memory, 4), None))
    expected = f"capacity must be an int in [1, {config.max_len}], got {config.max_len + 1}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        model.init_cache(memory, config.max_len + 1)


def test_the_decoding_loop_is_traced_once_not_per_token(monkeypatch):
    model = port_model("tiny", "float32", "decoding")
    traced = []
    step = decoding.next_token_log_probs

    def counting_step(*args):
        traced.append(args[5])                                        # cache_index: a tracer, not a Python int
        return step(*args)

    monkeypatch.setattr(decoding, "next_token_log_probs", counting_step)
    src = cases.decoding_inputs(VARIANTS["tiny"])[:2, :5]             # a shape no other test compiles
    same_shapes = np.where(src > 3, src - 1, src)
    tokens = decoding.greedy_decode(model, src)
    assert tokens.shape[1] > 1 and tokens.dtype == np.int64
    assert len(traced) == 1 and isinstance(traced[0], jax.core.Tracer)
    decoding.greedy_decode(model, same_shapes)                        # same shapes and budgets: no new trace
    assert len(traced) == 1
    tokens, scores = decoding.beam_search(model, src)
    assert tokens.shape[1] > 1 and tokens.dtype == np.int64 and scores.dtype == np.float64
    decoding.beam_search(model, same_shapes)
    assert len(traced) == 2


def _tied_candidates(dtype) -> list[np.ndarray]:
    """Summed log-probabilities (K = 4 beams, V = 7 tokens, eos 2) full of exact ties: between beams,
    between tokens, at the eos, between -0.0 and +0.0 and among the -inf slots of unfilled beams; one
    written out, the others drawn from five values."""
    written = np.array([[-1.0, -2.0, -1.0, -0.5, -0.5, -2.0, -1.0],
                        [-0.5, -0.5, -0.5, -1.0, -0.5, -3.0, -0.5],
                        [-0.0, -np.inf, 0.0, -0.0, -1.0, 0.0, -0.5],
                        [-np.inf] * 7])
    rng = np.random.default_rng(0)
    drawn = [rng.choice([-np.inf, -1.0, -0.5, -0.0, 0.0], size=(4, 7)) for _ in range(40)]
    return [candidates.astype(dtype) for candidates in [written, *drawn]]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_beam_candidates_are_chosen_as_the_reference_chooses_among_exact_ties(dtype):
    """One step's selection (``lax.top_k``) against the reference's ``select_candidates`` (a stable sort):
    the same eos hypotheses finish, from the same beams, with the same scores, and the same (beam, token,
    score) become the live beams (the reference drops impossible ones, the port keeps them at -inf)."""
    eos, beam_size = 2, 4
    tied = _tied_candidates(dtype)
    chosen = map(np.asarray, decoding._select(jnp.asarray(np.stack(tied)), eos, beam_size))   # one batch
    for candidates, (scores, beams, tokens, finishing, keep) in zip(tied, zip(*chosen), strict=True):
        expected = select_candidates(candidates, eos, beam_size)
        assert scores.dtype == dtype
        assert [(int(b), float(v)) for b, v in zip(beams[finishing], scores[finishing])] == \
            [(int(b), float(v)) for b, v in expected.finishing], candidates
        live = keep[np.isfinite(scores[keep])]
        assert list(zip(beams[live].tolist(), tokens[live].tolist(), scores[live].tolist())) == \
            list(zip(expected.beams.tolist(), expected.tokens.tolist(), expected.scores.tolist())), candidates


# ----------------------------------------------------------------------------- dropout

def test_dropout_is_off_by_default_and_on_with_deterministic_false():
    config = VARIANTS["tiny"]
    model, inputs = port_model("tiny"), cases.model_inputs(config, "source_padding")
    ref64 = reference_model("tiny")(**inputs)
    tolerance.assert_agrees(np.asarray(model(**inputs)), ref64, what="default (deterministic)")
    tolerance.assert_agrees(np.asarray(model(**inputs, deterministic=True)), ref64, what="deterministic=True")
    _, clean = capture_stages(model, **inputs)
    first, stages = capture_stages(model, **inputs, deterministic=False)
    second = nnx.view(model, deterministic=False)(**inputs)
    for noisy in (first, second):
        assert tolerance.max_abs(noisy, ref64) > tolerance.float64_bound(ref64)
    assert tolerance.max_abs(first, second) > 0                       # the dropout stream advances
    embedded, kept = np.asarray(stages["src_embed"]), np.asarray(stages["src_embed"]) != 0
    assert 0 < (~kept).mean() < 3 * config.dropout                    # about P_drop of the entries dropped
    tolerance.assert_agrees(embedded[kept], (np.asarray(clean["src_embed"]) / (1 - config.dropout))[kept],
                            what="kept entries scaled by 1 / (1 - P_drop)")


def test_gradients_are_by_checkpoint_name_and_match_nnx_grad():
    config = VARIANTS["shared_embeddings"]
    model, inputs = port_model("shared_embeddings"), cases.training_inputs(config)
    value, grads = backend.gradients(model, **inputs)
    assert list(grads) == list(reference_checkpoint.parameter_shapes(config))
    tolerance.assert_agrees(np.float64(value), reference.loss(reference_model("shared_embeddings"), **inputs))
    direct = nnx.grad(lambda m: loss(m, **inputs, deterministic=True))(model)
    shared = [variable for path, variable in nnx.to_flat_state(direct) if path[-1] == "embedding"]
    assert len(shared) == 1                                           # one matrix, gradients of all uses summed
    tolerance.assert_agrees(grads["shared_embed.weight"], np.asarray(shared[0][...]), what="compiled vs eager")
    assert np.abs(grads["shared_embed.weight"]).max() > 0


# ----------------------------------------------------------------------------- devices

def test_devices_lists_the_cpu_and_every_gpu():
    names = backend.devices()
    assert names[0] == "cpu"
    assert names[1:] == [f"gpu:{i}" for i in range(len(names) - 1)]
    assert device.resolve_device("cpu").platform == "cpu"


def test_determinism_switch_sets_the_xla_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    device.deterministic()
    device.deterministic()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", "--xla_gpu_deterministic_ops=true"]
    device.deterministic(False)
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x"]


def test_full_precision_sets_the_default_matmul_precision():
    before = jax.config.jax_default_matmul_precision
    try:
        device.full_precision()
        assert jax.config.jax_default_matmul_precision == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_agrees_at_full_float32_precision(dtype):
    if "gpu:0" not in backend.devices():
        pytest.skip(NO_GPU)
    config = VARIANTS["tiny"]
    model = backend.build(config, cases.seeded_params(config), dtype, "gpu:0")
    assert {leaf.devices().pop().platform for leaf in jax.tree.leaves(nnx.state(model))} == {"gpu"}
    inputs = cases.model_inputs(config, "ragged_batch")
    stages = backend.forward(model, **inputs)
    ref64, ref32 = reference.forward(reference_model("tiny"), **inputs), reference.forward(
        reference_model("tiny", "float32"), **inputs)
    for name in ref64:
        tolerance.assert_agrees(stages[name], ref64[name], ref32[name], what=name)


def test_gpu_decoding_is_run_to_run_identical():
    if "gpu:0" not in backend.devices():
        pytest.skip(NO_GPU)
    config = VARIANTS["tiny"]
    model = backend.build(config, cases.decoding_params(config), "float32", "gpu:0")
    src = cases.decoding_inputs(config)
    first, second = backend.beam(model, src), backend.beam(model, src)
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])


# ----------------------------------------------------------------------------- training (section 5)

# A short warmup makes the first learning rates large (lrate(t) = t / (4 * 5^1.5) ~ 0.02 t for d_model = 16): a
# learning rate or bias correction rounded to float32 (relative error up to 6e-8) then moves a weight by ~1e-9, far
# above the float64 bound of 1e-12, which the paper's warmup of 4000 steps (lrate(1) ~ 1e-6) would hide. (With
# warmup_steps = 4 the first rates, 2^-5, 2^-4 and 3 * 2^-5, would be exact in float32.)
TRAINING = TrainingConfig(warmup_steps=5)


def paper_rate(step: int, d_model: int, config: TrainingConfig) -> float:
    """Eq. (3) of section 5.3, written out here: the test's own oracle."""
    return config.learning_rate_scale * min(step ** -0.5, step * config.warmup_steps ** -1.5) / np.sqrt(d_model)


def paper_adam(weight, grad, m, v, t: int, rate: float, config: TrainingConfig):
    """One step of Kingma & Ba's Algorithm 1 in NumPy (the test's own oracle): the new weight, m and v."""
    m = config.beta1 * m + (1 - config.beta1) * grad
    v = config.beta2 * v + (1 - config.beta2) * grad ** 2
    m_hat, v_hat = m / (1 - config.beta1 ** t), v / (1 - config.beta2 ** t)
    return weight - rate * m_hat / (np.sqrt(v_hat) + config.epsilon), m, v


def training_model(variant: str = "tiny", dropout: float = 0.0) -> Transformer:
    """A fresh float64 model from the seeded weights (training changes it, so it is never cached)."""
    config = VARIANTS[variant].replace(dropout=dropout)
    return checkpoint.from_params(config, cases.seeded_params(config))


@pytest.mark.parametrize("config", [PAPER, TrainingConfig(warmup_steps=4, learning_rate_scale=2.0)])
def test_the_schedule_gives_lrate_from_step_one_as_optax_counts(config):
    """optax counts updates from 0; stepping optax's own scale_by_learning_rate with the schedule scales the t-th
    update by -lrate(t), t = 1, 2, ..., in float64; and over a range of counts the schedule is Eq. (3) at count + 1."""
    d_model = VARIANTS["tiny"].d_model
    schedule = training.learning_rate_schedule(d_model, config)
    scaler = optax.scale_by_learning_rate(schedule)
    state = scaler.init(jnp.ones((), jnp.float64))
    for step in range(1, 6):
        update, state = scaler.update(jnp.ones((), jnp.float64), state)
        assert update.dtype == jnp.float64
        expected = paper_rate(step, d_model, config)
        assert abs(-float(update) - expected) <= tolerance.float64_bound(expected), step
    counts = np.arange(0, 3 * config.warmup_steps + 50, 3)
    rates = np.asarray(schedule(jnp.asarray(counts)))
    expected = np.array([reference_learning_rate(int(count) + 1, d_model, config) for count in counts])
    assert rates.dtype == np.float64
    tolerance.assert_agrees(rates, expected, what="schedule(count) vs lrate(count + 1)")


def test_optax_computes_the_rate_and_the_bias_correction_in_float64():
    """Nothing in the optimizer's update of a float64 model is float32: not the schedule, not 1 - beta^t."""
    model = training_model()
    optimizer = training.optimizer(model, TRAINING)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    jaxpr = str(jax.make_jaxpr(lambda grads, state: optimizer.adam.tx.update(grads, state, params))(
        params, nnx.as_pure(optimizer.adam.opt_state)))
    assert "pow 0.98" in jaxpr and "f64" in jaxpr                     # the bias correction is traced here
    assert "f32" not in jaxpr


# 20 to 40 s: the float64 gradient and training step compiled, three steps (XLA:CPU takes some 20 s of CPU for a `tiny`
# training step).
def test_one_and_three_steps_are_the_papers_adam():
    """Each step of the port, given its own gradients (dropout 0), against Kingma & Ba's Algorithm 1 written out
    above: the loss it returns, the weights after steps 1 and 3 and Adam's moments, within the float64 policy."""
    model = training_model()
    optimizer = training.optimizer(model, TRAINING)
    weights = checkpoint.to_params(model)
    m = {name: np.zeros_like(value) for name, value in weights.items()}
    v = {name: np.zeros_like(value) for name, value in weights.items()}
    for t in range(1, 4):
        inputs = cases.training_inputs(model.config, seed=t)
        value, grads = training.gradients(model, **inputs)
        assert abs(training.train_step(model, optimizer, **inputs) - value) <= tolerance.float64_bound(value)
        rate = paper_rate(t, model.config.d_model, TRAINING)
        for name in weights:
            weights[name], m[name], v[name] = paper_adam(weights[name], grads[name], m[name], v[name], t, rate,
                                                         TRAINING)
        state = training.training_state(model, optimizer)
        assert state.step == t and state.config == TRAINING
        if t in (1, 3):
            after = checkpoint.to_params(model)
            for name in weights:
                tolerance.assert_agrees(after[name], weights[name], what=f"step {t}: {name}")
                tolerance.assert_agrees(state.first_moments[name], m[name], what=f"step {t}: m of {name}")
                tolerance.assert_agrees(state.second_moments[name], v[name], what=f"step {t}: v of {name}")
    assert max(np.abs(after[name] - cases.seeded_params(model.config)[name]).max() for name in after) > 1e-2


def test_a_training_run_compiles_its_step_once(caplog):
    """Three steps of a new model placed on the CPU and its optimizer compile the training step once, on a
    batch shape no other test trains on: the optimizer's step counters start committed to the model's device
    (optax creates them uncommitted; beside committed weights, the step's arguments turning committed after
    its first call compiled it again)."""
    config = VARIANTS["tiny"].replace(dropout=0.0)
    model = checkpoint.from_params(config, cases.seeded_params(config), device="cpu")
    optimizer = training.optimizer(model, TRAINING)
    batches = [{name: value[:2, :5] for name, value in cases.training_inputs(model.config, seed=t).items()}
               for t in range(3)]
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for batch in batches:
            training.train_step(model, optimizer, **batch)
    compiled = [record.message for record in caplog.records if "compilation of jit(_train_step)" in record.message]
    assert len(compiled) == 1, compiled


def test_tied_embeddings_have_one_pair_of_moments():
    model = training_model("shared_embeddings")
    state = training.training_state(model, training.optimizer(model))
    assert list(state.first_moments) == list(state.second_moments) == list(checkpoint.to_params(model))
    assert "shared_embed.weight" in state.first_moments and "src_embed.weight" not in state.first_moments
    adam = optax.tree.get(nnx.as_pure(training.optimizer(model).adam.opt_state), "ScaleByAdamState")
    assert len(nnx.to_flat_state(adam.mu)) == len(state.first_moments)


@pytest.mark.parametrize("p_drop", [0.1, 0.5])
def test_dropout_on_the_embedding_sums_has_the_papers_statistics(p_drop):
    """Section 5.4 on the sums of embeddings and positional encodings (the model's PositionalEncoding): each entry
    is dropped independently with probability P_drop and the survivors are scaled by 1 / (1 - P_drop). With N
    entries, Hoeffding's inequality bounds P(|dropped fraction - P_drop| >= delta) by 2 exp(-2 N delta^2); delta
    below makes that 1e-9."""
    config = VARIANTS["tiny"].replace(dropout=p_drop)
    positions = PositionalEncoding(config, dtype=jnp.float64, rngs=nnx.Rngs(params=0, dropout=1))
    x = np.full((8, config.max_len, config.d_model), 3.0)            # x + PE lies in [2, 4]: never 0 before dropout
    clean = np.asarray(positions(x, deterministic=True))
    noisy = np.asarray(positions(x, deterministic=False))
    dropped = noisy == 0
    delta = np.sqrt(np.log(2 / 1e-9) / (2 * dropped.size))
    assert abs(dropped.mean() - p_drop) <= delta, (dropped.mean(), delta)
    tolerance.assert_agrees(noisy[~dropped], clean[~dropped] / (1 - p_drop), what="survivors scaled")
    second = np.asarray(positions(x, deterministic=False))
    assert (second == 0).mean() > 0 and np.any((second == 0) != dropped)   # the stream advances: a new mask
    masks = []
    for _ in range(2):
        nnx.reseed(positions, dropout=2)
        masks.append(np.asarray(positions(x, deterministic=False)) == 0)
    np.testing.assert_array_equal(masks[0], masks[1])                     # the seed decides the masks


# 20 to 40 s: the training step with dropout (P_drop 0.5: its own program) and the eval loss compiled (XLA:CPU takes
# some 20 s of CPU for a `tiny` training step).
def test_a_training_step_uses_dropout_and_leaves_inference_untouched():
    """With P_drop = 0.5 the step's loss is not the eval loss; the dropout stream lives in the model's Dropout
    modules and advances; after the step the model computes inference (no dropout), the reference's forward at
    the updated weights."""
    model = training_model(dropout=0.5)
    inputs = cases.training_inputs(model.config)
    eval_loss = float(loss(model, **inputs, deterministic=True))
    counts = np.array([c[...] for _, c in nnx.to_flat_state(nnx.state(model, nnx.RngCount))])
    step_loss = training.train_step(model, training.optimizer(model, TRAINING), **inputs)
    assert abs(step_loss - eval_loss) > 1e3 * tolerance.float64_bound(eval_loss)
    after = np.array([c[...] for _, c in nnx.to_flat_state(nnx.state(model, nnx.RngCount))])
    assert np.all(after > counts)                                    # every dropout stream drew a mask
    nnx.reseed(model, dropout=7)                                     # the streams carry the "dropout" tag
    assert all(c[...] == 0 for _, c in nnx.to_flat_state(nnx.state(model, nnx.RngCount)))
    forward_inputs = {"src": inputs["src"], "tgt": inputs["tgt"]}
    expected = reference.build(model.config, checkpoint.to_params(model))(**forward_inputs)
    tolerance.assert_agrees(np.asarray(model(**forward_inputs)), expected, what="inference after a step")


def test_compiled_calls_follow_the_models_weights():
    """The model is split once for compiled calls, which pass its Variables' current values: after
    ``variable[...] =``, a training step, ``nnx.update`` and a Variable replaced by another object, the
    compiled forward pass is the reference's at the model's weights of that moment."""
    model = training_model()
    inputs = cases.model_inputs(model.config, "source_padding")

    def agrees(what: str) -> None:
        expected = reference.build(model.config, checkpoint.to_params(model))(**inputs)
        tolerance.assert_agrees(np.asarray(forward(model, **inputs)), expected, what=what)

    agrees("as built")
    kernel = model.decoder.layers[0].ffn.linear1.kernel
    kernel[...] = 2 * kernel[...]
    agrees("after variable[...] =")
    training.train_step(model, training.optimizer(model, TRAINING), **cases.training_inputs(model.config))
    agrees("after a training step")
    nnx.update(model.encoder, jax.tree.map(lambda value: -value, nnx.state(model.encoder, nnx.Param)))
    agrees("after nnx.update")
    model.generator.weight = nnx.Param(-model.generator.weight[...])
    agrees("after replacing a Variable")


def test_the_compiled_forward_pass_advances_the_dropout_streams():
    """As ``nnx.jit`` would: a compiled call with dropout on draws new masks each time, and the model's
    streams remember it."""
    model = training_model(dropout=0.5)
    view = nnx.view(model, deterministic=False)
    inputs = cases.model_inputs(model.config, "source_padding")
    counts = lambda: np.array([c[...] for _, c in nnx.to_flat_state(nnx.state(model, nnx.RngCount))])
    before = counts()
    first = np.asarray(forward(view, **inputs))
    between = counts()
    second = np.asarray(forward(view, **inputs))
    assert tolerance.max_abs(first, second) > 0
    assert np.all(before < between) and np.all(between < counts())


def test_a_saved_run_resumes_exactly(tmp_path):
    """training_state -> save_checkpoint(training=) -> load_training_state -> optimizer(state=): the next step is
    bit for bit the step of the run continued in memory (the saved config is used when none is given)."""
    path, batches = tmp_path / "run.safetensors", [cases.training_inputs(VARIANTS["tiny"], seed=s) for s in range(3)]
    model = training_model()
    optimizer = training.optimizer(model, TRAINING)
    for inputs in batches[:2]:
        training.train_step(model, optimizer, **inputs)
    checkpoint.save_checkpoint(model, path, training=training.training_state(model, optimizer))
    resumed = checkpoint.load_checkpoint(path)
    resumed_optimizer = training.optimizer(resumed, state=reference_checkpoint.load_training_state(path))
    assert training.training_state(resumed, resumed_optimizer).config == TRAINING
    losses = [training.train_step(m, o, **batches[2]) for m, o in ((model, optimizer), (resumed, resumed_optimizer))]
    assert losses[0] == losses[1]
    states = [training.training_state(m, o) for m, o in ((model, optimizer), (resumed, resumed_optimizer))]
    assert states[0].step == states[1].step == 3
    for name, value in checkpoint.to_params(model).items():
        np.testing.assert_array_equal(checkpoint.to_params(resumed)[name], value, err_msg=name)
        for which in (2, 3):
            np.testing.assert_array_equal(states[1][which][name], states[0][which][name], err_msg=name)


def test_training_refuses_float64_without_x64_and_labels_of_pad_alone():
    """A float64 step with x64 off, and a batch whose labels are all pad, are refused in one line (a saved run's bad
    moments, every port: tests/ports/test_every_port.py)."""
    model = training_model()
    inputs = cases.training_inputs(model.config)
    with jax.enable_x64(False), pytest.raises(ValueError, match="float64 needs 64-bit JAX"):
        training.train_step(model, training.optimizer(model), **inputs)
    with pytest.raises(ValueError, match="labels hold no non-pad token"):
        training.train_step(model, training.optimizer(model), inputs["src"], inputs["tgt"],
                            np.zeros_like(inputs["labels"]))
