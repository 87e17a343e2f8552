"""Pegasus (``model_type`` ``pegasus``: ``google/pegasus-xsum``, ``google/pegasus-cnn_dailymail`` and the other
summarizers of Zhang et al., 2020), as transformers defines it (``models/pegasus/modeling_pegasus.py``,
``tokenization_pegasus.py``).

**The model.** Pre-LN layers with a final LayerNorm after each stack (``norm_first`` true: ``model.{encoder,
decoder}.layer_norm``); Marian's sinusoid (``PegasusSinusoidalPositionalEmbedding.create_weight`` is Marian's: the
sines of section 3.5's angles in the first half of the columns, the cosines in the second, ``sinusoidal_layout``
"halves") at positions 0, 1, ... in the encoder and the decoder alike (``past_key_values_length`` + t: no position
offset, no padding index); the activation ``activation_function`` (``PegasusConfig``'s default "gelu"; the published
models' "relu"); ``scale_embedding`` (default false; the published models' true); a bias on the logits
(``final_logits_bias``, a (1, V) buffer, zeros in the published models: ``generator.bias``, ``output_bias`` true);
``nn.LayerNorm``'s epsilon 1e-5. One vocabulary: one shared embedding, or with ``tie_word_embeddings`` false
separate ones (:func:`.weights.embeddings`).

**Special ids.** pad 0, eos 1 and no bos: decoding starts from pad (``decoder_start_token_id``, :data:`BOS_FIELD`,
read unmasked as Marian's), so the import keeps pad and eos and takes as ``bos_id`` the lowest id that is neither
(:mod:`.importer`); ``PegasusConfig`` forces eos at the budget's end (``forced_eos_token_id``). The published
generation config (``google/pegasus-xsum``: ``num_beams`` 8, ``length_penalty`` 0.6, ``max_length`` 64) is read by
:mod:`.generation` as every family's.

**The tokenizer** (``PegasusTokenizer``, its ``tokenizer.json``): a SentencePiece Unigram model, the pieces' ids
then ``</s>``; no language. The ids below the pieces are pad, eos, ``<mask_1>``, ``<mask_2>``, ``<unk_2>`` ...
``<unk_102>`` (``offset`` 103) and ``<unk>``; decoding skips every special token (those the tokenizer config names
and the added tokens the JSON marks special) and joins the pieces with the Metaspace decoder.

**The export** writes a pre-LN config with a sinusoid other than fairseq's (:func:`claims`; learned positions are
:mod:`.mbart`'s) as ``PegasusForConditionalGeneration``: the ``halves`` table as it is, the paper's ``interleaved``
table through the feature permutation of :mod:`.marian` ("The paper's model as a Marian model": the symmetry holds
with the final norms too, each a LayerNorm over the reordered features); a model without ``output_bias`` gets a zero
``final_logits_bias``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig
from reference_numpy.model import sinusoidal_positional_encoding

from . import weights
from .family import HF_EXPORT, PRE_LN_LEGACY_FIELDS, TokenizerKind, check_sinusoid_export, field
from .tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON, json_files, json_tokenizer, unknown_id

MODEL_TYPE, MODELS, ARCHITECTURE = "pegasus", "Pegasus", "PegasusForConditionalGeneration"
DEFAULTS: dict[str, Any] = {"activation_function": "gelu", "scale_embedding": False}      # PegasusConfig's
LEGACY_FIELDS = PRE_LN_LEGACY_FIELDS
BOS_FIELD = "decoder_start_token_id"
IGNORED = weights.SINUSOID_BUFFERS


def architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """Pre-LN with final norms, the halves sinusoid from position 0, a logits bias; one vocabulary (module
    docstring)."""
    vocab = field(hf, "vocab_size")
    return {"src_vocab_size": vocab, "tgt_vocab_size": vocab,
            "share_embeddings": bool(hf.get("tie_word_embeddings", True)), "norm_first": True,
            "positional_encoding": "sinusoidal", "sinusoidal_layout": "halves", "output_bias": True}


def weight_table(config: TransformerConfig, tie_output: bool = True) -> weights.WeightTable:
    """The embeddings, ``final_logits_bias``, the BART lineage's layers and each stack's final ``layer_norm``."""
    table: weights.WeightTable = {}
    weights.embeddings(table, config, tie_output)
    weights.logits_bias(table, config)
    weights.layers(table, config)
    for stack in ("encoder", "decoder"):
        weights.norm(table, f"{stack}.norm", f"model.{stack}.layer_norm")
    return table


# ----------------------------------------------------------------------------- the export

def claims(config: TransformerConfig) -> bool:
    return config.norm_first and config.positional_encoding != "learned" and config.sinusoidal_layout != "fairseq"


def check_export(config: TransformerConfig) -> None:
    check_sinusoid_export(config, MODEL_TYPE, ("interleaved", "halves"))
    if config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(f"tgt_vocab_size {config.tgt_vocab_size} is not supported by {HF_EXPORT} with norm_first "
                         f"True: Pegasus has one vocabulary (src_vocab_size {config.src_vocab_size})")


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    return {}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The paper's interleaved model permuted to the halves layout (module docstring), its state dict, a zero
    ``final_logits_bias`` without ``output_bias``, each stack's sinusoid table (``embed_positions.weight``, which
    Pegasus's state dict holds), and ``model.shared`` a copy of the encoder's embedding when the
    embeddings are separate (transformers builds it; untied, its forward pass reads each side's own)."""
    if config.sinusoidal_layout == "interleaved":
        params = weights.permute_features(params, weights.halves_order(config.d_model))
    out = weights.written_with_logits_bias(config, weight_table(config), params)
    if not config.share_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    table = sinusoidal_positional_encoding(config.max_len, config.d_model, layout="halves")
    for stack in ("encoder", "decoder"):           # saved by transformers' Pegasus: the halves table, as it computes
        out[f"model.{stack}.embed_positions.weight"] = table.astype(out["final_logits_bias"].dtype)
    return out


# ----------------------------------------------------------------------------- the tokenizer

def tokenizer_record(root: Path, settings: dict[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """The record of a ``PegasusTokenizer`` directory, read from its ``tokenizer.json`` (module docstring)."""
    source, vocab, special = json_tokenizer(root, settings, config, "Pegasus")
    return {"family": "pegasus", "source": source, "target": source, "vocab": vocab,
            "unk_id": unknown_id(vocab, settings, root), "special_ids": special, "languages": {},
            "source_language": "none", "target_language": "none", "strip": False}


TOKENIZERS = (TokenizerKind("pegasus", classes=("PegasusTokenizer", "PegasusTokenizerFast"),
                            files=(TOKENIZER_JSON,),
                            reads=(TOKENIZER_CONFIG, TOKENIZER_JSON), kept=(TOKENIZER_CONFIG,),
                            record=tokenizer_record, written=json_files),)
