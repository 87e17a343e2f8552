"""The shared checkpoint <-> the PyTorch port's parameters.

The conversion is data: the architecture's tensors as the reference walks it once
(``reference_numpy.checkpoint.parameters``: name, shape, kind) and a table, kind -> torch parameter path and
layout, from which :func:`name_table` (checkpoint name -> torch parameter path, one exact entry per tensor) and
:func:`transposed` (the exact names of the tensors stored (in, out) in the checkpoint, so that y = x @ W + b, and
(out, in) by ``nn.Linear`` and the generator) are computed. Every tensor's shape is checked against the parameter it
fills. The model is built on the meta device (no random initialization) and filled by torch's
own ``load_state_dict(strict=True, assign=True)``. A file is read by the reference's
``reference_numpy.checkpoint.CheckpointReader`` (so load errors are the reference's one-line ``ValueError``s), each
tensor straight into a tensor torch allocated, which becomes the parameter: loading holds every weight once.
:func:`to_checkpoint_layout` and :func:`from_checkpoint_layout` convert any per-parameter tensors (weights,
gradients, Adam's moments) with the same table.

With ``share_embeddings`` the one checkpoint tensor ``shared_embed.weight`` fills the one
parameter ``src_embed.weight`` of the embedding module that ``tgt_embed`` and ``generator``
share (tied weights). The sinusoidal table is a non-persistent buffer, not a parameter: it is
not stored, and is derived for the model's dtype and device once the weights are loaded.

dtypes are the reference's four (``reference_numpy.precision.parse_dtype``): float64, float32, bfloat16 and float16.
Weights go to a low precision P rounded once, by the reference's ``round_to`` (torch's own float64 -> bfloat16 cast
rounds twice, through float32); bfloat16 arrays, which torch cannot read from NumPy, cross through their bits. A
model in P saves a BF16 or F16 file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TransformerConfig
from reference_numpy.precision import parse_dtype, round_to

from .device import resolve_device
from .model import Transformer
from .precision import LOW, dtype_name, from_numpy, to_numpy

# kind (reference_numpy.checkpoint.Parameter) -> (torch parameter path, from the tensor's module; transposed:
# torch holds it (out, in), the checkpoint (in, out))
_LAYOUT = {"shared_embedding": ("src_embed.weight", False),     # tgt_embed and generator: the same module
           "embedding": ("{module}_embed.weight", False),
           "position": ("{module}_pos.weight", False),
           "linear.weight": ("{module}.weight", True),          # nn.Linear
           "linear.bias": ("{module}.bias", False),
           "layernorm.gain": ("{module}.weight", False),
           "layernorm.bias": ("{module}.bias", False),
           "generator": ("generator.weight", True),             # checkpoint (D, V), torch (V, D)
           "generator.bias": ("generator.bias", False)}


def name_table(config: TransformerConfig) -> dict[str, str]:
    """checkpoint name -> torch parameter path: one exact entry per tensor of
    ``parameter_shapes(config)``, in its order."""
    return {tensor.name: _LAYOUT[tensor.kind][0].format(module=tensor.module)
            for tensor in reference_checkpoint.parameters(config)}


def transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The exact checkpoint names whose torch parameter is the transpose ((out, in) vs (in, out)):
    every ``nn.Linear`` weight and the generator's."""
    return tuple(tensor.name for tensor in reference_checkpoint.parameters(config) if _LAYOUT[tensor.kind][1])


def _torch_dtype(dtype: npt.DTypeLike | torch.dtype) -> torch.dtype:
    """The torch dtype of ``dtype`` (a torch, NumPy or ml_dtypes dtype, or a name), parsed by the reference's
    ``parse_dtype``: float64, float32, bfloat16 or float16, anything else its one ``ValueError``."""
    return getattr(torch, parse_dtype(dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype).name)


def from_params(config: TransformerConfig, params: dict[str, np.ndarray],
                dtype: npt.DTypeLike | torch.dtype = torch.float64, device: str | torch.device = "cpu") -> Transformer:
    """A :class:`Transformer` in ``dtype`` on ``device``, in eval mode, from checkpoint-layout arrays."""
    reference_checkpoint.validate_params(config, params)
    return _build(config, params.items(), dtype, device)


def _build(config: TransformerConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: npt.DTypeLike | torch.dtype,
           device: str | torch.device, owned: bool = False) -> Transformer:
    """:func:`from_params` on validated checkpoint-layout ``(name, array)`` pairs, converted one at a time
    (``owned``: see :func:`_converted`)."""
    dtype, device = _torch_dtype(dtype), resolve_device(device)
    with torch.device("meta"):
        model = Transformer(config)                                         # shapes only, no initialization
    _assign(model, dict(_converted(model, tensors, dtype, device, owned)))
    return model.to(device=device, dtype=dtype).eval()                      # derives the sinusoidal table


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Fill a meta-device ``module`` with ``tensors`` (parameter path, as ``named_parameters`` lists
    it, -> a new tensor of the parameter's shape) by ``load_state_dict(strict=True, assign=True)``;
    every name of a tied weight gets its one tensor. A parameter left unfilled is an error."""
    targets = dict(module.named_parameters())                              # tied weights listed once
    if set(targets) != set(tensors):
        raise ValueError(f"the name table and the torch parameters differ: {sorted(set(targets) ^ set(tensors))}")
    by_tensor = {id(parameter): path for path, parameter in targets.items()}
    module.load_state_dict({key: tensors[by_tensor[id(tensor)]].detach()
                            for key, tensor in module.state_dict(keep_vars=True).items()}, strict=True, assign=True)


def to_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> (in, out) NumPy arrays, the model's dtype)."""
    return to_checkpoint_layout(model, dict(model.named_parameters()))


def to_checkpoint_layout(model: Transformer, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``tensors`` (torch parameter path -> a tensor shaped like that parameter: a weight, its gradient,
    an Adam moment) by checkpoint name, in checkpoint layout ((in, out) projections), as new NumPy arrays
    (copies: a later training step does not change them)."""
    flip = set(transposed(model.config))
    arrays = {}
    for name, path in name_table(model.config).items():
        value = tensors[path].detach().cpu()
        arrays[name] = np.array(to_numpy(value.T if name in flip else value), order="C")
    return arrays


def from_checkpoint_layout(model: Transformer, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_checkpoint_layout`: ``arrays`` (checkpoint name -> an array in checkpoint
    layout) by torch parameter path, each a new tensor shaped like its parameter, in the model's dtype and
    on its device. A missing, unexpected or mis-shaped array is a ``ValueError`` naming the tensor."""
    return _torch_layout(model, arrays, model.dtype, model.device)


def _torch_layout(model: Transformer, arrays: dict[str, np.ndarray], dtype: torch.dtype,
                  device: torch.device, owned: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint-layout ``arrays`` (every name of the table, no other) as tensors by parameter path, in
    ``dtype`` on ``device`` (:func:`_converted`: new ones, unless ``owned``)."""
    table = name_table(model.config)
    unexpected = sorted(set(arrays) - set(table))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r}: not a checkpoint tensor of this model")
    missing = [name for name in table if name not in arrays]
    if missing:
        raise ValueError(f"checkpoint tensor {missing[0]!r} is missing")
    return dict(_converted(model, ((name, arrays[name]) for name in table), dtype, device, owned))


def _converted(model: Transformer, tensors: Iterable[tuple[str, np.ndarray]], dtype: torch.dtype,
               device: torch.device, owned: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter path, tensor in ``dtype`` on ``device``) for each checkpoint-layout ``(name, array)``, one at a
    time, each checked against the shape of ``model``'s parameter (``model`` may live on the meta device). To a
    low precision ``dtype`` an array of another dtype is rounded once, by the reference's ``round_to``.

    Each tensor is a copy in torch's own memory, aligned as torch aligns it (a tensor sharing a NumPy array's
    memory, aligned to 16 bytes, would round some results differently in torch's vectorized kernels) -- unless
    ``owned``: the arrays are then views of memory torch allocated (:func:`load_checkpoint` and
    :func:`load_training_state` have the reader read each tensor there), which a tensor of the same dtype that is
    contiguous in torch's layout keeps as it is, so that loading holds every weight once (one that is not, such as
    a weight read in the checkpoint's layout and transposed, is copied, and its array dropped, one tensor at a
    time)."""
    table, targets, flip = name_table(model.config), dict(model.named_parameters()), set(transposed(model.config))
    for name, array in tensors:
        path = table[name]
        rounded = dtype in LOW and array.dtype != parse_dtype(dtype_name(dtype))
        array = round_to(array, dtype_name(dtype)) if rounded else array
        value = from_numpy(array if owned else np.ascontiguousarray(array))
        value = value.T if name in flip else value
        if value.shape != targets[path].shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)} after conversion; "
                             f"torch parameter {path!r} needs {tuple(targets[path].shape)}")
        yield path, value.to(device=device, dtype=dtype, memory_format=torch.contiguous_format,
                             copy=rounded or not owned or not value.is_contiguous())   # to() keeps a view as it is


def load_checkpoint(path: str | os.PathLike, dtype: npt.DTypeLike | torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> Transformer:
    """Read, validate and load a shared checkpoint (a file, or a shipped model's name such as ``"numbers-en-fr"``)
    into a :class:`Transformer` (eval mode) on ``device``, in ``dtype`` (default: the file's own: float32, float64,
    bfloat16 or float16). The file's tokenizer is read beside it, not kept in the model
    (``reference_numpy.checkpoint.load_tokenizer_json``)."""
    reader = reference_checkpoint.CheckpointReader(path)
    model = _build(reader.config, reader.read(_reading_memory(reader.config)), reader.dtype if dtype is None else dtype,
                   device, owned=True)
    reference_checkpoint.release_freed_memory()                          # arrays cast to another dtype, dropped
    return model


def load_training_state(path: str | os.PathLike, dtype: npt.DTypeLike | None = None) -> TrainingState | None:
    """The reference's ``load_training_state`` (the same checks and errors), each Adam moment read straight into a
    tensor torch allocated in its parameter's layout (a transposed weight's moment as the NumPy transpose of an
    (out, in) tensor), which :func:`.training.optimizer` takes as its ``exp_avg`` or ``exp_avg_sq`` without a copy:
    resuming holds every moment once. The optimizer then updates that memory in place: a state resumes one
    optimizer (:func:`.training.training_state` gives a new one to save)."""
    reader = reference_checkpoint.CheckpointReader(path)
    return reader.read_training(_moment_memory(reader.config), dtype)


def _moment_memory(config: TransformerConfig) -> reference_checkpoint.Allocate:
    """Where :func:`load_training_state` has the reader read each moment (``adam.m.NAME``, ``adam.v.NAME``): a new
    tensor of torch's in the layout of parameter NAME, seen in the checkpoint's layout."""
    flip = set(transposed(config))

    def allocate(name: str, shape: tuple[int, ...], stored: np.dtype) -> np.ndarray:
        if name.split(".", 2)[2] in flip:
            return to_numpy(torch.empty(shape[::-1], dtype=_torch_dtype(stored))).T
        return to_numpy(torch.empty(shape, dtype=_torch_dtype(stored)))

    return allocate


def _reading_memory(config: TransformerConfig) -> reference_checkpoint.Allocate:
    """Where :func:`load_checkpoint` has the reader read each tensor: a new tensor of torch's, which the model keeps
    as its parameter; a weight torch holds transposed, which is copied into (out, in) and dropped, an anonymous map
    the system takes back at once (``reference_numpy.checkpoint.mapped_array``)."""
    flip = set(transposed(config))
    return lambda name, shape, stored: (reference_checkpoint.mapped_array(shape, stored) if name in flip
                                        else to_numpy(torch.empty(shape, dtype=_torch_dtype(stored))))


def save_checkpoint(model: Transformer, path: str | os.PathLike, training: TrainingState | None = None,
                    tokenizer: str | None = None) -> None:
    """Write the model's weights (in its dtype: a BF16 or F16 file for a low-precision model) and config as a
    shared checkpoint, atomically; with ``training`` (from :func:`.training.training_state`) also the run's Adam
    moments and step count; and with ``tokenizer`` (its JSON text: the model holds none, it travels beside it) the
    tokenizer."""
    reference_checkpoint.save_checkpoint(path, model.config, to_params(model), training, tokenizer)
