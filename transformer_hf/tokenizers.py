"""The families' tokenizers (Marian, M2M100, NLLB), carried in the checkpoint as data, and a checkpoint's
tokenizer of either kind built to encode and decode.

A family's tokenizer is a record (JSON text in the checkpoint's ``tokenizer`` metadata, the reference's kind
"record", ``tokenizer_version`` "2": ``reference_numpy.checkpoint.StoredTokenizer``; :data:`RECORD` lists its fields):
the SentencePiece model(s) converted by transformers' own converter (``transformers.convert_slow_tokenizer``) to
Hugging Face ``tokenizers`` JSON texts that cut a text into pieces, the model's vocabulary (piece -> id, the
family's ``vocab.json`` or the ``tokenizer.json``'s own), the language codes (code -> id) and where they go; and the
directory's own tokenizer files that those fields do not hold as they are (``tokenizer_config.json``, the
SentencePiece model files: each kind's ``kept``), byte for byte, which only ``export --to hf`` reads, to write the
directory's tokenizer back (:func:`hf_tokenizer_files`). Nothing in it is code; ``tokenizers`` alone runs it (no
sentencepiece at run time). The record's ``family`` names the :class:`.family.TokenizerKind` of a family module,
whose docstring gives the family's rules (transformers 5.23's): :mod:`.marian` (``marian``), :mod:`.m2m_100`
(``m2m_100``, ``nllb``), :mod:`.pegasus` (``pegasus``), :mod:`.bart` (``bart``), :mod:`.mbart` (``mbart50``). The
reference stores a record and returns it as it is; this module checks it (:func:`check_record`) wherever it is read.

Where this project differs from transformers, on purpose: a special token's name typed in a text (``"</s>"``) is
text, never the control id (transformers' ``split_special_tokens=True``), as for the project's own tokenizer; and
decoding skips the language codes (transformers 5.23's M2M100 tokenizer writes them, ``__fr__``, into the text).
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy import records
from reference_numpy.checkpoint import RECORD, StoredTokenizer, load_stored_tokenizer, stored_tokenizer
from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import Tokenizer, _library, pad_rows

from .family import TokenizerKind
from .files import read_json
from .registry import TOKENIZER_KINDS
from .tokenizer_files import TOKENIZER_CONFIG

SOURCE_LANGUAGE = ("none", "prefix", "suffix")       # where the source language's code goes in the source ids
TARGET_LANGUAGE = ("none", "forced", "source_prefix")  # forced first decoded token, or (Marian) the source's first
RECORD_FIELDS = {"family": str, "source": str, "target": str, "vocab": dict, "unk_id": int, "special_ids": list,
                 "languages": dict, "source_language": str, "target_language": str, "strip": bool, "files": dict,
                 "target_vocab": dict, "prefix_ids": list}
# "files": absent in the records of imports before it was kept; "target_vocab": a Marian model's separate target
# vocabulary, absent where one vocabulary serves both sides; "prefix_ids": the ids before every sequence's pieces
# (BART's <s>), absent where none go there
OPTIONAL = ("files", "target_vocab", "prefix_ids")
SHOWN_LANGUAGES = 8                                   # codes a message about an unknown language lists
FLAGS = {"--source-lang": "source language", "--target-lang": "target language"}

# tokenizer_config.json classes that name no family (the export's own, transformers' generic fast tokenizer): the
# directory's files say which kind it is
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def check_record(text: str, config: TransformerConfig) -> dict[str, Any]:
    """A family tokenizer's record, type-checked field by field with the standard library and against ``config``:
    its kind and choices, the config's pad and eos among its special ids, every id inside the model's vocabularies
    (with a separate ``target_vocab``, each vocabulary's inside its side's). Returns the record; anything else is
    one ``ValueError`` naming the field."""
    name = "tokenizer"
    data = records.record(records.parse_json(text, name, "a JSON text"), name, RECORD_FIELDS, OPTIONAL)
    for field, allowed in (("family", tuple(TOKENIZER_KINDS)), ("source_language", SOURCE_LANGUAGE),
                           ("target_language", TARGET_LANGUAGE)):
        if data[field] not in allowed:
            raise ValueError(f"tokenizer field {field!r} is {data[field]!r}; expected one of {', '.join(allowed)}")
    kept = TOKENIZER_KINDS[data["family"]].kept
    for file, content in (data.get("files") or {}).items():
        if file not in kept:
            raise ValueError(f"tokenizer field 'files' holds {file!r}; a {data['family']} tokenizer keeps "
                             f"{', '.join(kept)}")
        _decoded(records.check(content, str, f"tokenizer field 'files.{file}'"), file)
    both = min(config.src_vocab_size, config.tgt_vocab_size)
    separate = data.get("target_vocab") is not None
    if separate and not TOKENIZER_KINDS[data["family"]].separate_vocabs:
        raise ValueError(f"tokenizer field 'target_vocab' is a separate target vocabulary; a {data['family']} "
                         "tokenizer has one vocabulary")
    limits = {"vocab": config.src_vocab_size if separate else both, "target_vocab": config.tgt_vocab_size,
              "languages": both}
    for field, limit in limits.items():
        _check_ids([records.check(i, int, f"tokenizer field '{field}.{piece}'")
                    for piece, i in (data.get(field) or {}).items()], limit, field == "target_vocab")
    for field in ("special_ids", "prefix_ids"):
        _check_ids([records.check(i, int, f"tokenizer field '{field}'") for i in data.get(field) or []], both)
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
    """The Hugging Face tokenizer directory of a family's record (checked): its kept files as they were, and the
    files its kind writes from the record's own fields (``vocab.json``, Marian's ``target_vocab.json``, NLLB's
    ``tokenizer.json``). A record without ``files`` (an import before they were kept) is one ``ValueError``: import
    the directory again."""
    if not record.get("files"):
        raise ValueError(f"tokenizer field 'files' is missing: the {record['family']} tokenizer was imported without "
                         "its files (an earlier version); import the model directory again to export its tokenizer")
    files = {name: _decoded(content, name) for name, content in record["files"].items()}
    return {**files, **TOKENIZER_KINDS[record["family"]].written(record)}


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
        self._kind: TokenizerKind = TOKENIZER_KINDS[record["family"]]
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
        return cls(check_record(text, config), config)

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
        """The target language's id, the first token decoding must emit (M2M100/NLLB/mBART-50's
        ``forced_bos_token_id``); None for a family that forces none."""
        if self.record["target_language"] != "forced":
            return None
        return self._language_id("--target-lang", self.target_lang)

    def pieces(self, text: str, side: str = "source") -> list[str]:
        """The pieces of ``text`` by the side's SentencePiece model (a leading language code between the kind's
        ``code_marks``, Marian's ``>>xx<<``, kept whole)."""
        code: list[str] = []
        marks = self._kind.code_marks
        if marks is not None and text.startswith(marks[0]) and (end := text.find(marks[1])) != -1:
            code, text = [text[:end + len(marks[1])]], text[end + len(marks[1]):]
        tokenizer = self._source if side == "source" else self._target
        return code + tokenizer.encode(text, add_special_tokens=False).tokens

    def content_ids(self, text: str, side: str = "source") -> list[int]:
        """The ids of the pieces of ``text``, a piece outside the side's vocabulary as ``<unk>`` (no special
        token)."""
        vocab, unk = self._vocabs[side], self._unk[side]
        return [vocab.get(piece, unk) for piece in self.pieces(text, side)]

    def ids(self, text: str, side: str = "source") -> list[int]:
        """The model's ids of ``text`` as the family's tokenizer gives them (transformers' ``input_ids``; the
        ``target`` side: its ``text_target`` labels): the record's ``prefix_ids`` (BART's ``<s>``), the pieces' ids,
        eos, with the languages set by :meth:`with_languages`."""
        ids = [*(self.record.get("prefix_ids") or []), *self.content_ids(text, side), self.config.eos_id]
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

AnyTokenizer = Tokenizer | FamilyTokenizer


def check_tokenizer(stored: StoredTokenizer, config: TransformerConfig) -> None:
    """A checkpoint's tokenizer checked against ``config`` with the standard library, as its kind says: the
    project's BPE by the reference (``reference_numpy.tokenizer.check_tokenizer_json``), a family's record here."""
    if stored.kind == RECORD:
        check_record(stored.text, config)


def tokenizer_of(text: str | None, config: TransformerConfig) -> AnyTokenizer | None:
    """The tokenizer of a checkpoint's tokenizer text (either kind, checked against ``config``), None for none."""
    if text is None:
        return None
    if stored_tokenizer(text).kind == RECORD:
        return FamilyTokenizer.from_json(text, config)
    return Tokenizer.from_json(text, config)


def load_tokenizer_json(path: str | os.PathLike) -> str | None:
    """The JSON text of the checkpoint's tokenizer (a file or a shipped model's name), either kind checked against
    the file's config (``reference_numpy.checkpoint.load_stored_tokenizer``, a record checked here); None if it
    has none. Reads the file's header only."""
    found = load_stored_tokenizer(path)
    if found is None:
        return None
    stored, config = found
    check_tokenizer(stored, config)
    return stored.text


def load_tokenizer(path: str | os.PathLike) -> AnyTokenizer | None:
    """The checkpoint's tokenizer, ready to encode and decode (Hugging Face ``tokenizers``, the ``text`` extra): the
    project's BPE, or an imported family's; None if the file has none. Reads the file's header only."""
    found = load_stored_tokenizer(path)
    return None if found is None else tokenizer_of(found[0].text, found[1])


# ----------------------------------------------------------------------------- reading a Hugging Face directory

def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether a Hugging Face model directory holds a tokenizer (its ``tokenizer_config.json``)."""
    return (Path(directory) / TOKENIZER_CONFIG).is_file()


def tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer files of the directory that the import may read (never written over)."""
    root = Path(directory)
    names = (name for kind in TOKENIZER_KINDS.values() for name in kind.reads)
    return [root / name for name in dict.fromkeys(names) if (root / name).is_file()]


def _kind(root: Path, settings: dict[str, Any]) -> TokenizerKind:
    """The tokenizer kind its ``tokenizer_class`` names, else (no class, or a class of no family:
    :data:`GENERIC_CLASSES`) the first whose files the directory holds. A family's class no kind lists is refused:
    another family's files may be there (mBART-cc25's ``MBartTokenizer`` holds a tokenizer.json, as NLLB's does)."""
    named = settings.get("tokenizer_class")
    for kind in TOKENIZER_KINDS.values():
        if str(named) in kind.classes:
            return kind
    for kind in TOKENIZER_KINDS.values():
        if (named is None or named in GENERIC_CLASSES) and all((root / name).is_file() for name in kind.files):
            return kind
    classes = (name for kind in TOKENIZER_KINDS.values() for name in kind.classes)
    raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r}: tokenizer_class "
                     f"{settings.get('tokenizer_class')!r} is not a supported tokenizer "
                     f"(supported: {', '.join(classes)})")


def read_hf_tokenizer(directory: str | os.PathLike, config: TransformerConfig) -> str | None:
    """The family tokenizer's record (JSON text) of a Hugging Face model directory, None if it holds no tokenizer
    (no ``tokenizer_config.json``). Checked against ``config`` as a load checks it."""
    root = Path(directory)
    if not has_tokenizer(root):
        return None
    settings = read_json(root / TOKENIZER_CONFIG)
    if not isinstance(settings, dict):
        raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r} must hold a JSON object")
    kind = _kind(root, settings)
    record = kind.record(root, settings, config)
    record["files"] = {name: base64.b64encode((root / name).read_bytes()).decode("ascii") for name in kind.kept}
    text = json.dumps(record, ensure_ascii=False, sort_keys=True)
    check_record(text, config)
    return text
