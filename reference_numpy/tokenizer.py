"""Byte-pair encoding with one vocabulary for source and target (section 5.1), saved inside the checkpoint.

The tokenizer is a BPE model of the ``tokenizers`` library (the ``text`` extra): text is normalised (NFKC, lower
case, runs of white space to one space, trimmed), split at spaces with a word-start marker, and merged pair by
pair; decoding joins the pieces back, so ``decode(encode(text)) == normalise(text)``. Its special tokens sit at the
model config's ids: ``<pad>`` at ``pad_id``, ``<s>`` at ``bos_id``, ``</s>`` at ``eos_id``, and ``<unk>`` next
(characters the training text never had; :meth:`Tokenizer.encode` refuses them instead of feeding ``<unk>`` to the
model). A special token's name typed in a text (``"seventy-one </s> eighty"``) is text like any other: its
characters are encoded, never the control id, so a user's text cannot end the source early.

In a checkpoint the tokenizer is its JSON text in the safetensors metadata (``tokenizer``, with
``tokenizer_version``), so one file is a complete translator. :func:`check_tokenizer_json` validates that text
against the config with the standard library alone, so every load checks it whether or not ``tokenizers`` is
installed; :meth:`Tokenizer.from_json` then builds the library's object.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from . import records
from .config import TransformerConfig

TOKENIZER_VERSION = "1"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
INSTALL = "pip install 'transformer-reference[text]'"


def special_tokens(config: TransformerConfig) -> dict[str, int]:
    """``{token: id}`` of the three special tokens the model knows, at the config's ids."""
    return {PAD: config.pad_id, BOS: config.bos_id, EOS: config.eos_id}


def _library():
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise ValueError(f"text needs the tokenizers library: {INSTALL}") from None
    return tokenizers


class Tokenizer:
    """A shared BPE vocabulary for a model: ``encode`` text to ids, ``decode`` ids to text."""

    def __init__(self, library_tokenizer: Any, config: TransformerConfig) -> None:  # a tokenizers.Tokenizer
        self._tokenizer = library_tokenizer
        self._tokenizer.encode_special_tokens = True    # "</s>" typed in a text is text, never the control id
        self.config = config
        self.unk_id = library_tokenizer.token_to_id(UNK)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, config: TransformerConfig,
              name: str = "vocab_size") -> Tokenizer:
        """Learn up to ``vocab_size`` tokens (specials included) from ``texts`` of both languages (section 5.1's
        shared source-target vocabulary): every character of the texts, then merges until the size is reached or
        none is left. A size below the alphabet's and the four special tokens' is a ``ValueError`` naming ``name``
        and the size the texts need. The special ids must be 0, 1, 2 in some order (they are the first tokens)."""
        lib = _library()
        ids = special_tokens(config)
        if sorted(ids.values()) != [0, 1, 2]:
            raise ValueError(f"pad_id, bos_id and eos_id must be 0, 1 and 2 in some order to train a tokenizer, "
                             f"got {config.pad_id}, {config.bos_id}, {config.eos_id}")
        tokenizer = lib.Tokenizer(lib.models.BPE(unk_token=UNK))
        tokenizer.normalizer = lib.normalizers.Sequence([
            lib.normalizers.NFKC(), lib.normalizers.Lowercase(),
            lib.normalizers.Replace(lib.Regex(r"\s+"), " "), lib.normalizers.Strip()])
        tokenizer.pre_tokenizer = lib.pre_tokenizers.Metaspace()
        tokenizer.decoder = lib.decoders.Metaspace()
        trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                          special_tokens=[*sorted(ids, key=ids.__getitem__), UNK])
        tokenizer.train_from_iterator(texts, trainer)
        if tokenizer.get_vocab_size() > vocab_size:
            raise ValueError(f"{name} {vocab_size} is below the {tokenizer.get_vocab_size()} ids the texts' characters "
                             f"and the 4 special tokens take; give at least {tokenizer.get_vocab_size()}")
        return cls.from_json(tokenizer.to_str(), config)

    @classmethod
    def from_json(cls, text: str, config: TransformerConfig) -> Tokenizer:
        """The tokenizer of a JSON text (as saved in a checkpoint), checked against ``config``."""
        check_tokenizer_json(text, config)
        library = _library()
        try:
            tokenizer = library.Tokenizer.from_str(text)
        except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for JSON it cannot build
            raise ValueError(f"tokenizer is not a tokenizers JSON text ({str(err).splitlines()[0]})") from None
        return cls(tokenizer, config)

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def normalize(self, text: str) -> str:
        """The text the tokenizer sees: NFKC, lower case, single spaces, trimmed."""
        return self._tokenizer.normalizer.normalize_str(text)

    def tokens(self, ids: Iterable[int], side: str = "target") -> list[str]:
        """The piece of each id (for labelling pictures; one vocabulary serves either ``side``)."""
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def encode(self, text: str, name: str = "text") -> list[int]:
        """The ids of ``text`` (no bos or eos); a ``ValueError`` naming ``name`` if it is empty or holds
        characters the vocabulary has never seen."""
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if not encoding.ids:
            raise ValueError(f"{name} is empty")
        unknown = [text[start:end] for (start, end), i in zip(encoding.offsets, encoding.ids)
                   if i == self.unk_id]
        if unknown:
            raise ValueError(f"{name} {text!r} holds characters the tokenizer has never seen: "
                             f"{', '.join(map(repr, dict.fromkeys(unknown)))}")
        return encoding.ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``, stopping at the first eos; pad and bos are skipped."""
        kept = []
        for i in map(int, ids):
            if i == self.config.eos_id:
                break
            if i not in (self.config.pad_id, self.config.bos_id):
                kept.append(i)
        return self._tokenizer.decode(kept, skip_special_tokens=False)

    def source(self, text: str, name: str = "text") -> list[int]:
        """The source ids of ``text``: its ids (:meth:`encode`) and eos."""
        return [*self.encode(text, name), self.config.eos_id]

    def batch(self, texts: list[str], name: str = "text") -> np.ndarray:
        """Source ids of ``texts``: each ``ids + [eos]``, right-padded with pad_id. Shape (B, S)."""
        if not texts:
            raise ValueError(f"{name} holds no sentence")
        return pad_rows([self.source(text, name) for text in texts], self.config.pad_id)


def pad_rows(rows: list[list[int]], pad_id: int) -> np.ndarray:
    """Lists of ids as one (len(rows), longest) int64 array, right-padded with ``pad_id``."""
    out = np.full((len(rows), max(map(len, rows))), pad_id, dtype=np.int64)
    for row, ids in zip(out, rows):
        row[:len(ids)] = ids
    return out


def teacher_forcing(config: TransformerConfig, sources: list[list[int]],
                    labels: list[list[int]]) -> dict[str, np.ndarray]:
    """src = the source sequences; labels = the target sequences; tgt = the labels shifted right by one, the start
    token first (the output embeddings offset by one, section 3.1; the start token is ``config.start_id``)."""
    return {"src": pad_rows(sources, config.pad_id),
            "tgt": pad_rows([[config.start_id, *ids[:-1]] for ids in labels], config.pad_id),
            "labels": pad_rows(labels, config.pad_id)}


TOKENIZER_RECORD = {"model": dict, "added_tokens": list}          # the fields of a tokenizer's JSON text read here,
MODEL_RECORD = {"type": str, "vocab": dict}                         # of its model,
ADDED_TOKEN_RECORD = {"content": str, "id": int}                    # and of each added (special) token


def tokenizer_ids(text: str) -> tuple[str, dict[str, int]]:
    """A tokenizer's JSON text, type-checked field by field (:mod:`.records`; its other fields are the library's):
    its model's type and every token's id (the vocabulary's and the added tokens')."""
    name = "tokenizer"
    data = records.record(records.parse_json(text, name, "a tokenizers JSON text"), name, TOKENIZER_RECORD, others=True)
    model = records.record(data["model"], name, MODEL_RECORD, others=True, within="model")
    ids = {token: records.check(i, int, f"{name} field {'model.vocab.' + token!r}")
           for token, i in model["vocab"].items()}
    for index, token in enumerate(data["added_tokens"]):
        records.record(token, name, ADDED_TOKEN_RECORD, others=True, within=f"added_tokens[{index}]")
        ids[token["content"]] = token["id"]
    return model["type"], ids


def check_tokenizer_json(text: str, config: TransformerConfig) -> None:
    """Validate a tokenizer's JSON against ``config`` with the standard library alone: a BPE model, its special
    tokens at the config's pad/bos/eos ids, and every id inside both vocabularies (the vocabulary is shared).
    One ``ValueError`` naming the problem (a field of the JSON text of another type: :mod:`.records`)."""
    model_type, ids = tokenizer_ids(text)
    if model_type != "BPE":
        raise ValueError(f"tokenizer model is {model_type!r}; expected 'BPE'")
    for token, expected in special_tokens(config).items():
        if ids.get(token) != expected:
            raise ValueError(f"tokenizer has {token!r} at id {ids.get(token)}; the config's id is {expected}")
    limit = min(config.src_vocab_size, config.tgt_vocab_size)
    if max(ids.values()) >= limit or min(ids.values()) < 0:
        raise ValueError(f"tokenizer ids run from {min(ids.values())} to {max(ids.values())}; the model's "
                         f"vocabularies hold ids 0 to {limit - 1}")
