"""What a family module provides (:class:`Family`, which :mod:`.registry` holds by ``model_type``), its tokenizers'
description (:class:`TokenizerKind`), and the small checks the family modules share.

A family module (:mod:`.marian`, :mod:`.m2m_100`) is the whole of one Hugging Face family here: its config
conversion (``DEFAULTS``, ``LEGACY_FIELDS``, ``BOS_FIELD``, :meth:`Family.architecture`), its weight-name table
(:meth:`Family.weight_table`, the transposes listed entry by entry), its tokenizers (``TOKENIZERS``) and its export
back (:meth:`Family.claims`, :meth:`Family.check_export`, :meth:`Family.hf_config`, :meth:`Family.hf_weights`).
transformers' ``generate`` conventions are the same for every family (:mod:`.generation`). The import and export
drivers (:mod:`.importer`, :mod:`.exporter`) read the family from the registry and know no family themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reference_numpy.config import TransformerConfig

from .weights import WeightTable

HF_EXPORT = "the Hugging Face export"             # what an export refusal names as the target
LAYER_NORM_EPS = 1e-5                              # nn.LayerNorm's default, which the families construct with


@dataclass(frozen=True)
class TokenizerKind:
    """One tokenizer a family's directories hold, named by the record's ``family`` field
    (:mod:`.tokenizers`): ``classes``, the ``tokenizer_class`` values of ``tokenizer_config.json`` that name it;
    ``files``, the files that name it when no class does (every one present); ``reads``, every file of the
    directory it may read (the import never writes over one); ``kept``, the files kept byte for byte in the
    record's ``files`` for the export alone; ``record(root, settings, config)``, the record's fields from the
    directory (``settings``: its ``tokenizer_config.json``); ``written(record)``, the files the export writes from
    the record's other fields; ``code_marks``, the marks around a language code that a text may start with, kept as
    one piece (Marian's ``>>xx<<``), or None; ``separate_vocabs``, whether a record may hold a target vocabulary of
    its own (``target_vocab``: Marian's ``separate_vocabs``)."""

    name: str
    classes: tuple[str, ...]
    files: tuple[str, ...]
    reads: tuple[str, ...]
    kept: tuple[str, ...]
    record: Callable[[Path, dict[str, Any], TransformerConfig], dict[str, Any]]
    written: Callable[[dict[str, Any]], dict[str, bytes]]
    code_marks: tuple[str, str] | None = None
    separate_vocabs: bool = False


class Family(Protocol):
    """A family module: its constants and functions (each module's docstring says what its family computes)."""

    MODEL_TYPE: str                      # config.json's model_type: the registry's key
    MODELS: str                          # the models it covers, as a message names them
    ARCHITECTURE: str                    # the transformers class the export's config.json names
    DEFAULTS: dict[str, Any]             # the family's config class's defaults of fields a config.json may omit
    LEGACY_FIELDS: dict[str, Any]        # older config.json fields, with the one value each may hold
    BOS_FIELD: str                       # the config.json field read as bos (module docstrings: the bos rule)
    IGNORED: tuple[str, ...]             # suffixes of state-dict tensors the import does not read
    TOKENIZERS: tuple[TokenizerKind, ...]

    def architecture(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The :class:`TransformerConfig` fields that set the family apart (layers, positions, vocabularies,
        embeddings), from its ``config.json``."""
        ...

    def weight_table(self, config: TransformerConfig, tie_output: bool = True) -> WeightTable:
        """Checkpoint tensor -> :class:`.weights.Entry` (``tie_output``: the file's ``tie_word_embeddings``)."""
        ...

    def claims(self, config: TransformerConfig) -> bool:
        """Whether the export writes ``config`` as this family (which :meth:`check_export` may still refuse)."""
        ...

    def check_export(self, config: TransformerConfig) -> None:
        """One ``ValueError`` naming the first field of ``config`` the family cannot express."""
        ...

    def hf_config(self, config: TransformerConfig) -> dict[str, Any]:
        """The family's own fields of the export's ``config.json``."""
        ...

    def hf_weights(self, config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The export's state dict of ``params``."""
        ...


def field(hf: dict[str, Any], name: str) -> int:
    """An int field of ``config.json``: ids >= 0, sizes >= 1."""
    value, minimum = hf.get(name), 0 if name.endswith("_id") else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"config.json {name} must be an int >= {minimum}, got {value!r}")
    return value


# Fields of older config.json files (BART's lineage; published M2M100 and Pegasus files hold them) that transformers'
# pre-LN families no longer read: each must hold the value their code computes, or the file describes another model
PRE_LN_LEGACY_FIELDS: dict[str, Any] = {"normalize_before": True, "normalize_embedding": False,
                                        "add_final_layer_norm": True, "static_position_embeddings": True,
                                        "add_bias_logits": False, "layernorm_embedding": False}


def check_sinusoid_export(config: TransformerConfig, models: str, layouts: tuple[str, ...]) -> None:
    """What a family with a sinusoid table and ``nn.LayerNorm``'s epsilon refuses (one ``ValueError`` naming the
    field): learned positions, a LayerNorm of the embeddings, a layout other than ``layouts``, another LayerNorm
    epsilon (``models``: the family's name in the message)."""
    if config.positional_encoding != "sinusoidal":
        raise ValueError(f"positional_encoding {config.positional_encoding!r} is not supported by {HF_EXPORT}: "
                         f"{models} computes sinusoid tables (positional_encoding 'sinusoidal')")
    if config.embedding_norm:
        raise ValueError(f"embedding_norm True is not supported by {HF_EXPORT} with sinusoid tables: {models} has no "
                         f"LayerNorm of the embeddings")
    if config.layer_norm_eps != LAYER_NORM_EPS:
        raise ValueError(f"layer_norm_eps {config.layer_norm_eps!r} is not supported by {HF_EXPORT}: {models} "
                         f"constructs nn.LayerNorm with epsilon {LAYER_NORM_EPS!r} (a model trained with "
                         f"`train --layer-norm-eps {LAYER_NORM_EPS!r}` has it)")
    if config.sinusoidal_layout not in layouts:
        raise ValueError(f"sinusoidal_layout {config.sinusoidal_layout!r} is not supported by {HF_EXPORT} with "
                         f"norm_first {config.norm_first}: {models} has {' or '.join(map(repr, layouts))}")


def check_learned_export(config: TransformerConfig, models: str, offset: int) -> None:
    """What a family of learned positions read from row ``offset`` on, with the embedding LayerNorm and
    ``nn.LayerNorm``'s epsilon, refuses (one ``ValueError`` naming the field; ``models``: the family's name in the
    message): no embedding LayerNorm, another position offset or LayerNorm epsilon, two vocabularies."""
    if not config.embedding_norm:
        raise ValueError(f"embedding_norm False is not supported by {HF_EXPORT} with positional_encoding 'learned' "
                         f"and norm_first {config.norm_first}: {models} has embedding_norm True (layernorm_embedding)")
    if config.position_offset != offset:
        raise ValueError(f"position_offset {config.position_offset} is not supported by {HF_EXPORT}: {models} reads "
                         f"position t at row t + {offset}")
    if config.layer_norm_eps != LAYER_NORM_EPS:
        raise ValueError(f"layer_norm_eps {config.layer_norm_eps!r} is not supported by {HF_EXPORT}: {models} "
                         f"constructs nn.LayerNorm with epsilon {LAYER_NORM_EPS!r}")
    if config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(f"tgt_vocab_size {config.tgt_vocab_size} is not supported by {HF_EXPORT}: {models} has one "
                         f"vocabulary (src_vocab_size {config.src_vocab_size})")
