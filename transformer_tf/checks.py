"""The reference's input checks (``reference_numpy/checks.py``) on TensorFlow's tensors.

Each function reads a tensor's shape and dtype name (None for a size unknown while ``tf.function`` traces) -- its
values only where a check needs them and the tensor is eager -- and calls the reference's check, so a bad input
gets the reference's one-line ``ValueError``, naming the argument, as in every backend. NumPy arrays and nested
lists are taken too. :mod:`.model` calls these at its public entry points and holds the math alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from reference_numpy import checks


def layout(name: str, value: tf.Tensor | np.ndarray) -> tuple[tuple, str]:
    """(shape, dtype name) of a tensor or array argument."""
    if not tf.is_tensor(value):
        value = checks.as_array(name, value)
    return tuple(value.shape), value.dtype.name


def describe(name: str, value: tf.Tensor | np.ndarray | None) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional tensor or array argument (the reference's ``describe``)."""
    return None if value is None else layout(name, value)


def checked_mask(name: str, mask: tf.Tensor, scores_shape: tuple) -> tf.Tensor:
    """A bool mask broadcastable to ``scores_shape`` (None: a size unknown while tracing), as a tensor (the
    reference's ``checked_mask``)."""
    checks.check_mask(name, *layout(name, mask), tuple(scores_shape))
    return tf.convert_to_tensor(mask)


def checked_memory(memory: tf.Tensor, batch: int | None, d_model: int, model_dtype: str) -> tf.Tensor:
    """The encoder output given to ``decode`` or ``init_cache`` (``batch`` None: any) after the reference's
    ``check_memory``, as a tensor: an array or nested lists as NumPy reads them (Python floats are float64), the
    dtype that was checked."""
    if not tf.is_tensor(memory):
        memory = checks.as_array("memory", memory)
    checks.check_memory(*layout("memory", memory), batch, d_model, model_dtype)
    return tf.convert_to_tensor(memory)


def check_tokens(name: str, tokens: tf.Tensor, vocab_size: int, max_len: int) -> tf.Tensor:
    """Token ids after the reference's checks -- shape and dtype always, the id range unless the tensor is
    symbolic (traced) -- as int64 (``tf.gather`` takes no unsigned indices)."""
    if tf.is_symbolic_tensor(tokens):
        checks.check_token_layout(name, *layout(name, tokens), max_len)
    elif tf.is_tensor(tokens):
        checks.check_tokens(name, tokens.numpy(), vocab_size, max_len)
    else:
        tokens = checks.check_tokens(name, tokens, vocab_size, max_len)
    return tf.cast(tokens, tf.int64)


def check_beams(beams: tf.Tensor, rows: int, capacity: int) -> None:
    """A cache's ``beams`` table: (rows / K, K, capacity), integer (the reference's ``check_beams``)."""
    checks.check_beams(*layout("cache.beams", beams), rows, capacity)


def check_cache_index(cache_index: Any, length: int, capacity: int) -> Any:   # Any: what a caller gave
    """``cache_index`` (an int >= 0 with the ``length`` new positions inside the cache) after the reference's
    check when its value is known: an eager tensor is read; a traced one is left to the compiled caller (the
    searches bound it by construction) and returned as it is."""
    if tf.is_symbolic_tensor(cache_index):
        return cache_index
    return checks.check_cache_index(cache_index.numpy().item() if tf.is_tensor(cache_index) else cache_index,
                                    length, capacity)


def checked_forward_inputs(config: Any, src: tf.Tensor, tgt: tf.Tensor, src_mask: tf.Tensor | None,
                           tgt_mask: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """The forward pass's token ids after :func:`check_tokens` and the reference's ``check_forward_inputs``."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    checks.check_forward_inputs(config, tuple(src.shape), tuple(tgt.shape), describe("src_mask", src_mask),
                                describe("tgt_mask", tgt_mask))
    return src, tgt


def checked_source(config: Any, src: tf.Tensor, src_mask: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``encode``'s inputs: the source ids after :func:`check_tokens`, ``src_mask`` (None stays None) after the
    reference's ``check_mask`` against the encoder's (B, H, S, S) scores (the reference's ``checked_source``)."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    if src_mask is not None:
        (batch, length), heads = src.shape, config.n_heads
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, length))
    return src, src_mask


def checked_target(config: Any, tgt: tf.Tensor, memory: tf.Tensor, model_dtype: str) -> tuple[tf.Tensor, tf.Tensor]:
    """``decode``'s inputs: the target ids after :func:`check_tokens`, the encoder output after
    :func:`checked_memory` (the reference's ``checked_target``)."""
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    return tgt, checked_memory(memory, tgt.shape[0], config.d_model, model_dtype)


def checked_decoder_masks(config: Any, tgt_shape: tuple, memory_length: int, keys: int, src_mask: tf.Tensor | None,
                          tgt_mask: tf.Tensor | None) -> tuple[tf.Tensor | None, tf.Tensor | None]:
    """``decode``'s masks (None stays None) after the reference's ``check_mask``: ``src_mask`` against the decoder's
    (B, H, T, S) scores, ``tgt_mask`` against its (B, H, T, ``keys``) self-attention scores (the reference's
    ``checked_decoder_masks``)."""
    (batch, length), heads = tgt_shape, config.n_heads
    if src_mask is not None:
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, memory_length))
    if tgt_mask is not None:
        tgt_mask = checked_mask("tgt_mask", tgt_mask, (batch, heads, length, keys))
    return src_mask, tgt_mask
