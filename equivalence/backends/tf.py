"""The adapter of the TensorFlow/Keras port: NumPy in, NumPy out (:class:`equivalence.contract.Backend`).

Models are built with TensorFloat-32 off, run inference (``training=False``) on the device that
holds their weights, and train with ``transformer_tf.training`` (a compiled step, ``training=True``).
A bfloat16 or float16 model returns its stages and attention weights in that format (``ml_dtypes.bfloat16`` or
``np.float16`` arrays) and its log-probabilities in float32 (the recipe of ``reference_numpy/precision.py``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np
import tensorflow as tf

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
from reference_numpy.precision import DTYPES, check_autocast_training, parse_precision, round_to
from reference_numpy.training import LABEL_SMOOTHING
from transformer_tf import checkpoint, data_parallel, decoding, training
from transformer_tf import device as _device
from transformer_tf.capture import capture_stages
from transformer_tf.model import (
    Transformer,
    padding_mask,
    residual,
    scaled_dot_product_attention,
    target_mask,
)
from transformer_tf.precision import autocast_dtype
from transformer_tf.speed import compiled_forward

NAME = "tf"
FORWARD_PATH = "tf.function, XLA"


def devices() -> list[str]:
    """Devices this backend can run on here: "cpu" and "gpu:N"."""
    return _device.devices()


def build(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
          device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32", "float64", "bfloat16" or "float16") on ``device`` from checkpoint-layout
    arrays; "mixed-bfloat16" or "mixed-float16": Keras' mixed precision, the ``mixed_bfloat16`` or ``mixed_float16``
    policy."""
    _device.full_precision()
    stored, mixed = parse_precision(dtype)
    with tf.device(_device.resolve_device(device)):
        return _mixed(checkpoint.from_params(config, params, stored.name), mixed)


def load(path: Path, dtype: str = "float64", device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32", "float64", "bfloat16" or "float16", or a mixed precision as :func:`build`)
    from a shared checkpoint file (``checkpoint.load_checkpoint``: each array read is released once its variable
    holds it)."""
    _device.full_precision()
    stored, mixed = parse_precision(dtype)
    with tf.device(_device.resolve_device(device)):
        return _mixed(checkpoint.load_checkpoint(path, stored.name), mixed)


def _mixed(model: Transformer, mixed: np.dtype | None) -> Transformer:
    """``model`` (float32) under Keras' mixed policy in ``mixed`` (``Transformer(config, dtype="mixed_bfloat16")``
    holding its weights); ``model`` itself when ``mixed`` is None."""
    if mixed is None:
        return model
    new = Transformer(model.config, dtype=f"mixed_{mixed.name}")
    new.set_weights(model.get_weights())
    return new


def load_training_state(path: Path, dtype: str | None = None) -> TrainingState | None:
    """A saved run's training state (None if the file holds none), each moment in page-aligned memory of its own
    (``checkpoint.load_training_state``, the reference's), which :func:`optimizer` gives Keras's Adam without a
    copy."""
    return checkpoint.load_training_state(path, dtype)


def save(model: Transformer, path: Path, training: TrainingState | None = None, tokenizer: str | None = None) -> None:
    """Write the model's weights (and a run's training state, and a tokenizer's JSON text) as a shared checkpoint."""
    checkpoint.save_checkpoint(model, path, training, tokenizer)


def export_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) arrays)."""
    return checkpoint.to_params(model)


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its XLA-compiled forward pass


def forward(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
            ) -> dict[str, np.ndarray]:
    """Every stage of the forward pass (inference), by the shared stage names, from Keras's own eager call of the
    model: a call made once (``compare``, the equivalence harness) needs no graph, whose tracing took about 1 s a
    model and input shape on ``tiny``, 10-30 times the eager call (the graph without XLA is
    ``transformer_tf.compiled_forward(model, jit_compile=False)``, checked in tests/ports/test_tf.py). Every stage in
    the model's dtype, ``log_probs`` in float32 for a bfloat16 or float16 model."""
    with tf.device(_device.model_device(model)):           # the model's __call__ checks the inputs first
        _, stages = capture_stages(model, src, tgt, src_mask, tgt_mask, training=False)
    return {name: value.numpy() for name, value in stages.items()}


def log_probs(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None) -> np.ndarray:
    """The forward pass's (B, T, V) log-probabilities alone (inference), from ``compiled_forward`` with XLA,
    compiled once per model (and traced once per input shape); float32 for a bfloat16 or float16 model."""
    if model not in _GRAPHS:
        _GRAPHS[model] = compiled_forward(model)
    with tf.device(_device.model_device(model)):
        return _GRAPHS[model](src, tgt, src_mask, tgt_mask).numpy()


def component(model: Transformer, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run one component on NumPy inputs; weights come from layer 0 of each stack.

    ``inputs`` keys: attention and multi_head_attention take query, key, value, mask;
    positional_encoding, feed_forward, layer_norm, encoder_layer, encoder and generator take x (and mask);
    decoder_layer and decoder take x, memory, src_mask, tgt_mask.

    Float inputs are rounded to the model's dtype in NumPy (``round_to``: correctly, also from float64 to
    bfloat16, which TensorFlow's cast rounds twice), then become tensors of that dtype exactly.
    """
    with tf.device(_device.model_device(model)):
        attention = functools.partial(scaled_dot_product_attention, dtype=autocast_dtype(model.dtype_policy))
        return run_component(model, name, _component_tensors(model, inputs), attention).numpy()


def _component_tensors(model: Transformer, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """A component's NumPy ``inputs`` with the float ones rounded to the model's dtype once, as constants."""
    return {key: tf.constant(value) if isinstance(value, np.ndarray) and value.dtype in DTYPES else value
            for key, value in rounded_inputs(inputs, model.variable_dtype).items()}


def component_gradients(model: Transformer, name: str, inputs: dict[str, np.ndarray], grad_out: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """The gradients of sum(component * grad_out) with respect to the component's float inputs (attention's query,
    key and value; LayerNorm's x), by ``tf.GradientTape``, in the model's dtype."""
    keys = check_gradient_request(name)
    with tf.device(_device.model_device(model)):
        cast = _component_tensors(model, inputs)
        with tf.GradientTape() as tape:
            tape.watch([cast[key] for key in keys])
            out = run_component(model, name, cast, scaled_dot_product_attention)
        grads = tape.gradient(out, [cast[key] for key in keys],
                              output_gradients=tf.constant(round_to(grad_out, model.compute_dtype)))
    return {key: grad.numpy() for key, grad in zip(keys, grads)}


def greedy(model: Transformer, src: Tokens, use_cache: bool = True, forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy tokens (B, L) without the start token, pad-filled (compiled; with the key/value cache by default)."""
    return decoding.greedy_decode(model, src, use_cache, forced_bos_id)


def beam(model: Transformer, src: Tokens, beam_size: int = BEAM_SIZE, alpha: float | None = None,
         use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and scores (B,) (compiled; with the key/value cache by default)."""
    return decoding.beam_search(model, src, beam_size, alpha, use_cache, forced_bos_id)


def attention_weights(model: Transformer, src: Tokens, tgt: Tokens, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks, in the model's dtype
    (rounded to bfloat16 or float16 in a low precision)."""
    check_attention_request(model.config, layer, kind)
    with tf.device(_device.model_device(model)):
        _, stages = capture_stages(model, src, tgt, training=False)
        return sublayer_attention_weights(
            model, stages, padding_mask(src, model.config.pad_id), target_mask(tgt, model.config.pad_id), layer, kind,
            lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first, tf.identity)).numpy()


def loss(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 with dropout off (``training=False``)."""
    with tf.device(_device.model_device(model)):
        return float(training.loss(model, src, tgt, labels, epsilon))


def gradients(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING
              ) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, grads)``: the label-smoothed cross-entropy (section 5.4, dropout off) and its
    gradient for every checkpoint tensor, by checkpoint name, in checkpoint layout and the model's dtype (a
    bfloat16 or float16 model: P gradients, a float32 loss)."""
    return training.gradients(model, src, tgt, labels, epsilon)


def optimizer(model: Transformer, config: TrainingConfig | None = None, state: TrainingState | None = None,
              dtype: str | None = None) -> training.Optimizer:
    """Keras's Adam made to compute the paper's update, with the schedule of Eq. (3) (``transformer_tf.training``,
    one ``Optimizer`` record); ``dtype`` bfloat16 or float16 trains a float32 model in mixed precision."""
    mixed = autocast_dtype(model.dtype_policy)
    check_autocast_training(None if mixed is None else mixed.name, dtype)
    return training.optimizer(model, config, state, dtype)


def loss_scale(optimizer: training.Optimizer) -> float | None:
    """The current loss scale of a float16 mixed-precision optimizer (its ``LossScaleOptimizer``'s
    ``dynamic_scale``); None for any other."""
    return None if optimizer.loss_scale is None else float(optimizer.loss_scale.dynamic_scale.numpy())


def train_step(model: Transformer, optimizer: training.Optimizer, src: Tokens, tgt: Tokens, labels: Tokens,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One compiled training step, dropout as the model's config says: the loss before the update."""
    return training.train_step(model, optimizer, src, tgt, labels, epsilon)


def training_state(model: Transformer, optimizer: training.Optimizer) -> TrainingState:
    """Adam's moments and step count in checkpoint layout (NumPy, the model's dtype; mixed precision: the float32
    Adam's)."""
    return training.training_state(model, optimizer)


def train_data_parallel(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
                        state: TrainingState | None, batches: Batches, first_step: int, steps: int,
                        world_size: int, dtype: str = "float32", device: str = "cpu",
                        epsilon: float = LABEL_SMOOTHING, progress: Progress = None
                        ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A data-parallel run on a MirroredStrategy over ``world_size`` devices
    (``transformer_tf.data_parallel.train``)."""
    return data_parallel.train(config, params, training, state, batches, first_step, steps, world_size, dtype,
                               device, epsilon, progress)
