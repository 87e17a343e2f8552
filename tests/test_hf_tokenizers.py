"""The Hugging Face families' tokenizers carried in the checkpoint (transformer_hf/tokenizers.py), proven against
transformers' own tokenizer classes (the outside implementation): tiny SentencePiece models trained here on a few
sentences, saved into tiny random Marian and M2M100 directories with the tokenizer classes' save_pretrained,
imported, and compared id for id on many texts (unicode, empty, white space, characters the models never saw)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import warnings

import numpy as np
import pytest
from support import SOURCE, TARGET, backend, save_tiny_m2m100, tiny_separate_marian, train_spm

pytest.importorskip("sentencepiece", reason="the tests train SentencePiece models: pip install sentencepiece")
transformers = pytest.importorskip("transformers", reason="the oracle is transformers' tokenizers (peers extra)")
torch = pytest.importorskip("torch", reason="transformers' tiny models are built with PyTorch")

from equivalence.oracle import SENTENCES  # noqa: E402
from reference_numpy.checkpoint import load_checkpoint, load_tokenizer_json, save_checkpoint  # noqa: E402
from transformer_cli.main import main  # noqa: E402
from transformer_export.export import export_hf  # noqa: E402
from transformer_hf.importer import import_hf  # noqa: E402
from transformer_hf.registry import TOKENIZER_KINDS  # noqa: E402
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer, read_hf_tokenizer  # noqa: E402
from transformer_tasks.translation import translator  # noqa: E402

TEXTS = ["the cat", "Hello   World!", "", "   ", "\t\n", "Жук ел", "naïve façade", "a\tb\nc", "ｆｕｌｌ ｗｉｄｔｈ",
         " leading", "trailing  ", "12 345 67", "l'été à Noël", "ça va ?", "x</s>y", "<unk> <pad>", "日本語", "🙂 ok"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz  ,.?'çéÜ12Ж\t日"


def random_texts(seed: int, count: int = 200) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(30))) for _ in range(count)]


@pytest.fixture(scope="module", params=[False, True], ids=["nllb", "nllb-legacy"])
def nllb(request, tmp_path_factory) -> dict:
    """A tiny NLLB directory: NllbTokenizer (its tokenizer.json: a BPE model from a SentencePiece model trained
    here, <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces, the 200+ codes eng_Latn... after them) saved with
    save_pretrained (``legacy_behaviour`` as the parameter), with a tiny random M2M100 model."""
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    root = tmp_path_factory.mktemp("nllb")
    found = SentencePieceExtractor(str(train_spm(SOURCE * 3 + TARGET * 3, root / "m", "bpe", 120))).extract(None)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece in found["vocab"]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = transformers.NllbTokenizer(vocab=vocab, merges=found["merges"], legacy_behaviour=request.param,
                                           _spm_precompiled_charsmap=found["_spm_precompiled_charsmap"])
    directory, out = save_tiny_m2m100(root / "tiny-nllb", tokenizer, len(tokenizer))

    def oracle(src_lang: str, tgt_lang: str):
        return transformers.AutoTokenizer.from_pretrained(directory, src_lang=src_lang, tgt_lang=tgt_lang,
                                                          split_special_tokens=True)
    return {"checkpoint": out, "oracle": oracle, "size": len(vocab)}


# ----------------------------------------------------------------------------- ids and text against transformers

def test_marian_source_and_target_ids_equal_transformers(marian):
    mine, oracle = load_tokenizer(marian["checkpoint"]), marian["oracle"]
    assert isinstance(mine, FamilyTokenizer) and mine.family == "marian"
    for text in TEXTS + SOURCE + TARGET + random_texts(0):
        assert mine.ids(text) == oracle(text).input_ids, text
        assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text


def test_marian_decode_equals_transformers(marian):
    mine, oracle = load_tokenizer(marian["checkpoint"]), marian["oracle"]
    rng, eos = random.Random(1), marian["vocab"]["</s>"]
    for _ in range(300):
        ids = [rng.randrange(1, len(marian["vocab"])) for _ in range(rng.randrange(12))]   # eos ends our decode
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
        assert mine.decode([*ids, eos, *ids]) == oracle.decode(ids, skip_special_tokens=True)
    for text in TARGET + TEXTS:
        assert mine.decode(mine.ids(text, "target")) == oracle.decode(oracle(text_target=text).input_ids,
                                                                      skip_special_tokens=True)


@pytest.fixture(scope="module")
def separate_marian(tmp_path_factory) -> dict:
    """A tiny random Marian model with separate source and target vocabularies, imported
    (support.tiny_separate_marian)."""
    return tiny_separate_marian(tmp_path_factory.mktemp("separate-marian"))


def test_marian_separate_vocabularies_ids_and_decode_equal_transformers(separate_marian):
    """``separate_vocabs``: the source side's ids by vocab.json, the target side's by target_vocab.json (of another
    size), and the target ids decoded by it with the target model's decoder, as transformers does."""
    mine, oracle = load_tokenizer(separate_marian["checkpoint"]), separate_marian["oracle"]
    source, target = separate_marian["vocabs"]
    assert mine.record["target_vocab"] == target and mine.record["vocab"] == source and len(source) != len(target)
    for text in TEXTS + SOURCE + TARGET + random_texts(10):
        assert mine.ids(text) == oracle(text).input_ids, text
        assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
    assert any(mine.ids(text) != mine.ids(text, "target") for text in TARGET)        # the two sides differ
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(1, len(target)) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
    assert mine.tokens([5, 6], "source") == [next(p for p, i in source.items() if i == k) for k in (5, 6)]
    assert mine.tokens([5, 6]) == [next(p for p, i in target.items() if i == k) for k in (5, 6)]


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


def test_m2m100_ids_with_the_language_codes_equal_transformers(m2m100):
    tokenizer = load_tokenizer(m2m100["checkpoint"])
    for source, target in (("en", "fr"), ("fr", "de"), ("zu", "af")):
        mine, oracle = tokenizer.with_languages(source, target), m2m100["oracle"](source, target)
        for text in TEXTS + SOURCE + TARGET + random_texts(2, 100):
            assert mine.ids(text) == oracle(text).input_ids, text
            assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
        assert mine.forced_bos_id == oracle.get_lang_id(target)


def test_m2m100_decode_equals_transformers_and_drops_the_language_codes(m2m100):
    mine, oracle = load_tokenizer(m2m100["checkpoint"]).with_languages("en", "fr"), m2m100["oracle"]("en", "fr")
    rng, size, french = random.Random(3), len(m2m100["vocab"]), oracle.get_lang_id("fr")
    for _ in range(300):
        ids = [rng.randrange(3, size) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
        # transformers 5.23 writes a language code into the text ("__fr__ ..."); here it is dropped
        assert mine.decode([french, *ids]) == oracle.decode(ids, skip_special_tokens=True)


def test_nllb_ids_and_decode_equal_transformers(nllb):
    tokenizer = load_tokenizer(nllb["checkpoint"])
    assert tokenizer.family == "nllb"
    for source, target in (("eng_Latn", "fra_Latn"), ("zul_Latn", "deu_Latn")):
        mine, oracle = tokenizer.with_languages(source, target), nllb["oracle"](source, target)
        for text in TEXTS + SOURCE + TARGET + random_texts(4, 100):
            assert mine.ids(text) == oracle(text).input_ids, text
            assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
        assert mine.forced_bos_id == oracle.convert_tokens_to_ids(target)
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.randrange(3, nllb["size"]) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
        assert mine.decode([mine.forced_bos_id, *ids]) == oracle.decode([mine.forced_bos_id, *ids],
                                                                        skip_special_tokens=True)


# ----------------------------------------------------------------------------- export --to hf writes it back

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


def test_a_record_without_its_files_or_with_others_is_refused_naming_the_field(marian, tmp_path):
    """A record of an import before the files were kept loads and translates, and its export names what to do; a
    record keeping a file its family does not have, or a file that is not base64, is refused on load."""
    config, params = load_checkpoint(marian["checkpoint"])
    record = json.loads(load_tokenizer_json(marian["checkpoint"]))
    older = {name: value for name, value in record.items() if name != "files"}
    save_checkpoint(tmp_path / "older.safetensors", config, params, tokenizer=json.dumps(older))
    assert load_tokenizer(tmp_path / "older.safetensors").ids("the cat") == marian["oracle"]("the cat").input_ids
    with pytest.raises(ValueError, match="^tokenizer field 'files' is missing: the marian tokenizer was imported "
                                         "without its files"):
        export_hf(tmp_path / "older.safetensors", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    for files, message in (({**record["files"], "../config.json": ""}, "'files' holds '../config.json'; a marian "
                                                                       "tokenizer keeps tokenizer_config.json, "
                                                                       "source.spm, target.spm"),
                           ({**record["files"], "source.spm": "not base64!"}, "'files.source.spm' is not base64")):
        with pytest.raises(ValueError, match=re.escape(f"tokenizer field {message}")):
            FamilyTokenizer.from_json(json.dumps({**record, "files": files}), config)


# ----------------------------------------------------------------------------- languages: the flags' errors

def test_a_model_that_needs_a_language_and_gets_none_names_the_flag(m2m100):
    tokenizer = load_tokenizer(m2m100["checkpoint"])
    with pytest.raises(ValueError, match=r"^--source-lang: this m2m_100 model needs the source language \(one of af"):
        tokenizer.with_languages(None, "fr")
    with pytest.raises(ValueError, match=r"^--target-lang: this m2m_100 model needs the target language"):
        tokenizer.with_languages("en", None)
    with pytest.raises(ValueError, match=r"^--target-lang: 'xx' is not a language of this model \(known: af, am, "
                                         r"ar, ast, az, ba, be, bg, \.\.\. \(100 in all\)\)$"):
        tokenizer.with_languages("en", "xx")


def test_marian_takes_no_language_and_the_projects_bpe_none(marian, capsys):
    with pytest.raises(ValueError, match="^--source-lang: this marian model takes no source language$"):
        load_tokenizer(marian["checkpoint"]).with_languages("en", None)
    assert main(["translate", "one", "--target-lang", "fr"]) == 2          # the shipped model: the project's BPE
    out, err = capsys.readouterr()
    assert out == "" and "--target-lang: this model's tokenizer (one shared BPE vocabulary) takes no language" in err


# ----------------------------------------------------------------------------- the checkpoint and the commands

def test_the_record_is_data_and_round_trips(marian):
    text = load_tokenizer_json(marian["checkpoint"])
    record = json.loads(text)
    assert record["family"] == "marian" and record["vocab"] == marian["vocab"]
    assert json.loads(record["source"])["model"]["type"] == "Unigram"
    assert FamilyTokenizer.from_json(text, load_tokenizer(marian["checkpoint"]).config).to_json() == text


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


def test_a_directory_without_a_tokenizer_imports_the_weights_alone(marian, tmp_path):
    directory = tmp_path / "weights-only"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((marian["directory"] / name).read_bytes())
    import_hf(directory, tmp_path / "w.safetensors")
    assert load_tokenizer(tmp_path / "w.safetensors") is None


def test_import_never_writes_over_a_tokenizer_file(marian):
    vocab = marian["directory"] / "vocab.json"
    before = vocab.read_bytes()
    with pytest.raises(ValueError, match="would replace the input"):
        import_hf(marian["directory"], vocab, force=True)
    assert vocab.read_bytes() == before


def test_ids_are_checked_against_the_model(marian):
    record = json.loads(load_tokenizer_json(marian["checkpoint"]))
    config = load_tokenizer(marian["checkpoint"]).config
    record["vocab"]["far"] = config.src_vocab_size
    with pytest.raises(ValueError, match="^tokenizer ids run from 0 to"):
        FamilyTokenizer.from_json(json.dumps(record), config)
    assert np.all(load_tokenizer(marian["checkpoint"]).batch(["the cat", "a"]) >= 0)


def test_compare_translates_an_imported_m2m100_model_with_its_languages(m2m100, capsys):
    checkpoint = str(m2m100["checkpoint"])
    assert main(["compare", checkpoint, "--backends", "torch", "--dtype", "float64"]) == 0
    assert "translations" not in capsys.readouterr().out          # no languages: its sentences are not encoded
    assert main(["compare", checkpoint, "--backends", "torch", "--dtype", "float64", "--source-lang", "en",
                 "--target-lang", "fr"]) == 0
    assert "translations (greedy decoding" in capsys.readouterr().out
    assert main(["compare", "--preset", "tiny", "--source-lang", "en"]) == 2
    assert "--source-lang: the model has no tokenizer to encode sentences with" in capsys.readouterr().err


def test_a_multilingual_marian_model_takes_the_target_language_as_its_first_source_token(marian, tmp_path):
    """opus-mt-en-ROMANCE's convention: codes >>fr<< in the vocabulary; the code starts the source text, which
    MarianTokenizer keeps whole (remove_language_code); here --target-lang fr puts it there."""
    vocab = {**marian["vocab"], ">>fr<<": len(marian["vocab"]), ">>de<<": len(marian["vocab"]) + 1}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.MarianTokenizer(str(marian["directory"] / "source.spm"), str(marian["directory"] / "target.spm"),
                                     str(tmp_path / "vocab.json")).save_pretrained(tmp_path / "multi")
        oracle = transformers.MarianTokenizer.from_pretrained(tmp_path / "multi", split_special_tokens=True)
    config = dataclasses.replace(load_tokenizer(marian["checkpoint"]).config, src_vocab_size=len(vocab),
                                 tgt_vocab_size=len(vocab))
    tokenizer = FamilyTokenizer.from_json(read_hf_tokenizer(tmp_path / "multi", config), config)
    assert tokenizer.languages == ["de", "fr"]                     # sorted, as the record stores them
    with pytest.raises(ValueError, match=r"^--target-lang: this marian model needs the target language \(one of "
                                         r"de, fr\)$"):
        tokenizer.with_languages(None, None)
    french = tokenizer.with_languages(None, "fr")
    for text in TEXTS + SOURCE:
        assert french.ids(text) == oracle(f">>fr<< {text}").input_ids, text
        assert french.ids(f">>de<<{text}")[1:] == oracle(f">>de<<{text}").input_ids, text
    assert french.forced_bos_id is None and french.decode(french.ids("the cat")) == "the cat"


def test_the_ctranslate2_export_names_an_imported_models_tokens_by_its_pieces(marian):
    from transformer_export.ctranslate2 import token_names
    config = load_tokenizer(marian["checkpoint"]).config
    names = token_names(config, config.tgt_vocab_size, load_tokenizer_json(marian["checkpoint"]))
    assert names == sorted(marian["vocab"], key=marian["vocab"].__getitem__)


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
