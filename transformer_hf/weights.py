"""A family's weight-name table, and the driver that reads a Hugging Face state dict through it (import) or writes
one (export).

A table maps each checkpoint tensor (docs/checkpoint-format.md) to an :class:`Entry`: the state-dict names that may
hold it, the first present read (a file saved with tied weights holds the shared matrix once, older files every
copy), and whether it is stored as the transpose of that tensor -- every ``nn.Linear`` weight, which PyTorch stores
(out, in) and this project (in, out), and a separate output projection read from a (V, D) embedding or ``lm_head``.
The transposes are listed by each family's table, entry by entry (:func:`linear`); every tensor's shape is checked
against the reference's table (``reference_numpy.checkpoint.parameter_shapes``) on the way in and out.

transformers' encoder-decoder families of the BART lineage (Marian, M2M100, ...) name their layers alike:
:func:`layers` is that shared part of a table.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from reference_numpy.checkpoint import parameter_shapes
from reference_numpy.config import TransformerConfig


class Entry(NamedTuple):
    """One checkpoint tensor of a family's table: ``names``, the state-dict names that may hold it, the first
    present read and written; ``transpose``, whether the checkpoint holds the transpose of that tensor; ``row``,
    whether the state dict holds it as a (1, N) buffer (Marian's ``final_logits_bias``)."""

    names: tuple[str, ...]
    transpose: bool = False
    row: bool = False


WeightTable = dict[str, Entry]
# Tensors of a file that the import does not read: the sinusoid tables of older files (computed from the config
# here, as in transformers) and transformers' position-id buffers
SINUSOID_BUFFERS = ("embed_positions.weight", "embed_positions.weights", "embed_positions._float_tensor")


def linear(table: WeightTable, ours: str, theirs: str) -> None:
    """An ``nn.Linear``: its weight (out, in) transposed to the checkpoint's (in, out), its bias as it is."""
    table[f"{ours}.weight"], table[f"{ours}.bias"] = Entry((f"{theirs}.weight",), transpose=True), \
        Entry((f"{theirs}.bias",))


def norm(table: WeightTable, ours: str, theirs: str) -> None:
    """An ``nn.LayerNorm``: its gain and bias as they are."""
    table[f"{ours}.weight"], table[f"{ours}.bias"] = Entry((f"{theirs}.weight",)), Entry((f"{theirs}.bias",))


def embeddings(table: WeightTable, config: TransformerConfig, tie_output: bool = True) -> None:
    """The token embeddings and the pre-softmax projection as the BART lineage names them. One shared matrix
    (``share_embeddings``): ``model.shared``, or any tied copy a file holds. Else each side's ``embed_tokens``
    (transformers 5 ties nothing without ``tie_word_embeddings``, leaving ``model.shared`` unread by the forward
    pass), ``model.shared`` only where a file lacks it; the projection is ``lm_head``, or, tied (``tie_output``: the
    file's ``tie_word_embeddings``), the target embedding it is a copy of. The projection (V, D) is transposed to the
    checkpoint's (D, V)."""
    if config.share_embeddings:
        table["shared_embed.weight"] = Entry(("model.shared.weight", "model.encoder.embed_tokens.weight",
                                              "model.decoder.embed_tokens.weight", "lm_head.weight"))
        return
    table["src_embed.weight"] = Entry(("model.encoder.embed_tokens.weight", "model.shared.weight"))
    table["tgt_embed.weight"] = Entry(("model.decoder.embed_tokens.weight", "model.shared.weight"))
    table["generator.weight"] = Entry(("lm_head.weight", "model.decoder.embed_tokens.weight", "model.shared.weight")
                                      if tie_output else ("lm_head.weight",), transpose=True)


def layers(table: WeightTable, config: TransformerConfig) -> None:
    """The encoder's and decoder's layers as the BART lineage names them (``model.{encoder,decoder}.layers.{i}``:
    ``self_attn`` and ``encoder_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, their
    ``*_layer_norm``, ``fc1``, ``fc2`` and ``final_layer_norm``, the feed-forward's norm)."""
    for stack, count in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(count):
            ours, theirs = f"{stack}.layers.{i}", f"model.{stack}.layers.{i}"
            sublayers = [("self_attn", "self_attn", "self_attn_norm", "self_attn_layer_norm")]
            if stack == "decoder":
                sublayers.append(("cross_attn", "encoder_attn", "cross_attn_norm", "encoder_attn_layer_norm"))
            for attention, hf_attention, layer_norm, hf_norm in sublayers:
                for proj, hf_proj in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                                      ("o_proj", "out_proj")):
                    linear(table, f"{ours}.{attention}.{proj}", f"{theirs}.{hf_attention}.{hf_proj}")
                norm(table, f"{ours}.{layer_norm}", f"{theirs}.{hf_norm}")
            linear(table, f"{ours}.ffn.linear1", f"{theirs}.fc1")
            linear(table, f"{ours}.ffn.linear2", f"{theirs}.fc2")
            norm(table, f"{ours}.ffn_norm", f"{theirs}.final_layer_norm")


def read(config: TransformerConfig, table: WeightTable, weights: dict[str, np.ndarray], model: str,
         ignored: tuple[str, ...] = SINUSOID_BUFFERS, tie_output: bool = True) -> dict[str, np.ndarray]:
    """The checkpoint's tensors from a Hugging Face state dict (``weights``: name -> array) through ``table``, each
    transposed as its entry says and its shape asserted; a tensor of the file that the table does not read (other
    than a tied copy equal to the one read -- with ``tie_output`` false, the config's ``tie_word_embeddings``, the
    untied copies whatever they hold -- or one ending with ``ignored``) is refused, naming it as not part of a
    ``model``."""
    shapes, params, seen = parameter_shapes(config), {}, set()
    for ours, entry in table.items():
        present = [name for name in entry.names if name in weights]
        if not present:
            raise ValueError(f"the weights lack {entry.names[0]!r} (the checkpoint's {ours!r})")
        value = np.asarray(weights[present[0]])
        if entry.row and value.ndim == 2 and value.shape[0] == 1:
            value = value.reshape(-1)                                   # a (1, N) buffer
        value = value.T if entry.transpose else value
        if value.shape != shapes[ours]:
            raise ValueError(f"tensor {present[0]!r} has shape {np.shape(weights[present[0]])}; the config gives "
                             f"the checkpoint's {ours!r} the shape {shapes[ours]}")
        params[ours] = np.ascontiguousarray(value)
        seen.add(present[0])
        for copy in present[1:]:                        # a tied matrix saved twice must be one matrix
            if tie_output and not np.array_equal(np.asarray(weights[copy]), np.asarray(weights[present[0]])):
                raise ValueError(f"tensor {copy!r} differs from {present[0]!r}, which the config ties it to "
                                 "(share_encoder_decoder_embeddings / tie_word_embeddings)")
            seen.add(copy)
    unread = sorted(name for name in weights if name not in seen and not name.endswith(ignored))
    if unread:
        raise ValueError(f"tensor {unread[0]!r} is not part of a supported {model} model ({len(unread)} such)")
    return params


def logits_bias(table: WeightTable, config: TransformerConfig) -> None:
    """``output_bias``'s ``generator.bias``: the (1, V) buffer ``final_logits_bias`` (Marian, Pegasus, BART)."""
    if config.output_bias:
        table["generator.bias"] = Entry(("final_logits_bias",), row=True)


def written_with_logits_bias(config: TransformerConfig, table: WeightTable,
                             params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`written`, with a zero ``final_logits_bias`` for a model without ``output_bias`` (the families' class
    always holds the buffer; adding zero changes no logit)."""
    out = written(config, table, params)
    if not config.output_bias:
        out["final_logits_bias"] = np.zeros((1, config.tgt_vocab_size), next(iter(out.values())).dtype)
    return out


def written(config: TransformerConfig, table: WeightTable, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Hugging Face state dict of ``params`` (the checkpoint's dtype): each tensor under the first name its
    entry gives, transposed as it says (a ``row`` as its (1, N) buffer), its shape checked against the config's."""
    shapes, out = parameter_shapes(config), {}
    for ours, entry in table.items():
        value = np.asarray(params[ours])
        if value.shape != shapes[ours]:
            raise ValueError(f"tensor {ours!r} has shape {value.shape}; the config gives it {shapes[ours]}")
        value = value.reshape(1, -1) if entry.row else value
        out[entry.names[0]] = np.ascontiguousarray(value.T if entry.transpose else value)
    return out


# ----------------------------------------------------------------------------- the paper's table as the halves one

def halves_order(d_model: int) -> np.ndarray:
    """sigma: feature k of the halves layout is feature sigma[k] of section 3.5's interleaved one (the sine of
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
    ``order[k]`` of ``params`` (:func:`residual_axes`): an exact symmetry of the network (:mod:`.marian`, "The
    paper's model as a Marian model")."""
    out = {}
    for name, value in params.items():
        for axis in residual_axes(name):
            value = np.take(value, order, axis=axis)
        out[name] = value
    return out
