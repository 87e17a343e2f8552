"""The reference's hand-written backward pass (``reference_numpy/backward.py``) against oracles that
share none of its code: central finite differences of the forward pass (``reference_numpy/model.py``,
``training.py``), piece by piece and for the whole model, within ``tolerance.finite_difference_bound``;
and PyTorch's autograd (an outside implementation) within ``tolerance.gradient_bound``."""

from __future__ import annotations

import numpy as np
import pytest

from equivalence import tolerance
from equivalence.cases import FORWARD_VARIANTS, MASK_CASES, component_inputs, seeded_params, training_inputs
from equivalence.finite_differences import STEP, finite_difference_gradients
from reference_numpy import backward
from reference_numpy.config import TransformerConfig
from reference_numpy.model import (
    Decoder,
    DecoderLayer,
    Embeddings,
    Encoder,
    EncoderLayer,
    Generator,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    PositionalEncoding,
    PositionwiseFeedForward,
    Transformer,
    residual,
    scaled_dot_product_attention,
)
from reference_numpy.training import LABEL_SMOOTHING, label_smoothed_cross_entropy, loss

# Pieces: every size different (D 8, d_k 4, F 12, V 11 and 13, L 9), so a swapped axis fails.
PIECE = TransformerConfig.preset("tiny", d_model=8, n_heads=2, d_ff=12, src_vocab_size=11, tgt_vocab_size=13,
                                 max_len=9)
NORM_FIRST = {"post_ln": False, "pre_ln": True}
# Central differences estimate a derivative only where the function is smooth within +-h of the
# point; the ReLU of Eq. (2) has a kink at 0, and at the default h = 1e-3 a hidden unit of the
# seeded models changes sign inside the interval (src_embed.weight[5, 1] of the learned_pe model:
# the estimate moves from 0.0486 at h = 1e-3 to 0.0471 at h <= 1e-4, the backward's value).
# Tests through a ReLU use h = 1e-5: the rounding term of the bound, 3 delta / h ~ 1e-6, stays
# far below every bug planted in the backward pass (docs/reference.md).
RELU_STEP = 1e-5


def random(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def piece_params(config: TransformerConfig, prefix: str) -> dict[str, np.ndarray]:
    """The seeded checkpoint tensors of the module ``prefix`` (perturbed biases and norms)."""
    return {name: value for name, value in seeded_params(config).items() if name.startswith(f"{prefix}.")}


def assert_matches_finite_differences(function, inputs: dict[str, np.ndarray], analytic: dict[str, np.ndarray],
                                      step: float = STEP):
    """``analytic`` holds d function / d inputs[name] for every name; each entry must lie within its
    finite-difference bound of the Richardson estimate."""
    assert sorted(analytic) == sorted(inputs)
    estimates, bounds = finite_difference_gradients(function, inputs, step)
    for name, estimate in estimates.items():
        assert analytic[name].shape == estimate.shape, name
        assert np.isfinite(analytic[name]).all(), f"{name}: non-finite gradient"
        excess = np.abs(analytic[name] - estimate) - bounds[name]
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess[worst] <= 0, (f"{name}{list(worst)}: backward {analytic[name][worst]:.15e}, finite "
                                    f"differences {estimate[worst]:.15e} +- {bounds[name][worst]:.2e}")


def check_piece(forward, run, inputs: dict[str, np.ndarray], input_names: tuple[str, ...], step: float = STEP):
    """``forward(inputs) -> array`` is the model's code; ``run(inputs, grads) -> (out, backward)`` the backward
    module's, whose ``backward(upstream)`` returns the gradients of ``input_names`` (one array or a tuple).
    Checks d sum(upstream * forward) against finite differences for every input and parameter."""
    grads: dict[str, np.ndarray] = {}
    out, pullback = run(inputs, grads)
    np.testing.assert_array_equal(out, forward(inputs))                  # the forward is the model's, exactly
    upstream = random(out.shape, 7)
    result = pullback(upstream)
    result = result if isinstance(result, tuple) else (result,)
    analytic = {**grads, **dict(zip(input_names, result))}
    assert_matches_finite_differences(lambda p: float((upstream * forward(p)).sum()), inputs, analytic, step)
    return analytic


# ----------------------------------------------------------------------------- pieces

def test_linear():
    inputs = {"x": random((2, 3, 5), 0), "lin.weight": random((5, 4), 1), "lin.bias": random((4,), 2)}
    check_piece(lambda p: Linear(p, "lin")(p["x"]),
                lambda p, grads: backward.linear(Linear(p, "lin"), "lin", p["x"], grads), inputs, ("x",))


@pytest.mark.parametrize("case", MASK_CASES)
def test_attention(case):
    """Eq. (1) with every mask case; a fully masked query row (case fully_masked_row, batch row 1)
    and keys no query may see get exactly zero gradient, never NaN."""
    data = component_inputs(PIECE, "attention", case)
    mask = data.pop("mask")
    analytic = check_piece(lambda p: scaled_dot_product_attention(p["query"], p["key"], p["value"], mask)[0],
                           lambda p, grads: backward.attention(p["query"], p["key"], p["value"], mask),
                           data, ("query", "key", "value"))
    if mask is not None:
        full = np.broadcast_to(mask, analytic["query"].shape[:-1] + (analytic["key"].shape[-2],))  # (B, H, Tq, Tk)
        blind_queries, unseen_keys = ~full.any(axis=-1), ~full.any(axis=-2)
        assert (analytic["query"][blind_queries] == 0).all()
        assert (analytic["key"][unseen_keys] == 0).all() and (analytic["value"][unseen_keys] == 0).all()
    if case == "fully_masked_row":
        assert (analytic["query"][1] == 0).all() and (analytic["key"][1] == 0).all()


@pytest.mark.parametrize("case", MASK_CASES)
def test_multi_head_attention(case):
    data = component_inputs(PIECE, "multi_head_attention", case)
    mask = data.pop("mask")
    inputs = {**data, **piece_params(PIECE, "encoder.layers.0.self_attn")}
    name = "encoder.layers.0.self_attn"
    check_piece(lambda p: MultiHeadAttention(PIECE, p, name)(p["query"], p["key"], p["value"], mask),
                lambda p, grads: backward.multi_head_attention(MultiHeadAttention(PIECE, p, name), name, p["query"],
                                                               p["key"], p["value"], mask, grads),
                inputs, ("query", "key", "value"))


def test_feed_forward():
    name = "encoder.layers.0.ffn"
    inputs = {**component_inputs(PIECE, "feed_forward", "none"), **piece_params(PIECE, name)}
    check_piece(lambda p: PositionwiseFeedForward(PIECE, p, name)(p["x"]),
                lambda p, grads: backward.feed_forward(PositionwiseFeedForward(PIECE, p, name), name, p["x"], grads),
                inputs, ("x",), RELU_STEP)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_layer_norm(eps):
    """Biased variance, eps inside the square root (1e-2 makes a misplaced eps visible)."""
    config, name = PIECE.replace(layer_norm_eps=eps), "encoder.layers.0.ffn_norm"
    inputs = {"x": 0.3 + 2.0 * random((3, 7, 8), 3), **piece_params(config, name)}
    check_piece(lambda p: LayerNorm(config, p, name)(p["x"]),
                lambda p, grads: backward.layer_norm(LayerNorm(config, p, name), name, p["x"], grads), inputs, ("x",))


@pytest.mark.parametrize("norm_first", NORM_FIRST.values(), ids=NORM_FIRST.keys())
def test_residual(norm_first):
    """Post-LN LayerNorm(x + FFN(x)) and pre-LN x + FFN(LayerNorm(x)) (section 3.1)."""
    ffn_name, norm_name = "encoder.layers.0.ffn", "encoder.layers.0.ffn_norm"
    inputs = {**component_inputs(PIECE, "feed_forward", "none"), **piece_params(PIECE, ffn_name),
              **piece_params(PIECE, norm_name)}

    def run(p, grads):
        ffn = PositionwiseFeedForward(PIECE, p, ffn_name)
        return backward.residual(LayerNorm(PIECE, p, norm_name), norm_name, norm_first, p["x"],
                                 lambda h: backward.feed_forward(ffn, ffn_name, h, grads), grads)

    check_piece(lambda p: residual(p["x"], PositionwiseFeedForward(PIECE, p, ffn_name), LayerNorm(PIECE, p, norm_name),
                                   norm_first), run, inputs, ("x",), RELU_STEP)


@pytest.mark.parametrize("norm_first", NORM_FIRST.values(), ids=NORM_FIRST.keys())
def test_encoder_layer(norm_first):
    """Self-attention with a source row of padding only (every query fully masked)."""
    config, name = PIECE.replace(norm_first=norm_first), "encoder.layers.0"
    data = component_inputs(config, "encoder_layer", "fully_masked_row")
    mask = data.pop("mask")
    inputs = {**data, **piece_params(config, name)}
    check_piece(lambda p: EncoderLayer(config, p, name)(p["x"], mask),
                lambda p, grads: backward.encoder_layer(EncoderLayer(config, p, name), name, p["x"], mask, grads),
                inputs, ("x",), RELU_STEP)


@pytest.mark.parametrize("norm_first", NORM_FIRST.values(), ids=NORM_FIRST.keys())
def test_decoder_layer(norm_first):
    """Causal self-attention; cross-attention with a source row of padding only; d/dmemory too."""
    config, name = PIECE.replace(norm_first=norm_first), "decoder.layers.0"
    data = component_inputs(config, "decoder_layer", "fully_masked_row")
    src_mask, tgt_mask = data.pop("src_mask"), data.pop("tgt_mask")
    inputs = {**data, **piece_params(config, name)}
    analytic = check_piece(
        lambda p: DecoderLayer(config, p, name)(p["x"], p["memory"], src_mask, tgt_mask),
        lambda p, grads: backward.decoder_layer(DecoderLayer(config, p, name), name, p["x"], p["memory"], src_mask,
                                                tgt_mask, grads),
        inputs, ("x", "memory"), RELU_STEP)
    assert (analytic["memory"][1] == 0).all()                               # no query sees that source row


def test_stacks_pre_ln():
    """Two layers per stack and the stacks' final LayerNorms (pre-LN), encoder into decoder."""
    config = PIECE.replace(norm_first=True, n_encoder_layers=2, n_decoder_layers=2)
    data = component_inputs(config, "decoder", "fully_masked_row")
    src_mask, tgt_mask = data.pop("src_mask"), data.pop("tgt_mask")
    params = {name: value for name, value in seeded_params(config).items() if name.startswith(("encoder.", "decoder."))}
    inputs = {"x": data["x"], "source": data["memory"], **params}            # source: the encoder's input (B, S, D)

    def forward(p):
        memory = Encoder(config, p, "encoder")(p["source"], src_mask)
        return Decoder(config, p, "decoder")(p["x"], memory, src_mask, tgt_mask)

    def run(p, grads):
        memory, encoder_backward = backward.encoder(Encoder(config, p, "encoder"), "encoder", p["source"], src_mask,
                                                    grads)
        out, decoder_backward = backward.decoder(Decoder(config, p, "decoder"), "decoder", p["x"], memory, src_mask,
                                                 tgt_mask, grads)

        def pullback(grad_out):
            grad_x, grad_memory = decoder_backward(grad_out)
            return grad_x, encoder_backward(grad_memory)

        return out, pullback

    check_piece(forward, run, inputs, ("x", "source"), RELU_STEP)


def test_embeddings():
    """E[token] * sqrt(d_model) with repeated tokens and pad tokens; unused rows get zero."""
    tokens = np.array([[3, 5, 3, 0], [7, 0, 0, 0]])
    inputs = piece_params(PIECE, "src_embed")
    analytic = check_piece(lambda p: Embeddings(PIECE, p, "src_embed")(tokens),
                           lambda p, grads: backward.embeddings(Embeddings(PIECE, p, "src_embed"), "src_embed", tokens,
                                                                grads), inputs, ())
    unused = np.setdiff1d(np.arange(PIECE.src_vocab_size), tokens)
    assert (analytic["src_embed.weight"][unused] == 0).all()


@pytest.mark.parametrize("kind,layout", [("sinusoidal", "interleaved"), ("learned", "interleaved"),
                                         ("sinusoidal", "fairseq")])
def test_positional_encoding(kind, layout):
    """x + PE[rows]: dL/dx = dL/dout; a learned table's rows receive their positions' gradients; fairseq's rows
    follow the tokens (a padded row's positions skip its pads)."""
    config = PIECE.replace(positional_encoding=kind, sinusoidal_layout=layout)
    tokens = np.array([[5, 6, 7, 8, 9, 2], [0, 0, 5, 6, 2, 0]]) if layout == "fairseq" else None   # (B, T)
    inputs = {"x": random((2, 6, 8), 4), **piece_params(config, "tgt_pos_embed")}
    analytic = check_piece(lambda p: PositionalEncoding(config, p, "tgt_pos_embed", np.float64)(p["x"], 0, tokens),
                           lambda p, grads: backward.positional_encoding(
                               PositionalEncoding(config, p, "tgt_pos_embed", np.float64), "tgt_pos_embed",
                               kind == "learned", p["x"], tokens, grads), inputs, ("x",))
    assert set(analytic) == {"x"} | ({"tgt_pos_embed.weight"} if kind == "learned" else set())


@pytest.mark.parametrize("shared", [False, True], ids=["own_weight", "shared_embeddings"])
def test_generator(shared):
    """log_softmax(x W); tied, W is the shared embedding transposed and receives the transpose."""
    config = PIECE.replace(src_vocab_size=PIECE.tgt_vocab_size, share_embeddings=shared)
    name = "shared_embed" if shared else "generator"
    inputs = {"x": random((2, 5, 8), 5), **piece_params(config, name)}
    check_piece(lambda p: Generator(config, p, "generator")(p["x"]),
                lambda p, grads: backward.generator(Generator(config, p, "generator"), name, shared, p["x"], grads),
                inputs, ("x",))


@pytest.mark.parametrize("epsilon", [LABEL_SMOOTHING, 0.0])
def test_label_smoothed_cross_entropy(epsilon):
    """Section 5.4, mean over non-pad labels; pad positions get exactly zero gradient."""
    labels = np.array([[4, 2, 0, 0], [1, 0, 6, 3]])
    inputs = {"log_probs": random((2, 4, 7), 6)}
    value, pullback = backward.label_smoothed_cross_entropy(label_smoothed_cross_entropy, inputs["log_probs"], labels,
                                                            0, epsilon)
    assert value == float(label_smoothed_cross_entropy(inputs["log_probs"], labels, 0, epsilon))
    analytic = {"log_probs": pullback(1.0)}
    assert_matches_finite_differences(lambda p: float(label_smoothed_cross_entropy(p["log_probs"], labels, 0, epsilon)),
                                      inputs, analytic)
    assert (analytic["log_probs"][labels == 0] == 0).all()


# ----------------------------------------------------------------------------- the whole model

def small(config: TransformerConfig) -> TransformerConfig:
    """A FORWARD_VARIANTS config at the pieces' sizes, one layer per stack (finite differences cost
    four loss evaluations per entry)."""
    vocab = {"src_vocab_size": PIECE.tgt_vocab_size if config.share_embeddings else PIECE.src_vocab_size,
             "tgt_vocab_size": PIECE.tgt_vocab_size}
    return config.replace(d_model=PIECE.d_model, n_heads=PIECE.n_heads, d_ff=PIECE.d_ff, max_len=PIECE.max_len,
                          n_encoder_layers=1, n_decoder_layers=1, **vocab)


def batch(config: TransformerConfig) -> dict[str, np.ndarray]:
    """The suite's ragged training batch (padded targets and labels) with source row 1 all padding."""
    inputs = training_inputs(config)
    inputs["src"][1] = config.pad_id
    return inputs


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
def test_loss_and_gradients_match_finite_differences(variant):
    """Every entry of every checkpoint tensor against finite differences of ``training.loss``."""
    config = small(FORWARD_VARIANTS[variant])
    params, inputs = seeded_params(config), batch(config)
    value, grads = backward.loss_and_gradients(Transformer(config, params), label_smoothed_cross_entropy, **inputs,
                                               epsilon=LABEL_SMOOTHING)
    assert list(grads) == list(params)
    assert_matches_finite_differences(lambda p: float(loss(Transformer(config, p), **inputs)), params, grads,
                                      RELU_STEP)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
def test_loss_is_the_reference_loss(variant, dtype):
    """The loss is ``training.loss``'s, bit for bit; every checkpoint tensor has a finite gradient of
    its shape, in the model's dtype. (float32 values are not compared with float64 ones: the
    float32 policy's yardstick is the float32 reference's own error, and for gradients that is
    this code itself -- no independent float32 bound exists to test it against.)"""
    config = FORWARD_VARIANTS[variant]
    model, inputs = Transformer(config, seeded_params(config), dtype), batch(config)
    value, grads = backward.loss_and_gradients(model, label_smoothed_cross_entropy, **inputs, epsilon=LABEL_SMOOTHING)
    assert isinstance(value, float) and value == float(loss(model, **inputs))
    assert list(grads) == list(model.params)
    for name, grad in grads.items():
        assert grad.shape == model.params[name].shape and grad.dtype == dtype, name
        assert np.isfinite(grad).all(), name


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
def test_gradients_match_torch_autograd(variant):
    """The tiny configs (2 encoder and 3 decoder layers) against PyTorch's autograd in float64."""
    pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]'): no outside implementation")
    from equivalence.backends import torch as torch_backend

    config = FORWARD_VARIANTS[variant]
    params, inputs = seeded_params(config), batch(config)
    value, grads = backward.loss_and_gradients(Transformer(config, params), label_smoothed_cross_entropy, **inputs,
                                               epsilon=LABEL_SMOOTHING)
    torch_value, torch_grads = torch_backend.gradients(torch_backend.build(config, params, "float64", "cpu"), **inputs)
    assert abs(value - torch_value) <= tolerance.float64_bound(value)
    bound = tolerance.gradient_bound(grads, torch_grads)
    assert list(grads) == list(torch_grads)
    for name, grad in grads.items():
        error = tolerance.max_abs(grad, torch_grads[name])
        assert error <= bound, f"{name}: backward vs torch autograd differ by {error:.3e} > {bound:.3e}"


BAD_INPUTS = {
    "src float": {"src": np.ones((3, 7))},
    "batch sizes differ": {"tgt": np.ones((2, 6), dtype=np.int64)},
    "token out of range": {"tgt": np.full((3, 6), 99)},
    "too long": {"src": np.ones((3, 99), dtype=np.int64)},
    "labels all pad": {"labels": np.zeros((3, 6), dtype=np.int64)},
    "epsilon 1": {"epsilon": 1.0},
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_the_loss_errors(case):
    config = FORWARD_VARIANTS["tiny"]
    model = Transformer(config, seeded_params(config))
    arguments = {**training_inputs(config), "epsilon": LABEL_SMOOTHING, **BAD_INPUTS[case]}
    with pytest.raises(ValueError) as expected:
        loss(model, **arguments)
    with pytest.raises(ValueError) as got:
        backward.loss_and_gradients(model, label_smoothed_cross_entropy, **arguments)
    assert str(got.value) == str(expected.value)
