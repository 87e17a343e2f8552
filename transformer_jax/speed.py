"""What makes the JAX port's model fast and compiled; the math is in :mod:`.model`.

Three jobs, one seam each:

* **Compiled calls.** Every compiled entry point of the port (:func:`compiled_forward` and :func:`forward` here,
  ``decoding.greedy_decode`` and ``beam_search``, the training steps) enters the model through one seam,
  :func:`_split`: the model is split once per model object and rebuilt inside the function compiled by plain
  ``jax.jit`` (``_Structure.merge``), where ``nnx.jit`` walks the whole module graph at every call;
  :data:`_EXACT_ROUNDING` keeps XLA from dropping the precision recipe's roundings to bfloat16 or float16.
* **Attention along beams.** :func:`beam_scores` and :func:`beam_mix` are where ``incremental.beam_attention``
  (Eq. (1) along beam hypotheses) computes its products along a beam-search cache's hypotheses without gathering
  keys and values.
* **The log-softmax's row sums.** :func:`sum_exp` is the one place ``model.log_softmax`` calls into this module:
  the sum of ``exp`` over a row as matrix products with ones over chunks of it, which XLA:CPU runs faster than a
  row sum of ``exp``, at the same float32 error.

The numbers (per-call overhead, the log-softmax over a 37,000-class vocabulary): docs/benchmarks-jax.md,
"Speed and memory work". :mod:`.model` imports this module for :func:`sum_exp`; this module imports nothing from
the model (:class:`_Model` says what the compiled calls use of it).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy.typing as npt
from flax import nnx
from jax import lax

from reference_numpy.capture import stage_paths
from reference_numpy.config import TransformerConfig

from .capture import capture_stages

_HIGHEST = lax.Precision.HIGHEST   # every product in full float32, as the model's (GPUs included)

# ----------------------------------------------------------------------------- attention along beams

def beam_scores(query: jax.Array, key: jax.Array, beams: jax.Array) -> jax.Array:
    """Q K^T along each query row's hypothesis (a cache's ``beams`` table: position c of the hypothesis in row
    b*K + j is in row b*K + beams[b, j, c]) without gathering keys: every query row of a sentence against every
    key row of it (K times the products, a few KB), then at each position the score against the row ``beams``
    names. Shape: query (N, H, Tq, d_k), key (N, H, C, d_k), beams (B, K, C) -> (N, H, Tq, C)."""
    batch, k, capacity = beams.shape
    _, heads, length, _ = query.shape
    every = jnp.matmul(_every_row(query, beams), jnp.swapaxes(key, -1, -2), precision=_HIGHEST)   # (N, H, K*Tq, C)
    every = every.reshape(batch, k, heads, k, length, capacity)          # (B, Ki, H, Kj, Tq, C)
    scores = jnp.where(_picked(beams), every, 0).sum(axis=1)             # (B, H, Kj, Tq, C)
    return scores.transpose(0, 2, 1, 3, 4).reshape(batch * k, heads, length, capacity)


def beam_mix(weights: jax.Array, value: jax.Array, beams: jax.Array) -> jax.Array:
    """weights V along each query row's hypothesis without gathering values: each key row's values weighted by
    the weights of the positions it holds for every query row, summed over key rows.
    Shape: weights (N, H, Tq, C), value (N, H, C, d_v), beams (B, K, C) -> (N, H, Tq, d_v)."""
    batch, k, capacity = beams.shape
    _, heads, length, _ = weights.shape
    every = _every_row(weights, beams).reshape(batch, k, heads, k, length, capacity)   # (B, Ki, H, Kj, Tq, C)
    every = jnp.where(_picked(beams), every, 0).reshape(batch * k, heads, k * length, capacity)
    out = jnp.matmul(every, value, precision=_HIGHEST)                   # (N, H, K*Tq, d_v)
    out = out.reshape(batch, k, heads, k, length, -1).sum(axis=1)        # (B, H, Kj, Tq, d_v)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch * k, heads, length, -1)


def _every_row(x: jax.Array, beams: jax.Array) -> jax.Array:
    """For key row b*K + i, the rows of all K query rows of sentence b, one after the other.

    Shape: x (N, H, Tq, Z), beams (B, K, C) -> (N, H, K*Tq, Z).
    """
    batch, k, _ = beams.shape
    _, heads, length, width = x.shape
    x = x.reshape(batch, 1, k, heads, length, width).transpose(0, 1, 3, 2, 4, 5)   # (B, 1, H, K, Tq, Z)
    x = jnp.broadcast_to(x, (batch, k, heads, k, length, width))           # (B, Ki, H, Kj, Tq, Z)
    return x.reshape(batch * k, heads, k * length, width)


def _picked(beams: jax.Array) -> jax.Array:
    """(B, Ki, 1, Kj, 1, C) bool: position c of query row b*K + j is in key row b*K + i."""
    k = beams.shape[1]
    return beams[:, None, None, :, None, :] == jnp.arange(k, dtype=beams.dtype).reshape(1, k, 1, 1, 1, 1)


# ----------------------------------------------------------------------------- the log-softmax's row sums

_CHUNK_RANGE = (64, 1024)   # chunk lengths whose products with ones keep the plain sum's float32 error


def sum_exp(shifted: jax.Array) -> jax.Array:
    """sum(exp(shifted)) over the last axis, kept: products of the exps with a vector of ones over chunks of the
    row (:func:`_sum_chunk`), then the sum of the chunks' totals. XLA:CPU computes an exp inside a row sum one
    element at a time; here the exp runs on its own and the sum is a matrix product. A row with no such chunk is
    summed plainly.

    Shape: (..., V) -> (..., 1).
    """
    chunk = _sum_chunk(shifted.shape[-1])
    if chunk is None:
        return jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)
    chunks = jnp.exp(shifted).reshape(*shifted.shape[:-1], -1, chunk)                       # (..., V / chunk, chunk)
    totals = jnp.matmul(chunks, jnp.ones(chunk, shifted.dtype), precision=_HIGHEST)   # (..., V / chunk)
    return jnp.sum(totals, axis=-1, keepdims=True)


def _sum_chunk(classes: int) -> int | None:
    """The largest divisor of ``classes`` in :data:`_CHUNK_RANGE` (a row of up to 1,024 classes is one chunk),
    or None: then no chunk is both long enough to pay and short enough to keep the error."""
    low, high = _CHUNK_RANGE
    if classes <= high:
        return classes
    return next((c for c in range(high, low - 1, -1) if classes % c == 0), None)


# ----------------------------------------------------------------------------- compiled calls

class _Model(Protocol):
    """What the compiled forward pass uses of a ``model.Transformer``."""

    config: TransformerConfig

    def __call__(self, src: jax.Array, tgt: jax.Array, src_mask: jax.Array | None = None,
                 tgt_mask: jax.Array | None = None) -> Any: ...

    def _check_inputs(self, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: npt.ArrayLike | None,
                      tgt_mask: npt.ArrayLike | None) -> tuple[jax.Array, jax.Array]: ...


_M = TypeVar("_M")   # the model a structure rebuilds (``model.Transformer``)


def compiled_forward(model: _Model, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: npt.ArrayLike | None = None,
                     tgt_mask: npt.ArrayLike | None = None, stages: bool = False) -> Any:
    """``model(src, tgt, src_mask, tgt_mask)`` compiled with ``jax.jit`` on the model's split state (one
    compilation per model structure, input shapes, mask presence and ``stages``; the model is split once, see
    :func:`_split`); dropout streams the call draws from advance, as in ``nnx.jit``. With ``stages``, the call is
    ``capture_stages(model, ...)`` (:mod:`.capture`), which returns ``(log_probs, stages)``.

    The inputs are checked on the host first: once traced, token ids can no longer be compared
    with the vocabulary size (an id out of range would give NaN log-probabilities).
    Shape: as :class:`~.model.Transformer`.
    """
    src, tgt = model._check_inputs(src, tgt, src_mask, tgt_mask)
    split = _split(model)
    result, streams = _jitted_forward(split.structure, split.state, src, tgt, src_mask, tgt_mask, stages)
    for variable, value in zip(split.streams, streams):
        variable.set_raw_value(value)
    return result


def forward(model: _Model, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: npt.ArrayLike | None = None,
            tgt_mask: npt.ArrayLike | None = None, stages: bool = False) -> Any:
    """:func:`compiled_forward` with the stages in forward order (``jax.jit`` returns dicts with sorted keys;
    :func:`~reference_numpy.capture.stage_paths` holds the order).

    Shape: as :class:`~.model.Transformer`.
    """
    result = compiled_forward(model, src, tgt, src_mask, tgt_mask, stages)
    if not stages:
        return result
    log_probs, found = result
    return log_probs, {name: found[name] for name in stage_paths(model.config)}


# XLA may leave out a conversion to bfloat16 or float16 when the next operation reads the value in float32
# ("excess precision", on by default): it dropped the rounding of the logits before the log-softmax, and a
# bfloat16 model's log-probabilities then differed from the reference's by 0.027 (seven units of the logits)
# instead of 0.004 (one). The port's compiled functions turn it off, so that every rounding of the recipe happens;
# float32 and float64 programs have no such conversion and compile as before.
_EXACT_ROUNDING = {"xla_allow_excess_precision": False}


@functools.partial(jax.jit, static_argnames=("structure", "stages"), compiler_options=_EXACT_ROUNDING)
def _jitted_forward(structure: _Structure[_Model], state: nnx.State, src: jax.Array, tgt: jax.Array,
                    src_mask: jax.Array | None, tgt_mask: jax.Array | None,
                    stages: bool) -> tuple[Any, list[jax.Array]]:
    """The forward pass (with ``stages``, :func:`.capture.capture_stages` of it) and the values of the model's
    dropout streams after it (as :func:`_streams` lists them)."""
    model = structure.merge(state)
    result = capture_stages(model, src, tgt, src_mask, tgt_mask) if stages else model(src, tgt, src_mask, tgt_mask)
    return result, [variable.get_raw_value() for variable in _streams(model)]


class _Structure(Generic[_M]):
    """A model's ``nnx.GraphDef`` as a static argument of ``jax.jit``: its hash is computed once (hashing
    a GraphDef walks every node, and jit hashes static arguments at every call: docs/benchmarks-jax.md);
    equal structures compare equal, so models of one structure share their compilations."""

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Structure) and self.graphdef == other.graphdef)

    def merge(self, state: nnx.State) -> _M:
        """The model of this structure holding ``state`` (inside a compiled function: traced values)."""
        return nnx.merge(self.graphdef, state)


class _Split(NamedTuple, Generic[_M]):
    """A model split for compiled calls (:func:`_split`)."""

    structure: _Structure[_M]
    state: nnx.State                                   # the model's own Variables: values read at each call
    variables: tuple[tuple[tuple, nnx.Variable], ...]  # (path, Variable) of every entry of ``state``
    streams: tuple[nnx.Variable, ...]                  # the dropout streams' keys and counts (:func:`_streams`)


_SPLITS: weakref.WeakKeyDictionary[Any, _Split] = weakref.WeakKeyDictionary()


def _split(model: _M) -> _Split[_M]:
    """``nnx.split(model)`` once per model object (a walk of the whole module graph, which ``nnx.jit`` pays, and
    more, at every call: docs/benchmarks-jax.md), for compiled functions of (structure, state, inputs) under plain
    ``jax.jit``.

    The state holds the model's own ``nnx.Variable`` objects, so a call passes their current values:
    a training step, ``nnx.update`` or ``variable[...] = value`` changes what the next call computes
    with. A model whose Variables or submodules were replaced (a path now leads to another Variable)
    is split again (the check is a walk of the Variables' paths, without splitting).
    """
    split = _SPLITS.get(model)
    if split is None or not all(_at(model, path) is variable for path, variable in split.variables):
        graphdef, state = nnx.split(model)
        split = _SPLITS[model] = _Split(_Structure(graphdef), state, tuple(nnx.to_flat_state(state)),
                                        tuple(_streams(model)))
    return split


def _at(node: Any, path: tuple) -> Any:
    """The attribute or list item of ``node`` at an ``nnx.State`` path."""
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _streams(model: object) -> list[nnx.Variable]:
    """The model's dropout streams' keys and counts (``nnx.RngState``), in state order."""
    return [variable for _, variable in nnx.to_flat_state(nnx.state(model, nnx.RngState))]
