"""Every linear map of the autocast recipe (docs/equivalence.md, "Mixed precision: the autocast recipe"), checked
one by one in every backend as the attention products are (tests/ports/test_mixed_precision.py): the queries', keys',
values' and output projections of every attention sublayer, both linear maps of every feed-forward network and the
generator's logits.

Each map's input x, weight W, bias b and output y are captured as the backend computes them -- under its framework's
own switch, on the whole model and on a sublayer built alone (``torch.autocast``; Flax's ``dtype=P,
param_dtype=float32``; Keras' ``set_global_policy``; the reference's ``autocast``) -- and y is held to the recipe
computed here from x, W and b: x, W and b rounded to P (ml_dtypes' casts from float32), their products summed
exactly (float64), the sum rounded once to P. A backend sums in float32, in an order of its own: by the standard
bound of a sum of n + 1 terms in any order (Higham, Accuracy and Stability of Numerical Algorithms, Eq. (4.4);
products of two numbers of P are exact in float32), its sum is within gamma_{n+1} = (n + 1) u / (1 - (n + 1) u),
u = 2^-24, of sum |x_i W_i| + |b| of the exact one, so y must lie between the roundings to P of the exact sum minus
and plus that bound -- element by element, the two directions: a map computed more accurately than the recipe
(its input left float32) or less (the product rounded before the bias is added) is off by a unit of P at a share
of the elements, far outside the bound.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support import FRAMEWORKS, backend

from equivalence import cases
from equivalence.cases import FORWARD_VARIANTS
from reference_numpy.precision import AUTOCAST_NAMES

LOW = {"mixed-bfloat16": "bfloat16", "mixed-float16": "float16"}
VARIANTS = ("tiny", "marian")                      # the paper's model; a bias on the logits, SiLU
BACKENDS = ("numpy", *FRAMEWORKS)
U = 2.0 ** -24                                     # float32's unit roundoff

# Where each backend computes its linear maps: its model module, the class of a linear map and the method it runs
# (the framework's own call: Keras converts a layer's inputs in ``__call__``), and the generator's class and method
MODULES = {"numpy": "reference_numpy.model", "torch": "transformer_torch.model", "jax": "transformer_jax.model",
           "tf": "transformer_tf.model"}
# The module of a port's linear-map class where it is framework plumbing beside model.py
LINEAR_MODULES = {"torch": "transformer_torch.layers", "jax": "transformer_jax.layers", "tf": "transformer_tf.layers"}
SEAMS = {"numpy": ("Linear", "__call__", "__call__"), "torch": ("_Linear", "forward", "forward"),
         "jax": ("_Linear", "__call__", "__call__"), "tf": ("_Dense", "__call__", "__call__")}


def numpy_of(value: Any) -> np.ndarray:
    """A framework's array (a torch tensor, a TensorFlow or JAX array) as NumPy."""
    if hasattr(value, "detach"):                          # torch: NumPy has no bfloat16, ml_dtypes has
        if str(value.dtype) == "torch.bfloat16":
            return value.detach().float().numpy().astype(ml_dtypes.bfloat16)
        return value.detach().numpy()
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


def weights(name: str, layer: Any) -> tuple[np.ndarray, np.ndarray]:
    """A linear map's (in, out) weight and its bias, as float32 NumPy arrays."""
    if name == "torch":
        return numpy_of(layer.weight).T, numpy_of(layer.bias)
    if name == "jax":
        return numpy_of(layer.kernel[...]), numpy_of(layer.bias[...])
    if name == "tf":
        return numpy_of(layer.kernel.value), numpy_of(layer.bias.value)
    return layer.weight, layer.bias


class Map:
    """One call of a linear map: its input, (in, out) weight, bias (None: none) and output."""

    def __init__(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, y: np.ndarray):
        self.x, self.weight, self.bias, self.y = x, weight, bias, y


@contextlib.contextmanager
def captured(name: str, params: dict[str, np.ndarray] | None = None) -> Iterator[list[Map]]:
    """Inside the block, every call of backend ``name``'s linear maps is appended to the list given, in order; with
    ``params`` (the checkpoint the model was built from), the generator's too: its input, the projection and bias
    of ``params`` (float32, as the model holds them), and the logits its log-softmax reads."""
    module = importlib.import_module(MODULES[name])
    linear_class, linear_method, generator_method = SEAMS[name]
    maps: list[Map] = []
    linear_type = getattr(importlib.import_module(LINEAR_MODULES.get(name, MODULES[name])), linear_class)
    linear = getattr(linear_type, linear_method)
    generator = getattr(module.Generator, generator_method)
    log_softmax = module.log_softmax
    generated: list[np.ndarray] = []

    def linear_call(self, x, *args, **kwargs):
        y = linear(self, x, *args, **kwargs)
        maps.append(Map(numpy_of(x), *weights(name, self), numpy_of(y)))
        return y

    def generator_call(self, x, *args, **kwargs):
        generated.append(numpy_of(x))
        return generator(self, x, *args, **kwargs)

    def logits_read(logits):
        assert params is not None
        projection = params["shared_embed.weight"].T if "shared_embed.weight" in params else params["generator.weight"]
        bias = params.get("generator.bias")
        maps.append(Map(generated.pop(), projection.astype(np.float32),
                        None if bias is None else bias.astype(np.float32), numpy_of(logits)))
        return log_softmax(logits)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(linear_type, linear_method, linear_call)
        if params is not None:
            patch.setattr(module.Generator, generator_method, generator_call)
            patch.setattr(module, "log_softmax", logits_read)
        yield maps


def to_p(x: np.ndarray, low: str) -> np.ndarray:
    """float32 values rounded once to P (ml_dtypes' casts: to nearest, ties to even), as float64 (exactly)."""
    return np.asarray(x, np.float32).astype(np.dtype(low)).astype(np.float64)


def directed_p(x: np.ndarray, low: str, toward: float) -> np.ndarray:
    """float64 ``x`` rounded to P through a float32 rounded toward ``toward`` (-inf or +inf): at most (at least) the
    rounding of x to nearest P, as rounding to nearest is monotone."""
    single = x.astype(np.float32)
    past = (single.astype(np.float64) > x) if toward < 0 else (single.astype(np.float64) < x)
    single = np.where(past, np.nextafter(single, np.float32(toward)), single)
    return single.astype(np.dtype(low)).astype(np.float64)


def outside_the_recipe(mapped: Map, low: str) -> np.ndarray:
    """Where ``mapped``'s output is not a rounding to P of a float32 sum of the recipe's terms (the module
    docstring): a boolean array of the output's shape."""
    x, weight = to_p(mapped.x, low), to_p(mapped.weight, low)
    bias = np.zeros(weight.shape[1]) if mapped.bias is None else to_p(mapped.bias, low)
    exact = x @ weight + bias
    terms = x.shape[-1] + 1
    gamma = terms * U / (1 - terms * U) + terms * 2.0 ** -53 / (1 - terms * 2.0 ** -53)   # float32, float64 sums
    slack = gamma * (np.abs(x) @ np.abs(weight) + np.abs(bias))
    y = np.asarray(mapped.y, np.float64)
    return (y < directed_p(exact - slack, low, -np.inf)) | (y > directed_p(exact + slack, low, np.inf))


def assert_every_map_is_the_recipes(maps: list[Map], low: str, count: int, what: str) -> None:
    """``count`` maps were called, each output a number of P (the generator's logits, read wide, hold numbers of P)
    and within the recipe's bound at every element."""
    assert len(maps) == count, f"{what}: {len(maps)} linear maps called, {count} expected"
    for index, mapped in enumerate(maps):
        y = np.asarray(mapped.y)
        assert np.array_equal(y.astype(np.dtype(low)).astype(y.dtype), y), f"{what}: map {index} not rounded to P"
        off = outside_the_recipe(mapped, low)
        assert not off.any(), (f"{what}: map {index} of {count} ({mapped.weight.shape[0]} -> {mapped.weight.shape[1]}"
                               f"): {off.mean():.1%} of its outputs off the recipe's P value by more than float32 "
                               "summation can move it")


def model_maps(config) -> int:
    """The linear maps of a forward pass: 4 projections and 2 feed-forward maps an encoder layer, 8 projections and
    2 a decoder layer, and the generator."""
    return 6 * config.n_encoder_layers + 10 * config.n_decoder_layers + 1


# ----------------------------------------------------------------------------- the whole model, each switch

@functools.cache
def switch_model(name: str, variant: str, precision: str) -> Callable[[np.ndarray, np.ndarray], Any]:
    """``run(src, tgt)``: backend ``name``'s model of ``variant`` run eagerly under its framework's own switch in
    ``precision`` (float32 weights)."""
    config = FORWARD_VARIANTS[variant]
    params = cases.seeded_params(config)
    low = LOW[precision]
    if name == "numpy":
        from reference_numpy.precision import autocast

        model = backend("numpy").build(config, params, "float32")

        def run_reference(src, tgt):
            with autocast(low):
                return model(src, tgt)
        return run_reference
    if name == "torch":
        import torch

        model = backend("torch").build(config, params, "float32", "cpu")

        def run_torch(src, tgt):
            with torch.no_grad(), torch.autocast("cpu", dtype=getattr(torch, low)):
                return model.eval()(torch.as_tensor(src), torch.as_tensor(tgt))
        return run_torch
    if name == "jax":
        model = backend("jax").build(config, params, precision)       # Transformer(dtype=P, param_dtype=float32)
        return lambda src, tgt: model(src, tgt)
    return global_policy_model(config, params, low)


def global_policy_model(config, params: dict[str, np.ndarray], low: str) -> Callable:
    """The Keras port built with ``dtype=None`` under ``keras.mixed_precision.set_global_policy("mixed_P")``."""
    from transformer_tf import checkpoint
    from transformer_tf.model import Transformer

    loaded = checkpoint.from_params(config, params, "float32")
    with keras_global_policy(f"mixed_{low}"):
        model = Transformer(config, dtype=None)
    model.set_weights(loaded.get_weights())
    assert model.dtype_policy.name == f"mixed_{low}"
    return lambda src, tgt: model(src, tgt)


@contextlib.contextmanager
def keras_global_policy(policy: str) -> Iterator[None]:
    import keras

    before = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_every_linear_map_of_the_model_is_the_recipes(name, variant, precision):
    """A ragged batch through the whole model under each framework's switch: every projection, both feed-forward
    maps of every layer and the generator's logits are the recipe's rounding of their own input."""
    backend(name)
    config = FORWARD_VARIANTS[variant]
    inputs = cases.model_inputs(config, "ragged_batch")
    run = switch_model(name, variant, precision)
    with captured(name, cases.seeded_params(config)) as maps:
        run(inputs["src"], inputs["tgt"])
    assert_every_map_is_the_recipes(maps, LOW[precision], model_maps(config), f"{name}/{variant}/{precision}")


# ----------------------------------------------------------------------------- a sublayer built alone

def standalone(name: str, sublayer: str, low: str) -> Callable[[np.ndarray], Any]:
    """``run(x)``: backend ``name``'s ``sublayer`` ("ffn" or "attention", self-attention over x) built on its own, its
    float32 weights the port's initialisation (the reference's: seeded), called under the framework's switch: the
    global policy for Keras (the layer built with no dtype), ``torch.autocast`` around the call, Flax's
    ``dtype=P, param_dtype=float32``, the reference's ``autocast``."""
    config = FORWARD_VARIANTS["tiny"]
    module = importlib.import_module(MODULES[name])
    kind = "PositionwiseFeedForward" if sublayer == "ffn" else "MultiHeadAttention"
    call = (lambda layer, x: layer(x)) if sublayer == "ffn" else (lambda layer, x: layer(x, x, x))
    if name == "numpy":
        from reference_numpy.precision import autocast

        params = {key: value.astype(np.float32) for key, value in cases.seeded_params(config).items()}
        layer = getattr(module, kind)(config, params, f"encoder.layers.0.{'ffn' if sublayer == 'ffn' else 'self_attn'}")

        def run_reference(x):
            with autocast(low):
                return call(layer, x)
        return run_reference
    if name == "torch":
        import torch

        torch.manual_seed(0)
        layer = getattr(module, kind)(config).eval()

        def run_torch(x):
            with torch.no_grad(), torch.autocast("cpu", dtype=getattr(torch, low)):
                return call(layer, torch.as_tensor(x))
        return run_torch
    if name == "jax":
        import jax.numpy as jnp
        from flax import nnx

        layer = getattr(module, kind)(config, dtype=getattr(jnp, low), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        return lambda x: call(layer, jnp.asarray(x))
    with keras_global_policy(f"mixed_{low}"):
        layer = getattr(module, kind)(config)
    assert layer.dtype_policy.name == f"mixed_{low}"
    return lambda x: call(layer, x)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("sublayer", ["ffn", "attention"])
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_a_sublayer_built_alone_under_the_frameworks_switch(name, sublayer, precision):
    """The framework's switch reaches a feed-forward network or an attention sublayer built on its own: its linear
    maps (2, or the 4 projections) are the recipe's from float32 inputs that are not numbers of P, and the
    sublayer's output is P (the last map's)."""
    backend(name)
    low = LOW[precision]
    x = np.random.default_rng(1).standard_normal((2, 5, FORWARD_VARIANTS["tiny"].d_model)).astype(np.float32)
    assert np.mean(to_p(x, low) == x) < 0.01                  # an input the first maps must round
    run = standalone(name, sublayer, low)
    with captured(name) as maps:
        out = numpy_of(run(x))
    assert out.dtype == np.dtype(low), out.dtype
    assert_every_map_is_the_recipes(maps, low, 2 if sublayer == "ffn" else 4, f"{name} {sublayer} alone")
