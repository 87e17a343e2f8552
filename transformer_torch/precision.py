"""The low-precision recipe of ``reference_numpy/precision.py`` on PyTorch's tensors, and the exact crossings
between NumPy arrays and tensors (bfloat16 included, through its bits).

A model in a low precision P (bfloat16, float16) stores weights, activations and the cache in P and computes each
concept wide, in float32, from the P values (:func:`wide`), rounding its result once to P (:func:`narrow`); for
float32 and float64 both are the identity.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from reference_numpy.precision import BFLOAT16

LOW = (torch.bfloat16, torch.float16)   # the low precisions P of reference_numpy/precision.py


def dtype_name(dtype: torch.dtype) -> str:
    """torch's dtype by the name NumPy and the reference use ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def wide(x: Tensor) -> Tensor:
    """A P tensor (bfloat16, float16) as float32, exactly, for a concept computed wide; other tensors unchanged."""
    return x.float() if x.dtype in LOW else x


def narrow(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A concept's wide result rounded once (to nearest, ties to even) to the model's ``dtype`` when it is a low
    precision P; unchanged otherwise."""
    return x.to(dtype) if dtype in LOW else x


Concept = TypeVar("Concept", bound=Callable[..., Any])


def computed_wide(concept: Concept) -> Concept:
    """``concept`` (a function of tensors returning a tuple of tensors or None) entered and left by the recipe: its P
    tensor arguments widened on entry (:func:`wide`), each tensor it returns rounded once (:func:`narrow`) to its
    first argument's dtype (under ``torch.autocast`` the products inside are the framework's P products)."""

    @functools.wraps(concept)
    def entered_and_left(first: Tensor, *args: Any, **kwargs: Any) -> tuple:
        dtype = first.dtype
        results = concept(wide(first), *(wide(a) if isinstance(a, Tensor) else a for a in args), **kwargs)
        return tuple(None if result is None else narrow(result, dtype) for result in results)

    return entered_and_left  # type: ignore[return-value]


def from_numpy(array: np.ndarray) -> Tensor:
    """``array`` as a tensor sharing its memory, bit for bit; a bfloat16 array (ml_dtypes', which torch does not
    read) through its bits."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor as a NumPy array sharing its memory, bit for bit; a bfloat16 tensor (which NumPy has no dtype
    for) as an ml_dtypes bfloat16 array, through its bits."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(BFLOAT16)
    return tensor.numpy()
