"""This project's checkpoint as a Hugging Face model directory: the inverse of :mod:`.importer`.

``save_hf(config, params, DIRECTORY, tokenizer)`` (``transformer-reference export --to hf CHECKPOINT DIRECTORY``)
writes ``config.json``, ``model.safetensors`` and ``generation_config.json`` -- and, for a checkpoint holding the
project's BPE tokenizer, ``tokenizer.json`` and ``tokenizer_config.json``; for an imported family's tokenizer, the
directory's tokenizer files as the import read them -- which transformers'
``AutoModelForSeq2SeqLM.from_pretrained(DIRECTORY)`` and ``AutoTokenizer.from_pretrained(DIRECTORY)`` load. Nothing
here runs transformers.

The family follows from the config (:func:`.registry.family_for`: the first family module that claims it; its
``check_export`` refuses, in one line naming the field, what it cannot express), and writes its own fields of
``config.json`` and its state dict, through the import's own table, each shape checked (:mod:`.marian`: post-LN,
the paper's model included; :mod:`.m2m_100`: pre-LN with fairseq's positions). pad, bos and eos are kept;
``generation_config.json`` holds the checkpoint's decoding conventions (:mod:`.generation`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.checkpoint import RECORD, stored_tokenizer
from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import BOS, EOS, PAD, UNK, tokenizer_ids

from .files import CONFIG_FILE, GENERATION_FILE, SAFETENSORS_FILE
from .generation import generation_config, special_ids
from .importer import ACTIVATIONS
from .registry import family_for
from .tokenizer_files import TOKENIZER_CONFIG, TOKENIZER_JSON
from .tokenizers import check_record, hf_tokenizer_files

HF_ACTIVATIONS = {ours: theirs for theirs, ours in reversed(ACTIVATIONS.items())}   # silu -> "swish"


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of the family's model (read back by :func:`.importer.config_from_hf`)."""
    chosen = family_for(config)
    return {
        "model_type": chosen.MODEL_TYPE, "architectures": [chosen.ARCHITECTURE], "vocab_size": config.src_vocab_size,
        "d_model": config.d_model, "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers, "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads, "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
        "max_position_embeddings": config.max_len, "activation_function": HF_ACTIVATIONS[config.activation],
        "scale_embedding": config.scale_embeddings, "dropout": config.dropout, "attention_dropout": 0.0,
        "activation_dropout": 0.0, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "tie_word_embeddings": config.share_embeddings, "is_encoder_decoder": True, **special_ids(config),
        **chosen.hf_config(config)}


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The family's state dict of ``params`` (the checkpoint's dtype)."""
    return family_for(config).hf_weights(config, params)


def hf_tokenizer(tokenizer: str, config: TransformerConfig) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the checkpoint's BPE tokenizer (``tokenizer``, its JSON
    text, ``reference_numpy.tokenizer``), for transformers' ``PreTrainedTokenizerFast``: the same normaliser, pieces
    and decoder, and a post-processor appending ``</s>`` (eos), as ``Tokenizer.batch`` ends every source; a special
    token's name typed in a text is text (``split_special_tokens``, the project's ``encode_special_tokens``)."""
    import tokenizers

    model_type, _ = tokenizer_ids(tokenizer)
    if model_type != "BPE":
        raise ValueError(f"tokenizer model {model_type!r} is not supported by the Hugging Face export: it writes the "
                         "project's own BPE tokenizer")
    library = tokenizers.Tokenizer.from_str(tokenizer)
    library.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1", special_tokens=[(EOS, config.eos_id)])
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "bos_token": BOS, "eos_token": EOS,
                "unk_token": UNK, "model_max_length": config.max_len, "split_special_tokens": True,
                "clean_up_tokenization_spaces": False}
    return library.to_str(), settings


def save_hf(config: TransformerConfig, params: dict[str, np.ndarray], directory: str | Path,
            tokenizer: str | None = None) -> None:
    """Write the Hugging Face model directory (module docstring) into the existing ``directory``; the tokenizer's
    files only if ``tokenizer`` (the checkpoint's text: the project's BPE, or an imported family's record, whose
    directory files are written back as they were: :func:`.tokenizers.hf_tokenizer_files`) is given."""
    from safetensors.numpy import save_file

    root = Path(directory)
    files = {CONFIG_FILE: hf_config(config), GENERATION_FILE: generation_config(config)}
    state = hf_weights(config, params)
    if tokenizer is not None and stored_tokenizer(tokenizer).kind == RECORD:
        for file, data in hf_tokenizer_files(check_record(tokenizer, config)).items():
            (root / file).write_bytes(data)
    elif tokenizer is not None:
        text, files[TOKENIZER_CONFIG] = hf_tokenizer(tokenizer, config)
        (root / TOKENIZER_JSON).write_text(text, encoding="utf-8")
    for name, content in files.items():
        (root / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    save_file(state, root / SAFETENSORS_FILE, metadata={"format": "pt"})
