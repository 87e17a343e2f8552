"""The Hugging Face families' tokenizers carried in the checkpoint (transformer_hf/tokenizers.py), proven against
transformers' own tokenizer classes (the outside implementation): tiny SentencePiece models trained here on a few
sentences, saved into tiny random Marian and M2M100 directories with the tokenizer classes' save_pretrained,
imported, and compared id for id on many texts (unicode, empty, white space, characters the models never saw)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import warnings

import numpy as np
import pytest
from support import SOURCE, TARGET, TEXTS, random_texts

pytest.importorskip("sentencepiece", reason="the tests train SentencePiece models: pip install sentencepiece")
transformers = pytest.importorskip("transformers", reason="the oracle is transformers' tokenizers (peers extra)")
torch = pytest.importorskip("torch", reason="transformers' tiny models are built with PyTorch")

from reference_numpy.checkpoint import load_checkpoint, load_tokenizer_json, save_checkpoint  # noqa: E402
from transformer_export.export import export_hf  # noqa: E402
from transformer_hf.importer import import_hf  # noqa: E402
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer, read_hf_tokenizer  # noqa: E402

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


def test_mbart50_ids_and_decode_equal_transformers(mbart50):
    """mBART-50's [src_code] X </s> and [tgt_code] X </s>, its forced target code, and decoding that skips every
    special token (the codes, <mask>) as transformers' decode(skip_special_tokens=True) does."""
    tokenizer = load_tokenizer(mbart50["checkpoint"])
    assert isinstance(tokenizer, FamilyTokenizer) and tokenizer.family == "mbart50"
    assert len(tokenizer.languages) == 52
    for source, target in (("en_XX", "fr_XX"), ("ro_RO", "zh_CN")):
        mine, oracle = tokenizer.with_languages(source, target), mbart50["oracle"](source, target)
        for text in TEXTS + SOURCE + TARGET + random_texts(10, 100):
            assert mine.ids(text) == oracle(text).input_ids, text
            assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
        assert mine.forced_bos_id == oracle.convert_tokens_to_ids(target)
    rng = random.Random(11)
    for _ in range(300):
        ids = [rng.randrange(3, mbart50["size"]) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
        assert mine.decode([mine.forced_bos_id, *ids]) == oracle.decode([mine.forced_bos_id, *ids],
                                                                        skip_special_tokens=True)


def test_bart_ids_and_decode_equal_transformers(bart):
    """BART's byte-level BPE: <s> X </s> on both sides, every text's bytes pieces of the vocabulary (nothing unknown);
    decoding skips every special token and joins the pieces' bytes, as transformers' decode(skip_special_tokens=True)
    does (a byte sequence that is no UTF-8 text replaced alike)."""
    mine, oracle = load_tokenizer(bart["checkpoint"]), bart["oracle"]
    assert isinstance(mine, FamilyTokenizer) and mine.family == "bart" and mine.record["prefix_ids"] == [0]
    for text in TEXTS + SOURCE + TARGET + random_texts(12, 100):
        assert mine.ids(text) == oracle(text).input_ids, text
        assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
    rng = random.Random(13)
    for _ in range(300):
        ids = [rng.randrange(3, bart["size"]) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
    for text in TARGET + TEXTS:
        ids = oracle(text_target=text).input_ids
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True) == text, text


def test_pegasus_ids_and_decode_equal_transformers(pegasus):
    """Pegasus's Unigram pieces then </s>, on both sides; decoding skips every special token (<mask_1>, the
    <unk_k> block) as transformers' decode(skip_special_tokens=True) does."""
    mine, oracle = load_tokenizer(pegasus["checkpoint"]), pegasus["oracle"]
    assert isinstance(mine, FamilyTokenizer) and mine.family == "pegasus"
    for text in TEXTS + SOURCE + TARGET + random_texts(6, 100):
        assert mine.ids(text) == oracle(text).input_ids, text
        assert mine.ids(text, "target") == oracle(text_target=text).input_ids, text
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(2, pegasus["size"]) for _ in range(rng.randrange(12))]
        assert mine.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
    for text in TARGET + TEXTS:
        ids = mine.ids(text, "target")
        if mine.config.eos_id in ids[:-1]:
            # Pegasus's Unigram vocabulary holds "</s>" as a piece, which a typed "</s>" matches (in transformers
            # too: the ids above are equal); decoding stops at the first eos, as a decoded output ends there
            assert text == "x</s>y" and mine.decode(ids) == "x"
            continue
        assert mine.decode(ids) == oracle.decode(oracle(text_target=text).input_ids, skip_special_tokens=True)


def test_pegasus_tokenizer_exports_back_as_transformers_reads_it(pegasus, tmp_path):
    """``export --to hf`` writes the record's tokenizer.json and the kept tokenizer_config.json; transformers'
    AutoTokenizer loads them and gives the original directory's ids and text."""
    export_hf(pegasus["checkpoint"], tmp_path / "hf")
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", split_special_tokens=True)
    oracle = pegasus["oracle"]
    assert type(again) is type(oracle)
    for text in TEXTS + SOURCE + TARGET:
        assert again(text).input_ids == oracle(text).input_ids, text
        ids = oracle(text).input_ids
        assert again.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- export --to hf writes it back

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


# ----------------------------------------------------------------------------- the checkpoint and the commands

def test_the_record_is_data_and_round_trips(marian):
    text = load_tokenizer_json(marian["checkpoint"])
    record = json.loads(text)
    assert record["family"] == "marian" and record["vocab"] == marian["vocab"]
    assert json.loads(record["source"])["model"]["type"] == "Unigram"
    assert FamilyTokenizer.from_json(text, load_tokenizer(marian["checkpoint"]).config).to_json() == text


def test_a_directory_without_a_tokenizer_imports_the_weights_alone(marian, tmp_path):
    directory = tmp_path / "weights-only"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((marian["directory"] / name).read_bytes())
    import_hf(directory, tmp_path / "w.safetensors")
    assert load_tokenizer(tmp_path / "w.safetensors") is None


def test_a_tokenizer_class_of_no_kind_is_refused_by_name(mbart50, tmp_path):
    """mBART-cc25's MBartTokenizer puts the language code after eos and is not mBART-50's: its directory holds a
    tokenizer.json as NLLB's and mBART-50's do, and the class it names is refused, not read as either."""
    directory = tmp_path / "mbart-cc25"
    directory.mkdir()
    for path in mbart50["directory"].iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "MBartTokenizer"}))
    with pytest.raises(ValueError, match=r"tokenizer_class 'MBartTokenizer' is not a supported tokenizer "
                                         r"\(supported: .*MBart50Tokenizer"):
        import_hf(directory, tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()


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

