"""Gradients of the label-smoothed cross-entropy (section 5.4, epsilon_ls = 0.1) in float64:
every port against central finite differences of the NumPy reference's loss, and every pair
of ports against each other; in bfloat16 and float16, every port's autodiff through its recipe
against the reference's hand-written backward pass in the same precision, under the low-precision
policy."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from support import FRAMEWORKS, LOW_DTYPES, port_backend

from equivalence import tolerance
from equivalence.cases import VARIANTS, seeded_params, training_inputs
from reference_numpy import Transformer
from reference_numpy.training import gradients, loss

STEP = 1e-3          # finite-difference step along a unit direction; halved for Richardson extrapolation
DIRECTIONS = 3


@functools.cache
def port_model(port: str, variant: str, dtype: str):
    """The port's model of ``variant`` in ``dtype`` from the seeded weights (gradients leave it unchanged)."""
    config = VARIANTS[variant]
    return port_backend(port).build(config, seeded_params(config), dtype, "cpu")


@functools.cache
def port_gradients(port: str, variant: str):
    value, grads = port_backend(port).gradients(port_model(port, variant, "float64"),
                                                **training_inputs(VARIANTS[variant]))
    return float(value), grads


def reference_loss(variant: str, params: dict[str, np.ndarray]) -> float:
    config = VARIANTS[variant]
    return float(loss(Transformer(config, params), **training_inputs(config)))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_port_loss_and_gradient_names(port, variant):
    config = VARIANTS[variant]
    value, grads = port_gradients(port, variant)
    params = seeded_params(config)
    expected = reference_loss(variant, params)
    assert abs(value - expected) <= tolerance.float64_bound(expected), f"loss {value} vs reference {expected}"
    assert list(grads) == list(params)
    for name, grad in grads.items():
        assert grad.shape == params[name].shape and grad.dtype == np.float64, name
        assert np.isfinite(grad).all(), name


@functools.cache
def finite_differences(variant: str) -> list[tuple[dict[str, np.ndarray], float, float]]:
    """(d, estimate, bound) for random unit directions d: the Richardson-extrapolated central difference of the
    reference's loss along d and its tolerance.finite_difference_bound (the same for every port)."""
    params = seeded_params(VARIANTS[variant])
    rng = np.random.default_rng(99)
    result = []
    for _ in range(DIRECTIONS):
        direction = {name: rng.standard_normal(value.shape) for name, value in params.items()}
        norm = np.sqrt(sum(float((d ** 2).sum()) for d in direction.values()))
        direction = {name: d / norm for name, d in direction.items()}

        def central(step):
            shifted = [{name: params[name] + sign * step * direction[name] for name in params} for sign in (1, -1)]
            return (reference_loss(variant, shifted[0]) - reference_loss(variant, shifted[1])) / (2 * step)

        fd_h, fd_half = central(STEP), central(STEP / 2)
        bound = tolerance.finite_difference_bound(fd_h, fd_half, reference_loss(variant, params), STEP)
        result.append((direction, (4 * fd_half - fd_h) / 3, bound))
    return result


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_gradient_matches_finite_differences_of_the_reference(port, variant):
    """<grad, d> against the Richardson-extrapolated central difference of the reference's loss
    along random unit directions d, within tolerance.finite_difference_bound."""
    _, grads = port_gradients(port, variant)
    for direction, estimate, bound in finite_differences(variant):
        analytic = sum(float((grads[name] * direction[name]).sum()) for name in direction)
        assert abs(analytic - estimate) <= bound, f"{port}: <grad, d> = {analytic}, finite differences {estimate}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pair", list(itertools.combinations(FRAMEWORKS, 2)), ids="-".join)
def test_gradients_agree_across_ports(pair, variant):
    _, grads_a = port_gradients(pair[0], variant)
    _, grads_b = port_gradients(pair[1], variant)
    bound = tolerance.gradient_bound(grads_a, grads_b)
    for name in grads_a:
        error = tolerance.max_abs(grads_a[name], grads_b[name])
        assert error <= bound, f"{name}: {pair[0]} vs {pair[1]} differ by {error:.3e} > {bound:.3e}"


@functools.cache
def reference_gradients(variant: str, dtype: str):
    """The reference's loss and gradients with the model in ``dtype`` (the recipe's backward pass in P)."""
    config = VARIANTS[variant]
    value, grads = gradients(Transformer(config, seeded_params(config), dtype), **training_inputs(config))
    return float(value), grads


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_low_precision_gradients_agree_with_the_reference(port, variant, dtype):
    """A bfloat16 or float16 model's gradients, by the framework's autodiff through its recipe, are P tensors within
    the low-precision policy of the float64 gradients, tensor by tensor: 8 x the reference-in-P's own error (its
    backward pass rounds where ``reference_numpy/backward.py`` says), at least one unit of P at the tensor's scale;
    the float32 loss likewise."""
    value, grads = port_backend(port).gradients(port_model(port, variant, dtype), **training_inputs(VARIANTS[variant]))
    (value64, grads64), (value_low, grads_low) = reference_gradients(variant, "float64"), \
        reference_gradients(variant, dtype)
    tolerance.assert_agrees(value, value64, value_low, what=f"{port}: loss", precision=dtype)
    assert list(grads) == list(grads64)
    for name, grad in grads.items():
        assert grad.dtype == np.dtype(grads_low[name].dtype) and grad.shape == grads64[name].shape, name
        tolerance.assert_agrees(grad, grads64[name], grads_low[name], what=f"{port}: gradient of {name!r}",
                                precision=dtype)


REPEATS = 512    # copies of the suite's batch (4 rows): every bos 2048 times; bfloat16 stops adding 1s at 256


def repeated_batch() -> dict[str, np.ndarray]:
    return {name: np.tile(value, (REPEATS, 1)) for name, value in training_inputs(VARIANTS["tiny"]).items()}


@functools.cache
def repeated_batch_gradients(dtype: str) -> dict[str, np.ndarray]:
    config = VARIANTS["tiny"]
    return gradients(Transformer(config, seeded_params(config), dtype), **repeated_batch())[1]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_an_embedding_row_used_hundreds_of_times_sums_its_gradients_wide(port, dtype):
    """The recipe sums the gradients of one embedding row wide and rounds once (``backward.embeddings``); a
    framework's own embedding backward may add them one by one in P instead, which loses most of them past a few
    hundred (in bfloat16 256 + 1 = 256). The batch repeats every row 512 times: each embedding's gradient stays within
    the policy."""
    _, grads = port_backend(port).gradients(port_model(port, "tiny", dtype), **repeated_batch())
    grads64, grads_low = repeated_batch_gradients("float64"), repeated_batch_gradients(dtype)
    for name in ("src_embed.weight", "tgt_embed.weight"):
        tolerance.assert_agrees(grads[name], grads64[name], grads_low[name], what=f"{port}: gradient of {name!r}",
                                precision=dtype)
