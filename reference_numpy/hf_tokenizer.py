"""The tokenizers of the Hugging Face families (Marian, M2M100, NLLB), carried in the checkpoint as data.

A family's tokenizer is a record (JSON text in the checkpoint's ``tokenizer`` metadata, ``tokenizer_version`` "2";
:data:`RECORD` lists its fields): the SentencePiece model(s) converted by transformers' own converter
(``transformers.convert_slow_tokenizer``) to Hugging Face ``tokenizers`` JSON texts that cut a text into pieces,
the model's vocabulary (piece -> id, the family's ``vocab.json`` or the ``tokenizer.json``'s own), the language
codes (code -> id) and where they go; and the directory's own tokenizer files that those fields do not hold as they
are (``tokenizer_config.json``, the SentencePiece model files: :data:`KEPT_FILES`), byte for byte, which only
``export --to hf`` reads, to write the directory's tokenizer back (:func:`hf_tokenizer_files`). Nothing in it is
code; ``tokenizers`` alone runs it (no sentencepiece at run time). The rules are transformers 5.23's
(``models/marian/tokenization_marian.py``, ``models/m2m_100/tokenization_m2m_100.py``,
``models/nllb/tokenization_nllb.py``):

* Marian (``MarianTokenizer``): the source text's pieces by ``source.spm`` (the target side's by ``target.spm``),
  each looked up in the shared ``vocab.json`` (a piece it lacks is ``<unk>``), then ``</s>``. A text starting with a
  code ``>>xx<<`` keeps it as one token before the pieces (``remove_language_code``); a multilingual model (codes
  ``>>xx<<`` in its vocabulary) takes ``--target-lang xx`` as that code starting the source. Decoding skips the
  special tokens (``</s>``, ``<unk>``, ``<pad>``), joins the pieces with the source model's decoder (transformers
  decodes with the source ``spm`` when the vocabulary is shared) and strips the ends. With separate vocabularies
  (``separate_vocabs``: the model's ``share_encoder_decoder_embeddings`` false) the target side's pieces are
  looked up in ``target_vocab.json`` (the record's ``target_vocab``), and decoding reads the target ids by it and
  joins the pieces with the target model's decoder, as transformers does.
* M2M100 (``M2M100Tokenizer``): ``[__src__] + pieces' ids + [</s>]``; the codes ``__xx__`` sit after the
  vocabulary (``len(vocab.json) + i``, in the order of ``FAIRSEQ_LANGUAGE_CODES``); the target language's id is the
  first decoded token (``forced_bos_token_id``).
* NLLB (``NllbTokenizer``, its ``tokenizer.json``): ``[src_code] + ids + [</s>]`` (``legacy_behaviour``:
  ``ids + [</s>, src_code]``), codes such as ``eng_Latn``; the target's code forced first.

Where this project differs from transformers, on purpose: a special token's name typed in a text (``"</s>"``) is
text, never the control id (transformers' ``split_special_tokens=True``), as for the project's own tokenizer; and
decoding skips the language codes (transformers 5.23's M2M100 tokenizer writes them, ``__fr__``, into the text).
"""

from __future__ import annotations

import base64
import binascii
import copy
import importlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from . import records
from .config import TransformerConfig
from .tokenizer import TOKENIZER_VERSION, Tokenizer, _library, check_tokenizer_json, pad_rows

FAMILY_TOKENIZER_VERSION = "2"
FAMILIES = ("marian", "m2m_100", "nllb")
SOURCE_LANGUAGE = ("none", "prefix", "suffix")       # where the source language's code goes in the source ids
TARGET_LANGUAGE = ("none", "forced", "source_prefix")  # forced first decoded token, or (Marian) the source's first
RECORD = {"family": str, "source": str, "target": str, "vocab": dict, "unk_id": int, "special_ids": list,
          "languages": dict, "source_language": str, "target_language": str, "strip": bool, "files": dict,
          "target_vocab": dict}
# "files": absent in the records of imports before it was kept; "target_vocab": a Marian model's separate target
# vocabulary, absent where one vocabulary serves both sides
OPTIONAL = ("files", "target_vocab")
# A Hugging Face directory's tokenizer files
TOKENIZER_CONFIG, VOCAB_FILE, TOKENIZER_JSON = "tokenizer_config.json", "vocab.json", "tokenizer.json"
TARGET_VOCAB_FILE = "target_vocab.json"              # Marian's separate target vocabulary (``separate_vocabs``)
MARIAN_MODELS, M2M100_MODEL = ("source.spm", "target.spm"), "sentencepiece.bpe.model"
MARIAN_FILES, M2M100_FILES = (*MARIAN_MODELS, VOCAB_FILE), (M2M100_MODEL, VOCAB_FILE)
# The directory's tokenizer files that the other fields do not hold as they are, kept byte for byte (base64) in the
# record's "files" for ``export --to hf`` alone, which writes them back (vocab.json, target_vocab.json, NLLB's
# tokenizer.json: from "vocab", "target_vocab" and "source"). Nothing reads them to tokenize.
KEPT_FILES = {"marian": (TOKENIZER_CONFIG, *MARIAN_MODELS), "m2m_100": (TOKENIZER_CONFIG, M2M100_MODEL),
              "nllb": (TOKENIZER_CONFIG,)}
SHOWN_LANGUAGES = 8                                   # codes a message about an unknown language lists
FLAGS = {"--source-lang": "source language", "--target-lang": "target language"}


def is_family_record(text: str) -> bool:
    """Whether a checkpoint's tokenizer text is a family tokenizer's record (else a ``tokenizers`` JSON text)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return False
    return isinstance(data, dict) and "family" in data


def check_family_record(text: str, config: TransformerConfig) -> dict[str, Any]:
    """A family tokenizer's record, type-checked field by field with the standard library and against ``config``:
    its choices, the config's pad and eos among its special ids, every id inside the model's vocabularies (with a
    separate ``target_vocab``, each vocabulary's inside its side's). Returns the record; anything else is one
    ``ValueError`` naming the field."""
    name = "tokenizer"
    data = records.record(records.parse_json(text, name, "a JSON text"), name, RECORD, OPTIONAL)
    for field, allowed in (("family", FAMILIES), ("source_language", SOURCE_LANGUAGE),
                           ("target_language", TARGET_LANGUAGE)):
        if data[field] not in allowed:
            raise ValueError(f"tokenizer field {field!r} is {data[field]!r}; expected one of {', '.join(allowed)}")
    for file, content in (data.get("files") or {}).items():
        if file not in KEPT_FILES[data["family"]]:
            raise ValueError(f"tokenizer field 'files' holds {file!r}; a {data['family']} tokenizer keeps "
                             f"{', '.join(KEPT_FILES[data['family']])}")
        _decoded(records.check(content, str, f"tokenizer field 'files.{file}'"), file)
    both = min(config.src_vocab_size, config.tgt_vocab_size)
    separate = data.get("target_vocab") is not None
    if separate and data["family"] != "marian":
        raise ValueError(f"tokenizer field 'target_vocab' is Marian's separate target vocabulary; a "
                         f"{data['family']} tokenizer has one vocabulary")
    limits = {"vocab": config.src_vocab_size if separate else both, "target_vocab": config.tgt_vocab_size,
              "languages": both}
    for field, limit in limits.items():
        _check_ids([records.check(i, int, f"tokenizer field '{field}.{piece}'")
                    for piece, i in (data.get(field) or {}).items()], limit, field == "target_vocab")
    _check_ids([records.check(i, int, "tokenizer field 'special_ids'") for i in data["special_ids"]], both)
    unk = {i: piece for piece, i in data["vocab"].items()}.get(data["unk_id"])
    for field in ("vocab", "target_vocab") if separate else ("vocab",):
        if unk is None or unk not in data[field]:
            raise ValueError(f"tokenizer field {field!r} lacks the unknown token (unk_id {data['unk_id']})")
    for field, expected in (("pad", config.pad_id), ("eos", config.eos_id)):
        if expected not in data["special_ids"]:
            raise ValueError(f"tokenizer special_ids lack the config's {field} id {expected}")
    if (data["source_language"] != "none" or data["target_language"] != "none") and not data["languages"]:
        raise ValueError("tokenizer places language codes but lists none (field 'languages')")
    return data


def _check_ids(ids: list[int], limit: int, target: bool = False) -> None:
    """Every id of a vocabulary, a language or a special token is one of the model's (``target``: its target
    vocabulary's, below ``limit``)."""
    if ids and (min(ids) < 0 or max(ids) >= limit):
        side = "target vocabulary holds" if target else "vocabularies hold"
        raise ValueError(f"tokenizer ids run from {min(ids)} to {max(ids)}; the model's {side} ids 0 to "
                         f"{limit - 1}")


def _decoded(content: str, file: str) -> bytes:
    try:
        return base64.b64decode(content, validate=True)
    except binascii.Error:
        raise ValueError(f"tokenizer field 'files.{file}' is not base64 text") from None


def hf_tokenizer_files(record: dict[str, Any]) -> dict[str, bytes]:
    """The Hugging Face tokenizer directory of a family's record (checked): its kept files as they were, and
    ``vocab.json`` (Marian, M2M100; and Marian's ``target_vocab.json``) or ``tokenizer.json`` (NLLB) from the
    record's own fields. A record without
    ``files`` (an import before they were kept) is one ``ValueError``: import the directory again."""
    if not record.get("files"):
        raise ValueError(f"tokenizer field 'files' is missing: the {record['family']} tokenizer was imported without "
                         "its files (an earlier version); import the model directory again to export its tokenizer")
    files = {name: _decoded(content, name) for name, content in record["files"].items()}
    if record["family"] == "nllb":
        files[TOKENIZER_JSON] = record["source"].encode("utf-8")
    else:
        for name, field in ((VOCAB_FILE, "vocab"), (TARGET_VOCAB_FILE, "target_vocab")):
            if record.get(field) is not None:
                files[name] = (json.dumps(record[field], ensure_ascii=False, indent=2) + "\n").encode("utf-8")
    return files


def _built(library: Any, record: dict[str, Any], side: str) -> Any:
    """The ``tokenizers`` object of the record's ``source`` or ``target`` JSON text."""
    try:
        return library.Tokenizer.from_str(record[side])
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for JSON it cannot build
        raise ValueError(f"tokenizer field {side!r} is not a tokenizers JSON text "
                         f"({str(err).splitlines()[0]})") from None


class FamilyTokenizer:
    """A Hugging Face family's tokenizer (module docstring): text to the model's ids and back, with the languages
    of a translation (:meth:`with_languages`) where the family needs them."""

    def __init__(self, record: dict[str, Any], config: TransformerConfig) -> None:
        library = _library()
        self.record, self.config = record, config
        self._source, self._target = (_built(library, record, side) for side in ("source", "target"))
        for tokenizer in (self._source, self._target):
            tokenizer.encode_special_tokens = True      # "</s>" typed in a text is text, never the control id
        self._vocabs = {"source": record["vocab"], "target": record.get("target_vocab") or record["vocab"]}
        self._pieces = {side: {i: piece for piece, i in vocab.items()} for side, vocab in self._vocabs.items()}
        unk = self._pieces["source"][record["unk_id"]]
        self._unk = {side: vocab[unk] for side, vocab in self._vocabs.items()}
        # transformers joins a shared vocabulary's pieces with the source model's decoder, separate ones' with the
        # target model's
        self._joiner = self._target if record.get("target_vocab") else self._source
        self._skipped = {*record["special_ids"], *record["languages"].values()}
        self.source_lang: str | None = None             # set by with_languages
        self.target_lang: str | None = None

    @classmethod
    def from_json(cls, text: str, config: TransformerConfig) -> FamilyTokenizer:
        return cls(check_family_record(text, config), config)

    def to_json(self) -> str:
        return json.dumps(self.record, ensure_ascii=False, sort_keys=True)

    @property
    def family(self) -> str:
        return self.record["family"]

    @property
    def languages(self) -> list[str]:
        return list(self.record["languages"])

    def with_languages(self, source_lang: str | None, target_lang: str | None) -> FamilyTokenizer:
        """This tokenizer translating ``source_lang`` to ``target_lang`` (``--source-lang``/``--target-lang``):
        each checked against what the family needs (one ``ValueError`` naming the flag)."""
        for flag, value, place in (("--source-lang", source_lang, self.record["source_language"]),
                                   ("--target-lang", target_lang, self.record["target_language"])):
            if place == "none" and value is not None:
                raise ValueError(f"{flag}: this {self.family} model takes no {FLAGS[flag]}")
            if place != "none" and value is None:
                raise self._missing(flag)
            if value is not None and value not in self.record["languages"]:
                raise ValueError(f"{flag}: {value!r} is not a language of this model (known: {self._shown()})")
        translating = copy.copy(self)                   # the tokenizers objects shared, not built again
        translating.source_lang, translating.target_lang = source_lang, target_lang
        return translating

    def _missing(self, flag: str) -> ValueError:
        return ValueError(f"{flag}: this {self.family} model needs the {FLAGS[flag]} (one of {self._shown()})")

    def _shown(self) -> str:
        codes = self.languages
        more = f", ... ({len(codes)} in all)" if len(codes) > SHOWN_LANGUAGES else ""
        return ", ".join(codes[:SHOWN_LANGUAGES]) + more

    def _language_id(self, flag: str, value: str | None) -> int:
        if value is None:
            raise self._missing(flag)
        return self.record["languages"][value]

    @property
    def forced_bos_id(self) -> int | None:
        """The target language's id, the first token decoding must emit (M2M100/NLLB's ``forced_bos_token_id``);
        None for a family that forces none."""
        if self.record["target_language"] != "forced":
            return None
        return self._language_id("--target-lang", self.target_lang)

    def pieces(self, text: str, side: str = "source") -> list[str]:
        """The pieces of ``text`` by the side's SentencePiece model (Marian: a leading ``>>xx<<`` code kept whole)."""
        code: list[str] = []
        if self.family == "marian" and text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[:end + 2]], text[end + 2:]
        tokenizer = self._source if side == "source" else self._target
        return code + tokenizer.encode(text, add_special_tokens=False).tokens

    def content_ids(self, text: str, side: str = "source") -> list[int]:
        """The ids of the pieces of ``text``, a piece outside the side's vocabulary as ``<unk>`` (no special
        token)."""
        vocab, unk = self._vocabs[side], self._unk[side]
        return [vocab.get(piece, unk) for piece in self.pieces(text, side)]

    def ids(self, text: str, side: str = "source") -> list[int]:
        """The model's ids of ``text`` as the family's tokenizer gives them (transformers' ``input_ids``; the
        ``target`` side: its ``text_target`` labels), with the languages set by :meth:`with_languages`."""
        ids = [*self.content_ids(text, side), self.config.eos_id]
        if side == "source" and self.record["target_language"] == "source_prefix":
            ids = [self._language_id("--target-lang", self.target_lang), *ids]
        place = self.record["source_language"]
        if place != "none":
            language = self._language_id("--source-lang" if side == "source" else "--target-lang",
                                         self.source_lang if side == "source" else self.target_lang)
            ids = [language, *ids] if place == "prefix" else [*ids, language]
        return ids

    # -- the interface of reference_numpy.tokenizer.Tokenizer, which translate, evaluate and compare use

    def encode(self, text: str, name: str = "text") -> list[int]:
        """The ids of ``text``'s pieces (no special token); a ``ValueError`` naming ``name`` if it has none."""
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        ids = self.content_ids(text)
        if not ids:
            raise ValueError(f"{name} is empty")
        return ids

    def source(self, text: str, name: str = "text") -> list[int]:
        """The source ids of ``text`` (:meth:`ids`); a ``ValueError`` naming ``name`` if it is blank."""
        self.encode(text, name)
        return self.ids(text)

    def batch(self, texts: list[str], name: str = "text") -> np.ndarray:
        """Source ids of ``texts``, right-padded with pad_id. Shape (B, S)."""
        if not texts:
            raise ValueError(f"{name} holds no sentence")
        return pad_rows([self.source(text, name) for text in texts], self.config.pad_id)

    def tokens(self, ids: Iterable[int], side: str = "target") -> list[str]:
        """Each id's piece in the side's vocabulary, a language code's id by its code (M2M100's ``__fr__`` as
        "fr"), "<unk>" for an id outside both (the labels of ``plot attention``)."""
        names = {i: code for code, i in self.record["languages"].items()} | self._pieces[side]
        return [names.get(int(i), "<unk>") for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: stops at the first eos, skips the special tokens and the language codes (and ids
        outside the vocabulary), joins the pieces with the family's decoder (transformers'
        ``decode(skip_special_tokens=True)``)."""
        pieces = []
        for i in map(int, ids):
            if i == self.config.eos_id:
                break
            if i not in self._skipped and i in self._pieces["target"]:
                pieces.append(self._pieces["target"][i])
        text = self._joiner.decoder.decode(pieces) if pieces else ""
        return text.strip() if self.record["strip"] else text


# ----------------------------------------------------------------------------- a checkpoint's tokenizer, either kind

def tokenizer_version(text: str) -> str:
    """The ``tokenizer_version`` a checkpoint writes beside a tokenizer's text: "1" for the project's BPE (a
    ``tokenizers`` JSON text, :mod:`.tokenizer`), "2" for a Hugging Face family's record."""
    return FAMILY_TOKENIZER_VERSION if is_family_record(text) else TOKENIZER_VERSION


def check_any_tokenizer(text: str, config: TransformerConfig) -> None:
    """A checkpoint's tokenizer text checked against ``config`` with the standard library, as its kind says."""
    if is_family_record(text):
        check_family_record(text, config)
    else:
        check_tokenizer_json(text, config)


def read_tokenizer(text: str, config: TransformerConfig) -> Tokenizer | FamilyTokenizer:
    """The tokenizer of a checkpoint's tokenizer text: the project's BPE or a Hugging Face family's."""
    if is_family_record(text):
        return FamilyTokenizer.from_json(text, config)
    return Tokenizer.from_json(text, config)


# ----------------------------------------------------------------------------- reading a Hugging Face directory

CLASSES = {"MarianTokenizer": "marian", "M2M100Tokenizer": "m2m_100", "NllbTokenizer": "nllb",
           "NllbTokenizerFast": "nllb"}


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether a Hugging Face model directory holds a tokenizer (its ``tokenizer_config.json``)."""
    return (Path(directory) / TOKENIZER_CONFIG).is_file()


def tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer files of the directory that the import reads (never written over)."""
    root = Path(directory)
    names = (TOKENIZER_CONFIG, *MARIAN_FILES, TARGET_VOCAB_FILE, *M2M100_FILES, TOKENIZER_JSON)
    return [root / name for name in dict.fromkeys(names) if (root / name).is_file()]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read {os.fspath(path)!r}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None


def _converted(model_file: Path) -> str:
    """A SentencePiece model file as a ``tokenizers`` JSON text that cuts text into the same pieces, by
    transformers' ``SpmConverter`` (its normalizer, Metaspace pre-tokenizer and decoder; a Unigram model as is, a
    BPE model's merges from its vocabulary by transformers' ``SentencePieceExtractor``)."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.models import BPE
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter
    except ImportError:
        raise ValueError(f"importing the SentencePiece tokenizer {os.fspath(model_file)!r} needs transformers, "
                         "sentencepiece and protobuf: pip install 'transformer-reference[hf]'") from None

    class Converter(SpmConverter):
        def vocab(self, proto: Any) -> list[tuple[str, float]]:
            """The pieces and scores; SentencePiece never matches its unknown and control pieces (types 2, 3) in a
            text, so their names here end with the word-start marker, which no word holds after its first
            character: "</s>" typed in a text is text, as SentencePiece encodes it."""
            return [(piece.piece + "\u2581" * (piece.type in (2, 3)), piece.score) for piece in proto.pieces]

        def tokenizer(self, proto: Any) -> Any:
            if proto.trainer_spec.model_type != 2:                 # 1: Unigram, SpmConverter's own
                return super().tokenizer(proto)
            found: dict[str, Any] = SentencePieceExtractor(os.fspath(model_file)).extract(None)  # type: ignore[assignment]  # 2: BPE; transformers annotates a tuple, returns a dict
            tokenizer = Tokenizer(BPE(found["vocab"], found["merges"], unk_token=proto.trainer_spec.unk_piece,
                                      fuse_unk=True, byte_fallback=False, dropout=None))
            tokenizer.add_tokens(found["additional_special_tokens"])
            return tokenizer

    class Source:
        vocab_file = os.fspath(model_file)

    try:
        return Converter(Source()).converted().to_str()
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, or the converter's refusal of a model type
        raise ValueError(f"cannot convert the SentencePiece model {os.fspath(model_file)!r}: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None


def _language_codes(module: str, root: Path) -> Any:
    """``FAIRSEQ_LANGUAGE_CODES`` of a transformers tokenizer module (the family's published list of codes)."""
    try:
        return importlib.import_module(f"transformers.models.{module}").FAIRSEQ_LANGUAGE_CODES
    except ImportError:
        raise ValueError(f"importing the tokenizer of {os.fspath(root)!r} needs transformers' language codes: "
                         "pip install 'transformer-reference[hf]'") from None


def _family(root: Path, settings: dict[str, Any]) -> str:
    named = CLASSES.get(str(settings.get("tokenizer_class")))
    if named is not None:
        return named
    for family, files in (("marian", MARIAN_FILES), ("nllb", (TOKENIZER_JSON,)), ("m2m_100", M2M100_FILES)):
        if all((root / name).is_file() for name in files):
            return family
    raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r}: tokenizer_class "
                     f"{settings.get('tokenizer_class')!r} is not a supported tokenizer "
                     f"(supported: {', '.join(CLASSES)})")


def _special_ids(vocab: dict[str, int], settings: dict[str, Any], config: TransformerConfig) -> list[int]:
    """The ids transformers' ``decode(skip_special_tokens=True)`` skips: the special tokens the tokenizer config
    names (bos, eos, unk, pad, sep, cls, mask) that the vocabulary holds, and the config's pad and eos."""
    names = [settings.get(f"{kind}_token") for kind in ("bos", "eos", "unk", "pad", "sep", "cls", "mask")]
    names = [name.get("content") if isinstance(name, dict) else name for name in names]
    return sorted({vocab[name] for name in names if isinstance(name, str) and name in vocab}
                  | {config.pad_id, config.eos_id})


def read_hf_tokenizer(directory: str | os.PathLike, config: TransformerConfig) -> str | None:
    """The family tokenizer's record (JSON text) of a Hugging Face model directory, None if it holds no tokenizer
    (no ``tokenizer_config.json``). Checked against ``config`` as a load checks it."""
    root = Path(directory)
    if not has_tokenizer(root):
        return None
    settings = _read_json(root / TOKENIZER_CONFIG)
    if not isinstance(settings, dict):
        raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r} must hold a JSON object")
    family = _family(root, settings)
    record = {"marian": _marian, "m2m_100": _m2m100, "nllb": _nllb}[family](root, settings, config)
    record["files"] = {name: base64.b64encode((root / name).read_bytes()).decode("ascii")
                       for name in KEPT_FILES[family]}
    text = json.dumps(record, ensure_ascii=False, sort_keys=True)
    check_family_record(text, config)
    return text


def _need(root: Path, names: Iterable[str], family: str) -> None:
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise ValueError(f"{os.fspath(root)!r}: the {family} tokenizer lacks {', '.join(missing)}")


def _vocabulary(path: Path) -> dict[str, int]:
    vocab = _read_json(path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ValueError(f"{os.fspath(path)!r} must map pieces to integer ids")
    return vocab


def _unk(vocab: dict[str, int], settings: dict[str, Any], root: Path) -> int:
    unk = settings.get("unk_token", "<unk>")
    unk = unk.get("content") if isinstance(unk, dict) else unk
    if unk not in vocab:
        raise ValueError(f"{os.fspath(root)!r}: the vocabulary lacks the unknown token {unk!r}")
    return vocab[unk]


def _marian(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    separate = settings.get("separate_vocabs") is True
    _need(root, (*MARIAN_FILES, TARGET_VOCAB_FILE) if separate else MARIAN_FILES, "Marian")
    vocab = _vocabulary(root / VOCAB_FILE)
    languages = {piece[2:-2]: i for piece, i in vocab.items() if piece.startswith(">>") and piece.endswith("<<")}
    source, target = (_converted(root / name) for name in MARIAN_MODELS)
    return {"family": "marian", "source": source, "target": target,
            "vocab": vocab, "unk_id": _unk(vocab, settings, root), "special_ids": _special_ids(vocab, settings, config),
            "languages": languages, "source_language": "none",
            "target_language": "source_prefix" if languages else "none", "strip": True,
            **({"target_vocab": _vocabulary(root / TARGET_VOCAB_FILE)} if separate else {})}


def _m2m100(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    _need(root, M2M100_FILES, "M2M100")
    tables = _language_codes("m2m_100.tokenization_m2m_100", root)
    codes = tables.get(str(settings.get("language_codes", "m2m100")))
    if codes is None:
        raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r}: language_codes "
                         f"{settings.get('language_codes')!r} is not one of {', '.join(tables)}")
    vocab = _vocabulary(root / VOCAB_FILE)
    source = _converted(root / M2M100_MODEL)
    return {"family": "m2m_100", "source": source, "target": source, "vocab": vocab,
            "unk_id": _unk(vocab, settings, root), "special_ids": _special_ids(vocab, settings, config),
            "languages": {code: len(vocab) + i for i, code in enumerate(codes)},
            "source_language": "prefix", "target_language": "forced", "strip": True}


def _nllb(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    if not (root / TOKENIZER_JSON).is_file():
        raise ValueError(f"{os.fspath(root)!r}: an NLLB tokenizer is read from its {TOKENIZER_JSON}, which the "
                         "directory lacks")
    from tokenizers import Tokenizer
    text = (root / TOKENIZER_JSON).read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for JSON it cannot build
        raise ValueError(f"{os.fspath(root / TOKENIZER_JSON)!r} is not a tokenizers JSON text "
                         f"({str(err).splitlines()[0]})") from None
    tokenizer.post_processor = None                 # the language and eos are placed by the record, not the JSON
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    languages = {code: vocab[code] for code in _language_codes("nllb.tokenization_nllb", root) if code in vocab}
    source = tokenizer.to_str()
    return {"family": "nllb", "source": source, "target": source, "vocab": vocab,
            "unk_id": _unk(vocab, settings, root), "special_ids": _special_ids(vocab, settings, config),
            "languages": languages, "source_language": "suffix" if settings.get("legacy_behaviour") else "prefix",
            "target_language": "forced", "strip": False}
