"""Mixed precision the way each framework does it: the autocast recipe (``reference_numpy/precision.py``, "The autocast
recipe"; ``--dtype mixed-bfloat16``/``mixed-float16``) -- float32 parameters and residual stream, every linear map
and attention product on P-rounded inputs accumulated in float32 and rounded to P, softmax, LayerNorm and
log-softmax in float32.

Each port runs it through its framework's own switch (the adapters' ``build(..., "mixed-bfloat16")``):
``torch.autocast(device_type, dtype)``, Flax's ``dtype=P, param_dtype=float32``, Keras' ``mixed_bfloat16`` policy.
The bound is the project's low-precision rule: k = 8 times the reference-in-the-recipe's own error against the
float64 reference (``tolerance.low_precision_bound``), never tuned. An oracle written here from the definition, with
NumPy and ml_dtypes alone (float32 sums of P-rounded inputs, nothing imported from ``reference_numpy``' model),
checks the reference's recipe itself.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
import pytest
from support import FRAMEWORKS, STEPS, TRAINING, backend, batches, config_of, copied, port_backend, trained

from equivalence import cases, tolerance
from equivalence.backends import numpy as reference
from equivalence.cases import FORWARD_VARIANTS
from equivalence.margins import greedy_margins
from equivalence.training_runs import Run, assert_weights_and_moments, recipe_gradients, reference_run
from reference_numpy.config import TransformerConfig
from reference_numpy.precision import AUTOCAST_NAMES, autocast, parse_precision, spacing

VARIANTS = ("tiny", "pre_ln")                      # one per norm position
LOW = {"mixed-bfloat16": "bfloat16", "mixed-float16": "float16"}
CASE = "ragged_batch"                              # source and target padding in one batch
RESIDUAL_STAGES = ("src_embed", "tgt_embed")       # + every layer's output and both stacks': float32
RECIPE_DRAWS = 32                                  # runs of the reference with random roundings (float16_bound)


def inputs(variant: str) -> dict:
    return cases.model_inputs(FORWARD_VARIANTS[variant], CASE)


@functools.cache
def reference_stages(variant: str, precision: str) -> dict[str, np.ndarray]:
    """The reference's stages on the seeded weights of ``variant`` in ``precision`` (a dtype or a mixed name)."""
    config = FORWARD_VARIANTS[variant]
    return reference.forward(reference.build(config, cases.seeded_params(config), precision), **inputs(variant))


@functools.cache
def port_model(port: str, variant: str, precision: str, params: str = "seeded"):
    config = FORWARD_VARIANTS[variant]
    return port_backend(port).build(config, cases.PARAMS[params](config), precision, "cpu")


# ----------------------------------------------------------------------------- the names and their one error

def test_the_precision_names():
    """Today's dtypes keep their recipe; the mixed names are a float32 model under autocast in P; anything else is
    one ValueError naming the argument and every choice, as ``autocast`` outside bfloat16 and float16 is."""
    assert parse_precision("bfloat16") == (np.dtype(ml_dtypes.bfloat16), None)
    assert parse_precision("mixed-bfloat16") == (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))
    assert parse_precision("mixed-float16") == (np.dtype(np.float32), np.dtype(np.float16))
    with pytest.raises(ValueError, match=r"^dtype must be one of float64, float32, bfloat16, float16, "
                                         r"mixed-bfloat16, mixed-float16, got 'mixed-float32'$"):
        parse_precision("mixed-float32")
    with pytest.raises(ValueError, match="^dtype must be one of bfloat16, float16 under autocast, got float32$"):
        with autocast("float32"):
            pass


@pytest.mark.parametrize("port", ["numpy", *FRAMEWORKS])
def test_every_backend_refuses_a_bad_precision_with_the_same_error(port):
    backend = reference if port == "numpy" else port_backend(port)
    config = FORWARD_VARIANTS["tiny"]
    with pytest.raises(ValueError) as refused:
        backend.build(config, cases.seeded_params(config), "mixed-float64", "cpu")
    assert str(refused.value) == ("dtype must be one of float64, float32, bfloat16, float16, mixed-bfloat16, "
                                  "mixed-float16, got 'mixed-float64'")


# ----------------------------------------------------------------------------- an oracle from the definition

def _p(x: np.ndarray, low: str) -> np.ndarray:
    """float32 values rounded once to P (ml_dtypes' and NumPy's float32 -> P casts round to nearest, ties to even)
    and widened back to float32, exactly."""
    return np.asarray(x, np.float32).astype(np.dtype(low)).astype(np.float32)


def _oracle(config: TransformerConfig, params: dict, src: np.ndarray, tgt: np.ndarray, low: str) -> dict:
    """The autocast recipe of the whole model written from its definition, one plain loop per concept: every
    product's inputs rounded to P and summed in float32, its result rounded to P; everything else float32."""
    w = {name: np.asarray(value, np.float32) for name, value in params.items()}
    d, heads = config.d_model, config.n_heads

    def linear(x, name):                      # y = x W + b: x, W, b in P, float32 sums, y rounded to P
        return _p(_p(x, low) @ _p(w[f"{name}.weight"], low) + _p(w[f"{name}.bias"], low), low)

    def layer_norm(x, name):                  # float32
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + np.float32(config.layer_norm_eps)) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def attention(xq, xkv, mask, name):       # mask (B, Tq, Tk), True = may attend
        q, k, v = (linear(x, f"{name}.{p}_proj") for x, p in ((xq, "q"), (xkv, "k"), (xkv, "v")))
        out = np.zeros_like(q)
        dk = d // heads
        for b in range(q.shape[0]):
            for h in range(heads):
                cols = slice(h * dk, (h + 1) * dk)
                scores = _p(q[b, :, cols] @ k[b, :, cols].T, low) / np.float32(math.sqrt(dk))   # Q K^T in P
                scores = np.where(mask[b], scores, -np.inf)
                for i in range(len(scores)):
                    if mask[b, i].any():        # a row that sees no key stays zero
                        e = np.exp(scores[i] - scores[i].max())
                        out[b, i, cols] = _p(_p(e / e.sum(), low) @ v[b, :, cols], low)        # weights V in P
        return linear(out, f"{name}.o_proj")

    def residual(x, sublayer, norm):          # a P output added to the float32 stream is float32
        if config.norm_first:
            return x + sublayer(layer_norm(x, norm))
        return layer_norm(x + sublayer(x), norm)

    def ffn(x, name):
        return linear(np.maximum(linear(x, f"{name}.linear1"), 0), f"{name}.linear2")

    position = np.arange(config.max_len)[:, None]
    angle = position / np.power(10000.0, np.arange(0, d, 2) / d)
    table = np.empty((config.max_len, d))
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    table = table.astype(np.float32)
    stages = {}
    x = w["src_embed.weight"][src] * np.float32(math.sqrt(d)) + table[:src.shape[1]]
    stages["src_embed"] = x
    keys = src != config.pad_id
    src_mask = np.broadcast_to(keys[:, None, :], (len(src), src.shape[1], src.shape[1]))
    for i in range(config.n_encoder_layers):
        name = f"encoder.layers.{i}"
        x = residual(x, lambda h, name=name: attention(h, h, src_mask, f"{name}.self_attn"), f"{name}.self_attn_norm")
        x = residual(x, lambda h, name=name: ffn(h, f"{name}.ffn"), f"{name}.ffn_norm")
        stages[name] = x
    memory = layer_norm(x, "encoder.norm") if config.norm_first else x
    stages["encoder"] = memory
    y = w["tgt_embed.weight"][tgt] * np.float32(math.sqrt(d)) + table[:tgt.shape[1]]
    stages["tgt_embed"] = y
    length = tgt.shape[1]
    tgt_mask = (tgt != config.pad_id)[:, None, :] & np.tril(np.ones((length, length), bool))[None]
    cross_mask = np.broadcast_to(keys[:, None, :], (len(src), length, src.shape[1]))
    for i in range(config.n_decoder_layers):
        name = f"decoder.layers.{i}"
        y = residual(y, lambda h, name=name: attention(h, h, tgt_mask, f"{name}.self_attn"), f"{name}.self_attn_norm")
        y = residual(y, lambda h, name=name: attention(h, memory, cross_mask, f"{name}.cross_attn"),
                     f"{name}.cross_attn_norm")
        y = residual(y, lambda h, name=name: ffn(h, f"{name}.ffn"), f"{name}.ffn_norm")
        stages[name] = y
    y = layer_norm(y, "decoder.norm") if config.norm_first else y
    stages["decoder"] = y
    logits = _p(_p(y, low) @ _p(w["generator.weight"], low), low).astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    stages["log_probs"] = (shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))).astype(np.float32)
    return stages


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_reference_recipe_against_an_oracle_from_the_definition(variant, precision):
    """The reference's autocast recipe against :func:`_oracle`: every stage in the same dtype (float32), the same
    float32 number at most elements, and each within the project's rule of the other. The reference sums the products
    exactly and the oracle in float32, so they differ only where a float32 sum lands across a rounding boundary of P
    and where that difference spreads (measured: every element identical in bfloat16, 78-100% of each stage in
    float16); a residual stream, softmax or LayerNorm rounded to P, or a product left in float32, changes nearly every
    float32 element of the stages after it."""
    config = FORWARD_VARIANTS[variant]
    case = inputs(variant)
    low = LOW[precision]
    mine = _oracle(config, cases.seeded_params(config), case["src"], case["tgt"], low)
    ref, ref64 = reference_stages(variant, precision), reference_stages(variant, "float64")
    assert list(mine) == list(ref)
    for name, value in ref.items():
        assert value.dtype == mine[name].dtype == np.float32, (name, value.dtype)
        assert np.mean(value == mine[name]) >= 0.5, (name, np.mean(value == mine[name]))
        assert tolerance.stage_agreement(mine[name], ref64[name], value, low).ok, name
        assert tolerance.stage_agreement(value, ref64[name], mine[name], low).ok, name


# ----------------------------------------------------------------------------- each port against the reference

@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_forward_stages(port, variant, precision):
    """Every stage of each port under its framework's switch within k x the reference-in-the-recipe's error against
    float64 (the project's low-precision rule), in the reference's dtypes: the residual stream and every stage
    float32."""
    stages = port_backend(port).forward(port_model(port, variant, precision), **inputs(variant))
    ref64, mixed = reference_stages(variant, "float64"), reference_stages(variant, precision)
    assert list(stages) == list(ref64)
    for name, value in stages.items():
        assert value.dtype == mixed[name].dtype == np.float32, (name, value.dtype)
        result = tolerance.stage_agreement(value, ref64[name], mixed[name], LOW[precision])
        assert result.ok, f"{port}/{precision}/{variant}/{name}: {result}"
        assert _share_in(value, LOW[precision]) < 0.5, f"{port}/{precision}/{variant}/{name} is rounded to P"


def _share_in(values: np.ndarray, low: str) -> float:
    """The share of ``values`` that are numbers of ``low``: all of a stream rounded to P, a few of a float32 stream
    (one in 2^13 to 2^16 draws, and its exact zeros)."""
    return float(np.mean(values.astype(np.dtype(low)).astype(values.dtype) == values))


@pytest.mark.parametrize("port", ["numpy", *FRAMEWORKS])
@pytest.mark.parametrize("case", cases.MASK_CASES)
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_attention_products_in_p(port, case, precision):
    """Eq. (1) alone under each switch, on inputs that are numbers of P (queries sharpened as in the low-precision
    components): the output is P and the correctly rounded value of the recipe's own float32 computation -- Q K^T
    rounded to P, the softmax in float32, the weights rounded to P for their product with V -- at 99% of the elements
    or more, one unit apart at most elsewhere. A port's float32 sums differ from the reference's exact ones by ~2^-24
    relative against P's units of 2^-8 or 2^-11, so its roundings land elsewhere at a few elements in a thousand; a
    product left in float32 (the weights, or the scores, not rounded to P) moves a third of them."""
    low = LOW[precision]
    config = FORWARD_VARIANTS["tiny"]
    given = cases.low_precision_component_inputs(config, "attention", case, low)
    ref = reference.component(reference.build(config, cases.seeded_params(config), precision), "attention", given)
    backend = reference if port == "numpy" else port_backend(port)
    out = backend.component(port_model(port, "tiny", precision) if port != "numpy" else
                            reference.build(config, cases.seeded_params(config), precision), "attention", given)
    assert out.dtype == ref.dtype == np.dtype(low)
    units = np.abs(out.astype(np.float64) - ref) / np.maximum(spacing(ref, low), spacing(out, low))
    assert np.mean(units == 0) >= 0.99 and np.max(units) <= 1, (np.mean(units == 0), np.max(units))


@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_attention_weights(port, precision):
    """The decoder's cross-attention weights of a layer (the P weights its product with V read) within the rule."""
    case = inputs("tiny")
    weights = port_backend(port).attention_weights(port_model(port, "tiny", precision), case["src"], case["tgt"], 1,
                                                   "decoder_cross")
    refs = [reference.attention_weights(reference.build(FORWARD_VARIANTS["tiny"],
                                                         cases.seeded_params(FORWARD_VARIANTS["tiny"]), p),
                                        case["src"], case["tgt"], 1, "decoder_cross") for p in ("float64", precision)]
    assert weights.dtype == refs[1].dtype == np.dtype(LOW[precision])
    result = tolerance.stage_agreement(weights, refs[0], refs[1], LOW[precision])
    assert result.ok, f"{port}/{precision}: decoder_cross weights: {result}"


@functools.cache
def reference_decoding(variant: str, precision: str):
    """(src, float64 greedy tokens, their margins, the bound of the recipe's log-probabilities along them)."""
    config = FORWARD_VARIANTS[variant]
    params, src = cases.decoding_params(config), cases.decoding_inputs(config)
    model64 = reference.build(config, params, "float64")
    tokens = reference.greedy(model64, src)
    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), tokens[:, :-1]], axis=1)
    mixed = reference.build(config, params, precision)
    bound = tolerance.low_precision_bound(reference.log_probs(model64, src, tgt), reference.log_probs(mixed, src, tgt),
                                          LOW[precision])
    return src, tokens, greedy_margins(model64, src, tokens), bound


@pytest.mark.parametrize("port", ["numpy", *FRAMEWORKS])
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_greedy_decoding(port, precision):
    """Greedy decoding with each framework's cache under its switch: identical to the float64 reference up to each
    row's first step whose margin is below twice the recipe's bound (the project's token rule); in float16, whose
    bound the seeded tiny models' decisions clear, at least one step compared."""
    backend = reference if port == "numpy" else port_backend(port)
    src, ref_tokens, margins, bound = reference_decoding("tiny", precision)
    model = reference.build(FORWARD_VARIANTS["tiny"], cases.decoding_params(FORWARD_VARIANTS["tiny"]), precision) \
        if port == "numpy" else port_model(port, "tiny", precision, "decoding")
    tokens = backend.greedy(model, src)
    agree, note, _ = tolerance.greedy_tokens_agree(tokens, ref_tokens, margins, bound, FORWARD_VARIANTS["tiny"].pad_id)
    assert agree, note
    if precision == "mixed-float16":
        compared = [tolerance.greedy_decisive_steps(row, bound) for row in margins]
        assert any(steps is None or steps > 0 for steps in compared), "no step compared"


@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_beam_search_runs_and_agrees_with_the_ports_own_uncached_search(port, precision):
    """Beam search (section 6.1) under each switch never crashes, and its cached search (the beam table, the cache in
    the compute dtype) gives the tokens of the same port's search without a cache, scores within twice the rule's
    bound of the reference's in the recipe. (Beam steps choose between close candidates: no row of the seeded models
    is decisive below float32, docs/equivalence.md, so tokens are not compared with the reference.)"""
    backend = port_backend(port)
    model = port_model(port, "tiny", precision, "decoding")
    src = cases.decoding_inputs(FORWARD_VARIANTS["tiny"])
    tokens, scores = backend.beam(model, src)
    uncached, uncached_scores = backend.beam(model, src, use_cache=False)
    np.testing.assert_array_equal(tokens, uncached)
    assert np.all(np.isfinite(scores))
    config = FORWARD_VARIANTS["tiny"]
    ref_model = reference.build(config, cases.decoding_params(config), precision)
    _, ref_scores = reference.beam(ref_model, src)
    _, ref64_scores = reference.beam(reference.build(config, cases.decoding_params(config), "float64"), src)
    same = np.all(tokens == reference.beam(ref_model, src)[0], axis=1)
    if same.any():
        bound = tolerance.pair_bound(LOW[precision], ref64_scores[same], ref_scores[same])
        assert tolerance.max_abs(scores[same], ref_scores[same]) <= bound


# ----------------------------------------------------------------------------- the PyTorch port on `base`

@pytest.mark.slow
def test_every_linear_map_of_the_pytorch_port_on_base_returns_bfloat16_under_autocast(monkeypatch):
    """Under ``torch.autocast("cpu", torch.bfloat16)`` every linear map of the PyTorch port on Table 3's base model
    (random weights) returns bfloat16: each ``nn.Linear`` (a forward hook) and every call of the port's one linear
    seam, the generator's logits included. The port's oneDNN fast path (weights of 65,536 elements and more: every
    linear map of ``base``) would return float32 outside autocast's dispatch."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")
    from transformer_torch import model as port
    from transformer_torch import speed

    config = TransformerConfig.preset("base")
    with torch.device("cpu"):
        model = port.Transformer(config).eval()
    seen: list[tuple[str, torch.dtype]] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out, name=name: seen.append((name, out.dtype)))
    products: list[torch.dtype] = []
    linear = speed.linear

    def recorded(*args):
        out = linear(*args)
        products.append(out.dtype)
        return out

    monkeypatch.setattr(speed, "linear", recorded)
    src = torch.tensor([[5, 6, 7, 2]])
    tgt = torch.tensor([[1, 8, 9]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs = model(src, tgt)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert linears == config.n_encoder_layers * (4 + 2) + config.n_decoder_layers * (2 * 4 + 2)
    assert len(seen) == linears and all(dtype == torch.bfloat16 for _, dtype in seen), seen
    assert len(products) == linears + 1 and set(products) == {torch.bfloat16}     # + the generator's logits
    assert log_probs.dtype == torch.float32


# ----------------------------------------------------------------------------- Flax's idiom, written by hand

def test_flax_dtype_bfloat16_param_dtype_float32_greedy_decodes():
    """The Flax port built as Flax users write mixed precision, ``dtype=jnp.bfloat16, param_dtype=jnp.float32``:
    float32 parameters, bfloat16 caches, and greedy decoding (section 6.1, with the cache) that writes the tokens of
    the adapter's mixed-bfloat16 model; another ``param_dtype`` is one ValueError naming it."""
    pytest.importorskip("jax", reason="jax is not installed (pip install '.[jax]')")
    import jax.numpy as jnp
    from flax import nnx

    from transformer_jax import checkpoint, decoding
    from transformer_jax.model import Transformer

    config = FORWARD_VARIANTS["tiny"]
    loaded = checkpoint.from_params(config, cases.decoding_params(config), "float32")
    model = Transformer(config, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded, nnx.Param))
    assert {leaf.dtype for leaf in jax_leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}
    src = cases.decoding_inputs(config)
    memory = model.encode(jnp.asarray(src))
    assert memory.dtype == jnp.float32
    assert {c.keys.dtype for pair in model.init_cache(memory, 8) for c in pair} == {jnp.dtype(jnp.bfloat16)}
    tokens = np.asarray(decoding.greedy_decode(model, src))
    np.testing.assert_array_equal(tokens, port_backend("jax").greedy(port_model("jax", "tiny", "mixed-bfloat16",
                                                                                 "decoding"), src))
    with pytest.raises(ValueError, match="^param_dtype must be the dtype \\(bfloat16\\) or float32 beside a bfloat16 "
                                         "or float16 dtype \\(mixed precision\\), got float16$"):
        Transformer(config, dtype=jnp.bfloat16, param_dtype=jnp.float16, rngs=nnx.Rngs(0))


def jax_leaves(state) -> list:
    import jax
    return jax.tree_util.tree_leaves(state)


# ----------------------------------------------------------------------------- Keras' idiom, written by hand

def test_keras_global_mixed_bfloat16_policy():
    """The Keras port under ``keras.mixed_precision.set_global_policy("mixed_bfloat16")`` (``dtype=None``: the global
    policy, Keras' meaning): float32 variables, the LayerNorms, embeddings and positional encodings float32, every
    other layer computing in bfloat16, and the log-probabilities of the adapter's ``mixed-bfloat16`` model (built
    with ``dtype="mixed_bfloat16"``) to the bit."""
    keras = pytest.importorskip("keras", reason="keras is not installed (pip install '.[tf]')")
    pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install '.[tf]')")
    from transformer_tf import checkpoint
    from transformer_tf.model import Transformer

    config = FORWARD_VARIANTS["tiny"]
    loaded = checkpoint.from_params(config, cases.seeded_params(config), "float32")
    before = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = Transformer(config, dtype=None)
    finally:
        keras.mixed_precision.set_global_policy(before)
    model.set_weights(loaded.get_weights())
    assert model.dtype_policy.name == "mixed_bfloat16"
    assert {v.dtype for v in model.weights} == {"float32"}
    policies = {layer.name: layer.dtype_policy.name for layer in model._flatten_layers()}
    assert policies["self_attn_norm"] == policies["src_embed"] == policies["src_pos"] == "float32"
    assert policies["q_proj"] == policies["ffn"] == policies["generator"] == "mixed_bfloat16"
    case = inputs("tiny")
    mine = np.asarray(model(case["src"], case["tgt"]))
    theirs = port_backend("tf").log_probs(port_model("tf", "tiny", "mixed-bfloat16"), case["src"], case["tgt"])
    assert mine.dtype == np.float32
    np.testing.assert_array_equal(mine, theirs)


# ----------------------------------------------------------------------------- the command line

# ----------------------------------------------------------------------------- the shipped model

@functools.cache
def shipped_stages(backend_name: str, precision: str) -> dict[str, np.ndarray]:
    """The shipped translator's stages on held-out sentences and their French (teacher forcing), in ``precision``:
    trained weights (sharp attention, large activations) and linear maps past the PyTorch port's oneDNN size."""
    config, params, _, inputs = trained()
    backend = reference if backend_name == "numpy" else port_backend(backend_name)
    return backend.forward(backend.build(config, params, precision, "cpu"), **inputs)


@pytest.mark.slow
@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_shipped_model_forward_stages(port, precision):
    """Every stage of the shipped model under each framework's switch within the rule, float32 throughout."""
    stages = shipped_stages(port, precision)
    ref64, mixed = shipped_stages("numpy", "float64"), shipped_stages("numpy", precision)
    for name, value in stages.items():
        assert value.dtype == mixed[name].dtype == np.float32, (name, value.dtype)
        result = tolerance.stage_agreement(value, ref64[name], mixed[name], LOW[precision])
        assert result.ok, f"{port}/{precision}/shipped/{name}: {result}"


# ----------------------------------------------------------------------------- gradients

@functools.cache
def reference_gradients(variant: str, precision: str) -> tuple[float, dict[str, np.ndarray]]:
    """The reference's loss and gradients (section 5.4, label smoothing 0.1) in ``precision``: under autocast its
    backward pass through the recipe's casts (``reference_numpy/backward.py``)."""
    config = FORWARD_VARIANTS[variant]
    return reference.gradients(reference.build(config, cases.seeded_params(config), precision),
                               **cases.training_inputs(config))


@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_gradients(port, variant, precision):
    """Each framework's autodiff under its switch (autograd under ``torch.autocast``, ``nnx.grad`` of the
    ``dtype=P, param_dtype=float32`` model, ``tf.GradientTape`` under ``mixed_bfloat16``): float32 gradients, tensor by
    tensor within 8 x the reference-in-the-recipe's own error against the float64 gradient (at least one unit of P at
    the tensor's scale), the loss likewise. In bfloat16 also the same numbers: each product's gradient is one rounding
    to bfloat16's 8 bits of float32 sums that differ from the reference's exact ones by ~2^-20, so a port's
    gradients are the reference's bit for bit but at a few elements in a thousand (measured: every element of every
    linear map's weight gradient, in all three ports); a rounding to P left out of the backward, or one too many,
    changes most of them. (float16's 11 bits let those sums' differences through: 7-100% identical there.)"""
    config = FORWARD_VARIANTS[variant]
    value, grads = port_backend(port).gradients(port_model(port, variant, precision), **cases.training_inputs(config))
    (value64, grads64), (value_mixed, grads_mixed) = (reference_gradients(variant, p) for p in ("float64", precision))
    low = LOW[precision]
    assert tolerance.agreement(value, value64, value_mixed, low).ok
    assert list(grads) == list(grads64)
    for name, grad in grads.items():
        assert grad.dtype == grads_mixed[name].dtype == np.float32, (name, grad.dtype)
        result = tolerance.agreement(grad, grads64[name], grads_mixed[name], low)
        assert result.ok, f"{port}/{precision}/{variant}: gradient of {name}: {result}"
        if low == "bfloat16" and name.endswith(".weight") and "norm" not in name and "embed" not in name:
            assert np.mean(grad == grads_mixed[name]) >= 0.9, (name, np.mean(grad == grads_mixed[name]))


# ----------------------------------------------------------------------------- training

@functools.cache
def training_run(backend_name: str, precision: str):
    """Ten steps of section 5 (the training suite's config and batches, dropout off) from the seeded ``tiny`` weights:
    a model built in ``precision`` and its backend's float32 Adam, each step's loss and gradients under the model's
    recipe; in "float64", the reference's or a port's float64 run of the same steps (the yardstick), as
    tests/equivalence/test_training.py runs them."""
    module, config = backend(backend_name), config_of("tiny")
    model = module.build(config, cases.seeded_params(config), precision, "cpu")
    optimizer = module.optimizer(model, TRAINING)
    inputs = batches("tiny")
    losses = [module.train_step(model, optimizer, **inputs[step]) for step in range(STEPS)]
    return copied(losses, module.export_params(model), module.training_state(model, optimizer))


# 20 to 40 s in JAX and TensorFlow: the training step under the framework's switch, compiled for it (the float16
# one with its loss scaling), beside the reference's ten steps in float64 and in the recipe.
@pytest.mark.slow
@pytest.mark.parametrize("port", list(FRAMEWORKS))
@pytest.mark.parametrize("precision", AUTOCAST_NAMES)
def test_ten_steps(port, precision):
    """Ten optimizer steps of a float32 model under each framework's switch -- torch's automatic mixed precision
    (autocast with a ``GradScaler``), Flax's ``dtype``/``param_dtype`` model with a ``DynamicScale``, Keras' mixed
    policy with a ``LossScaleOptimizer`` (float16; bfloat16 has float32's range and checks finiteness only): every
    step taken where the reference's is, float16's loss scale and its good steps the reference's, and each step's loss
    within the low-precision rule of the float64 reference's run, the reference's own run in the recipe (its float16
    loss scaled) the yardstick. In bfloat16 each tensor's update and Adam moments too (:func:`assert_updates_agree`).
    In float16 that per-tensor rule fails at a few entries whose exact first gradient is below float16's noise (a
    gradient of 2e-5 whose sign a port computes otherwise: Adam's first update is lrate(1) times its sign, so the
    entry moves 2 lrate(1) apart, 11 times the reference's own error there); every weight and both moments are held
    entry by entry instead to the float64 run's ``TrainingBound`` with float16's per-entry gradient bound
    (``tolerance.recipe_gradient_bound``, :func:`float16_bound`)."""
    low = LOW[precision]
    ref64, same, run = training_run("numpy", "float64"), training_run("numpy", precision), training_run(port, precision)
    for step, (value, v_same, v64) in enumerate(zip(run.losses, same.losses, ref64.losses), 1):
        assert tolerance.agreement(np.float32(value), v64, v_same, low).ok, f"loss at step {step}"
    assert run.state.step == same.state.step == STEPS
    assert run.state.loss_scale == same.state.loss_scale and (same.state.loss_scale is None) == (low == "bfloat16")
    if low == "bfloat16":
        assert_updates_agree(run, same, ref64, low, port)
    else:
        expected, bound = float16_bound()
        assert_weights_and_moments(run, expected, bound, f"{port}/{precision}")


@functools.cache
def float16_bound() -> tuple[Run, tolerance.TrainingBound]:
    """The float64 reference's ten steps and the bound of a mixed-float16 run of them, entry by entry: each step's
    gradient bound 8 x the largest error of the reference's own mixed-float16 run and of RECIPE_DRAWS more with
    every rounding to float16 a random one (``tolerance.recipe_gradient_bound``, ``tolerance.random_roundings``),
    carried through Adam by ``tolerance.TrainingBound``, float32 masters."""
    config = config_of("tiny")
    recipe = recipe_gradients(config, cases.seeded_params(config), TRAINING, batches("tiny"), "float16", RECIPE_DRAWS)
    return reference_run(config, cases.seeded_params(config), TRAINING, batches("tiny"), recipe=recipe)


def test_the_float16_bound_is_tight_enough_to_decide():
    """The bound of :func:`float16_bound` must not swallow what it guards: a port whose updates are negated (2
    |update| off) must fail at most entries, so the bound is below twice a weight's own update (float64) at more
    than half of them (measured: the median entry's bound is 1.3 times its update, 44% of the entries' bound below
    it; a negated update passes at 39% of them and fails by up to 110 times the bound). Key-projection biases are
    left out: their gradient is zero in exact arithmetic (a key bias shifts all of a query's scores alike), their
    updates rounding noise divided by Adam's epsilon."""
    (expected, bound), initial = float16_bound(), cases.seeded_params(config_of("tiny"))
    ratios = []
    for name, before in initial.items():
        moved = np.abs(expected.params[name] - before)
        if not name.endswith("k_proj.bias"):
            ratios.append(bound.weight_bound(name, expected.params[name])[moved > 0] / moved[moved > 0])
    assert np.median(np.concatenate(ratios)) < 2


def test_random_roundings_for_the_training_bound_round_to_either_neighbour_in_proportion():
    """``tolerance.random_roundings`` (the draws of :func:`float16_bound`): inside the block every rounding to float16
    or bfloat16 gives one of the two neighbours, the upper one with probability the value's distance from the lower
    one in units (stochastic rounding): over 20,000 draws its frequency within Hoeffding's bound of that fraction
    (2 exp(-2 n t^2) = 1e-9); float32 and the rounding outside the block are untouched."""
    from reference_numpy import precision
    n, fractions = 20_000, np.array([0.0, 0.1, 0.25, 0.5, 0.9])
    slack = math.sqrt(math.log(2 / 1e-9) / (2 * n))
    for dtype in ("float16", "bfloat16"):
        lower = np.array([1.0, -3.0, 1000.0, 2.0 ** -20, 0.5])                    # numbers of P (normal, subnormal)
        unit = spacing(lower, dtype) * np.sign(lower)
        values = np.repeat(lower + fractions * unit, n)
        with tolerance.random_roundings(np.random.default_rng(0)):
            rounded = precision.round_to(values, dtype).astype(np.float64).reshape(len(lower), n)
            assert precision.round_to(np.float32(1.1), np.float32) == np.float32(1.1)
        upper = rounded == (lower + unit)[:, None]
        assert np.all(upper | (rounded == lower[:, None]))
        assert np.all(np.abs(upper.mean(axis=1) - fractions) <= slack), (dtype, upper.mean(axis=1))
    assert precision.round_to(np.float64(1.0 + 2.0 ** -12), "float16") == 1.0                # to nearest again


def assert_updates_agree(run, same, ref64, low: str, port: str) -> None:
    """Each tensor's update (weights after minus before) and Adam's moments of ``run`` within the low-precision rule
    of the float64 run ``ref64``, the reference's run in the recipe ``same`` the yardstick."""
    for tensor, before in cases.seeded_params(config_of("tiny")).items():
        start32 = before.astype(np.float32).astype(np.float64)
        update = lambda r, start: np.asarray(r.params[tensor], dtype=np.float64) - start   # noqa: E731
        result = tolerance.agreement(update(run, start32).astype(np.float32), update(ref64, before),
                                     update(same, start32), low)
        assert result.ok, f"{port}: update of {tensor}: {result}"
        for which in (2, 3):
            result = tolerance.agreement(run.state[which][tensor], ref64.state[which][tensor],
                                         same.state[which][tensor], low)
            assert result.ok, f"{port}: moment {which - 1} of {tensor}: {result}"


@pytest.mark.parametrize("port", ["numpy", *FRAMEWORKS])
def test_a_dtype_beside_a_mixed_model_is_refused(port):
    """A mixed-precision model trains in its own recipe: a ``dtype`` given beside it is one ValueError, the same in
    every backend."""
    backend = reference if port == "numpy" else port_backend(port)
    model = port_model(port, "tiny", "mixed-float16") if port != "numpy" else \
        reference.build(FORWARD_VARIANTS["tiny"], cases.seeded_params(FORWARD_VARIANTS["tiny"]), "mixed-float16")
    with pytest.raises(ValueError) as refused:
        backend.optimizer(model, dtype="bfloat16")
    assert str(refused.value) == "a mixed-float16 model trains in its own recipe, got dtype='bfloat16'"

