"""The adapter of the PyTorch port: NumPy in, NumPy out (:class:`equivalence.contract.Backend`).

Models
are built in eval mode; every call but :func:`gradients` and :func:`train_step` runs without gradients,
and those two leave the model in eval mode. On CUDA, :func:`build` turns TF32 off
(:func:`transformer_torch.device.full_precision`) so that float32 means float32.

A bfloat16 or float16 model (P) returns its stages and attention weights as NumPy arrays of P (``ml_dtypes.bfloat16``,
``np.float16``) and its log-probabilities in float32; :func:`component` rounds float inputs to P with the reference's
``round_to`` before they become tensors; :func:`gradients` are P arrays. :func:`optimizer` with ``dtype`` P trains a
float32 model in mixed precision (``transformer_torch.training.optimizer``; :func:`loss_scale` reads float16's
``GradScaler``).
"""

from __future__ import annotations

import contextlib
import weakref

import numpy as np
import torch

from equivalence.backends import in_recipe
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
from transformer_torch import checkpoint, data_parallel, decoding, speed, training
from transformer_torch.capture import capture_stages
from transformer_torch.device import devices as _devices
from transformer_torch.device import full_precision, resolve_device
from transformer_torch.model import (
    Transformer,
    padding_mask,
    residual,
    scaled_dot_product_attention,
    target_mask,
)
from transformer_torch.precision import dtype_name, from_numpy, to_numpy

NAME = "torch"
FORWARD_PATH = "eager"
# the autocast dtype of each model built in "mixed-bfloat16" or "mixed-float16" (a float32 model): every call of this
# adapter on it runs under torch.autocast(device_type, dtype), the framework's own switch
_AUTOCAST: weakref.WeakKeyDictionary[Transformer, torch.dtype] = weakref.WeakKeyDictionary()


def _recipe(model: Transformer) -> contextlib.AbstractContextManager:
    """``torch.autocast`` of a model built in a mixed precision, on its device's type; nothing for any other."""
    mixed = _AUTOCAST.get(model)
    return contextlib.nullcontext() if mixed is None else torch.autocast(model.device.type, dtype=mixed)


_in_recipe = in_recipe(_recipe)


def devices() -> list[str]:
    """Devices this backend can run on here: "cpu" and "cuda:N" for every visible GPU."""
    return _devices()


def build(config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
          device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32", "float64", "bfloat16" or "float16") on ``device`` from checkpoint-layout
    arrays; "mixed-bfloat16" or "mixed-float16": a float32 model whose calls run under ``torch.autocast``."""
    _prepare(device)
    stored, mixed = parse_precision(dtype)
    return _autocast(checkpoint.from_params(config, params, stored.name, device), mixed)


def load(path: Path, dtype: str = "float64", device: str = "cpu") -> Transformer:
    """A model in ``dtype`` ("float32", "float64", "bfloat16" or "float16", or a mixed precision as :func:`build`)
    from a shared checkpoint file."""
    _prepare(device)
    stored, mixed = parse_precision(dtype)
    return _autocast(checkpoint.load_checkpoint(path, stored.name, device), mixed)


def _autocast(model: Transformer, mixed: np.dtype | None) -> Transformer:
    """``model``, its calls through this adapter under ``torch.autocast`` in ``mixed`` (None: none), its weights
    packed for oneDNN where its inference multiplies them there (``speed.pack_weights``: this adapter changes them
    only in place, by its optimizers' steps, which the packed copies follow)."""
    if mixed is not None:
        _AUTOCAST[model] = getattr(torch, mixed.name)
    return speed.pack_weights(model)


def load_training_state(path: Path, dtype: str | None = None) -> TrainingState | None:
    """A saved run's training state (None if the file holds none), each moment read into a tensor torch allocated
    (``checkpoint.load_training_state``), which :func:`optimizer` takes as Adam's own without a copy."""
    return checkpoint.load_training_state(path, dtype)


def save(model: Transformer, path: Path, training: TrainingState | None = None, tokenizer: str | None = None) -> None:
    """Write the model's weights (and a run's training state, and a tokenizer's JSON text) as a shared checkpoint."""
    checkpoint.save_checkpoint(model, path, training, tokenizer)


def export_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) arrays)."""
    return checkpoint.to_params(model)


@_in_recipe
@torch.no_grad()
def forward(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
            ) -> dict[str, np.ndarray]:
    """Every stage of the forward pass (inference), by the shared stage names: in the model's dtype, log_probs in
    float32 for a bfloat16 or float16 model."""
    _, stages = capture_stages(model.eval(), src, tgt, src_mask, tgt_mask)
    return {name: _numpy(value) for name, value in stages.items()}


@_in_recipe
@torch.no_grad()
def log_probs(model: Transformer, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None) -> np.ndarray:
    """The forward pass's (B, T, V) log-probabilities alone (inference); float32 for a bfloat16 or float16 model."""
    return _numpy(model.eval()(src, tgt, src_mask, tgt_mask))


@_in_recipe
@torch.no_grad()
def component(model: Transformer, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run one component on NumPy inputs; weights come from layer 0 of each stack.

    ``inputs`` keys: attention and multi_head_attention take query, key, value, mask;
    positional_encoding, feed_forward, layer_norm, encoder_layer, encoder and generator take x (and mask);
    decoder_layer and decoder take x, memory, src_mask, tgt_mask. Float inputs are rounded to the model's dtype
    (``round_to``: once, also from float64 to bfloat16) and become tensors exactly.
    """
    return _numpy(run_component(model.eval(), name, _component_tensors(model, inputs), scaled_dot_product_attention))


def _component_tensors(model: Transformer, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor | None]:
    """A component's NumPy ``inputs`` as tensors on the model's device, float ones rounded to its dtype once."""
    return {key: None if value is None else from_numpy(np.ascontiguousarray(value)).to(model.device)
            for key, value in rounded_inputs(inputs, dtype_name(model.dtype)).items()}

@_in_recipe
def component_gradients(model: Transformer, name: str, inputs: dict[str, np.ndarray], grad_out: np.ndarray
                        ) -> dict[str, np.ndarray]:
    """The gradients of sum(component * grad_out) with respect to the component's float inputs (attention's query,
    key and value; LayerNorm's x), by autograd, in the model's dtype."""
    keys, t = check_gradient_request(name), _component_tensors(model, inputs)
    with torch.enable_grad():
        wrt = [torch.as_tensor(t[key]).requires_grad_() for key in keys]          # float inputs: never None
        t.update(zip(keys, wrt))
        out = run_component(model.eval(), name, t, scaled_dot_product_attention)
        seed = from_numpy(round_to(grad_out, dtype_name(model.dtype))).to(model.device)
        grads = torch.autograd.grad(out, wrt, seed)
    return {key: _numpy(grad) for key, grad in zip(keys, grads)}

@_in_recipe
def greedy(model: Transformer, src: Tokens, use_cache: bool = True, forced_bos_id: int | None = None) -> np.ndarray:
    """Greedy tokens (B, L) without the start token, pad-filled."""
    return decoding.greedy_decode(model.eval(), src, use_cache, forced_bos_id)

@_in_recipe
def beam(model: Transformer, src: Tokens, beam_size: int = BEAM_SIZE, alpha: float | None = None,
         use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Beam-search tokens (B, L) and scores (B,)."""
    return decoding.beam_search(model.eval(), src, beam_size, alpha, use_cache, forced_bos_id)


@_in_recipe
@torch.no_grad()
def attention_weights(model: Transformer, src: Tokens, tgt: Tokens, layer: int, kind: str = "encoder") -> np.ndarray:
    """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention, default masks; in the model's dtype."""
    check_attention_request(model.config, layer, kind)
    source, target = (torch.as_tensor(np.asarray(tokens), device=model.device) for tokens in (src, tgt))
    _, stages = capture_stages(model.eval(), source, target)
    no_dropout = lambda y: y
    return _numpy(sublayer_attention_weights(
        model, stages, padding_mask(source, model.config.pad_id), target_mask(target, model.config.pad_id), layer, kind,
        lambda x, sublayer, norm: residual(x, sublayer, norm, model.config.norm_first, no_dropout)))


@_in_recipe
@torch.no_grad()
def loss(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING) -> float:
    """The label-smoothed cross-entropy of section 5.4 with dropout off (eval mode)."""
    return training.loss(model.eval(), src, tgt, labels, epsilon).item()    # arrays checked and placed by the port


@_in_recipe
def gradients(model: Transformer, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING
              ) -> tuple[float, dict[str, np.ndarray]]:
    """``(loss, grads)``: the label-smoothed cross-entropy (section 5.4, dropout off) and its
    gradient for every checkpoint tensor, in checkpoint layout (a bfloat16 or float16 model's: P arrays)."""
    return training.gradients(model, src, tgt, labels, epsilon)


@_in_recipe
def optimizer(model: Transformer, config: TrainingConfig | None = None, state: TrainingState | None = None,
              dtype: str | None = None) -> training.Optimizer:
    """``torch.optim.Adam`` with its ``LambdaLR`` schedule of section 5.3 (``transformer_torch.training.optimizer``,
    one ``Optimizer`` record); ``dtype`` bfloat16 or float16 trains a float32 model in mixed precision."""
    check_autocast_training(dtype_name(_AUTOCAST[model]) if model in _AUTOCAST else None, dtype)
    return training.optimizer(model, config, state, dtype)


def loss_scale(optimizer: training.Optimizer) -> float | None:
    """The current loss scale of a float16 mixed-precision optimizer (its ``GradScaler``'s); None for any other."""
    return None if optimizer.loss_scale is None else float(optimizer.loss_scale.get_scale())


@_in_recipe
def train_step(model: Transformer, optimizer: training.Optimizer, src: Tokens, tgt: Tokens, labels: Tokens,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One training step (dropout as the model's config says): the loss before the update."""
    return training.train_step(model, optimizer, src, tgt, labels, epsilon)


def training_state(model: Transformer, optimizer: training.Optimizer) -> TrainingState:
    """The run's state in checkpoint layout (NumPy, the model's dtype)."""
    return training.training_state(model, optimizer)


def train_data_parallel(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
                        state: TrainingState | None, batches: Batches, first_step: int, steps: int,
                        world_size: int, dtype: str = "float32", device: str = "cpu",
                        epsilon: float = LABEL_SMOOTHING, progress: Progress = None
                        ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
    """A data-parallel run on DistributedDataParallel over ``world_size`` processes
    (``transformer_torch.data_parallel.train``)."""
    return data_parallel.train(config, params, training, state, batches, first_step, steps, world_size, dtype,
                               device, epsilon, progress)


def _prepare(device: str) -> None:
    if resolve_device(device).type == "cuda":
        full_precision()


def _numpy(value: torch.Tensor) -> np.ndarray:
    return to_numpy(value.detach().cpu())
