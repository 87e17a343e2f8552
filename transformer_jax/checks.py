"""The reference's input checks (``reference_numpy/checks.py``) on JAX's arrays.

Each function reads an array's shape and dtype name -- its values only where a check needs them and the array
holds values (not a tracer inside ``jax.jit``: the compiled callers check before they trace) -- and calls the
reference's check, so a bad input gets the reference's one-line ``ValueError``, naming the argument, as in every
backend. NumPy arrays and nested lists are taken too. :mod:`.model` calls these at its public entry points and
holds the math alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax.typing import DTypeLike

from reference_numpy import checks

from .device import _check_dtype
from .precision import autocast_dtype


def layout(name: str, value: object) -> tuple[tuple, str]:
    """(shape, dtype name) of an array argument (traced or not)."""
    array = value if isinstance(value, jax.Array) else checks.as_array(name, value)
    return tuple(array.shape), array.dtype.name


def describe(name: str, value: object) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional array argument (the reference's ``describe``)."""
    return None if value is None else layout(name, value)


def checked_mask(name: str, mask: npt.ArrayLike, scores_shape: tuple[int, ...]) -> jax.Array:
    """A bool mask broadcastable to ``scores_shape``, as a JAX array (the reference's ``checked_mask``)."""
    checks.check_mask(name, *layout(name, mask), tuple(scores_shape))
    return jnp.asarray(mask)


def checked_memory(memory: npt.ArrayLike, batch: int | None, d_model: int, model_dtype: str) -> jax.Array:
    """The encoder output given to ``decode`` or ``init_cache`` (``batch`` None: any) after the reference's
    ``check_memory``, as a JAX array: an array or nested lists as NumPy reads them (Python floats are float64), the
    dtype that was checked."""
    if not isinstance(memory, jax.Array):
        memory = checks.as_array("memory", memory)
    checks.check_memory(*layout("memory", memory), batch, d_model, model_dtype)
    return jnp.asarray(memory)


def check_tokens(name: str, tokens: npt.ArrayLike, vocab_size: int, max_len: int) -> jax.Array:
    """Token ids after the reference's checks: shape and dtype always, the id range only on concrete (untraced)
    arrays."""
    if isinstance(tokens, jax.core.Tracer):
        checks.check_token_layout(name, *layout(name, tokens), max_len)
        return tokens
    return jnp.asarray(checks.check_tokens(name, tokens, vocab_size, max_len))


def check_beams(beams: jax.Array, rows: int, capacity: int) -> None:
    """A cache's ``beams`` table: (rows / K, K, capacity), integer (the reference's ``check_beams``)."""
    checks.check_beams(*layout("cache.beams", beams), rows, capacity)


def check_cache_index(cache_index: int | jax.Array | None, length: int, capacity: int) -> int | jax.Array:
    """``cache_index`` after the reference's check of a concrete one (an int then); a traced one, in a compiled
    decoding loop, is the loop's to bound (``lax.dynamic_update_slice`` would clamp it)."""
    if isinstance(cache_index, jax.core.Tracer):
        return cache_index
    return checks.check_cache_index(cache_index, length, capacity)


def checked_forward_inputs(config: Any, src: npt.ArrayLike, tgt: npt.ArrayLike, src_mask: npt.ArrayLike | None,
                           tgt_mask: npt.ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    """The forward pass's token ids after :func:`check_tokens` and the reference's ``check_forward_inputs``."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    checks.check_forward_inputs(config, tuple(src.shape), tuple(tgt.shape), describe("src_mask", src_mask),
                                describe("tgt_mask", tgt_mask))
    return src, tgt


def checked_source(config: Any, src: npt.ArrayLike, src_mask: npt.ArrayLike | None
                   ) -> tuple[jax.Array, jax.Array | None]:
    """``encode``'s inputs: the source ids after :func:`check_tokens`, ``src_mask`` (None stays None) after the
    reference's ``check_mask`` against the encoder's (B, H, S, S) scores (the reference's ``checked_source``)."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    if src_mask is not None:
        (batch, length), heads = src.shape, config.n_heads
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, length))
    return src, src_mask


def checked_target(config: Any, tgt: npt.ArrayLike, memory: npt.ArrayLike, model_dtype: str
                   ) -> tuple[jax.Array, jax.Array]:
    """``decode``'s inputs: the target ids after :func:`check_tokens`, the encoder output after
    :func:`checked_memory` (the reference's ``checked_target``)."""
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    return tgt, checked_memory(memory, tgt.shape[0], config.d_model, model_dtype)


def checked_decoder_masks(config: Any, tgt_shape: tuple, memory_length: int, keys: int, src_mask: npt.ArrayLike | None,
                          tgt_mask: npt.ArrayLike | None) -> tuple[jax.Array | None, jax.Array | None]:
    """``decode``'s masks (None stays None) after the reference's ``check_mask``: ``src_mask`` against the decoder's
    (B, H, T, S) scores, ``tgt_mask`` against its (B, H, T, ``keys``) self-attention scores (the reference's
    ``checked_decoder_masks``)."""
    (batch, length), heads = tgt_shape, config.n_heads
    if src_mask is not None:
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, memory_length))
    if tgt_mask is not None:
        tgt_mask = checked_mask("tgt_mask", tgt_mask, (batch, heads, length, keys))
    return src_mask, tgt_mask


def check_param_dtype(dtype: np.dtype, param_dtype: DTypeLike) -> np.dtype:
    """``param_dtype`` beside ``dtype``: ``dtype`` itself, or float32 beside bfloat16 or float16; else one ValueError
    naming ``param_dtype``.
    """
    parsed = _check_dtype(param_dtype)
    if parsed != dtype and not (parsed == np.float32 and autocast_dtype(dtype, parsed) is not None):
        raise ValueError(f"param_dtype must be the dtype ({dtype.name}) or float32 beside a bfloat16 or float16 "
                         f"dtype (mixed precision), got {parsed.name}")
    return parsed


def checked_dtypes(dtype: DTypeLike, param_dtype: DTypeLike | None) -> tuple[np.dtype, np.dtype]:
    """A model's ``dtype`` (``device._check_dtype``) and ``param_dtype``: ``dtype`` unless given, else
    :func:`check_param_dtype`'s."""
    dtype = _check_dtype(dtype)
    return dtype, dtype if param_dtype is None else check_param_dtype(dtype, param_dtype)
