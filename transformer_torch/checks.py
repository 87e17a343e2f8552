"""The reference's input checks (``reference_numpy/checks.py``) on PyTorch's tensors.

Each function reads a tensor's shape and dtype name -- its values only where a check needs them and the tensor
holds values (not while ``torch.compile`` or ``torch.export`` traces it) -- and calls the reference's check, so a
bad input gets the reference's one-line ``ValueError``, naming the argument, as in every backend. NumPy arrays
and nested lists are taken too. :mod:`.model` calls these at its public entry points and holds the math alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from reference_numpy import checks

from .precision import dtype_name


def layout(name: str, value: object) -> tuple[tuple, str]:
    """(shape, dtype name) of a tensor or array argument."""
    if isinstance(value, Tensor):
        return tuple(value.shape), dtype_name(value.dtype)
    array = checks.as_array(name, value)
    return array.shape, array.dtype.name


def describe(name: str, value: object) -> tuple[tuple, str] | None:
    """(shape, dtype name) of an optional tensor or array argument (the reference's ``describe``)."""
    return None if value is None else layout(name, value)


def checked_mask(name: str, mask: Tensor | np.ndarray, scores_shape: tuple[int, ...],
                 device: torch.device | str | None = None) -> Tensor:
    """A bool mask broadcastable to ``scores_shape``, as a tensor on ``device`` (the reference's ``checked_mask``)."""
    checks.check_mask(name, *layout(name, mask), tuple(scores_shape))
    return torch.as_tensor(mask, device=device)


def checked_memory(memory: Tensor | np.ndarray, batch: int | None, d_model: int, model_dtype: str,
                   device: torch.device | str | None = None) -> Tensor:
    """The encoder output given to ``decode`` or ``init_cache`` (``batch`` None: any) after the reference's
    ``check_memory``, as a tensor on ``device``: an array or nested lists as NumPy reads them (Python floats are
    float64), the dtype that was checked."""
    if not isinstance(memory, Tensor):
        memory = checks.as_array("memory", memory)
    checks.check_memory(*layout("memory", memory), batch, d_model, model_dtype)
    return torch.as_tensor(memory, device=device)


def check_tokens(name: str, tokens: Tensor | np.ndarray, vocab_size: int, max_len: int,
                 device: torch.device) -> Tensor:
    """Token ids after the reference's checks -- shape and dtype always, the id range unless the tensor is traced
    (``torch.compiler.is_compiling()``: it holds no values) -- as int64 on ``device``."""
    if not isinstance(tokens, Tensor):
        tokens = torch.as_tensor(checks.check_tokens(name, tokens, vocab_size, max_len))
    else:
        checks.check_token_layout(name, *layout(name, tokens), max_len)
        if not torch.compiler.is_compiling():
            checks.check_token_values(name, tokens.cpu().numpy(), vocab_size)
    return tokens.to(device=device, dtype=torch.long)


def check_cache_index(cache_index: Any, length: int, capacity: int) -> Any:   # Any: what a caller gave
    """``cache_index`` (an int >= 0 with the ``length`` new positions inside the cache) after the reference's
    check when its value is known: a 0-d tensor holding a value is read; a traced one (``torch.export``,
    ``torch.compile``: an exported decoding step) is left to the compiled caller and returned as it is."""
    if isinstance(cache_index, Tensor):
        if torch.compiler.is_compiling():
            return cache_index
        cache_index = cache_index.item() if cache_index.ndim == 0 else cache_index
    return checks.check_cache_index(cache_index, length, capacity)


def check_beams(beams: Tensor, rows: int, capacity: int) -> None:
    """A cache's ``beams`` table: (rows / K, K, capacity), integer (the reference's ``check_beams``)."""
    checks.check_beams(*layout("cache.beams", beams), rows, capacity)


def checked_forward_inputs(config: Any, src: Tensor | np.ndarray, tgt: Tensor | np.ndarray,
                           src_mask: Tensor | np.ndarray | None, tgt_mask: Tensor | np.ndarray | None,
                           device: torch.device) -> tuple[Tensor, Tensor]:
    """The forward pass's token ids after :func:`check_tokens` and the reference's ``check_forward_inputs``."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len, device)
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len, device)
    checks.check_forward_inputs(config, tuple(src.shape), tuple(tgt.shape), describe("src_mask", src_mask),
                                describe("tgt_mask", tgt_mask))
    return src, tgt


def checked_source(config: Any, src: Tensor | np.ndarray, src_mask: Tensor | np.ndarray | None,
                   device: torch.device) -> tuple[Tensor, Tensor | None]:
    """``encode``'s inputs as tensors on ``device``: the source ids after :func:`check_tokens`, ``src_mask`` (None
    stays None) after the reference's ``check_mask`` against the encoder's (B, H, S, S) scores (the reference's
    ``checked_source``)."""
    src = check_tokens("src", src, config.src_vocab_size, config.max_len, device)
    if src_mask is not None:
        (batch, length), heads = src.shape, config.n_heads
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, length), device)
    return src, src_mask


def checked_target(config: Any, tgt: Tensor | np.ndarray, memory: Tensor | np.ndarray, model_dtype: str,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """``decode``'s inputs as tensors on ``device``: the target ids after :func:`check_tokens`, the encoder output
    after :func:`checked_memory` (the reference's ``checked_target``)."""
    tgt = check_tokens("tgt", tgt, config.tgt_vocab_size, config.max_len, device)
    return tgt, checked_memory(memory, tgt.shape[0], config.d_model, model_dtype, device)


def checked_decoder_masks(config: Any, tgt_shape: tuple, memory_length: int, keys: int,
                          src_mask: Tensor | np.ndarray | None, tgt_mask: Tensor | np.ndarray | None,
                          device: torch.device | str | None = None) -> tuple[Tensor | None, Tensor | None]:
    """``decode``'s masks (None stays None) as tensors on ``device`` after the reference's ``check_mask``:
    ``src_mask`` against the decoder's (B, H, T, S) scores, ``tgt_mask`` against its (B, H, T, ``keys``)
    self-attention scores (the reference's ``checked_decoder_masks``)."""
    (batch, length), heads = tgt_shape, config.n_heads
    if src_mask is not None:
        src_mask = checked_mask("src_mask", src_mask, (batch, heads, length, memory_length), device)
    if tgt_mask is not None:
        tgt_mask = checked_mask("tgt_mask", tgt_mask, (batch, heads, length, keys), device)
    return src_mask, tgt_mask
