"""An independent whole-model oracle: the Transformer of sections 3.1-3.5, written from the paper
and ``docs/checkpoint-format.md`` alone, in float64, one sentence, one head and one query at a
time. It shares no code with the reference: from ``reference_numpy`` it takes only the config,
the seeded checkpoint weights (``init_params``) and the float64 bound of the tolerance policy.
The reference's every stage is compared with it for every config variant and mask case.

In bfloat16 and float16 the same oracle rounds where ``docs/equivalence.md`` ("Low precision") says the recipe
rounds: the weights; each linear map's output; each head's attention output; each LayerNorm's output; the
residual sums; the scaled embedding, the positional table and their sum; the logits; the log-probabilities to
float32. Its rounding (``nearest``) picks the nearest number of the format from a table of all its finite
values, by exact float64 distances, ties to the even bit pattern. The reference in that format must give the
same bits at every stage.

Conventions the oracle states (``docs/reference.md``): masks are bool, True = may attend; a
query that may attend to no key outputs zero; the target's default mask is causal and hides
target padding, the source's hides source padding; embeddings are scaled by sqrt(d_model); PE
is interleaved (even columns sin, odd cos); LayerNorm uses the biased variance with
``config.layer_norm_eps`` inside the square root; pre-LN adds a final LayerNorm to each stack.
"""

from __future__ import annotations

import importlib
import math

import ml_dtypes
import numpy as np
import pytest
from support import FRAMEWORKS, constant_logits_params, float64_inference, framework_array, port_backend

from equivalence.backends import numpy as reference_backend
from equivalence.tolerance import FLOAT64_RELATIVE, assert_agrees
from reference_numpy import Transformer, TransformerConfig, capture_stages, init_params
from reference_numpy import model as reference_model
from reference_numpy.precision import round_to

# eps = 1e-2 moves every LayerNorm output by ~1e-3 relative to eps = 1e-6 or 1e-5: a wrong
# epsilon anywhere is nine orders of magnitude over the float64 bound.
TINY = TransformerConfig.preset("tiny", layer_norm_eps=1e-2)          # 2 encoder, 3 decoder layers
VARIANTS = {
    "post_ln": TINY,
    "pre_ln": TINY.replace(norm_first=True),
    "learned_pe": TINY.replace(positional_encoding="learned"),
    "shared_embeddings": TINY.replace(src_vocab_size=TINY.tgt_vocab_size, share_embeddings=True),
    "one_layer_each": TINY.replace(n_encoder_layers=1, n_decoder_layers=1),
    "pre_ln_3_1_learned_shared": TINY.replace(n_encoder_layers=3, n_decoder_layers=1, norm_first=True,
                                              positional_encoding="learned", src_vocab_size=TINY.tgt_vocab_size,
                                              share_embeddings=True),
    "default_eps": TINY.replace(layer_norm_eps=1e-6),
}
BATCH, SRC_LEN, TGT_LEN = 3, 7, 6
CASES = ("padding", "fully_padded_source", "explicit_masks")


# ----------------------------------------------------------------------------- the oracle

def exact(x):
    """float64: no rounding beyond float64's own."""
    return x


def linear(x, p, name, r=exact):
    """y = x W + b with W stored (in, out) (checkpoint format), rounded by ``r``."""
    return r(x @ p[f"{name}.weight"] + p[f"{name}.bias"])


def layer_norm(x, p, name, eps, r=exact):
    """Ba et al. (2016), position by position: (v - mean) / sqrt(biased var + eps) * weight + bias."""
    out = np.empty_like(x)
    for i, v in enumerate(x):
        mean = math.fsum(v) / len(v)
        var = math.fsum((v - mean) ** 2) / len(v)
        out[i] = r((v - mean) / math.sqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"])
    return out


def attention(p, name, n_heads, queries, memory, allowed, r=exact):
    """Section 3.2.2: queries from ``queries``, keys and values from ``memory``; head h uses
    columns h*d_k..(h+1)*d_k-1; Eq. (1) per query over its visible keys (``allowed`` (H, Tq, Tk));
    a query with no visible key outputs zero. Then W^O."""
    q, k, v = (linear(x, p, f"{name}.{proj}", r) for x, proj in ((queries, "q_proj"), (memory, "k_proj"),
                                                                 (memory, "v_proj")))
    d_k = q.shape[1] // n_heads
    concat = np.zeros_like(q)
    for h in range(n_heads):
        cols = slice(h * d_k, (h + 1) * d_k)
        for i in range(len(q)):
            visible = [j for j in range(len(k)) if allowed[h, i, j]]
            if not visible:
                continue
            scores = [float(q[i, cols] @ k[j, cols]) / math.sqrt(d_k) for j in visible]
            exps = [math.exp(s - max(scores)) for s in scores]
            concat[i, cols] = r(sum(e / math.fsum(exps) * v[j, cols] for e, j in zip(exps, visible)))
    return linear(concat, p, f"{name}.o_proj", r)


def feed_forward(x, p, name, r=exact):
    """Eq. (2): max(0, x W1 + b1) W2 + b2."""
    return linear(np.maximum(linear(x, p, f"{name}.linear1", r), 0.0), p, f"{name}.linear2", r)


def sublayer(x, f, p, norm, config, r=exact):
    """Section 3.1: post-LN LayerNorm(x + f(x)); pre-LN x + f(LayerNorm(x))."""
    if config.norm_first:
        return r(x + f(layer_norm(x, p, norm, config.layer_norm_eps, r)))
    return layer_norm(r(x + f(x)), p, norm, config.layer_norm_eps, r)


def embed(tokens, p, config, side, r=exact):
    """Section 3.4: E[token] * sqrt(d_model), plus the section 3.5 sinusoid or the learned table."""
    name = "shared_embed" if config.share_embeddings else f"{side}_embed"
    out = np.zeros((len(tokens), config.d_model))
    for pos, token in enumerate(tokens):
        if config.positional_encoding == "learned":
            table = p[f"{side}_pos_embed.weight"][pos]
        else:
            table = np.zeros(config.d_model)
            for i in range(0, config.d_model, 2):
                angle = pos / 10000 ** (i / config.d_model)
                table[i], table[i + 1] = math.sin(angle), math.cos(angle)
        out[pos] = r(r(p[f"{name}.weight"][token] * math.sqrt(config.d_model)) + r(table))
    return out


def log_softmax_by_hand(logits) -> np.ndarray:
    """Section 3.4's log-softmax of one row of logits, in float64: z_i - max - log(fsum_j exp(z_j - max)).
    Shifting by the max keeps every exponential in [0, 1] and the sum in [1, V]: the ones that underflow to 0 are
    those below the largest by more than exp's range, whose share of the sum is below float64's resolution."""
    logits = np.asarray(logits, dtype=np.float64)
    top = max(logits)
    return logits - top - math.log(math.fsum(math.exp(z - top) for z in logits))


def oracle_sentence(p, config, src, tgt, enc_allowed, cross_allowed, tgt_allowed, r=exact):
    """One sentence's stages; the masks are (H, S, S), (H, T, S) and (H, T, T)."""
    stages, h, eps = {}, config.n_heads, config.layer_norm_eps
    x = stages["src_embed"] = embed(src, p, config, "src", r)
    for i in range(config.n_encoder_layers):
        name = f"encoder.layers.{i}"
        x = sublayer(x, lambda y: attention(p, f"{name}.self_attn", h, y, y, enc_allowed, r), p,
                     f"{name}.self_attn_norm", config, r)
        x = stages[name] = sublayer(x, lambda y: feed_forward(y, p, f"{name}.ffn", r), p, f"{name}.ffn_norm",
                                    config, r)
    memory = stages["encoder"] = layer_norm(x, p, "encoder.norm", eps, r) if config.norm_first else x
    y = stages["tgt_embed"] = embed(tgt, p, config, "tgt", r)
    for i in range(config.n_decoder_layers):
        name = f"decoder.layers.{i}"
        y = sublayer(y, lambda z: attention(p, f"{name}.self_attn", h, z, z, tgt_allowed, r), p,
                     f"{name}.self_attn_norm", config, r)
        y = sublayer(y, lambda z: attention(p, f"{name}.cross_attn", h, z, memory, cross_allowed, r), p,
                     f"{name}.cross_attn_norm", config, r)
        y = stages[name] = sublayer(y, lambda z: feed_forward(z, p, f"{name}.ffn", r), p, f"{name}.ffn_norm",
                                    config, r)
    out = stages["decoder"] = layer_norm(y, p, "decoder.norm", eps, r) if config.norm_first else y
    weight = p["shared_embed.weight"].T if config.share_embeddings else p["generator.weight"]   # (D, V), no bias
    log_probs = np.array([log_softmax_by_hand(logits) for logits in r(out @ weight)])
    stages["log_probs"] = log_probs if r is exact else log_probs.astype(np.float32)
    return stages


def oracle(p, config, src, tgt, src_key_mask=None, tgt_mask=None, r=exact):
    """Every stage for a batch. Default masks: source keys that are not padding (encoder and
    cross attention); target keys j <= i that are not padding. Explicit masks: src_key_mask
    (B, S) for both source-side attentions, tgt_mask (B, H, T, T)."""
    h, s, t = config.n_heads, src.shape[1], tgt.shape[1]
    per_sentence = []
    for b in range(len(src)):
        keys = src_key_mask[b] if src_key_mask is not None else [token != config.pad_id for token in src[b]]
        if tgt_mask is not None:
            tgt_allowed = tgt_mask[b]
        else:
            causal_unpadded = [[j <= i and tgt[b, j] != config.pad_id for j in range(t)] for i in range(t)]
            tgt_allowed = np.broadcast_to(causal_unpadded, (h, t, t))
        per_sentence.append(oracle_sentence(p, config, src[b], tgt[b], np.broadcast_to(keys, (h, s, s)),
                                            np.broadcast_to(keys, (h, t, s)), tgt_allowed, r))
    return {name: np.stack([stages[name] for stages in per_sentence]) for name in per_sentence[0]}


# ----------------------------------------------------------------------------- the comparison

def inputs(config, case, seed=0):
    """Token ids (pad_id, bos_id, eos_id excluded) and, for ``explicit_masks``, random masks with
    per-head target masks and some fully masked rows."""
    rng, first = np.random.default_rng(seed), max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(first, config.src_vocab_size, size=(BATCH, SRC_LEN))
    tgt = rng.integers(first, config.tgt_vocab_size, size=(BATCH, TGT_LEN))
    tgt[:, 0] = config.bos_id
    if case == "explicit_masks":
        tgt_mask = rng.random((BATCH, config.n_heads, TGT_LEN, TGT_LEN)) < 0.5
        tgt_mask[0, 1, 2, :] = False                                            # a fully masked row
        return src, tgt, rng.random((BATCH, SRC_LEN)) < 0.6, tgt_mask
    src_lengths = [SRC_LEN, 2, 5] if case == "padding" else [SRC_LEN, 0, 5]     # row 1: no source token at all
    src[np.arange(SRC_LEN)[None, :] >= np.array(src_lengths)[:, None]] = config.pad_id
    tgt[np.arange(TGT_LEN)[None, :] >= np.array([TGT_LEN, 3, 5])[:, None]] = config.pad_id
    return src, tgt, None, None


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_matches_the_oracle_stage_by_stage(variant, case):
    """Every stage the reference exposes, in its order, within the float64 policy."""
    config = VARIANTS[variant]
    params = init_params(config, seed=1, perturb=0.1)          # non-trivial biases and LayerNorm weights
    src, tgt, src_key_mask, tgt_mask = inputs(config, case)
    expected = oracle(params, config, src, tgt, src_key_mask, tgt_mask)
    _, stages = capture_stages(Transformer(config, params), src, tgt,
                               None if src_key_mask is None else src_key_mask[:, None, None, :], tgt_mask)
    assert list(stages) == list(expected)
    for name, value in expected.items():
        assert_agrees(stages[name], value, what=f"{variant}/{case}/{name}")


def test_oracle_uses_the_zero_output_convention_on_a_fully_masked_row():
    """The oracle's own convention, seen directly: a query with no visible key contributes only
    the output projection's bias."""
    config = VARIANTS["post_ln"]
    params = init_params(config, seed=1, perturb=0.1)
    queries, memory = np.ones((2, config.d_model)), np.ones((3, config.d_model))
    allowed = np.zeros((config.n_heads, 2, 3), dtype=bool)
    out = attention(params, "encoder.layers.0.self_attn", config.n_heads, queries, memory, allowed)
    np.testing.assert_array_equal(out, np.broadcast_to(params["encoder.layers.0.self_attn.o_proj.bias"], out.shape))


# ----------------------------------------------------------------------------- bfloat16 and float16

def rounding_to(name):
    """``nearest``: arrays rounded to the nearest number of the format ``name``, ties to the even bit pattern, past
    the largest finite number by half its spacing to infinity (IEEE 754 round-to-nearest-even), as float64."""
    dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[name]
    patterns = np.arange(1 << 15, dtype=np.uint16)                              # every non-negative bit pattern
    with np.errstate(invalid="ignore"):                                         # the NaN patterns
        values = patterns.view(dtype).astype(np.float64)
    finite = np.isfinite(values)
    values, patterns = values[finite], patterns[finite]                         # ascending, as bit patterns are
    top_gap = values[-1] - values[-2]

    def nearest(x):
        x = np.asarray(x, dtype=np.float64)
        magnitude = np.abs(x)
        above = np.clip(np.searchsorted(values, magnitude), 1, len(values) - 1)
        low, high = values[above - 1], values[above]
        down, up = magnitude - low, high - magnitude                            # exact: neighbours within 2x
        pick_high = (up < down) | ((up == down) & (patterns[above] % 2 == 0))
        out = np.where(magnitude <= low, low, np.where(pick_high, high, low))
        out = np.where(magnitude >= values[-1] + top_gap / 2, np.inf, out)
        return np.copysign(out, x)
    return nearest


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_oracles_rounding_by_hand(dtype):
    """The table rounding on values whose nearest number is known: exact numbers stay, a value just past a
    midpoint goes up, an exact midpoint goes to the even neighbour, past the largest number to infinity."""
    nearest = rounding_to(dtype)
    bits = 8 if dtype == "bfloat16" else 11                                     # significand bits
    ulp, largest = 2.0 ** (1 - bits), float(ml_dtypes.finfo(dtype).max)
    cases = {1.0: 1.0, 1 + ulp: 1 + ulp, 1 + ulp / 2: 1.0, 1 + 3 * ulp / 2: 1 + 2 * ulp,
             1 + ulp / 2 + 2.0 ** -40: 1 + ulp, -(1 + ulp / 2 + 2.0 ** -40): -(1 + ulp), 0.0: 0.0,
             largest: largest, largest * (1 + ulp / 4): largest, largest * (1 + ulp): np.inf}
    np.testing.assert_array_equal(nearest(list(cases)), list(cases.values()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("variant", ["post_ln", "pre_ln", "learned_pe", "shared_embeddings"])
def test_reference_in_low_precision_matches_the_oracle_bit_for_bit(variant, dtype):
    """The reference in bfloat16 and float16 (weights rounded, every stage stored in the format, log-probabilities
    float32) gives the oracle's bits at every stage: the recipe's rounding points and nothing else. (Both compute
    between roundings in float64, where a sum's last-bit differences change a rounded result with probability
    ~2^-40.)"""
    config = VARIANTS[variant]
    nearest = rounding_to(dtype)
    params = {name: nearest(value) for name, value in init_params(config, seed=1, perturb=0.1).items()}
    src, tgt, _, _ = inputs(config, "padding")
    expected = oracle(params, config, src, tgt, r=nearest)
    _, stages = capture_stages(Transformer(config, params, dtype), src, tgt)
    assert list(stages) == list(expected)
    for name, value in expected.items():
        assert stages[name].dtype == (np.float32 if name == "log_probs" else np.dtype(dtype)), name
        np.testing.assert_array_equal(stages[name].astype(np.float64), value, err_msg=f"{variant}/{dtype}/{name}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_is_the_oracles_rounding(dtype):
    """``reference_numpy.precision.round_to`` (which scales and rounds the significand) against the table: random
    magnitudes over the whole range, subnormals, exact midpoints between neighbours and values a hair beside them
    (NumPy's and ml_dtypes' float64 -> bfloat16 casts, through float32, get those wrong)."""
    nearest, rng = rounding_to(dtype), np.random.default_rng(0)
    low, high = (-140, 129) if dtype == "bfloat16" else (-26, 17)
    x = rng.standard_normal(20000) * np.exp2(rng.uniform(low, high, 20000))
    numbers = nearest(x[:2000])
    numbers = numbers[np.isfinite(numbers) & (np.abs(numbers) < float(ml_dtypes.finfo(dtype).max))]
    next_up = np.nextafter(numbers.astype(dtype), np.asarray(np.inf, dtype)).astype(np.float64)
    midpoints = (numbers + next_up) / 2                                         # exact in float64
    assert np.all((numbers < midpoints) & (midpoints < next_up))
    x = np.concatenate([x, midpoints, midpoints + np.abs(midpoints) * 2.0 ** -40, midpoints * (1 - 2.0 ** -45)])
    np.testing.assert_array_equal(round_to(x, dtype).astype(np.float64), nearest(x))


# ----------------------------------------------------------------------------- log-softmax beyond exp's range
#
# Logits far apart: float64's exp underflows below -745 and float32's below -104, so exp(z - max) is 0 for most
# of these, where the log-softmax is finite (about z - max): log(softmax(z)) would be -inf there. Every value is a
# float32 number (integers, halves and quarters below 2^24), so both formats see the same logits.
EDGE_LOGITS = np.array([
    [0.0, -1e3, -1e4, -1e5, 1.0, -0.5, -150.0, -400.0],                  # 1e3..1e5 below a top near 0
    [1e5, 1e5, 99999.0, 0.0, -1e5, 99000.0, 99900.0, 99999.5],            # a shared top far above 0
    [-1e5, -100001.0, -100150.0, -2e5, -100000.25, -1.1e5, -1e5, -3e5],   # every logit far below 0
    [50.0, -50.0, 120.0, -120.0, 400.0, -400.0, 0.0, 800.0],              # within float64's range, not float32's
    [7.0] * 8,                                                            # all equal: -log 8 each
])
# 1,536 classes (JAX sums them in chunks of 768): the first row repeated, each copy 1 lower than the last.
WIDE_EDGE_LOGITS = (np.tile(EDGE_LOGITS[0], 192) - np.repeat(np.arange(192.0), 8))[None, :]
LIBRARY_ULPS = 4    # float32 exp and log of the frameworks' math libraries: within 4 units in the last place


def edge_bound(logits: np.ndarray, expected: np.ndarray, dtype: str) -> np.ndarray:
    """Element-wise bound on a backend's log-softmax r of the rows ``logits`` (z; m = max z, V classes, S =
    sum_j exp(z_j - m) in [1, V]), ``expected`` being :func:`log_softmax_by_hand`'s.

    float64: the policy, FLOAT64_RELATIVE times the computation's scale max(1, |r_i|, |m|) (log-softmax depends on
    z - m only, but an implementation may round at m's scale, forming m + log S).

    float32, derived to first order in u = 2^-24 for the max-shifted computation any backend does:
    z_i - m rounds by u|z_i - m| <= u|r_i| (log S >= 0); each exp is within LIBRARY_ULPS = C units (2Cu relative)
    and carries its argument's rounding, a relative u|z_j - m| that weighted by exp(z_j - m) / S adds at most
    u (V - 1) / e to S (x e^-x <= 1/e); summing V positive terms adds (V - 1) u; the log turns S's relative error
    into an absolute one and adds its C units at log S <= log V; the last difference rounds by u|r_i|, or, formed
    as z_i - (m + log S), by u (|m| + log V) more:
        |r - r_i| <= u (2 |r_i| + |m| + log V + (V - 1)(1 + 1/e) + 2C (1 + log V)).
    The second-order terms are u times these, 2^-24 of them."""
    top = logits.max(axis=-1, keepdims=True)
    if dtype == "float64":
        return FLOAT64_RELATIVE * np.maximum(np.maximum(1.0, np.abs(expected)), np.abs(top))
    classes = logits.shape[-1]
    return 2.0 ** -24 * (2 * np.abs(expected) + np.abs(top) + math.log(classes) + (classes - 1) * (1 + 1 / math.e)
                         + 2 * LIBRARY_ULPS * (1 + math.log(classes)))


def assert_log_softmax(out, logits: np.ndarray, dtype: str, what: str) -> None:
    """``out`` (..., V) is the log-softmax of every row of ``logits`` in ``dtype``: finite, within
    :func:`edge_bound`."""
    out = np.asarray(out)
    assert out.dtype == np.dtype(dtype), f"{what}: {out.dtype}, expected {dtype}"
    rows = logits.reshape(-1, logits.shape[-1])
    expected = np.array([log_softmax_by_hand(row) for row in rows]).reshape(logits.shape)
    assert np.isfinite(out).all(), f"{what}: {np.count_nonzero(~np.isfinite(out))} log-probabilities not finite"
    error, bound = np.abs(out.astype(np.float64) - expected), edge_bound(logits, expected, dtype)
    worst = np.unravel_index(np.argmax(error / bound), error.shape)
    assert np.all(error <= bound), f"{what}: element {worst} is {error[worst]:.3e} off, over its {bound[worst]:.3e}"


def test_the_log_softmax_by_hand_in_closed_form():
    """The oracle where the sum is known: equal logits give -log 8; in the first edge row only 1, 0 and -0.5
    count (the rest are more than 150 below the top), r = z - 1 - log(1 + e^-1 + e^-1.5)."""
    assert_agrees(log_softmax_by_hand(EDGE_LOGITS[4]), np.full(8, -math.log(8)), what="equal logits")
    assert_agrees(log_softmax_by_hand(EDGE_LOGITS[0]), EDGE_LOGITS[0] - 1 - math.log1p(math.exp(-1) + math.exp(-1.5)),
                  what="edge row 0")


def backend_log_softmax(name: str, logits: np.ndarray):
    """The ``log_softmax`` of the backend's model.py (the generator's, section 3.4) on ``logits``, as NumPy."""
    if name == "numpy":
        module = reference_model
    else:
        port_backend(name)                               # a skip with its reason if the framework is missing
        module = importlib.import_module(f"transformer_{name}.model")
    with float64_inference(name):
        return np.asarray(module.log_softmax(framework_array(name, logits)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_log_softmax_beyond_exps_range(name, dtype):
    """Every backend's log_softmax on :data:`EDGE_LOGITS` and the 1,536 classes of :data:`WIDE_EDGE_LOGITS`."""
    for logits in (EDGE_LOGITS, WIDE_EDGE_LOGITS):
        assert_log_softmax(backend_log_softmax(name, logits.astype(dtype)), logits, dtype,
                           f"{name} {dtype} log_softmax of {logits.shape[1]} classes")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["numpy", *FRAMEWORKS])
def test_model_log_probabilities_beyond_exps_range(name, dtype):
    """A model whose logits are exactly the second edge row at every position (``support.constant_logits_params``:
    a top of 1e5, the rest down to -1e5): every backend's forward pass gives their log-softmax at every position."""
    backend = reference_backend if name == "numpy" else port_backend(name)
    model = backend.build(*constant_logits_params(EDGE_LOGITS[1]), dtype)
    out = backend.log_probs(model, np.array([[5, 6, 7], [8, 2, 0]]), np.array([[1, 3, 4], [1, 5, 0]]))
    assert_log_softmax(out, np.broadcast_to(EDGE_LOGITS[1], out.shape), dtype, f"{name} {dtype} model log-probs")
