"""M2M100 and NLLB (``model_type`` ``m2m_100``: NLLB shares M2M100's architecture), as transformers defines them
(``models/m2m_100/``, ``models/nllb/tokenization_nllb.py``).

**The model.** Pre-LN layers with a final LayerNorm after each stack (``norm_first`` true); fairseq's sinusoid
(``sinusoidal_layout`` "fairseq": positions from ``pad_token_id + 1`` over the non-pad tokens); ReLU or GELU
(``M2M100Config``'s default "relu"); ``scale_embedding`` (default true); no logits bias; ``nn.LayerNorm``'s epsilon
1e-5. One vocabulary: one shared embedding, or with ``tie_word_embeddings`` false separate ones
(:func:`.weights.embeddings`). The special ids are the file's: ``bos_token_id`` (0) is bos (:data:`BOS_FIELD`);
decoding starts from eos (``decoder_start_token_id``) and the target language's code is forced first, given per
call (``translate --target-lang``).

**The tokenizers.** M2M100 (``M2M100Tokenizer``): ``[__src__] + pieces' ids + [</s>]``; the codes ``__xx__`` sit
after the vocabulary (``len(vocab.json) + i``, in the order of ``FAIRSEQ_LANGUAGE_CODES``); the target language's id
is the first decoded token (``forced_bos_token_id``). NLLB (``NllbTokenizer``, its ``tokenizer.json``):
``[src_code] + ids + [</s>]`` (``legacy_behaviour``: ``ids + [</s>, src_code]``), codes such as ``eng_Latn``; the
target's code forced first.

**The export** writes a pre-LN config with fairseq's positions (:func:`claims`) as
``M2M100ForConditionalGeneration``, one vocabulary: separate embeddings of it are ``tie_word_embeddings`` false,
with ``model.shared`` a copy of the encoder's embedding (transformers builds it; its forward pass reads the
encoder's own).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig

from . import weights
from .family import HF_EXPORT, PRE_LN_LEGACY_FIELDS, TokenizerKind, check_sinusoid_export, field
from .tokenizer_files import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    VOCAB_FILE,
    converted,
    language_codes,
    need,
    read_tokenizer_json,
    special_ids,
    unknown_id,
    vocabulary,
    vocabulary_files,
)

MODEL_TYPE, MODELS, ARCHITECTURE = "m2m_100", "M2M100 and NLLB", "M2M100ForConditionalGeneration"
DEFAULTS: dict[str, Any] = {"activation_function": "relu", "scale_embedding": True}       # M2M100Config's
LEGACY_FIELDS = PRE_LN_LEGACY_FIELDS
BOS_FIELD = "bos_token_id"
IGNORED = weights.SINUSOID_BUFFERS


def architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """Pre-LN with final norms, fairseq's sinusoid, no logits bias; one vocabulary (module docstring)."""
    vocab = field(hf, "vocab_size")
    return {"src_vocab_size": vocab, "tgt_vocab_size": vocab, "share_embeddings": bool(hf.get("tie_word_embeddings",
                                                                                              True)),
            "norm_first": True, "positional_encoding": "sinusoidal", "sinusoidal_layout": "fairseq",
            "output_bias": False}


def weight_table(config: TransformerConfig, tie_output: bool = True) -> weights.WeightTable:
    """The embeddings, the BART lineage's layers and each stack's final ``layer_norm``."""
    table: weights.WeightTable = {}
    weights.embeddings(table, config, tie_output)
    weights.layers(table, config)
    for stack in ("encoder", "decoder"):
        weights.norm(table, f"{stack}.norm", f"model.{stack}.layer_norm")
    return table


# ----------------------------------------------------------------------------- the export

def claims(config: TransformerConfig) -> bool:
    return config.norm_first and config.sinusoidal_layout == "fairseq"


def check_export(config: TransformerConfig) -> None:
    check_sinusoid_export(config, MODEL_TYPE, ("fairseq",))
    if config.output_bias:
        raise ValueError(f"output_bias True is not supported by {HF_EXPORT} with norm_first True: M2M100 has "
                         "output_bias False")
    if config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(f"tgt_vocab_size {config.tgt_vocab_size} is not supported by {HF_EXPORT} with norm_first "
                         f"True: M2M100 has one vocabulary (src_vocab_size {config.src_vocab_size})")


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    return {}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict, with ``model.shared`` a copy of the encoder's embedding when the embeddings are separate
    (M2M100 always builds it; untied, its forward pass reads the encoder's own ``embed_tokens``)."""
    out = weights.written(config, weight_table(config), params)
    if not config.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    return out


# ----------------------------------------------------------------------------- the tokenizers

SPM_MODEL = "sentencepiece.bpe.model"
FILES = (SPM_MODEL, VOCAB_FILE)


def m2m100_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of an ``M2M100Tokenizer`` directory (module docstring)."""
    need(root, FILES, "M2M100")
    tables = language_codes("m2m_100.tokenization_m2m_100", root)
    codes = tables.get(str(settings.get("language_codes", "m2m100")))
    if codes is None:
        raise ValueError(f"{os.fspath(root / TOKENIZER_CONFIG)!r}: language_codes "
                         f"{settings.get('language_codes')!r} is not one of {', '.join(tables)}")
    vocab = vocabulary(root / VOCAB_FILE)
    source = converted(root / SPM_MODEL)
    return {"family": "m2m_100", "source": source, "target": source, "vocab": vocab,
            "unk_id": unknown_id(vocab, settings, root), "special_ids": special_ids(vocab, settings, config),
            "languages": {code: len(vocab) + i for i, code in enumerate(codes)},
            "source_language": "prefix", "target_language": "forced", "strip": True}


def nllb_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of an ``NllbTokenizer`` directory, read from its ``tokenizer.json`` (module docstring)."""
    tokenizer = read_tokenizer_json(root, "an NLLB tokenizer")
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    languages = {code: vocab[code] for code in language_codes("nllb.tokenization_nllb", root) if code in vocab}
    source = tokenizer.to_str()
    return {"family": "nllb", "source": source, "target": source, "vocab": vocab,
            "unk_id": unknown_id(vocab, settings, root), "special_ids": special_ids(vocab, settings, config),
            "languages": languages, "source_language": "suffix" if settings.get("legacy_behaviour") else "prefix",
            "target_language": "forced", "strip": False}


def nllb_files(record: dict[str, Any]) -> dict[str, bytes]:
    """NLLB's ``tokenizer.json``: the record's ``source``, as the import read it."""
    return {TOKENIZER_JSON: record["source"].encode("utf-8")}


# In this order a directory's files name its tokenizer when no tokenizer_class does: a tokenizer.json is NLLB's
TOKENIZERS = (
    TokenizerKind("nllb", classes=("NllbTokenizer", "NllbTokenizerFast"), files=(TOKENIZER_JSON,),
                  reads=(TOKENIZER_CONFIG, TOKENIZER_JSON), kept=(TOKENIZER_CONFIG,), record=nllb_record,
                  written=nllb_files),
    TokenizerKind("m2m_100", classes=("M2M100Tokenizer",), files=FILES, reads=(TOKENIZER_CONFIG, *FILES),
                  kept=(TOKENIZER_CONFIG, SPM_MODEL), record=m2m100_record, written=vocabulary_files),
)
