"""The adapter of the JAX/Flax port: NumPy in, NumPy out (:class:`equivalence.contract.Backend`).

Every function runs with 64-bit JAX on
(``with jax.enable_x64(True):``, for that call and thread only), so that float64 models are
possible; importing the module changes no setting, and float32 models stay float32. bfloat16 and float16
models (``reference_numpy/precision.py``) return their stages in the format (``ml_dtypes.bfloat16``,
``np.float16``) and their log-probabilities in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import jax
import numpy as np
from flax import nnx

from equivalence.contract import Mask, Path, Progress, Tokens
from equivalence.recipes import (
    check_attention_request,
    check_gradient_request,
    rounded_inputs,
    run_component,
    sublayer_attention_weights,
)
from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import Batches
from reference_numpy.decoding import BEAM_SIZE
from reference_numpy.precision import check_autocast_training, parse_precision, round_to
from reference_numpy.training import LABEL_SMOOTHING
from transformer_jax import checkpoint, data_parallel, decoding, training
from transformer_jax import device as _device
from transformer_jax.model import Transformer, padding_mask, residual, scaled_dot_product_attention, target_mask
from transformer_jax.precision import autocast_dtype
from transformer_jax.speed import forward as _forward

NAME = "jax"
FORWARD_PATH = "jax.jit"
_Arguments = ParamSpec("_Arguments")
_Result = TypeVar("_Result")


def _x64(function: Callable[_Arguments, _Result]) -> Callable[_Arguments, _Result]:
    """``function`` run under ``jax.enable_x64(True)`` (jit caches stay valid: every call sees x64 on)."""
    @functools.wraps(function)
    def with_x64(*args: _Arguments.args, **kwargs: _Arguments.kwargs) -> _Result:
        with jax.enable_x64(True):
            return function(*args, **kwargs)
    return with_x64


@_x64
def devices() -> list[str]:
    """Devices this backend can run on here: "cpu" and "gpu:N" for each GPU JAX sees."""
    return _device.devices()


@_x64
def build(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
          device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32", "float64", "bfloat16" or "float16") on ``device`` from checkpoint-layout
    arrays; "mixed-bfloat16" or "mixed-float16": Flax's mixed precision, ``dtype=P, param_dtype=float32``."""
    stored, mixed = parse_precision(dtype)
    return _mixed(checkpoint.from_params(config, params, stored.name, device), mixed)


@_x64
def load(path: Path, dtype: str = "float64", device: str = "cpu") -> Transformer:
    """A model in ``dtype`` (float32, float64, bfloat16 or float16, or a mixed precision as :func:`build`) from a
    shared checkpoint file."""
    stored, mixed = parse_precision(dtype)
    return _mixed(checkpoint.load_checkpoint(path, stored.name, device), mixed)


def _mixed(model: Transformer, mixed: np.dtype | None) -> Transformer:
    """``model`` (float32) as Flax's mixed precision in ``mixed`` (``Transformer(config, dtype=mixed,
    param_dtype=float32)`` holding its parameters); ``model`` itself when ``mixed`` is None."""
    if mixed is None:
        return model
    new = Transformer(model.config, dtype=mixed, param_dtype=np.float32, rngs=nnx.Rngs(params=0, dropout=0))
    nnx.update(new, nnx.state(model, nnx.Param))
    return new


@_x64
def load_training_state(path: Path, dtype: str | None = None) -> TrainingState | None:
    """A saved run's training state (None if the file holds none), each moment in page-aligned memory of its own
    (``checkpoint.load_training_state``, the reference's), which :func:`optimizer` gives optax without a copy."""
    return checkpoint.load_training_state(path, dtype)


@_x64
def save(model: Transformer, path: Path, training: TrainingState | None = None, tokenizer: str | None = None) -> None:
    """Write the model's weights (and a run's training state, and a tokenizer's JSON text) as a shared checkpoint."""
    checkpoint.save_checkpoint(model, path, training, tokenizer)


@_x64
def export_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) arrays)."""
    return checkpoint.to_params(model)


@_x64
def forward(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
            ) -> dict[str, np.ndarray]:
    """Every stage of the compiled forward pass (inference), by the shared stage names, in order, in the model's
    dtype (float32, float64, bfloat16 or float16); a bfloat16 or float16 model's log-probabilities are float32."""
    _, stages = _forward(model, src, tgt, src_mask, tgt_mask, stages=True)
    return {name: np.asarray(value) for name, value in stages.items()}


@_x64
def log_probs(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None) -> np.ndarray:
    """The compiled forward pass's (B, T, V) log-probabilities alone (inference): float32 for a bfloat16 or
    float16 model."""
    return np.asarray(_forward(model, src, tgt, src_mask, tgt_mask))


@_x64
def component(model: Transformer, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run one component on NumPy inputs; weights come from layer 0 of each stack.

    ``inputs`` keys: attention and multi_head_attention take query, key, value, mask;
    positional_encoding, feed_forward, layer_norm, encoder_layer, encoder and generator take x (and mask);
    decoder_layer and decoder take x, memory, src_mask, tgt_mask. Float inputs are rounded to the model's dtype
    (float32, float64, bfloat16 or float16) by ``round_to``, once.
    """
    attention = functools.partial(scaled_dot_product_attention, dtype=autocast_dtype(model.dtype, model.param_dtype))
    return np.asarray(run_component(model, name, rounded_inputs(inputs, model.param_dtype), attention))


@_x64
def component_gradients(model: Transformer, name: str, inputs: dict[str, np.ndarray], grad_out: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """The gradients of sum(component * grad_out) with respect to the component's float inputs (attention's query,
    key and value; LayerNorm's x), by ``jax.vjp``, in the model's dtype."""
    keys, rounded = check_gradient_request(name), rounded_inputs(inputs, model.dtype)

    def component_of(*floats: jax.Array) -> jax.Array:
        return run_component(model, name, {**rounded, **dict(zip(keys, floats))}, scaled_dot_product_attention)

    _, pullback = jax.vjp(component_of, *(jax.numpy.asarray(rounded[key]) for key in keys))
    grads = pullback(jax.numpy.asarray(round_to(grad_out, model.dtype)))
    return {key: np.asarray(grad) for key, grad in zip(keys, grads)}


@_x64
def greedy(model: Transformer, src: Tokens, use_cache: bool = True, forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy tokens (B, L) without the start token, pad-filled, from the compiled decoding loop."""
    return decoding.greedy_decode(model, src, use_cache, forced_bos_id)


@_x64
def beam(model: Transformer, src: Tokens, beam_size: int = BEAM_SIZE, alpha: float | None = None,
         use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and length-normalized scores (B,), from the compiled search."""
    return decoding.beam_search(model, src, beam_size, alpha, use_cache, forced_bos_id)


@_x64
def attention_weights(model: Transformer, src: Tokens, tgt: Tokens, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks, in the model's
    dtype (float32, float64, bfloat16 or float16)."""
    check_attention_request(model.config, layer, kind)
    no_dropout = lambda y: y
    return np.asarray(sublayer_attention_weights(
        model, forward(model, src, tgt), padding_mask(src, model.config.pad_id), target_mask(tgt, model.config.pad_id),
        layer, kind, lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first, no_dropout)))


@_x64
def loss(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 with dropout off."""
    return float(training.loss(model, src, tgt, labels, epsilon, deterministic=True))


@_x64
def gradients(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING
              ) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, grads)``: the label-smoothed cross-entropy (section 5.4, dropout off) and its
    gradient for every checkpoint tensor, by checkpoint name, in checkpoint layout (NumPy; a bfloat16 or float16
    model's gradients in its format, its loss float32)."""
    return training.gradients(model, src, tgt, labels, epsilon)


@_x64
def optimizer(model: Transformer, config: TrainingConfig | None = None, state: TrainingState | None = None,
              dtype: str | None = None) -> training.Optimizer:
    """``nnx.Optimizer`` with optax's Adam and the schedule of section 5.3 (``transformer_jax.training.optimizer``,
    one ``Optimizer`` record); with ``dtype`` "bfloat16" or "float16" (a float32 model) over float32 master
    weights."""
    check_autocast_training(autocast_dtype(model.dtype, model.param_dtype), dtype)
    return training.optimizer(model, config, state, dtype)


@_x64
def loss_scale(optimizer: training.Optimizer) -> float | None:
    """The current loss scale of a float16 mixed-precision optimizer (its Flax ``DynamicScale``); None for any
    other."""
    return None if optimizer.loss_scale is None else float(optimizer.loss_scale.scale)


@_x64
def train_step(model: Transformer, optimizer: training.Optimizer, src: Tokens, tgt: Tokens, labels: Tokens,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One compiled training step (dropout as the model's config says): the loss before the update."""
    return training.train_step(model, optimizer, src, tgt, labels, epsilon)


@_x64
def training_state(model: Transformer, optimizer: training.Optimizer) -> TrainingState:
    """The run's state in checkpoint layout (NumPy, the model's dtype; mixed precision: the float32 Adam's)."""
    return training.training_state(model, optimizer)


@_x64
def train_data_parallel(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
                        state: TrainingState | None, batches: Batches, first_step: int, steps: int,
                        world_size: int, dtype: str = "float32", device: str = "cpu",
                        epsilon: float = LABEL_SMOOTHING, progress: Progress = None
                        ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A data-parallel run on a mesh of ``world_size`` devices (``transformer_jax.data_parallel.train``)."""
    return data_parallel.train(config, params, training, state, batches, first_step, steps, world_size, dtype,
                               device, epsilon, progress)
