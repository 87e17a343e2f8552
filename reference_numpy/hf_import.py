"""A Hugging Face Marian (opus-mt) or M2M100/NLLB model directory as this project's config and weights.

``import_hf(DIRECTORY, OUT)`` (``transformer-reference import DIRECTORY OUT``) reads the directory's ``config.json``
and its weights -- ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) through safetensors' own
reader, or a pickled ``pytorch_model.bin`` (or the shards of ``pytorch_model.bin.index.json``) only through
``torch.load(weights_only=True)`` -- and writes one shared
checkpoint (docs/checkpoint-format.md), with the directory's tokenizer when it has one
(:mod:`reference_numpy.hf_tokenizer`, whose SentencePiece conversion uses transformers' converter). The weights'
import runs no transformers code.

The families, as transformers defines them (``models/marian/modeling_marian.py``, ``models/m2m_100/``):

* ``marian``: post-LN layers (``LayerNorm(x + Sublayer(x))``), no final stack norms, the sinusoid in two halves
  (sines, then cosines) at positions 0, 1, ..., the activation ``activation_function`` ("swish" is SiLU),
  ``scale_embedding``, a bias on the logits (``final_logits_bias``, here ``generator.bias``);
* ``m2m_100`` (M2M100 and NLLB): pre-LN layers with a final LayerNorm after each stack, fairseq's sinusoid (positions
  from ``pad_token_id + 1`` over the non-pad tokens), ReLU or GELU, no logits bias.

Both use ``nn.LayerNorm``'s epsilon 1e-5 and the same attention (q, k, v and out projections with biases; the
queries scaled by d_k^-0.5 before the product, the same function as Eq. (1)). Every ``nn.Linear`` stores its
weight (out, in), this project (in, out): the names in :data:`TRANSPOSED` are transposed, every tensor's shape is
asserted against the config. Anything outside the space the reference defines is refused with one ``ValueError``
line naming the field (or tensor).

Special ids and decoding: the project's config holds three different ids pad, bos, eos, and the decoding conventions
of ``reference_numpy/decoding.py``, set from ``generation_config.json`` (or, without it, the same fields of
``config.json``, as older files hold them) as transformers' ``generate`` reads them: ``decoder_start_token_id`` is
``decoder_start_id`` (Marian's pad, M2M100/NLLB's eos); ``bad_words_ids`` of one token each are ``suppressed_ids``
(Marian's pad; nothing else is suppressed: transformers may emit any other token), ``renormalize_logits`` is
``renormalize`` (opus-mt's generation configs set it); ``forced_eos_token_id`` (Marian's
eos; id 0 in a Marian config that names no other, whatever its eos) is ``forced_eos`` with ``forced_eos_id`` when it is
not eos; beam search is transformers' (``length_normalization`` "hf") with its ``length_penalty``
(1.0 by default) and ``early_stopping`` (False by default); ``num_beams`` (1 by default) is ``beam_size``, the beam
the decoding commands use when given none. A setting with which ``generate`` would choose other tokens than the
reference can (:data:`GENERATE_NEUTRAL`: sampling, repetition penalties, the encoder's n-gram blocking, ...) is
refused, naming it; ``min_length`` (counting the start token and not eos) is ``min_output_length`` (eos held back
below that output step), ``min_new_tokens`` + 1 when that is set (``generate`` lets it take precedence), and
``no_repeat_ngram_size`` the config's. The output budget is ``generate``'s: ``max_new_tokens``, or else
``max_length`` less the decoder start token it counts, or else transformers' default of 20 new tokens
(:data:`GENERATE_NEW_TOKENS`), as ``max_output_length`` (every sentence's, where section 6.1 gives each its source
length + 50); ``max_len``
(``max_position_embeddings``) caps it as it caps transformers' default. ``forced_bos_token_id`` is ``forced_bos_id``,
the first token decoding forces when a call names none (M2M100/NLLB's target language is given per call, by
``translate --target-lang``).
Marian has no bos of its own (its ``bos_token_id``, if any, is eos): the import keeps pad and eos and takes as
``bos_id`` the lowest id that is neither -- unless ``decoder_start_token_id`` is neither, as in a Marian model this
project exported (:mod:`.hf_export`), which starts from its bos; M2M100/NLLB's ``bos_token_id`` (0) is kept.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.checkpoint import parameter_shapes, save_checkpoint
from reference_numpy.config import MAX_BEAM_SIZE, MAX_LEN_LIMIT, TransformerConfig
from reference_numpy.hf_tokenizer import read_hf_tokenizer, tokenizer_files

FAMILIES = ("marian", "m2m_100")
# transformers' ACT2FN names -> the reference's activation (reference_numpy.model.activation): "gelu" is the exact
# erf form (GELUActivation), "swish" and "silu" are x sigmoid(x)
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu"}
LAYER_NORM_EPS = 1e-5                              # nn.LayerNorm's default, which both families construct with
CONFIG_FILE, SAFETENSORS_FILE, SHARDED_INDEX, PICKLE_FILE, PICKLE_INDEX = (
    "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json")              # in the order transformers' from_pretrained looks for them
GENERATION_FILE = "generation_config.json"
GENERATE_NEW_TOKENS = 20         # generate's budget without max_new_tokens or max_length (its default max_length 20)
# Fields of older config.json files (BART's lineage) that transformers' Marian and M2M100 no longer read: each must
# hold the value the family's code computes, or the file describes another model
LEGACY_FIELDS: dict[str, dict[str, Any]] = {
    "marian": {"normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
               "static_position_embeddings": True, "add_bias_logits": False, "layernorm_embedding": False},
    "m2m_100": {"normalize_before": True, "normalize_embedding": False, "add_final_layer_norm": True,
                "static_position_embeddings": True, "add_bias_logits": False, "layernorm_embedding": False},
}
# transformers' generation settings that make ``generate`` choose other tokens than the reference's decoding, with
# the values that leave it unchanged (transformers' own defaults, GenerationConfig._get_default_generation_params):
# any other value is refused, naming the field. The sampling parameters (temperature, top_k, ...) act only with
# do_sample, so they are not among them.
GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "do_sample": (False,), "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,), "encoder_no_repeat_ngram_size": (0,),
    "num_beam_groups": (1,), "diversity_penalty": (0.0,), "penalty_alpha": (0.0,), "guidance_scale": (1.0,),
    "sequence_bias": ({}, []), "force_words_ids": ([],), "constraints": ([],), "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],), "exponential_decay_length_penalty": (), "stop_strings": ([],),
    "token_healing": (False,), "dola_layers": (), "watermarking_config": (), "forced_decoder_ids": ([],)}
# Fields that name another model when present with any value but these
ABSENT_OR: dict[str, tuple[Any, ...]] = {"position_embedding_type": ("absolute",), "num_experts": (0, None),
                                         "is_decoder": (False,), "add_cross_attention": (False,)}


def config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Hugging Face ``config.json`` (a dict) and ``generation_config.json``
    (``generation``; None: the same fields of ``config.json``); one ``ValueError`` line naming the first field outside
    the supported space."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"config.json model_type {family!r} is not supported (supported: "
                         f"{', '.join(repr(name) for name in FAMILIES)}: Marian/opus-mt, M2M100 and NLLB)")
    for name, value in LEGACY_FIELDS[family].items():
        if name in hf and hf[name] != value:
            raise ValueError(f"config.json {name} {hf[name]!r} is not supported: {family} models here have "
                             f"{name} {value!r}")
    for name, values in ABSENT_OR.items():
        if name in hf and hf[name] not in values:
            raise ValueError(f"config.json {name} {hf[name]!r} is not supported (supported: "
                             f"{', '.join(repr(value) for value in values if value is not None)} or absent)")
    for name in ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings"):
        if name in hf and not isinstance(hf[name], bool):
            raise ValueError(f"config.json {name} must be true or false, got {hf[name]!r}")
    activation = hf.get("activation_function", "gelu" if family == "marian" else "relu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"config.json activation_function {activation!r} is not supported (supported: "
                         f"{', '.join(repr(name) for name in ACTIVATIONS)})")
    for encoder, decoder in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if _field(hf, encoder) != _field(hf, decoder):
            raise ValueError(f"config.json {decoder} {hf[decoder]!r} differs from {encoder} {hf[encoder]!r}: the "
                             "reference's encoder and decoder layers have one size")
    vocab = _field(hf, "vocab_size")
    if family == "marian":
        share_sides = bool(hf.get("share_encoder_decoder_embeddings", True))
        tgt_vocab = vocab if share_sides or hf.get("decoder_vocab_size") is None else _field(hf, "decoder_vocab_size")
    else:
        share_sides, tgt_vocab = True, vocab
    share = share_sides and bool(hf.get("tie_word_embeddings", True))
    pad, eos = _field(hf, "pad_token_id"), _field(hf, "eos_token_id")
    bos = hf.get("decoder_start_token_id" if family == "marian" else "bos_token_id")
    if not isinstance(bos, int) or isinstance(bos, bool) or bos in (pad, eos):
        bos = min(set(range(3)) - {pad, eos})               # see the module docstring
    dropout = hf.get("dropout", 0.1)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ValueError(f"config.json dropout must be a number in [0, 1), got {dropout!r}")
    max_len = _field(hf, "max_position_embeddings")
    if max_len > MAX_LEN_LIMIT:
        raise ValueError(f"config.json max_position_embeddings {max_len} is not supported (at most {MAX_LEN_LIMIT})")
    sizes: dict[str, Any] = {field: _field(hf, name) for field, name in (
        ("d_model", "d_model"), ("n_heads", "encoder_attention_heads"), ("d_ff", "encoder_ffn_dim"),
        ("n_encoder_layers", "encoder_layers"), ("n_decoder_layers", "decoder_layers"))}
    conventions = decoding_conventions(hf if generation is None else generation, (pad, bos, eos), max_len,
                                       "config.json" if generation is None else GENERATION_FILE)
    try:                                   # the fields above name their own file; the config's checks name none
        return TransformerConfig(
            src_vocab_size=vocab, tgt_vocab_size=tgt_vocab, **sizes,
            dropout=float(dropout), layer_norm_eps=LAYER_NORM_EPS, norm_first=family == "m2m_100",
            positional_encoding="sinusoidal", max_len=max_len, share_embeddings=share, pad_id=pad, bos_id=bos,
            eos_id=eos, activation=ACTIVATIONS[activation],
            sinusoidal_layout="halves" if family == "marian" else "fairseq",
            scale_embeddings=bool(hf.get("scale_embedding", family == "m2m_100")), output_bias=family == "marian",
            **conventions)
    except ValueError as err:
        raise ValueError(f"config.json: {str(err).splitlines()[0]}") from None


def decoding_conventions(generation: dict[str, Any], ids: tuple[int, int, int], max_len: int,
                         source: str) -> dict[str, Any]:
    """The config's decoding fields from transformers' generation settings (``source``: the file they come from;
    the module docstring says which) for the model's (pad, bos, eos) ``ids`` and ``max_position_embeddings``
    (``max_len``), each refused in one line naming the field when transformers would decode otherwise than the
    reference can: a bad word of several tokens, several forced eos tokens. A start token that is bos and
    suppressed tokens that are pad and bos are the config's defaults (None), as a checkpoint exported by
    :mod:`.hf_export` holds them."""
    pad, bos, eos = ids
    _check_neutral(generation, eos, source)
    start = generation.get("decoder_start_token_id")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"{source} decoder_start_token_id must be an int >= 0, got {start!r}")
    bad = generation.get("bad_words_ids") or []
    if not isinstance(bad, list) or any(not isinstance(word, list) or len(word) != 1 for word in bad):
        raise ValueError(f"{source} bad_words_ids {bad!r} is not supported: only words of one token each")
    forced_eos = _forced_eos(generation, source)
    length_penalty = generation.get("length_penalty", 1.0)
    if not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool) or not length_penalty >= 0:
        raise ValueError(f"{source} length_penalty must be a number >= 0 (the reference's stopping rules need lp "
                         f"to grow with length), got {length_penalty!r}")
    early_stopping = generation.get("early_stopping", False)
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise ValueError(f"{source} early_stopping must be true, false or \"never\", got {early_stopping!r}")
    beams = generation.get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or not 1 <= beams <= MAX_BEAM_SIZE:
        raise ValueError(f"{source} num_beams must be an int from 1 to {MAX_BEAM_SIZE}, got {beams!r}")
    renormalize = generation.get("renormalize_logits", False)
    if not isinstance(renormalize, bool):
        raise ValueError(f"{source} renormalize_logits must be true or false, got {renormalize!r}")
    suppressed = [word[0] for word in bad]
    for name in ("min_length", "min_new_tokens", "no_repeat_ngram_size"):
        value = generation.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{source} {name} must be an int >= 0, got {value!r}")
    forced_bos = generation.get("forced_bos_token_id")
    if forced_bos is not None and (not isinstance(forced_bos, int) or isinstance(forced_bos, bool)
                                   or forced_bos < 0 or forced_bos in (pad, eos)):
        raise ValueError(f"{source} forced_bos_token_id {forced_bos!r} is not supported: only a token id other than "
                         f"pad ({pad}) and eos ({eos}), or none")
    # generate replaces min_length by min_new_tokens + its input length (the start token) when min_new_tokens is set
    min_new_tokens = generation.get("min_new_tokens")
    return dict(decoder_start_id=None if start == bos else start,
                suppressed_ids=None if sorted(suppressed) == sorted({pad, bos}) else suppressed,
                renormalize=renormalize, max_output_length=_new_tokens(generation, max_len, source),
                forced_eos=forced_eos is not None, forced_eos_id=None if forced_eos in (None, eos) else forced_eos,
                length_normalization="hf", length_penalty=length_penalty, early_stopping=early_stopping,
                beam_size=beams, forced_bos_id=forced_bos,
                no_repeat_ngram_size=generation.get("no_repeat_ngram_size") or 0,
                min_output_length=(generation.get("min_length") or 0) if min_new_tokens is None else min_new_tokens + 1)


def _forced_eos(generation: dict[str, Any], source: str) -> int | None:
    """The token ``generate`` forces at the last step (``forced_eos_token_id``: an id, or a list of one), or None;
    several are refused (transformers would give each the same score 0 and choose by ties)."""
    forced = generation.get("forced_eos_token_id")
    if isinstance(forced, list) and len(forced) == 1:
        forced = forced[0]
    if forced is None or (isinstance(forced, int) and not isinstance(forced, bool) and forced >= 0):
        return forced
    raise ValueError(f"{source} forced_eos_token_id {forced!r} is not supported: only one token id or none")


def _new_tokens(generation: dict[str, Any], max_len: int, source: str) -> int:
    """``generate``'s budget of new tokens (transformers' ``_prepare_generated_length`` for an encoder-decoder,
    whose decoder input is the start token alone): ``max_new_tokens``, else ``max_length`` - 1, else 20 -- its
    default, which it caps at ``max_position_embeddings`` (``max_len``) with the start token."""
    for name, minimum in (("max_new_tokens", 1), ("max_length", 2)):
        value = generation.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{source} {name} must be an int >= {minimum}, got {value!r}")
        return value if name == "max_new_tokens" else value - 1
    return max(1, min(GENERATE_NEW_TOKENS, max_len - 1))


def _check_neutral(generation: dict[str, Any], eos: int, source: str) -> None:
    """One ``ValueError`` line naming the first generation setting (:data:`GENERATE_NEUTRAL`, or an
    ``eos_token_id`` other than the model's) with which ``generate`` would choose other tokens than the reference."""
    for name, neutral in GENERATE_NEUTRAL.items():
        value = generation.get(name)
        if value is not None and not any(value == allowed and isinstance(value, bool) == isinstance(allowed, bool)
                                         for allowed in neutral):
            raise ValueError(f"{source} {name} {value!r} is not supported: generate would choose other tokens than "
                             "every backend here; without the field the model imports, decoding as the reference")
    if generation.get("eos_token_id") not in (None, eos, [eos]):
        raise ValueError(f"{source} eos_token_id {generation['eos_token_id']!r} is not supported: only config.json's "
                         f"eos_token_id ({eos})")


def _field(hf: dict[str, Any], name: str) -> int:
    """An int field: ids >= 0, sizes >= 1."""
    value, minimum = hf.get(name), 0 if name.endswith("_id") else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"config.json {name} must be an int >= {minimum}, got {value!r}")
    return value


def weight_table(config: TransformerConfig, family: str, tie_output: bool = True) -> dict[str, tuple[str, ...]]:
    """Checkpoint tensor name -> the Hugging Face state-dict names that may hold it, the first present wins (a file
    saved with tied weights holds the shared matrix once, older files every copy). With ``share_embeddings`` false
    the target embedding and the projection may be one tied matrix in the file (``tie_output``, the config's
    ``tie_word_embeddings``): both are read from it; else the projection is ``lm_head`` alone, and each side's
    embedding its own ``embed_tokens`` (transformers 5 ties nothing without ``tie_word_embeddings``, leaving
    ``model.shared`` unread by the forward pass), ``model.shared`` only where a file lacks it."""
    table: dict[str, tuple[str, ...]] = {}
    if config.share_embeddings:
        table["shared_embed.weight"] = ("model.shared.weight", "model.encoder.embed_tokens.weight",
                                        "model.decoder.embed_tokens.weight", "lm_head.weight")
    else:
        table["src_embed.weight"] = ("model.encoder.embed_tokens.weight", "model.shared.weight")
        table["tgt_embed.weight"] = ("model.decoder.embed_tokens.weight", "model.shared.weight")
        table["generator.weight"] = (("lm_head.weight", "model.decoder.embed_tokens.weight", "model.shared.weight")
                                     if tie_output else ("lm_head.weight",))
    if config.output_bias:
        table["generator.bias"] = ("final_logits_bias",)
    for stack, layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"model.{stack}.layers.{i}"
            sublayers = [("self_attn", "self_attn", "self_attn_norm", "self_attn_layer_norm")]
            if stack == "decoder":
                sublayers.append(("cross_attn", "encoder_attn", "cross_attn_norm", "encoder_attn_layer_norm"))
            for attention, hf_attention, norm, hf_norm in sublayers:
                for proj, hf_proj in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                                      ("o_proj", "out_proj")):
                    _affine(table, f"{ours}.{attention}.{proj}", f"{theirs}.{hf_attention}.{hf_proj}")
                _affine(table, f"{ours}.{norm}", f"{theirs}.{hf_norm}")
            _affine(table, f"{ours}.ffn.linear1", f"{theirs}.fc1")
            _affine(table, f"{ours}.ffn.linear2", f"{theirs}.fc2")
            _affine(table, f"{ours}.ffn_norm", f"{theirs}.final_layer_norm")
        if config.norm_first:
            _affine(table, f"{stack}.norm", f"model.{stack}.layer_norm")
    return table


def _affine(table: dict[str, tuple[str, ...]], ours: str, theirs: str) -> None:
    table[f"{ours}.weight"], table[f"{ours}.bias"] = (f"{theirs}.weight",), (f"{theirs}.bias",)


def transposed(config: TransformerConfig) -> frozenset[str]:
    """The checkpoint tensors stored as the transpose of their Hugging Face tensor: every ``nn.Linear`` weight (the
    attention projections, fc1, fc2) and the separate output projection (HF's (V, D) ``lm_head`` or embedding)."""
    return frozenset(name for name in parameter_shapes(config)
                     if name.endswith(".weight") and ("_proj." in name or ".ffn.linear" in name
                                                      or name == "generator.weight"))


# Tensors a file may hold that the import does not read: the sinusoid tables of older files (computed from the
# config here, as in transformers) and transformers' position-id buffers
IGNORED_SUFFIXES = ("embed_positions.weight", "embed_positions.weights", "embed_positions._float_tensor")


def convert(config: TransformerConfig, family: str, weights: dict[str, np.ndarray], tie_output: bool = True,
            ) -> dict[str, np.ndarray]:
    """The checkpoint's tensors from a Hugging Face state dict (``weights``: name -> array), through
    :func:`weight_table` (``tie_output``: the config's ``tie_word_embeddings``) and :func:`transposed`, each shape
    asserted; a tensor of the file that the table does not read (other than a tied copy equal to the one read -- with
    ``tie_output`` false, the untied ``model.shared`` whatever it holds -- or a sinusoid table) is refused, naming
    it."""
    shapes, flip, params, read = parameter_shapes(config), transposed(config), {}, set()
    for ours, candidates in weight_table(config, family, tie_output).items():
        present = [name for name in candidates if name in weights]
        if not present:
            raise ValueError(f"the weights lack {candidates[0]!r} (the checkpoint's {ours!r})")
        value = np.asarray(weights[present[0]])
        if ours == "generator.bias":
            value = value.reshape(-1) if value.ndim == 2 and value.shape[0] == 1 else value   # (1, V) buffer
        value = value.T if ours in flip else value
        if value.shape != shapes[ours]:
            raise ValueError(f"tensor {present[0]!r} has shape {np.shape(weights[present[0]])}; the config gives "
                             f"the checkpoint's {ours!r} the shape {shapes[ours]}")
        params[ours] = np.ascontiguousarray(value)
        read.add(present[0])
        for copy in present[1:]:                        # a tied matrix saved twice must be one matrix
            if tie_output and not np.array_equal(np.asarray(weights[copy]), np.asarray(weights[present[0]])):
                raise ValueError(f"tensor {copy!r} differs from {present[0]!r}, which the config ties it to "
                                 "(share_encoder_decoder_embeddings / tie_word_embeddings)")
            read.add(copy)
    unread = sorted(name for name in weights if name not in read and not name.endswith(IGNORED_SUFFIXES))
    if unread:
        raise ValueError(f"tensor {unread[0]!r} is not part of a supported {family} model ({len(unread)} such)")
    return params


def read_config(directory: str | os.PathLike, name: str = CONFIG_FILE) -> dict[str, Any]:
    """The JSON object of the directory's ``config.json`` (or the file ``name``)."""
    path = Path(directory) / name
    if not Path(directory).is_dir():
        raise ValueError(f"{os.fspath(directory)!r} is not a directory (a Hugging Face model directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read {os.fspath(path)!r}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)!r} must hold a JSON object")
    return data


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The files the weights are read from, the first of these the directory holds: ``model.safetensors``, the
    shards its index names, ``pytorch_model.bin``, the shards its index names (a large M2M100 or NLLB model's)."""
    root = Path(directory)
    for name in (SAFETENSORS_FILE, SHARDED_INDEX, PICKLE_FILE, PICKLE_INDEX):
        if (root / name).exists():
            return _shards(root / name) if name.endswith(".index.json") else [root / name]
    raise ValueError(f"{os.fspath(root)!r} holds no {SAFETENSORS_FILE}, {SHARDED_INDEX}, {PICKLE_FILE} or "
                     f"{PICKLE_INDEX}")


def _shards(index_path: Path) -> list[Path]:
    """The files a sharded checkpoint's index names in its ``weight_map``: files of its own directory."""
    weight_map = read_config(index_path.parent, index_path.name).get("weight_map")
    shards = list(weight_map.values()) if isinstance(weight_map, dict) else []
    if not shards or any(not isinstance(shard, str) or Path(shard).name != shard for shard in shards):
        raise ValueError(f"{os.fspath(index_path)!r}: weight_map must name shard files of the directory")
    return [index_path.parent / shard for shard in sorted(set(shards))]


def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """The directory's state dict as NumPy arrays, float16 and bfloat16 widened to float32 (exactly)."""
    weights: dict[str, np.ndarray] = {}
    for path in weight_files(directory):
        if path.suffix == ".bin":                   # pytorch_model.bin, or a shard of its index
            weights.update(_read_pickle(path))
        else:
            weights.update(_read_safetensors(path))
    return weights


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file; bfloat16 ones (which NumPy has no type for) widened to float32 exactly, from their
    bytes (a bfloat16 number is the upper half of the float32 with the same value)."""
    from safetensors import safe_open
    try:
        with safe_open(os.fspath(path), framework="numpy") as file:
            names = list(file.keys())
            brain = {name for name in names if file.get_slice(name).get_dtype() == "BF16"}
            weights = {name: _widened(file.get_tensor(name)) for name in names if name not in brain}
    except Exception as err:  # noqa: BLE001 - OSError, or safetensors' SafetensorError: not a safetensors file
        raise ValueError(f"cannot read {os.fspath(path)!r}: {str(err).splitlines()[0]}") from None
    if brain:
        with open(path, "rb") as raw:               # the header safetensors has just validated
            size = int.from_bytes(raw.read(8), "little")
            header = json.loads(raw.read(size))
            for name in brain:
                begin, end = header[name]["data_offsets"]
                raw.seek(8 + size + begin)
                halves = np.frombuffer(raw.read(end - begin), dtype="<u2")
                weights[name] = (halves.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])
    return weights


def _read_pickle(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{os.fspath(path)!r} is a pickle: reading it needs PyTorch (its weights-only loader); "
                         "pip install 'transformer-reference[torch]', or give the model as model.safetensors") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - the weights-only unpickler refuses anything but tensors
        raise ValueError(f"cannot read {os.fspath(path)!r}: {_pickle_refusal(err)}; the import reads a pickle only "
                         "with torch's weights-only loader (or give the model as model.safetensors)") from None
    if not isinstance(state, dict):
        raise ValueError(f"{os.fspath(path)!r} does not hold a state dict")
    return {name: tensor.detach().float().numpy() if tensor.dtype in (torch.bfloat16, torch.float16)
            else tensor.detach().numpy() for name, tensor in state.items()}


def _pickle_refusal(err: Exception) -> str:
    """The reason torch's weights-only loader gave for refusing a file, in one line: the Python object it holds (a
    class the loader will not construct: unpickling one may run code), or torch's own words for a file that is no
    pickle of tensors -- without its advice to load the file anyway, or its terminal codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    unsafe = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if unsafe:
        return f"it holds a Python object ({unsafe.group(1)}) besides tensors, and unpickling one may run code"
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    first = detail.group(1) if detail else (text.strip().splitlines() or [type(err).__name__])[0]
    return f"it is not a pickle of tensors alone ({first.strip()})"


def _widened(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if array.dtype == np.float16 else array


def load_hf(directory: str | os.PathLike, dtype: Any = None) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """``(config, params)`` of a Hugging Face Marian or M2M100/NLLB directory, the weights in the file's float dtype
    (float16 as float32) or ``dtype``: what :func:`reference_numpy.checkpoint.load_checkpoint` returns for a
    shared checkpoint, so that ``reference_numpy.Transformer(*load_hf(directory))`` runs the model."""
    hf = read_config(directory)
    generation_path = Path(directory) / GENERATION_FILE
    config = config_from_hf(hf, read_config(directory, GENERATION_FILE) if generation_path.exists() else None)
    weights = read_weights(directory)
    floats = {np.dtype(value.dtype) for value in weights.values() if np.issubdtype(value.dtype, np.floating)}
    params = convert(config, hf["model_type"], weights, tie_output=hf.get("tie_word_embeddings", True) is True)
    target = np.dtype(dtype) if dtype is not None else (np.dtype(np.float64) if np.dtype(np.float64) in floats
                                                        else np.dtype(np.float32))
    return config, {name: value.astype(target, copy=False) for name, value in params.items()}


def import_hf(directory: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> TransformerConfig:
    """Write the directory's model as the shared checkpoint ``out``, with its tokenizer when the directory holds
    one (:mod:`reference_numpy.hf_tokenizer`; refused if it exists, unless ``force``, and never over a file the
    import reads); returns its config."""
    sources = ([Path(directory) / CONFIG_FILE, Path(directory) / GENERATION_FILE, *weight_files(directory),
                *tokenizer_files(directory)] if Path(directory).is_dir() else [])
    for source in sources:
        if os.path.exists(out) and source.exists() and os.path.samefile(out, source):
            raise ValueError(f"OUT: writing {os.fspath(out)!r} would replace the input {os.fspath(source)!r}; "
                             "write elsewhere")
    if os.path.lexists(out) and not force:
        raise ValueError(f"OUT: {os.fspath(out)!r} already exists; pass --force to replace it")
    config, params = load_hf(directory)
    save_checkpoint(out, config, params, tokenizer=read_hf_tokenizer(directory, config))
    return config
