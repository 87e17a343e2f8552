"""The agreement matrix's bfloat16 and float16 components (the recipe of ``reference_numpy/precision.py``), on inputs
and weights that are numbers of the format, so that the error is the recipe's alone. The forward stages,
log-probabilities, attention weights, port pairs and decoding in both formats are
``tests/equivalence/test_agreement.py``'s, parametrized with float64 and float32.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import reference_model_in
from support import (
    DEVICE_KINDS,
    FRAMEWORKS,
    LOW_DTYPES,
    device_for,
    port_backend,
    port_model,
)

from equivalence import cases
from equivalence.backends import numpy as reference
from equivalence.cases import FORWARD_VARIANTS, MASK_CASES
from reference_numpy.precision import round_to

# The recipe's concepts computed wide and rounded once: checked element by element (tolerance.single_rounding_bound)
# and exactly wherever the float32 bound decides the rounding (tolerance.decided_by_rounding).
SINGLE_ROUNDING = ("attention", "layer_norm")
# Each concept of the recipe once, and one layer: the stacks are test_forward_stages' in both formats.
COMPONENT_CASES = [(component, case) for component in ("attention", "multi_head_attention", "decoder_layer")
                   for case in MASK_CASES] + [(component, "none") for component in
                                              ("positional_encoding", "feed_forward", "layer_norm", "generator")]
VARIANTS = ("tiny", "pre_ln")   # one per norm position


@functools.cache
def reference_component_in(low: str, variant: str, component: str, case: str, dtype: str) -> np.ndarray:
    """The reference's component in ``dtype`` on weights and inputs that are numbers of ``low``."""
    return reference.component(reference_model_in(low, variant, dtype), component,
                               cases.low_precision_component_inputs(FORWARD_VARIANTS[variant], component, case, low))


@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("component,case", COMPONENT_CASES)
def test_component_low_precision(port, device_kind, dtype, variant, component, case, agreement, single_rounding,
                                 logits_rounding):
    """Attention and LayerNorm, rounded once, element by element within the float32 bound of the wide value plus
    half a unit, and the correctly rounded value itself wherever that bound decides it (a softmax or a variance
    computed in P instead is several units off: the queries are scaled up, ``cases.low_precision_component_inputs``;
    a rounding left out is half a unit off); the generator's logits likewise, through its float32 log-probabilities;
    the other components within the low-precision policy."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs = cases.low_precision_component_inputs(FORWARD_VARIANTS[variant], component, case, dtype)
    out = backend.component(port_model(port, variant, dtype, device), component, inputs)
    ref64, ref32, ref_low = (reference_component_in(dtype, variant, component, case, precision)
                             for precision in ("float64", "float32", dtype))
    what = f"{component}: {variant}/{case}"
    if component in SINGLE_ROUNDING:
        single_rounding(out, ref64, ref32, port=port, device=device, dtype=dtype, what=what)
        return
    agreement(out, ref64, ref_low, port=port, device=device, dtype=dtype, what=what, scores=component == "generator")
    if component == "generator":
        logits_rounding(out, inputs["x"], functools.partial(reference_model_in, dtype, variant), dtype,
                        f"{port}/{dtype}/{what}")



@functools.cache
def reference_component_gradients_in(low: str, variant: str, component: str, case: str,
                                     dtype: str) -> dict[str, np.ndarray]:
    """The reference's backward pass of a component in ``dtype``, on the inputs, weights and output gradient of
    :func:`component_gradient_inputs` (numbers of ``low``)."""
    inputs, grad_out = component_gradient_inputs(low, variant, component, case)
    return reference.component_gradients(reference_model_in(low, variant, dtype), component, inputs, grad_out)


def component_gradient_inputs(low: str, variant: str, component: str, case: str) -> tuple[dict, np.ndarray]:
    """The component's inputs (``cases.low_precision_component_inputs``) and a seeded gradient of its output, N(0, 1)
    rounded to ``low``."""
    inputs = cases.low_precision_component_inputs(FORWARD_VARIANTS[variant], component, case, low)
    shape = reference_component_in(low, variant, component, case, "float64").shape
    return inputs, round_to(np.random.default_rng(1).standard_normal(shape), low).astype(np.float64)


@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("device_kind", DEVICE_KINDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("component,case", [("attention", case) for case in MASK_CASES] + [("layer_norm", "none")])
def test_component_gradients_low_precision(port, device_kind, dtype, variant, component, case, single_rounding):
    """The backward pass of attention (dQ, dK, dV) and of LayerNorm (dx) in P: each gradient of an input is computed
    wide from P values and the P gradient of the output and rounded once (``reference_numpy/backward.py``), so element
    by element within the float32 bound of the exact value plus half a unit, and exactly the correctly rounded value
    wherever that bound decides it: a backward pass computed in P, or a rounding a compiler leaves out, fails."""
    backend = port_backend(port)
    device = device_for(backend, device_kind)
    inputs, grad_out = component_gradient_inputs(dtype, variant, component, case)
    grads = backend.component_gradients(port_model(port, variant, dtype, device), component, inputs, grad_out)
    ref64, ref32 = (reference_component_gradients_in(dtype, variant, component, case, precision)
                    for precision in ("float64", "float32"))
    assert list(grads) == list(ref64)
    for key, grad in grads.items():
        assert str(grad.dtype) == dtype, (key, grad.dtype)
        single_rounding(grad, ref64[key], ref32[key], port=port, device=device, dtype=dtype,
                        what=f"gradient of {component}'s {key}: {variant}/{case}")
