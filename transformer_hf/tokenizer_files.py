"""What the families' tokenizer readers share: a SentencePiece model converted by transformers' own converter to a
``tokenizers`` JSON text, a directory's vocabularies, its unknown and special tokens, transformers' published
language codes, and the vocabulary files an export writes back from a record. The families' readers (their
:class:`.family.TokenizerKind`) build a record's fields from these (:mod:`.tokenizers` describes the record)."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reference_numpy.config import TransformerConfig

from .files import read_json

TOKENIZER_CONFIG, VOCAB_FILE, TOKENIZER_JSON = "tokenizer_config.json", "vocab.json", "tokenizer.json"
TARGET_VOCAB_FILE = "target_vocab.json"              # Marian's separate target vocabulary (``separate_vocabs``)


def need(root: Path, names: Iterable[str], family: str) -> None:
    """Every file of ``names`` is in the directory ``root``, or one ``ValueError`` naming the missing ones."""
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise ValueError(f"{os.fspath(root)!r}: the {family} tokenizer lacks {', '.join(missing)}")


def vocabulary(path: Path) -> dict[str, int]:
    """A ``vocab.json``: piece -> integer id."""
    vocab = read_json(path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ValueError(f"{os.fspath(path)!r} must map pieces to integer ids")
    return vocab


def unknown_id(vocab: dict[str, int], settings: dict[str, Any], root: Path) -> int:
    """The id of the tokenizer config's unknown token (``<unk>`` by default)."""
    unk = settings.get("unk_token", "<unk>")
    unk = unk.get("content") if isinstance(unk, dict) else unk
    if unk not in vocab:
        raise ValueError(f"{os.fspath(root)!r}: the vocabulary lacks the unknown token {unk!r}")
    return vocab[unk]


def special_ids(vocab: dict[str, int], settings: dict[str, Any], config: TransformerConfig) -> list[int]:
    """The ids transformers' ``decode(skip_special_tokens=True)`` skips: the special tokens the tokenizer config
    names (bos, eos, unk, pad, sep, cls, mask) that the vocabulary holds, and the config's pad and eos."""
    names = [settings.get(f"{kind}_token") for kind in ("bos", "eos", "unk", "pad", "sep", "cls", "mask")]
    names = [name.get("content") if isinstance(name, dict) else name for name in names]
    return sorted({vocab[name] for name in names if isinstance(name, str) and name in vocab}
                  | {config.pad_id, config.eos_id})


def language_codes(module: str, root: Path) -> Any:
    """``FAIRSEQ_LANGUAGE_CODES`` of a transformers tokenizer module (the family's published list of codes)."""
    try:
        return importlib.import_module(f"transformers.models.{module}").FAIRSEQ_LANGUAGE_CODES
    except ImportError:
        raise ValueError(f"importing the tokenizer of {os.fspath(root)!r} needs transformers' language codes: "
                         "pip install 'transformer-reference[hf]'") from None


def vocabulary_files(record: dict[str, Any]) -> dict[str, bytes]:
    """``vocab.json`` (and Marian's ``target_vocab.json``) of a record's ``vocab`` (and ``target_vocab``)."""
    return {name: (json.dumps(record[field], ensure_ascii=False, indent=2) + "\n").encode("utf-8")
            for name, field in ((VOCAB_FILE, "vocab"), (TARGET_VOCAB_FILE, "target_vocab"))
            if record.get(field) is not None}


def converted(model_file: Path) -> str:
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


def read_tokenizer_json(root: Path, what: str) -> Any:
    """The ``tokenizers.Tokenizer`` of a directory's ``tokenizer.json`` without its post-processor (the record places
    the special tokens and language codes, not the JSON); one ``ValueError`` naming the directory or the file, ``what``
    (``"a Pegasus tokenizer"``) in the message."""
    if not (root / TOKENIZER_JSON).is_file():
        raise ValueError(f"{os.fspath(root)!r}: {what} is read from its {TOKENIZER_JSON}, which the directory lacks")
    from tokenizers import Tokenizer
    text = (root / TOKENIZER_JSON).read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for JSON it cannot build
        raise ValueError(f"{os.fspath(root / TOKENIZER_JSON)!r} is not a tokenizers JSON text "
                         f"({str(err).splitlines()[0]})") from None
    tokenizer.post_processor = None
    return tokenizer


def json_tokenizer(root: Path, settings: dict[str, Any], config: TransformerConfig,
                   family: str) -> tuple[str, dict[str, int], list[int]]:
    """``(source, vocab, special_ids)`` of a tokenizer read from a directory's ``tokenizer.json`` (transformers'
    ``TokenizersBackend`` classes: Pegasus, BART, mBART-50): the JSON text without its post-processor (the record
    places the special tokens), its vocabulary with the added tokens, and the ids ``decode(skip_special_tokens=True)``
    skips -- :func:`special_ids` and every added token the JSON marks special (``<mask_1>``, a language code)."""
    tokenizer = read_tokenizer_json(root, f"a {family} tokenizer")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    special = sorted(set(special_ids(vocab, settings, config)) | {vocab[name] for name in added if name in vocab})
    return tokenizer.to_str(), vocab, special


def json_files(record: dict[str, Any]) -> dict[str, bytes]:
    """A ``tokenizer.json`` family's file: the record's ``source``, as the import read it (its post-processor, which
    transformers' tokenizer class builds again on loading, left out)."""
    return {TOKENIZER_JSON: record["source"].encode("utf-8")}
