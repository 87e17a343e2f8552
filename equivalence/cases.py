"""The shared matrix of agreement cases: config variants x mask cases, with seeded inputs.

Every port's tests (and the ``compare`` command) draw their inputs from here, so that all
backends are checked on exactly the same numbers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from reference_numpy.checkpoint import init_params
from reference_numpy.config import TransformerConfig
from reference_numpy.model import causal_mask
from reference_numpy.precision import round_to

_TINY = TransformerConfig.preset("tiny")

VARIANTS: dict[str, TransformerConfig] = {
    "tiny": _TINY,
    "pre_ln": _TINY.replace(norm_first=True),
    "learned_pe": _TINY.replace(positional_encoding="learned"),
    "shared_embeddings": _TINY.replace(src_vocab_size=_TINY.tgt_vocab_size, share_embeddings=True),
}

# VARIANTS plus a config away from every framework's LayerNorm default (torch 1e-5, Flax 1e-6,
# Keras 1e-3), pre-LN so that the final norms of both stacks use it too: a default or misplaced
# epsilon anywhere moves outputs by ~1e-3, far over either bound. The agreement matrix runs it
# in its forward-pass checks (components, stages, attention weights); a full variant (decoding,
# port pairs, gradients, per-port tests) would run the suite's slowest checks once more for a config
# that differs only in its epsilon.
#
# And the choices of Hugging Face's families (docs/reference.md, "The configuration"), each in at least one
# variant of the forward matrix: "marian" is Marian/opus-mt's (post-LN, SiLU, the sinusoid in halves, a bias on the
# logits; and its decoding conventions: start from pad, pad alone suppressed and the rest renormalized, one budget of
# 12 tokens for every sentence (transformers' max_new_tokens; the paper's source length + 50 gives the decoding
# batch's rows 52-57), a token forced at its end -- not eos: token 4, as a Marian config whose eos is not 0 forces
# id 0 (forced_eos_id; opus-mt's files force their eos) --, transformers' |Y|^1 beam scores); "fairseq" the
# M2M100/NLLB lineage's (pre-LN, fairseq's sinusoid, whose positions skip the padding of the ragged and fully masked
# rows), with GELU and unscaled embeddings, the remaining choices; "bart" the BART/mBART lineage's (learned positions
# read from row t + 2 of a table of max_len + 2 rows, a LayerNorm of the embeddings plus positions before each
# stack, GELU, unscaled embeddings, a bias on the logits). Their decoding, gradients and training are
# tests/families/test_config_choices.py's.
FORWARD_VARIANTS: dict[str, TransformerConfig] = {
    **VARIANTS,
    "layer_norm_eps": _TINY.replace(norm_first=True, layer_norm_eps=1e-2),
    "marian": _TINY.replace(activation="silu", sinusoidal_layout="halves", output_bias=True).with_decoding(
        decoder_start_id=_TINY.pad_id, suppressed_ids=(_TINY.pad_id,), renormalize=True, max_output_length=12,
        forced_eos=True, forced_eos_id=4, length_normalization="hf", length_penalty=1.0),
    "fairseq": _TINY.replace(norm_first=True, activation="gelu", sinusoidal_layout="fairseq",
                             scale_embeddings=False),
    "bart": _TINY.replace(positional_encoding="learned", position_offset=2, embedding_norm=True, activation="gelu",
                          scale_embeddings=False, output_bias=True),
}
# The variants of Hugging Face's choices, by name (a subset of FORWARD_VARIANTS).
CHOICE_VARIANTS = ("marian", "fairseq", "bart")

MASK_CASES = ("none", "causal", "source_padding", "ragged_batch", "fully_masked_row")

# Perturbation of biases and LayerNorm parameters in test checkpoints (see init_params).
TEST_PERTURB = 0.1
# Scale of the eos column of the output projection in decoding checkpoints: with it the seeded
# tiny models end some sequences with eos and run others to the maximum length.
EOS_BOOST = 2.0
BATCH, SRC_LEN, TGT_LEN = 3, 7, 6


def seeded_params(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float64 weights with perturbed biases and LayerNorm parameters."""
    return init_params(config, seed, perturb=TEST_PERTURB)


def decoding_params(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """:func:`seeded_params` with the eos logit weights scaled by ``EOS_BOOST`` (sequences of mixed lengths)."""
    params = seeded_params(config, seed)
    if config.share_embeddings:
        params["shared_embed.weight"][config.eos_id, :] *= EOS_BOOST
    else:
        params["generator.weight"][:, config.eos_id] *= EOS_BOOST
    return params


PARAMS = {"seeded": seeded_params, "decoding": decoding_params}


def _lengths(case: str, length: int) -> list[int]:
    """Real (non-pad) length of each batch row for a mask case."""
    return {
        "source_padding": [length - 2] * BATCH,
        "ragged_batch": [length, length - 3, 2],
        "fully_masked_row": [length, 0, length - 1],
    }.get(case, [length] * BATCH)


def _length_mask(lengths: list[int], length: int) -> np.ndarray:
    return np.arange(length)[None, :] < np.array(lengths)[:, None]            # (B, T)


def attention_inputs(config: TransformerConfig, case: str, dtype: npt.DTypeLike = np.float64,
                     seed: int = 0) -> dict[str, np.ndarray | None]:
    """query (B, Tq, D), key and value (B, Tk, D) and a bool mask for one mask case.

    ``causal`` uses Tq = Tk; every other case attends from TGT_LEN queries to SRC_LEN keys
    through a key padding mask (B, 1, 1, Tk); ``fully_masked_row`` leaves batch row 1 with no key.
    """
    query, key, value, mask = _attention_tensors(config, case, dtype, seed)
    return {"query": query, "key": key, "value": value, "mask": mask}


def _attention_tensors(config: TransformerConfig, case: str, dtype: npt.DTypeLike,
                       seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`attention_inputs`' query, key, value and mask."""
    _check_case(case)
    rng = np.random.default_rng(seed)
    tk = TGT_LEN if case == "causal" else SRC_LEN
    query = rng.standard_normal((BATCH, TGT_LEN, config.d_model))
    key = rng.standard_normal((BATCH, tk, config.d_model))
    value = rng.standard_normal((BATCH, tk, config.d_model))
    if case == "none":
        mask = None
    elif case == "causal":
        mask = causal_mask(TGT_LEN)
    else:
        mask = _length_mask(_lengths(case, tk), tk)[:, None, None, :]
    return query.astype(dtype), key.astype(dtype), value.astype(dtype), mask


COMPONENT_MASKED = {"attention": True, "multi_head_attention": True, "positional_encoding": False,
                    "feed_forward": False, "layer_norm": False, "encoder_layer": True, "decoder_layer": True,
                    "encoder": True, "decoder": True, "generator": False}

# The common offset of :func:`layer_norm_offset_inputs`: a one-pass variance E[x^2] - E[x]^2 subtracts
# two numbers near 1e8 (float32 ulp 8) to find a variance near 1, and loses every digit of it.
LAYER_NORM_OFFSET = 1e4


def component_inputs(config: TransformerConfig, component: str, case: str, dtype: npt.DTypeLike = np.float64,
                     seed: int = 0) -> dict[str, np.ndarray | None]:
    """Inputs of one component (see ``backend.component``) for a mask case.

    ``attention`` (Eq. 1 alone) gets per-head tensors (B, H, T, d_k); ``multi_head_attention``
    gets (B, T, D) like every other component.
    Encoder side: x (B, S, D) and a self-attention mask (None, causal (1, 1, S, S) or key
    padding (B, 1, 1, S)). Decoder side: x (B, T, D), memory (B, S, D), src_mask (key padding
    or None) and tgt_mask (causal, or None for ``none``). Unmasked components ignore ``case``.
    """
    if component not in COMPONENT_MASKED:
        raise ValueError(f"unknown component {component!r}; choose one of {tuple(COMPONENT_MASKED)}")
    if component == "multi_head_attention":
        return attention_inputs(config, case, dtype, seed)
    if component == "attention":                                      # one tensor per head: (B, H, T, d_k)
        *tensors, mask = _attention_tensors(config, case, dtype, seed)
        heads = [tensor.reshape(*tensor.shape[:2], config.n_heads, config.d_k).transpose(0, 2, 1, 3)
                 for tensor in tensors]
        return {**dict(zip(("query", "key", "value"), heads)), "mask": mask}
    _check_case(case)
    rng = np.random.default_rng(seed)
    x_len = TGT_LEN if component.startswith("decoder") else SRC_LEN
    x = rng.standard_normal((BATCH, x_len, config.d_model)).astype(dtype)
    if not COMPONENT_MASKED[component]:
        return {"x": x}
    key_padding = (None if case in ("none", "causal")
                   else _length_mask(_lengths(case, SRC_LEN), SRC_LEN)[:, None, None, :])
    if component.startswith("encoder"):
        return {"x": x, "mask": causal_mask(SRC_LEN) if case == "causal" else key_padding}
    memory = rng.standard_normal((BATCH, SRC_LEN, config.d_model)).astype(dtype)
    return {"x": x, "memory": memory, "src_mask": key_padding,
            "tgt_mask": None if case == "none" else causal_mask(TGT_LEN)}


# The queries of the low-precision attention checks are scaled by this: scores of ~10 rather than ~1 (trained models'
# attention is sharp), so that a softmax computed in bfloat16 or float16 instead of wide rounds each score by more
# than the recipe's one rounding of the output.
SHARP_QUERIES = 4.0


def low_precision_component_inputs(config: TransformerConfig, component: str, case: str,
                                   dtype: npt.DTypeLike) -> dict[str, np.ndarray | None]:
    """:func:`component_inputs` rounded to the low format ``dtype`` (float64 arrays holding numbers of ``dtype``),
    the attention components' queries scaled by ``SHARP_QUERIES`` first."""
    inputs = component_inputs(config, component, case)
    query = inputs.get("query")
    if component in ("attention", "multi_head_attention") and query is not None:
        inputs["query"] = query * SHARP_QUERIES
    return {name: value if value is None or value.dtype == bool else round_to(value, dtype).astype(np.float64)
            for name, value in inputs.items()}


def layer_norm_offset_inputs(config: TransformerConfig, dtype: npt.DTypeLike = np.float64,
                             seed: int = 0) -> dict[str, np.ndarray]:
    """x (B, S, D) = LAYER_NORM_OFFSET + N(0, 1) for the ``layer_norm`` component, rounded to
    float32 so that every dtype sees the same numbers and float32's error is the computation's alone."""
    rng = np.random.default_rng(seed)
    x = LAYER_NORM_OFFSET + rng.standard_normal((BATCH, SRC_LEN, config.d_model))
    return {"x": x.astype(np.float32).astype(dtype)}


def model_inputs(config: TransformerConfig, case: str, seed: int = 0) -> dict[str, np.ndarray | None]:
    """src (B, S), tgt (B, T) and masks for the full model in one mask case.

    ``none`` passes explicit all-True masks (so even the decoder attends everywhere: this
    checks that explicit masks are honoured); the other cases pass ``None`` and let the model
    build its defaults (source padding; causal + target padding). ``ragged_batch`` pads source
    and target rows to different lengths; ``fully_masked_row`` has a source row of padding only.
    """
    _check_case(case)
    src, tgt = _token_ids(config, case, seed)
    src_mask = tgt_mask = None
    if case == "none":
        src_mask = np.ones((BATCH, 1, 1, SRC_LEN), dtype=bool)
        tgt_mask = np.ones((BATCH, 1, TGT_LEN, TGT_LEN), dtype=bool)
    return {"src": src, "tgt": tgt, "src_mask": src_mask, "tgt_mask": tgt_mask}


def _token_ids(config: TransformerConfig, case: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`model_inputs`' src and tgt."""
    rng = np.random.default_rng(seed)
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(first, config.src_vocab_size, size=(BATCH, SRC_LEN))
    tgt = rng.integers(first, config.tgt_vocab_size, size=(BATCH, TGT_LEN))
    tgt[:, 0] = config.bos_id
    src = np.where(_length_mask(_lengths(case, SRC_LEN), SRC_LEN), src, config.pad_id)
    if case == "ragged_batch":
        tgt = np.where(_length_mask([TGT_LEN, 3, TGT_LEN - 1], TGT_LEN), tgt, config.pad_id)
    return src, tgt


def training_inputs(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """A ragged batch for the training loss: src (B, S), tgt (B, T) = bos + labels shifted right,
    labels (B, T) ending in eos and padded."""
    src, tgt = _token_ids(config, "ragged_batch", seed)                       # model_inputs' ragged batch
    lengths = (tgt != config.pad_id).sum(axis=1)                               # bos + tokens
    labels = np.concatenate([tgt[:, 1:], np.full((BATCH, 1), config.pad_id)], axis=1)
    labels[np.arange(BATCH), lengths - 1] = config.eos_id
    return {"src": src, "tgt": tgt, "labels": labels}


def decoding_inputs(config: TransformerConfig, seed: int = 0) -> np.ndarray:
    """A ragged batch of source sentences ending in eos, for greedy and beam search. Shape (B, S)."""
    rng = np.random.default_rng(seed)
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(first, config.src_vocab_size, size=(BATCH, SRC_LEN))
    lengths = np.array(_lengths("ragged_batch", SRC_LEN))
    src[np.arange(BATCH), lengths - 1] = config.eos_id
    return np.where(_length_mask(list(lengths), SRC_LEN), src, config.pad_id)


def _check_case(case: str) -> None:
    if case not in MASK_CASES:
        raise ValueError(f"unknown mask case {case!r}; choose one of {MASK_CASES}")
