"""Export a shared checkpoint to a CTranslate2 model directory (``transformer-reference export --to ctranslate2``).

CTranslate2 (https://github.com/OpenNMT/CTranslate2) is a C++ inference engine for exactly the
encoder-decoder of section 3. The export goes through its own Python model specification,
``ctranslate2.specs.TransformerSpec`` (a ``TransformerEncoderSpec`` and a ``TransformerDecoderSpec``),
filled in the form of the project's other converters: an exact :func:`name_table` (checkpoint
name -> CTranslate2 variable), :func:`transposed` (every projection: ours are stored (in, out),
CTranslate2's (out, in)), and a shape check of every tensor against :func:`variable_shapes`,
computed from the config alone. The spec then checks itself (``validate``), aliases tied tensors
(``optimize``) and writes ``model.bin``, ``config.json`` and the vocabularies (``save``).

What maps where (section numbers are the paper's):

* embeddings (section 3.4): ``src_embed``/``tgt_embed`` (or ``shared_embed`` for both) ->
  ``encoder/embeddings_0``, ``decoder/embeddings``, with CTranslate2's ``scale_embeddings``
  (multiply by sqrt(d_model)); the pre-softmax projection ``generator`` (or, tied, the shared
  embedding) -> ``decoder/projection`` (no bias);
* positional encodings (section 3.5): the table is written into ``encoder/position_encodings``
  and ``decoder/position_encodings`` explicitly, (max_len, d_model) rows -- our interleaved
  sin/cos table (:func:`reference_numpy.model.sinusoidal_positional_encoding`) or the learned one;
  CTranslate2's own sinusoid (sines then cosines, not interleaved) is never used;
* attention (section 3.2.2): self-attention q, k, v -> one fused ``linear_0`` stacked [W_q; W_k; W_v]
  along the output axis; cross-attention q -> ``linear_0`` and k, v -> fused ``linear_1`` [W_k; W_v];
  ``o_proj`` -> the last linear. Heads are head-major on both sides;
* LayerNorm (section 3.1): each sublayer's norm -> that sublayer's ``layer_norm`` (gamma, beta);
  ``norm_first`` -> ``pre_norm`` (with the final ``encoder/layer_norm``, ``decoder/layer_norm``),
  post-LN -> ``pre_norm=False`` and no final norm; ``layer_norm_eps`` -> ``layer_norm_epsilon``;
* feed-forward (Eq. 2): ``linear1``, ``linear2`` -> ``ffn/linear_0``, ``ffn/linear_1``, ReLU.

Vocabularies: CTranslate2 takes token strings; the export names each id (:func:`token_names`).
A checkpoint with a tokenizer (section 5.1's shared BPE vocabulary, :mod:`reference_numpy.tokenizer`)
gives each id its BPE piece, so that CTranslate2 translates text: the directory also holds the
tokenizer (``tokenizer.json``, the checkpoint's own JSON text), the source is the tokenizer's pieces
and CTranslate2 appends ``</s>`` to it (as ``Tokenizer.batch`` appends eos); an id beyond the
tokenizer's vocabulary is ``<N>``. Without a tokenizer every id N is ``<N>``, except ``<pad>``,
``<s>`` and ``</s>`` at the config's pad, bos and eos ids, and the caller passes the source's eos
itself (:func:`to_tokens` and :func:`to_ids` convert between id rows and these strings). Either way
``<s>`` is CTranslate2's decoder start token, ``</s>`` its end token, and ``<pad>`` its unknown token
(so that no token is appended beyond the model's vocabulary, and ``disable_unk`` suppresses pad);
no bos is added to the source.

CTranslate2 stores float32, float16, bfloat16, int8 and int16 weights, never float64: the export
writes float32 (a float64 checkpoint is rounded to float32, as the float32 reference rounds it).
Anything the export cannot represent is refused before anything is written, with one
``ValueError`` naming the field or tensor. An existing output directory is never replaced unless
``force=True``; the model is written into a temporary sibling directory and renamed into place.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reference_numpy.checkpoint import RECORD, load_checkpoint, stored_tokenizer
from reference_numpy.config import PAPER_CHOICES, TransformerConfig, refuse_choices
from reference_numpy.model import sinusoidal_positional_encoding
from transformer_export.outputs import refuse_input
from transformer_hf.tokenizers import load_tokenizer_json

INSTALL = "pip install 'transformer-reference[peers]'"
SPECIAL_TOKENS = {"pad_id": "<pad>", "bos_id": "<s>", "eos_id": "</s>"}
TOKENIZER_FILE = "tokenizer.json"
INT16_MAX = np.iinfo(np.int16).max   # CTranslate2 stores num_heads as int16


def require_ctranslate2():
    """The ``ctranslate2`` module, or a ``ValueError`` naming the extra that installs it."""
    try:
        return importlib.import_module("ctranslate2")
    except ModuleNotFoundError:
        raise ValueError(f"exporting to CTranslate2 needs ctranslate2: {INSTALL}") from None


# ----------------------------------------------------------------------------- vocabularies

def token_names(config: TransformerConfig, size: int, tokenizer: str | None = None) -> list[str]:
    """The token string of every id below ``size``: the BPE piece of each id of ``tokenizer`` (a checkpoint's
    tokenizer JSON text, whose specials sit at the config's ids), else ``<pad>``, ``<s>``, ``</s>`` at the
    special ids; ``<N>`` for every other id. A ``ValueError`` if two ids get one name (CTranslate2 looks
    tokens up by name)."""
    names = {getattr(config, field): name for field, name in SPECIAL_TOKENS.items()}
    if tokenizer is not None:
        names = tokenizer_pieces(tokenizer)
    out = [names.get(i, f"<{i}>") for i in range(size)]
    if len(set(out)) != len(out):
        twice = next(name for name in out if out.count(name) > 1)
        raise ValueError(f"token {twice!r} names two ids of the vocabulary; CTranslate2 needs one name per id")
    return out


def tokenizer_pieces(tokenizer: str) -> dict[int, str]:
    """``{id: piece}`` of a tokenizer's JSON text (its BPE vocabulary and its added special tokens; an imported
    family's record: its vocabulary, :mod:`transformer_hf.tokenizers`)."""
    data = json.loads(tokenizer)
    if stored_tokenizer(tokenizer).kind == RECORD:
        return {int(i): piece for piece, i in data["vocab"].items()}
    pieces = {int(i): token for token, i in data["model"]["vocab"].items()}
    pieces.update({int(token["id"]): token["content"] for token in data["added_tokens"]})
    return pieces


def to_tokens(config: TransformerConfig, rows: npt.ArrayLike, size: int) -> list[list[str]]:
    """Rows of ids (B, T) as CTranslate2 token lists, each row's trailing padding removed.

    CTranslate2 masks a source by its length only, so a pad id inside a row (which the reference masks)
    cannot be passed on: it is refused."""
    names = token_names(config, size)
    batch = []
    for b, row in enumerate(np.asarray(rows)):
        ids = [int(i) for i in row]
        while ids and ids[-1] == config.pad_id:
            ids.pop()
        if config.pad_id in ids:
            raise ValueError(f"row {b} holds pad_id ({config.pad_id}) before its last token; CTranslate2 masks "
                             "padding by length only")
        batch.append([names[i] for i in ids])
    return batch


def to_ids(config: TransformerConfig, rows: Iterable[list[str]], size: int) -> np.ndarray:
    """CTranslate2 token lists as rows of ids (B, L), right-padded with ``pad_id``."""
    index = {name: i for i, name in enumerate(token_names(config, size))}
    ids = [[index[token] for token in row] for row in rows]
    out = np.full((len(ids), max((len(row) for row in ids), default=0)), config.pad_id, dtype=np.int64)
    for b, row_ids in enumerate(ids):
        out[b, :len(row_ids)] = row_ids
    return out


def translate_options(max_length: int, beam_size: int = 1, alpha: float = 0.0, forced: bool = False) -> dict:
    """Keyword arguments of ``ctranslate2.Translator.translate_batch`` that follow the reference's decoding
    (section 6.1, ``reference_numpy/decoding.py``) as far as CTranslate2 can: at most ``max_length`` tokens,
    eos counted and returned, eos allowed from the first step, pad (CTranslate2's unknown token) and bos
    never emitted, no source truncation; ``forced`` makes every output exactly ``max_length`` tokens long.

    What CTranslate2 cannot express: it suppresses pad and bos on the logits, so its log-probabilities are
    renormalized over the other tokens (the reference's are not); its beam search divides a finished
    hypothesis's score by |Y|^alpha, not by GNMT's ((5 + |Y|) / 6)^alpha, and stops once ``beam_size``
    hypotheses have finished. Greedy tokens are the same; beam search may differ (docs/peers.md)."""
    return {"beam_size": beam_size, "length_penalty": alpha, "max_decoding_length": max_length,
            "min_decoding_length": max_length if forced else 0, "return_end_token": True, "disable_unk": True,
            "suppress_sequences": [[SPECIAL_TOKENS["bos_id"]]], "max_input_length": 0, "return_scores": True}


# ----------------------------------------------------------------------------- the name table

def name_table(config: TransformerConfig) -> dict[str, str]:
    """Checkpoint tensor name -> CTranslate2 spec variable (``scope/name``): one entry per tensor of the
    checkpoint. Several tensors naming one variable are stacked in table order along the output axis:
    [W_q; W_k; W_v] (self-attention ``linear_0``), [W_k; W_v] (cross-attention ``linear_1``)."""
    table = {}
    if config.share_embeddings:
        table["shared_embed.weight"] = "encoder/embeddings_0/weight"
    else:
        table.update({"src_embed.weight": "encoder/embeddings_0/weight",
                      "tgt_embed.weight": "decoder/embeddings/weight", "generator.weight": "decoder/projection/weight"})
    if config.positional_encoding == "learned":
        table.update({"src_pos_embed.weight": "encoder/position_encodings/encodings",
                      "tgt_pos_embed.weight": "decoder/position_encodings/encodings"})
    for i in range(config.n_encoder_layers):
        ours, theirs = f"encoder.layers.{i}", f"encoder/layer_{i}"
        _attention(table, f"{ours}.self_attn", f"{theirs}/self_attention", SELF_ATTENTION)
        _norm(table, f"{ours}.self_attn_norm", f"{theirs}/self_attention/layer_norm")
        _ffn(table, f"{ours}", f"{theirs}/ffn")
    for i in range(config.n_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"decoder/layer_{i}"
        _attention(table, f"{ours}.self_attn", f"{theirs}/self_attention", SELF_ATTENTION)
        _norm(table, f"{ours}.self_attn_norm", f"{theirs}/self_attention/layer_norm")
        _attention(table, f"{ours}.cross_attn", f"{theirs}/attention", CROSS_ATTENTION)
        _norm(table, f"{ours}.cross_attn_norm", f"{theirs}/attention/layer_norm")
        _ffn(table, f"{ours}", f"{theirs}/ffn")
    if config.norm_first:
        _norm(table, "encoder.norm", "encoder/layer_norm")
        _norm(table, "decoder.norm", "decoder/layer_norm")
    return table


# CTranslate2's linear layers of q, k, v and the output projection: self-attention fuses q, k, v into
# linear_0; encoder-decoder attention keeps q in linear_0 and fuses k, v (applied to the memory) into linear_1
SELF_ATTENTION = ("linear_0", "linear_0", "linear_0", "linear_1")
CROSS_ATTENTION = ("linear_0", "linear_1", "linear_1", "linear_2")


def _attention(table: dict[str, str], ours: str, theirs: str, linears: tuple[str, str, str, str]) -> None:
    for proj, linear in zip(("q_proj", "k_proj", "v_proj", "o_proj"), linears):
        table[f"{ours}.{proj}.weight"] = f"{theirs}/{linear}/weight"
        table[f"{ours}.{proj}.bias"] = f"{theirs}/{linear}/bias"


def _norm(table: dict[str, str], ours: str, theirs: str) -> None:
    table[f"{ours}.weight"] = f"{theirs}/gamma"
    table[f"{ours}.bias"] = f"{theirs}/beta"


def _ffn(table: dict[str, str], ours: str, theirs: str) -> None:
    for mine, linear in (("linear1", "linear_0"), ("linear2", "linear_1")):
        table[f"{ours}.ffn.{mine}.weight"] = f"{theirs}/{linear}/weight"
        table[f"{ours}.ffn.{mine}.bias"] = f"{theirs}/{linear}/bias"
    _norm(table, f"{ours}.ffn_norm", f"{theirs}/layer_norm")


def transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The checkpoint tensors whose CTranslate2 variable is the transpose: every projection weight
    (ours (in, out), CTranslate2's (out, in)), the separate pre-softmax projection (D, V) included;
    embeddings, position tables, biases and LayerNorm parameters are not."""
    return tuple(name for name in name_table(config) if is_projection_weight(name))


def is_projection_weight(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a projection's weight, stored (in, out) (docs/checkpoint-format.md):
    the attention projections, the feed-forward layers, the separate pre-softmax projection."""
    return name.endswith(".weight") and ("_proj." in name or ".ffn.linear" in name or name == "generator.weight")


def tied(config: TransformerConfig) -> dict[str, str]:
    """CTranslate2 variables that hold a copy of another (tied weights, section 3.4): with
    ``share_embeddings`` the decoder embedding and the projection are the shared embedding."""
    if not config.share_embeddings:
        return {}
    return {"decoder/embeddings/weight": "encoder/embeddings_0/weight",
            "decoder/projection/weight": "encoder/embeddings_0/weight"}


def variable_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every CTranslate2 array variable the export writes, with its shape, from the config alone."""
    d, f, length = config.d_model, config.d_ff, config.max_len
    shapes: dict[str, tuple[int, ...]] = {"encoder/embeddings_0/weight": (config.src_vocab_size, d),
                                          "decoder/embeddings/weight": (config.tgt_vocab_size, d),
                                          "decoder/projection/weight": (config.tgt_vocab_size, d),
                                          "encoder/position_encodings/encodings": (length, d),
                                          "decoder/position_encodings/encodings": (length, d)}
    norm = lambda scope: shapes.update({f"{scope}/gamma": (d,), f"{scope}/beta": (d,)})
    linear = lambda scope, out, width: shapes.update({f"{scope}/weight": (out, width), f"{scope}/bias": (out,)})
    for stack, layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(layers):
            layer = f"{stack}/layer_{i}"
            linear(f"{layer}/self_attention/linear_0", 3 * d, d)
            linear(f"{layer}/self_attention/linear_1", d, d)
            norm(f"{layer}/self_attention/layer_norm")
            if stack == "decoder":
                linear(f"{layer}/attention/linear_0", d, d)
                linear(f"{layer}/attention/linear_1", 2 * d, d)
                linear(f"{layer}/attention/linear_2", d, d)
                norm(f"{layer}/attention/layer_norm")
            linear(f"{layer}/ffn/linear_0", f, d)
            linear(f"{layer}/ffn/linear_1", d, f)
            norm(f"{layer}/ffn/layer_norm")
        if config.norm_first:
            norm(f"{stack}/layer_norm")
    return shapes


# ----------------------------------------------------------------------------- building the spec

def check_representable(config: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """Refuse, with one ``ValueError`` naming the field or tensor, what a float32 CTranslate2 model cannot hold, and
    the configuration choices this export does not write (it writes the paper's: ``config.PAPER_CHOICES``)."""
    refuse_choices(config, "the CTranslate2 export", **PAPER_CHOICES)
    if config.n_heads > INT16_MAX:
        raise ValueError(f"n_heads ({config.n_heads}) exceeds {INT16_MAX}, the most CTranslate2 stores (int16)")
    eps = np.float32(config.layer_norm_eps)
    if not np.isfinite(eps) or eps < np.finfo(np.float32).tiny:
        raise ValueError(f"layer_norm_eps ({config.layer_norm_eps!r}) is not a normal float32 number; CTranslate2 "
                         "computes LayerNorm in float32")
    limit = np.finfo(np.float32).max
    for name, value in params.items():
        if np.abs(value).max(initial=0.0) > limit:
            raise ValueError(f"tensor {name!r} holds values beyond float32's range; CTranslate2 stores float32")


def variables(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The CTranslate2 variables (float32, CTranslate2's layout) of a checkpoint's ``params``: through
    :func:`name_table` and :func:`transposed`, the sinusoidal table computed here, the tied copies, and
    every shape checked against :func:`variable_shapes`."""
    flip = set(transposed(config))
    stacked: dict[str, list[np.ndarray]] = {}
    for name, target in name_table(config).items():
        value = np.asarray(params[name], dtype=np.float32)
        stacked.setdefault(target, []).append(value.T if name in flip else value)
    out = {target: np.ascontiguousarray(np.concatenate(parts)) for target, parts in stacked.items()}  # (out, in)
    if config.positional_encoding == "sinusoidal":
        table = sinusoidal_positional_encoding(config.max_len, config.d_model, np.float32)      # (L, D) interleaved
        out["encoder/position_encodings/encodings"] = table
        out["decoder/position_encodings/encodings"] = table.copy()
    for target, source in tied(config).items():
        out[target] = out[source].copy()
    expected = variable_shapes(config)
    if set(out) != set(expected):
        raise AssertionError(f"name table and shapes disagree: {sorted(set(out) ^ set(expected))}")
    for target, shape in expected.items():
        if out[target].shape != shape:
            raise AssertionError(f"CTranslate2 variable {target!r} has shape {out[target].shape}; expected {shape}")
    return out


def build_spec(config: TransformerConfig, params: dict[str, np.ndarray], tokenizer: str | None = None) -> Any:
    """A validated ``ctranslate2.specs.TransformerSpec`` holding ``params``, its vocabularies named by
    :func:`token_names` (see the module docstring)."""
    require_ctranslate2()
    from ctranslate2.specs import TransformerDecoderSpec, TransformerEncoderSpec, TransformerSpec, model_spec
    check_representable(config, params)
    pre_norm = config.norm_first
    spec = TransformerSpec(TransformerEncoderSpec(config.n_encoder_layers, config.n_heads, pre_norm=pre_norm),
                           TransformerDecoderSpec(config.n_decoder_layers, config.n_heads, pre_norm=pre_norm))
    for path, value in variables(config, params).items():
        scope, attribute = path.rsplit("/", 1)
        setattr(model_spec.index_spec(spec, scope), attribute, value)
    spec.encoder.scale_embeddings = spec.decoder.scale_embeddings = True      # x sqrt(d_model), section 3.4
    names = {field: name for field, name in SPECIAL_TOKENS.items()}
    for key, setting in (("layer_norm_epsilon", config.layer_norm_eps), ("bos_token", names["bos_id"]),
                       ("eos_token", names["eos_id"]), ("decoder_start_token", names["bos_id"]),
                       ("unk_token", names["pad_id"]), ("add_source_bos", False),
                       ("add_source_eos", tokenizer is not None)):
        setattr(spec.config, key, setting)
    spec.register_source_vocabulary(token_names(config, config.src_vocab_size, tokenizer))
    spec.register_target_vocabulary(token_names(config, config.tgt_vocab_size, tokenizer))
    spec.validate()
    return spec


# ----------------------------------------------------------------------------- writing the directory

def export_ctranslate2(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write the shared ``checkpoint`` file, with its tokenizer if it holds one, as a float32 CTranslate2
    model directory ``output_dir`` (see :func:`save_ctranslate2`). Returns the output directory."""
    refuse_input(os.fspath(output_dir), [os.fspath(checkpoint)], "OUTPUT_DIR")
    check_output(output_dir, force)
    require_ctranslate2()
    config, params = load_checkpoint(checkpoint)
    return save_ctranslate2(config, params, output_dir, force, load_tokenizer_json(checkpoint))


def check_output(output_dir: str | os.PathLike, force: bool) -> Path:
    """Refuse an existing ``output_dir`` (unless ``force``), one whose parent directory does not exist, and one that
    names no directory of its own (``.``, ``..``: the directory is written beside it and renamed into place)."""
    output = Path(output_dir)
    if output.name in ("", ".."):                                         # ".", "..", "/" (pathlib drops "x/.")
        raise ValueError(f"{str(output)!r} names no directory of its own to write into; give the new directory's "
                         "name, e.g. model-dir")
    if os.path.lexists(output) and not force:
        raise ValueError(f"{str(output)!r} already exists; pass force=True (--force) to replace it")
    if not output.parent.is_dir():
        raise ValueError(f"{str(output.parent)!r} is not a directory" if output.parent.exists()
                         else f"directory {str(output.parent)!r} of the output does not exist")
    return output


def save_ctranslate2(config: TransformerConfig, params: dict[str, np.ndarray], output_dir: str | os.PathLike,
                     force: bool = False, tokenizer: str | None = None) -> Path:
    """Write a float32 CTranslate2 model directory ``output_dir`` holding ``params`` (and ``tokenizer``, a
    tokenizer's JSON text: its pieces name the vocabulary and it is saved as ``tokenizer.json``).

    An existing ``output_dir`` is refused unless ``force``; the model is written into a temporary
    sibling directory first and renamed into place, so that a failed export leaves nothing behind
    and replaces nothing. Returns the output directory."""
    check_output(output_dir, force)
    spec = build_spec(config, params, tokenizer)
    spec.optimize(quantization="float32")                                   # aliases the tied copies

    def write(directory: Path) -> None:
        spec.save(str(directory))
        if tokenizer is not None:
            (directory / TOKENIZER_FILE).write_text(tokenizer, encoding="utf-8")

    return write_into_place(output_dir, force, write)


def write_into_place(output_dir: str | os.PathLike, force: bool, write: Callable[[Path], None]) -> Path:
    """Call ``write(directory)`` on a new temporary directory beside ``output_dir`` (refused if it exists,
    unless ``force``, see :func:`check_output`) and rename that directory into place once ``write`` has
    returned: a failure leaves nothing behind and replaces nothing. Returns the output directory."""
    output = check_output(output_dir, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        write(staging)
        staging.chmod(0o777 & ~_umask())                                    # mkdtemp's 0o700 -> a usual directory
        _move_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _move_into_place(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``; an existing ``output`` (``force``) is moved aside first and
    deleted only once the new directory is in place (put back if the rename fails)."""
    if not os.path.lexists(output):
        os.rename(staging, output)
        return
    holder = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
    try:
        os.rename(output, holder / output.name)
    except OSError:
        os.rmdir(holder)
        raise
    try:
        os.rename(staging, output)
    except OSError:
        os.rename(holder / output.name, output)        # should this fail, the old one stays in ``holder``
        os.rmdir(holder)
        raise
    shutil.rmtree(holder)
