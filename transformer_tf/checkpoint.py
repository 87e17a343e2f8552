"""The shared safetensors checkpoint <-> the Keras model.

The mapping is data, kept here in one place:

* ``MODULES``: checkpoint module names that differ from the Keras attribute names;
* ``LEAVES``: what each kind of module calls the checkpoint's ``weight`` and ``bias``
  (``keras.layers.Dense`` names them ``kernel``/``bias``, ``LayerNormalization``
  ``gamma``/``beta``);
* ``TRANSPOSED``: tensors stored transposed relative to the Keras weight. It is empty: a
  Dense kernel is (in, out) exactly like the checkpoint (y = x @ W + b), and the generator and
  embedding tables have the checkpoint's layout too.

File reading and validation are the reference's (``reference_numpy.checkpoint``), so a bad
file gives the same one-line ``ValueError`` in every port. Every tensor's shape is checked
against its Keras weight before it is assigned.
"""

from __future__ import annotations

import os

import numpy as np

from reference_numpy import checkpoint as reference
from reference_numpy.config import TransformerConfig

from .model import Transformer

MODULES = {"shared_embed": "src_embed", "src_pos_embed": "src_pos", "tgt_pos_embed": "tgt_pos"}
LEAVES = {  # kind of module (last word of its name) -> checkpoint leaf -> Keras variable name
    "proj": {"weight": "kernel", "bias": "bias"},        # keras.layers.Dense, kernel (in, out)
    "linear": {"weight": "kernel", "bias": "bias"},      # keras.layers.Dense, kernel (in, out)
    "norm": {"weight": "gamma", "bias": "beta"},         # LayerNorm (keras.layers.LayerNormalization)
    "embed": {"weight": "embeddings"},                   # Embeddings (V, D), learned PositionalEncoding (L, D)
    "generator": {"weight": "kernel"},                   # Generator (D, V)
}
TRANSPOSED: frozenset[str] = frozenset()


def keras_path(name: str) -> str:
    """The Keras attribute path of one checkpoint tensor, e.g.
    ``encoder.layers.0.self_attn.q_proj.weight`` -> ``encoder.layers.0.self_attn.q_proj.kernel``."""
    *modules, leaf = name.split(".")
    kind = modules[-1].rstrip("0123456789").split("_")[-1]
    return ".".join([MODULES.get(modules[0], modules[0]), *modules[1:], LEAVES[kind][leaf]])


def name_table(config: TransformerConfig) -> dict[str, str]:
    """Checkpoint name -> Keras attribute path, for every tensor of ``config``'s checkpoint."""
    return {name: keras_path(name) for name in reference.parameter_shapes(config)}


def keras_weight(model: Transformer, path: str):
    """The Keras variable at an attribute path (list indices are path components)."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def named_weights(model: Transformer) -> dict:
    """Checkpoint name -> the model's Keras variable, in the checkpoint's order."""
    return {name: keras_weight(model, path) for name, path in name_table(model.config).items()}


def checkpoint_layout(name: str, value: np.ndarray) -> np.ndarray:
    """A Keras weight's value (or gradient) in the checkpoint's layout, and back (a transpose is
    its own inverse)."""
    return value.T if name in TRANSPOSED else value


def from_params(config: TransformerConfig, params: dict[str, np.ndarray], dtype="float64") -> Transformer:
    """A model in ``dtype`` from checkpoint-layout arrays (validated like a checkpoint file)."""
    reference.validate_params(config, params)
    model = Transformer(config, dtype=dtype)
    for name, weight in named_weights(model).items():
        value = checkpoint_layout(name, params[name])
        if tuple(weight.shape) != value.shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}; the Keras weight "
                             f"{keras_path(name)} has shape {tuple(weight.shape)}")
        weight.assign(value.astype(model.compute_dtype))
    return model


def to_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights in checkpoint layout (name -> NumPy array, the model's dtype)."""
    return {name: checkpoint_layout(name, np.array(weight.numpy())) for name, weight in named_weights(model).items()}


def load_checkpoint(path: str | os.PathLike, dtype="float64") -> Transformer:
    """Read, validate and load a shared checkpoint into a new model in ``dtype``."""
    config, params = reference.load_checkpoint(path)
    return from_params(config, params, dtype)


def save_checkpoint(model: Transformer, path: str | os.PathLike) -> None:
    """Write the model as a shared checkpoint (atomically, in the model's dtype)."""
    reference.save_checkpoint(path, model.config, to_params(model))
