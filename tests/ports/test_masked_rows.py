"""A query row that sees no key, in every backend's Eq. (1).

The project's convention (docs/ports.md): a query row whose mask has no True entry attends to nothing -- its
attention weights and its output are zeros, never NaN and never the uniform average over the keys that filling
masked scores with a large negative number (instead of -inf) gives. The outputs alone cannot tell the two apart
where a backend also zeroes the output of such a row, so the weights are read here. The expected values are the
convention's (zeros; each other row's weights summing to one), not any backend's output.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from support import FRAMEWORKS

from reference_numpy import model as reference

BACKENDS = ("numpy", "torch", "jax", "tf")
QUERIES, KEYS, D_K, EMPTY = 3, 5, 4, 1   # row EMPTY of the mask is all False


def attention(name: str, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """(output, weights) of the backend's ``scaled_dot_product_attention`` on float32 NumPy inputs."""
    if name == "numpy":
        return reference.scaled_dot_product_attention(query, key, value, mask)
    pytest.importorskip(FRAMEWORKS[name], reason=f"{FRAMEWORKS[name]} is not installed (pip install '.[{name}]')")
    model = importlib.import_module(f"transformer_{name}.model")
    if name == "torch":
        import torch

        out, weights = model.scaled_dot_product_attention(*map(torch.as_tensor, (query, key, value, mask)),
                                                          return_weights=True)
        return out.numpy(), weights.numpy()
    out, weights = model.scaled_dot_product_attention(query, key, value, mask)
    return np.asarray(out), np.asarray(weights)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_row_that_sees_no_key_has_zero_weights_and_a_zero_output(name):
    rng = np.random.default_rng(7)
    query = rng.standard_normal((1, 1, QUERIES, D_K)).astype(np.float32)
    key, value = (rng.standard_normal((1, 1, KEYS, D_K)).astype(np.float32) for _ in range(2))
    mask = rng.random((1, 1, QUERIES, KEYS)) < 0.7
    mask[..., 0] = True                                  # every other row sees at least one key
    mask[..., EMPTY, :] = False
    out, weights = attention(name, query, key, value, mask)
    assert not weights[..., EMPTY, :].any() and not out[..., EMPTY, :].any()
    seen = [row for row in range(QUERIES) if row != EMPTY]
    np.testing.assert_allclose(weights[..., seen, :].sum(axis=-1), 1.0, rtol=1e-6)
    assert not weights[..., seen, :][~mask[..., seen, :]].any()     # a masked key gets no weight


def beam_attention(name: str, query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray,
                   beams: np.ndarray) -> np.ndarray:
    """The output of the backend's ``incremental.beam_attention`` (Eq. (1) along beam hypotheses) on NumPy inputs."""
    if name != "numpy":
        pytest.importorskip(FRAMEWORKS[name], reason=f"{FRAMEWORKS[name]} is not installed (pip install '.[{name}]')")
    incremental = importlib.import_module("reference_numpy.incremental" if name == "numpy"
                                          else f"transformer_{name}.incremental")
    if name == "torch":
        import torch

        inputs = tuple(map(torch.as_tensor, (query, key, value, mask, beams)))
        return incremental.beam_attention(*inputs)[0].numpy()
    return np.asarray(incremental.beam_attention(query, key, value, mask, beams)[0])


@pytest.mark.parametrize("path", ["attention", "beams"])
@pytest.mark.parametrize("name", BACKENDS)
def test_a_row_that_sees_no_key_outputs_zero_over_infinite_values(name, path):
    """Zero weights alone do not make a zero output: 0 x inf is NaN, so a value holding an infinity (an overflowed
    projection) reaches the output of every row through weights . V. The convention says the row that sees no key
    outputs zeros all the same, in Eq. (1) and along beam hypotheses (each of the two rows of one sentence reading its
    keys from the rows the table names)."""
    rng = np.random.default_rng(11)
    rows = 2 if path == "beams" else 1
    query = rng.standard_normal((rows, 1, QUERIES, D_K)).astype(np.float32)
    key, value = (rng.standard_normal((rows, 1, KEYS, D_K)).astype(np.float32) for _ in range(2))
    value[..., KEYS - 1, 0] = np.inf
    mask = np.ones((1, 1, QUERIES, KEYS), dtype=bool)
    mask[..., EMPTY, :] = False
    with np.errstate(invalid="ignore"):                                  # 0 x inf, in NumPy
        if path == "beams":
            beams = np.array([[[0, 1, 0, 1, 1], [1, 1, 0, 0, 1]]])             # (B, K, C): B = 1, K = 2
            out = beam_attention(name, query, key, value, mask, beams)
        else:
            out = attention(name, query, key, value, mask)[0]
    assert (out[..., EMPTY, :] == 0).all(), out[..., EMPTY, :]
    seen = [row for row in range(QUERIES) if row != EMPTY]
    assert not np.isfinite(out[..., seen, 0]).any()                    # the infinity reaches every other row
