"""The reference's answers that a run of a port is judged against (``compare``, ``export --check``, the device
check): a fixed batch of ordinary ids or the translated :data:`SENTENCES`, the float64 NumPy reference's stages and
greedy tokens on it, and for each lower precision the reference's own stages in it and the bound of its
log-probabilities (:mod:`equivalence.tolerance`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from equivalence import tolerance
from equivalence.backends import numpy as reference
from equivalence.margins import greedy_margins
from reference_numpy import TransformerConfig
from reference_numpy.tokenizer import Tokenizer
from transformer_hf.tokenizers import FamilyTokenizer

DTYPES = ("float64", "float32")   # the default; any of reference_numpy.precision.DTYPE_NAMES may be asked for
# What compare translates with a tokenizer: rules of French number words (et un/onze, quatre-vingt(s), cent(s))
SENTENCES = ("three hundred and twelve", "seventy-one thousand, two hundred", "eighty thousand and eighty",
             "nine hundred and ninety-nine thousand, nine hundred and ninety-one")


def non_finite_kind(array: np.ndarray) -> str | None:
    """"nan" if ``array`` holds a NaN, else "inf" if it holds an infinity, else None."""
    if np.isnan(array).any():
        return "nan"
    return "inf" if np.isinf(array).any() else None


def compare_inputs(config: TransformerConfig) -> dict[str, np.ndarray]:
    """A fixed batch of ids: two source sentences (the second padded) and their shifted targets."""
    rng = np.random.default_rng(2017)
    source_ids, target_ids = ordinary_ids(config)
    src = source_ids[rng.integers(0, len(source_ids), (2, 12))]
    tgt = target_ids[rng.integers(0, len(target_ids), (2, 10))]
    src[0, -1], src[1, 8] = config.eos_id, config.eos_id
    src[1, 9:] = config.pad_id
    tgt[:, 0] = config.bos_id
    tgt[1, 7:] = config.pad_id
    return {"src": src[:, :min(12, config.max_len)], "tgt": tgt[:, :min(10, config.max_len)]}


def ordinary_ids(config: TransformerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The source's and the target's ids that are none of pad, bos and eos: those above every special id, or, where
    a special id is the vocabulary's last (Marian's pad), every id but the special ones (the same draws for a
    vocabulary that starts with its special ids)."""
    special = (config.pad_id, config.bos_id, config.eos_id)
    first = max(special) + 1
    ids = lambda size: np.arange(first, size) if first < size else np.setdiff1d(np.arange(size), special)
    return ids(config.src_vocab_size), ids(config.tgt_vocab_size)


def translation_source(tokenizer: Tokenizer | FamilyTokenizer, config: TransformerConfig) -> np.ndarray | None:
    """:data:`SENTENCES` as source ids (B, S), or None if the tokenizer cannot encode them (another language) or
    they are longer than the model's ``max_len`` (a model of few positions, a tokenizer of short pieces): the
    comparison then runs on :func:`compare_inputs`."""
    try:
        src = tokenizer.batch(list(SENTENCES))
    except ValueError:
        return None
    return src if src.shape[1] <= config.max_len else None


@dataclass
class Oracle:
    """Everything the reference says about the inputs, computed once: the float64 truth, and for every other
    precision asked for, the reference's own stages in it (the yardstick of that precision's bound) and the bound
    of its log-probabilities along the float64 translation (for the token rule)."""

    inputs: dict[str, np.ndarray]   # src and tgt, the batch every run computes
    stages64: dict[str, np.ndarray]
    stages: dict[str, dict[str, np.ndarray]]    # precision -> the reference's stages in it
    greedy: np.ndarray
    greedy_margins: np.ndarray
    greedy_bounds: dict[str, float]             # precision -> bound of the log-probabilities
    stage_maps: dict                            # each stage as a map of earlier ones (tolerance.stage_maps)


def build_oracle(config: TransformerConfig, params: dict[str, np.ndarray], src: np.ndarray,
                 tgt: np.ndarray | None = None, dtypes: tuple[str, ...] = DTYPES) -> Oracle:
    """The reference's answers on ``src`` and ``tgt``; without ``tgt``, the target is the float64 reference's own
    greedy output shifted right (teacher forcing on its translation). The float64 reference's stages must be
    finite: a checkpoint that overflows even float64 leaves nothing to compare against (an input error). The
    reference in a lower precision may overflow; the runs in it then fail at that stage."""
    model64 = reference.build(config, params, "float64")
    tokens = reference.greedy(model64, src)
    forced = np.concatenate([np.full((len(tokens), 1), config.bos_id), tokens[:, :-1]], axis=1)
    inputs = {"src": src, "tgt": forced if tgt is None else tgt}
    stages64 = reference.forward(model64, **inputs)
    for name, stage in stages64.items():
        if non_finite_kind(stage):
            raise ValueError(f"the float64 reference itself gives {non_finite_kind(stage)} at stage {name}: "
                             "the checkpoint's weights are out of range, there is nothing to compare against")
    stages, bounds, log_probs64 = {}, {}, model64(src, forced)
    for dtype in dict.fromkeys(dtype for dtype in dtypes if dtype != "float64"):
        model = reference.build(config, params, dtype)
        stages[dtype] = reference.forward(model, **inputs)
        bounds[dtype] = tolerance.bound_for(dtype, log_probs64, reference.log_probs(model, src, forced))
    return Oracle(inputs, stages64, stages, tokens, greedy_margins(model64, src, tokens), bounds,
                  tolerance.stage_maps(model64, **inputs))


def greedy_verdict(tokens: np.ndarray, oracle: Oracle, dtype: str, pad_id: int) -> tuple[bool, str]:
    """float64: identical tokens. Lower precisions: identical up to each row's first near-tie (its bound)."""
    if dtype == "float64":
        return tokens.shape == oracle.greedy.shape and bool(np.array_equal(tokens, oracle.greedy)), ""
    agree, note, _ = tolerance.greedy_tokens_agree(tokens, oracle.greedy, oracle.greedy_margins,
                                                   oracle.greedy_bounds[dtype], pad_id)
    return agree, note
