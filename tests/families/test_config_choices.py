"""The configuration choices of Hugging Face's families (``TransformerConfig.activation``, ``sinusoidal_layout``,
``scale_embeddings``, ``output_bias``): each against an oracle written here from its published definition with
naive loops and ``math`` (sharing no code with ``reference_numpy``), against transformers' own modules where it has
them (an outside implementation), and in every port: decoding with the cache, gradients and one Adam step in float64
(the fuzzer's checks on the two variants of the forward matrix, ``cases.CHOICE_VARIANTS``), the checkpoint's record
of the choices and the refusals of values outside them. (The logits' one rounding with a bias, in bfloat16 and
float16: tests/equivalence/test_agreement.py on the 'marian' variant.)
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from support import FRAMEWORKS, port_backend

from equivalence import cases, fuzz, tolerance
from equivalence.cases import CHOICE_VARIANTS, FORWARD_VARIANTS
from reference_numpy import (
    Transformer,
    TransformerConfig,
    capture_stages,
    init_params,
    load_checkpoint,
    save_checkpoint,
)
from reference_numpy import decoding as reference_decoding
from reference_numpy.incremental import at_position
from reference_numpy.model import activation, sinusoidal_positional_encoding
from reference_numpy.variants import position_ids

TINY = TransformerConfig.preset("tiny")
# Inputs of the activations: both signs, zero, the knees near +-1, and values where exp(-x) overflows.
POINTS = [-800.0, -40.0, -6.5, -3.0, -1.0, -0.5, -1e-3, 0.0, 1e-7, 0.25, 0.7, 1.0, 2.5, 5.0, 30.0, 800.0]


def close64(actual, expected) -> bool:
    """The float64 policy: within 1e-12 relative to the expected values' scale (tolerance.float64_bound)."""
    expected = np.asarray(expected, dtype=np.float64)
    return tolerance.max_abs(np.asarray(actual, dtype=np.float64), expected) <= tolerance.float64_bound(expected)


# ----------------------------------------------------------------------------- oracles from the definitions

def silu_oracle(x: float) -> float:
    """x sigmoid(x) (Elfwing et al., 2018), by cases so that exp never overflows."""
    if x >= 0:
        return x / (1.0 + math.exp(-x))
    return x * math.exp(x) / (1.0 + math.exp(x))


def gelu_oracle(x: float) -> float:
    """x Phi(x), Phi the standard normal CDF (Hendrycks & Gimpel, 2016): x / 2 (1 + erf(x / sqrt 2))."""
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("name,oracle", [("relu", lambda x: max(0.0, x)), ("silu", silu_oracle),
                                         ("gelu", gelu_oracle)])
def test_activations_against_their_definitions(name, oracle):
    x = np.array(POINTS)
    expected = [oracle(value) for value in POINTS]
    assert close64(activation(x, name), expected)
    assert activation(x, name).dtype == np.float64


def test_marian_halves_table_element_by_element():
    """MarianSinusoidalPositionalEmbedding: position_enc[pos, j] = pos / 10000^(2 (j // 2) / dim); the sines of the
    even j in the first half, the cosines of the odd j in the second (transformers' docstring: "features are not
    interleaved. The cos features are in the 2nd half of the vector")."""
    length, dim = 40, 16
    table = sinusoidal_positional_encoding(length, dim, np.float64, "halves")
    assert table.shape == (length, dim)
    for pos in range(length):
        for i in range(dim // 2):
            angle = pos / 10000 ** (2 * i / dim)
            assert abs(table[pos, i] - math.sin(angle)) <= 1e-12
            assert abs(table[pos, dim // 2 + i] - math.cos(angle)) <= 1e-12


@pytest.mark.parametrize("pad_id", [0, 1, 5])
def test_fairseq_table_element_by_element(pad_id):
    """fairseq's get_embedding: half = dim / 2, w_i = exp(-i ln(10000) / (half - 1)), row p = [sin(p w), cos(p w)],
    row padding_idx zeros; this project's row k >= 1 is fairseq's row pad_id + k and its row 0 is the zero row."""
    length, dim = 30, 12
    half = dim // 2
    table = sinusoidal_positional_encoding(length, dim, np.float64, "fairseq", pad_id)
    assert table.shape == (length + 1, dim)
    assert not table[0].any()
    for k in range(1, length + 1):
        for i in range(half):
            angle = (pad_id + k) * math.exp(-i * math.log(10000) / (half - 1))
            assert abs(table[k, i] - math.sin(angle)) <= 1e-12
            assert abs(table[k, half + i] - math.cos(angle)) <= 1e-12


def positions_oracle(row: list[int], pad_id: int, offset: int) -> list[int]:
    """fairseq's make_positions for one row, by a loop: each non-pad token counts itself; a pad reads row 0."""
    out, count = [], 0
    for token in row:
        if token == pad_id:
            out.append(0)
        else:
            count += 1
            out.append(offset + count)
    return out


def test_fairseq_positions_of_padded_rows_by_hand():
    pad = 1
    tokens = np.array([[7, 8, 9, 2], [7, 8, 2, pad], [pad, pad, 7, 2], [7, pad, 8, pad]])
    assert position_ids(tokens, pad).tolist() == [[1, 2, 3, 4], [1, 2, 3, 0], [0, 0, 1, 2], [1, 0, 2, 0]]
    assert position_ids(tokens, pad, 5).tolist() == [[6, 7, 8, 9], [6, 7, 8, 0], [0, 0, 6, 7], [6, 0, 7, 0]]
    assert position_ids(tokens, pad, by_step=True).tolist() == [[1, 2, 3, 4], [1, 2, 3, 0], [0, 0, 3, 4],
                                                                [1, 0, 3, 0]]
    assert position_ids(tokens, pad, 5, by_step=True).tolist() == [[6, 7, 8, 9], [6, 7, 8, 0], [0, 0, 8, 9],
                                                                   [6, 0, 8, 0]]
    rng = np.random.default_rng(3)
    for pad_id in (0, 3):
        batch = rng.integers(0, 5, (6, 9))
        for offset in (0, 4):
            assert position_ids(batch, pad_id, offset).tolist() == [positions_oracle(list(row), pad_id, offset)
                                                                   for row in batch]


@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
def test_the_embedded_source_by_hand(variant):
    """The "src_embed" stage of a ragged batch: E[token] x sqrt(d_model) (or x 1 unscaled) + the table row each
    position reads (fairseq: counting only the row's non-pad tokens; a learned table: row t + position_offset), every
    element by a loop; with ``embedding_norm`` that sum's LayerNorm, (v - mean) / sqrt(var + eps) x gain + bias with
    math.fsum."""
    config = FORWARD_VARIANTS[variant]
    params = cases.seeded_params(config)
    src = cases.model_inputs(config, "ragged_batch")["src"]
    stage = capture_stages(Transformer(config, params), src, src[:, :3] * 0 + config.bos_id)[1]["src_embed"]
    embed = params["src_embed.weight"]
    scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
    d, half = config.d_model, config.d_model // 2
    for b, row in enumerate(src):
        count = 0
        for t, token in enumerate(row):
            count += token != config.pad_id
            if config.positional_encoding == "learned":
                pe = [float(value) for value in params["src_pos_embed.weight"][t + config.position_offset]]
            else:
                pe = [0.0] * d
                for i in range(half):
                    if config.sinusoidal_layout == "halves":
                        angle = t / 10000 ** (2 * i / d)
                    elif token == config.pad_id:
                        continue
                    else:
                        angle = (config.pad_id + count) * math.exp(-i * math.log(10000) / (half - 1))
                    pe[i], pe[half + i] = math.sin(angle), math.cos(angle)
            expected = [float(embed[token, column]) * scale + pe[column] for column in range(d)]
            if config.embedding_norm:
                mean = math.fsum(expected) / d
                var = math.fsum((value - mean) ** 2 for value in expected) / d
                gain, bias = params["src_embed_norm.weight"], params["src_embed_norm.bias"]
                expected = [(value - mean) / math.sqrt(var + config.layer_norm_eps) * float(gain[column])
                            + float(bias[column]) for column, value in enumerate(expected)]
            for column, value in enumerate(expected):
                assert abs(stage[b, t, column] - value) <= 1e-12 * max(1.0, abs(value)), (b, t, column)


def test_the_logits_bias_by_hand():
    """log p = x W + b - log sum exp(x W + b) (Marian's final_logits_bias), every entry with math.fsum."""
    config = FORWARD_VARIANTS["marian"]
    params = cases.seeded_params(config)
    generator = Transformer(config, params).generator
    x = np.random.default_rng(0).standard_normal((2, 3, config.d_model))
    out = generator(x)
    weight, bias = params["generator.weight"], params["generator.bias"]
    assert np.abs(bias).max() > 0.01                                       # a bias the test can see
    for b in range(2):
        for t in range(3):
            logits = [math.fsum(x[b, t, k] * weight[k, v] for k in range(config.d_model)) + bias[v]
                      for v in range(config.tgt_vocab_size)]
            top = max(logits)
            total = top + math.log(math.fsum(math.exp(value - top) for value in logits))
            assert close64(out[b, t], [value - total for value in logits])


# ----------------------------------------------------------------------------- transformers' own modules

def needs_transformers() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (the outside implementation)")


def test_activations_against_transformers():
    """ACT2FN["gelu"] (GELUActivation: torch's exact erf GELU), ACT2FN["swish"] and ACT2FN["silu"], in float64."""
    needs_transformers()
    import torch
    from transformers.activations import ACT2FN

    x = torch.tensor(POINTS, dtype=torch.float64)
    for theirs, ours in (("gelu", "gelu"), ("swish", "silu"), ("silu", "silu"), ("relu", "relu")):
        assert close64(activation(np.array(POINTS), ours), ACT2FN[theirs](x).numpy()), theirs


def test_marian_table_against_transformers():
    """transformers computes Marian's table in float64 NumPy and stores it as float32 (torch.FloatTensor): the
    reference's float64 table rounded to float32 is that table exactly."""
    needs_transformers()
    import torch
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    module = MarianSinusoidalPositionalEmbedding(64, 16)
    theirs = module.create_weight()
    assert theirs.dtype == torch.float32
    ours = sinusoidal_positional_encoding(64, 16, np.float64, "halves")
    assert np.array_equal(ours.astype(np.float32), theirs.numpy())
    interleaved = sinusoidal_positional_encoding(64, 16, np.float64, "interleaved")
    assert not np.array_equal(interleaved.astype(np.float32), theirs.numpy())       # the layouts differ


@pytest.mark.parametrize("pad_id", [1, 4])
def test_fairseq_table_and_positions_against_transformers(pad_id):
    """M2M100SinusoidalPositionalEmbedding: its table rows pad_id + k are the reference's rows k within the error
    of its float32 arithmetic (frequencies, angles, sin and cos in float32: a few float32 ulps of the angle, derived
    below), and its position ids of padded rows, with and without past positions, are the reference's rows + pad_id
    (pad_id where the reference reads its zero row)."""
    needs_transformers()
    import torch
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    length, dim = 40, 16
    theirs = M2M100SinusoidalPositionalEmbedding.get_embedding(pad_id + length + 1, dim, pad_id).double().numpy()
    ours = sinusoidal_positional_encoding(length, dim, np.float64, "fairseq", pad_id)
    assert not theirs[pad_id].any() and not ours[0].any()
    angle = (pad_id + np.arange(1, length + 1))[:, None] * np.ones((1, dim))     # the largest angle of each row
    bound = 8 * np.finfo(np.float32).eps * (angle + 1)                          # each float32 rounding on the way
    assert (np.abs(theirs[pad_id + 1:] - ours[1:]) <= bound).all()
    tokens = torch.tensor([[7, 8, 9, 2], [pad_id, pad_id, 7, 2], [7, pad_id, 8, pad_id]])
    for past in (0, 3):
        ids = M2M100SinusoidalPositionalEmbedding.create_position_ids_from_input_ids(tokens, pad_id, past).numpy()
        rows = position_ids(tokens.numpy(), pad_id, past)
        assert np.array_equal(ids, np.where(rows == 0, pad_id, rows + pad_id))
    # generate's cached decoding: one token a step at past_key_values_length = the step, the decoder's rows by_step
    steps = np.concatenate([M2M100SinusoidalPositionalEmbedding.create_position_ids_from_input_ids(
        tokens[:, i:i + 1], pad_id, i).numpy() for i in range(tokens.shape[1])], axis=1)
    rows = position_ids(tokens.numpy(), pad_id, by_step=True)
    assert np.array_equal(steps, np.where(rows == 0, pad_id, rows + pad_id))


# ----------------------------------------------------------------------------- every port

@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
def test_cached_steps_read_the_positions_of_the_whole_prefix(variant):
    """The reference's decoder fed one position at a time through its cache (each step's position given by its
    cache_index) gives the whole prefix's outputs: fairseq's rows c + 1, Marian's rows c."""
    config = FORWARD_VARIANTS[variant]
    model = Transformer(config, cases.seeded_params(config))
    inputs = cases.model_inputs(config, "source_padding")
    memory = model.encode(inputs["src"])
    src_mask = (inputs["src"] != config.pad_id)[:, None, None, :]
    whole = model.decode(inputs["tgt"], memory, src_mask)
    cache = model.init_cache(memory, inputs["tgt"].shape[1])
    for step in range(inputs["tgt"].shape[1]):
        out, cache = model.decode(inputs["tgt"][:, step:step + 1], memory, src_mask, cache=at_position(cache, step))
        assert close64(out[:, 0], whole[:, step]), step


@functools.cache
def reference_searches(variant: str):
    config = FORWARD_VARIANTS[variant]
    model = Transformer(config, cases.decoding_params(config))
    src = cases.decoding_inputs(config)
    return src, reference_decoding.greedy_decode(model, src), reference_decoding.beam_search(model, src, 3)


@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_decoded_tokens_float64(port, variant):
    """Greedy decoding and beam search (K = 3) with each port's cache give the reference's tokens (which
    recomputes every prefix) and scores within the float64 policy."""
    backend = port_backend(port)
    config = FORWARD_VARIANTS[variant]
    model = backend.build(config, cases.decoding_params(config), "float64", "cpu")
    src, greedy, (beam_tokens, beam_scores) = reference_searches(variant)
    assert np.array_equal(np.asarray(backend.greedy(model, src)), greedy)
    tokens, scores = backend.beam(model, src, 3)
    assert np.array_equal(np.asarray(tokens), beam_tokens)
    assert close64(scores, beam_scores)


@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
@pytest.mark.parametrize("port", [pytest.param(port, marks=[pytest.mark.slow] if port != "torch" else [])
                                  for port in FRAMEWORKS])
def test_forward_decoding_gradients_and_a_training_step(port, variant):
    """The fuzzer's whole check (equivalence/fuzz.py: the forward stages in float64 and float32, greedy tokens, the
    loss, its gradient against the reference's hand-written backward pass and one Adam step in float64) on a
    ragged batch of each variant, a source row fully padded. JAX and TensorFlow compile each of the five (15-50 s a
    variant): slow; test_port_gradients below is their gradient alone."""
    config = FORWARD_VARIANTS[variant].replace(dropout=0.0)
    case = fuzz.Case(config, seed=1, weight_scale=1.0, src_lengths=(7, 3, 0), tgt_lengths=(6, 2, 4), src_len=7,
                     tgt_len=6, token_dtype="int64", explicit_masks=False)
    not_compared: list[str] = []
    found = fuzz.check(case, port_backend(port), not_compared)
    assert not found, "\n".join(found)
    assert not not_compared, not_compared


@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_port_gradients(port, variant):
    """Each port's autodiff gradient of the label-smoothed loss (float64) against the reference's hand-written
    backward pass, within tolerance.gradient_bound; the loss within the float64 policy."""
    from reference_numpy.training import gradients

    config = FORWARD_VARIANTS[variant]
    params, batch = cases.seeded_params(config), cases.training_inputs(config)
    backend = port_backend(port)
    value, grads = backend.gradients(backend.build(config, params, "float64", "cpu"), **batch)
    ref_value, ref_grads = gradients(Transformer(config, params), **batch)
    assert abs(value - ref_value) <= tolerance.float64_bound(ref_value)
    assert list(grads) == list(ref_grads)
    bound = tolerance.gradient_bound(ref_grads, grads)
    for name, grad in ref_grads.items():
        assert tolerance.max_abs(grads[name], grad) <= bound, name


@pytest.mark.parametrize("variant", CHOICE_VARIANTS)
def test_reference_gradients_against_finite_differences(variant):
    """The hand-written backward pass through SiLU, GELU, the bias and either table: the loss's derivative along
    random unit directions against Richardson-extrapolated central differences (tolerance.finite_difference_bound)."""
    from reference_numpy.training import gradients, loss

    config = FORWARD_VARIANTS[variant]
    params, batch = cases.seeded_params(config), cases.training_inputs(config)
    value = lambda changed: float(loss(Transformer(config, changed), **batch))
    _, grads = gradients(Transformer(config, params), **batch)
    rng, step = np.random.default_rng(5), 1e-3
    for _ in range(2):
        direction = {name: rng.standard_normal(array.shape) for name, array in params.items()}
        norm = math.sqrt(sum(float((d ** 2).sum()) for d in direction.values()))

        def central(h, direction=direction, norm=norm):
            moved = [{name: params[name] + sign * h * direction[name] / norm for name in params} for sign in (1, -1)]
            return (value(moved[0]) - value(moved[1])) / (2 * h)

        fd_h, fd_half = central(step), central(step / 2)
        bound = tolerance.finite_difference_bound(fd_h, fd_half, value(params), step)
        analytic = sum(float((grads[name] * direction[name]).sum()) for name in params) / norm
        assert abs(analytic - (4 * fd_half - fd_h) / 3) <= bound


# ----------------------------------------------------------------------------- the configuration and the checkpoint

@pytest.mark.parametrize("field,value", [("activation", "tanh"), ("activation", "swish"),
                                         ("sinusoidal_layout", "sin_cos"), ("scale_embeddings", 1),
                                         ("output_bias", "yes"), ("embedding_norm", 1), ("position_offset", -1),
                                         ("position_offset", 2.0)])
def test_a_value_outside_the_choices_is_one_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        TINY.replace(**{field: value})


def test_choices_that_do_not_fit_together_are_refused():
    with pytest.raises(ValueError, match="^sinusoidal_layout 'halves' needs positional_encoding 'sinusoidal'"):
        TINY.replace(positional_encoding="learned", sinusoidal_layout="halves")
    with pytest.raises(ValueError, match="^sinusoidal_layout 'fairseq' needs d_model >= 4"):
        TINY.replace(d_model=2, n_heads=1, sinusoidal_layout="fairseq")
    with pytest.raises(ValueError, match="^position_offset 2 needs positional_encoding 'learned'"):
        TINY.replace(position_offset=2)
    with pytest.raises(ValueError, match=r"^max_len \+ position_offset must be <= 65536, got 65537$"):
        TINY.replace(positional_encoding="learned", max_len=65536, position_offset=1)


def test_a_config_without_the_fields_is_the_papers_model():
    data = {name: value for name, value in TINY.to_dict().items()
            if name not in ("activation", "sinusoidal_layout", "scale_embeddings", "output_bias", "embedding_norm",
                            "position_offset")}
    config = TransformerConfig.from_dict(data)
    assert (config.activation, config.sinusoidal_layout, config.scale_embeddings, config.output_bias,
            config.embedding_norm, config.position_offset) == ("relu", "interleaved", True, False, False, 0)
    assert config == TINY


def test_the_checkpoint_records_the_choices_and_refuses_others_alike_in_every_backend(tmp_path):
    """The choices round-trip through the file's config, ``generator.bias`` among its tensors; a file whose config
    holds a value outside them is refused by every backend's loader with the reference's one message."""
    config = FORWARD_VARIANTS["marian"]
    params = init_params(config, 0, perturb=0.1)
    path = tmp_path / "marian.safetensors"
    save_checkpoint(path, config, params)
    loaded, loaded_params = load_checkpoint(path)
    assert loaded == config and list(loaded_params) == list(params)
    assert np.array_equal(loaded_params["generator.bias"], params["generator.bias"])

    bad = tmp_path / "bad.safetensors"
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8:8 + header_length])
    header["__metadata__"]["config"] = json.dumps({**config.to_dict(), "activation": "tanh"})
    text = json.dumps(header).encode()
    bad.write_bytes(len(text).to_bytes(8, "little") + text + path.read_bytes()[8 + header_length:])
    with pytest.raises(ValueError) as reference_error:
        load_checkpoint(bad)
    assert "activation must be one of" in str(reference_error.value)
    for port in FRAMEWORKS:
        with pytest.raises(ValueError) as port_error:
            port_backend(port).load(bad)
        assert str(port_error.value) == str(reference_error.value), port

