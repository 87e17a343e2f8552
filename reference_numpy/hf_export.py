"""This project's checkpoint as a Hugging Face model directory: the inverse of :mod:`reference_numpy.hf_import`.

``save_hf(config, params, DIRECTORY, tokenizer)`` (``transformer-reference export --to hf CHECKPOINT DIRECTORY``)
writes ``config.json``, ``model.safetensors`` and ``generation_config.json`` -- and, for a checkpoint holding the
project's BPE tokenizer, ``tokenizer.json`` and ``tokenizer_config.json``; for an imported family's tokenizer, the
directory's tokenizer files as the import read them -- which transformers'
``AutoModelForSeq2SeqLM.from_pretrained(DIRECTORY)`` and ``AutoTokenizer.from_pretrained(DIRECTORY)`` load. The
tensors go through the import's own table (:func:`.hf_import.weight_table`, each checkpoint tensor to the first
Hugging Face name it is read from; :func:`.hf_import.transposed`), each shape checked. Nothing here runs
transformers.

The family follows from the config (the families as :mod:`.hf_import` describes them):

* post-LN (``norm_first`` false) -> Marian (``MarianMTModel``): the ``halves`` table as it is; the paper's
  ``interleaved`` table through the feature permutation below. A model without ``output_bias`` gets a zero
  ``final_logits_bias`` (adding zero changes no logit);
* pre-LN with fairseq's positions (``sinusoidal_layout`` "fairseq") -> M2M100 (``M2M100ForConditionalGeneration``),
  one shared embedding (M2M100's ``model.shared``).

**The paper's model as a Marian model.** Section 3.5's table puts sin(p / 10000^(2i/D)) in column 2i and the cosine
of the same angle in column 2i + 1; Marian's (``MarianSinusoidalPositionalEmbedding.create_weight``) puts the same
sine in column i and the cosine in column D/2 + i: the same numbers, the columns reordered, halves[:, k] =
interleaved[:, sigma[k]] with sigma = (0, 2, ..., D - 2, 1, 3, ..., D - 1) (:func:`halves_order`). Reordering the
d_model features of every vector of the residual stream by one permutation is an exact symmetry of the network:
the embeddings' columns, the input rows of W_q, W_k, W_v and W_1 (stored (in, out)), the output columns of W_O and
W_2 and their biases, the LayerNorms' gains and biases (mean and variance are sums over all features, which do
not depend on their order) and the input rows of the pre-softmax projection (:func:`permute_features`). The
attention heads' and the feed-forward's inner features are untouched. So the model whose features are reordered by
sigma reads the halves table and computes the paper model's log-probabilities: the same real numbers, only the
floating-point sums over d_model taken in another order. Every exported weight is a checkpoint weight, bit for bit.

Refused, in one line naming the field: what neither family computes -- learned positions (``positional_encoding``),
pre-LN without fairseq's positions or post-LN with them (``sinusoidal_layout``), a logits bias or two vocabularies
in M2M100 (``output_bias``, ``tgt_vocab_size``: separate embeddings of one vocabulary are M2M100's
``tie_word_embeddings`` false), a LayerNorm epsilon other than the 1e-5 both
families construct ``nn.LayerNorm`` with (``layer_norm_eps``; the presets' 1e-6 included: see docs/huggingface.md).

Special ids and decoding: pad, bos and eos are kept; ``generation_config.json`` holds the checkpoint's decoding
conventions (:mod:`.decoding`; what :mod:`.hf_import` reads back): the start token (``decoder_start_token_id``:
``decoder_start_id``, or bos), the tokens never written (``bad_words_ids`` of one token each, which set their scores
to -inf as the reference does: pad and bos unless ``suppressed_ids`` says otherwise; ``renormalize_logits`` its
``renormalize``), eos (or ``forced_eos_id``) forced at the
end of the budget only with ``forced_eos``, ``length_penalty`` and ``early_stopping``; the checkpoint's ``beam_size`` as
``num_beams`` (1, greedy, by default); ``min_output_length`` as ``min_length`` (one number: ``min_length`` counts the
start token and not eos, ``min_output_length`` eos and not the start token) and ``no_repeat_ngram_size``;
``forced_bos_id`` as ``forced_bos_token_id``; its ``max_output_length`` tokens after the start token (``max_length``
counts the start token), or, without one, ``max_len``: section 6.1's per-sentence budget (source length + 50) has
no ``generate`` equivalent (a caller gives it as ``max_new_tokens``), and the export imports back with the budget
transformers decodes it with. Beam search in transformers normalises by
|Y|^length_penalty (``length_normalization`` "hf"): a checkpoint with the paper's ((5 + |Y|) / 6)^alpha ("gnmt") has
no ``generate`` equivalent, so its export's greedy decoding is the reference's, its beam search transformers' own --
and it imports back as "hf".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import parameter_shapes
from .config import TransformerConfig
from .hf_import import (
    ACTIVATIONS,
    CONFIG_FILE,
    LAYER_NORM_EPS,
    SAFETENSORS_FILE,
    transposed,
    weight_table,
)
from .hf_tokenizer import check_family_record, hf_tokenizer_files, is_family_record
from .tokenizer import BOS, EOS, PAD, UNK, tokenizer_ids

GENERATION_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json")
ARCHITECTURES = {"marian": "MarianMTModel", "m2m_100": "M2M100ForConditionalGeneration"}
HF_ACTIVATIONS = {ours: theirs for theirs, ours in reversed(ACTIVATIONS.items())}   # silu -> "swish"


def family_of(config: TransformerConfig) -> str:
    """``"marian"`` or ``"m2m_100"`` (see the module docstring), or one ``ValueError`` naming the field no family
    expresses."""
    target = "the Hugging Face export"
    if config.positional_encoding != "sinusoidal":
        raise ValueError(f"positional_encoding {config.positional_encoding!r} is not supported by {target}: Marian "
                         "and M2M100 compute sinusoid tables (positional_encoding 'sinusoidal')")
    if config.layer_norm_eps != LAYER_NORM_EPS:
        raise ValueError(f"layer_norm_eps {config.layer_norm_eps!r} is not supported by {target}: Marian and M2M100 "
                         f"construct nn.LayerNorm with epsilon {LAYER_NORM_EPS!r} (a model trained with "
                         f"`train --layer-norm-eps {LAYER_NORM_EPS!r}` has it)")
    family = "m2m_100" if config.norm_first else "marian"
    layouts = ("fairseq",) if config.norm_first else ("interleaved", "halves")
    if config.sinusoidal_layout not in layouts:
        raise ValueError(f"sinusoidal_layout {config.sinusoidal_layout!r} is not supported by {target} with "
                         f"norm_first {config.norm_first}: {family} has {' or '.join(map(repr, layouts))}")
    if family == "m2m_100" and config.output_bias:
        raise ValueError(f"output_bias True is not supported by {target} with norm_first True: M2M100 has "
                         "output_bias False")
    if family == "m2m_100" and config.src_vocab_size != config.tgt_vocab_size:
        raise ValueError(f"tgt_vocab_size {config.tgt_vocab_size} is not supported by {target} with norm_first "
                         f"True: M2M100 has one vocabulary (src_vocab_size {config.src_vocab_size})")
    return family


def hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of the family's model (read back by :func:`.hf_import.config_from_hf`)."""
    family = family_of(config)
    out: dict[str, Any] = {
        "model_type": family, "architectures": [ARCHITECTURES[family]], "vocab_size": config.src_vocab_size,
        "d_model": config.d_model, "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers, "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads, "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff,
        "max_position_embeddings": config.max_len, "activation_function": HF_ACTIVATIONS[config.activation],
        "scale_embedding": config.scale_embeddings, "dropout": config.dropout, "attention_dropout": 0.0,
        "activation_dropout": 0.0, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0,
        "tie_word_embeddings": config.share_embeddings, "is_encoder_decoder": True, **special_ids(config)}
    if family == "marian":
        out.update(share_encoder_decoder_embeddings=config.share_embeddings,
                   decoder_vocab_size=config.tgt_vocab_size)
    return out


def special_ids(config: TransformerConfig) -> dict[str, Any]:
    """pad, bos, eos, the token decoding starts from (``config.start_id``) and the forced eos (Marian's config
    forces one by default; the reference only with ``forced_eos``: ``forced_last_id``)."""
    forced = config.forced_last_id if config.forced_eos else None
    return {"pad_token_id": config.pad_id, "bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
            "decoder_start_token_id": config.start_id, "forced_eos_token_id": forced}


def generation_config(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json``: the checkpoint's decoding conventions as transformers' ``generate`` reads them
    (module docstring), its beam ``beam_size`` (greedy by default)."""
    suppressed = (config.pad_id, config.bos_id) if config.suppressed_ids is None else config.suppressed_ids
    bad_words = {"bad_words_ids": [[token] for token in sorted(set(suppressed))]} if suppressed else {}
    return {**special_ids(config), "num_beams": config.beam_size, "do_sample": False,
            "max_length": generate_budget(config) + 1, **bad_words, "renormalize_logits": config.renormalize,
            "length_penalty": config.length_penalty, "early_stopping": config.early_stopping,
            "min_length": config.min_output_length, "no_repeat_ngram_size": config.no_repeat_ngram_size,
            "forced_bos_token_id": config.forced_bos_id}


def generate_budget(config: TransformerConfig) -> int:
    """The output budget of every sentence in ``generate``: ``max_output_length`` (capped at ``max_len``, as
    :func:`reference_numpy.decoding.max_output_lengths` caps it), or ``max_len``."""
    return min(config.max_len if config.max_output_length is None else config.max_output_length, config.max_len)


def halves_order(d_model: int) -> np.ndarray:
    """sigma: feature k of Marian's halves layout is feature sigma[k] of section 3.5's interleaved one (the sine of
    frequency i at 2i, its cosine at 2i + 1 -> at i and D/2 + i)."""
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def residual_axes(name: str) -> tuple[int, ...]:
    """The axes of checkpoint tensor ``name`` that index d_model features of the residual stream (weights stored
    (in, out)): embeddings' columns, the input rows of the projections reading the stream (q, k, v, W_1, the
    pre-softmax projection), the output columns and biases of those writing it (W_O, W_2), LayerNorms."""
    if name.endswith("embed.weight"):
        return (1,)
    if name == "generator.weight" or name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                    "linear1.weight")):
        return (0,)
    if name.endswith(("o_proj.weight", "linear2.weight")):
        return (1,)
    if name.endswith(("o_proj.bias", "linear2.bias")) or "norm." in name:
        return (0,)
    return ()


def permute_features(params: dict[str, np.ndarray], order: np.ndarray) -> dict[str, np.ndarray]:
    """Every tensor with its residual-stream features reordered, feature k of the result being feature
    ``order[k]`` of ``params`` (:func:`residual_axes`): an exact symmetry of the network (module docstring)."""
    out = {}
    for name, value in params.items():
        for axis in residual_axes(name):
            value = np.take(value, order, axis=axis)
        out[name] = value
    return out


def hf_weights(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The family's state dict of ``params`` (the checkpoint's dtype): the paper's interleaved model permuted to
    Marian's halves (:func:`permute_features`), each tensor under the first Hugging Face name
    :func:`.hf_import.weight_table` reads it from, transposed as :func:`.hf_import.transposed` says, its shape
    checked against the config's; Marian's ``final_logits_bias`` (1, V), zero without ``output_bias``."""
    family, shapes, flip = family_of(config), parameter_shapes(config), transposed(config)
    if config.sinusoidal_layout == "interleaved":
        params = permute_features(params, halves_order(config.d_model))
    out = {}
    for ours, candidates in weight_table(config, family).items():
        value = np.asarray(params[ours])
        if value.shape != shapes[ours]:
            raise ValueError(f"tensor {ours!r} has shape {value.shape}; the config gives it {shapes[ours]}")
        if ours != "generator.bias":                             # Marian's (1, V) buffer, below
            out[candidates[0]] = np.ascontiguousarray(value.T if ours in flip else value)
    if family == "marian":
        dtype = next(iter(out.values())).dtype
        bias = params["generator.bias"] if config.output_bias else np.zeros(config.tgt_vocab_size, dtype)
        out["final_logits_bias"] = np.asarray(bias).reshape(1, config.tgt_vocab_size)
    elif not config.share_embeddings:           # M2M100 always builds model.shared; untied, its forward pass reads
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]    # the encoder's own embed_tokens
    return out


def hf_tokenizer(tokenizer: str, config: TransformerConfig) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the checkpoint's BPE tokenizer (``tokenizer``, its JSON
    text, :mod:`.tokenizer`), for transformers' ``PreTrainedTokenizerFast``: the same normaliser, pieces and
    decoder, and a post-processor appending ``</s>`` (eos), as ``Tokenizer.batch`` ends every source; a special
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
    directory files are written back as they were: :func:`.hf_tokenizer.hf_tokenizer_files`) is given."""
    from safetensors.numpy import save_file

    root = Path(directory)
    files = {CONFIG_FILE: hf_config(config), GENERATION_FILE: generation_config(config)}
    weights = hf_weights(config, params)
    if tokenizer is not None and is_family_record(tokenizer):
        for file, data in hf_tokenizer_files(check_family_record(tokenizer, config)).items():
            (root / file).write_bytes(data)
    elif tokenizer is not None:
        text, files[TOKENIZER_CONFIG_FILE] = hf_tokenizer(tokenizer, config)
        (root / TOKENIZER_FILE).write_text(text, encoding="utf-8")
    for name, content in files.items():
        (root / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    save_file(weights, root / SAFETENSORS_FILE, metadata={"format": "pt"})
