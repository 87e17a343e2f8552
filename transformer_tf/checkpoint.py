"""The shared safetensors checkpoint <-> the Keras model.

The mapping is data, kept in one place: a table, kind -> Keras attribute path and layout, applied to the
architecture's tensors as the reference walks it once (``reference_numpy.checkpoint.parameters``: name, shape,
kind) gives :func:`name_table`, the Keras attribute path of the variable that holds every tensor of a checkpoint,
in its order.
Keras' own layers keep their own variable names (``keras.layers.Dense``: ``kernel``/``bias``;
``LayerNormalization``: ``gamma``/``beta``); the port's layers name theirs ``weight`` like the
checkpoint. :func:`transposed` is empty: a Dense kernel is (in, out) exactly like the checkpoint
(y = x @ W + b), and the embedding, positional and generator tables have the checkpoint's layout.

Loading never initializes a variable at random: the model is built under a ``keras.StatelessScope`` that
defers its variables, each is created empty (:func:`_empty_model`), and the reference's ``CheckpointReader``
reads each tensor stored in the variable's dtype straight into the variable's buffer, after a shape check that
names both sides: loading holds every weight once. A tensor of another dtype is rounded to the variable's by the
reference's ``round_to`` (TensorFlow's own float64 -> bfloat16 cast rounds twice, through float32) and assigned; a
bfloat16 or float16 model saves a BF16 or F16 file. File reading and validation are the reference's, so a bad file
gives the same one-line ``ValueError`` in every port.

Every per-variable tensor (weights, gradients, Adam's moments) crosses between the two layouts
through :func:`to_checkpoint_layout` and :func:`from_checkpoint_layout`, keyed on the Keras side
by ``variable.path``. Saving may add a training run's state (Adam's moments and step count,
format version 2).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf
from keras.src.backend.common.variables import initialize_all_variables

from reference_numpy import checkpoint as reference
from reference_numpy.checkpoint import TrainingState
from reference_numpy.checkpoint import load_training_state as load_training_state  # moments TF takes as they are
from reference_numpy.config import TransformerConfig
from reference_numpy.precision import round_to

from .model import Transformer
from .precision import parse_dtype

# kind (reference_numpy.checkpoint.Parameter) -> (Keras attribute path, from the tensor's module; transposed: none,
# a Dense kernel is (in, out) like the checkpoint)
_LAYOUT = {"shared_embedding": ("src_embed.weight", False),                # tgt_embed is the same layer
           "embedding": ("{module}_embed.weight", False),
           "position": ("{module}_pos.weight", False),
           "linear.weight": ("{module}.kernel", False),                     # keras.layers.Dense
           "linear.bias": ("{module}.bias", False),
           "layernorm.gain": ("{module}.gamma", False),                     # keras.layers.LayerNormalization
           "layernorm.bias": ("{module}.beta", False),
           "generator": ("generator.weight", False),
           "generator.bias": ("generator.bias", False)}


def name_table(config: TransformerConfig) -> dict[str, str]:
    """Checkpoint name -> Keras attribute path (list indices are path components): one exact
    entry per tensor of ``parameter_shapes(config)``, in its order."""
    return {tensor.name: _LAYOUT[tensor.kind][0].format(module=tensor.module)
            for tensor in reference.parameters(config)}


def transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The exact checkpoint names whose Keras variable is the transpose ((out, in) vs (in, out)): none."""
    return tuple(tensor.name for tensor in reference.parameters(config) if _LAYOUT[tensor.kind][1])


def from_params(config: TransformerConfig, params: dict[str, np.ndarray],
                dtype: npt.DTypeLike = "float64") -> Transformer:
    """A model in ``dtype`` (float64, float32, bfloat16 or float16) from checkpoint-layout arrays (validated like a
    checkpoint file) of any of the four."""
    reference.validate_params(config, params)
    model = _empty_model(config, parse_dtype(dtype).name)
    values = from_checkpoint_layout(model, params)
    for variable in model.weights:
        variable.assign(round_to(values.pop(variable.path), variable.dtype))
    return model


def to_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> NumPy array, the model's dtype)."""
    return to_checkpoint_layout(model, {variable.path: variable for variable in model.weights})


def to_checkpoint_layout(model: Transformer, tensors: dict) -> dict[str, np.ndarray]:
    """Per-variable tensors (weights, gradients, Adam's moments), keyed by Keras ``variable.path``, as
    NumPy arrays by checkpoint name, in checkpoint layout and the checkpoint's order. A tensor may be
    a Keras variable, a ``tf.Tensor`` or ``tf.IndexedSlices`` (an embedding's gradient)."""
    flipped = transposed(model.config)
    arrays = {name: np.array(tf.convert_to_tensor(tensors[variable.path]).numpy())   # a copy (bfloat16 too)
              for name, variable in _variables(model).items()}
    return {name: value.T if name in flipped else value for name, value in arrays.items()}


def from_checkpoint_layout(model: Transformer, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint-layout arrays by checkpoint name -> NumPy arrays in the Keras variables' layout,
    keyed by ``variable.path``; a shape that does not fit names both sides."""
    flipped = transposed(model.config)
    values = {}
    for name, variable in _variables(model).items():
        value = np.asarray(arrays[name])
        value = value.T if name in flipped else value
        _check_shape(model, name, value.shape, variable)
        values[variable.path] = value
    return values


def _check_shape(model: Transformer, name: str, shape: tuple[int, ...], variable: keras.Variable) -> None:
    if tuple(variable.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {shape}; the Keras variable "
                         f"{name_table(model.config)[name]} has shape {tuple(variable.shape)}")


def load_checkpoint(path: str | os.PathLike, dtype: npt.DTypeLike | None = None) -> Transformer:
    """Read, validate and load a shared checkpoint (a file, or a shipped model's name such as
    ``"numbers-en-fr"``) into a new model, in ``dtype`` (float64, float32, bfloat16 or float16; by default
    the dtype the file holds). The file's tokenizer is read beside it, not kept in the model
    (``reference_numpy.checkpoint.load_tokenizer_json``)."""
    reader = reference.CheckpointReader(path)
    model = _empty_model(reader.config, (reader.dtype if dtype is None else parse_dtype(dtype)).name)
    _read_into(model, reader)
    reference.release_freed_memory()                                     # arrays rounded and assigned, dropped
    return model


def save_checkpoint(model: Transformer, path: str | os.PathLike, training: TrainingState | None = None,
                    tokenizer: str | None = None) -> None:
    """Write the model (and a run's ``training`` state, from ``training.training_state``) as a shared checkpoint,
    atomically, in the model's dtype (a bfloat16 or float16 model: a BF16 or F16 file), and with ``tokenizer`` (its
    JSON text: the model holds none, it travels beside it) the tokenizer."""
    reference.save_checkpoint(path, model.config, to_params(model), training, tokenizer)


def _empty_model(config: TransformerConfig, dtype: str) -> Transformer:
    """A model in ``dtype`` whose variables hold memory not yet written (never initialized at random): it is built
    under a ``keras.StatelessScope`` that defers its variables (Keras draws no random numbers and allocates
    nothing), then each variable is created from TensorFlow's ``Empty`` tensor, which it takes as its own without a
    copy and whose pages the system provides only as they are written."""
    with keras.StatelessScope(initialize_variables=False):
        model = Transformer(config, dtype=dtype)                            # every variable deferred
    for variable in model.weights:
        variable._initializer = lambda shape, dtype: tf.raw_ops.Empty(shape=shape, dtype=dtype, init=False)
    initialize_all_variables()
    return model


def _read_into(model: Transformer, reader: reference.CheckpointReader) -> None:
    """Fill ``model``'s variables from ``reader``, one tensor at a time. A tensor stored in the dtype and layout of
    a variable in host memory is read straight into the variable's buffer (as a NumPy view, which TensorFlow's eager
    tensors give of a CPU buffer without a copy), so that loading holds every weight once; any other is read,
    rounded to the variable's dtype by the reference's ``round_to`` (TensorFlow's own float64 -> bfloat16 cast
    rounds twice, through float32), assigned (copied to the variable's device) and dropped."""
    variables, flipped = _variables(model), set(transposed(model.config))
    direct = lambda name: (variables[name].dtype == reader.dtype.name and name not in flipped
                           and "CPU" in variables[name].value.device)

    def allocate(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if not direct(name):
            return np.empty(shape, dtype)
        _check_shape(model, name, shape, variables[name])
        return variables[name].value.value()._numpy()                     # the variable's own buffer

    for name, value in reader.read(allocate):
        if not direct(name):
            value = value.T if name in flipped else value
            _check_shape(model, name, value.shape, variables[name])
            variables[name].assign(round_to(value, variables[name].dtype))


def _variables(model: Transformer) -> dict:
    """Checkpoint name -> the model's Keras variable, in the checkpoint's order; refuses a model
    with a variable the table does not reach (none may be left unloaded)."""
    variables = {name: _attribute(model, path) for name, path in name_table(model.config).items()}
    left_out = {id(v) for v in model.weights} - {id(v) for v in variables.values()}
    if left_out:
        paths = [v.path for v in model.weights if id(v) in left_out]
        raise ValueError(f"the name table reaches no checkpoint tensor for the Keras variable {paths[0]}")
    return variables


def _attribute(model: Transformer, path: str) -> keras.Variable:
    """The object at a Keras attribute path such as ``decoder.layers.0.ffn.linear1.kernel``."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node
