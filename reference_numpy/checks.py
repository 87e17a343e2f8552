"""Input checks of the Transformer's public calls, written once for every backend.

Each port describes its tensors by shape (a tuple; None for a size unknown while tracing) and dtype name
("int64", "float32", ...) and calls these, so that a bad input gets the same one-line ``ValueError``, naming
the argument, in every backend (``reference_numpy/model.py`` and each port's ``model.py`` hold the math alone).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .config import TransformerConfig

TOKEN_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def as_array(name: str, value: object) -> np.ndarray:
    """``value`` (an array or nested lists) as a NumPy array; nested lists of unequal lengths are refused."""
    try:
        return np.asarray(value)
    except ValueError:
        raise ValueError(f"{name} must be a rectangular array, got nested sequences of different lengths") from None


def describe(name: str, value: object) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional array argument."""
    if value is None:
        return None
    array = as_array(name, value)
    return array.shape, array.dtype.name


def check_tokens(name: str, tokens: object, vocab_size: int, max_len: int, offset: int = 0) -> np.ndarray:
    """Token ids as a NumPy array, after :func:`check_token_layout` and :func:`check_token_values`."""
    ids = as_array(name, tokens)
    check_token_layout(name, ids.shape, ids.dtype.name, max_len, offset)
    check_token_values(name, ids, vocab_size)
    return ids


def check_token_layout(name: str, shape: tuple, dtype: str, max_len: int, offset: int = 0) -> None:
    """Token ids are (batch, length), of an integer dtype (any of ``TOKEN_DTYPES``), at least one
    sequence of at least one token, and ``offset`` + length <= ``max_len`` positions."""
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"{name} must have shape (batch, length), got {shape}")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{name} must hold integer token ids, got dtype {dtype}")
    if 0 in shape:
        raise ValueError(f"{name} must hold at least one sequence of at least one token, got shape {shape}")
    if shape[1] is not None and offset + shape[1] > max_len:
        raise ValueError(f"{name} length {offset + shape[1]} exceeds max_len {max_len}")


def check_token_values(name: str, tokens: np.ndarray, vocab_size: int) -> None:
    """Every id is in [0, vocab_size) (an id outside would index past the embedding table)."""
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{name} holds token ids outside [0, {vocab_size})")


def check_mask(name: str, shape: tuple, dtype: str, scores_shape: tuple) -> None:
    """A mask is boolean (True = may attend), has an axis of key positions at least, and broadcasts to the attention
    scores without enlarging them."""
    shape, scores_shape = tuple(shape), tuple(scores_shape)
    if dtype != "bool":
        raise ValueError(f"{name} must be boolean (True = may attend), got dtype {dtype}")
    if not shape:
        raise ValueError(f"{name} must have an axis of key positions at least (..., Tk), got a 0-d array; "
                         "None attends everywhere")
    fits = len(shape) <= len(scores_shape) and all(   # == each, not `in`: Dynamo misreads `in` on symbolic sizes
        size is None or target is None or size == 1 or size == target
        for size, target in zip(shape[::-1], scores_shape[::-1]))
    if not fits:
        raise ValueError(f"{name} of shape {shape} does not broadcast to the attention "
                         f"scores (B, H, Tq, Tk) = {scores_shape}")


def checked_mask(name: str, mask: object, scores_shape: tuple) -> np.ndarray:
    """``mask`` as a NumPy array, after :func:`check_mask`."""
    array = as_array(name, mask)
    check_mask(name, array.shape, array.dtype.name, scores_shape)
    return array


def check_memory(shape: tuple, dtype: str, batch: int | None, d_model: int, model_dtype: str) -> None:
    """The encoder output given to ``decode`` is (B, S, d_model), S >= 1, B the target's batch, in the model's dtype."""
    shape = tuple(shape)
    fits = len(shape) == 3 and all(size is None or target is None or size == target
                                   for size, target in zip(shape, (batch, None, d_model))) and shape[1] != 0
    if not fits:
        raise ValueError(f"memory must have shape (batch, source length, d_model) = ({batch}, S, {d_model}) "
                         f"with S >= 1, got {shape}")
    if dtype != model_dtype:
        raise ValueError(f"memory must have the model's dtype {model_dtype}, got {dtype}")


def check_cache_capacity(capacity: object, max_len: int) -> None:
    """A key/value cache holds an int number of target positions in [1, max_len]."""
    if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or not 1 <= int(capacity) <= max_len:
        raise ValueError(f"capacity must be an int in [1, {max_len}], got {capacity!r}")


def check_cache_index(cache_index: object, length: int, capacity: int) -> int:
    """A cache's ``position`` is an int >= 0 and the ``length`` new positions from it fit in a cache of ``capacity``;
    returns it as an ``int``."""
    if not isinstance(cache_index, numbers.Integral) or isinstance(cache_index, bool) or int(cache_index) < 0:
        raise ValueError(f"cache.position must be an int >= 0, got {cache_index!r}")
    if int(cache_index) + length > capacity:
        raise ValueError(f"cache holds {capacity} positions; decoding needs {cache_index + length}")
    return int(cache_index)


def check_beams(shape: tuple, dtype: str, rows: int, capacity: int) -> None:
    """A cache's ``beams`` table is an int (B, K, C) array for its N = B * K rows of C positions."""
    shape = tuple(shape)
    fits = len(shape) == 3 and all(size is None or target is None or size == target
                                   for size, target in ((shape[2], capacity), (_product(shape[:2]), rows)))
    if not dtype.startswith(("int", "uint")) or not fits:
        raise ValueError(f"cache.beams must be an int array (B, K, C) for a cache of {rows} rows of {capacity} "
                         f"positions (B * K = {rows}, C = {capacity}), got {dtype} of shape {shape}")


def check_memory_rows(rows: int | None, memory_rows: int | None) -> None:
    """The memory's cached keys and values of B sentences are read by N = B * K decoder rows (K >= 1 consecutive rows
    per sentence)."""
    if rows is not None and memory_rows is not None and (memory_rows == 0 or rows % memory_rows):
        raise ValueError(f"cache: the memory's keys and values have {memory_rows} rows; the decoder's {rows} rows "
                         f"must be a multiple of them (K consecutive rows per sentence)")


def _product(sizes: tuple) -> int | None:
    return None if None in sizes else math.prod(sizes)


def check_forward_inputs(config: TransformerConfig, src_shape: tuple, tgt_shape: tuple,
                         src_mask: tuple[tuple, str] | None, tgt_mask: tuple[tuple, str] | None) -> None:
    """The forward pass's checks beyond each token tensor's own: src and tgt have one batch size,
    ``src_mask`` fits both the encoder's (B, H, S, S) and the decoder's (B, H, T, S) scores, ``tgt_mask``
    the decoder's (B, H, T, T). Masks are (shape, dtype name) or None. Run before any computation, so
    that a Keras model refuses bad input before Keras' call wrapper reformats the error."""
    (batch, src_len), (tgt_batch, tgt_len) = src_shape, tgt_shape
    if None not in (batch, tgt_batch) and batch != tgt_batch:
        raise ValueError(f"tgt batch size {tgt_batch} differs from src batch size {batch}")
    heads = config.n_heads
    if src_mask is not None:
        for queries in (src_len, tgt_len):
            check_mask("src_mask", *src_mask, (batch, heads, queries, src_len))
    if tgt_mask is not None:
        check_mask("tgt_mask", *tgt_mask, (batch, heads, tgt_len, tgt_len))


def checked_forward_inputs(config: TransformerConfig, src: object, tgt: object, src_mask: object,
                           tgt_mask: object) -> tuple[np.ndarray, np.ndarray]:
    """The forward pass's token ids as NumPy arrays, after :func:`check_tokens` and :func:`check_forward_inputs`."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    check_forward_inputs(config, src.shape, tgt.shape, describe("src_mask", src_mask), describe("tgt_mask", tgt_mask))
    return src, tgt


def checked_memory(memory: object, batch: int | None, d_model: int, model_dtype: str) -> np.ndarray:
    """The encoder output given to ``decode`` as a NumPy array, after :func:`check_memory`."""
    memory = as_array("memory", memory)
    check_memory(memory.shape, memory.dtype.name, batch, d_model, model_dtype)
    return memory


def checked_source(config: TransformerConfig, src: object, src_mask: object) -> tuple[np.ndarray, np.ndarray | None]:
    """``encode``'s inputs: the source ids after :func:`check_tokens`, ``src_mask`` (None stays None) after
    :func:`check_mask` against the encoder's (B, H, S, S) scores."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len)
    if src_mask is not None:
        (batch, length), heads = src.shape, config.n_heads
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, length))
    return src, src_mask


def checked_target(config: TransformerConfig, tgt: object, memory: object, model_dtype: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``decode``'s inputs: the target ids after :func:`check_tokens`, the encoder output after
    :func:`checked_memory`."""
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len)
    return tgt, checked_memory(memory, len(tgt), config.d_model, model_dtype)


def checked_decoder_masks(config: TransformerConfig, tgt_shape: tuple, memory_length: int, keys: int,
                          src_mask: object, tgt_mask: object) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``decode``'s masks (None stays None) after :func:`check_mask`: ``src_mask`` against the decoder's
    (B, H, T, S) scores, ``tgt_mask`` against its (B, H, T, ``keys``) self-attention scores (``keys`` T, or a cache's
    capacity C)."""
    (batch, length), heads = tgt_shape, config.n_heads
    if src_mask is not None:
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, memory_length))
    if tgt_mask is not None:
        tgt_mask = checked_mask("tgt_mask", tgt_mask, (batch, heads, length, keys))
    return src_mask, tgt_mask
