"""The shared safetensors checkpoint <-> the Flax NNX parameters of :class:`.model.Transformer`.

The whole conversion is data: the architecture's tensors as the reference walks it once
(:func:`reference_numpy.checkpoint.parameters`: name, shape, kind) and a table, kind -> NNX parameter path and
layout, from which :func:`name_table` (checkpoint name -> NNX parameter path) and :func:`transposed` (empty: every
NNX parameter has the checkpoint's layout) are computed; :func:`to_checkpoint_layout` and
:func:`from_checkpoint_layout` apply them to any per-parameter tensors (parameters, gradients,
Adam's moments). Loading never initializes weights at random: one trace of the constructor under ``jax.jit``
(once per config and dtype, :func:`_skeleton`) gives the model's structure and its parameters' paths, shapes and
dtypes without creating an array, and computes the state that is not a parameter (the dropout RNG streams, seeded
with ``nnx.Rngs(params=0, dropout=0)``, and the sinusoidal tables), leaving the parameters' random initialization
out; every tensor is checked against its parameter and placed from memory of its own that ``jax.device_put`` uses
in place on the CPU: :func:`load_checkpoint` has the reference's ``CheckpointReader`` read each tensor straight
there, so that loading holds the weights once; and ``nnx.merge`` assembles the model. File validation is the reference's
(``reference_numpy.checkpoint.CheckpointReader`` and ``validate_params``), so a bad file gives
the reference's one-line ``ValueError``.

A model is float32, float64, bfloat16 or float16, from a file or arrays of any of the four: a tensor
is rounded to a low precision by the reference's ``round_to`` (NumPy's float64 -> bfloat16 cast
rounds twice, through float32), then handed to JAX as it is, exactly; a bfloat16 or float16 model
saves a BF16 or F16 file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from flax import nnx

from reference_numpy import checkpoint as reference
from reference_numpy.checkpoint import load_training_state as load_training_state  # moments JAX uses in place
from reference_numpy.config import TransformerConfig
from reference_numpy.precision import is_low, round_to

from .device import _check_dtype, resolve_device
from .model import Transformer

# kind (reference_numpy.checkpoint.Parameter) -> (NNX parameter path, from the tensor's module; transposed: none,
# nnx.Linear's kernel is (in, out) like the checkpoint)
_LAYOUT = {"shared_embedding": ("generator.embeddings.embedding", False),   # src_embed, tgt_embed: the same module
           "embedding": ("{module}_embed.embedding", False),                # nnx.Embed
           "position": ("{module}_pos.weight", False),
           "linear.weight": ("{module}.kernel", False),                     # nnx.Linear
           "linear.bias": ("{module}.bias", False),
           "layernorm.gain": ("{module}.scale", False),                     # nnx.LayerNorm
           "layernorm.bias": ("{module}.bias", False),
           "generator": ("generator.weight", False),                        # (D, V) like the checkpoint
           "generator.bias": ("generator.bias", False)}


def name_table(config: TransformerConfig) -> dict[str, str]:
    """checkpoint name -> Flax NNX parameter path: one exact entry per tensor of
    ``parameter_shapes(config)``, in its order.

    Flax's layers name their parameters ``kernel`` (``nnx.Linear``), ``scale`` (``nnx.LayerNorm``)
    and ``embedding`` (``nnx.Embed``); the port's own ones (generator, learned positions) are
    ``weight``. A path is the one ``nnx.state`` lists: with shared embeddings the one
    ``Embeddings`` module is ``src_embed``, ``tgt_embed`` and ``generator.embeddings``, and a
    shared variable is listed once, under its first path in sorted order,
    ``generator.embeddings.embedding``.
    """
    return {tensor.name: _LAYOUT[tensor.kind][0].format(module=tensor.module)
            for tensor in reference.parameters(config)}


def transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The exact checkpoint names whose NNX parameter is the transpose ((out, in) vs (in, out)):
    none. ``nnx.Linear`` kernels are (in, out) like the checkpoint (y = x @ W + b), the
    generator's ``weight`` is (D, V) like ``generator.weight``, and embedding and position tables
    are (V or L, D) on both sides."""
    return tuple(tensor.name for tensor in reference.parameters(config) if _LAYOUT[tensor.kind][1])


def from_params(config: TransformerConfig, params: dict[str, np.ndarray], dtype: npt.DTypeLike = jnp.float64,
                device: str | None = None) -> Transformer:
    """A :class:`Transformer` in ``dtype`` holding ``params`` (checkpoint names and layout), on
    ``device`` (``"cpu"``, ``"gpu:N"``; by default JAX's default device).

    ``params`` is validated by the reference (names, shapes, one float dtype, finite values),
    then each tensor is checked against its NNX parameter (a one-line ``ValueError`` naming both),
    cast to ``dtype`` (float32, float64, bfloat16 or float16; rounded once to a low one) and placed
    on the device (see the module docstring).
    """
    params = {name: np.asarray(value) for name, value in params.items()}
    reference.validate_params(config, params)
    return _assembled(config, _in_table_order(config, params), _check_dtype(dtype), device)


def to_params(model: Transformer) -> dict[str, np.ndarray]:
    """The model's parameters in checkpoint names and layout, as NumPy arrays of the model's dtype."""
    return to_checkpoint_layout(model, nnx.state(model, nnx.Param))


def to_checkpoint_layout(model: Transformer, tensors: nnx.State) -> dict[str, np.ndarray]:
    """Per-parameter tensors of ``model`` -- its parameters, their gradients (``nnx.grad``) or
    Adam's moments (section 5.3): an ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)`` --
    by checkpoint name, in checkpoint layout, as NumPy arrays (a tied matrix is one tensor)."""
    state = {_dotted(keys): value for keys, value in nnx.to_flat_state(tensors)}
    flip = set(transposed(model.config))
    arrays = {}
    for name, path in name_table(model.config).items():
        value = np.asarray(state[path][...])
        arrays[name] = value.T if name in flip else value
    return arrays


def from_checkpoint_layout(model: Transformer, arrays: dict[str, np.ndarray]) -> nnx.State:
    """The inverse of :func:`to_checkpoint_layout`: arrays by checkpoint name and layout as an
    ``nnx.State`` shaped like ``nnx.state(model, nnx.Param)``, cast to the model's dtype and placed
    like its parameter (committed to its device only if the parameter is, so that compiled steps
    are reused); a missing or mis-shaped tensor is a one-line ``ValueError`` naming it."""
    return _jax_layout(model, arrays)


def _jax_layout(model: Transformer, arrays: dict[str, np.ndarray], owned: bool = False) -> nnx.State:
    """:func:`from_checkpoint_layout`, each array copied -- or, ``owned``, one of the model's dtype placed as it is
    (``jax.device_put`` uses an array aligned to 64 bytes in place on the CPU, such as the reference's
    ``load_training_state`` reads: see :func:`_own_copy`)."""
    targets = {_dotted(keys): (keys, variable) for keys, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    own = lambda value: value if owned and value.dtype == model.param_dtype else _cast(value, model.param_dtype)
    placed = lambda value, like: jax.device_put(own(value), like.sharding if like.committed else None)
    return nnx.from_flat_state([(keys, target.replace(placed(value, target[...])))
                                for keys, target, value in
                                _converted(model.config, _in_table_order(model.config, dict(arrays)), targets)])


def load_checkpoint(path: str | os.PathLike, dtype: npt.DTypeLike | None = None,
                    device: str | None = None) -> Transformer:
    """Read, validate (the reference's checks and errors) and load a shared checkpoint (a file, or a
    shipped model's name such as ``"numbers-en-fr"``), in the file's dtype unless ``dtype`` is given
    (float32, bfloat16, float16, or float64 with ``jax_enable_x64`` on); a file of any of the four loads
    into any other. The file's tokenizer is read beside it, not kept in the model
    (``reference_numpy.checkpoint.load_tokenizer_json``)."""
    reader = reference.CheckpointReader(path)
    dtype = _check_dtype(reader.dtype if dtype is None else dtype)
    tensors = reader.read(lambda name, shape, stored: reference.mapped_array(shape, stored))   # JAX uses in place
    model = _assembled(reader.config, tensors, dtype, device, owned=True)
    reference.release_freed_memory()
    return model


def save_checkpoint(model: Transformer, path: str | os.PathLike,
                    training: reference.TrainingState | None = None, tokenizer: str | None = None) -> None:
    """Write the model (and a run's ``training`` state, from :func:`.training.training_state`) as a
    shared checkpoint, atomically, by the reference's writer, in the model's dtype (a bfloat16 model
    writes a BF16 file), and with ``tokenizer`` (its JSON text: the model holds none, it travels beside it) the
    tokenizer."""
    reference.save_checkpoint(path, model.config, to_params(model), training, tokenizer)


def _dotted(keys: tuple) -> str:
    """An NNX state path as the dotted string of :func:`name_table`."""
    return ".".join(map(str, keys))


def _assembled(config: TransformerConfig, tensors: Iterable[tuple[str, np.ndarray]], dtype: np.dtype,
               device: str | None, owned: bool = False) -> Transformer:
    """The model holding validated checkpoint-layout ``(name, array)`` pairs, taken one at a time: each array is
    copied, cast to ``dtype``, into memory of its own (:func:`_own_copy`) and placed on ``device``, so that the
    weights are held twice only one tensor at a time -- or, ``owned``, an array already in such memory
    (:func:`load_checkpoint` has the reader read each tensor into such memory) and of ``dtype`` is placed as it
    is, and the weights are held once (see the module docstring)."""
    graphdef, targets, constants = _skeleton(config, dtype)
    if set(name_table(config).values()) != set(targets):
        raise ValueError(f"the name table and the NNX parameters differ: "
                         f"{sorted(set(name_table(config).values()) ^ set(targets))}")
    where = None if device is None else resolve_device(device)
    own = lambda value: value if owned and value.dtype == dtype else _own_copy(value, dtype)
    state = nnx.from_flat_state([(keys, target.replace(jax.device_put(own(value), where)))
                                 for keys, target, value in _converted(config, tensors, targets)])
    return nnx.merge(graphdef, state, jax.device_put(constants, where))   # the constants' own Variables


def _own_copy(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` cast to ``dtype`` in an anonymous memory map of its own (``reference_numpy.checkpoint.mapped_array``):
    page-aligned, so that ``jax.device_put`` on the CPU uses it in place instead of copying it again (it does so for
    arrays aligned to 64 bytes; NumPy's are aligned to 16), and given back to the system when the model drops it.
    (Copies made by NumPy or XLA would share the heap with the arrays being dropped, which the allocator keeps
    resident after loading: docs/benchmarks-jax.md, "Loading".) To a low ``dtype`` the values are rounded by
    ``round_to`` (through a temporary copy of the one tensor)."""
    copy = reference.mapped_array(value.shape, dtype)
    copy[...] = round_to(value, dtype) if is_low(dtype) else value
    return copy


def _cast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A copy of ``value`` in ``dtype``, rounded once (``round_to``) when that is low."""
    return round_to(value, dtype) if is_low(dtype) else value.astype(dtype)


def _in_table_order(config: TransformerConfig, arrays: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` for every tensor of :func:`name_table`, in its order, each removed from ``arrays`` as it
    is given (pass a copy of a dict you keep); a missing one is a ``ValueError`` naming it."""
    for name in name_table(config):
        if name not in arrays:
            raise ValueError(f"tensor {name!r} is missing")
        yield name, arrays.pop(name)


def _converted(config: TransformerConfig, tensors: Iterable[tuple[str, np.ndarray]],
               targets: dict[str, tuple[tuple, nnx.Param]]) -> Iterator[tuple[tuple, nnx.Param, np.ndarray]]:
    """(state keys, target parameter, array in the NNX layout) for each checkpoint-layout ``(name, array)``, one
    at a time; ``targets`` maps a dotted NNX path to its keys and (abstract or real) parameter."""
    table, flip = name_table(config), set(transposed(config))
    for name, value in tensors:
        value = np.asarray(value)
        value = value.T if name in flip else value
        keys, target = targets[table[name]]
        if value.shape != target.shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}; the NNX parameter {table[name]} has shape "
                             f"{target.shape}")
        yield keys, target, value


@functools.lru_cache(maxsize=64)
def _skeleton(config: TransformerConfig, dtype: np.dtype) -> tuple[nnx.GraphDef, dict[str, tuple[tuple, nnx.Param]],
                                                                     nnx.State]:
    """One trace of the constructor under ``jax.jit``: the model's ``GraphDef``, every ``nnx.Param`` as an abstract
    parameter (shape and dtype, no array) by dotted path -> (state keys, parameter), and the computed state that is
    not a parameter (the dropout streams of ``nnx.Rngs(params=0, dropout=0)``, the sinusoidal tables). The
    parameters' random initialization is traced but not an output, so XLA never computes it (tracing the constructor
    once more, as ``nnx.eval_shape`` would for the structure, doubled a model's loading time). The random streams
    hold their counts as references: Flax updates an array-valued Variable after comparing the new value's sharding
    with the old one's, and a tracer, which has none, answers by walking the trace for its error message -- once per
    initializer, a cost that grows with the constructor's length (0.3 s of loading the shipped model); a reference
    is written in place. The streams come back from the trace as plain arrays, as before."""
    traced: dict[str, Any] = {}

    def constants() -> nnx.State:
        with nnx.var_defaults(ref=True):    # streams whose count updates are plain writes (see below)
            rngs = nnx.Rngs(params=0, dropout=0)
        model = Transformer(config, dtype=dtype, rngs=rngs)
        traced["graphdef"], params, *rest = nnx.split(model, nnx.Param, ...)         # rest: one State, the others
        traced["params"] = jax.tree.map(lambda value: jax.ShapeDtypeStruct(value.shape, value.dtype), params)
        return rest[0]

    rest = jax.jit(constants)()
    targets = {_dotted(keys): (keys, variable) for keys, variable in nnx.to_flat_state(traced["params"])}
    return traced["graphdef"], targets, rest
