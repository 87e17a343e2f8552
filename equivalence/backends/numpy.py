"""The adapter of the NumPy reference: NumPy in, NumPy out (:class:`equivalence.contract.Backend`).

Gradients come from the reference's hand-written backward pass (``reference_numpy/backward.py``); the suite checks
it against central finite differences of the loss (:mod:`equivalence.finite_differences`).
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np

from equivalence.backends import in_recipe
from equivalence.contract import Mask, Path, Progress, Tokens
from equivalence.recipes import (
    check_attention_request,
    check_gradient_request,
    rounded_inputs,
    run_component,
    sublayer_attention_weights,
)
from reference_numpy import backward, checkpoint, data_parallel, decoding, training
from reference_numpy.capture import capture_stages
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import Batches
from reference_numpy.model import Transformer, padding_mask, residual, scaled_dot_product_attention, target_mask
from reference_numpy.precision import autocast, check_autocast_training, parse_precision, round_to

NAME = "numpy"
FORWARD_PATH = "NumPy"
# the autocast dtype of each model built in "mixed-bfloat16" or "mixed-float16" (a float32 model): every call of this
# adapter on it runs under reference_numpy.precision.autocast, as the PyTorch adapter's under torch.autocast
_AUTOCAST: weakref.WeakKeyDictionary[Transformer, np.dtype] = weakref.WeakKeyDictionary()


def _recipe(model: Transformer) -> contextlib.AbstractContextManager:
    """The autocast block of a model built in a mixed precision; nothing for any other."""
    mixed = _AUTOCAST.get(model)
    return contextlib.nullcontext() if mixed is None else autocast(mixed)


_in_recipe = in_recipe(_recipe)


def devices() -> list[str]:
    """Devices this backend can run on here."""
    return ["cpu"]


def build(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
          device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float64", "float32", "bfloat16" or "float16") on ``device`` from checkpoint-layout
    arrays; "mixed-bfloat16" or "mixed-float16": a float32 model run by the autocast recipe."""
    return _built(config, params, dtype, copy=True)


def load(path: Path, dtype: str = "float64", device: str = "cpu") -> Transformer:
    """A model from a shared checkpoint file, holding the arrays read (no weight held twice)."""
    config, params = checkpoint.load_checkpoint(path)
    return _built(config, params, dtype, copy=False)


def _built(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str, copy: bool) -> Transformer:
    """:func:`build`'s model; ``copy=False``: the arrays already in the model's dtype taken as they are."""
    stored, mixed = parse_precision(dtype)
    model = Transformer(config, params, dtype=stored, copy=copy)
    if mixed is not None:
        _AUTOCAST[model] = mixed
    return model


def load_training_state(path: Path, dtype: str | None = None) -> checkpoint.TrainingState | None:
    """A saved run's training state (None if the file holds none): the reference's ``load_training_state`` (each
    moment in memory of its own, given back to the system once dropped; the reference's Adam copies it)."""
    return checkpoint.load_training_state(path, dtype)


def save(model: Transformer, path: Path, training: checkpoint.TrainingState | None = None,
         tokenizer: str | None = None) -> None:
    """Write the model's weights (and a run's training state, and a tokenizer's JSON text) as a shared checkpoint."""
    checkpoint.save_checkpoint(path, model.config, export_params(model), training, tokenizer)


def export_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) arrays)."""
    return {name: np.array(value) for name, value in model.params.items()}


@_in_recipe
def forward(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
            ) -> dict[str, np.ndarray]:
    """Every stage of the forward pass (inference), by the shared stage names."""
    _, stages = capture_stages(model, src, tgt, src_mask, tgt_mask)
    return stages


@_in_recipe
def log_probs(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None) -> np.ndarray:
    """The forward pass's (B, T, V) log-probabilities alone: the model call."""
    return model(src, tgt, src_mask, tgt_mask)


@_in_recipe
def component(model: Transformer, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run one component (:data:`equivalence.recipes.COMPONENTS`) on NumPy inputs; weights from layer 0."""
    return run_component(model, name, rounded_inputs(inputs, model.dtype), scaled_dot_product_attention)


@_in_recipe
def component_gradients(model: Transformer, name: str, inputs: dict[str, np.ndarray], grad_out: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """The gradients of sum(component * grad_out) with respect to the component's float inputs, by the reference's
    backward pass (:mod:`reference_numpy.backward`): attention's query, key and value; LayerNorm's x."""
    keys, t = check_gradient_request(name), rounded_inputs(inputs, model.dtype)
    if name == "attention":
        _, component_backward = backward.attention(t["query"], t["key"], t["value"], t["mask"])
    else:
        _, component_backward = backward.layer_norm(model.encoder.layers[0].self_attn_norm, "norm", t["x"], {})
    grads = component_backward(round_to(grad_out, model.dtype))
    return dict(zip(keys, grads if name == "attention" else (grads,)))


@_in_recipe
def greedy(model: Transformer, src: Tokens, use_cache: bool = True, forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy tokens (B, L) without the start token, pad-filled. The reference has no cache; ``use_cache`` is
    ignored."""
    return decoding.greedy_decode(model, src, forced_bos_id)


@_in_recipe
def beam(model: Transformer, src: Tokens, beam_size: int = decoding.BEAM_SIZE,
         alpha: float | None = None, use_cache: bool = True, forced_bos_id: int | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and scores (B,). The reference has no cache; ``use_cache`` is ignored."""
    return decoding.beam_search(model, src, beam_size, alpha, forced_bos_id)


@_in_recipe
def attention_weights(model: Transformer, src: Tokens, tgt: Tokens, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks."""
    check_attention_request(model.config, layer, kind)
    return sublayer_attention_weights(model, forward(model, src, tgt), padding_mask(src, model.config.pad_id),
                                      target_mask(tgt, model.config.pad_id), layer, kind,
                                      lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first))


@_in_recipe
def loss(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens,
         epsilon: float = training.LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 (the reference computes inference: no dropout)."""
    return float(training.loss(model, src, tgt, labels, epsilon))


@_in_recipe
def gradients(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = training.LABEL_SMOOTHING
              ) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, grads)``: the loss of section 5.4 and its gradient for every checkpoint tensor, in checkpoint
    layout, by the reference's backward pass."""
    value, grads = training.gradients(model, src, tgt, labels, epsilon)
    return float(value), grads


@_in_recipe
def optimizer(model: Transformer, config: TrainingConfig | None = None,
              state: checkpoint.TrainingState | None = None,
              dtype: str | None = None) -> training.Optimizer:
    """The reference's Adam with the schedule of section 5.3 (``reference_numpy.training.optimizer``, one
    ``Optimizer`` record); ``dtype`` bfloat16 or float16 trains a float32 model in mixed precision."""
    check_autocast_training(_AUTOCAST.get(model), dtype)
    return training.optimizer(model, config, state, dtype)


def loss_scale(optimizer: training.Optimizer) -> float | None:
    """The current loss scale of a float16 mixed-precision optimizer; None for any other."""
    return None if optimizer.loss_scale is None else float(optimizer.loss_scale.value)


@_in_recipe
def train_step(model: Transformer, optimizer: training.Optimizer, src: Tokens, tgt: Tokens, labels: Tokens,
               epsilon: float = training.LABEL_SMOOTHING) -> float:
    """One training step (the reference has no dropout): the loss before the update."""
    return float(training.train_step(model, optimizer, src, tgt, labels, epsilon))


def training_state(model: Transformer, optimizer: training.Optimizer) -> checkpoint.TrainingState:
    """The run's state in checkpoint layout."""
    return training.training_state(model, optimizer)


def train_data_parallel(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
                        state: checkpoint.TrainingState | None, batches: Batches, first_step: int, steps: int,
                        world_size: int, dtype: str = "float32", device: str = "cpu",
                        epsilon: float = training.LABEL_SMOOTHING, progress: Progress = None
                        ) -> tuple[dict[str, np.ndarray], checkpoint.TrainingState, list[float]]:
    """A data-parallel run, the reference's shards one after another in this process
    (``reference_numpy.data_parallel.train``)."""
    return data_parallel.train(config, params, training, state, batches, first_step, steps, world_size, dtype,
                               device, epsilon, progress)
