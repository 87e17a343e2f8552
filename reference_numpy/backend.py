"""The backend adapter of the reference: NumPy in, NumPy out.

Every port ships a ``backend.py`` with these same names (see ``docs/ports.md``), so that the
agreement suite and the ``compare`` command drive all backends through one interface.
"""

from __future__ import annotations

import numpy as np

from . import checkpoint, decoding, training
from .cases import COMPONENT_MASKED
from .config import TransformerConfig
from .model import Transformer, padding_mask, residual, scaled_dot_product_attention, target_mask

NAME = "numpy"
COMPONENTS = tuple(COMPONENT_MASKED)


def devices() -> list[str]:
    """Devices this backend can run on here."""
    return ["cpu"]


def build(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
          device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32" or "float64") on ``device`` from checkpoint-layout arrays."""
    return Transformer(config, params, dtype=np.dtype(dtype))


def load(path, dtype: str = "float64", device: str = "cpu") -> Transformer:
    """A model from a shared checkpoint file."""
    config, params = checkpoint.load_checkpoint(path)
    return build(config, params, dtype, device)


def save(model: Transformer, path) -> None:
    """Write the model's weights as a shared checkpoint."""
    checkpoint.save_checkpoint(path, model.config, export_params(model))


def export_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) arrays)."""
    return {name: np.array(value) for name, value in model.params.items()}


def forward(model: Transformer, src, tgt, src_mask=None, tgt_mask=None) -> dict[str, np.ndarray]:
    """Every stage of the forward pass (inference), by the shared stage names."""
    _, stages = model(src, tgt, src_mask, tgt_mask, return_intermediates=True)
    return stages


def component(model: Transformer, name: str, inputs: dict) -> np.ndarray:
    """Run one component on NumPy inputs; weights come from layer 0 of each stack.

    ``inputs`` keys: attention and multi_head_attention take query, key, value, mask;
    positional_encoding, feed_forward, layer_norm, encoder_layer and encoder take x (and mask);
    decoder_layer and decoder take x, memory, src_mask, tgt_mask.
    """
    cast = {key: (value.astype(model.dtype) if isinstance(value, np.ndarray) and value.dtype.kind == "f"
                  else value) for key, value in inputs.items()}
    return run_component(model, name, cast, scaled_dot_product_attention)


def run_component(model, name: str, inputs: dict, attention):
    """The component dispatch written once for every backend: ``inputs`` are already the
    backend's tensors in the model's dtype, ``attention`` is its Eq. (1) function; only the
    names all ports share are used (weights of layer 0 of each stack)."""
    encoder_layer, decoder_layer = model.encoder.layers[0], model.decoder.layers[0]
    if name == "attention":
        return attention(inputs["query"], inputs["key"], inputs["value"], inputs["mask"])[0]
    if name == "multi_head_attention":
        return encoder_layer.self_attn(inputs["query"], inputs["key"], inputs["value"], inputs["mask"])
    if name == "positional_encoding":
        return model.src_pos(inputs["x"])
    if name == "feed_forward":
        return encoder_layer.ffn(inputs["x"])
    if name == "layer_norm":
        return encoder_layer.self_attn_norm(inputs["x"])
    if name == "encoder_layer":
        return encoder_layer(inputs["x"], inputs["mask"])
    if name == "encoder":
        return model.encoder(inputs["x"], inputs["mask"])
    if name == "decoder_layer":
        return decoder_layer(inputs["x"], inputs["memory"], inputs["src_mask"], inputs["tgt_mask"])
    if name == "decoder":
        return model.decoder(inputs["x"], inputs["memory"], inputs["src_mask"], inputs["tgt_mask"])
    raise ValueError(f"unknown component {name!r}; choose one of {COMPONENTS}")


def greedy(model: Transformer, src, use_cache: bool = True) -> np.ndarray:
    """Greedy tokens (B, L) without bos, pad-filled. The reference has no cache; ``use_cache`` is ignored."""
    return decoding.greedy_decode(model, src)


def beam(model: Transformer, src, beam_size: int = decoding.BEAM_SIZE, alpha: float = decoding.LENGTH_PENALTY_ALPHA,
         use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and scores (B,). The reference has no cache; ``use_cache`` is ignored."""
    return decoding.beam_search(model, src, beam_size, alpha)


ATTENTION_KINDS = ("encoder", "decoder_self", "decoder_cross")


def attention_weights(model: Transformer, src, tgt, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks."""
    check_attention_request(model.config, layer, kind)
    return sublayer_attention_weights(model, forward(model, src, tgt), padding_mask(src, model.config.pad_id),
                                      target_mask(tgt, model.config.pad_id), layer, kind,
                                      lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first))


def check_attention_request(config: TransformerConfig, layer: int, kind: str) -> None:
    """One-line errors for an unknown ``kind`` or a ``layer`` outside its stack."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"kind must be one of {ATTENTION_KINDS}, got {kind!r}")
    layers = config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers
    if not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an int in [0, {layers}), got {layer!r}")


def sublayer_attention_weights(model, stages: dict, src_mask, tgt_mask, layer: int, kind: str, residual_fn):
    """The weights one attention sublayer computes, recomputed from the stage before its layer.

    Written once for every backend: it only uses the names all ports share (``encoder.layers``,
    ``self_attn``, ``self_attn_norm``, ``cross_attn``, ``cross_attn_norm``, ``return_weights``),
    so ``stages`` and the masks are the backend's own tensors, and ``residual_fn(x, sublayer,
    norm)`` is its residual connection with dropout off.
    """
    stack_name = "encoder" if kind == "encoder" else "decoder"
    x = stages["src_embed" if kind == "encoder" else "tgt_embed"] if layer == 0 else \
        stages[f"{stack_name}.layers.{layer - 1}"]                           # the layer's input
    block = getattr(model, stack_name).layers[layer]
    seen_by = (lambda h, norm: norm(h)) if model.config.norm_first else (lambda h, norm: h)   # the sublayer's input
    h = seen_by(x, block.self_attn_norm)
    if kind != "decoder_cross":
        return block.self_attn(h, h, h, src_mask if kind == "encoder" else tgt_mask, return_weights=True)[1]
    x = residual_fn(x, lambda y: block.self_attn(y, y, y, tgt_mask), block.self_attn_norm)
    h = seen_by(x, block.cross_attn_norm)
    return block.cross_attn(h, stages["encoder"], stages["encoder"], src_mask, return_weights=True)[1]


def loss(model: Transformer, src, tgt, labels, epsilon: float = training.LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 (the ports also return its gradients)."""
    return float(training.loss(model, src, tgt, labels, epsilon))
