"""The adapter steps written once for every backend: the component dispatch and the attention-weights recipe.

They use only the names all ports share (``encoder.layers``, ``self_attn``, ``self_attn_norm``, ``cross_attn``,
``cross_attn_norm``, ``ffn``, ``src_pos``, ``return_weights``; ``docs/ports.md``), so an adapter passes its own
model and tensors and gets its own tensors back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from reference_numpy.config import TransformerConfig
from reference_numpy.precision import DTYPES, round_to

from .cases import COMPONENT_MASKED

COMPONENTS = tuple(COMPONENT_MASKED)
# The components whose backward pass the adapters run (``component_gradients``), and the inputs differentiated.
GRADIENT_INPUTS = {"attention": ("query", "key", "value"), "layer_norm": ("x",)}
ATTENTION_KINDS = ("encoder", "decoder_self", "decoder_cross")


def run_component(model: Any, name: str, inputs: dict, attention: Callable[..., Any]) -> Any:
    """One component of ``model`` on ``inputs`` (the backend's tensors, already in the model's dtype);
    ``attention`` is the backend's Eq. (1) function. Weights come from layer 0 of each stack.

    ``inputs`` keys: attention and multi_head_attention take query, key, value, mask;
    positional_encoding, feed_forward, layer_norm, encoder_layer, encoder and generator take x (and mask);
    decoder_layer and decoder take x, memory, src_mask, tgt_mask.
    """
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
    if name == "generator":
        return model.generator(inputs["x"])
    raise ValueError(f"unknown component {name!r}; choose one of {COMPONENTS}")


def rounded_inputs(inputs: dict, dtype: npt.DTypeLike) -> dict:
    """A component's NumPy ``inputs`` with every float array (float64, float32, bfloat16 or float16) rounded once,
    correctly, to the model's ``dtype`` (``round_to``: frameworks' float64 -> bfloat16 casts round twice); masks and
    None as they are. Each adapter then makes its own tensors of them, exactly."""
    return {key: round_to(value, dtype) if isinstance(value, np.ndarray) and value.dtype in DTYPES else value
            for key, value in inputs.items()}


def check_attention_request(config: TransformerConfig, layer: int, kind: str) -> None:
    """One-line errors for an unknown ``kind`` or a ``layer`` outside its stack."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"kind must be one of {ATTENTION_KINDS}, got {kind!r}")
    layers = config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers
    if not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an int in [0, {layers}), got {layer!r}")


def sublayer_attention_weights(model: Any, stages: dict, src_mask: Any, tgt_mask: Any, layer: int, kind: str,
                               residual_fn: Callable[..., Any]) -> Any:
    """The weights (B, H, Tq, Tk) one attention sublayer computes (Eq. (1) inside Eq. (2)), recomputed from the
    stage before its layer.

    ``stages`` (by the shared stage names) and the masks are the backend's own tensors, and
    ``residual_fn(x, sublayer, norm)`` is its residual connection (section 5.4) with dropout off.
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


def check_gradient_request(name: str) -> tuple[str, ...]:
    """The float inputs whose gradients ``component_gradients`` returns for component ``name``; a ValueError for a
    component whose backward pass the adapters do not run."""
    if name not in GRADIENT_INPUTS:
        raise ValueError(f"component gradients are run for {sorted(GRADIENT_INPUTS)}, not {name!r}")
    return GRADIENT_INPUTS[name]
