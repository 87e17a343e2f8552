"""The choices a configuration makes beside the paper's, each one named function; :mod:`.model` holds the paper's
own (ReLU, the interleaved sinusoidal table, position t at row t) and calls these by ``config``'s name.

* activations (``config.activation``): :func:`silu`, :func:`gelu`;
* sinusoidal table layouts (``config.sinusoidal_layout``): :func:`halves_table`, :func:`fairseq_table`;
* the ``fairseq`` layout's rows: :func:`position_ids`.

Every function computes in float64 (or the wide type it is given); :mod:`.model` rounds the result.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------- activations

def silu(x: np.ndarray) -> np.ndarray:
    """x sigmoid(x) = x / (1 + exp(-x)) -- "swish"/"silu" (Elfwing et al., 2018; Ramachandran et al., 2017),
    ``torch.nn.SiLU``. Shape: (...) -> (...)."""
    with np.errstate(over="ignore"):                                    # exp(-x) -> inf: x / inf = -0
        return (x / (1.0 + np.exp(-x))).astype(x.dtype)


def gelu(x: np.ndarray) -> np.ndarray:
    """x Phi(x) = x / 2 (1 + erf(x / sqrt(2))), Phi the standard normal CDF -- Hendrycks & Gimpel (2016), the exact
    (erf) form: ``torch.nn.functional.gelu`` without its tanh approximation.
    Shape: (...) -> (...)."""
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))).astype(x.dtype)


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function, element by element: the C library's ``erf`` (Python's ``math.erf``; NumPy has none),
    in float64. Shape: (...) -> (...)."""
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(np.asarray(x, dtype=np.float64)), dtype=np.float64)


# ----------------------------------------------------------------------------- sinusoidal layouts

def halves_table(length: int, d_model: int) -> np.ndarray:
    """Section 3.5's angles with the sines in the first half of the columns and the cosines in the second --
    the features are not interleaved: PE(pos, i) = sin(pos / 10000^(2i/d_model)),
    PE(pos, D/2 + i) = cos(pos / 10000^(2i/d_model)) for i < D/2.

    Shape: returns (L, D), rows 0 .. L-1, float64.
    """
    position = np.arange(length, dtype=np.float64)[:, None]              # (L, 1)
    angle = position / np.power(10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model)   # (L, D/2)
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1)


def fairseq_table(length: int, d_model: int, pad_id: int) -> np.ndarray:
    """The ``fairseq`` table (tensor2tensor's form of the sinusoids):
    frequencies w_i = exp(-i ln(10000) / (D/2 - 1)) for i < D/2 (the last one exactly 1/10000), sines in the first
    half, cosines in the second, at the positions pad_id + 1, pad_id + 2, ... (fairseq counts positions from the
    padding index + 1, :func:`position_ids`). Row 0 is zeros (what a pad token reads: fairseq's row
    ``padding_idx``), row k >= 1 is [sin((pad_id + k) w), cos((pad_id + k) w)].

    Shape: returns (L + 1, D), float64.
    """
    half = d_model // 2
    frequency = np.exp(np.arange(half, dtype=np.float64) * -(math.log(10000.0) / (half - 1)))   # (D/2,)
    position = pad_id + np.arange(1, length + 1, dtype=np.float64)[:, None]                     # (L, 1)
    table = np.zeros((length + 1, d_model), dtype=np.float64)
    table[1:, :half] = np.sin(position * frequency)
    table[1:, half:] = np.cos(position * frequency)
    return table


def position_ids(tokens: np.ndarray, pad_id: int, offset: int = 0, by_step: bool = False) -> np.ndarray:
    """The row of the ``fairseq`` table (:func:`fairseq_table`) each token reads: 0 for a pad token, else
    ``offset`` plus the number of non-pad tokens of its row up to and including it (a position id counted from
    pad_id + 1 is this row + pad_id: the table's zero row is row 0 here).

    ``by_step`` (the decoder's tokens): ``offset`` plus the token's own position in its row, counted from 1, pads
    included -- the rows a decoded prefix reads when decoding one token per step with a cache of the earlier steps,
    its positions counted by step. The two differ only
    where a pad precedes a real token: never in a right-padded target; in decoding, after a pad start token or an
    emitted pad, where counting steps is what makes decoding with and without a cache one computation.

    Positions depend on the tokens: a padded row's first real token is at row 1 wherever the padding is. In cached
    decoding ``tokens`` holds the new positions only and ``offset`` is the step's ``cache_index`` (the number of
    earlier positions, pad tokens included): one new non-pad token at
    cache_index c reads row c + 1, the row it reads in the whole prefix when no earlier token is a pad.

    Shape: tokens (B, T) int -> rows (B, T) int64.
    """
    real = (np.asarray(tokens) != pad_id).astype(np.int64)              # (B, T)
    counted = np.arange(1, real.shape[1] + 1) if by_step else np.cumsum(real, axis=1)
    return (offset + counted) * real
