"""Every combination of the embedding choices (``TransformerConfig.share_embeddings``, ``scale_embeddings``,
``output_bias``), each checked on its own:

* the structure of the embedding matrices -- ``shared``: one matrix for the source, the target and the output
  projection (section 3.4); ``separate``: a source and a target embedding, the output projection the target's
  (a file's tied ``lm_head``); ``untied``: three matrices -- times the scale sqrt(d_model) on or off, times a bias
  on the logits on or off: twelve combinations;
* by hand, in every backend: the "src_embed" and "tgt_embed" stages of a ragged batch are E[token] x sqrt(d_model)
  (or x 1) plus the sinusoid of section 3.5, written here from its formula, and the log-probabilities are
  log_softmax(x W + b) of the decoder's output, W the shared matrix transposed or the projection's own (float64
  policy: 1e-12 relative to scale);
* against transformers, which ships each combination but one in its Marian and M2M100 families: a tiny random model
  of exactly that combination, saved with ``save_pretrained`` and imported, gives the reference's log-probabilities
  in float64 (1e-12 relative to scale). Marian always has its ``final_logits_bias`` and is the only family with
  separate source and target embeddings, so the combination "separate, no bias" is Marian with that bias zero (the
  logits x W + 0 are those of a projection without one), imported as a config without the bias.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from support import backend, build, exact_tables, hf_log_probs, masks

from equivalence import cases, tolerance
from reference_numpy import Transformer, TransformerConfig
from transformer_hf.importer import load_hf

STRUCTURES = ("shared", "separate", "untied")
COMBINATIONS = [pytest.param(structure, scale, bias, id=f"{structure}-{'scaled' if scale else 'unscaled'}-"
                             f"{'bias' if bias else 'no_bias'}")
                for structure, scale, bias in itertools.product(STRUCTURES, (True, False), (True, False))]
BACKENDS = ("numpy", "torch", "jax", "tf")


def combination(structure: str, scale: bool, bias: bool) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """The tiny preset with this combination, and seeded float64 weights (the bias perturbed away from zero; with
    ``separate``, the projection the target embedding transposed, as a tied file holds it)."""
    tiny = TransformerConfig.preset("tiny").replace(dropout=0.0)
    sizes = {"src_vocab_size": tiny.tgt_vocab_size} if structure == "shared" else {}
    config = tiny.replace(share_embeddings=structure == "shared", scale_embeddings=scale, output_bias=bias, **sizes)
    params = cases.seeded_params(config)
    if structure == "separate":
        params["generator.weight"] = params["tgt_embed.weight"].T.copy()
    return config, params


def sinusoid(length: int, d_model: int) -> np.ndarray:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i / d_model)), PE(pos, 2i + 1) = cos(the same), by a loop."""
    table = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(0, d_model, 2):
            angle = pos / 10000 ** (i / d_model)
            table[pos, i], table[pos, i + 1] = math.sin(angle), math.cos(angle)
    return table


def embedded(matrix: np.ndarray, tokens: np.ndarray, scale: bool) -> np.ndarray:
    """Each token's row of ``matrix``, times sqrt(d_model) if ``scale``, plus the sinusoid of its position."""
    d_model = matrix.shape[1]
    return matrix[tokens] * (math.sqrt(d_model) if scale else 1.0) + sinusoid(tokens.shape[1], d_model)


def log_softmax_of_logits(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """log p = l - log sum exp l, l = x W (+ b), summed with math.fsum entry by entry."""
    logits = np.einsum("btd,dv->btv", x, weight) + (0.0 if bias is None else bias)
    out = np.empty_like(logits)
    for index in np.ndindex(logits.shape[:2]):
        row = logits[index]
        top = row.max()
        out[index] = row - top - math.log(math.fsum(math.exp(value - top) for value in row))
    return out


def matrices(config: TransformerConfig, params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The source embedding, the target embedding and the output projection W (D, V) the config names."""
    if config.share_embeddings:
        shared = params["shared_embed.weight"]
        return shared, shared, shared.T
    return params["src_embed.weight"], params["tgt_embed.weight"], params["generator.weight"]


def assert_float64(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    error, bound = tolerance.max_abs(actual, expected), tolerance.float64_bound(expected)
    assert error <= bound, f"{what}: max abs error {error:.3e} > bound {bound:.3e} (float64 policy)"


# ----------------------------------------------------------------------------- by hand, every backend

@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("structure, scale, bias", COMBINATIONS)
def test_both_embeddings_and_the_projection_by_hand(structure, scale, bias, name):
    """The source's and the target's embedding stage and the log-probabilities of a ragged batch, in float64,
    against their definitions computed here from the config's matrices."""
    config, params = combination(structure, scale, bias)
    inputs = cases.model_inputs(config, "ragged_batch")
    src, tgt = inputs["src"], inputs["tgt"]
    adapter = backend(name)
    stages = adapter.forward(adapter.build(config, params, "float64", "cpu"), src, tgt)
    source, target, projection = matrices(config, params)
    assert_float64(stages["src_embed"], embedded(source, src, scale), "the source's embedding stage")
    assert_float64(stages["tgt_embed"], embedded(target, tgt, scale), "the target's embedding stage")
    expected = log_softmax_of_logits(stages["decoder"], projection, params["generator.bias"] if bias else None)
    assert_float64(stages["log_probs"], expected, "the log-probabilities of the decoder's output")


# ----------------------------------------------------------------------------- against transformers

def transformers_model(structure: str, scale: bool, bias: bool):
    """A tiny random transformers model of the combination, and whether its logits bias is to be zero (Marian's
    ``final_logits_bias``, for a separate structure without a bias: no family ships it)."""
    separate = dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=33)     # two vocabularies
    family, changes = {
        ("shared", True): ("marian", {}),
        ("shared", False): ("m2m_100", {}),
        ("separate", True): ("marian", separate),
        ("separate", False): ("marian", separate),
        ("untied", True): ("marian", {**separate, "tie_word_embeddings": False}),
        ("untied", False): ("m2m_100", {"tie_word_embeddings": False}),
    }[structure, bias]
    model = build(family, seed=7, scale_embedding=scale, **changes)
    return family, model, family == "marian" and not bias


def imported(family: str, model, zero_bias: bool, directory) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """The model saved by ``save_pretrained`` and imported in float64 (with ``zero_bias``, its zero logits bias
    imported as no bias at all)."""
    import torch

    if zero_bias:
        with torch.no_grad():
            model.final_logits_bias.zero_()
    model.save_pretrained(directory)
    config, params = load_hf(directory, dtype=np.float64)
    if zero_bias:
        assert not params["generator.bias"].any()
        config, params = config.replace(output_bias=False), {k: v for k, v in params.items() if k != "generator.bias"}
    return config, params


@pytest.mark.parametrize("structure, scale, bias", COMBINATIONS)
def test_the_combination_against_transformers(structure, scale, bias, tmp_path):
    """transformers' float64 log-probabilities of a model with exactly this combination (the config the import
    reads says so, and the matrices are one, two tied or three) are the reference's, within the float64 policy."""
    pytest.importorskip("transformers", reason="transformers is not installed (the outside implementation)")
    family, model, zero_bias = transformers_model(structure, scale, bias)
    config, params = imported(family, model, zero_bias, tmp_path / "model")
    assert (config.share_embeddings, config.scale_embeddings, config.output_bias) == (structure == "shared", scale,
                                                                                      bias)
    if structure != "shared":
        tied = np.array_equal(params["generator.weight"], params["tgt_embed.weight"].T)
        assert tied == (structure == "separate") and not np.array_equal(params["src_embed.weight"][:20],
                                                                        params["tgt_embed.weight"][:20])
    rng = np.random.default_rng(5)
    words = lambda vocab: np.array([i for i in range(vocab) if i not in (config.pad_id, config.eos_id)])
    src, tgt = rng.choice(words(config.src_vocab_size), (2, 7)), rng.choice(words(config.tgt_vocab_size), (2, 6))
    src[1, 5:] = config.pad_id                      # a padded source row; the target unpadded (transformers' default)
    model = model.double()
    exact_tables(family, model, config)
    expected = hf_log_probs(model, src, tgt, config.pad_id)
    assert_float64(Transformer(config, params)(src, tgt, *masks(config, src, tgt)), expected,
                   f"{family} ({structure}, scale {scale}, bias {bias}) against transformers")
