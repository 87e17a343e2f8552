"""Each family's published generation config against transformers' own ``generate``: a tiny random model of the
family (``support.build``, every parameter random, then made to end at varied lengths), its ``generation_config.json``
holding the fields the published model's file holds (the sizes shrunk: the models' widths, never a decoding field),
saved with ``save_pretrained`` and imported; the reference and every port, loading the checkpoint in float64 and given
no decoding argument but the beam the checkpoint names, decode the tokens ``generate`` decodes from that file alone --
beam search with the file's beam, length penalty, early stopping, minimum length, n-gram blocking and forced tokens,
and greedy decoding (``num_beams`` 1) with the same conventions.

transformers is the outside implementation; it ranks its candidates in float32 even in a float64 model, so tokens
are compared, not scores (a near-tie would fail the test and be traced, not loosened)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from support import FRAMEWORKS, MBART50_GENERATION, build, float64_inference, port_backend

from transformer_hf.importer import import_hf, load_hf

torch = pytest.importorskip("torch", reason="torch is not installed: transformers' models need it (pip install "
                                            "'.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed: the models these tests decode with are "
                                           "built with it")

# The generation fields of the published models' files (generation_config.json, or config.json where the file
# predates it), by family: google/pegasus-xsum's, facebook/bart-large-cnn's, facebook/mbart-large-50-many-to-many-mmt's
# (its target language is forced per call: tests/cli/test_families_commands.py)
PUBLISHED = {
    "pegasus": {"num_beams": 8, "length_penalty": 0.6, "max_length": 64, "decoder_start_token_id": 0,
                "pad_token_id": 0, "eos_token_id": 1, "forced_eos_token_id": 1},
    "bart": {"num_beams": 4, "length_penalty": 2.0, "max_length": 142, "min_length": 56, "no_repeat_ngram_size": 3,
             "early_stopping": True, "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2,
             "decoder_start_token_id": 2, "forced_bos_token_id": 0, "forced_eos_token_id": 2},
    "mbart": MBART50_GENERATION,
}
# The models' positions cover the published budgets (max_length counts the start token)
POSITIONS = {"pegasus": 72, "bart": 150, "mbart": 208}
SEED = 5


def natural(model, seed: int):
    """The random model made to end at varied lengths: LayerNorm gains 1 + N(0, 0.01) and biases N(0, 0.01), other
    biases shrunk, and the eos logit raised through ``final_logits_bias`` (every family here has one)."""
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "layer_norm" in name or "layernorm" in name:
                noise = 0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
                tensor.copy_((1.0 if name.endswith("weight") else 0.0) + noise)
            elif name.endswith("bias"):
                tensor.mul_(0.2)
        model.final_logits_bias[0, model.config.eos_token_id] += 2.0
    return model


@pytest.fixture(scope="module", params=list(PUBLISHED))
def published(request, tmp_path_factory):
    """(family, transformers' float64 model with the published generation config, the imported checkpoint, its
    config, the sources, generate's beam and greedy tokens)."""
    family = request.param
    model = natural(build(family, seed=SEED, max_position_embeddings=POSITIONS[family]).double(), SEED)
    model.generation_config = importlib.import_module("transformers").GenerationConfig(**PUBLISHED[family])
    directory = tmp_path_factory.mktemp(family)
    model.save_pretrained(directory)
    out = directory.parent / f"{family}-published.safetensors"
    import_hf(directory, out)
    config, _ = load_hf(directory)
    src = sources(config)
    expected = {beam: generated(model, src, config.pad_id, beam) for beam in (1, config.decoding.beam_size)}
    return family, model, out, config, src, expected


def sources(config) -> np.ndarray:
    """Four sentences of 9, 6, 3 and 7 tokens ending with eos, padded (no special token among the words)."""
    rng = np.random.default_rng(4)
    special = {config.pad_id, config.eos_id, config.bos_id}
    words = np.array([i for i in range(config.src_vocab_size) if i not in special])
    src = rng.choice(words, size=(4, 9))
    for row, length in enumerate((9, 6, 3, 7)):
        src[row, length - 1] = config.eos_id
        src[row, length:] = config.pad_id
    return src


def generated(model, src, pad_id: int, beams: int) -> np.ndarray:
    """transformers' tokens from the model's own generation config (``num_beams`` alone given), without the start
    token."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(src != pad_id).long(),
                             num_beams=beams)
    return out.numpy()[:, 1:]


def same_tokens(mine, theirs, pad_id: int) -> None:
    mine, theirs = np.asarray(mine), np.asarray(theirs)
    width = max(mine.shape[1], theirs.shape[1])
    pad = [np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=pad_id) for tokens in (mine, theirs)]
    np.testing.assert_array_equal(*pad)


def test_the_import_reads_the_published_fields(published):
    family, _, _, config, _, expected = published
    fields = PUBLISHED[family]
    decoding = config.decoding
    assert (decoding.beam_size, decoding.length_penalty, decoding.max_output_length, config.start_id) == (
        fields["num_beams"], fields.get("length_penalty", 1.0), fields["max_length"] - 1,
        fields["decoder_start_token_id"])
    assert (decoding.min_output_length, decoding.no_repeat_ngram_size, decoding.forced_bos_id) == (
        fields.get("min_length", 0), fields.get("no_repeat_ngram_size", 0), fields.get("forced_bos_token_id"))
    beam = expected[decoding.beam_size]
    ended = [(row == config.eos_id).any() for row in beam]
    assert any(ended), "some hypothesis ends with eos before the budget"
    assert not np.array_equal(beam, expected[1][:, :beam.shape[1]]) or beam.shape != expected[1].shape


@pytest.mark.parametrize("port", ["numpy", *FRAMEWORKS])
def test_every_backend_decodes_the_published_config_as_generate(published, port):
    family, _, out, config, src, expected = published
    backend = importlib.import_module("equivalence.backends.numpy") if port == "numpy" else port_backend(port)
    with float64_inference(port):
        model = backend.load(out, "float64")
        same_tokens(backend.greedy(model, src), expected[1], config.pad_id)
        same_tokens(backend.beam(model, src, config.decoding.beam_size)[0], expected[config.decoding.beam_size],
                    config.pad_id)
