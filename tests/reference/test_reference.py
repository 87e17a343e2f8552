"""Checks of the NumPy reference that do not trust the reference: naive loop implementations,
the paper's formulas evaluated with Python floats, and invariances of the architecture."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from equivalence.cases import VARIANTS
from equivalence.tolerance import assert_agrees
from reference_numpy import (
    LayerNorm,
    MultiHeadAttention,
    Transformer,
    TransformerConfig,
    capture_stages,
    causal_mask,
    count_parameters,
    init_params,
    padding_mask,
    scaled_dot_product_attention,
    sinusoidal_positional_encoding,
    target_mask,
)
from reference_numpy.decoding import next_token_log_probs
from reference_numpy.incremental import at_position

TINY = VARIANTS["tiny"]


def close64(actual, expected, what="output"):
    """The project's float64 policy (1e-12 relative to scale)."""
    assert_agrees(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64), what=what)


# ----------------------------------------------------------------------------- naive implementations

def naive_attention(q, k, v, allowed):
    """Eq. (1) one query at a time with Python floats; a row with no allowed key gives zeros."""
    batch, tq, d_k = q.shape
    out = np.zeros((batch, tq, v.shape[-1]))
    for b in range(batch):
        for i in range(tq):
            keys = [j for j in range(k.shape[1]) if allowed[b, i, j]]
            if not keys:
                continue
            scores = [sum(float(q[b, i, c]) * float(k[b, j, c]) for c in range(d_k)) / math.sqrt(d_k) for j in keys]
            top = max(scores)
            exps = [math.exp(s - top) for s in scores]
            for j, e in zip(keys, exps):
                out[b, i] += e / sum(exps) * v[b, j]
    return out


def naive_multi_head(params, name, n_heads, query, key, value, allowed):
    """Section 3.2.2 head by head: head i uses columns i*d_k..(i+1)*d_k-1 of W^Q, W^K, W^V."""
    d_model = query.shape[-1]
    d_k = d_model // n_heads
    heads = []
    for i in range(n_heads):
        cols = slice(i * d_k, (i + 1) * d_k)
        project = lambda x, proj: x @ params[f"{name}.{proj}.weight"][:, cols] + params[f"{name}.{proj}.bias"][cols]
        heads.append(naive_attention(project(query, "q_proj"), project(key, "k_proj"), project(value, "v_proj"),
                                     allowed))
    return np.concatenate(heads, axis=-1) @ params[f"{name}.o_proj.weight"] + params[f"{name}.o_proj.bias"]


def naive_layer_norm(x, weight, bias, eps):
    out = np.empty_like(x)
    for index in np.ndindex(x.shape[:-1]):
        row = [float(value) for value in x[index]]
        mean = sum(row) / len(row)
        var = sum((value - mean) ** 2 for value in row) / len(row)          # biased variance
        out[index] = [(value - mean) / math.sqrt(var + eps) for value in row]
    return out * weight + bias


def random_allowed(rng, batch, tq, tk):
    allowed = rng.random((batch, tq, tk)) < 0.7
    allowed[0, 1] = False                                                  # a fully masked query row
    return allowed


def test_attention_matches_naive_loops():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 3))
    allowed = random_allowed(rng, 2, 5, 6)
    out, weights = scaled_dot_product_attention(q, k, v, allowed)
    close64(out, naive_attention(q, k, v, allowed))
    assert np.all(out[0, 1] == 0) and np.all(weights[0, 1] == 0)


def test_attention_without_mask_matches_naive_loops():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 3, 8)), rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 4, 8))
    close64(scaled_dot_product_attention(q, k, v)[0], naive_attention(q, k, v, np.ones((1, 3, 4), bool)))


def test_multi_head_attention_matches_naive_heads():
    rng = np.random.default_rng(3)
    params = init_params(TINY, seed=4, perturb=0.1)
    name = "decoder.layers.1.cross_attn"
    query, memory = rng.standard_normal((2, 5, TINY.d_model)), rng.standard_normal((2, 7, TINY.d_model))
    allowed = random_allowed(rng, 2, 5, 7)
    out = MultiHeadAttention(TINY, params, name)(query, memory, memory, allowed[:, None])
    close64(out, naive_multi_head(params, name, TINY.n_heads, query, memory, memory, allowed))


def test_layer_norm_matches_naive_statistics():
    rng = np.random.default_rng(5)
    x = 3.0 + 2.0 * rng.standard_normal((2, 3, 16))
    params = {"n.weight": rng.standard_normal(16), "n.bias": rng.standard_normal(16)}
    for eps in (1e-6, 1e-5, 1e-3):
        norm = LayerNorm(TINY.replace(layer_norm_eps=eps), params, "n")
        close64(norm(x), naive_layer_norm(x, params["n.weight"], params["n.bias"], eps))


def test_layer_norm_uses_the_configured_epsilon():
    """eps is added to the biased variance: x = [0, 1e-3] has mean 5e-4 and variance 2.5e-7."""
    x = np.array([[0.0, 1e-3]])
    params = {"n.weight": np.ones(2), "n.bias": np.zeros(2)}
    for eps in (1e-12, 1e-6, 1e-5):
        half = 5e-4 / math.sqrt(2.5e-7 + eps)
        close64(LayerNorm(TINY.replace(layer_norm_eps=eps), params, "n")(x), [[-half, half]], what=f"eps={eps}")


# ----------------------------------------------------------------------------- positional encoding

def test_positional_encoding_is_the_papers_formula_interleaved():
    length, d_model = 50, 16
    table = sinusoidal_positional_encoding(length, d_model)
    expected = [[math.sin(pos / 10000 ** (2 * (c // 2) / d_model)) if c % 2 == 0
                 else math.cos(pos / 10000 ** (2 * (c // 2) / d_model)) for c in range(d_model)]
                for pos in range(length)]
    close64(table, expected)


def test_positional_encoding_is_computed_in_float64_then_cast():
    table32 = sinusoidal_positional_encoding(1000, 512, np.float32)
    assert table32.dtype == np.float32
    np.testing.assert_array_equal(table32, sinusoidal_positional_encoding(1000, 512).astype(np.float32))


@pytest.mark.parametrize("offset", [1, 3, 17])
def test_positional_encoding_at_pos_plus_k_is_a_fixed_rotation(offset):
    """Section 3.5: PE(pos + k) is a linear function of PE(pos); here the 2x2 rotations by k*omega_i."""
    length, d_model = 64, 16
    table = sinusoidal_positional_encoding(length + offset, d_model)
    rotation = np.zeros((d_model, d_model))
    for i in range(d_model // 2):
        angle = offset / 10000 ** (2 * i / d_model)
        # [sin(a + b), cos(a + b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
        rotation[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[math.cos(angle), math.sin(angle)],
                                                      [-math.sin(angle), math.cos(angle)]]
    close64(table[:length] @ rotation.T, table[offset:offset + length])


# ----------------------------------------------------------------------------- invariances of the model

@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request):
    config = VARIANTS[request.param]
    return Transformer(config, init_params(config, seed=7, perturb=0.1))


def tokens(rng, config, shape, vocab):
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1
    return rng.integers(first, vocab, size=shape)


def test_decoder_is_causal(model):
    """Changing target tokens at positions >= t never changes outputs at positions < t."""
    config, rng = model.config, np.random.default_rng(8)
    src = tokens(rng, config, (2, 6), config.src_vocab_size)
    tgt = tokens(rng, config, (2, 7), config.tgt_vocab_size)
    base = model(src, tgt)
    for t in range(1, 7):
        changed = tgt.copy()
        changed[:, t:] = tokens(rng, config, (2, 7 - t), config.tgt_vocab_size)
        close64(model(src, changed)[:, :t], base[:, :t], what=f"positions < {t}")


def test_cached_decoding_equals_uncached_step_by_step(model):
    """Section 3.2.3 with a key/value cache: feeding the target a few positions at a time through
    init_cache and decode(cache=) (at_position, or the cache's own position) gives every position the uncached
    decoder's output
    on the whole prefix (with the default causal mask, and with an explicit mask over the cache
    for a target row with padding), and next_token_log_probs with a cache the uncached
    log-probabilities, in float64 within the policy. The cache is a value: a step returns a new
    one and leaves the one it was given unchanged."""
    config, rng = model.config, np.random.default_rng(17)
    src = tokens(rng, config, (3, 6), config.src_vocab_size)
    src[1, 4:] = config.pad_id
    tgt = tokens(rng, config, (3, 8), config.tgt_vocab_size)
    tgt[:, 0] = config.bos_id
    src_mask = padding_mask(src, config.pad_id)
    memory = model.encode(src, src_mask)
    steps = ((0, 1), (1, 2), (2, 5), (5, 6), (6, 8))                        # one or several new positions
    cache = empty = model.init_cache(memory, 10)
    for start, end in steps:
        out, cache = model.decode(tgt[:, start:end], memory, src_mask, cache=at_position(cache, start))
        close64(out, model.decode(tgt[:, :end], memory, src_mask)[:, start:], what=f"positions {start}..{end - 1}")
    assert not any(kv.keys.any() or kv.values.any() for layer in empty for kv in layer[:1])
    assert not cache[0][0].keys[:, :, 8:].any()                             # never written
    assert [own.position for own, _ in cache] == [8] * config.n_decoder_layers   # advanced past the last write
    assert all(memory_cache.is_memory and memory_cache.position == () for _, memory_cache in cache)
    stepped = model.init_cache(memory, 10)                                  # no position given: the cache's own
    for start, end in steps:
        out, stepped = model.decode(tgt[:, start:end], memory, src_mask, cache=stepped)
        close64(out, model.decode(tgt[:, :end], memory, src_mask)[:, start:], what=f"own position {start}..{end - 1}")
    cache = model.init_cache(memory, 8)
    for start, end in steps:
        cached, cache = next_token_log_probs(model, tgt[:, start:end], memory, src_mask, cache, start)
        uncached = next_token_log_probs(model, tgt[:, :end], memory, src_mask)
        assert np.array_equal(np.isfinite(cached), np.isfinite(uncached))
        close64(cached[np.isfinite(cached)], uncached[np.isfinite(uncached)], what=f"log-probs after {end} tokens")
    tgt[2, 5:] = config.pad_id
    cache = model.init_cache(memory, 8)
    for start, end in steps:
        rows = target_mask(tgt[:, :end], config.pad_id)[:, :, start:]        # (B, 1, T_new, end)
        tgt_mask = np.pad(rows, [(0, 0), (0, 0), (0, 0), (0, 8 - end)])     # (B, 1, T_new, C)
        out, cache = model.decode(tgt[:, start:end], memory, src_mask, tgt_mask, cache=at_position(cache, start))
        close64(out, model.decode(tgt[:, :end], memory, src_mask)[:, start:], what=f"padded, {start}..{end - 1}")


def test_cache_arguments_are_checked():
    model = Transformer(TINY, init_params(TINY, seed=18))
    memory = model.encode(np.array([[5, 6, 7]]))
    cache = model.init_cache(memory, 2)
    with pytest.raises(ValueError, match="cache holds 2 positions; decoding needs 3"):
        model.decode(np.array([[1, 5]]), memory, cache=at_position(cache, 1))
    with pytest.raises(ValueError, match="cache.position must be an int >= 0, got 1.0"):
        model.decode(np.array([[1]]), memory, cache=at_position(cache, 1.0))
    with pytest.raises(ValueError, match=r"capacity must be an int in \[1, 64\], got 0"):
        model.init_cache(memory, 0)
    with pytest.raises(ValueError, match="memory must have the model's dtype float64, got float32"):
        model.init_cache(memory.astype(np.float32), 2)


def test_source_padding_is_invisible(model):
    """Changing source tokens under the padding mask never changes outputs at real positions."""
    config, rng = model.config, np.random.default_rng(9)
    src = tokens(rng, config, (2, 8), config.src_vocab_size)
    tgt = tokens(rng, config, (2, 5), config.tgt_vocab_size)
    real = np.arange(8) < np.array([[8], [5]])
    mask = padding_mask(np.where(real, src, config.pad_id), config.pad_id)
    other = np.where(real, src, tokens(rng, config, (2, 8), config.src_vocab_size))
    memory, other_memory = model.encode(src, mask), model.encode(other, mask)
    close64(other_memory[real], memory[real], what="encoder output at real positions")
    close64(model(other, tgt, mask), model(src, tgt, mask), what="log-probabilities")


def test_encoder_without_positions_is_permutation_equivariant(model):
    config, rng = model.config, np.random.default_rng(10)
    x = rng.standard_normal((2, 6, config.d_model))
    keep = rng.random((2, 6)) < 0.8
    permutation = rng.permutation(6)
    mask = keep[:, None, None, :]
    out = model.encoder(x, mask)
    permuted = model.encoder(x[:, permutation], mask[..., permutation])
    close64(permuted, out[:, permutation])


def test_log_probabilities_are_normalized(model):
    config, rng = model.config, np.random.default_rng(11)
    log_probs = model(tokens(rng, config, (2, 4), config.src_vocab_size),
                      tokens(rng, config, (2, 3), config.tgt_vocab_size))
    close64(np.log(np.exp(log_probs).sum(-1)), np.zeros(log_probs.shape[:-1]))


def test_float32_on_request_stays_float32(model):
    config, rng = model.config, np.random.default_rng(12)
    model32 = Transformer(config, model.params, dtype=np.float32)
    _, stages = capture_stages(model32, tokens(rng, config, (2, 4), config.src_vocab_size),
                               tokens(rng, config, (2, 3), config.tgt_vocab_size))
    assert {name: value.dtype for name, value in stages.items()} == {name: np.float32 for name in stages}


def test_shared_embeddings_are_one_matrix():
    config = VARIANTS["shared_embeddings"]
    params = init_params(config, seed=13)
    model = Transformer(config, params)
    matrix = model.params["shared_embed.weight"]
    assert model.src_embed.weight is matrix and model.tgt_embed.weight is matrix
    assert model.generator.weight.base is matrix                          # the transpose is a view
    tokens_ = np.array([[5, 6]])
    close64(model.src_embed(tokens_), params["shared_embed.weight"][tokens_] * math.sqrt(config.d_model))


def test_dropout_does_not_change_inference():
    rng = np.random.default_rng(14)
    src, tgt = tokens(rng, TINY, (2, 5), TINY.src_vocab_size), tokens(rng, TINY, (2, 4), TINY.tgt_vocab_size)
    params = init_params(TINY, seed=15)
    np.testing.assert_array_equal(Transformer(TINY.replace(dropout=0.0), params)(src, tgt),
                                  Transformer(TINY.replace(dropout=0.5), params)(src, tgt))


def test_pre_ln_differs_from_post_ln_and_has_final_norms():
    config = VARIANTS["pre_ln"]
    model = Transformer(config, init_params(config, seed=16, perturb=0.1))
    assert model.encoder.norm is not None and model.decoder.norm is not None
    assert Transformer(TINY, init_params(TINY, seed=16)).encoder.norm is None


def test_masks_follow_the_convention():
    causal = causal_mask(4)[0, 0]
    assert causal.dtype == bool
    assert all(causal[i, j] == (j <= i) for i in range(4) for j in range(4))
    np.testing.assert_array_equal(padding_mask(np.array([[5, 6, 0]]), 0)[0, 0, 0], [True, True, False])


@pytest.mark.parametrize("bad, message", [
    (np.ones((1, 1, 2, 3)), "mask must be boolean"),
    (np.ones((1, 1, 2, 4), dtype=bool), "does not broadcast"),
])
def test_attention_refuses_bad_masks(bad, message):
    q = np.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, np.zeros((1, 1, 3, 4)), np.zeros((1, 1, 3, 4)), bad)


@pytest.mark.parametrize("src, message", [
    (np.array([1, 2]), "src must have shape"),
    (np.array([[1.0, 2.0]]), "src must hold integer"),
    (np.array([[1, 99]]), "src holds token ids outside"),
    (np.ones((1, 65), dtype=int), "src length 65 exceeds max_len 64"),
])
def test_model_refuses_bad_tokens(src, message):
    model = Transformer(TINY, init_params(TINY))
    with pytest.raises(ValueError, match=message):
        model(src, np.array([[1, 3]]))


# ----------------------------------------------------------------------------- parameter counts

def paper_count(d_model, d_ff, layers, vocab):
    """Section 3 by hand: attention 4d^2 + 4d, FFN 2 d d_ff + d_ff + d, LayerNorm 2d, embeddings V d
    (one matrix shared by both embeddings and the pre-softmax projection)."""
    attention = 4 * d_model * d_model + 4 * d_model
    ffn = 2 * d_model * d_ff + d_ff + d_model
    norm = 2 * d_model
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    return layers * (encoder_layer + decoder_layer) + vocab * d_model


@pytest.mark.parametrize("preset, d_model, d_ff, table3_millions", [("base", 512, 2048, 65), ("big", 1024, 4096, 213)])
def test_parameter_counts_match_the_paper(preset, d_model, d_ff, table3_millions):
    config = TransformerConfig.preset(preset)
    assert (config.src_vocab_size, config.tgt_vocab_size, config.share_embeddings) == (37000, 37000, True)
    count = count_parameters(config)
    assert count == paper_count(d_model, d_ff, 6, 37000)
    assert abs(count - table3_millions * 1e6) <= 0.05 * table3_millions * 1e6


# ----------------------------------------------------------------------------- properties of attention

@settings(max_examples=60, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), tq=st.integers(1, 6), tk=st.integers(1, 6),
       d_k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), density=st.floats(0.0, 1.0))
def test_attention_weights_are_distributions_or_zero(batch, heads, tq, tk, d_k, seed, density):
    rng = np.random.default_rng(seed)
    q = 10 * rng.standard_normal((batch, heads, tq, d_k))
    k = 10 * rng.standard_normal((batch, heads, tk, d_k))
    v = rng.standard_normal((batch, heads, tk, d_k))
    mask = rng.random((batch, 1, tq, tk)) < density
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    assert np.all(weights[np.broadcast_to(~mask, weights.shape)] == 0)
    sums = weights.sum(-1)
    visible = np.broadcast_to(mask.any(-1), sums.shape)
    close64(sums[visible], np.ones(visible.sum()))
    assert np.all(sums[~visible] == 0) and np.all(out[~visible] == 0)


def test_reference_imports_no_framework():
    code = ("import sys, reference_numpy, equivalence.backends.numpy, equivalence.cases; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'jax', 'jaxlib', 'flax', 'tensorflow', 'keras')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_attention_weights_reproduce_the_layer_output():
    """The adapter's weights are the ones the layer uses: weights @ V (per head) and W^O give
    the self-attention sublayer's output."""
    from equivalence.backends import numpy as backend
    config = VARIANTS["pre_ln"]
    model = backend.build(config, init_params(config, seed=17, perturb=0.1))
    src, tgt = np.array([[5, 6, 7, 2, 0]]), np.array([[1, 8, 9]])
    weights = backend.attention_weights(model, src, tgt, 1, "encoder")
    stages = backend.forward(model, src, tgt)
    block = model.encoder.layers[1]
    h = block.self_attn_norm(stages["encoder.layers.0"])
    v = block.self_attn._split_heads(block.self_attn.v_proj(h))
    heads = (weights @ v).transpose(0, 2, 1, 3).reshape(1, 5, config.d_model)
    close64(block.self_attn.o_proj(heads), block.self_attn(h, h, h, padding_mask(src, config.pad_id)))
    assert np.all(weights[..., 4] == 0)                                    # the padded key


def test_attention_refuses_a_mask_that_would_enlarge_the_scores():
    """A (B, 1, 1, Tk) mask on 3-D (B, Tq, d_k) inputs would broadcast to (B, B, Tq, Tk)."""
    q = np.zeros((3, 2, 4))
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_dot_product_attention(q, np.zeros((3, 5, 4)), np.zeros((3, 5, 4)), np.ones((3, 1, 1, 5), bool))


@pytest.mark.parametrize("dtype", ["foo", "mixed_bfloat16", "int8", "float8_e4m3fn", "complex64", np.int32])
def test_a_dtype_outside_the_four_is_one_error(dtype):
    """float64, float32, bfloat16 and float16 are the model's precisions; anything else, a name NumPy does not know
    included, is one ValueError naming the four."""
    with pytest.raises(ValueError, match="dtype must be one of float64, float32, bfloat16, float16, got "):
        Transformer(TransformerConfig.preset("tiny"), init_params(TransformerConfig.preset("tiny")), dtype)
