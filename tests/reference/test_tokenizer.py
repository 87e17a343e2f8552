"""The shared BPE tokenizer of section 5.1: its round trip, its special tokens at the config's ids, its refusals,
the standard-library validation of its JSON text, and its place in the checkpoint's metadata.

The round trip is checked against an independent normalisation (``unicodedata`` NFKC, ``str.lower``, ``str.split``),
not against :meth:`Tokenizer.normalize` alone. Tests that build a tokenizer need the ``tokenizers`` library (the
``text`` extra); the validation and checkpoint tests read the shipped model's JSON text with the standard library.
"""

from __future__ import annotations

import itertools
import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from reference_numpy import FORMAT_VERSION, TransformerConfig, init_params, load_checkpoint, save_checkpoint
from reference_numpy.checkpoint import load_tokenizer_json
from reference_numpy.tokenizer import (
    BOS,
    EOS,
    PAD,
    TOKENIZER_VERSION,
    UNK,
    Tokenizer,
    check_tokenizer_json,
    pad_rows,
    special_tokens,
)
from transformer_tasks.translation import SHIPPED, load_translator

TINY = TransformerConfig.preset("tiny")
SMALL = TINY.replace(src_vocab_size=64, tgt_vocab_size=64)            # room for the small tokenizer below
SHIPPED_SIZE = 384                                                     # the shipped model's vocabularies
# A few texts of both languages: the small tokenizer's whole training corpus
TEXTS = ["one hundred and two", "cent deux", "twenty-one", "vingt et un", "eighty", "quatre-vingts",
         "one thousand, seventy-one", "mille soixante et onze", "two hundred", "deux cents", "zero", "zéro"]
WHITESPACE = " \t\n\r\x0b\x0c\u00a0\u2003\u3000"                    # ASCII, and what NFKC turns into a space


def needs_library():
    pytest.importorskip("tokenizers", reason="the tokenizers library (the text extra) is not installed")


def independent_normalize(text: str) -> str:
    """NFKC, lower case, runs of white space to one space, trimmed: the documented normalisation."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


@pytest.fixture(scope="module")
def shipped_json() -> str:
    return load_tokenizer_json(SHIPPED)


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    needs_library()
    return load_translator()[2]


@pytest.fixture(scope="module")
def small() -> Tokenizer:
    needs_library()
    return Tokenizer.train(TEXTS, 64, SMALL)


def permuted(pad_id: int, bos_id: int, eos_id: int) -> TransformerConfig:
    return SMALL.replace(pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ----------------------------------------------------------------------------- round trip

def test_the_corpus_round_trips_in_both_languages(shipped):
    pytest.importorskip("num2words", reason="num2words (the text extra) is not installed")
    from transformer_tasks.numbers import english, french

    rng = np.random.Generator(np.random.PCG64(5))
    numbers = [*range(100), *rng.integers(100, 1_000_000, size=400)]
    texts = [text for n in numbers for text in (english(n), french(n))]
    for text in texts:
        assert independent_normalize(text) == text                     # the corpus is already normalised
        assert shipped.decode(shipped.encode(text)) == text
        messy = "\t " + "  \n".join(text.upper().split(" ")) + "\u3000"
        assert shipped.normalize(messy) == text
        assert shipped.decode(shipped.encode(messy)) == text, messy


def vocabulary_pieces(tokenizer: Tokenizer) -> list[str]:
    """Every non-special piece of the vocabulary without its word-start marker."""
    pieces = {piece.replace("\u2581", "") for piece in tokenizer.tokens(range(tokenizer.vocab_size))}
    return sorted(pieces - {PAD, BOS, EOS, UNK, ""})


@st.composite
def texts_of_the_alphabet(draw, pieces: list[str]) -> str:
    """Pieces of the vocabulary in any case (``é`` also decomposed), joined by any white space or none."""
    words = draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=12))
    out = draw(st.text(WHITESPACE, max_size=3))
    for word in words:
        if draw(st.booleans()):
            word = word.upper()
        if draw(st.booleans()):
            word = unicodedata.normalize("NFD", word)
        out += word + draw(st.text(WHITESPACE, max_size=3))
    return out


@pytest.mark.parametrize("which", ["shipped", "small"])
def test_any_text_of_the_alphabet_round_trips(which, request):
    tokenizer = request.getfixturevalue(which)

    @settings(max_examples=150, derandomize=True, deadline=None)
    @given(texts_of_the_alphabet(vocabulary_pieces(tokenizer)))
    def round_trip(text):
        expected = independent_normalize(text)
        assert tokenizer.normalize(text) == expected
        assert tokenizer.decode(tokenizer.encode(text)) == expected
        assert tokenizer.decode(tokenizer.batch([text])[0]) == expected

    round_trip()


# ----------------------------------------------------------------------------- special tokens, decode, batch

def test_the_shipped_specials_sit_at_the_configs_ids_and_unk_follows(shipped):
    config = shipped.config
    assert special_tokens(config) == {PAD: config.pad_id, BOS: config.bos_id, EOS: config.eos_id}
    assert shipped.tokens([config.pad_id, config.bos_id, config.eos_id, 3]) == [PAD, BOS, EOS, UNK]
    assert shipped.unk_id == 3


@pytest.mark.parametrize("ids", list(itertools.permutations(range(3))))
def test_trained_specials_sit_at_any_assignment_of_0_1_2(small, ids):
    config = permuted(*ids)
    tokenizer = Tokenizer.train(TEXTS, 64, config)
    by_id = {config.pad_id: PAD, config.bos_id: BOS, config.eos_id: EOS}
    assert tokenizer.tokens([0, 1, 2, 3]) == [by_id[0], by_id[1], by_id[2], UNK]
    assert tokenizer.unk_id == 3
    added = {token["content"]: token["id"] for token in json.loads(tokenizer.to_json())["added_tokens"]}
    assert added == {PAD: config.pad_id, BOS: config.bos_id, EOS: config.eos_id, UNK: 3}
    # the rest of the vocabulary does not depend on where the specials sit
    assert tokenizer.tokens(range(4, small.vocab_size)) == small.tokens(range(4, small.vocab_size))


@pytest.mark.parametrize("ids", [(5, 1, 2), (0, 1, 3), (3, 4, 5)])
def test_training_refuses_special_ids_other_than_0_1_2(ids):
    needs_library()
    message = one_line_error(Tokenizer.train, TEXTS, 64, permuted(*ids))
    assert message == (f"pad_id, bos_id and eos_id must be 0, 1 and 2 in some order to train a tokenizer, "
                       f"got {ids[0]}, {ids[1]}, {ids[2]}")


def test_training_refuses_a_vocabulary_larger_than_the_models():
    needs_library()
    message = one_line_error(Tokenizer.train, TEXTS, 64, SMALL.replace(tgt_vocab_size=30))
    assert message == "tokenizer ids run from 0 to 63; the model's vocabularies hold ids 0 to 29"


def test_training_is_deterministic(small):
    assert Tokenizer.train(TEXTS, 64, SMALL).to_json() == small.to_json()
    assert Tokenizer.train(iter(TEXTS), 64, SMALL).to_json() == small.to_json()          # any iterable


@pytest.mark.parametrize("ids", [(0, 1, 2), (2, 0, 1)])
def test_decode_stops_at_eos_and_skips_pad_and_bos(ids):
    needs_library()
    config = permuted(*ids)
    tokenizer = Tokenizer.train(TEXTS, 64, config)
    pad, bos, eos = config.pad_id, config.bos_id, config.eos_id
    first, second = tokenizer.encode("vingt et un"), tokenizer.encode("deux cents")
    assert tokenizer.decode([bos, *first, eos, *second, eos, pad]) == "vingt et un"
    assert tokenizer.decode(np.array([pad, bos, first[0], pad, *first[1:], pad, eos, *second])) == "vingt et un"
    assert tokenizer.decode([*first, pad, pad]) == "vingt et un"                # no eos: to the end
    assert tokenizer.decode([eos, *first]) == ""
    assert tokenizer.decode([]) == ""


@pytest.mark.parametrize("ids", [(0, 1, 2), (2, 0, 1)])
def test_batch_appends_eos_and_right_pads(ids):
    needs_library()
    config = permuted(*ids)
    tokenizer = Tokenizer.train(TEXTS, 64, config)
    texts = ["vingt et un", "eighty", "one thousand, seventy-one"]
    rows = [tokenizer.encode(text) for text in texts]
    batch = tokenizer.batch(texts)
    longest = max(map(len, rows)) + 1
    assert batch.shape == (3, longest) and batch.dtype == np.int64
    for row, ids_ in zip(batch, rows):
        assert row.tolist() == [*ids_, config.eos_id] + [config.pad_id] * (longest - len(ids_) - 1)
    assert pad_rows([[7], [7, 8, 9]], 5).tolist() == [[7, 5, 5], [7, 8, 9]]


# ----------------------------------------------------------------------------- what encode refuses

@pytest.mark.parametrize("text, problem", [
    ("", "is empty"),
    ("  \t\n \u3000", "is empty"),
    (b"vingt", "must be a string, got bytes"),
    (None, "must be a string, got NoneType"),
    (21, "must be a string, got int"),
    (["vingt"], "must be a string, got list"),
])
def test_encode_refuses_what_is_not_text(shipped, text, problem):
    assert one_line_error(shipped.encode, text, "source") == f"source {problem}"
    assert one_line_error(shipped.batch, ["un", text], "source") == f"source {problem}"


@pytest.mark.parametrize("text, unseen", [
    ("bonjour", "'b', 'j'"),
    ("  un   kilo", "'k'"),                                             # white space collapsed before the unknown
    ("vingt\t\tet\n bob", "'b'"),
    ("KILO", "'K'"),                                                    # named as written
    ("un\nbébé", "'b'"),
])
def test_encode_names_the_characters_it_has_never_seen(shipped, text, unseen):
    message = one_line_error(shipped.encode, text, "source")
    assert message == f"source {text!r} holds characters the tokenizer has never seen: {unseen}"
    assert one_line_error(shipped.encode, text).startswith(f"text {text!r} ")


# ----------------------------------------------------------------------------- check_tokenizer_json

def changed(text: str, change) -> str:
    data = json.loads(text)
    change(data)
    return json.dumps(data)


def swap_pad_and_bos(data) -> None:
    for token in data["added_tokens"]:
        token["id"] = {0: 1, 1: 0}.get(token["id"], token["id"])
    vocab = data["model"]["vocab"]
    vocab[PAD], vocab[BOS] = vocab[BOS], vocab[PAD]


def drop_eos(data) -> None:
    data["added_tokens"] = [token for token in data["added_tokens"] if token["content"] != EOS]
    del data["model"]["vocab"][EOS]


SHIPPED_CONFIG = TINY.replace(src_vocab_size=SHIPPED_SIZE, tgt_vocab_size=SHIPPED_SIZE)
BAD_TEXTS = [
    (lambda text: text[:-1], "tokenizer is not a tokenizers JSON text (JSONDecodeError: "),
    (lambda text: "[]", "tokenizer must be a JSON object, got []"),
    (lambda text: changed(text, lambda data: data.pop("model")), "tokenizer field 'model' is missing"),
    (lambda text: changed(text, lambda data: data.pop("added_tokens")), "tokenizer field 'added_tokens' is missing"),
    (lambda text: changed(text, lambda data: data["model"].pop("vocab")), "tokenizer field 'model.vocab' is missing"),
    (lambda text: changed(text, lambda data: data["model"].update(type="WordPiece")),
     "tokenizer model is 'WordPiece'; expected 'BPE'"),
    (lambda text: changed(text, swap_pad_and_bos), "tokenizer has '<pad>' at id 1; the config's id is 0"),
    (lambda text: changed(text, drop_eos), "tokenizer has '</s>' at id None; the config's id is 2"),
    (lambda text: changed(text, lambda data: data["model"]["vocab"].update(zz=-1)),
     "tokenizer ids run from -1 to 373; the model's vocabularies hold ids 0 to 383"),
]


@pytest.mark.parametrize("change, problem", BAD_TEXTS)
def test_check_refuses_a_bad_json_text(shipped_json, change, problem):
    assert problem in one_line_error(check_tokenizer_json, change(shipped_json), SHIPPED_CONFIG)


@pytest.mark.parametrize("changes, problem", [
    (dict(pad_id=1, bos_id=0), "tokenizer has '<pad>' at id 0; the config's id is 1"),
    (dict(eos_id=7), "tokenizer has '</s>' at id 2; the config's id is 7"),
    (dict(src_vocab_size=373), "tokenizer ids run from 0 to 373; the model's vocabularies hold ids 0 to 372"),
    (dict(tgt_vocab_size=300), "tokenizer ids run from 0 to 373; the model's vocabularies hold ids 0 to 299"),
])
def test_check_refuses_a_tokenizer_that_does_not_fit_the_config(shipped_json, changes, problem):
    assert one_line_error(check_tokenizer_json, shipped_json, SHIPPED_CONFIG.replace(**changes)) == problem


def test_check_accepts_the_shipped_tokenizer_down_to_its_own_size(shipped_json):
    ids = json.loads(shipped_json)["model"]["vocab"].values()
    assert max(ids) == 373 and sorted(ids) == list(range(374))          # the limits tested above are its edges
    check_tokenizer_json(shipped_json, SHIPPED_CONFIG)
    check_tokenizer_json(shipped_json, SHIPPED_CONFIG.replace(src_vocab_size=374, tgt_vocab_size=374))


# ----------------------------------------------------------------------------- in the checkpoint

def params_for(config: TransformerConfig) -> dict[str, np.ndarray]:
    return init_params(config, seed=4, dtype=np.float32, perturb=0.1)


def test_a_tokenizer_round_trips_through_the_checkpoint(tmp_path, shipped_json):
    params = params_for(SHIPPED_CONFIG)
    save_checkpoint(tmp_path / "m.safetensors", SHIPPED_CONFIG, params, tokenizer=shipped_json)
    assert load_tokenizer_json(tmp_path / "m.safetensors") == shipped_json
    config, loaded = load_checkpoint(tmp_path / "m.safetensors")
    assert config == SHIPPED_CONFIG and list(loaded) == list(params)
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
        assert loaded[name].dtype == value.dtype


def test_a_checkpoint_without_tokenizer_loads_and_has_none(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", TINY, params_for(TINY))
    assert load_tokenizer_json(tmp_path / "m.safetensors") is None
    assert load_checkpoint(tmp_path / "m.safetensors")[0] == TINY


def test_the_translator_of_a_checkpoint(tmp_path, shipped_json):
    save_checkpoint(tmp_path / "bare.safetensors", TINY, params_for(TINY))
    message = one_line_error(load_translator, tmp_path / "bare.safetensors")
    assert message.startswith(f"checkpoint {str(tmp_path / 'bare.safetensors')!r} has no tokenizer, ")
    needs_library()
    save_checkpoint(tmp_path / "m.safetensors", SHIPPED_CONFIG, params_for(SHIPPED_CONFIG), tokenizer=shipped_json)
    config, params, tokenizer = load_translator(tmp_path / "m.safetensors")
    assert config == SHIPPED_CONFIG and tokenizer.config == config and tokenizer.to_json() == shipped_json
    assert params["src_embed.weight"].dtype == np.float64


def write(tmp_path: Path, config: TransformerConfig, **metadata) -> Path:
    path = tmp_path / "bad.safetensors"
    save_file(params_for(config), str(path),
              metadata={"format_version": FORMAT_VERSION, "config": config.to_json(), **metadata})
    return path


@pytest.mark.parametrize("config, metadata, problem", [
    (SHIPPED_CONFIG, dict(tokenizer_version="2"), "unknown tokenizer_version '2' (this library reads version 1)"),
    (SHIPPED_CONFIG, dict(tokenizer_version=None), "unknown tokenizer_version None (this library reads version 1)"),
    (SHIPPED_CONFIG.replace(pad_id=2, eos_id=0), {}, "tokenizer has '<pad>' at id 0; the config's id is 2"),
    (SHIPPED_CONFIG.replace(src_vocab_size=200), {},
     "tokenizer ids run from 0 to 373; the model's vocabularies hold ids 0 to 199"),
    (SHIPPED_CONFIG, dict(tokenizer="{}"), "tokenizer field 'model' is missing"),
])
def test_a_file_with_a_bad_tokenizer_is_refused_by_every_load(tmp_path, shipped_json, config, metadata, problem):
    record = {"tokenizer": shipped_json, "tokenizer_version": TOKENIZER_VERSION, **metadata}
    path = write(tmp_path, config, **{key: value for key, value in record.items() if value is not None})
    expected = f"checkpoint {str(path)!r}: {problem}"
    assert one_line_error(load_checkpoint, path) == expected
    assert one_line_error(load_tokenizer_json, path) == expected
    assert one_line_error(load_translator, path) == expected


@pytest.mark.parametrize("config, tokenizer, problem", [
    (SHIPPED_CONFIG.replace(tgt_vocab_size=100), None, "the model's vocabularies hold ids 0 to 99"),
    (SHIPPED_CONFIG.replace(bos_id=2, eos_id=1), None, "tokenizer has '<s>' at id 1; the config's id is 2"),
    (SHIPPED_CONFIG, "not json", "tokenizer is not a tokenizers JSON text"),
])
def test_save_refuses_a_tokenizer_that_does_not_fit_and_writes_nothing(tmp_path, shipped_json, config, tokenizer,
                                                                       problem):
    assert problem in one_line_error(save_checkpoint, tmp_path / "new.safetensors", config, params_for(config),
                                     tokenizer=shipped_json if tokenizer is None else tokenizer)
    assert list(tmp_path.iterdir()) == []                                # no file, no partial file
    save_checkpoint(tmp_path / "old.safetensors", TINY, params_for(TINY))
    before = (tmp_path / "old.safetensors").read_bytes()
    with pytest.raises(ValueError, match=re.escape(problem)):
        save_checkpoint(tmp_path / "old.safetensors", config, params_for(config),
                        tokenizer=shipped_json if tokenizer is None else tokenizer)
    assert (tmp_path / "old.safetensors").read_bytes() == before         # the user's file is kept
    assert [p.name for p in tmp_path.iterdir()] == ["old.safetensors"]


def test_an_empty_batch_and_json_the_library_cannot_build_are_refused_by_name(shipped):
    with pytest.raises(ValueError, match="^source holds no sentence$"):
        shipped.batch([], "source")
    data = json.loads(shipped.to_json())
    data["normalizer"] = {"type": "NoSuchNormalizer"}
    with pytest.raises(ValueError, match="^tokenizer is not a tokenizers JSON text"):
        Tokenizer.from_json(json.dumps(data), shipped.config)
