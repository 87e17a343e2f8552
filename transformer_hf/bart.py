"""BART (``model_type`` ``bart``: ``facebook/bart-large-cnn``, ``facebook/bart-large-xsum`` and the other summarizers
and denoisers of Lewis et al., 2020), as transformers defines it (``models/bart/modeling_bart.py``).

**The model.** Post-LN layers (``norm_first`` false), no final stack norms; learned positions
(``BartLearnedPositionalEmbedding``: a table of ``max_position_embeddings`` + 2 rows, position t reading row t + 2:
``positional_encoding`` "learned", ``position_offset`` 2, rows 0 and 1 never read); ``layernorm_embedding``, a
LayerNorm of the embeddings plus positions before each stack's first layer (``embedding_norm``: the checkpoint's
``src_embed_norm``, ``tgt_embed_norm``); the activation ``activation_function`` (``BartConfig``'s default "gelu");
``scale_embedding`` (default false); a bias on the logits (``final_logits_bias``, a (1, V) buffer:
``generator.bias``, ``output_bias`` true); ``nn.LayerNorm``'s epsilon 1e-5. One vocabulary: one shared embedding, or
with ``tie_word_embeddings`` false separate ones (:func:`.weights.embeddings`).

**Special ids.** bos 0 (``bos_token_id``, :data:`BOS_FIELD`), pad 1, eos 2; decoding starts from eos
(``decoder_start_token_id``) and BART-CNN's generation config forces bos first (``forced_bos_token_id`` 0) and eos at
the budget's end, holds eos back below ``min_length`` 56 and blocks repeated trigrams (``no_repeat_ngram_size`` 3),
all read by :mod:`.generation` as every family's.

**The tokenizer** (``BartTokenizer``, transformers 5's alias of ``RobertaTokenizer``; its ``tokenizer.json``): GPT-2's
byte-level BPE (the ``ByteLevel`` pre-tokenizer and decoder: every byte a piece, so no text is unknown), ``<s>``,
``<pad>``, ``</s>``, ``<unk>`` and ``<mask>`` among its ids; a source and a target are ``<s> + ids + </s>``
(``RobertaProcessing``: the record's ``prefix_ids``); no language. Decoding skips every special token and joins the
pieces with the byte-level decoder.

**The export** writes a post-LN config with learned positions (:func:`claims`) as ``BartForConditionalGeneration``:
the embedding LayerNorm and the offset of 2 are BART's own, so a config without them is refused naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig

from . import weights
from .family import TokenizerKind, check_learned_export, field
from .tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON, json_files, json_tokenizer, unknown_id

MODEL_TYPE, MODELS, ARCHITECTURE = "bart", "BART", "BartForConditionalGeneration"
DEFAULTS: dict[str, Any] = {"activation_function": "gelu", "scale_embedding": False}      # BartConfig's
# Fields of older config.json files (the published BART files hold them) that transformers' BART no longer reads: each
# must hold the value BART's code computes, or the file describes another model
LEGACY_FIELDS: dict[str, Any] = {"normalize_before": False, "normalize_embedding": True, "add_final_layer_norm": False,
                                 "static_position_embeddings": False, "add_bias_logits": False}
BOS_FIELD = "bos_token_id"
IGNORED: tuple[str, ...] = ()                      # every tensor of a BART file is read, its position tables too
POSITION_OFFSET = 2                                # BartLearnedPositionalEmbedding's offset


def architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """Post-LN, learned positions from row 2, the embedding LayerNorm, a logits bias; one vocabulary (module
    docstring)."""
    vocab = field(hf, "vocab_size")
    return {"src_vocab_size": vocab, "tgt_vocab_size": vocab,
            "share_embeddings": bool(hf.get("tie_word_embeddings", True)), "norm_first": False,
            "positional_encoding": "learned", "position_offset": POSITION_OFFSET, "embedding_norm": True,
            "output_bias": True}


def weight_table(config: TransformerConfig, tie_output: bool = True) -> weights.WeightTable:
    """The embeddings, ``final_logits_bias``, each stack's position table and ``layernorm_embedding``, and the BART
    lineage's layers."""
    table: weights.WeightTable = {}
    weights.embeddings(table, config, tie_output)
    weights.logits_bias(table, config)
    for side, stack in (("src", "encoder"), ("tgt", "decoder")):
        table[f"{side}_pos_embed.weight"] = weights.Entry((f"model.{stack}.embed_positions.weight",))
        weights.norm(table, f"{side}_embed_norm", f"model.{stack}.layernorm_embedding")
    weights.layers(table, config)
    return table


# ----------------------------------------------------------------------------- the export

def claims(config: TransformerConfig) -> bool:
    return not config.norm_first and config.positional_encoding == "learned"


def check_export(config: TransformerConfig) -> None:
    """What BART cannot express: no embedding LayerNorm, another position offset or LayerNorm epsilon, two
    vocabularies."""
    check_learned_export(config, MODELS, POSITION_OFFSET)


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    return {}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return state_dict(config, weight_table(config), params)


def state_dict(config: TransformerConfig, table: weights.WeightTable,
               params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict of the BART lineage's ``table``, a zero ``final_logits_bias`` without ``output_bias``, and
    ``model.shared`` a copy of the encoder's embedding when the embeddings are separate (transformers builds it;
    untied, its forward pass reads each side's own)."""
    out = weights.written_with_logits_bias(config, table, params)
    if not config.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    return out


# ----------------------------------------------------------------------------- the tokenizer

def tokenizer_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of a ``BartTokenizer`` directory, read from its ``tokenizer.json`` (module docstring): its
    ``cls_token`` (``<s>``) before every sequence."""
    source, vocab, special = json_tokenizer(root, settings, config, "BART")
    cls = settings.get("cls_token", "<s>")
    cls = cls.get("content") if isinstance(cls, dict) else cls
    if cls not in vocab:
        raise ValueError(f"{str(root)!r}: the BART tokenizer's vocabulary lacks its cls_token {cls!r}")
    return {"family": "bart", "source": source, "target": source, "vocab": vocab,
            "unk_id": unknown_id(vocab, settings, root), "special_ids": special, "languages": {},
            "source_language": "none", "target_language": "none", "strip": False, "prefix_ids": [vocab[cls]]}


TOKENIZERS = (TokenizerKind("bart", classes=("BartTokenizer", "BartTokenizerFast", "RobertaTokenizer",
                                             "RobertaTokenizerFast"), files=(TOKENIZER_JSON,),
                            reads=(TOKENIZER_CONFIG, TOKENIZER_JSON), kept=(TOKENIZER_CONFIG,),
                            record=tokenizer_record, written=json_files),)
