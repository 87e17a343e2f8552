"""``transformer_hf.exporter`` (``transformer_export.export.export_hf``, what ``export --to hf`` runs): this
project's checkpoints as Hugging Face model directories, loaded and run by transformers itself (the outside
implementation).

* transformers' ``AutoModelForSeq2SeqLM`` loads every tensor of the export (none missing, none unexpected, the file
  what its own ``save_pretrained`` writes back) and reproduces the reference's float64 log-probabilities within
  1e-12 x max(1, max|ref|) -- its sinusoid buffers set to the reference's float64 table, as in
  tests/families/test_hf_import.py, which checks transformers' float32 tables against the reference's -- for the paper's
  model (post-LN, interleaved table: through the feature permutation of :mod:`transformer_hf.marian`), a
  Marian-style and an M2M100-style config; its own float32 run is within the float32 policy;
* ``import(export(x))``: the families' configs and tensors bit for bit; the paper's model as the Marian model whose
  features are reordered by the permutation this test derives from the two tables (not the module's), bit for bit;
* the shipped model (its LayerNorm epsilon set to Marian's 1e-5, a model of its own): ``AutoTokenizer`` gives the
  project's ids and text, and transformers' ``generate`` with the export's generation config writes exactly the
  reference's greedy tokens;
* (the refusals, one line naming the field, and the command's outputs and inputs:
  tests/cli/test_families_commands.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import EXPORTED, EXPORTED_FAMILY, build, exact_tables, hf_log_probs, masks, random_params, trained

from equivalence import tolerance
from reference_numpy import Transformer, TransformerConfig, greedy_decode
from reference_numpy.checkpoint import (
    load_checkpoint,
    load_tokenizer_json,
    save_checkpoint,
)
from reference_numpy.model import sinusoidal_positional_encoding
from reference_numpy.tokenizer import Tokenizer
from transformer_export.export import export_hf
from transformer_hf.files import read_weights
from transformer_hf.importer import import_hf
from transformer_tasks.translation import SHIPPED

torch = pytest.importorskip("torch", reason="torch is not installed: transformers' models need it (pip install "
                                            "'.[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: the exported directories "
                                                          "are loaded by it (pip install transformers)")

HF_CLASS = {"marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration",
            "pegasus": "PegasusForConditionalGeneration", "bart": "BartForConditionalGeneration",
            "mbart": "MBartForConditionalGeneration"}


@pytest.fixture(scope="module", params=list(EXPORTED))
def exported(request, tmp_path_factory):
    """(case, config, float32 params, the checkpoint, the directory its export wrote: ``export_hf``, what ``export
    --to hf`` runs)."""
    case, config = request.param, EXPORTED[request.param]
    params = random_params(config)
    root = tmp_path_factory.mktemp(case)
    save_checkpoint(root / "model.safetensors", config, params)
    export_hf(root / "model.safetensors", root / "hf")
    return case, config, params, root / "model.safetensors", root / "hf"


def inputs(config: TransformerConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A batch with a padded source row; the target starts with bos (the decoder start token of the export) and is
    unpadded (transformers masks no target position: the reference gets the causal mask alone)."""
    rng = np.random.default_rng(seed)
    words = np.array([i for i in range(min(config.src_vocab_size, config.tgt_vocab_size))
                      if i not in (config.pad_id, config.bos_id, config.eos_id)])
    src = rng.choice(words, size=(2, 7))
    src[1, 5:] = config.pad_id
    tgt = rng.choice(words, size=(2, 6))
    tgt[:, 0] = config.bos_id
    return src, tgt


def from_export(directory, dtype=None):
    model, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory, output_loading_info=True,
                                                                     **({"dtype": dtype} if dtype else {}))
    return model.eval(), info


def test_transformers_loads_every_tensor_of_the_export(exported, tmp_path):
    """The family's class, no tensor missing, unexpected or of another shape; what transformers' own
    ``save_pretrained`` writes back holds the same tensors, bit for bit."""
    case, _, _, _, directory = exported
    model, info = from_export(directory)
    assert type(model).__name__ == HF_CLASS[EXPORTED_FAMILY[case]]
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    model.save_pretrained(tmp_path)
    ours, theirs = read_weights(directory), read_weights(tmp_path)
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        assert np.array_equal(value, theirs[name]), name


@pytest.fixture(scope="module")
def float64_model(exported):
    """transformers' float64 model of the export, its sinusoid buffers the reference's float64 table."""
    case, config, _, _, directory = exported
    model, _ = from_export(directory, torch.float64)
    exact_tables(EXPORTED_FAMILY[case], model, config)
    return model


def test_transformers_reproduces_the_references_log_probs_in_float64(exported, float64_model):
    """The paper's model compared as it is (interleaved table, its own weights) with the Marian model of its export."""
    case, config, params, _, _ = exported
    src, tgt = inputs(config)
    expected = hf_log_probs(float64_model, src, tgt, config.pad_id)
    got = Transformer(config, {name: value.astype(np.float64) for name, value in params.items()})(
        src, tgt, *masks(config, src, tgt))
    error, bound = tolerance.max_abs(got, expected), tolerance.float64_bound(expected)
    print(f"{case}: reference vs transformers float64: max abs error {error:.3e} (bound {bound:.3e})")
    assert error <= bound


def test_transformers_float32_run_is_within_the_float32_policy(exported):
    """transformers' own float32 model, its own float32 sinusoid tables, against the float64 reference: within
    8 x max(max|ref32 - ref64|, ulp32), as a port is held."""
    case, config, params, _, directory = exported
    model, _ = from_export(directory)
    src, tgt = inputs(config, seed=2)
    hf32 = hf_log_probs(model, src, tgt, config.pad_id)
    wide = {name: value.astype(np.float64) for name, value in params.items()}
    ref64 = Transformer(config, wide)(src, tgt, *masks(config, src, tgt))
    ref32 = Transformer(config, params, dtype=np.float32)(src, tgt, *masks(config, src, tgt))
    error, bound = tolerance.max_abs(hf32, ref64), tolerance.float32_bound(ref64, ref32)
    print(f"{case}: transformers float32 vs reference float64: max abs error {error:.3e} (bound {bound:.3e})")
    assert error <= bound


def interleaved_to_halves(d_model: int, length: int = 40) -> np.ndarray:
    """The permutation sigma with halves[:, k] == interleaved[:, sigma[k]], found by comparing the two tables'
    columns (every column differs from every other over 40 positions)."""
    interleaved = sinusoidal_positional_encoding(length, d_model, layout="interleaved")
    halves = sinusoidal_positional_encoding(length, d_model, layout="halves")
    order = [[j for j in range(d_model) if np.array_equal(halves[:, k], interleaved[:, j])] for k in range(d_model)]
    assert all(len(found) == 1 for found in order)
    return np.array([found[0] for found in order])


@pytest.mark.parametrize("family", ["marian", "m2m_100"])
def test_an_imported_models_decoding_conventions_survive_export_and_import(family, tmp_path):
    """A transformers model's own generation settings (Marian: start from pad, pad never written, eos forced, the
    rest renormalized as opus-mt's files ask; M2M100: start from eos, early stopping, a token other than eos forced
    at the budget's end; a beam of 3 for both), imported, exported and imported again: the same config, the same
    tensors bit for bit, and the export's generation_config.json transformers' settings as they were (a repetition
    penalty of 1.2 among them)."""
    model = build(family, seed=3)
    model.generation_config.num_beams = 3
    if family == "marian":
        model.generation_config.renormalize_logits = True
        model.generation_config.min_length = 5
    else:
        model.generation_config.forced_eos_token_id = 4
        model.generation_config.min_new_tokens = 3
        model.generation_config.forced_bos_token_id = 6
    model.generation_config.no_repeat_ngram_size = 3
    model.generation_config.repetition_penalty = 1.2
    model.save_pretrained(tmp_path / "hf")
    first = import_hf(tmp_path / "hf", tmp_path / "first.safetensors")
    assert (first.decoding.min_output_length, first.decoding.no_repeat_ngram_size, first.decoding.forced_bos_id,
            first.decoding.repetition_penalty) == ((5, 3, None, 1.2) if family == "marian" else (4, 3, 6, 1.2))
    decoding = first.decoding
    assert decoding.length_normalization == "hf" and decoding.decoder_start_id is not None and decoding.beam_size == 3
    assert decoding.renormalize == (family == "marian")
    assert (first.decoding.forced_eos, first.forced_last_id) == ((True, 0) if family == "marian" else (True, 4))
    export_hf(tmp_path / "first.safetensors", tmp_path / "exported")
    assert import_hf(tmp_path / "exported", tmp_path / "second.safetensors") == first
    before, after = (load_checkpoint(tmp_path / name)[1] for name in ("first.safetensors", "second.safetensors"))
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    theirs, ours = (json.loads((tmp_path / where / "generation_config.json").read_text())
                    for where in ("hf", "exported"))
    unset = {"decoder_start_token_id": None, "bad_words_ids": None, "forced_eos_token_id": None,
             "early_stopping": False, "num_beams": 1, "renormalize_logits": False,   # GenerationConfig's defaults
             "no_repeat_ngram_size": 0, "forced_bos_token_id": None, "repetition_penalty": 1.0}
    for field, default in unset.items():
        assert ours.get(field, default) == theirs.get(field, default), field


# The residual-stream axis of each kind of tensor (stored (in, out)), written out here for the round trip's check
FEATURE_AXIS = {"embed.weight": 1, "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1,
                "o_proj.bias": 0, "linear1.weight": 0, "linear2.weight": 1, "linear2.bias": 0, "norm.weight": 0,
                "norm.bias": 0, "q_proj.bias": None, "k_proj.bias": None, "v_proj.bias": None, "linear1.bias": None}


def test_import_of_the_export_is_the_checkpoint(exported, tmp_path):
    """The families: the config and every tensor bit for bit. The paper's model, post-LN or pre-LN: the Marian (or
    Pegasus) model with the halves table and a zero logits bias, every tensor the checkpoint's with its residual
    features reordered by sigma, bit for bit."""
    case, config, params, _, directory = exported
    back = import_hf(directory, tmp_path / "back.safetensors")
    _, imported = load_checkpoint(tmp_path / "back.safetensors")
    # transformers' beam normalisation, and its one budget for every sentence: the paper's model's max_len (export)
    hf_decoding = config.with_decoding(length_normalization="hf",
                                       max_output_length=config.decoding.max_output_length or config.max_len)
    if config.positional_encoding != "sinusoidal" or config.sinusoidal_layout != "interleaved":
        assert back == hf_decoding
        assert imported.keys() == params.keys()
        assert all(imported[name].dtype == np.float32 and np.array_equal(imported[name], value)
                   for name, value in params.items())
        return
    assert back == hf_decoding.replace(sinusoidal_layout="halves", output_bias=True)
    assert not imported.pop("generator.bias").any()
    assert imported.keys() == params.keys()
    sigma = interleaved_to_halves(config.d_model)
    assert not np.array_equal(sigma, np.arange(config.d_model))
    for name, value in params.items():
        axis = next(axis for suffix, axis in FEATURE_AXIS.items() if name.endswith(suffix))
        expected = value if axis is None else np.take(value, sigma, axis=axis)
        assert np.array_equal(imported[name], expected), name


# ----------------------------------------------------------------------------- the shipped model

@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped model with Marian's LayerNorm epsilon (a model of its own: the reference runs it as well), its
    tokenizer, exported; (config, float64 params, tokenizer, held-out sources, the directory)."""
    config, params = load_checkpoint(SHIPPED)
    config = config.replace(layer_norm_eps=1e-5)
    root = tmp_path_factory.mktemp("shipped")
    text = load_tokenizer_json(SHIPPED)
    save_checkpoint(root / "model.safetensors", config, params, tokenizer=text)
    export_hf(root / "model.safetensors", root / "hf")
    _, _, _, held_out = trained()
    params64 = {name: value.astype(np.float64) for name, value in params.items()}
    return config, params64, Tokenizer.from_json(text, config), held_out["src"], root / "hf"


def test_autotokenizer_gives_the_projects_ids_and_text(shipped):
    config, _, tokenizer, src, directory = shipped
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (config.pad_id, config.bos_id, config.eos_id)
    texts = [tokenizer.decode(row) for row in src]
    batch = hf(texts, padding=True, return_tensors="np")
    assert np.array_equal(batch["input_ids"], tokenizer.batch(texts))                   # ids + [eos], padded
    assert np.array_equal(batch["attention_mask"], tokenizer.batch(texts) != config.pad_id)
    assert [hf.decode(row, skip_special_tokens=True) for row in src] == texts
    typed = hf("seventy-one </s> eighty")["input_ids"]                                   # a typed name is text
    assert typed.count(config.eos_id) == 1 and typed[-1] == config.eos_id


def test_generate_writes_the_references_greedy_tokens(shipped):
    """transformers' ``generate`` (float32, its cache, the export's generation config: start from bos, pad and bos
    suppressed) on the held-out sentences against the float64 reference's ``greedy_decode``."""
    config, params, tokenizer, src, directory = shipped
    model, _ = from_export(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    batch = hf([tokenizer.decode(row) for row in src], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch).numpy()
    assert (out[:, 0] == config.bos_id).all()
    expected = greedy_decode(Transformer(config, params), src)
    width = max(out.shape[1] - 1, expected.shape[1])
    pad = lambda rows: np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=config.pad_id)
    assert np.array_equal(pad(out[:, 1:]), pad(expected))
    assert [hf.decode(row, skip_special_tokens=True) for row in out] == [tokenizer.decode(row) for row in expected]


# ----------------------------------------------------------------------------- refusals, outputs, inputs
