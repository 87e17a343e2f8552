"""``transformer_hf.importer``: a Hugging Face Marian (and M2M100/NLLB) model
directory, built by transformers from a tiny config with random weights and saved by ``save_pretrained``, against
transformers' own forward pass in float64.

* the log-probabilities of the imported checkpoint in the reference, and in every installed port loading the file,
  within the float64 policy (``equivalence.tolerance.float64_bound``: 1e-12 x max(1, max|ref|)) of transformers';
* the one place transformers computes in float32 in a float64 model: its sinusoid tables (Marian builds its table in
  float64 and stores it through ``torch.FloatTensor``; M2M100 computes its frequencies and angles in float32). The
  tables are checked against the reference's float64 table within their float32 rounding, derived below; then the
  float64 comparison runs with transformers' table buffers set to the reference's table, so that every other
  operation is held to 1e-12;
* the weights bit-identical to the file's (the table inverted rebuilds every tensor of the file), and the refusals
  (one line naming the field; ``transformer-reference import``'s, its outputs and inputs and ``compare`` on the
  imported file: tests/cli/test_families_commands.py).
"""

from __future__ import annotations

import fractions
import json

import numpy as np
import pytest
from support import (
    FAMILIES,
    HALVES_FAMILIES,
    LEARNED_FAMILIES,
    M2M100,
    MARIAN,
    build,
    exact_tables,
    hf_log_probs,
    masks,
    position_tables,
    reference_table,
)

from equivalence import backends, tolerance
from reference_numpy import Transformer
from reference_numpy.checkpoint import load_checkpoint
from transformer_hf.files import read_weights
from transformer_hf.importer import config_from_hf, import_hf, load_hf
from transformer_hf.registry import family as family_module

torch = pytest.importorskip("torch", reason="torch is not installed: transformers' models need it (pip install "
                                            "'.[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: the Hugging Face models "
                                                          "these tests import are built with it (pip install "
                                                          "transformers)")

def inputs(config, seed: int = 1):
    """A batch with a padded source row; the target starts with the family's decoder start token and is unpadded
    (transformers' decoder masks no target position by default: the reference gets the causal mask alone)."""
    rng = np.random.default_rng(seed)
    special = {config.pad_id, config.eos_id}
    words = np.array([i for i in range(config.src_vocab_size) if i not in special])
    src = rng.choice(words, size=(2, 7))
    src[1, 5:] = config.pad_id
    tgt = rng.choice(words, size=(2, 6))
    return src, tgt


def float32_table_bound(family: str, config, exact: np.ndarray) -> np.ndarray:
    """How far transformers' float32 sinusoid may be from the exact one (``exact``, transformers' layout), element
    by element. Marian: the float64 value rounded once to float32, half a float32 unit (2^-24 relative), plus the
    float64 table's own error. M2M100 (fairseq, ``get_embedding``): the exponent -i log(10000) / (h - 1) rounded to
    float32 (relative 2^-24), exp and the product with the position each rounded (2^-24 each, relative), so the
    angle p w is off by at most p w (|log w| + 3) 2^-24, which moves sin and cos as much; their own rounding adds
    2^-24 relative."""
    u = 2.0 ** -24
    if family in HALVES_FAMILIES:
        return u * np.abs(exact) + 1e-15
    half = config.d_model // 2
    w = np.exp(-np.arange(half) * np.log(10000.0) / (half - 1))
    positions = np.arange(len(exact))[:, None]                     # transformers' row p is position p
    angle_error = positions * w * (np.abs(np.log(w)) + 3) * u
    return np.concatenate([angle_error, angle_error], axis=1) + u * np.abs(exact) + 1e-15


def test_transformers_sinusoid_tables_are_the_references_in_float32(saved_family):
    """The layout (halves; fairseq's offset and frequencies) of transformers' table against the reference's float64
    table, within the float32 rounding transformers makes (the halves swapped, or the offset off by one, is off by
    O(1))."""
    family, model, _, out = saved_family
    if family in LEARNED_FAMILIES:
        pytest.skip(f"{family}'s positions are learned: read from the file as they are "
                    "(test_weights_are_the_files_bit_for_bit)")
    config, _ = load_checkpoint(out)
    for _, _, table in position_tables(family, model):
        exact, read = reference_table(family, config, len(table))
        error, bound = np.abs(table - exact)[read], float32_table_bound(family, config, exact)[read]
        assert np.all(error <= bound), np.max(error / bound)
        assert np.max(error) > 0, "transformers' table is float32: a float64 one would be exact"


@pytest.fixture(scope="module")
def float64_model(saved_family):
    family, model, _, out = saved_family
    config, _ = load_checkpoint(out)
    model = model.double()
    exact_tables(family, model, config)
    return model


def test_reference_matches_transformers_in_float64(saved_family, float64_model):
    family, _, _, out = saved_family
    config, params = load_checkpoint(out, dtype=np.float64)
    src, tgt = inputs(config)
    expected = hf_log_probs(float64_model, src, tgt, config.pad_id)
    got = Transformer(config, params)(src, tgt, *masks(config, src, tgt))
    error, bound = tolerance.max_abs(got, expected), tolerance.float64_bound(expected)
    print(f"{family}: reference vs transformers float64: max abs error {error:.3e} (bound {bound:.3e})")
    assert error <= bound


@pytest.mark.parametrize("port", backends.PORTS)
def test_every_port_loading_the_import_matches_transformers_in_float64(saved_family, float64_model, port):
    if not backends.installed(port):
        pytest.skip(f"{port} is not installed: {', '.join(backends.absent_frameworks(port))} missing")
    adapter, _ = backends.load((port,))
    family, _, _, out = saved_family
    config, _ = load_checkpoint(out)
    src, tgt = inputs(config, seed=2)
    expected = hf_log_probs(float64_model, src, tgt, config.pad_id)
    model = adapter[port].load(out, "float64")
    got = adapter[port].log_probs(model, src, tgt, *masks(config, src, tgt))
    error, bound = tolerance.max_abs(got, expected), tolerance.float64_bound(expected)
    print(f"{family}: {port} vs transformers float64: max abs error {error:.3e} (bound {bound:.3e})")
    assert error <= bound


def test_transformers_float32_run_is_within_the_float32_policy(saved_family):
    """transformers' own float32 model (its float32 sinusoid tables too) is held to the project's float32 policy
    against the reference in float64, as a port is: max|hf32 - ref64| <= 8 x max(max|ref32 - ref64|, ulp32), ref32
    the float32 reference on the same inputs (which rounds its table to float32 as well)."""
    family, _, directory, out = saved_family
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(directory).eval()
    assert next(model.parameters()).dtype == torch.float32
    config, params = load_checkpoint(out, dtype=np.float64)
    src, tgt = inputs(config, seed=4)
    hf32 = hf_log_probs(model, src, tgt, config.pad_id)
    ref64 = Transformer(config, params)(src, tgt, *masks(config, src, tgt))
    ref32 = Transformer(config, params, dtype=np.float32)(src, tgt, *masks(config, src, tgt))
    error, bound = tolerance.max_abs(hf32, ref64), tolerance.float32_bound(ref64, ref32)
    print(f"{family}: transformers float32 vs reference float64: max abs error {error:.3e} (bound {bound:.3e})")
    assert error <= bound


@pytest.mark.parametrize("port", backends.PORTS)
def test_every_port_builds_from_load_hf_as_from_the_file(saved_family, port):
    """The Python API without a file: a port's model from ``load_hf``'s arrays computes what the imported file's
    does, bit for bit (the same float32 weights, widened to float64)."""
    if not backends.installed(port):
        pytest.skip(f"{port} is not installed: {', '.join(backends.absent_frameworks(port))} missing")
    adapter = backends.load((port,))[0][port]
    _, _, directory, out = saved_family
    config, params = load_hf(directory)
    src, tgt = inputs(config, seed=3)
    from_file = adapter.log_probs(adapter.load(out, "float64"), src, tgt, *masks(config, src, tgt))
    from_arrays = adapter.log_probs(adapter.build(config, params, "float64"), src, tgt, *masks(config, src, tgt))
    assert np.array_equal(from_file, from_arrays)


def test_weights_are_the_files_bit_for_bit(saved_family):
    """The table inverted rebuilds every tensor of transformers' file from the checkpoint, bit for bit (the
    checkpoint keeps the file's float32), but the sinusoid tables a file may hold (Pegasus saves its own), which the
    reference computes (test_transformers_sinusoid_tables_are_the_references_in_float32)."""
    family, _, directory, out = saved_family
    config, params = load_checkpoint(out)
    file = read_weights(directory)
    assert all(value.dtype == np.float32 for value in params.values())
    rebuilt = {}
    for ours, entry in family_module(family).weight_table(config).items():
        value = params[ours].T if entry.transpose else params[ours]
        for name in entry.names:
            if name in file:
                rebuilt[name] = value.reshape(file[name].shape)
    assert set(rebuilt) == {name for name in file if not name.endswith(family_module(family).IGNORED)}
    for name, value in rebuilt.items():
        assert np.array_equal(value, file[name]), name
    # one tensor by hand: a cross-attention query projection, (out, in) in the file, (in, out) here
    assert np.array_equal(params["decoder.layers.1.cross_attn.q_proj.weight"],
                          file["model.decoder.layers.1.encoder_attn.q_proj.weight"].T)


def test_config_mapping():
    marian = config_from_hf({**MARIAN, "model_type": "marian"})
    assert (marian.norm_first, marian.sinusoidal_layout, marian.activation, marian.output_bias,
            marian.share_embeddings, marian.layer_norm_eps) == (False, "halves", "silu", True, True, 1e-5)
    assert (marian.pad_id, marian.eos_id, marian.bos_id, marian.max_len) == (28, 0, 1, 40)
    m2m = config_from_hf({**M2M100, "model_type": "m2m_100"})
    assert (m2m.norm_first, m2m.sinusoidal_layout, m2m.activation, m2m.output_bias,
            m2m.pad_id, m2m.bos_id, m2m.eos_id) == (True, "fairseq", "gelu", False, 1, 0, 2)


@pytest.mark.parametrize(("field", "value"), [("normalize_before", False), ("add_final_layer_norm", False),
                                              ("layernorm_embedding", True), ("activation_function", "swiglu")])
def test_an_m2m100_outside_the_space_is_refused_naming_the_field(field, value):
    """M2M100/NLLB are pre-LN with final norms: a config saying otherwise (BART's lineage) is another model."""
    with pytest.raises(ValueError, match=field) as caught:
        config_from_hf({**M2M100, "model_type": "m2m_100", field: value})
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("field", "value"), [("d_model", "16"), ("encoder_layers", 0), ("dropout", -0.1)])
def test_a_field_s_refusal_names_its_file_once(field, value):
    with pytest.raises(ValueError) as caught:
        config_from_hf({**MARIAN, "model_type": "marian", field: value})
    assert str(caught.value).startswith(f"config.json {field} ") and str(caught.value).count("config.json") == 1


def test_an_unknown_tensor_is_refused_naming_it(tmp_path):
    from safetensors.numpy import load_file, save_file
    model = build("marian")
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "model.encoder.layernorm_embedding.weight": np.ones(16, np.float32)},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.encoder.layernorm_embedding.weight'"):
        load_hf(tmp_path)


def test_separate_vocabularies_and_untied_projection(tmp_path):
    """Marian with share_encoder_decoder_embeddings false (two vocabularies) imports as separate embeddings, the
    decoder's tied projection read from the decoder's embedding; the forward pass still agrees in float64."""
    model = build("marian", seed=3, share_encoder_decoder_embeddings=False, decoder_vocab_size=33)
    model.save_pretrained(tmp_path / "model")
    import_hf(tmp_path / "model", tmp_path / "out.safetensors")
    config, params = load_checkpoint(tmp_path / "out.safetensors", dtype=np.float64)
    assert (config.share_embeddings, config.src_vocab_size, config.tgt_vocab_size) == (False, 29, 33)
    assert np.array_equal(params["generator.weight"], params["tgt_embed.weight"].T)
    model = model.double()
    exact_tables("marian", model, config)
    src, tgt = inputs(config)
    tgt = tgt % 27 + 1                       # a word of both vocabularies, not eos (0)
    expected = hf_log_probs(model, src, tgt, config.pad_id)
    got = Transformer(config, params)(src, tgt, *masks(config, src, tgt))
    assert tolerance.max_abs(got, expected) <= tolerance.float64_bound(expected)


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_untied_word_embeddings_are_three_matrices(family, tmp_path):
    """tie_word_embeddings false with one vocabulary: transformers 5 then ties nothing (``model.shared`` stays in the
    file, unread by its forward pass), so the encoder's and the decoder's ``embed_tokens`` and ``lm_head`` are three
    matrices: separate embeddings here, each read from its own tensor, and the forward pass agrees in float64."""
    model = build(family, seed=4, tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "model")
    hf = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    embeddings = ["model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "lm_head.weight"]
    assert all(not np.array_equal(hf[a], hf[b]) for i, a in enumerate(embeddings) for b in embeddings[i + 1:])
    config, params = load_hf(tmp_path / "model", dtype=np.float64)
    assert not config.share_embeddings and config.src_vocab_size == config.tgt_vocab_size
    for ours, theirs in (("src_embed.weight", hf[embeddings[1]]), ("tgt_embed.weight", hf[embeddings[2]]),
                         ("generator.weight", hf[embeddings[3]].T)):
        assert np.array_equal(params[ours], theirs), ours
    model = model.double()
    exact_tables(family, model, config)
    src, tgt = inputs(config)
    expected = hf_log_probs(model, src, tgt, config.pad_id)
    got = Transformer(config, params)(src, tgt, *masks(config, src, tgt))
    assert tolerance.max_abs(got, expected) <= tolerance.float64_bound(expected)


def test_a_pickle_is_read_by_torchs_weights_only_loader(saved_family, tmp_path):
    family, model, directory, out = saved_family
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    torch.save({name: torch.as_tensor(value) for name, value in read_weights(directory).items()},
               tmp_path / "pytorch_model.bin")
    config, params = load_hf(tmp_path)
    expected_config, expected = load_checkpoint(out)
    assert config == expected_config
    assert all(np.array_equal(params[name], expected[name]) for name in expected)


@pytest.mark.parametrize("content, reason", [
    ({"weight": torch.zeros(2), "ratio": fractions.Fraction(1, 3)},
     "it holds a Python object (fractions.Fraction) besides tensors, and unpickling one may run code"),
    (b"not a pickle", "it is not a pickle of tensors alone (")], ids=["object", "garbage"])
def test_a_pickle_the_weights_only_loader_refuses_is_one_line_naming_the_file(saved_family, tmp_path, content, reason):
    """A ``pytorch_model.bin`` holding a Python object besides tensors (which torch's weights-only loader will not
    construct), or not a pickle at all: one line naming the file and the reason, without torch's advice to load it
    anyway or its terminal codes."""
    _, _, directory, _ = saved_family
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    path = tmp_path / "pytorch_model.bin"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError) as info:
        load_hf(tmp_path)
    message = str(info.value)
    assert message.startswith(f"cannot read {str(path)!r}: {reason}"), message
    assert "\n" not in message and "\x1b" not in message and "weights_only=" not in message.split(": ", 1)[1]
    assert message.endswith("the import reads a pickle only with torch's weights-only loader (or give the model as "
                            "model.safetensors)")


def test_pickled_shards_are_read_as_transformers_reads_them(saved_family, tmp_path):
    """A directory as larger M2M100 and NLLB models come: ``pytorch_model.bin.index.json`` naming two pickled shards
    (transformers' own index format, which its ``from_pretrained`` loads here too: the outside check of the layout)
    imports as the whole file; an index naming a file outside the directory is refused naming the index."""
    family, _, directory, out = saved_family
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    state = {name: torch.as_tensor(value) for name, value in read_weights(directory).items()}
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, held in shards.items():
        torch.save({name: state[name] for name in held}, tmp_path / shard)
    index = {"metadata": {"total_size": sum(value.nbytes for value in state.values())},
             "weight_map": {name: shard for shard, held in shards.items() for name in held}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    config, params = load_hf(tmp_path)
    expected_config, expected = load_checkpoint(out)
    assert config == expected_config and params.keys() == expected.keys()
    assert all(np.array_equal(params[name], expected[name]) for name in expected)
    loaded = getattr(transformers, FAMILIES[family][1]).from_pretrained(tmp_path).state_dict()
    assert state.keys() <= loaded.keys(), state.keys() - loaded.keys()
    assert all(torch.equal(loaded[name], value) for name, value in state.items())
    index["weight_map"][names[0]] = "../elsewhere.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="pytorch_model.bin.index.json'?: weight_map must name shard files"):
        load_hf(tmp_path)


def test_bfloat16_and_float16_files_are_widened_exactly(saved_family, tmp_path):
    """A model saved in bfloat16 (NumPy has no such type: read from its bytes) or float16 imports as the float32
    numbers those formats hold: torch's own widening of the same tensors."""
    from safetensors.torch import save_file
    family, _, directory, _ = saved_family
    state = {name: torch.as_tensor(value) for name, value in read_weights(directory).items()}
    for dtype in (torch.bfloat16, torch.float16):
        (tmp_path / "config.json").write_text((directory / "config.json").read_text())
        save_file({name: value.to(dtype) for name, value in state.items()}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
        widened = read_weights(tmp_path)
        for name, value in state.items():
            assert widened[name].dtype == np.float32
            assert np.array_equal(widened[name], value.to(dtype).float().numpy()), (dtype, name)
        load_hf(tmp_path)


def test_a_sharded_directory_imports_as_the_whole_file(saved_family, tmp_path):
    family, _, directory, out = saved_family
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(directory)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    config, params = load_hf(tmp_path)
    expected_config, expected = load_checkpoint(out)
    assert config == expected_config and params.keys() == expected.keys()
    assert all(np.array_equal(params[name], expected[name]) for name in expected)

