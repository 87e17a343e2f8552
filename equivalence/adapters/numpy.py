"""The adapter of the NumPy reference: NumPy in, NumPy out (:class:`equivalence.contract.Backend`).

The reference has no backward pass: :func:`gradients` differentiates its float64 loss by central finite
differences (:mod:`equivalence.finite_differences`), which costs four loss evaluations per parameter entry.
"""

from __future__ import annotations

import numpy as np

from reference_numpy import checkpoint, decoding, training
from reference_numpy.config import TransformerConfig
from reference_numpy.model import Transformer, padding_mask, residual, scaled_dot_product_attention, target_mask

from ..finite_differences import finite_difference_gradients
from ..recipes import check_attention_request, run_component, sublayer_attention_weights

NAME = "numpy"


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
    """Run one component (:data:`equivalence.recipes.COMPONENTS`) on NumPy inputs; weights from layer 0."""
    cast = {key: (value.astype(model.dtype) if isinstance(value, np.ndarray) and value.dtype.kind == "f"
                  else value) for key, value in inputs.items()}
    return run_component(model, name, cast, scaled_dot_product_attention)


def greedy(model: Transformer, src, use_cache: bool = True) -> np.ndarray:
    """Greedy tokens (B, L) without bos, pad-filled. The reference has no cache; ``use_cache`` is ignored."""
    return decoding.greedy_decode(model, src)


def beam(model: Transformer, src, beam_size: int = decoding.BEAM_SIZE, alpha: float = decoding.LENGTH_PENALTY_ALPHA,
         use_cache: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and scores (B,). The reference has no cache; ``use_cache`` is ignored."""
    return decoding.beam_search(model, src, beam_size, alpha)


def attention_weights(model: Transformer, src, tgt, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks."""
    check_attention_request(model.config, layer, kind)
    return sublayer_attention_weights(model, forward(model, src, tgt), padding_mask(src, model.config.pad_id),
                                      target_mask(tgt, model.config.pad_id), layer, kind,
                                      lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first))


def loss(model: Transformer, src, tgt, labels, epsilon: float = training.LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 (the reference computes inference: no dropout)."""
    return float(training.loss(model, src, tgt, labels, epsilon))


def gradients(model: Transformer, src, tgt, labels, epsilon: float = training.LABEL_SMOOTHING
              ) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, grads)``: the loss of section 5.4 and its gradient for every checkpoint tensor, in checkpoint
    layout, by Richardson-extrapolated central differences of the float64 loss at the model's weights."""
    value = loss(model, src, tgt, labels, epsilon)
    grads, _ = finite_difference_gradients(
        lambda params: loss(build(model.config, params), src, tgt, labels, epsilon), export_params(model))
    return value, grads
