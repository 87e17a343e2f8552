"""Checks specific to the TensorFlow/Keras port (the shared matrix is in ``test_agreement.py``, what every port must
do in tests/ports/test_every_port.py):
checkpoint interchange with the reference, Keras serialization and ``.weights.h5`` saving, the
backend guard, masking, dropout, the key/value cache, the compiled searches, training
(section 5: the schedule, Keras's Adam made to compute the paper's update, dropout, resuming), and
bfloat16 and float16 models (the recipe of ``reference_numpy/precision.py``: the formats' names, files, the port's
own refusal to train one, mixed-precision training over float32 masters with Keras' ``LossScaleOptimizer``)."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install '.[tf]')")
keras = pytest.importorskip("keras", reason="keras is not installed (pip install '.[tf]')")

import transformer_tf  # noqa: E402
from equivalence import cases, tolerance  # noqa: E402
from equivalence.backends import numpy as reference  # noqa: E402
from equivalence.backends import tf as backend  # noqa: E402
from equivalence.cases import VARIANTS  # noqa: E402
from reference_numpy import checkpoint as reference_checkpoint  # noqa: E402
from reference_numpy import decoding as reference_decoding  # noqa: E402
from reference_numpy import model as reference_model_module  # noqa: E402
from reference_numpy import precision  # noqa: E402
from reference_numpy import training as reference_training  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from reference_numpy.incremental import at_position as reference_at_position  # noqa: E402
from reference_numpy.precision import round_to, training_dtype  # noqa: E402
from transformer_tf import checkpoint, data_parallel, decoding, device, training  # noqa: E402
from transformer_tf.incremental import at_position  # noqa: E402
from transformer_tf.model import (  # noqa: E402
    Transformer,
    scaled_dot_product_attention,
    sinusoidal_positional_encoding,
)
from transformer_tf.speed import compiled_forward  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float64", "float32")
LOW_DTYPES = ("bfloat16", "float16")
BAD_DTYPE = "dtype must be one of float64, float32, bfloat16, float16, got "


@functools.cache
def port_model(variant: str, dtype: str, params_kind: str = "test") -> Transformer:
    params = (cases.decoding_params if params_kind == "decoding" else cases.seeded_params)(VARIANTS[variant])
    return backend.build(VARIANTS[variant], params, dtype)


@functools.cache
def reference_model(variant: str, dtype: str, params_kind: str = "test"):
    params = (cases.decoding_params if params_kind == "decoding" else cases.seeded_params)(VARIANTS[variant])
    return reference.build(VARIANTS[variant], params, dtype)


def reference_log_probs(variant: str, inputs: dict, params_kind: str = "test"):
    return tuple(reference_model(variant, dtype, params_kind)(**inputs) for dtype in DTYPES)


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("change", ["missing", "shape", "nan"])
def test_bad_params_give_the_reference_errors(change):
    config = VARIANTS["tiny"]
    params = cases.seeded_params(config)
    name = "decoder.layers.1.cross_attn.k_proj.weight"
    if change == "missing":
        del params[name]
    elif change == "shape":
        params[name] = params[name].T[:, :-1]
    else:
        params[name][0, 0] = np.nan
    with pytest.raises(ValueError) as expected:
        reference_checkpoint.validate_params(config, params)
    with pytest.raises(ValueError, match=name) as port:
        transformer_tf.from_params(config, params)
    assert str(port.value) == str(expected.value)


def keras_attribute(model, path: str):
    """The object at an attribute path of the name table (list indices as components)."""
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_name_table_covers_every_keras_weight_exactly_once(variant):
    model = port_model(variant, "float64")
    table = checkpoint.name_table(model.config)
    shapes = reference_checkpoint.parameter_shapes(model.config)
    assert list(table) == list(shapes)
    assert len(set(table.values())) == len(table)
    weights = [keras_attribute(model, path) for path in table.values()]
    assert len({id(weight) for weight in weights}) == len(weights)
    assert {id(weight) for weight in weights} == {id(weight) for weight in model.weights}
    assert len(model.weights) == len(table)
    assert checkpoint.transposed(model.config) == ()
    assert [tuple(weight.shape) for weight in weights] == list(shapes.values())


def test_a_tensor_of_the_wrong_layout_names_the_checkpoint_tensor_and_the_keras_variable(monkeypatch):
    config = VARIANTS["tiny"]
    name = "encoder.layers.0.ffn.linear1.weight"                 # (d_model, d_ff): not square
    monkeypatch.setattr(checkpoint, "transposed", lambda config: (name,))
    d, f = config.d_model, config.d_ff
    with pytest.raises(ValueError, match=rf"^tensor '{name}' has shape \({f}, {d}\); the Keras variable "
                                         rf"encoder\.layers\.0\.ffn\.linear1\.kernel has shape \({d}, {f}\)$"):
        transformer_tf.from_params(config, cases.seeded_params(config))


def test_loading_draws_no_random_weights_and_leaves_the_callers_arrays(monkeypatch):
    """The model's variables are created from the arrays: Keras's random initializers never run
    (they fail here, as constructing a model shows) and the caller's dict and arrays are untouched."""
    config = VARIANTS["shared_embeddings"]
    params = cases.seeded_params(config)
    before = {name: value.copy() for name, value in params.items()}

    def refuse(*args, **kwargs):
        raise AssertionError("a random initializer ran")

    for initializer in (keras.initializers.RandomUniform, keras.initializers.GlorotUniform):
        monkeypatch.setattr(initializer, "__call__", refuse)
    with pytest.raises(AssertionError, match="a random initializer ran"):
        Transformer(config)
    model = transformer_tf.from_params(config, params, "float32")
    assert list(params) == list(before)
    for name, value in params.items():
        np.testing.assert_array_equal(value, before[name])
    for name, value in checkpoint.to_params(model).items():
        np.testing.assert_array_equal(value, before[name].astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_checkpoint_keeps_the_file_dtype_unless_asked(tmp_path, dtype):
    config = VARIANTS["shared_embeddings"]
    path = tmp_path / "model.safetensors"
    params = {name: value.astype(dtype) for name, value in cases.seeded_params(config).items()}
    reference_checkpoint.save_checkpoint(path, config, params)
    model = transformer_tf.load_checkpoint(path)
    assert model.compute_dtype == dtype and {w.dtype for w in model.weights} == {dtype}
    other = "float32" if dtype == "float64" else "float64"
    assert transformer_tf.load_checkpoint(path, dtype=other).compute_dtype == other


# ----------------------------------------------------------------------------- Keras idiom

def test_get_config_round_trip():
    model = port_model("pre_ln", "float32")
    config = model.get_config()
    assert config["config"] == VARIANTS["pre_ln"].to_dict()
    clone = Transformer.from_config(config)
    assert clone.config == model.config and clone.dtype_policy.name == "float32"
    assert [tuple(w.shape) for w in clone.weights] == [tuple(w.shape) for w in model.weights]
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert isinstance(revived, Transformer) and revived.config == model.config
    for layer in (model.encoder, model.decoder.layers[0], model.decoder.layers[0].self_attn,
                  model.encoder.layers[0].ffn, model.tgt_pos, model.src_embed, model.decoder.norm):
        copy = type(layer).from_config(layer.get_config())
        assert copy.get_config() == layer.get_config(), type(layer).__name__


# Keras' save_weights calls np.array on its variables, which NumPy 2 flags (not this port's code).
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
def test_keras_weights_h5_round_trip_gives_identical_outputs(tmp_path, variant):
    model = port_model(variant, "float64")
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    clone = Transformer.from_config(model.get_config())
    clone.load_weights(path)
    inputs = cases.model_inputs(VARIANTS[variant], "ragged_batch")
    np.testing.assert_array_equal(clone(**inputs).numpy(), model(**inputs).numpy())


def test_float32_and_float64_models_coexist(agreement):
    inputs = cases.model_inputs(VARIANTS["tiny"], "source_padding")
    ref64, ref32 = reference_log_probs("tiny", inputs)
    for dtype in DTYPES:
        out = port_model("tiny", dtype)(**inputs).numpy()
        assert {w.dtype for w in port_model("tiny", dtype).weights} == {dtype}
        agreement(out, ref64, ref32, port="tf", device="cpu", dtype=dtype, what="coexisting dtypes")


def test_wrong_keras_backend_is_refused_in_one_line():
    pytest.importorskip("jax", reason="jax is not installed: no other Keras backend to configure")
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    result = subprocess.run([sys.executable, "-c", "import transformer_tf"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and "KERAS_BACKEND=tensorflow" in last and "'jax'" in last


def test_import_sets_no_keras_backend(tmp_path):
    """Keras' default backend is TensorFlow: importing the port leaves ``KERAS_BACKEND`` unset
    (a fresh Keras home, so no keras.json of this machine chooses a backend)."""
    env = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    code = "import os, transformer_tf, keras; print(os.environ.get('KERAS_BACKEND'), keras.backend.backend())"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "tensorflow"]


def test_keras_masks_on_inputs_are_ignored():
    """A ``_keras_mask`` on an input must not become ``mask``/``src_mask``/``tgt_mask``."""
    model = port_model("tiny", "float64")
    inputs = cases.model_inputs(VARIANTS["tiny"], "ragged_batch")
    expected = model(inputs["src"], inputs["tgt"]).numpy()
    src, tgt = tf.constant(inputs["src"]), tf.constant(inputs["tgt"])
    src._keras_mask = tf.zeros(src.shape, tf.bool)
    tgt._keras_mask = tf.zeros(tgt.shape, tf.bool)
    np.testing.assert_array_equal(model(src, tgt).numpy(), expected)
    x = tf.constant(np.random.default_rng(0).standard_normal((3, 7, 16)))
    plain = model.encoder.layers[0](x).numpy()
    x._keras_mask = tf.constant([[True] * 7, [False] * 7, [True] * 7])
    np.testing.assert_array_equal(model.encoder.layers[0](x).numpy(), plain)


# ----------------------------------------------------------------------------- masking and dropout

@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_row_gives_zeros(dtype, jit_compile):
    inputs = cases.component_inputs(VARIANTS["tiny"], "attention", "fully_masked_row", dtype=np.dtype(dtype))
    attention = tf.function(scaled_dot_product_attention, jit_compile=jit_compile)
    out, weights = attention(inputs["query"], inputs["key"], inputs["value"], inputs["mask"])
    assert out.dtype == dtype
    assert np.all(out.numpy()[1] == 0) and np.all(weights.numpy()[1] == 0)
    assert np.isfinite(out.numpy()).all() and np.abs(out.numpy()[0]).max() > 0


def test_bad_masks_and_tokens_raise_one_line_value_errors():
    model = port_model("tiny", "float64")
    inputs = cases.attention_inputs(VARIANTS["tiny"], "source_padding")
    with pytest.raises(ValueError, match="mask must be boolean"):
        scaled_dot_product_attention(inputs["query"], inputs["key"], inputs["value"], inputs["mask"].astype(int))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_dot_product_attention(inputs["query"], inputs["key"], inputs["value"], np.ones((2, 5), bool))
    tokens = cases.model_inputs(VARIANTS["tiny"], "none")
    with pytest.raises(ValueError, match=r"src holds token ids outside \[0, 19\)"):
        model(tokens["src"] + 100, tokens["tgt"])
    for dtype in ("int8", "float8_e4m3fn"):
        with pytest.raises(ValueError, match=f"^{BAD_DTYPE}{dtype}$"):
            Transformer(VARIANTS["tiny"], dtype=dtype)
    with pytest.raises(ValueError, match="device must be one of"):
        backend.build(VARIANTS["tiny"], cases.seeded_params(VARIANTS["tiny"]), "float64", "gpu:99")


def test_dropout_only_in_training(agreement):
    model = port_model("pre_ln", "float64")
    inputs = cases.model_inputs(VARIANTS["pre_ln"], "ragged_batch")
    ref64, ref32 = reference_log_probs("pre_ln", inputs)
    agreement(model(**inputs, training=False).numpy(), ref64, ref32, port="tf", device="cpu", dtype="float64",
              what="training=False")
    first, second = (model(**inputs, training=True).numpy() for _ in range(2))
    assert np.isfinite(first).all()
    assert np.abs(first - ref64).max() > 1e-3 and np.abs(first - second).max() > 1e-3


@pytest.mark.parametrize("jit_compile", [False, True])
def test_compiled_forward_agrees_in_float64(jit_compile, agreement):
    """The graph (``jit_compile``: XLA's program) of the forward pass, its output and, with ``stages``,
    every stage against the reference's (``backend.forward`` runs the model eagerly)."""
    inputs = cases.model_inputs(VARIANTS["learned_pe"], "fully_masked_row")
    ref64, ref32 = reference_log_probs("learned_pe", inputs)
    out = compiled_forward(port_model("learned_pe", "float64"), jit_compile=jit_compile)(**inputs)
    agreement(out.numpy(), ref64, ref32, port="tf", device="cpu", dtype="float64", what="compiled forward")
    _, stages = compiled_forward(port_model("learned_pe", "float64"), jit_compile=jit_compile, stages=True)(**inputs)
    reference_stages = {dtype: reference.forward(reference_model("learned_pe", dtype, "test"), **inputs)
                        for dtype in DTYPES}
    assert list(stages) == list(reference_stages["float64"])
    for name, stage in stages.items():
        agreement(stage.numpy(), reference_stages["float64"][name], reference_stages["float32"][name], port="tf",
                  device="cpu", dtype="float64", what=f"compiled forward stage {name}")


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("step", [1, 4], ids=["one_position_per_call", "several_positions_per_call"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["tiny", "pre_ln"])
def test_cached_decode_equals_the_reference_forward_pass(variant, dtype, step, agreement):
    """Teacher forcing through the key/value cache (``init_cache``, ``decode(..., cache=,
    cache_index=)``) against the reference's full forward pass. The cache holds two positions
    more than the target, so unwritten positions must be masked; padding inside the target is
    hidden by an explicit mask over absolute positions."""
    config = VARIANTS[variant]
    inputs = cases.model_inputs(config, "ragged_batch")
    del inputs["src_mask"], inputs["tgt_mask"]
    ref64, ref32 = reference_log_probs(variant, inputs)
    model, src, tgt = port_model(variant, dtype), inputs["src"], inputs["tgt"]
    length, capacity = tgt.shape[1], tgt.shape[1] + 2
    keys = np.arange(capacity)
    written = np.pad(tgt, ((0, 0), (0, capacity - length)), constant_values=config.pad_id) != config.pad_id
    src_mask = transformer_tf.padding_mask(src, config.pad_id)
    memory = model.encode(src, src_mask)
    cache = model.init_cache(memory, capacity)
    assert len(cache) == config.n_decoder_layers
    assert tuple(cache[0][0].keys.shape) == (len(tgt), config.n_heads, capacity, config.d_k)
    assert tuple(cache[0][1].values.shape) == (len(tgt), config.n_heads, src.shape[1], config.d_k)
    outs = []
    for start in range(0, length, step):                                # T_new = step (the last call: fewer)
        queries = np.arange(start, min(start + step, length))
        tgt_mask = written[:, None, None, :] & (keys[None, :] <= queries[:, None])[None, None]   # (B, 1, T_new, C)
        out, cache = model.decode(tgt[:, queries], memory, src_mask, tgt_mask, cache=at_position(cache, start))
        outs.append(out)
    cached = model.generator(tf.concat(outs, axis=1)).numpy()
    agreement(cached, ref64, ref32, port="tf", device="cpu", dtype=dtype, what="cached log-probs")


def test_cached_next_token_log_probs_use_the_causal_mask_by_default(agreement):
    """Without a target mask the cached step sees keys j <= cache_index + q: step by step it
    gives the reference's log-probabilities of every next token (pad and bos at -inf)."""
    config = VARIANTS["pre_ln"]
    inputs = cases.model_inputs(config, "source_padding")             # no padding inside the target
    del inputs["src_mask"], inputs["tgt_mask"]
    ref64, ref32 = reference_log_probs("pre_ln", inputs)
    model, src, tgt = port_model("pre_ln", "float64"), inputs["src"], inputs["tgt"]
    src_mask = transformer_tf.padding_mask(src, config.pad_id)
    memory = model.encode(src, src_mask)
    cache = model.init_cache(memory, config.max_len)
    steps = []
    for t in range(tgt.shape[1]):
        log_probs, cache = decoding.next_token_log_probs(model, tgt[:, t:t + 1], memory, src_mask, cache, t)
        steps.append(log_probs.numpy())
    cached = np.stack(steps, axis=1)                                   # (B, T, V)
    forbidden = [config.pad_id, config.bos_id]
    assert np.all(cached[..., forbidden] == -np.inf)
    allowed = np.setdiff1d(np.arange(config.tgt_vocab_size), forbidden)
    agreement(cached[..., allowed], ref64[..., allowed], ref32[..., allowed], port="tf", device="cpu",
              dtype="float64", what="cached next-token log-probs")


@pytest.mark.parametrize("capacity,tgt_slice,cache_index", [
    (0, slice(0, 1), 0),                       # capacity outside [1, max_len]
    (4, slice(0, 1), None),                    # no cache_index with a cache
    (4, slice(0, 1), -1),                      # a negative cache_index
    (4, slice(0, 2), 3),                       # new positions past the capacity
    (4, slice(0, 1), tf.constant(4)),          # an eager tensor index is checked too
])
def test_bad_cache_arguments_give_the_reference_errors(capacity, tgt_slice, cache_index):
    """One-line ValueErrors, word for word the reference's (the same call on the NumPy model)."""
    tokens = cases.model_inputs(VARIANTS["tiny"], "none")
    tgt = tokens["tgt"][:, tgt_slice]
    plain_index = cache_index.numpy().item() if tf.is_tensor(cache_index) else cache_index
    messages = []
    for model, index, placed in ((reference_model("tiny", "float64"), plain_index, reference_at_position),
                                 (port_model("tiny", "float64"), cache_index, at_position)):
        memory = model.encode(tokens["src"])
        with pytest.raises(ValueError) as error:
            model.decode(tgt, memory, cache=placed(model.init_cache(memory, capacity), index))
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "\n" not in messages[1]


def test_reorder_cache_gathers_every_cache_along_the_batch_axis():
    model = port_model("tiny", "float64")
    memory = tf.constant(np.random.default_rng(0).standard_normal((3, 5, 16)))    # (B, S, D)
    cache = model.init_cache(memory, 6)
    reordered = decoding.reorder_cache(cache, tf.constant([2, 2, 0]))
    for layer, original in zip(reordered, cache):
        for kv, source in zip(layer, original):
            assert isinstance(kv, transformer_tf.KVCache) and kv.beams == ()
            for tensor, before in ((kv.keys, source.keys), (kv.values, source.values)):
                np.testing.assert_array_equal(tensor.numpy(), before.numpy()[[2, 2, 0]])


def test_argmax_breaks_ties_to_the_lower_index_under_xla():
    values = tf.constant([[1.0, 3.0, 3.0, -np.inf, 3.0, 2.0]], tf.float64)
    assert tf.function(lambda x: tf.argmax(x, axis=-1), jit_compile=True)(values).numpy().tolist() == [1]


def tied_candidates(rng, beam_size: int, vocab: int, eos_id: int) -> np.ndarray:
    """Summed log-probabilities (K, V) drawn from a few values, so that most candidates tie exactly,
    -0.0 against +0.0 and -inf (pad and bos) included; eos is often among the best."""
    values = rng.choice(np.array([0.0, -0.0, -0.5, -1.0, -np.inf]), size=(beam_size, vocab))
    values[:, eos_id] = rng.choice([0.0, -0.5], size=beam_size)
    values[:, :2] = -np.inf                                                     # pad and bos
    return values


@pytest.mark.parametrize("jit_compile", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_beam_selection_is_the_references_on_exact_ties(dtype, jit_compile):
    """The compiled step's selection (top_k: ties to the lower beam, then the lower token) against the
    reference's ``select_candidates`` (a stable sort of all K x V candidates), with and without XLA, on
    candidates that tie everywhere: the eos that finish (beam and score, in rank order) and the next
    live beams (beam, token, score, in rank order) must be the same."""
    rng = np.random.default_rng(0)
    beam_size, vocab, eos_id = 3, 7, 2
    batch = np.stack([tied_candidates(rng, beam_size, vocab, eos_id) for _ in range(40)]).astype(dtype)
    select = tf.function(lambda c: decoding._select(c, eos_id, beam_size), jit_compile=jit_compile)
    value, beam, token, finishing, keep = (t.numpy() for t in select(tf.constant(batch)))
    for b, candidates in enumerate(batch):
        expected = reference_decoding.select_candidates(candidates, eos_id, beam_size)
        assert [(beam[b, r], value[b, r]) for r in np.flatnonzero(finishing[b])] == expected.finishing
        kept = keep[b][np.isfinite(value[b, keep[b]])]                      # the reference keeps finite ones only
        np.testing.assert_array_equal(beam[b, kept], expected.beams)
        np.testing.assert_array_equal(token[b, kept], expected.tokens)
        np.testing.assert_array_equal(value[b, kept], expected.scores)


@functools.cache
def reference_search(variant: str, kind: str):
    model = reference_model(variant, "float64", "decoding")
    src = cases.decoding_inputs(VARIANTS[variant])
    if kind == "greedy":
        return reference_decoding.greedy_decode(model, src), None
    return reference_decoding.beam_search(model, src)


def test_beam_search_rejects_a_bad_beam_size():
    with pytest.raises(ValueError, match="beam_size must be a positive int"):
        transformer_tf.beam_search(port_model("tiny", "float64"), cases.decoding_inputs(VARIANTS["tiny"]),
                                   beam_size=0)


# ----------------------------------------------------------------------------- devices

def test_devices_and_switches():
    assert device.devices()[0] == "cpu"
    assert device.resolve_device("cpu") == "/CPU:0"
    device.full_precision()
    assert not tf.config.experimental.tensor_float_32_execution_enabled()


def _gpu() -> str:
    gpus = [name for name in device.devices() if name != "cpu"]
    if not gpus:
        pytest.skip("no GPU present: TensorFlow lists no GPU device on this machine")
    return gpus[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_forward_agrees_with_tf32_off(dtype, agreement):
    gpu = _gpu()
    params = cases.seeded_params(VARIANTS["tiny"])
    model = backend.build(VARIANTS["tiny"], params, dtype, gpu)
    assert "GPU" in device.model_device(model)
    assert not tf.config.experimental.tensor_float_32_execution_enabled()
    inputs = cases.model_inputs(VARIANTS["tiny"], "ragged_batch")
    ref64, ref32 = reference_log_probs("tiny", inputs)
    agreement(backend.forward(model, **inputs)["log_probs"], ref64, ref32, port="tf", device=gpu, dtype=dtype,
              what="gpu forward")


def test_gpu_search_tokens_equal_the_reference():
    gpu = _gpu()
    model = backend.build(VARIANTS["tiny"], cases.decoding_params(VARIANTS["tiny"]), "float64", gpu)
    src = cases.decoding_inputs(VARIANTS["tiny"])
    np.testing.assert_array_equal(backend.greedy(model, src), reference_search("tiny", "greedy")[0])
    np.testing.assert_array_equal(backend.beam(model, src)[0], reference_search("tiny", "beam")[0])


# ----------------------------------------------------------------------------- training (section 5)

# A short warmup so that the first steps take large learning rates (0.088, 0.125, 0.144 for d_model 16):
# every mistake in the update (epsilon's place, the step count, beta2, a float32 learning rate) then
# moves the weights far beyond the float64 rounding.
TRAINING = TrainingConfig(warmup_steps=2)


def paper_lrate(step: int, d_model: int, config: TrainingConfig) -> float:
    """Eq. (3), written out: d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step from 1."""
    return config.learning_rate_scale / math.sqrt(d_model) * min(1 / math.sqrt(step),
                                                                  step / config.warmup_steps ** 1.5)


def paper_adam(weights: dict, first: dict, second: dict, grads: dict, t: int, rate: float,
               config: TrainingConfig) -> None:
    """Kingma & Ba (2015), Algorithm 1, in NumPy, in place: step t (from 1) with learning rate ``rate``."""
    b1, b2, eps = config.beta1, config.beta2, config.epsilon
    for name, g in grads.items():
        first[name] = b1 * first[name] + (1 - b1) * g
        second[name] = b2 * second[name] + (1 - b2) * g * g
        m_hat, v_hat = first[name] / (1 - b1 ** t), second[name] / (1 - b2 ** t)
        weights[name] = weights[name] - rate * m_hat / (np.sqrt(v_hat) + eps)


def training_model(variant: str = "tiny", dropout: float = 0.0, dtype: str = "float64") -> Transformer:
    """A fresh model from the seeded weights (training changes it: never cached)."""
    config = VARIANTS[variant].replace(dropout=dropout)
    return backend.build(config, cases.seeded_params(config), dtype)


def assert_within_float64_policy(port: dict, expected: dict, what: str) -> None:
    assert list(port) == list(expected), what
    for name in expected:
        assert port[name].dtype == np.float64, f"{what} {name}"
        tolerance.assert_agrees(port[name], expected[name], what=f"{what} {name}")


@pytest.mark.parametrize("config", [reference_training.PAPER, TrainingConfig(warmup_steps=7, learning_rate_scale=3.0)])
def test_the_schedule_gives_eq3_at_iterations_plus_one(config):
    """Keras evaluates the schedule at ``optimizer.iterations`` (0 before the first update): the update
    numbered t = iterations + 1 gets the reference's lrate(t), in float64."""
    schedule = training.learning_rate_schedule(16, config)
    iterations = np.array([0, 1, 2, config.warmup_steps - 2, config.warmup_steps - 1, config.warmup_steps,
                           10 * config.warmup_steps, 10 ** 6])
    rates = schedule(tf.constant(iterations)).numpy()
    expected = np.array([reference_training.learning_rate(int(i) + 1, 16, config) for i in iterations])
    assert rates.dtype == np.float64
    tolerance.assert_agrees(rates, expected, what="lrate(iterations + 1)")
    assert np.argmax(rates) == 4                                             # the peak: step t = warmup_steps
    model = training_model()
    assert float(training.optimizer(model, config).adam.learning_rate) == rates[0]  # before the first step: lrate(1)


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
def test_keras_adam_computes_the_papers_update(variant):
    """One and three updates with the port's own gradients (``optimizer.apply``, eager) against Algorithm 1
    written out above: weights and moments (tied weights: one tensor, one pair of moments) within the
    float64 policy (measured: identical bits)."""
    model = training_model(variant)
    inputs = cases.training_inputs(model.config)
    optimizer = training.optimizer(model, TRAINING)
    weights = checkpoint.to_params(model)
    assert list(weights) == list(reference_checkpoint.parameter_shapes(model.config))
    first, second = ({name: np.zeros_like(w) for name, w in weights.items()} for _ in range(2))
    for t in (1, 2, 3):
        _, grads = training.gradients(model, **inputs)
        keras_layout = checkpoint.from_checkpoint_layout(model, grads)
        optimizer.adam.apply([keras_layout[v.path] for v in model.trainable_variables], model.trainable_variables)
        paper_adam(weights, first, second, grads, t, paper_lrate(t, model.config.d_model, TRAINING), TRAINING)
        if t in (1, 3):
            state = training.training_state(model, optimizer)
            assert state.step == t and state.config == TRAINING
            assert_within_float64_policy(checkpoint.to_params(model), weights, f"weights after {t} steps")
            assert_within_float64_policy(state.first_moments, first, f"m after {t} steps")
            assert_within_float64_policy(state.second_moments, second, f"v after {t} steps")


def test_train_step_is_the_papers_step():
    """Three compiled steps (dropout 0) against Algorithm 1 fed with the port's eager gradients at the same
    weights. The compiled gradient may differ from the eager one by rounding; Adam divides by sqrt(v_hat) + eps
    and so magnifies that where a gradient is ~0, which :class:`equivalence.tolerance.TrainingBound` accounts
    for (the gradient policy carried through the update)."""
    model = training_model()
    optimizer = training.optimizer(model, TRAINING)
    weights = checkpoint.to_params(model)
    first, second = ({name: np.zeros_like(w) for name, w in weights.items()} for _ in range(2))
    bound = tolerance.TrainingBound(weights)
    for t in (1, 2, 3):
        inputs = cases.training_inputs(model.config, seed=t)
        value, grads = training.gradients(model, **inputs)
        assert abs(training.train_step(model, optimizer, **inputs) - value) <= tolerance.float64_bound(value)
        rate = paper_lrate(t, model.config.d_model, TRAINING)
        paper_adam(weights, first, second, grads, t, rate, TRAINING)
        bound.step(value, grads, first, second, t, rate, TRAINING.beta1, TRAINING.beta2, TRAINING.epsilon)
        state, params = training.training_state(model, optimizer), checkpoint.to_params(model)
        assert state.step == t
        for name in weights:
            assert np.all(np.abs(params[name] - weights[name]) <= bound.weight_bound(name, weights[name])), name
            assert np.all(np.abs(state.first_moments[name] - first[name])
                          <= bound.first_moment_bound(name, first[name])), name
            assert np.all(np.abs(state.second_moments[name] - second[name])
                          <= bound.second_moment_bound(name, second[name])), name


def hoeffding_bound(n: int, failure: float = 1e-9) -> float:
    """|fraction - p| of n independent Bernoulli(p) draws exceeds this with probability <= ``failure``:
    Hoeffding, P(|mean - p| >= t) <= 2 exp(-2 n t^2)."""
    return math.sqrt(math.log(2 / failure) / (2 * n))


@pytest.mark.parametrize("p_drop", [0.1, 0.5])
def test_dropout_on_the_embedding_sums_has_the_papers_statistics(p_drop):
    """Section 5.4: dropout on the sums of the embeddings and the positional encodings. In training mode each
    unit is zeroed with probability P_drop and the survivors are scaled by 1 / (1 - P_drop); in inference the
    sums pass unchanged. Each sublayer's output (encoder and decoder layers) is dropped in training too."""
    model = Transformer(VARIANTS["tiny"].replace(dropout=p_drop))
    x = tf.constant(np.random.default_rng(0).standard_normal((8, model.config.max_len, model.config.d_model)))
    clean = model.src_pos(x, training=False).numpy()
    assert np.all(clean != 0)
    out = model.src_pos(x, training=True).numpy()
    dropped = out == 0
    np.testing.assert_array_equal(model.src_pos(x).numpy(), clean)                # default: inference
    assert abs(dropped.mean() - p_drop) <= hoeffding_bound(out.size), dropped.mean()
    tolerance.assert_agrees(out[~dropped], clean[~dropped] / (1 - p_drop), what="survivors")
    assert np.any(model.src_pos(x, training=True).numpy() != out)                # a new mask each call
    memory = tf.constant(np.random.default_rng(1).standard_normal((2, 5, model.config.d_model)))
    for layer, args in ((model.encoder.layers[0], (memory,)), (model.decoder.layers[0], (memory[:, :4], memory))):
        train, infer = layer(*args, training=True).numpy(), layer(*args, training=False).numpy()
        assert tolerance.max_abs(train, infer) > tolerance.float64_bound(infer), layer.name


def test_a_training_step_uses_dropout_and_leaves_inference_untouched(agreement):
    """The loss of a step with P_drop = 0.5 is not the inference loss; afterwards the model's default call
    is inference again and equals the reference's forward pass at the updated weights."""
    model = training_model(dropout=0.5)
    inputs = cases.training_inputs(model.config)
    inference = backend.loss(model, **inputs)
    step_loss = training.train_step(model, training.optimizer(model, TRAINING), **inputs)
    assert abs(step_loss - inference) > tolerance.float64_bound(inference)
    src, tgt = inputs["src"], inputs["tgt"]
    ref64, ref32 = (reference.build(model.config, checkpoint.to_params(model), dtype)(src, tgt) for dtype in DTYPES)
    agreement(model(src, tgt).numpy(), ref64, ref32, port="tf", device="cpu", dtype="float64",
              what="inference after a training step")


def test_a_saved_run_resumes_with_the_same_next_step(tmp_path):
    """training_state -> save_checkpoint(training=) -> load_training_state -> optimizer(state=): the next step
    (t = 3, lrate(3)) is the step the run in memory takes, to the bit."""
    path = tmp_path / "run.safetensors"
    batches = [cases.training_inputs(VARIANTS["tiny"], seed=seed) for seed in range(3)]
    model = training_model()
    optimizer = training.optimizer(model, TRAINING)
    for inputs in batches[:2]:
        training.train_step(model, optimizer, **inputs)
    checkpoint.save_checkpoint(model, path, training=training.training_state(model, optimizer))
    resumed = checkpoint.load_checkpoint(path)
    resumed_optimizer = training.optimizer(resumed, state=reference_checkpoint.load_training_state(path))
    tolerance.assert_agrees(float(resumed_optimizer.adam.learning_rate), paper_lrate(3, 16, TRAINING),
                            what="lrate(3)")
    runs = ((model, optimizer), (resumed, resumed_optimizer))
    losses = [training.train_step(m, o, **batches[2]) for m, o in runs]
    assert losses[0] == losses[1]
    (state, params), (resumed_state, resumed_params) = ((training.training_state(m, o), checkpoint.to_params(m))
                                                        for m, o in runs)
    assert resumed_state.step == state.step == 3 and resumed_state.config == TRAINING
    for name in params:
        np.testing.assert_array_equal(resumed_params[name], params[name])
        np.testing.assert_array_equal(resumed_state.first_moments[name], state.first_moments[name])
        np.testing.assert_array_equal(resumed_state.second_moments[name], state.second_moments[name])


def test_a_float64_run_resumes_in_float32():
    """A saved state is cast to the model's dtype: float32 moments for a float32 model."""
    model = training_model()
    state = training.training_state(model, training.optimizer(model, TRAINING))._replace(step=5)
    model = training_model(dtype="float32")
    optimizer = training.optimizer(model, state=state)
    resumed = training.training_state(model, optimizer)
    assert resumed.step == 5 and resumed.config == TRAINING
    tolerance.assert_agrees(float(optimizer.adam.learning_rate), paper_lrate(6, 16, TRAINING), what="lrate(6)")
    moments = (*resumed.first_moments.values(), *resumed.second_moments.values())
    assert {m.dtype for m in moments} == {np.dtype(np.float32)}


# ----------------------------------------------------------------------------- bfloat16 and float16

@pytest.mark.parametrize("dtype", [*LOW_DTYPES, np.float16, ml_dtypes.bfloat16, tf.bfloat16, tf.float16,
                                   keras.DTypePolicy("bfloat16")], ids=str)
def test_a_low_precision_is_named_as_in_every_backend(dtype):
    """A name, a NumPy or ml_dtypes dtype, a TensorFlow dtype or a Keras policy: variables stored in P."""
    model = Transformer(VARIANTS["tiny"], dtype=dtype)
    name = model.compute_dtype
    assert name in LOW_DTYPES and model.variable_dtype == name and {w.dtype for w in model.weights} == {name}


@pytest.mark.parametrize("call", ["from_params", "load_checkpoint", "data_parallel.train"])
def test_a_bad_dtype_gives_the_reference_error(tmp_path, call):
    config = VARIANTS["tiny"]
    params = cases.seeded_params(config)
    path = tmp_path / "model.safetensors"
    reference_checkpoint.save_checkpoint(path, config, params)
    runs = {"from_params": lambda: transformer_tf.from_params(config, params, "int8"),
            "load_checkpoint": lambda: transformer_tf.load_checkpoint(path, "float8_e4m3fn"),
            "data_parallel.train": lambda: data_parallel.train(config, params, None, None, None, 0, 1, 1, "int8")}
    with pytest.raises(ValueError, match=f"^{BAD_DTYPE}(int8|float8_e4m3fn)$"):
        runs[call]()


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_the_positional_table_is_rounded_once(dtype):
    """TensorFlow's own float64 -> bfloat16 cast rounds twice; the table is the reference's, bit for bit."""
    table = sinusoidal_positional_encoding(64, 16, dtype).numpy()
    assert table.dtype == dtype
    np.testing.assert_array_equal(table, reference_model_module.sinusoidal_positional_encoding(64, 16, dtype))


@pytest.mark.parametrize("stored", LOW_DTYPES)
def test_a_low_precision_file_loads_exactly(tmp_path, stored):
    """A BF16 or F16 file loads in its own format by default, each variable holding the file's numbers exactly,
    and into any other format as the reference loads it."""
    config = VARIANTS["shared_embeddings"]
    path = tmp_path / "model.safetensors"
    reference_checkpoint.save_checkpoint(path, config, {name: round_to(value, stored)
                                                        for name, value in cases.seeded_params(config).items()})
    for dtype in (None, "float32", "float64", *LOW_DTYPES):
        model = transformer_tf.load_checkpoint(path, dtype)
        assert model.compute_dtype == (dtype or stored)
        _, expected = reference_checkpoint.load_checkpoint(path, dtype)
        for name, value in checkpoint.to_params(model).items():
            assert value.dtype == expected[name].dtype, name
            np.testing.assert_array_equal(value.view(np.uint8), expected[name].view(np.uint8), err_msg=name)


@pytest.mark.parametrize("variant", ["tiny", "learned_pe"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_a_low_precision_model_saves_its_own_format_bit_for_bit(tmp_path, variant, dtype):
    """float64 weights rounded once to P (``round_to``, not TensorFlow's cast), saved as a BF16 or F16 file that
    the reference reads back bit for bit, and that loads into an equal model."""
    config = VARIANTS[variant]
    params = cases.seeded_params(config)
    path = tmp_path / "model.safetensors"
    model = transformer_tf.from_params(config, params, dtype)
    transformer_tf.save_checkpoint(model, path)
    _, saved = reference_checkpoint.load_checkpoint(path)
    assert list(saved) == list(params)
    for name, value in saved.items():
        assert value.dtype == dtype, name
        np.testing.assert_array_equal(value.view(np.uint16), round_to(params[name], dtype).view(np.uint16), name)
    inputs = cases.model_inputs(config, "ragged_batch")
    np.testing.assert_array_equal(transformer_tf.load_checkpoint(path)(**inputs).numpy(), model(**inputs).numpy())


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_a_low_precision_model_is_refused_training_before_any_work(dtype):
    """A P model has P gradients but is not trained itself: the reference's ``check_trainable`` error from every
    training entry point, before any work (the optimizer and the batches are never touched). A float64 model does not
    train in P: ``training_dtype``'s error."""
    config = VARIANTS["tiny"]
    model = port_model("tiny", dtype)
    inputs = cases.training_inputs(config)
    with pytest.raises(ValueError) as expected:
        reference_training.optimizer(reference_model("tiny", dtype))
    message = f"^{re.escape(str(expected.value))}$"
    assert f"dtype={dtype!r}" in str(expected.value)

    def untouched(*args, **kwargs):
        raise AssertionError("the refusal came after some work")

    with pytest.raises(ValueError, match=message):
        training.optimizer(model)
    with pytest.raises(ValueError, match=message):
        training.train_step(model, None, **inputs)
    with pytest.raises(ValueError, match=message):
        data_parallel.train_step(model, None, **inputs, strategy=None)
    with pytest.raises(ValueError, match=message):
        data_parallel.train(config, cases.seeded_params(config), None, None, untouched, 0, 1, 1, dtype)
    with pytest.raises(ValueError) as expected:
        training_dtype("float64", dtype)
    with pytest.raises(ValueError, match=f"^{re.escape(str(expected.value))}$"):
        training.optimizer(port_model("tiny", "float64"), dtype=dtype)


def assert_masters_and_their_rounding(model: Transformer, mixed: training.Optimizer) -> None:
    """The model's weights (the masters) and Adam's moments are float32; the P model holds the masters rounded to
    P, bit for bit."""
    dtype = mixed.low.compute_dtype
    low, state = checkpoint.to_params(mixed.low), training.training_state(model, mixed)
    for name, master in checkpoint.to_params(model).items():
        assert master.dtype == np.float32 and state.first_moments[name].dtype == np.float32, name
        assert low[name].dtype == dtype, name
        np.testing.assert_array_equal(low[name].view(np.uint16), round_to(master, dtype).view(np.uint16), name)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_mixed_precision_steps_float32_masters_and_rounds_them_to_p(dtype, monkeypatch):
    """``optimizer(float32 model, dtype=P)``: each step's loss and gradients are the P model's, Adam updates the
    float32 masters and the P model is the masters rounded again. float16: Keras' ``LossScaleOptimizer`` at
    ``LOSS_SCALE``, doubled after ``LOSS_SCALE_GROWTH_INTERVAL`` finite steps (here 2, set after the import: read
    when the optimizer is made), and a step whose gradient overflows is skipped (the same run continued:
    :func:`assert_an_overflowing_step_is_skipped`); bfloat16 has no scale."""
    monkeypatch.setattr(precision, "LOSS_SCALE_GROWTH_INTERVAL", 2)
    model = training_model(dtype="float32")
    mixed = training.optimizer(model, TRAINING, dtype=dtype)
    assert mixed.low is not None
    assert_masters_and_their_rounding(model, mixed)
    before = checkpoint.to_params(model)
    scales = []
    for seed in (0, 1):
        inputs = cases.training_inputs(model.config, seed=seed)
        low_loss = backend.loss(mixed.low, **inputs)                       # dropout 0: the step's own loss
        assert training.train_step(model, mixed, **inputs) == low_loss
        scales.append(backend.loss_scale(mixed))
    assert int(mixed.adam.iterations) == 2
    assert scales == ([precision.LOSS_SCALE, 2 * precision.LOSS_SCALE] if dtype == "float16" else [None, None])
    assert all(np.any(value != before[name]) for name, value in checkpoint.to_params(model).items())
    assert_masters_and_their_rounding(model, mixed)
    if dtype == "float16":
        assert_an_overflowing_step_is_skipped(model, mixed, cases.training_inputs(model.config))


def assert_an_overflowing_step_is_skipped(model: Transformer, mixed: training.Optimizer, inputs: dict) -> None:
    """A loss scale of float32's largest number overflows float16's gradients: the step changes no master weight,
    no P weight, no moment, leaves Adam's t (the inner optimizer's ``iterations``, hence the schedule) where it was,
    and halves the scale; it returns the unscaled loss. The next step is taken again."""
    largest = float(np.finfo(np.float32).max)
    mixed.loss_scale.dynamic_scale.assign(largest)
    (weights, low, state), rate = ((checkpoint.to_params(model), checkpoint.to_params(mixed.low),
                                    training.training_state(model, mixed)), float(mixed.adam.learning_rate))
    value = training.train_step(model, mixed, **inputs)
    assert value == backend.loss(mixed.low, **inputs)
    assert backend.loss_scale(mixed) == largest / 2
    after = training.training_state(model, mixed)
    assert after.step == state.step and float(mixed.adam.learning_rate) == rate
    for name, value in checkpoint.to_params(model).items():
        np.testing.assert_array_equal(value, weights[name], name)
        np.testing.assert_array_equal(checkpoint.to_params(mixed.low)[name], low[name], name)
        np.testing.assert_array_equal(after.first_moments[name], state.first_moments[name], name)
        np.testing.assert_array_equal(after.second_moments[name], state.second_moments[name], name)
    mixed.loss_scale.dynamic_scale.assign(precision.LOSS_SCALE)
    training.train_step(model, mixed, **inputs)
    assert training.training_state(model, mixed).step == state.step + 1

