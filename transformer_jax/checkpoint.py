"""The shared safetensors checkpoint <-> the Flax NNX parameters of :class:`.model.Transformer`.

The whole conversion is the data below: ``RENAMES`` turns a checkpoint name into the NNX
attribute path of its parameter, and ``TRANSPOSED`` lists the tensors stored transposed. Layer
numbers become list indices; every name not matched by ``RENAMES`` (the biases) is the same on
both sides. File validation is the reference's (:func:`reference_numpy.checkpoint.load_checkpoint`
and ``validate_params``), so a bad file gives the reference's one-line ``ValueError``.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from reference_numpy import checkpoint as reference
from reference_numpy.config import TransformerConfig

from .model import Transformer

# (checkpoint name suffix, NNX path suffix); the first matching row applies.
RENAMES: tuple[tuple[str, str], ...] = (
    ("shared_embed.weight", "src_embed.embedding"),  # the one shared module: also tgt_embed, generator.embed
    ("src_embed.weight", "src_embed.embedding"),
    ("tgt_embed.weight", "tgt_embed.embedding"),
    ("src_pos_embed.weight", "src_pos.table"),       # learned positional encoding only
    ("tgt_pos_embed.weight", "tgt_pos.table"),
    ("generator.weight", "generator.weight"),        # (D, V); absent with shared embeddings
    ("norm.weight", "norm.scale"),                   # every LayerNorm: *_attn_norm, ffn_norm, encoder.norm, ...
    ("_proj.weight", "_proj.kernel"),                # q_proj, k_proj, v_proj, o_proj (nnx.Linear)
    ("linear1.weight", "linear1.kernel"),            # feed-forward (nnx.Linear)
    ("linear2.weight", "linear2.kernel"),
)

# nnx.Linear kernels are (in, out) like the checkpoint (y = x @ W + b): nothing is transposed.
TRANSPOSED: frozenset[str] = frozenset()

Path = tuple[str | int, ...]


def nnx_path(name: str) -> Path:
    """The NNX attribute path of checkpoint tensor ``name``, e.g. ("encoder", "layers", 0, ...)."""
    for old, new in RENAMES:
        if name.endswith(old):
            name = name[:-len(old)] + new
            break
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


def name_table(config: TransformerConfig) -> dict[str, Path]:
    """Every checkpoint tensor of ``config`` -> its NNX parameter path, in checkpoint order."""
    return {name: nnx_path(name) for name in reference.parameter_shapes(config)}


def parameter(model: Transformer, path: Path) -> nnx.Param:
    """The ``nnx.Param`` at ``path`` (attribute names and list indices)."""
    node = model
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def from_params(config: TransformerConfig, params: dict[str, np.ndarray], dtype=jnp.float64) -> Transformer:
    """A :class:`Transformer` in ``dtype`` holding ``params`` (checkpoint names and layout).

    ``params`` is validated by the reference (names, shapes, one float dtype, finite values),
    cast to ``dtype`` on the host, then checked tensor by tensor against the NNX shapes.
    """
    params = {name: np.asarray(value) for name, value in params.items()}
    reference.validate_params(config, params)
    model = Transformer(config, dtype, rngs=nnx.Rngs(0))
    for name, path in name_table(config).items():
        value = np.asarray(params[name], dtype=model.dtype)
        value = value.T if name in TRANSPOSED else value
        target = parameter(model, path)
        if value.shape != target.shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}; the NNX parameter "
                             f"{'.'.join(map(str, path))} has shape {target.shape}")
        target[...] = jnp.asarray(value)
    return model


def to_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters in checkpoint names and layout, as NumPy arrays of the model's dtype."""
    params = {}
    for name, path in name_table(model.config).items():
        value = np.asarray(parameter(model, path)[...])
        params[name] = value.T if name in TRANSPOSED else value
    return params


def load_checkpoint(path: str | os.PathLike, dtype=jnp.float64) -> Transformer:
    """Read, validate (the reference's checks and errors) and load a shared checkpoint."""
    config, params = reference.load_checkpoint(path)
    return from_params(config, params, dtype)


def save_checkpoint(model: Transformer, path: str | os.PathLike) -> None:
    """Write the model as a shared checkpoint (atomically, by the reference's writer)."""
    reference.save_checkpoint(path, model.config, to_params(model))
