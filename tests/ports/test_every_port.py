"""What every port must do, one test for all three (parametrized over the ports' adapters, ``equivalence.backends``):
decoding with the key/value cache as without it (float64 against the reference, step by step, several positions at
a time; bfloat16 and float16 token for token) and without it as the reference, a bfloat16 or float16 model keeping
every stage, cache and gradient in its format, and training refusing such a model, or a bad saved run, with the
reference's words.

A test calls the port through its adapter, and through its own modules where it looks inside (the caches, one
decoding step): the ports are parallel texts (tests/project/test_parallel_texts.py), so each has the same names.
:class:`Port` holds the few calls whose spelling is the framework's. What only one framework has -- SDPA and oneDNN,
``nn.Transformer`` interop, a cache written in place (PyTorch); x64, XLA flags, compiled loops (JAX); Keras
serialization and masks, XLA's argmax (TensorFlow) -- and each framework's optimizer, schedule, loss scaler and
dropout streams are checked in tests/ports/test_torch.py, test_jax.py and test_tf.py."""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from support import LOW_DTYPES, port_backend, port_model

from equivalence import cases, tolerance
from equivalence.backends import numpy as reference
from equivalence.cases import VARIANTS
from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy.decoding import next_token_log_probs as reference_next_token_log_probs
from reference_numpy.incremental import at_position
from reference_numpy.model import padding_mask as reference_padding_mask
from reference_numpy.precision import check_trainable, training_dtype
from reference_numpy.training import PAPER

PORTS = ("torch", "jax", "tf")


@dataclass(frozen=True)
class Port:
    """A port as the shared tests see it: its adapter, its own model and decoding modules (the same names in every
    port), and the calls its framework spells its own way."""

    name: str
    backend: ModuleType                          # equivalence.backends.<name>
    model: ModuleType                            # transformer_<name>.model
    decoding: ModuleType                         # transformer_<name>.decoding
    tensor: Callable[[np.ndarray], Any]          # a NumPy array as the framework's
    array: Callable[[Any], np.ndarray]           # the framework's array as NumPy (ml_dtypes for bfloat16)
    dtype: Callable[[Any], str]                  # the name of a framework array's or a model's dtype
    running: Callable[[], contextlib.AbstractContextManager]   # where the port's own calls run: no autograd, x64
    loss: Callable[..., Any]                     # the port's loss of a batch, dropout off, as the framework's scalar


@functools.cache
def port_of(name: str) -> Port:
    backend = port_backend(name)
    model, decoding, training = (importlib.import_module(f"transformer_{name}.{module}")
                                 for module in ("model", "decoding", "training"))
    if name == "torch":
        import torch

        from transformer_torch.precision import to_numpy
        return Port(name, backend, model, decoding, torch.as_tensor, lambda value: to_numpy(value.detach()),
                    lambda value: str(value.dtype).removeprefix("torch."), torch.no_grad,
                    lambda model, batch: training.loss(model, *(torch.as_tensor(value) for value in batch.values())))
    if name == "jax":
        import jax
        import jax.numpy as jnp
        return Port(name, backend, model, decoding, jnp.asarray, np.asarray, lambda value: np.dtype(value.dtype).name,
                    lambda: jax.enable_x64(True),
                    lambda model, batch: training.loss(model, **batch, deterministic=True))
    import tensorflow as tf
    return Port(name, backend, model, decoding, tf.constant, lambda value: value.numpy(),
                lambda value: getattr(value, "compute_dtype", None) or value.dtype.name, contextlib.nullcontext,
                lambda model, batch: training.loss(model, **batch))


@pytest.fixture(params=PORTS)
def port(request) -> Iterator[Port]:
    """Each port in turn; PyTorch on one intra-op thread (the tiny models gain nothing from more, which only spin on
    a shared CPU)."""
    port = port_of(request.param)
    if port.name != "torch":
        yield port
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield port
    torch.set_num_threads(threads)


@functools.cache
def reference_model(variant: str, dtype: str = "float64", params: str = "seeded"):
    return reference.build(VARIANTS[variant], cases.PARAMS[params](VARIANTS[variant]), dtype)


def reference_error(check, *arguments) -> str:
    """The ValueError message the reference's own ``check`` gives for ``arguments``."""
    with pytest.raises(ValueError) as raised:
        check(*arguments)
    return str(raised.value)


# ----------------------------------------------------------------------------- decoding with and without the cache

def test_uncached_decoding_gives_the_reference_tokens_in_float64(port, agreement):
    """Decoding without the cache (every step re-runs the decoder on the whole prefix), on rows that end at different
    steps: the reference's greedy and beam tokens (int64), its beam scores within the float64 policy. The cached
    search, every variant, every port: tests/equivalence/test_agreement.py::test_decoded_tokens_float64."""
    config, src = VARIANTS["tiny"], cases.decoding_inputs(VARIANTS["tiny"])
    model, ref = port_model(port.name, "tiny", "float64", "cpu", "decoding"), reference_model("tiny", params="decoding")
    greedy, (ref_tokens, ref_scores) = reference.greedy(ref, src), reference.beam(ref, src)
    assert len({row.tolist().count(config.pad_id) for row in greedy}) > 1            # rows end at different steps
    tokens = port.backend.greedy(model, src, use_cache=False)
    assert tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens, greedy)
    tokens, scores = port.backend.beam(model, src, use_cache=False)
    assert tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens, ref_tokens)
    agreement(scores, ref_scores, None, port=port.name, device="cpu", dtype="float64", what="beam scores")


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_cached_and_uncached_decoding_give_the_same_tokens_in_low_precision(port, dtype):
    """Greedy decoding and beam search on the tiny decoding case with the key/value cache (in P) and without it: the
    same tokens; the beam scores, summed in float32, are float32 numbers."""
    model, src = port_model(port.name, "tiny", dtype, "cpu", "decoding"), cases.decoding_inputs(VARIANTS["tiny"])
    tokens = port.backend.greedy(model, src)
    assert tokens.shape[1] > 1
    np.testing.assert_array_equal(port.backend.greedy(model, src, use_cache=False), tokens)
    (cached, cached_scores), (uncached, uncached_scores) = (port.backend.beam(model, src, use_cache=use_cache)
                                                            for use_cache in (True, False))
    np.testing.assert_array_equal(cached, uncached)
    for scores in (cached_scores, uncached_scores):
        assert np.array_equal(scores.astype(np.float32), scores)


def step_log_probs(port: Port, model, src: np.ndarray, tgt: np.ndarray, use_cache: bool, first: int = 1
                   ) -> np.ndarray:
    """Next-token log-probabilities after every prefix of ``tgt`` (from the ``first`` tokens on), one decoding step
    at a time, by the port's own ``decoding.next_token_log_probs``; with the cache the ``first`` tokens go in at
    once, then one per step. (B, T - first + 1, V)."""
    with port.running():
        src_mask = port.model.padding_mask(port.tensor(src), model.config.pad_id)
        memory = model.encode(port.tensor(src), src_mask)
        cache = model.init_cache(memory, tgt.shape[1])
        steps = []
        for end in range(first, tgt.shape[1] + 1):
            if use_cache:
                start = 0 if end == first else end - 1
                log_probs, cache = port.decoding.next_token_log_probs(model, port.tensor(tgt[:, start:end]), memory,
                                                                      src_mask, cache, start)
            else:
                log_probs = port.decoding.next_token_log_probs(model, port.tensor(tgt[:, :end]), memory, src_mask)
            steps.append(port.array(log_probs))
    return np.stack(steps, axis=1)


def random_targets(config, rows: int, seed: int) -> np.ndarray:
    """(rows, 6) target tokens from bos, no special token after it."""
    tgt = np.random.default_rng(seed).integers(3, config.tgt_vocab_size, size=(rows, 6))
    tgt[:, 0] = config.bos_id
    return tgt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_and_uncached_steps_give_the_same_log_probs(port, variant):
    """Random targets, one new position per step: with the cache and without it, the reference's next-token
    log-probabilities within the float64 policy (pad and bos -inf in both), and each other's."""
    config = VARIANTS[variant]
    src = cases.decoding_inputs(config)
    tgt = random_targets(config, len(src), 1)
    model = port_model(port.name, variant, "float64", "cpu", "decoding")
    cached, uncached = step_log_probs(port, model, src, tgt, True), step_log_probs(port, model, src, tgt, False)
    assert cached.dtype == np.float64
    special = [config.pad_id, config.bos_id]
    assert np.all(cached[..., special] == -np.inf) and np.all(uncached[..., special] == -np.inf)
    ordinary = np.setdiff1d(np.arange(config.tgt_vocab_size), special)
    refs = {}
    for dtype in ("float64", "float32"):
        ref = reference_model(variant, dtype, "decoding")
        src_mask = reference_padding_mask(src, config.pad_id)
        memory = ref.encode(src, src_mask)
        refs[dtype] = np.stack([reference_next_token_log_probs(ref, tgt[:, :t + 1], memory, src_mask)
                                for t in range(tgt.shape[1])], axis=1)[..., ordinary]
    for steps in (cached, uncached):
        tolerance.assert_agrees(steps[..., ordinary], refs["float64"], refs["float32"], what=f"{variant}/float64")
    tolerance.assert_agrees(cached[..., ordinary], uncached[..., ordinary], what="cached vs uncached")


def test_several_new_positions_at_once_give_the_uncached_log_probs(port):
    """The cache filled with 3 positions in one call, then one per call: the same log-probabilities as recomputing
    every prefix (float64, the policy's bound)."""
    config = VARIANTS["pre_ln"]
    src = cases.decoding_inputs(config)
    tgt = random_targets(config, len(src), 2)
    model = port_model(port.name, "pre_ln", "float64", "cpu", "decoding")
    ordinary = np.setdiff1d(np.arange(config.tgt_vocab_size), [config.pad_id, config.bos_id])
    cached, uncached = (step_log_probs(port, model, src, tgt, use_cache, first=3)[..., ordinary]
                        for use_cache in (True, False))
    tolerance.assert_agrees(cached, uncached, what="3 positions, then 1 per step")


def finite(log_probs: np.ndarray, config) -> np.ndarray:
    return np.delete(log_probs, [config.pad_id, config.bos_id], axis=-1)   # pad/bos are -inf by rule


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_steps_along_the_reference_s_greedy_output_give_its_log_probs(port, variant):
    """Teacher-forced along the reference's greedy output, one new position per step and then two at once: with the
    cache, the uncached step's and the reference's log-probabilities; the cache's last position, never written,
    stays empty. Rows already ended (pad-filled) are left out: with a cache their pad keys are not masked, and
    greedy decoding ignores those rows."""
    config = VARIANTS[variant]
    model, ref = port_model(port.name, variant, "float64", "cpu", "decoding"), reference_model(variant,
                                                                                             params="decoding")
    src = cases.decoding_inputs(config)
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), reference.greedy(ref, src)], axis=1)
    src_mask = reference_padding_mask(src, config.pad_id)
    ref_memory = ref.encode(src, src_mask)
    with port.running():
        memory, mask = model.encode(port.tensor(src)), port.tensor(src_mask)
        cache = model.init_cache(memory, tgt.shape[1] + 1)
        ends = [*range(1, tgt.shape[1] - 1), tgt.shape[1]]                 # the last step feeds 2 positions
        for start, end in zip([0, *ends], ends):
            cached, cache = port.decoding.next_token_log_probs(model, port.tensor(tgt[:, start:end]), memory, mask,
                                                               cache, start)
            uncached = port.decoding.next_token_log_probs(model, port.tensor(tgt[:, :end]), memory, mask)
            cached, uncached = port.array(cached), port.array(uncached)
            expected = reference_next_token_log_probs(ref, tgt[:, :end], ref_memory, src_mask)
            live = (tgt[:, :end] != config.pad_id).all(axis=1)
            assert live.any()
            tolerance.assert_agrees(finite(cached[live], config), finite(uncached[live], config),
                                    what=f"cached vs uncached, positions {start}..{end - 1}")
            tolerance.assert_agrees(finite(cached[live], config), finite(expected[live], config),
                                    what=f"cached vs reference, positions {start}..{end - 1}")
        unfilled = port.array(cache[0][0].keys)[:, :, tgt.shape[1]:]
    assert unfilled.shape[2] == 1 and not unfilled.any()


# ----------------------------------------------------------------------------- bfloat16 and float16

@pytest.mark.parametrize("variant", ["tiny", "pre_ln"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_a_low_precision_model_keeps_every_stage_in_its_dtype(port, dtype, variant):
    """The recipe of reference_numpy/precision.py: the weights, every stage, the attention weights of every kind and
    layer, every component's output, the memory and both caches of every layer, empty and written, in P (NumPy:
    ml_dtypes.bfloat16, np.float16); the log-probabilities (of the forward pass and of the generator) and the loss in
    float32."""
    config, low = VARIANTS[variant], np.dtype(dtype)
    model = port_model(port.name, variant, dtype, "cpu")
    assert port.dtype(model) == dtype
    assert {value.dtype for value in port.backend.export_params(model).values()} == {low}
    inputs = cases.model_inputs(config, "ragged_batch")
    stages = port.backend.forward(model, **inputs)
    assert {name: value.dtype for name, value in stages.items()} == \
        {name: np.dtype(np.float32) if name == "log_probs" else low for name in stages}
    assert port.backend.log_probs(model, **inputs).dtype == np.float32
    for layer in (0, 1):
        for kind in ("encoder", "decoder_self", "decoder_cross"):
            weights = port.backend.attention_weights(model, inputs["src"], inputs["tgt"], layer, kind)
            assert weights.dtype == low, (layer, kind)
    components = [(name, "causal" if masked else "none") for name, masked in cases.COMPONENT_MASKED.items()]
    for name, case in [*components, ("attention", "causal"), ("layer_norm", "causal"), ("decoder", "causal")]:
        expected = np.dtype(np.float32) if name == "generator" else low
        assert port.backend.component(model, name, cases.component_inputs(config, name, case)).dtype == expected, name
    with port.running():
        memory = model.encode(port.tensor(inputs["src"]))
        assert port.dtype(memory) == dtype
        caches = model.init_cache(memory, 4)
        _, written = model.decode(port.tensor(inputs["tgt"][:, :2]), memory, cache=at_position(caches, 0))
        for cached in (caches, written):
            assert {port.dtype(array) for layer in cached for cache in layer for array in (cache.keys, cache.values)} \
                == {dtype}
        assert port.dtype(port.loss(model, cases.training_inputs(config))) == "float32"


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_a_low_precision_model_has_gradients_in_its_precision(port, dtype, variant):
    """Autodiff through the recipe: a finite float32 loss and, for every checkpoint tensor in checkpoint order, a
    finite gradient in P shaped like the tensor; with shared embeddings, their gradient summing every use and the
    loss the model's ``loss``, bit for bit."""
    config = VARIANTS[variant]
    model, inputs = port_model(port.name, variant, dtype, "cpu"), cases.training_inputs(config)
    value, grads = port.backend.gradients(model, **inputs)
    assert isinstance(value, float) and math.isfinite(value)
    shapes = reference_checkpoint.parameter_shapes(config)
    assert list(grads) == list(shapes)
    for name, grad in grads.items():
        assert grad.dtype == np.dtype(dtype) and grad.shape == shapes[name], name
        assert np.isfinite(grad.astype(np.float32)).all(), name
    if config.share_embeddings:
        assert np.abs(grads["shared_embed.weight"].astype(np.float32)).max() > 0
        assert value == port.backend.loss(model, **inputs)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_training_refuses_a_low_precision_model_before_any_work(port, dtype):
    """Training updates float32 or float64 weights: the optimizer (with or without ``dtype``), a step and
    data-parallel training refuse a P model with the reference's ``check_trainable`` message, before any batch is
    asked for; a float64 model asking for P steps gets ``training_dtype``'s (mixed precision keeps float32
    masters)."""
    config = VARIANTS["tiny"]
    model, inputs = port_model(port.name, "tiny", dtype, "cpu"), cases.training_inputs(config)
    message = f"^{re.escape(reference_error(check_trainable, dtype))}$"

    def no_batch(step):
        raise AssertionError("a batch was asked for")

    adam = port.backend.optimizer(port_model(port.name, "tiny", "float32", "cpu"))
    for call in (lambda: port.backend.optimizer(model), lambda: port.backend.optimizer(model, dtype=dtype),
                 lambda: port.backend.train_step(model, adam, **inputs),
                 lambda: port.backend.train_data_parallel(config, cases.seeded_params(config), PAPER, None, no_batch,
                                                          1, 1, 1, dtype)):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=f"^{re.escape(reference_error(training_dtype, 'float64', dtype))}$"):
        port.backend.optimizer(port_model(port.name, "tiny", "float64", "cpu"), dtype=dtype)


# ----------------------------------------------------------------------------- a saved run's training state

# A tensor of the saved run and what is wrong with it: a moment missing, or of the wrong shape.
BAD_STATES = {
    "m-missing": ("encoder.layers.0.ffn.linear1.weight", "first_moments", None),
    "v-transposed": ("encoder.layers.0.ffn.linear1.weight", "second_moments", np.transpose),
    "decoder-m-missing": ("decoder.layers.1.ffn.linear1.weight", "first_moments", None),
    "decoder-v-misshaped": ("decoder.layers.1.ffn.linear1.weight", "second_moments", lambda value: np.zeros(3)),
    "linear2-m-missing": ("decoder.layers.1.ffn.linear2.weight", "first_moments", None),
    "linear2-v-transposed": ("decoder.layers.1.ffn.linear2.weight", "second_moments", np.transpose),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_a_bad_training_state_gives_the_references_error(port, case):
    """A saved run whose Adam moment is missing or misshaped: the port's optimizer refuses it with the reference's
    one-line message, naming the tensor as the file names it."""
    name, moments, change = BAD_STATES[case]
    model, ref = port_model(port.name, "tiny", "float64", "cpu"), reference_model("tiny")
    state = port.backend.training_state(model, port.backend.optimizer(model))
    table = dict(getattr(state, moments))
    if change is None:
        del table[name]
    else:
        table[name] = change(table[name])
    bad = state._replace(**{moments: table})
    message = reference_error(lambda: reference.optimizer(ref, state=bad))
    assert "\n" not in message and f"adam.{'m' if moments == 'first_moments' else 'v'}.{name}" in message
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        port.backend.optimizer(model, state=bad)
