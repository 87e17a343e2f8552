"""The commands on the Hugging Face families' models: ``import`` (its refusals, outputs and inputs), ``export --to
hf`` (a config no family expresses refused naming the field, a ``train`` run made for it, the tokenizer an imported
model carries written back), ``translate``, ``evaluate``, ``compare`` and ``plot attention`` on imported models
(their languages, their own beam, transformers' ``generate`` as the oracle), ``train``'s refusal of an imported
tokenizer, and ``compare`` on a checkpoint of the families' choices. The libraries under these commands are checked
in tests/families/."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from in_process import cli
from support import (
    EXPORTED,
    EXPORTED_FAMILY,
    PAPER,
    SOURCE,
    TARGET,
    TEXTS,
    backend,
    build,
    port_backend,
    random_params,
    random_texts,
)

pytest.importorskip("sentencepiece", reason="the tests train SentencePiece models: pip install sentencepiece")
transformers = pytest.importorskip("transformers", reason="the oracle is transformers (peers extra)")
torch = pytest.importorskip("torch", reason="transformers' tiny models are built with PyTorch")

from equivalence import backends  # noqa: E402
from equivalence.cases import FORWARD_VARIANTS  # noqa: E402
from equivalence.oracle import SENTENCES  # noqa: E402
from reference_numpy import init_params  # noqa: E402
from reference_numpy.checkpoint import (  # noqa: E402
    CheckpointReader,
    load_checkpoint,
    load_tokenizer_json,
    save_checkpoint,
)
from transformer_cli.main import EXIT_OK, EXIT_USAGE, main  # noqa: E402
from transformer_hf.importer import import_hf, load_hf  # noqa: E402
from transformer_hf.registry import TOKENIZER_KINDS, family_for  # noqa: E402
from transformer_hf.tokenizers import load_tokenizer  # noqa: E402
from transformer_tasks.translation import translator  # noqa: E402


@pytest.fixture(scope="module", params=list(EXPORTED))
def exported(request, tmp_path_factory) -> tuple:
    """(case, a checkpoint of EXPORTED's config with random weights)."""
    config, root = EXPORTED[request.param], tmp_path_factory.mktemp(request.param)
    save_checkpoint(root / "model.safetensors", config, random_params(config))
    return request.param, root / "model.safetensors"


# ----------------------------------------------------------------------------- import

# About 30 s: `compare` runs every installed backend on the imported model in float64 and float32 (JAX's and
# TensorFlow's programs compiled for its shapes, which no other test shares) and their greedy decoding.
def test_compare_on_the_import_exits_0(saved_family, capsys):
    _, _, _, out = saved_family
    status = main(["compare", str(out), "--backends", ",".join(b for b in backends.PORTS if backends.installed(b)),
                   "--threads", "1"])
    assert status == EXIT_OK, capsys.readouterr().out


IMPORT_REFUSED = [("activation_function", "gelu_new"), ("normalize_embedding", True), ("normalize_before", True),
                  ("layernorm_embedding", True), ("add_final_layer_norm", True),
                  ("position_embedding_type", "relative_key"), ("decoder_attention_heads", 2), ("decoder_ffn_dim", 32),
                  ("model_type", "t5"),
                  ("max_position_embeddings", 2 ** 17), ("d_model", 18), ("scale_embedding", "false"),
                  ("pad_token_id", None), ("encoder_layers", 0), ("dropout", "0.1"), ("eos_token_id", [0, 1])]


@pytest.mark.parametrize(("field", "value"), IMPORT_REFUSED)
def test_a_model_outside_the_space_is_refused_naming_the_field(tmp_path, capsys, field, value):
    model = build("marian")
    model.save_pretrained(tmp_path / "model")
    path = tmp_path / "model" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    capsys.readouterr()                                             # transformers' progress bar
    with pytest.raises(ValueError, match=field) as caught:
        load_hf(tmp_path / "model")
    assert "\n" not in str(caught.value)
    assert main(["import", str(tmp_path / "model"), str(tmp_path / "out.safetensors")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err
    assert not (tmp_path / "out.safetensors").exists()


def test_import_command_outputs_and_inputs(saved_family, tmp_path, capsys):
    _, _, directory, _ = saved_family
    out = tmp_path / "model.safetensors"
    assert main(["import", str(directory), str(out)]) == EXIT_OK
    line = capsys.readouterr().out
    assert line.startswith(f"wrote {out}: ") and line.endswith("; decoding as generate: greedy, at most 20 tokens a "
                                                                "sentence (docs/huggingface.md)\n"), line
    assert main(["import", str(directory), str(out)]) == EXIT_USAGE              # exists: kept without --force
    assert "--force" in capsys.readouterr().err
    assert main(["import", str(directory), str(out), "--force"]) == EXIT_OK
    capsys.readouterr()
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    before = (copy / "model.safetensors").read_bytes()
    assert main(["import", str(copy), str(copy / "model.safetensors"), "--force"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "replace the input" in err
    assert (copy / "model.safetensors").read_bytes() == before
    (tmp_path / "link.safetensors").symlink_to(copy / "model.safetensors")         # the input through a link
    assert main(["import", str(copy), str(tmp_path / "link.safetensors"), "--force"]) == EXIT_USAGE
    assert "replace the input" in capsys.readouterr().err
    assert (copy / "model.safetensors").read_bytes() == before
    assert main(["import", str(tmp_path / "absent"), str(tmp_path / "x.safetensors")]) == EXIT_USAGE
    capsys.readouterr()
    (tmp_path / "bare").mkdir()
    shutil.copy(directory / "config.json", tmp_path / "bare")                       # a config and no weights
    assert main(["import", str(tmp_path / "bare"), str(tmp_path / "x.safetensors")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no model.safetensors, model.safetensors.index.json, pytorch_model.bin " \
                                      "or pytorch_model.bin.index.json" in err


# ----------------------------------------------------------------------------- export --to hf

EXPORT_REFUSED = [("layer_norm_eps", PAPER.replace(layer_norm_eps=1e-6)),
                  ("positional_encoding", PAPER.replace(positional_encoding="learned")),
                  ("embedding_norm", PAPER.replace(embedding_norm=True)),
                  ("embedding_norm", EXPORTED["mbart"].replace(embedding_norm=False)),
                  ("position_offset", EXPORTED["mbart"].replace(position_offset=1)),
                  ("sinusoidal_layout", PAPER.replace(sinusoidal_layout="fairseq")),
                  ("output_bias", EXPORTED["m2m_100"].replace(output_bias=True)),
                  ("tgt_vocab_size", EXPORTED["m2m_100"].replace(share_embeddings=False, tgt_vocab_size=33))]


@pytest.mark.parametrize(("field", "config"), EXPORT_REFUSED,
                         ids=[f"{field}-{i}" for i, (field, _) in enumerate(EXPORT_REFUSED)])
def test_what_no_family_expresses_is_refused_naming_the_field(tmp_path, capsys, field, config):
    with pytest.raises(ValueError, match=field) as caught:
        family_for(config)
    assert "\n" not in str(caught.value)
    save_checkpoint(tmp_path / "model.safetensors", config, random_params(config))
    status, _, err = cli(capsys, "export", "--to", "hf", str(tmp_path / "model.safetensors"), str(tmp_path / "hf"))
    assert status == EXIT_USAGE and err.count("\n") == 1 and field in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]       # nothing written


def test_a_run_trained_with_the_families_layer_norm_epsilon_exports(tmp_path, monkeypatch, capsys):
    """``train``'s models have the presets' LayerNorm epsilon 1e-6, which no family expresses: the refusal names the
    flag that trains one with 1e-5, and a run trained with it exports (its checkpoint holds that epsilon)."""
    monkeypatch.chdir(tmp_path)
    run = ["train", "--steps", "1", "--eval-size", "0", "--backends", "numpy"]
    assert cli(capsys, *run, "--out", "paper.safetensors")[0] == EXIT_OK
    status, _, err = cli(capsys, "export", "--to", "hf", "paper.safetensors", "paper-hf")
    assert status == EXIT_USAGE and "layer_norm_eps 1e-06" in err and "train --layer-norm-eps 1e-05" in err
    assert cli(capsys, *run, "--layer-norm-eps", "1e-5", "--out", "hf.safetensors")[0] == EXIT_OK
    assert CheckpointReader("hf.safetensors").config.layer_norm_eps == 1e-5
    assert cli(capsys, "export", "--to", "hf", "hf.safetensors", "hf")[0] == EXIT_OK
    assert json.loads(Path("hf/config.json").read_text())["model_type"] == "marian"


def test_export_command_outputs_and_inputs(exported, tmp_path, capsys):
    """An existing directory is replaced only with --force (as every output of the command); never the
    checkpoint's own directory, even with --force; a checkpoint without a tokenizer exports the model alone, and
    says so."""
    case, checkpoint = exported
    out = tmp_path / "hf"
    status, printed, _ = cli(capsys, "export", "--to", "hf", str(checkpoint), str(out))
    assert status == EXIT_OK and "without a tokenizer" in printed
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json",
                                                           "model.safetensors"]
    (out / "config.json").write_text("{}")
    status, _, err = cli(capsys, "export", "--to", "hf", str(checkpoint), str(out))
    assert status == EXIT_USAGE and "--force" in err and err.count("\n") == 1
    assert (out / "config.json").read_text() == "{}"
    status, _, _ = cli(capsys, "export", "--to", "hf", str(checkpoint), str(out), "--force")
    assert status == EXIT_OK and json.loads((out / "config.json").read_text())["model_type"] == EXPORTED_FAMILY[case]
    before = checkpoint.read_bytes()
    status, _, err = cli(capsys, "export", "--to", "hf", str(checkpoint), str(checkpoint.parent), "--force")
    assert status == EXIT_USAGE and "replace the input" in err and err.count("\n") == 1
    assert checkpoint.read_bytes() == before


# ----------------------------------------------------------------------------- imported models' tokenizers

def test_a_separate_vocabularies_marian_model_translates_as_generate(separate_marian, capsys):
    """``translate --backend jax`` on the import: transformers' ``generate`` tokens, decoded to its text."""
    model, oracle = separate_marian["model"], separate_marian["oracle"]
    batch = oracle(SOURCE, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = oracle.batch_decode(model.generate(**batch), skip_special_tokens=True)
    assert len(set(expected)) > 1 and all(expected)                     # sentences translated apart, none empty
    assert main(["translate", "--checkpoint", str(separate_marian["checkpoint"]), "--backend", "jax", *SOURCE]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_compare_on_a_model_too_short_for_its_sentences_compares_its_id_batch(separate_marian, capsys):
    """compare's sentences, cut by this tokenizer's short pieces, are longer than the model's 64 positions: compare
    runs on its fixed batch of ids instead (as for a tokenizer that cannot encode them), and agrees."""
    tokenizer = load_tokenizer(separate_marian["checkpoint"])
    assert tokenizer.batch(list(SENTENCES)).shape[1] > load_checkpoint(separate_marian["checkpoint"])[0].max_len
    assert main(["compare", str(separate_marian["checkpoint"]), "--backends", "numpy"]) == 0
    assert "all backends agree" in capsys.readouterr().out


def test_the_export_of_a_separate_vocabularies_marian_model_holds_its_tokenizer(separate_marian, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = exported_tokenizer(separate_marian["checkpoint"], separate_marian["directory"], tmp_path, capsys)
    assert theirs.separate_vocabs and json.loads((tmp_path / "hf" / "target_vocab.json").read_text()) == \
        separate_marian["vocabs"][1]
    assert_same_ids(theirs, separate_marian["oracle"], TEXTS + SOURCE + TARGET + random_texts(11, 100))


def exported_tokenizer(checkpoint, directory, tmp_path, capsys, **languages):
    """``export --to hf`` of an imported checkpoint: transformers' AutoTokenizer of the export; the files the import
    kept are the directory's, byte for byte; and the export imports back to the same record."""
    out = tmp_path / "hf"
    assert main(["export", "--to", "hf", str(checkpoint), str(out)]) == 0
    assert "and its tokenizer (AutoTokenizer)" in capsys.readouterr().out
    record = json.loads(load_tokenizer_json(checkpoint))
    for name in TOKENIZER_KINDS[record["family"]].kept:
        assert (out / name).read_bytes() == (directory / name).read_bytes(), name
    import_hf(out, tmp_path / "again.safetensors")
    assert load_tokenizer_json(tmp_path / "again.safetensors") == load_tokenizer_json(checkpoint)
    return transformers.AutoTokenizer.from_pretrained(out, split_special_tokens=True, **languages)


def assert_same_ids(theirs, oracle, texts):
    for text in texts:
        assert theirs(text).input_ids == oracle(text).input_ids, text
        assert theirs(text_target=text).input_ids == oracle(text_target=text).input_ids, text


def test_the_export_of_an_imported_marian_model_holds_its_tokenizer(marian, tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # "Recommended: pip install sacremoses."
        theirs = exported_tokenizer(marian["checkpoint"], marian["directory"], tmp_path, capsys)
    assert type(theirs).__name__ == "MarianTokenizer"
    assert_same_ids(theirs, marian["oracle"], TEXTS + SOURCE + TARGET + random_texts(6, 100))


def test_the_export_of_an_imported_m2m100_model_holds_its_tokenizer(m2m100, tmp_path, capsys):
    theirs = exported_tokenizer(m2m100["checkpoint"], m2m100["directory"], tmp_path, capsys, src_lang="fr",
                                tgt_lang="de")
    assert type(theirs).__name__ == "M2M100Tokenizer"
    assert_same_ids(theirs, m2m100["oracle"]("fr", "de"), TEXTS + SOURCE + TARGET + random_texts(7, 100))


def test_the_export_of_an_imported_nllb_model_holds_its_tokenizer(nllb, tmp_path, capsys):
    theirs = exported_tokenizer(nllb["checkpoint"], nllb["checkpoint"].with_suffix(""), tmp_path, capsys,
                                src_lang="zul_Latn", tgt_lang="deu_Latn")
    assert_same_ids(theirs, nllb["oracle"]("zul_Latn", "deu_Latn"), TEXTS + SOURCE + TARGET + random_texts(8, 100))


def test_the_export_of_an_imported_mbart50_model_holds_its_tokenizer(mbart50, tmp_path, capsys):
    theirs = exported_tokenizer(mbart50["checkpoint"], mbart50["directory"], tmp_path, capsys, src_lang="ro_RO",
                                tgt_lang="de_DE")
    assert type(theirs).__name__ == "MBart50Tokenizer"
    assert_same_ids(theirs, mbart50["oracle"]("ro_RO", "de_DE"), TEXTS + SOURCE + TARGET + random_texts(9, 100))


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "tf"])
def test_an_mbart50_model_translates_into_its_target_language_as_generate(mbart50, name, capsys):
    """``translate --target-lang`` on an imported mBART-50 (mBART-50's published generation config: beam 5,
    max_length 200, early stopping) gives ``generate(forced_bos_token_id=<the language's id>)``'s tokens, token for
    token (the translator the command runs), and its text."""
    model, oracle = mbart50["model"].double(), mbart50["oracle"]("en_XX", "fr_XX")
    forced = oracle.convert_tokens_to_ids("fr_XX")
    batch = oracle(SOURCE, return_tensors="pt", padding=True)
    with torch.no_grad():
        tokens = model.generate(**batch, forced_bos_token_id=forced).numpy()[:, 1:]
    expected = oracle.batch_decode(tokens, skip_special_tokens=True)
    assert (tokens[:, 0] == forced).all() and len(set(expected)) > 1 and all(expected)
    checkpoint = str(mbart50["checkpoint"])
    run = translator(backend(name), checkpoint, "float64", source_lang="en_XX", target_lang="fr_XX")
    assert run.beam_size == 5
    for mine, theirs in zip(run.decode_all([run.encode(text) for text in SOURCE]), tokens, strict=True):
        theirs = theirs[theirs != 1]                                       # generate pads finished rows with pad
        assert list(np.asarray(mine)[:len(theirs)]) == list(theirs) and (np.asarray(mine)[len(theirs):] == 1).all()
    assert main(["translate", "--checkpoint", checkpoint, "--backend", name, "--dtype", "float64", "--source-lang",
                 "en_XX", "--target-lang", "fr_XX", *SOURCE]) == 0
    assert capsys.readouterr().out.splitlines() == expected


def test_the_export_of_an_imported_bart_model_holds_its_tokenizer(bart, tmp_path, capsys):
    theirs = exported_tokenizer(bart["checkpoint"], bart["directory"], tmp_path, capsys)
    assert type(theirs).__name__ == "RobertaTokenizer"                  # transformers 5's BartTokenizer
    assert_same_ids(theirs, bart["oracle"], TEXTS + SOURCE + TARGET + random_texts(14, 100))


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "tf"])
def test_a_bart_model_translates_as_generate(bart, name, capsys):
    """``translate`` on an imported BART with bart-large-cnn's generation config (beam 4, length penalty 2, at least
    56 tokens, no repeated trigram, <s> forced first) gives ``generate``'s tokens, token for token (the translator
    the command runs), and its text."""
    model, oracle = bart["model"].double(), bart["oracle"]
    batch = oracle(SOURCE, return_tensors="pt", padding=True)
    with torch.no_grad():
        tokens = model.generate(**batch).numpy()[:, 1:]
    expected = oracle.batch_decode(tokens, skip_special_tokens=True)
    assert (tokens[:, 0] == 0).all() and len(set(expected)) > 1 and all(expected)
    checkpoint = str(bart["checkpoint"])
    run = translator(backend(name), checkpoint, "float64")
    assert run.beam_size == 4
    for mine, theirs in zip(run.decode_all([run.encode(text) for text in SOURCE]), tokens, strict=True):
        theirs = theirs[theirs != 1]                                       # generate pads finished rows with pad
        assert list(np.asarray(mine)[:len(theirs)]) == list(theirs) and (np.asarray(mine)[len(theirs):] == 1).all()
    assert main(["translate", "--checkpoint", checkpoint, "--backend", name, "--dtype", "float64", *SOURCE]) == 0
    assert capsys.readouterr().out.split("\n") == [*expected, ""]      # random bytes: "\x1e" is no line's end


def test_marian_takes_no_language_and_the_projects_bpe_none(marian, capsys):
    with pytest.raises(ValueError, match="^--source-lang: this marian model takes no source language$"):
        load_tokenizer(marian["checkpoint"]).with_languages("en", None)
    assert main(["translate", "one", "--target-lang", "fr"]) == 2          # the shipped model: the project's BPE
    out, err = capsys.readouterr()
    assert out == "" and "--target-lang: this model's tokenizer (one shared BPE vocabulary) takes no language" in err


@pytest.fixture(scope="module")
def reference_tokens(marian) -> list[np.ndarray]:
    """The float64 reference's greedy tokens of SOURCE from the imported Marian checkpoint."""
    return translator(backend("numpy"), marian["checkpoint"], "float64").decode_all(
        [load_tokenizer(marian["checkpoint"]).source(text) for text in SOURCE])


@pytest.mark.parametrize("name", ["numpy", "torch", "jax", "tf"])
def test_translate_and_evaluate_run_an_imported_marian_model(marian, reference_tokens, name, capsys):
    translate = translator(backend(name), marian["checkpoint"], "float64")
    tokens = translate.decode_all([translate.encode(text) for text in SOURCE])
    assert all(np.array_equal(mine, theirs) for mine, theirs in zip(tokens, reference_tokens, strict=True))
    checkpoint = str(marian["checkpoint"])
    assert main(["translate", "--checkpoint", checkpoint, "--backend", name, "--dtype", "float64",
                 *SOURCE[:3]]) == 0
    assert capsys.readouterr().out.splitlines() == [translate.tokenizer.decode(ids) for ids in reference_tokens[:3]]
    source, target = marian["root"] / f"{name}.src", marian["root"] / f"{name}.ref"
    source.write_text("\n".join(SOURCE[:3]) + "\n", encoding="utf-8")
    target.write_text("\n".join(TARGET[:3]) + "\n", encoding="utf-8")
    assert main(["evaluate", checkpoint, "--source", str(source), "--reference", str(target), "--backend", name,
                 "--dtype", "float64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sentences"] == 3


def test_the_commands_search_with_an_imported_models_own_beam(marian, tmp_path, capsys):
    """A directory whose generation_config.json asks for num_beams 3: translate and evaluate without --beam search
    with a beam of 3 (the checkpoint's beam_size), as transformers' generate does; --beam 1 is greedy decoding."""
    directory = tmp_path / "beam-3"
    shutil.copytree(marian["directory"], directory)
    settings = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**settings, "num_beams": 3}))
    checkpoint = str(tmp_path / "beam-3.safetensors")
    assert import_hf(directory, checkpoint).decoding.beam_size == 3
    outputs = {}
    for beam in ([], ["--beam", "3"], ["--beam", "1"]):
        assert main(["translate", "--checkpoint", checkpoint, "--dtype", "float64", *beam, *SOURCE]) == 0
        outputs[tuple(beam)] = capsys.readouterr().out
    assert outputs[()] == outputs[("--beam", "3")] != outputs[("--beam", "1")]
    source, target = tmp_path / "test.src", tmp_path / "test.ref"
    source.write_text("\n".join(SOURCE) + "\n", encoding="utf-8")
    target.write_text("\n".join(TARGET) + "\n", encoding="utf-8")
    for beam, expected in (([], 3), (["--beam", "1"], 1)):
        assert main(["evaluate", checkpoint, "--source", str(source), "--reference", str(target), "--json",
                     *beam]) == 0
        assert json.loads(capsys.readouterr().out)["beam"] == expected


def test_translate_names_the_missing_language_of_an_imported_m2m100_model(m2m100, capsys):
    assert main(["translate", "--checkpoint", str(m2m100["checkpoint"]), "hello"]) == 2
    assert "--source-lang: this m2m_100 model needs the source language" in capsys.readouterr().err


def test_compare_translates_an_imported_m2m100_model_with_its_languages(m2m100, capsys):
    checkpoint = str(m2m100["checkpoint"])
    assert main(["compare", checkpoint, "--backends", "torch", "--dtype", "float64"]) == 0
    assert "translations" not in capsys.readouterr().out          # no languages: its sentences are not encoded
    assert main(["compare", checkpoint, "--backends", "torch", "--dtype", "float64", "--source-lang", "en",
                 "--target-lang", "fr"]) == 0
    assert "translations (greedy decoding" in capsys.readouterr().out
    assert main(["compare", "--preset", "tiny", "--source-lang", "en"]) == 2
    assert "--source-lang: the model has no tokenizer to encode sentences with" in capsys.readouterr().err


def test_train_refuses_to_resume_with_an_imported_tokenizer(marian, capsys, tmp_path):
    """A run's file holding a family's tokenizer (written through the library: train never writes one)."""
    from reference_numpy.checkpoint import TrainingState, load_checkpoint, save_checkpoint
    from reference_numpy.config import TrainingConfig
    config, params = load_checkpoint(marian["checkpoint"])
    zeros = {name: np.zeros_like(value) for name, value in params.items()}
    run = tmp_path / "run.safetensors"
    save_checkpoint(run, config, params, TrainingState(TrainingConfig(), 1, zeros, zeros),
                    load_tokenizer_json(marian["checkpoint"]))
    assert main(["train", "--task", "numbers", "--resume", str(run), "--steps", "1"]) == 2
    assert "holds an imported marian tokenizer; --task numbers trains with the project's own BPE" in \
        capsys.readouterr().err


def test_plot_attention_draws_an_imported_m2m100_sentence_with_its_languages(m2m100, tmp_path, capsys):
    """`plot attention --text` takes --source-lang/--target-lang as `translate` does: the source is transformers'
    encoding of the sentence (its language code first, labelled by the code), the target starts from the decoder start
    token (eos) and writes the target language's code first (M2M100's forced first token); without them, one error
    naming the flag."""
    from transformer_cli.commands.attention import attention_by_backend

    checkpoint, text = str(m2m100["checkpoint"]), "the cat"
    out = tmp_path / "attention.png"
    assert main(["plot", "attention", checkpoint, "--text", text, "--backends", "numpy", "--out", str(out)]) == 2
    assert "--source-lang: this m2m_100 model needs the source language" in capsys.readouterr().err
    assert main(["plot", "attention", checkpoint, "--text", text, "--backends", "numpy", "--out", str(out),
                 "--source-lang", "en", "--target-lang", "fr"]) == 0 and out.stat().st_size > 0
    _, written, sources, _ = attention_by_backend(checkpoint, None, 0, "decoder_cross", None, None, ("numpy",), text,
                                                  languages=("en", "fr"))
    oracle = m2m100["oracle"]("en", "fr")
    assert sources == ["en", *oracle.convert_ids_to_tokens(oracle(text).input_ids)[1:]]     # a code by its name
    assert oracle(text).input_ids[0] == oracle.get_lang_id("en") and written[0] == "fr"
    _, _, targets, _ = attention_by_backend(checkpoint, None, 0, "decoder_self", None, None, ("numpy",), text,
                                            languages=("en", "fr"))
    assert targets[:2] == ["</s>", "fr"]


# ----------------------------------------------------------------------------- the families' choices

def test_compare_on_a_checkpoint_with_the_choices(tmp_path, capsys):
    """``compare`` on a checkpoint of fairseq's lineage (pre-LN, GELU, fairseq's positions, unscaled embeddings, a
    logits bias): every stage of PyTorch within its bound, exit 0."""
    config = FORWARD_VARIANTS["fairseq"].replace(output_bias=True)
    path = tmp_path / "fairseq.safetensors"
    save_checkpoint(path, config, init_params(config, 0, perturb=0.1))
    port_backend("torch")
    status, out, err = cli(capsys, "compare", str(path), "--backends", "torch", "--threads", "1")
    assert status == 0, out + err
    assert "all backends agree with the reference" in out
