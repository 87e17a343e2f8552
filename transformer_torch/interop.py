"""Conversion between the port's :class:`.model.Transformer` and ``torch.nn.Transformer``.

``nn.Transformer`` holds only the two stacks, so :class:`NNTransformerModel` puts the port's
embeddings, positional encodings and generator around one; :func:`to_nn_transformer` and
:func:`from_nn_transformer` convert the weights in the form of ``checkpoint.py``: an exact
:func:`name_table` (the port's parameter path -> the wrapper's, built by explicit loops over the
layers), :func:`transposed` (empty: both sides are ``nn.Linear``s, (out, in)), a shape check per
tensor, and torch's ``load_state_dict(strict=True, assign=True)`` into a wrapper built on the meta
device; back to the port, through checkpoint layout into the port's own loader.
In eval mode both compute the same function (float64 agreement within the project's bound),
on torch's slow path and on its inference fast path (``torch._transformer_encoder_layer_fwd``
for encoder layers and ``torch._native_multi_head_attention`` for decoder self-attention,
taken in eval mode without gradients); nested tensors are never used (no key padding masks are
passed and the encoder is built with ``enable_nested_tensor=False``).

What maps where:

* q/k/v projections <-> ``nn.MultiheadAttention.in_proj_weight``/``in_proj_bias``, packed
  [W_q; W_k; W_v] along the output axis (head i owns output features i*d_k .. (i+1)*d_k - 1 in
  both); ``o_proj`` <-> ``out_proj``; encoder ``self_attn_norm``/``ffn_norm`` <-> ``norm1``/
  ``norm2``; decoder ``self_attn_norm``/``cross_attn_norm``/``ffn_norm`` <-> ``norm1``/``norm2``/
  ``norm3``; ``cross_attn`` <-> ``multihead_attn``; ``ffn.linear1``/``ffn.linear2`` <->
  ``linear1``/``linear2``.
* ``norm_first`` <-> pre-LN. ``nn.Transformer`` always builds final encoder/decoder norms; the
  paper's post-LN model has none, so the stacks are built as ``nn.TransformerEncoder``/
  ``nn.TransformerDecoder`` with ``norm=None`` (post-LN) or with the pre-LN final norms.
* masks: ours are bool, True = may attend, broadcastable to (B, H, Tq, Tk);
  ``nn.MultiheadAttention``'s bool masks mean True = NOT allowed, shaped (B * H, Tq, Tk):
  :func:`to_nn_mask` expands and inverts.

Every :class:`TransformerConfig` can be represented. :func:`from_nn_transformer` refuses, with
a ``ValueError`` naming the module, an ``nn.Transformer`` outside the paper's model: an
activation other than ReLU, attention or LayerNorm without biases, separate key/value widths
(``kdim``/``vdim``), ``batch_first=False``, a LayerNorm epsilon or ``norm_first`` different
from the config, a final norm on a post-LN stack (``nn.Transformer``'s default) or none on a
pre-LN stack, or layer counts and widths different from the config.

Limits: a query row that sees no key (e.g. a source of padding only) gives zeros in the port
and in torch's slow path, but NaN on torch's encoder fast path; in training mode
``nn.Transformer`` adds dropout sites the paper does not have (on the attention weights and on
the feed-forward hidden layer), so only eval-mode outputs agree.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reference_numpy.config import PAPER_CHOICES, TransformerConfig, refuse_choices

from . import checkpoint
from .model import Embeddings, Generator, PositionalEncoding, Transformer, padding_mask, target_mask


class NNTransformerModel(nn.Module):
    """The port's embeddings, positional encodings and generator around a ``torch.nn.Transformer``.

    ``forward`` takes the port's arguments and mask convention (True = may attend) and the same
    defaults (source padding mask; causal + target padding mask).

    Shape: src (B, S), tgt (B, T) -> log-probabilities (B, T, V_tgt).
    """

    def __init__(self, config: TransformerConfig, transformer: nn.Transformer | None = None):
        super().__init__()
        self.config = config
        self.src_embed = Embeddings(config, config.src_vocab_size)
        self.tgt_embed = self.src_embed if config.share_embeddings else Embeddings(config, config.tgt_vocab_size)
        self.src_pos = PositionalEncoding(config)
        self.tgt_pos = PositionalEncoding(config)
        self.transformer = transformer if transformer is not None else build_nn_transformer(config)
        self.generator = Generator(config, self.tgt_embed if config.share_embeddings else None)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """Embed the source and run ``nn.Transformer``'s encoder. Shape: src (B, S) -> memory (B, S, D)."""
        src = torch.as_tensor(src, device=self.src_embed.weight.device)
        src_mask = self._mask(src_mask, padding_mask(src, self.config.pad_id))
        batch, length = src.shape
        return self.transformer.encoder(self.src_pos(self.src_embed(src)),
                                        mask=to_nn_mask(src_mask, batch, self.config.n_heads, length, length))

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None) -> Tensor:
        """Embed the shifted target and run ``nn.Transformer``'s decoder (no cache: the whole
        prefix every call). Shape: tgt (B, T), memory (B, S, D) -> (B, T, D)."""
        tgt = torch.as_tensor(tgt, device=self.src_embed.weight.device)
        src_mask = self._mask(src_mask, torch.ones(1, 1, 1, memory.shape[1], dtype=torch.bool, device=tgt.device))
        tgt_mask = self._mask(tgt_mask, target_mask(tgt, self.config.pad_id))
        (batch, t), s, h = tgt.shape, memory.shape[1], self.config.n_heads
        return self.transformer.decoder(self.tgt_pos(self.tgt_embed(tgt)), memory,
                                        tgt_mask=to_nn_mask(tgt_mask, batch, h, t, t),
                                        memory_mask=to_nn_mask(src_mask, batch, h, t, s))

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None) -> Tensor:
        src = torch.as_tensor(src, device=self.src_embed.weight.device)
        src_mask = self._mask(src_mask, padding_mask(src, self.config.pad_id))
        return self.generator(self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask))

    def _mask(self, mask: Tensor | None, default: Tensor) -> Tensor:
        return default if mask is None else torch.as_tensor(mask, device=self.src_embed.weight.device)


def to_nn_mask(mask: Tensor, batch: int, n_heads: int, query_length: int, key_length: int) -> Tensor:
    """Our mask (bool, True = may attend, broadcastable to (B, H, Tq, Tk)) as an
    ``nn.MultiheadAttention`` ``attn_mask`` (bool, True = NOT allowed).

    Shape: mask broadcastable to (B, H, Tq, Tk) -> (B * H, Tq, Tk).
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    full = mask.expand(batch, n_heads, query_length, key_length)           # (B, H, Tq, Tk)
    return ~full.reshape(batch * n_heads, query_length, key_length)        # (B * H, Tq, Tk)


def build_nn_transformer(config: TransformerConfig) -> nn.Transformer:
    """An ``nn.Transformer`` (batch_first, ReLU) with the paper's structure for ``config``:
    final norms only for pre-LN (``norm_first``). The paper's other choices only (``config.PAPER_CHOICES``)."""
    refuse_choices(config, "torch.nn.Transformer interop", **PAPER_CHOICES)
    layer_args: dict[str, Any] = dict(d_model=config.d_model, nhead=config.n_heads, dim_feedforward=config.d_ff,
                      dropout=config.dropout, activation="relu", layer_norm_eps=config.layer_norm_eps,
                      batch_first=True, norm_first=config.norm_first)
    final_norm = lambda: nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_args), config.n_encoder_layers,
                                    norm=final_norm(), enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_args), config.n_decoder_layers,
                                    norm=final_norm())
    return nn.Transformer(d_model=config.d_model, nhead=config.n_heads, custom_encoder=encoder,
                          custom_decoder=decoder, batch_first=True)


def name_table(config: TransformerConfig) -> dict[str, str]:
    """The port's parameter path -> the :class:`NNTransformerModel` parameter path: one exact entry
    per parameter of the port. The q, k and v projections of one attention name one packed
    parameter (``in_proj_weight``/``in_proj_bias``): they are stacked in that order along the
    output axis, [W_q; W_k; W_v]."""
    table = {"src_embed.weight": "src_embed.weight"}
    if not config.share_embeddings:
        table.update({"tgt_embed.weight": "tgt_embed.weight", "generator.weight": "generator.weight"})
    if config.positional_encoding == "learned":
        table.update({"src_pos.weight": "src_pos.weight", "tgt_pos.weight": "tgt_pos.weight"})
    for i in range(config.n_encoder_layers):
        ours, theirs = f"encoder.layers.{i}", f"transformer.encoder.layers.{i}"
        _attention(table, f"{ours}.self_attn", f"{theirs}.self_attn")
        _affine(table, f"{ours}.self_attn_norm", f"{theirs}.norm1")
        _affine(table, f"{ours}.ffn.linear1", f"{theirs}.linear1")
        _affine(table, f"{ours}.ffn.linear2", f"{theirs}.linear2")
        _affine(table, f"{ours}.ffn_norm", f"{theirs}.norm2")
    if config.norm_first:
        _affine(table, "encoder.norm", "transformer.encoder.norm")
    for i in range(config.n_decoder_layers):
        ours, theirs = f"decoder.layers.{i}", f"transformer.decoder.layers.{i}"
        _attention(table, f"{ours}.self_attn", f"{theirs}.self_attn")
        _affine(table, f"{ours}.self_attn_norm", f"{theirs}.norm1")
        _attention(table, f"{ours}.cross_attn", f"{theirs}.multihead_attn")
        _affine(table, f"{ours}.cross_attn_norm", f"{theirs}.norm2")
        _affine(table, f"{ours}.ffn.linear1", f"{theirs}.linear1")
        _affine(table, f"{ours}.ffn.linear2", f"{theirs}.linear2")
        _affine(table, f"{ours}.ffn_norm", f"{theirs}.norm3")
    if config.norm_first:
        _affine(table, "decoder.norm", "transformer.decoder.norm")
    return table


def transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The exact port parameter paths whose ``nn.Transformer`` parameter is the transpose: none,
    both sides store ``nn.Linear`` weights (out, in)."""
    return ()


def _attention(table: dict[str, str], ours: str, theirs: str) -> None:
    for kind in ("weight", "bias"):
        for proj in ("q_proj", "k_proj", "v_proj"):
            table[f"{ours}.{proj}.{kind}"] = f"{theirs}.in_proj_{kind}"        # packed [W_q; W_k; W_v]
        table[f"{ours}.o_proj.{kind}"] = f"{theirs}.out_proj.{kind}"


def _affine(table: dict[str, str], ours: str, theirs: str) -> None:
    """A module with a weight and a bias (``nn.Linear``, ``nn.LayerNorm``)."""
    table[f"{ours}.weight"] = f"{theirs}.weight"
    table[f"{ours}.bias"] = f"{theirs}.bias"


def _packed(config: TransformerConfig) -> dict[str, list[str]]:
    """The wrapper's parameter path -> the port's parameter paths it holds, stacked in table order."""
    packed: dict[str, list[str]] = {}
    for ours, theirs in name_table(config).items():
        packed.setdefault(theirs, []).append(ours)
    return packed


def _check_shapes(module: nn.Module, loaded: dict[str, Tensor]) -> None:
    parameters = dict(module.named_parameters())
    for path, value in loaded.items():
        if path in parameters and value.shape != parameters[path].shape:
            raise ValueError(f"the tensor for {path!r} has shape {tuple(value.shape)}; the parameter needs "
                             f"{tuple(parameters[path].shape)}")


def to_nn_transformer(model: Transformer) -> NNTransformerModel:
    """An :class:`NNTransformerModel` with ``model``'s weights (copied), dtype, device and train/eval mode."""
    config, ours, flip = model.config, dict(model.named_parameters()), set(transposed(model.config))
    loaded = {theirs: torch.cat([ours[path].T if path in flip else ours[path] for path in paths])
              for theirs, paths in _packed(config).items()}                 # (sum of out, in) or (sum of out,)
    with torch.device("meta"):
        wrapper = NNTransformerModel(config)                                # shapes only, no initialization
    _check_shapes(wrapper, loaded)
    _fill(wrapper, loaded)
    return wrapper.to(device=model.device, dtype=model.dtype).train(model.training)


def _fill(wrapper: NNTransformerModel, tensors: dict[str, Tensor]) -> None:
    """Fill a meta-device ``wrapper`` with ``tensors`` (by ``named_parameters`` path) through torch's
    ``load_state_dict(strict=True, assign=True)``; with ``share_embeddings`` every name of the tied
    embedding (``tgt_embed``, ``generator.embeddings``) gets its one tensor."""
    path_of = {id(parameter): path for path, parameter in wrapper.named_parameters()}
    wrapper.load_state_dict({key: tensors[path_of[id(value)]].detach()
                             for key, value in wrapper.state_dict(keep_vars=True).items()}, strict=True, assign=True)


def from_nn_transformer(wrapper: NNTransformerModel) -> Transformer:
    """A :class:`Transformer` with ``wrapper``'s weights (copied), dtype, device and mode; a ``ValueError``
    when its ``nn.Transformer`` is outside the paper's model (see the module docstring). The weights go
    through checkpoint layout (:func:`.checkpoint.to_checkpoint_layout`) into the port's own loader,
    :func:`.checkpoint.from_params`, which checks every tensor."""
    config, theirs, flip = wrapper.config, dict(wrapper.named_parameters()), set(transposed(wrapper.config))
    check_representable(wrapper.transformer, config)
    loaded = {}
    for their_path, paths in _packed(config).items():
        for path, part in zip(paths, theirs[their_path].chunk(len(paths))):   # [W_q; W_k; W_v] -> each
            loaded[path] = part.T if path in flip else part
    with torch.device("meta"):
        shell = Transformer(config)                                         # the name table's model, no weights
    weight = wrapper.src_embed.weight
    model = checkpoint.from_params(config, checkpoint.to_checkpoint_layout(shell, loaded), weight.dtype, weight.device)
    return model.train(wrapper.training)


def check_representable(transformer: nn.Transformer, config: TransformerConfig) -> None:
    """Refuse (one-line ``ValueError`` naming the module) an ``nn.Transformer`` the port cannot represent."""
    for stack, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        module = getattr(transformer, stack)
        if len(module.layers) != n_layers:
            raise ValueError(f"transformer.{stack} has {len(module.layers)} layers; the config says {n_layers}")
        if (module.norm is not None) != config.norm_first:
            raise ValueError(f"transformer.{stack}.norm is {type(module.norm).__name__}; a "
                             f"{'pre' if config.norm_first else 'post'}-LN stack "
                             f"{'needs' if config.norm_first else 'has no'} final LayerNorm")
        if module.norm is not None:
            _check_norm(f"transformer.{stack}.norm", module.norm, config)
        for i, layer in enumerate(module.layers):
            _check_layer(f"transformer.{stack}.layers.{i}", layer, config)


def _check_layer(name: str, layer: nn.Module, config: TransformerConfig) -> None:
    if layer.norm_first != config.norm_first:
        raise ValueError(f"{name}.norm_first is {layer.norm_first}; the config says {config.norm_first}")
    if layer.activation is not F.relu and not isinstance(layer.activation, nn.ReLU):
        raise ValueError(f"{name}.activation is {layer.activation}; the paper's feed-forward uses ReLU (Eq. 2)")
    linear1, linear2 = cast(nn.Linear, layer.linear1), cast(nn.Linear, layer.linear2)   # the layer's feed-forward
    if linear1.out_features != config.d_ff or linear1.bias is None or linear2.bias is None:
        raise ValueError(f"{name}.linear1/linear2 must be {config.d_model} -> {config.d_ff} -> {config.d_model} "
                         "with biases")
    for attn_name, attn in layer.named_children():
        if isinstance(attn, nn.MultiheadAttention):
            _check_attention(f"{name}.{attn_name}", attn, config)
        elif isinstance(attn, nn.Module) and attn_name.startswith("norm"):
            _check_norm(f"{name}.{attn_name}", attn, config)


def _check_attention(name: str, attn: nn.MultiheadAttention, config: TransformerConfig) -> None:
    if not attn._qkv_same_embed_dim or attn.in_proj_weight is None:
        raise ValueError(f"{name} has separate kdim/vdim projections; the port's keys and values have width d_model")
    if attn.in_proj_bias is None or attn.out_proj.bias is None or attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(f"{name} must have q/k/v/out biases and no bias_k/bias_v/add_zero_attn")
    if not attn.batch_first:
        raise ValueError(f"{name}.batch_first is False; NNTransformerModel passes (B, T, D) tensors")
    if attn.embed_dim != config.d_model or attn.num_heads != config.n_heads:
        raise ValueError(f"{name} has embed_dim {attn.embed_dim}, {attn.num_heads} heads; the config says "
                         f"{config.d_model}, {config.n_heads}")


def _check_norm(name: str, norm: nn.Module, config: TransformerConfig) -> None:
    if not isinstance(norm, nn.LayerNorm) or norm.weight is None or norm.bias is None:
        raise ValueError(f"{name} must be an nn.LayerNorm with weight and bias, got {norm}")
    if norm.eps != config.layer_norm_eps:
        raise ValueError(f"{name}.eps is {norm.eps}; the config says layer_norm_eps={config.layer_norm_eps}")
