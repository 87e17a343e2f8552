"""A Hugging Face model directory of a supported family as this project's config and weights.

``import_hf(DIRECTORY, OUT)`` (``transformer-reference import DIRECTORY OUT``) reads the directory's ``config.json``
and its weights (:mod:`.files`) and writes one shared checkpoint (docs/checkpoint-format.md), with the directory's
tokenizer when it has one (:mod:`.tokenizers`, whose SentencePiece conversion uses transformers' converter). The
weights' import runs no transformers code.

The family is ``config.json``'s ``model_type``, looked up in :mod:`.registry`; its module gives what sets it apart
(:class:`.family.Family`), and this driver the rest, which the families share: the sizes (encoder and decoder layers
of one size), ``dropout``, ``max_position_embeddings`` (``max_len``, at most 65,536), the activation
(transformers' ``ACT2FN`` names, :data:`ACTIVATIONS`), ``scale_embedding``, ``nn.LayerNorm``'s epsilon 1e-5, the
special ids, and the decoding conventions of ``generation_config.json`` (:mod:`.generation`). Every family here uses
the same attention (q, k, v and out projections with biases; the queries scaled by d_k^-0.5 before the product, the
same function as Eq. (1)). Anything outside the space the reference defines is refused with one ``ValueError`` line
naming the field (or tensor).

Special ids: the project's config holds three different ids pad, bos and eos. The import keeps pad and eos, and
takes as ``bos_id`` the family's ``BOS_FIELD`` unless it is pad or eos or absent, then the lowest id that is neither
(Marian has no bos of its own: :mod:`.marian`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from reference_numpy.checkpoint import save_checkpoint
from reference_numpy.config import MAX_LEN_LIMIT, TransformerConfig

from . import weights
from .family import LAYER_NORM_EPS, field
from .files import CONFIG_FILE, GENERATION_FILE, read_config, read_generation, read_weights, weight_files
from .generation import decoding_conventions
from .registry import family
from .tokenizers import read_hf_tokenizer, tokenizer_files

# transformers' ACT2FN names -> the reference's activation (reference_numpy.model.activation): "gelu" is the exact
# erf form (GELUActivation), "swish" and "silu" are x sigmoid(x)
ACTIVATIONS = {"relu": "relu", "swish": "silu", "silu": "silu", "gelu": "gelu"}
# Fields that name another model when present with any value but these
ABSENT_OR: dict[str, tuple[Any, ...]] = {"position_embedding_type": ("absolute",), "num_experts": (0, None),
                                         "is_decoder": (False,), "add_cross_attention": (False,)}


def config_from_hf(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> TransformerConfig:
    """The :class:`TransformerConfig` of a Hugging Face ``config.json`` (a dict) and ``generation_config.json``
    (``generation``; None: the same fields of ``config.json``); one ``ValueError`` line naming the first field outside
    the supported space."""
    chosen = family(hf.get("model_type"))
    for name, value in chosen.LEGACY_FIELDS.items():
        if name in hf and hf[name] != value:
            raise ValueError(f"config.json {name} {hf[name]!r} is not supported: {chosen.MODEL_TYPE} models here have "
                             f"{name} {value!r}")
    for name, values in ABSENT_OR.items():
        if name in hf and hf[name] not in values:
            raise ValueError(f"config.json {name} {hf[name]!r} is not supported (supported: "
                             f"{', '.join(repr(value) for value in values if value is not None)} or absent)")
    for name in ("scale_embedding", "share_encoder_decoder_embeddings", "tie_word_embeddings"):
        if name in hf and not isinstance(hf[name], bool):
            raise ValueError(f"config.json {name} must be true or false, got {hf[name]!r}")
    activation = hf.get("activation_function", chosen.DEFAULTS["activation_function"])
    if activation not in ACTIVATIONS:
        raise ValueError(f"config.json activation_function {activation!r} is not supported (supported: "
                         f"{', '.join(repr(name) for name in ACTIVATIONS)})")
    for encoder, decoder in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if field(hf, encoder) != field(hf, decoder):
            raise ValueError(f"config.json {decoder} {hf[decoder]!r} differs from {encoder} {hf[encoder]!r}: the "
                             "reference's encoder and decoder layers have one size")
    architecture = chosen.architecture(hf)
    pad, eos = field(hf, "pad_token_id"), field(hf, "eos_token_id")
    bos = hf.get(chosen.BOS_FIELD)
    if not isinstance(bos, int) or isinstance(bos, bool) or bos in (pad, eos):
        bos = min(set(range(3)) - {pad, eos})               # see the module docstring
    dropout = hf.get("dropout", 0.1)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ValueError(f"config.json dropout must be a number in [0, 1), got {dropout!r}")
    max_len = field(hf, "max_position_embeddings")
    if max_len > MAX_LEN_LIMIT:
        raise ValueError(f"config.json max_position_embeddings {max_len} is not supported (at most {MAX_LEN_LIMIT})")
    sizes: dict[str, Any] = {name: field(hf, hf_name) for name, hf_name in (
        ("d_model", "d_model"), ("n_heads", "encoder_attention_heads"), ("d_ff", "encoder_ffn_dim"),
        ("n_encoder_layers", "encoder_layers"), ("n_decoder_layers", "decoder_layers"))}
    decoding = decoding_conventions(hf if generation is None else generation, (pad, bos, eos), max_len,
                                    CONFIG_FILE if generation is None else GENERATION_FILE)
    try:                                   # the fields above name their own file; the config's checks name none
        return TransformerConfig(
            **sizes, **architecture, dropout=float(dropout), layer_norm_eps=LAYER_NORM_EPS, max_len=max_len,
            pad_id=pad, bos_id=bos, eos_id=eos, activation=ACTIVATIONS[activation],
            scale_embeddings=bool(hf.get("scale_embedding", chosen.DEFAULTS["scale_embedding"])), decoding=decoding)
    except ValueError as err:
        raise ValueError(f"config.json: {str(err).splitlines()[0]}") from None


def convert(config: TransformerConfig, model_type: str, state: dict[str, np.ndarray], tie_output: bool = True,
            ) -> dict[str, np.ndarray]:
    """The checkpoint's tensors from a Hugging Face state dict (``state``: name -> array) of the family of
    ``model_type``, through its weight table (``tie_output``: the config's ``tie_word_embeddings``; each tensor
    transposed as the table says, its shape asserted; :func:`.weights.read`)."""
    chosen = family(model_type)
    return weights.read(config, chosen.weight_table(config, tie_output), state, chosen.MODEL_TYPE, chosen.IGNORED,
                        tie_output)


def load_hf(directory: str | os.PathLike, dtype: Any = None) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """``(config, params)`` of a Hugging Face directory of a supported family, the weights in the file's float
    dtype (float16 as float32) or ``dtype``: what :func:`reference_numpy.checkpoint.load_checkpoint` returns for a
    shared checkpoint, so that ``reference_numpy.Transformer(*load_hf(directory))`` runs the model."""
    hf = read_config(directory)
    config = config_from_hf(hf, read_generation(directory))
    state = read_weights(directory)
    floats = {np.dtype(value.dtype) for value in state.values() if np.issubdtype(value.dtype, np.floating)}
    params = convert(config, hf["model_type"], state, tie_output=hf.get("tie_word_embeddings", True) is True)
    target = np.dtype(dtype) if dtype is not None else (np.dtype(np.float64) if np.dtype(np.float64) in floats
                                                        else np.dtype(np.float32))
    return config, {name: value.astype(target, copy=False) for name, value in params.items()}


def read_hf_directory(directory: str | os.PathLike) -> tuple[TransformerConfig, dict[str, np.ndarray], str | None]:
    """``(config, params, tokenizer JSON text or None)`` of a Hugging Face model directory, as its import would
    write them (:func:`import_hf`), held in memory, the weights in the file's dtype."""
    config, params = load_hf(directory)
    return config, params, read_hf_tokenizer(directory, config)


def import_hf(directory: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> TransformerConfig:
    """Write the directory's model as the shared checkpoint ``out``, with its tokenizer when the directory holds
    one (:mod:`.tokenizers`; refused if it exists, unless ``force``, and never over a file the import reads);
    returns its config."""
    sources = ([Path(directory) / CONFIG_FILE, Path(directory) / GENERATION_FILE, *weight_files(directory),
                *tokenizer_files(directory)] if Path(directory).is_dir() else [])
    for source in sources:
        if os.path.exists(out) and source.exists() and os.path.samefile(out, source):
            raise ValueError(f"OUT: writing {os.fspath(out)!r} would replace the input {os.fspath(source)!r}; "
                             "write elsewhere")
    if os.path.lexists(out) and not force:
        raise ValueError(f"OUT: {os.fspath(out)!r} already exists; pass --force to replace it")
    config, params, tokenizer = read_hf_directory(directory)
    save_checkpoint(out, config, params, tokenizer=tokenizer)
    return config
