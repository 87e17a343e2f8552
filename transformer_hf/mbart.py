"""mBART and mBART-50 (``model_type`` ``mbart``: ``facebook/mbart-large-50-many-to-many-mmt`` and the other
translators of Liu et al., 2020 and Tang et al., 2020), as transformers defines them
(``models/mbart/modeling_mbart.py``, ``models/mbart50/tokenization_mbart50.py``).

**The model.** Pre-LN layers (``norm_first`` true) with a final LayerNorm after each stack (``model.{encoder,
decoder}.layer_norm``); learned positions (``MBartLearnedPositionalEmbedding``: a table of
``max_position_embeddings`` + 2 rows, position t reading row t + 2, as BART's: ``positional_encoding`` "learned",
``position_offset`` 2); ``layernorm_embedding``, a LayerNorm of the embeddings plus positions before each stack's
first layer (``embedding_norm``); the activation ``activation_function`` (``MBartConfig``'s default "gelu");
``scale_embedding`` (default false; mBART-50's true); a bias on the logits (``final_logits_bias``, a (1, V) buffer:
``generator.bias``, ``output_bias`` true); ``nn.LayerNorm``'s epsilon 1e-5. One vocabulary: one shared embedding, or
with ``tie_word_embeddings`` false separate ones (:func:`.weights.embeddings`).

**Special ids.** bos 0 (``bos_token_id``, :data:`BOS_FIELD`), pad 1, eos 2; mBART-50 decodes from eos
(``decoder_start_token_id`` 2), forces the target language's code first (``forced_bos_token_id``, given per call:
``translate --target-lang``) and eos at the budget's end (``forced_eos_token_id``); its published generation config
(beam 5, ``max_length`` 200, ``early_stopping``) is read by :mod:`.generation` as every family's.

**The tokenizer** (``MBart50Tokenizer``, its ``tokenizer.json``): a SentencePiece Unigram model with fairseq's ids
-- ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, then the SentencePiece pieces one above their own ids (fairseq's
offset 1), then the language codes (``en_XX``, ``fr_XX``, ... in the order of ``FAIRSEQ_LANGUAGE_CODES``) and
``<mask>``, the codes and ``<mask>`` added special tokens. A source is ``[src_code] + ids + [</s>]``, a target
``[tgt_code] + ids + [</s>]`` (``source_language`` "prefix"); decoding forces the target's code first
(``target_language`` "forced") and skips every special token, the codes included.

**The export** writes a pre-LN config with learned positions (:func:`claims`) as
``MBartForConditionalGeneration``: the embedding LayerNorm and the offset of 2 are mBART's own, so a config without
them is refused naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig

from . import bart, weights
from .family import TokenizerKind, check_learned_export, field
from .tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON, json_files, json_tokenizer, language_codes, unknown_id

MODEL_TYPE, MODELS, ARCHITECTURE = "mbart", "mBART and mBART-50", "MBartForConditionalGeneration"
DEFAULTS: dict[str, Any] = {"activation_function": "gelu", "scale_embedding": False}      # MBartConfig's
# Fields of older config.json files (the published mBART files hold them) that transformers' mBART no longer reads:
# each must hold the value mBART's code computes, or the file describes another model
LEGACY_FIELDS: dict[str, Any] = {"normalize_before": True, "normalize_embedding": True, "add_final_layer_norm": True,
                                 "static_position_embeddings": False, "add_bias_logits": False}
BOS_FIELD = "bos_token_id"
IGNORED: tuple[str, ...] = ()                      # every tensor of an mBART file is read, its position tables too
POSITION_OFFSET = 2                                # MBartLearnedPositionalEmbedding's offset


def architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """Pre-LN with final norms, learned positions from row 2, the embedding LayerNorm, a logits bias; one vocabulary
    (module docstring)."""
    vocab = field(hf, "vocab_size")
    return {"src_vocab_size": vocab, "tgt_vocab_size": vocab,
            "share_embeddings": bool(hf.get("tie_word_embeddings", True)), "norm_first": True,
            "positional_encoding": "learned", "position_offset": POSITION_OFFSET, "embedding_norm": True,
            "output_bias": True}


def weight_table(config: TransformerConfig, tie_output: bool = True) -> weights.WeightTable:
    """BART's table (:func:`.bart.weight_table`: the embeddings, ``final_logits_bias``, each stack's position table
    and ``layernorm_embedding``, the lineage's layers) and each stack's final ``layer_norm``."""
    table = bart.weight_table(config, tie_output)
    for stack in ("encoder", "decoder"):
        weights.norm(table, f"{stack}.norm", f"model.{stack}.layer_norm")
    return table


# ----------------------------------------------------------------------------- the export

def claims(config: TransformerConfig) -> bool:
    return config.norm_first and config.positional_encoding == "learned"


def check_export(config: TransformerConfig) -> None:
    """What mBART cannot express: no embedding LayerNorm, another position offset or LayerNorm epsilon, two
    vocabularies."""
    check_learned_export(config, "mBART", POSITION_OFFSET)


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    return {}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict as BART's (:func:`.bart.state_dict`) over this table."""
    return bart.state_dict(config, weight_table(config), params)


# ----------------------------------------------------------------------------- the tokenizer

def mbart50_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of an ``MBart50Tokenizer`` directory, read from its ``tokenizer.json`` (module docstring): the
    language codes are those of transformers' published list that the vocabulary holds."""
    source, vocab, special = json_tokenizer(root, settings, config, "mBART-50")
    languages = {code: vocab[code] for code in language_codes("mbart50.tokenization_mbart50", root) if code in vocab}
    return {"family": "mbart50", "source": source, "target": source, "vocab": vocab,
            "unk_id": unknown_id(vocab, settings, root), "special_ids": special, "languages": languages,
            "source_language": "prefix", "target_language": "forced", "strip": False}


TOKENIZERS = (TokenizerKind("mbart50", classes=("MBart50Tokenizer", "MBart50TokenizerFast"), files=(TOKENIZER_JSON,),
                            reads=(TOKENIZER_CONFIG, TOKENIZER_JSON), kept=(TOKENIZER_CONFIG,),
                            record=mbart50_record, written=json_files),)
