"""The agreement matrix: every port x device x dtype x component x mask case x config variant
against the NumPy reference, under the one tolerance policy of ``equivalence.tolerance``.
The forward-pass checks also run the ``layer_norm_eps`` variant (``cases.FORWARD_VARIANTS``).
bfloat16 and float16 (the recipe of ``reference_numpy/precision.py``) run the forward stages, the components,
attention weights, the port pairs and decoding, on the seeded variants and on the shipped model.

A port whose framework is not installed, or a GPU that is not present, is a skip with its
reason, never a pass.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from conftest import reference_model_in, rounded_reference
from support import DEVICE_KINDS, FRAMEWORKS, LOW_DTYPES, device_for, port_backend, port_model, trained

from equivalence import cases, tolerance
from equivalence.backends import numpy as reference
from equivalence.cases import COMPONENT_MASKED, FORWARD_VARIANTS, MASK_CASES, VARIANTS
from equivalence.margins import decoding_oracle, teacher_forced_bound
from equivalence.recipes import ATTENTION_KINDS

DTYPES = ("float64", "float32")
COMPONENT_CASES = [(component, case) for component, masked in COMPONENT_MASKED.items()
                   for case in (MASK_CASES if masked else ("none",))]


@functools.cache
def reference_model(variant: str, dtype: str, params: str = "seeded"):
    return reference.build(FORWARD_VARIANTS[variant], cases.PARAMS[params](FORWARD_VARIANTS[variant]), dtype)


@functools.cache
def reference_component(variant: str, component: str, case: str, dtype: str) -> np.ndarray:
    inputs = cases.component_inputs(FORWARD_VARIANTS[variant], component, case)
    return reference.component(reference_model(variant, dtype), component, inputs)


@functools.cache
def reference_forward(variant: str, case: str, dtype: str) -> dict[str, np.ndarray]:
    return reference.forward(reference_model(variant, dtype), **cases.model_inputs(FORWARD_VARIANTS[variant], case))


@pytest.fixture(params=list(FRAMEWORKS))
def port(request):
    return request.param


@pytest.fixture(params=DEVICE_KINDS)
def device_kind(request):
    return request.param


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("component,case", COMPONENT_CASES)
def test_component(port, device_kind, dtype, variant, component, case, agreement):
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs = cases.component_inputs(FORWARD_VARIANTS[variant], component, case, dtype=np.dtype(dtype))
    out = backend.component(port_model(port, variant, dtype, device), component, inputs)
    agreement(out, reference_component(variant, component, case, "float64"),
              reference_component(variant, component, case, "float32"),
              port=port, device=device, dtype=dtype, what=f"{component}: {variant}/{case}")


@functools.cache
def reference_layer_norm_offset(variant: str, dtype: str) -> np.ndarray:
    inputs = cases.layer_norm_offset_inputs(FORWARD_VARIANTS[variant])
    return reference.component(reference_model(variant, dtype), "layer_norm", inputs)


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
def test_layer_norm_with_a_large_common_offset_float32(port, device_kind, variant, agreement):
    """float32 LayerNorm of x = 1e4 + N(0, 1) (``cases.layer_norm_offset_inputs``) within the float32
    policy: a one-pass variance E[x^2] - E[x]^2 cancels two numbers near 1e8 (ulp 8) and loses
    the variance (~1) entirely. float32 only: the float64 policy is relative to the output's
    scale (~3), and a correct float64 LayerNorm may round quantities of the input's scale,
    1e4 x 2^-53 ~ 1e-12, already at that bound (docs/equivalence.md, "Independent oracles")."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs = cases.layer_norm_offset_inputs(FORWARD_VARIANTS[variant], dtype=np.float32)
    out = backend.component(port_model(port, variant, "float32", device), "layer_norm", inputs)
    agreement(out, reference_layer_norm_offset(variant, "float64"), reference_layer_norm_offset(variant, "float32"),
              port=port, device=device, dtype="float32", what=f"layer_norm, offset 1e4: {variant}")


@functools.cache
def reference_attention(variant: str, kind: str, dtype: str) -> np.ndarray:
    inputs = cases.model_inputs(FORWARD_VARIANTS[variant], "ragged_batch")
    return reference.attention_weights(reference_model(variant, dtype), inputs["src"], inputs["tgt"], 1, kind)


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES + LOW_DTYPES)
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_attention_weights(port, device_kind, dtype, variant, kind, agreement):
    """The weights ``plot attention`` draws, layer 1, on a ragged batch (in bfloat16 and float16, rounded to it)."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs = cases.model_inputs(FORWARD_VARIANTS[variant], "ragged_batch")
    weights = backend.attention_weights(port_model(port, variant, dtype, device), inputs["src"], inputs["tgt"], 1, kind)
    agreement(weights, reference_attention(variant, kind, "float64"), reference_attention(variant, kind, dtype),
              port=port, device=device, dtype=dtype, what=f"attention weights: {variant}/{kind}")


@functools.cache
def port_forward(port: str, variant: str, case: str, dtype: str, device: str) -> dict[str, np.ndarray]:
    model = port_model(port, variant, dtype, device)
    return port_backend(port).forward(model, **cases.model_inputs(FORWARD_VARIANTS[variant], case))


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES + LOW_DTYPES)
@pytest.mark.parametrize("case", MASK_CASES)
def test_forward_stages(port, device_kind, dtype, variant, case, agreement, logits_rounding):
    """Every stage against the float64 reference with the original (float64) weights, under the policy of the
    model's precision; in bfloat16 and float16 every stage is stored in the format and the log-probabilities are
    float32."""
    device = device_for(port_backend(port), device_kind)
    stages = port_forward(port, variant, case, dtype, device)
    ref64, ref_same = reference_forward(variant, case, "float64"), reference_forward(variant, case, dtype)
    assert list(stages) == list(ref64), f"{port} stage names {list(stages)} differ from {list(ref64)}"
    inputs = cases.model_inputs(FORWARD_VARIANTS[variant], case)
    maps = tolerance.stage_maps(reference_model(variant, "float64"), **inputs)
    for stage in ref64:
        agreement(stages[stage], ref64[stage], ref_same[stage], port=port, device=device, dtype=dtype,
                  what=f"forward {stage.split('.')[0]}: {variant}/{case}/{stage}", scores=stage == "log_probs",
                  added=(maps.get(stage), stages, ref_same))
    if dtype in LOW_DTYPES:
        logits_rounding(stages["log_probs"], stages["decoder"], functools.partial(reference_model_in, dtype, variant),
                        dtype, f"{port}/{dtype}/forward: {variant}/{case}")


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
@pytest.mark.parametrize("dtype", DTYPES + LOW_DTYPES)
def test_log_probs(port, device_kind, dtype, variant, agreement, logits_rounding):
    """The output-only inference call ``bench`` times (JAX's and TF's XLA-compiled forward pass): explicit
    masks (case "none") and the model's default ones on a ragged batch; with its own generator weight and
    with the shared embedding's (the other variants' layers are test_forward_stages' and the same code)."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    model = port_model(port, variant, dtype, device)
    for case in ("none", "ragged_batch"):
        inputs = cases.model_inputs(FORWARD_VARIANTS[variant], case)
        log_probs = backend.log_probs(model, **inputs)
        agreement(log_probs, reference_forward(variant, case, "float64")["log_probs"],
                  reference_forward(variant, case, dtype)["log_probs"], port=port, device=device, dtype=dtype,
                  what=f"log_probs: {variant}/{case}", scores=True)
        if dtype in LOW_DTYPES:
            logits_rounding(log_probs, port_forward(port, variant, case, dtype, device)["decoder"],
                            functools.partial(reference_model_in, dtype, variant), dtype,
                            f"{port}/{dtype}/log_probs: {variant}/{case}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES + LOW_DTYPES)
@pytest.mark.parametrize("case", MASK_CASES)
@pytest.mark.parametrize("pair", list(itertools.combinations(FRAMEWORKS, 2)), ids="-".join)
def test_ports_agree_with_each_other(pair, device_kind, dtype, variant, case):
    """Each pair of ports, stage by stage, within tolerance.pair_bound (twice the policy's bound)."""
    devices = [device_for(port_backend(port), device_kind) for port in pair]
    first, second = (port_forward(port, variant, case, dtype, device) for port, device in zip(pair, devices))
    ref64, ref_same = reference_forward(variant, case, "float64"), reference_forward(variant, case, dtype)
    for stage in ref64:
        error = tolerance.max_abs(first[stage], second[stage])
        bound = tolerance.pair_bound(dtype, ref64[stage], ref_same[stage])
        assert error <= bound, f"{pair[0]} vs {pair[1]}, {stage}: {error:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_runs_are_bitwise_identical(port, dtype):
    """Twenty runs of the same forward pass and greedy decode give the same bits: the suite's
    results do not depend on the run."""
    backend = port_backend(port)
    model = port_model(port, "tiny", dtype, "cpu")
    inputs = cases.model_inputs(VARIANTS["tiny"], "ragged_batch")
    src = cases.decoding_inputs(VARIANTS["tiny"])
    first, first_tokens = backend.forward(model, **inputs), backend.greedy(model, src)
    for _ in range(19):
        again = backend.forward(model, **inputs)
        assert all(np.array_equal(again[stage], first[stage]) for stage in first)
        np.testing.assert_array_equal(backend.greedy(model, src), first_tokens)


# ----------------------------------------------------------------------------- decoded tokens

@functools.cache
def reference_decoding(variant: str, kind: str):
    """Reference float64 tokens, scores and decision margins, and the float32 error bound of
    the log-probabilities along the reference's own output (teacher forcing)."""
    return decoding_oracle(reference_model(variant, "float64", "decoding"),
                           reference_model(variant, "float32", "decoding"), cases.decoding_inputs(VARIANTS[variant]),
                           kind)


def _port_decode(port, device, dtype, variant, kind):
    model = port_model(port, variant, dtype, device, "decoding")
    src = cases.decoding_inputs(VARIANTS[variant])
    backend = port_backend(port)
    return backend.greedy(model, src) if kind == "greedy" else backend.beam(model, src)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["greedy", "beam"])
def test_decoded_tokens_float64(port, device_kind, variant, kind, agreement):
    """float64, each port's cached search (its default; the uncached one: test_torch/jax/tf.py): tokens identical
    to the reference's, every row, whole length; beam scores agree."""
    device = device_for(port_backend(port), device_kind)
    _, ref_tokens, ref_scores, _, _ = reference_decoding(variant, kind)
    assert len(set((ref_tokens != VARIANTS[variant].pad_id).sum(axis=1))) > 1, "rows should end at different steps"
    out = _port_decode(port, device, "float64", variant, kind)
    tokens = out if kind == "greedy" else out[0]
    assert tokens.dtype == np.int64
    np.testing.assert_array_equal(tokens, ref_tokens)
    if kind == "beam":
        agreement(out[1], ref_scores, None, port=port, device=device, dtype="float64", what=f"beam scores: {variant}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_float32(port, device_kind, variant):
    """float32: tokens identical up to the first step whose top-two log-probability margin in
    the float64 reference is below twice the float32 bound (see
    ``tolerance.greedy_decisive_steps``); rows without such a step must match entirely."""
    device = device_for(port_backend(port), device_kind)
    _, ref_tokens, _, margins, bound = reference_decoding(variant, "greedy")
    tokens = _port_decode(port, device, "float32", variant, "greedy")
    agree, note, full_rows = tolerance.greedy_tokens_agree(tokens, ref_tokens, margins, bound, VARIANTS[variant].pad_id)
    assert agree, note
    assert full_rows, "every row had a float32 near-tie; choose inputs with clear decisions"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_beam_tokens_float32(port, device_kind, variant):
    """float32 beam search: rows without a near-tie (``tolerance.beam_row_is_decisive``) must
    match exactly; rows with one are not compared. At least one row must be compared."""
    device = device_for(port_backend(port), device_kind)
    _, ref_tokens, _, margins, bound = reference_decoding(variant, "beam")
    tokens, _ = _port_decode(port, device, "float32", variant, "beam")
    clear = [row for row, row_margins in enumerate(margins) if tolerance.beam_row_is_decisive(row_margins, bound)]
    assert clear, "every row had a float32 near-tie; choose inputs with clear decisions"
    for row in clear:
        np.testing.assert_array_equal(_emitted(tokens[row], variant), _emitted(ref_tokens[row], variant),
                                      err_msg=f"row {row}")


@functools.cache
def reference_decoding_in(variant: str, kind: str, dtype: str):
    """The reference's float64 tokens, scores and margins with the bound of its log-probabilities in ``dtype``."""
    src, tokens, scores, margins, _ = reference_decoding(variant, kind)
    return src, tokens, scores, margins, teacher_forced_bound(reference_model(variant, "float64", "decoding"),
                                                              reference_model(variant, dtype, "decoding"), src, tokens)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_float16(port, device_kind, variant):
    """float16 greedy decoding with the cache, on the decoding case (rows ending at eos and at the length limit):
    the float32 rule with float16's bound (identical up to each row's first step whose float64 margin is below twice
    it), at least one step compared. (Seeded tiny models decide by margins below bfloat16's bound, ~0.4, at the first
    step; bfloat16 decoding is compared on the shipped model, whose decisions are clear.)"""
    device = device_for(port_backend(port), device_kind)
    _, ref_tokens, _, margins, bound = reference_decoding_in(variant, "greedy", "float16")
    tokens = _port_decode(port, device, "float16", variant, "greedy")
    agree, note, _ = tolerance.greedy_tokens_agree(tokens, ref_tokens, margins, bound, VARIANTS[variant].pad_id)
    assert agree, note
    compared = [tolerance.greedy_decisive_steps(row, bound) for row in margins]       # None: the whole row
    assert any(steps is None or steps > 0 for steps in compared), "no step compared; choose clearer decisions"


def _emitted(row: np.ndarray, variant: str) -> np.ndarray:
    """The tokens a row emitted (decoders never emit pad_id, so padding is exactly the pad ids)."""
    return row[row != VARIANTS[variant].pad_id]


# ----------------------------------------------------------------------------- the shipped trained model

@functools.cache
def trained_model(backend_name: str, dtype: str, device: str = "cpu"):
    config, params, _, _ = trained()
    backend = reference if backend_name == "numpy" else port_backend(backend_name)
    return backend.build(config, params, dtype, device)


@functools.cache
def trained_reference(dtype: str):
    return reference.forward(trained_model("numpy", dtype), **trained()[3])


@functools.cache
def trained_decoding(kind: str, dtype: str = "float32"):
    """The reference's float64 decoding of the held-out sentences, with the bound of ``dtype``'s log-probabilities."""
    src, tokens, scores, margins, _ = decoding_oracle(trained_model("numpy", "float64"),
                                                      trained_model("numpy", "float32"), trained()[3]["src"], kind)
    return src, tokens, scores, margins, teacher_forced_bound(trained_model("numpy", "float64"),
                                                              trained_model("numpy", dtype), src, tokens)


@functools.cache
def trained_model_in(low: str, dtype: str):
    """The reference in ``dtype`` with the trained weights rounded to ``low``."""
    config, params, _, _ = trained()
    return rounded_reference(config, params, low, dtype)


@pytest.mark.parametrize("dtype", DTYPES + LOW_DTYPES)
def test_trained_model_forward_stages(port, device_kind, dtype, agreement, logits_rounding):
    """Every stage of the trained model on held-out sentences and their French translations; in bfloat16 and
    float16 the logits' roundings too (trained logits are large and spread: where XLA dropped them, first seen)."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    stages = backend.forward(trained_model(port, dtype, device), **trained()[3])
    ref64, ref_same = trained_reference("float64"), trained_reference(dtype)
    maps = tolerance.stage_maps(trained_model("numpy", "float64"), **trained()[3])
    for stage in ref64:
        agreement(stages[stage], ref64[stage], ref_same[stage], port=port, device=device, dtype=dtype,
                  what=f"trained model, forward {stage}", scores=stage == "log_probs",
                  added=(maps.get(stage), stages, ref_same))
    if dtype in LOW_DTYPES:
        logits_rounding(stages["log_probs"], stages["decoder"], functools.partial(trained_model_in, dtype), dtype,
                        f"{port}/{dtype}/trained model, forward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_trained_model_attention_weights(port, device_kind, dtype, kind, agreement):
    """The weights ``plot attention`` draws for the trained model, last layer (its sharpest alignment)."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs, layer = trained()[3], trained()[0].n_decoder_layers - 1
    weights = backend.attention_weights(trained_model(port, dtype, device), inputs["src"], inputs["tgt"], layer, kind)
    expected = {dtype: reference.attention_weights(trained_model("numpy", dtype), inputs["src"], inputs["tgt"], layer,
                                                   kind) for dtype in DTYPES}
    agreement(weights, expected["float64"], expected["float32"], port=port, device=device, dtype=dtype,
              what=f"trained model, attention weights {kind}")


@pytest.mark.parametrize("kind", ["greedy", "beam"])
def test_trained_model_translations_float64(port, device_kind, kind, agreement):
    """float64: the same tokens, hence the same French text, as the reference for every held-out sentence, greedy
    and beam search (beam 4, alpha 0.6); beam scores within the policy. (The whole test split:
    scripts/check_translations.py.)"""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    model = trained_model(port, "float64", device)
    _, ref_tokens, ref_scores, _, _ = trained_decoding(kind)
    out = backend.greedy(model, trained()[3]["src"]) if kind == "greedy" else backend.beam(model, trained()[3]["src"])
    tokens = out if kind == "greedy" else out[0]
    np.testing.assert_array_equal(tokens, ref_tokens)
    tokenizer = trained()[2]
    assert [tokenizer.decode(row) for row in tokens] == [tokenizer.decode(row) for row in ref_tokens]
    if kind == "beam":
        agreement(out[1], ref_scores, None, port=port, device=device, dtype="float64",
                  what="trained model, beam scores")


@pytest.mark.parametrize("dtype", ("float32",) + LOW_DTYPES)
def test_trained_model_translations_below_float64(port, device_kind, dtype):
    """float32, bfloat16 and float16 greedy decoding: identical to the reference's float64 tokens except after a
    near-tie the precision's own bound allows; float32 beam search likewise. Trained weights decide clearly: every
    row is compared whole. (Beam search below float32 is not compared: its rule allows t times the bound at step t,
    which at bfloat16's bound, ~0.8, leaves no row decisive.)"""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    model, src, pad_id = trained_model(port, dtype, device), trained()[3]["src"], trained()[0].pad_id
    _, ref_tokens, _, margins, bound = trained_decoding("greedy", dtype)
    agree, note, full_rows = tolerance.greedy_tokens_agree(backend.greedy(model, src), ref_tokens, margins, bound,
                                                           pad_id)
    assert agree and full_rows == len(src), note
    if dtype == "float32":
        _, ref_tokens, _, margins, bound = trained_decoding("beam")
        assert all(tolerance.beam_row_is_decisive(row_margins, bound) for row_margins in margins)
        np.testing.assert_array_equal(backend.beam(model, src)[0], ref_tokens)
