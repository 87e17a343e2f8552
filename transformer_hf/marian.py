"""Marian (``model_type`` ``marian``: the ~1,500 ``Helsinki-NLP/opus-mt-*`` translators), as transformers defines it
(``models/marian/modeling_marian.py``, ``tokenization_marian.py``).

**The model.** Post-LN layers (``LayerNorm(x + Sublayer(x))``, ``norm_first`` false), no final stack norms; the
sinusoid in two halves (sines, then cosines) at positions 0, 1, ... (``sinusoidal_layout`` "halves"); the activation
``activation_function`` ("swish" is SiLU; ``MarianConfig``'s default "gelu"); ``scale_embedding`` (default false);
a bias on the logits (``final_logits_bias``, a (1, V) buffer: ``generator.bias``, ``output_bias`` true);
``nn.LayerNorm``'s epsilon 1e-5. One vocabulary shared by every embedding unless
``share_encoder_decoder_embeddings`` is false (a target vocabulary of ``decoder_vocab_size``) or
``tie_word_embeddings`` is false (:func:`.weights.embeddings`).

**Special ids.** Marian has no bos of its own (its ``bos_token_id``, if any, is eos): the config holds three
different ids, so the import keeps pad and eos and takes as ``bos_id`` the lowest id that is neither -- unless
``decoder_start_token_id`` (:data:`BOS_FIELD`) is neither, as in a Marian model this project exported, which starts
from its bos. Decoding reads no bos: it starts from ``decoder_start_id`` (Marian's pad, read unmasked) and
suppresses ``suppressed_ids`` (opus-mt's ``bad_words_ids`` [[pad]]); ``MarianConfig`` forces id 0 at the budget's
end whatever the model's eos (:mod:`.generation` reads it as ``forced_eos_id``).

**The tokenizer** (``MarianTokenizer``): the source text's pieces by ``source.spm`` (the target side's by
``target.spm``), each looked up in the shared ``vocab.json`` (a piece it lacks is ``<unk>``), then ``</s>``. A text
starting with a code ``>>xx<<`` keeps it as one token before the pieces (``remove_language_code``); a multilingual
model (codes ``>>xx<<`` in its vocabulary) takes ``--target-lang xx`` as that code starting the source. Decoding
skips the special tokens (``</s>``, ``<unk>``, ``<pad>``), joins the pieces with the source model's decoder
(transformers decodes with the source ``spm`` when the vocabulary is shared) and strips the ends. With separate
vocabularies (``separate_vocabs``: the model's ``share_encoder_decoder_embeddings`` false) the target side's pieces
are looked up in ``target_vocab.json`` (the record's ``target_vocab``), and decoding reads the target ids by it and
joins the pieces with the target model's decoder, as transformers does.

**The export** writes a post-LN config (:func:`claims`) as ``MarianMTModel``: the ``halves`` table as it is, the
paper's ``interleaved`` table through the feature permutation below; a model without ``output_bias`` gets a zero
``final_logits_bias`` (adding zero changes no logit).

**The paper's model as a Marian model.** Section 3.5's table puts sin(p / 10000^(2i/D)) in column 2i and the cosine
of the same angle in column 2i + 1; Marian's (``MarianSinusoidalPositionalEmbedding.create_weight``) puts the same
sine in column i and the cosine in column D/2 + i: the same numbers, the columns reordered, halves[:, k] =
interleaved[:, sigma[k]] with sigma = (0, 2, ..., D - 2, 1, 3, ..., D - 1) (:func:`.weights.halves_order`).
Reordering the d_model features of every vector of the residual stream by one permutation is an exact symmetry of
the network: the embeddings' columns, the input rows of W_q, W_k, W_v and W_1 (stored (in, out)), the output columns
of W_O and W_2 and their biases, the LayerNorms' gains and biases (mean and variance are sums over all features,
which do not depend on their order) and the input rows of the pre-softmax projection
(:func:`.weights.permute_features`). The attention heads' and the feed-forward's inner features are untouched. So
the model whose features are reordered by sigma reads the halves table and computes the paper model's
log-probabilities: the same real numbers, only the floating-point sums over d_model taken in another order. Every
exported weight is a checkpoint weight, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig

from . import weights
from .family import TokenizerKind, check_sinusoid_export, field
from .tokenizer_files import (
    TARGET_VOCAB_FILE,
    TOKENIZER_CONFIG,
    VOCAB_FILE,
    converted,
    need,
    special_ids,
    unknown_id,
    vocabulary,
    vocabulary_files,
)

MODEL_TYPE, MODELS, ARCHITECTURE = "marian", "Marian/opus-mt", "MarianMTModel"
DEFAULTS: dict[str, Any] = {"activation_function": "gelu", "scale_embedding": False}      # MarianConfig's
# Fields of older config.json files (BART's lineage) that transformers' Marian no longer reads: each must hold the
# value Marian's code computes, or the file describes another model
LEGACY_FIELDS: dict[str, Any] = {"normalize_before": False, "normalize_embedding": False,
                                 "add_final_layer_norm": False, "static_position_embeddings": True,
                                 "add_bias_logits": False, "layernorm_embedding": False}
BOS_FIELD = "decoder_start_token_id"
IGNORED = weights.SINUSOID_BUFFERS


def architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """Post-LN, the halves sinusoid, a logits bias; the vocabularies and their sharing (module docstring)."""
    vocab = field(hf, "vocab_size")
    share_sides = bool(hf.get("share_encoder_decoder_embeddings", True))
    tgt_vocab = vocab if share_sides or hf.get("decoder_vocab_size") is None else field(hf, "decoder_vocab_size")
    return {"src_vocab_size": vocab, "tgt_vocab_size": tgt_vocab,
            "share_embeddings": share_sides and bool(hf.get("tie_word_embeddings", True)), "norm_first": False,
            "positional_encoding": "sinusoidal", "sinusoidal_layout": "halves", "output_bias": True}


def weight_table(config: TransformerConfig, tie_output: bool = True) -> weights.WeightTable:
    """The embeddings, the BART lineage's layers and ``final_logits_bias`` (with ``output_bias``)."""
    table: weights.WeightTable = {}
    weights.embeddings(table, config, tie_output)
    weights.logits_bias(table, config)
    weights.layers(table, config)
    return table


# ----------------------------------------------------------------------------- the export

def claims(config: TransformerConfig) -> bool:
    return not config.norm_first and config.positional_encoding == "sinusoidal"


def check_export(config: TransformerConfig) -> None:
    check_sinusoid_export(config, MODEL_TYPE, ("interleaved", "halves"))


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    return {"share_encoder_decoder_embeddings": config.share_embeddings, "decoder_vocab_size": config.tgt_vocab_size}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The paper's interleaved model permuted to the halves layout (module docstring), its state dict, and a zero
    ``final_logits_bias`` without ``output_bias``."""
    if config.sinusoidal_layout == "interleaved":
        params = weights.permute_features(params, weights.halves_order(config.d_model))
    out = weights.written_with_logits_bias(config, weight_table(config), params)
    return out


# ----------------------------------------------------------------------------- the tokenizer

SPM_MODELS = ("source.spm", "target.spm")
FILES = (*SPM_MODELS, VOCAB_FILE)


def tokenizer_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of a ``MarianTokenizer`` directory (module docstring)."""
    separate = settings.get("separate_vocabs") is True
    need(root, (*FILES, TARGET_VOCAB_FILE) if separate else FILES, "Marian")
    vocab = vocabulary(root / VOCAB_FILE)
    languages = {piece[2:-2]: i for piece, i in vocab.items() if piece.startswith(">>") and piece.endswith("<<")}
    source, target = (converted(root / name) for name in SPM_MODELS)
    return {"family": "marian", "source": source, "target": target,
            "vocab": vocab, "unk_id": unknown_id(vocab, settings, root),
            "special_ids": special_ids(vocab, settings, config), "languages": languages, "source_language": "none",
            "target_language": "source_prefix" if languages else "none", "strip": True,
            **({"target_vocab": vocabulary(root / TARGET_VOCAB_FILE)} if separate else {})}


TOKENIZERS = (TokenizerKind("marian", classes=("MarianTokenizer",), files=FILES,
                            reads=(TOKENIZER_CONFIG, *FILES, TARGET_VOCAB_FILE),
                            kept=(TOKENIZER_CONFIG, *SPM_MODELS), record=tokenizer_record, written=vocabulary_files,
                            code_marks=(">>", "<<"), separate_vocabs=True),)
