"""A cached decoding step reads the written part of its self-attention cache, not the whole capacity.

A cache holds C positions (the budget: an imported opus-mt model's is 511 tokens); a step at position t reads
the narrowest width W of ``incremental.attended_widths(C)`` holding positions 0 .. t (64, 128, 256, ... then C),
so that a step's work grows with its hypothesis, not with C. Checked without looking at the attention's code:

* the widths against their definition, by brute force over every capacity up to 600;
* positions past W are never read: filled with NaN, which any product over them would spread (0 x NaN is NaN),
  they leave a decoding step, greedy decoding and beam search exactly as a cache of zeros does -- in every
  backend, with the step's position known (eager) and, in the ports' searches, traced (JAX's ``lax.switch``,
  TensorFlow's ``tf.switch_case``);
* with the first width made 2, whole searches cross one width after another and still give the reference's
  tokens and scores (the reference's decoders use no cache).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from support import FRAMEWORKS, float64_inference, framework_array, port_backend

from equivalence.tolerance import assert_agrees
from reference_numpy import TransformerConfig, incremental, init_params
from reference_numpy import model as reference
from reference_numpy.decoding import beam_search, greedy_decode

CAPACITY = 200                  # wider than the first width (64): three widths, 64, 128 and 200
# tiny, with room for the wide cache; a budget that stays inside the first width
CONFIG = TransformerConfig.preset("tiny", max_len=CAPACITY).with_decoding(max_output_length=30)
FIRST = 64


def test_the_widths_are_64_doubled_below_the_capacity_then_the_capacity():
    for capacity in range(1, 601):
        expected = sorted({64 * 2 ** i for i in range(10) if 64 * 2 ** i < capacity} | {capacity})
        assert list(incremental.attended_widths(capacity)) == expected
        for written in range(1, capacity + 1):
            assert incremental.attended_width(capacity, written) == min(w for w in expected if w >= written)


def tail_filled(name: str, cache: tuple, start: int) -> tuple:
    """The caches with every self-attention key and value from position ``start`` on made NaN (the memory's
    keys and values as they are), in the backend's own arrays (traced ones included)."""
    def filled(x):
        if name == "torch":
            x = x.clone()
            x[:, :, start:] = float("nan")
            return x
        if name == "jax":
            return x.at[:, :, start:].set(np.nan)
        if name == "tf":
            tf = importlib.import_module("tensorflow")
            return tf.concat([x[:, :, :start], tf.fill(tf.shape(x[:, :, start:]), tf.constant(np.nan, x.dtype))], 2)
        x = x.copy()
        x[:, :, start:] = np.nan
        return x
    return tuple((own._replace(keys=filled(own.keys), values=filled(own.values)), memory) for own, memory in cache)


def model_of(name: str, params: dict):
    if name == "numpy":
        return reference.Transformer(CONFIG, params)
    return port_backend(name).build(CONFIG, params, "float64")


@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
@pytest.mark.parametrize("position", [3, 64, 100])
def test_a_decoding_step_reads_no_position_past_its_width(name, position):
    """One step at ``position`` (width 64, then 128: the written positions 0 .. 64 no longer fit in 64) over a
    cache of 200 positions whose first ``position`` hold seeded keys and values, NaN from the width on: finite,
    and the reference's step over a cache of exactly the written positions (one width: the whole cache)."""
    params = init_params(CONFIG, seed=0, perturb=0.1)
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(3, CONFIG.src_vocab_size, (2, 5)), rng.integers(3, CONFIG.tgt_vocab_size, (2, 1))
    width = incremental.attended_width(CAPACITY, position + 1)
    assert width == (FIRST if position < FIRST else 2 * FIRST)
    seeded = np.random.default_rng(1).standard_normal((2, CONFIG.n_heads, CAPACITY, CONFIG.d_k, 2))   # K and V
    seeded[:, :, position:] = 0.0                           # not written yet: zeros, as init_cache makes them

    def step(name: str, capacity: int, tail: bool) -> np.ndarray:
        model, convert = model_of(name, params), (lambda x: framework_array(name, x))
        with float64_inference(name):
            memory = model.encode(convert(src))
            cache = tuple((own._replace(keys=convert(seeded[:, :, :capacity, :, 0]),
                                        values=convert(seeded[:, :, :capacity, :, 1])), memory_cache)
                          for own, memory_cache in model.init_cache(memory, capacity))
            if tail:
                cache = tail_filled(name, cache, width)
            out, _ = model.decode(convert(tgt), memory, cache=incremental.at_position(cache, position))
            return np.asarray(out)

    assert incremental.attended_width(position + 1, position + 1) == position + 1     # reads its whole cache
    expected = step("numpy", position + 1, tail=False)
    out = step(name, CAPACITY, tail=True)
    assert np.isfinite(out).all(), f"{name}: a position past the width {width} was read"
    assert_agrees(out, expected, what=f"{name}: a step at position {position}, NaN past the width")


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_a_port_s_searches_read_no_position_past_the_width(name, monkeypatch):
    """Greedy decoding and beam search (each a compiled loop in JAX and TensorFlow, the step's position traced)
    on caches of 200 positions whose positions from 64 on are NaN, while the budget (30 tokens) stays inside the
    first width: the reference's tokens."""
    params = init_params(CONFIG, seed=0, perturb=0.1)
    src = np.random.default_rng(2).integers(3, CONFIG.src_vocab_size, (2, 6))
    model = model_of(name, params)
    init_cache = type(model).init_cache
    monkeypatch.setattr(type(model), "init_cache",
                        lambda self, memory, capacity: tail_filled(name, init_cache(self, memory, CAPACITY), FIRST))
    decoding = importlib.import_module(f"transformer_{name}.decoding")
    if name == "jax":                                      # traced anew, through the patch
        decoding._greedy.clear_cache()
        decoding._beam.clear_cache()
    expected_model = reference.Transformer(CONFIG, params)
    with float64_inference(name):
        greedy, (beams, _) = decoding.greedy_decode(model, src), decoding.beam_search(model, src, 3)
    np.testing.assert_array_equal(greedy, greedy_decode(expected_model, src))
    np.testing.assert_array_equal(beams, beam_search(expected_model, src, 3)[0])


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_searches_that_cross_every_width_decode_as_the_reference(name, monkeypatch):
    """The first width made 2 (widths 2, 4, 8, 16, 32, then the capacity): every port's greedy decoding and beam
    search of a ragged batch cross one width after another (JAX's and TensorFlow's compiled loops switch branch
    at each), in float64, and give the reference's tokens and beam scores (the reference decodes without a
    cache)."""
    monkeypatch.setattr(incremental, "ATTENDED_WIDTH", 2)
    config = TransformerConfig.preset("tiny").with_decoding(max_output_length=40)
    params = init_params(config, seed=4, perturb=0.1)
    src = np.random.default_rng(3).integers(3, config.src_vocab_size, (3, 7))
    src[1, 4:], src[2, 2:] = config.pad_id, config.pad_id
    decoding = importlib.import_module(f"transformer_{name}.decoding")
    if name == "jax":                                      # traced anew with these widths
        decoding._greedy.clear_cache()
        decoding._beam.clear_cache()
    model = port_backend(name).build(config, params, "float64")
    expected_model = reference.Transformer(config, params)
    expected_tokens, expected_scores = beam_search(expected_model, src, 3)
    with float64_inference(name):
        greedy, (tokens, scores) = decoding.greedy_decode(model, src), decoding.beam_search(model, src, 3)
    if name == "jax":                                      # no program of these widths left for other tests
        decoding._greedy.clear_cache()
        decoding._beam.clear_cache()
    assert greedy.shape[1] > 32 or tokens.shape[1] > 32, "the searches crossed too few widths to test them"
    np.testing.assert_array_equal(greedy, greedy_decode(expected_model, src))
    np.testing.assert_array_equal(tokens, expected_tokens)
    assert_agrees(scores, expected_scores, what=f"{name}: beam scores across the widths")


@pytest.mark.slow            # Inductor compiles the step twice (max_autotune): the first width, then W a symbol
def test_the_compiled_pytorch_step_reads_the_written_width_and_crosses_widths(agreement, monkeypatch):
    """``transformer_torch.compile_decoding`` with the first width made 2: steps 0 .. 9 fed ``tgt`` over caches of
    40 positions (widths 2, 4, 8, 16, 32, 40), each step's cache NaN from its width on (zeros from the step's
    position to the width, as ``init_cache`` leaves them), give log-probabilities finite
    and within the float32 policy of the reference's forward pass (float64 and float32) -- the program is handed the
    first W positions only -- and Dynamo compiles two programs in all: the first width's, then one with W a symbol
    that serves every later width."""
    torch = pytest.importorskip("torch", reason="the compiled step is the PyTorch port's")
    from transformer_torch import compile_decoding, speed
    from transformer_torch.decoding import next_token_log_probs
    from transformer_torch.model import padding_mask

    monkeypatch.setattr(incremental, "ATTENDED_WIDTH", 2)
    config = CONFIG.replace(max_len=40)
    params = init_params(config, seed=5, perturb=0.1)
    rng = np.random.default_rng(4)
    src, tgt = rng.integers(3, config.src_vocab_size, (2, 6)), rng.integers(3, config.tgt_vocab_size, (2, 10))
    src[1, 3:] = config.pad_id
    model = compile_decoding(port_backend("torch").build(config, params, "float32").eval())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step, log_probs = speed.decoding_step(model, next_token_log_probs), []

    def unwritten(cache: tuple, written: int, width: int) -> tuple:
        """The caches with positions written .. width - 1 zero (not yet written, as ``init_cache`` leaves them) and
        NaN from the width on."""
        def filled(x):
            x = x.clone()
            x[:, :, written:width], x[:, :, width:] = 0.0, float("nan")
            return x
        return tuple((own._replace(keys=filled(own.keys), values=filled(own.values)), memory) for own, memory in cache)

    with torch.inference_mode():
        memory = model.encode(torch.from_numpy(src))
        mask, cache = padding_mask(torch.from_numpy(src), config.pad_id), model.init_cache(memory, 40)
        for index in range(tgt.shape[1]):
            cache = unwritten(cache, index, incremental.attended_width(40, index + 1))
            out, cache = step(torch.from_numpy(tgt[:, index:index + 1]), memory, mask, cache, index)
            log_probs.append(out.numpy())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    emitted = np.setdiff1d(np.arange(config.tgt_vocab_size), config.never_emitted)
    out = np.stack(log_probs, axis=1)[:, :, emitted]                                       # (B, T, V - never)
    assert np.isfinite(out).all(), "the compiled step read a position past its width"
    agreement(out, *(reference.Transformer(config, params, dtype)(src, tgt)[:, :, emitted]
                     for dtype in (np.float64, np.float32)),
              port="torch compile_decoding", device="cpu", dtype="float32",
              what="log-probs of the compiled step across widths, NaN past each width")
