"""A differential fuzzer over the configuration space: any :class:`TransformerConfig`, any inputs, every backend
against the reference under the one policy of :mod:`equivalence.tolerance` (``docs/equivalence.md``, "The
configuration space").

A :class:`Case` is a configuration (widths, head counts odd and even, one or two layers per side, pre- or post-LN,
either positional encoding and every sinusoidal layout (fairseq's from d_model 4), every feed-forward activation,
scaled or unscaled embeddings, a logits bias or none, shared or separate embeddings, vocabularies with the special
ids anywhere, tiny and large LayerNorm epsilons, and the decoding conventions: any start token, suppressed tokens,
forced eos, either length normalization with any alpha and every ``early_stopping``, a minimum output length,
n-gram blocking and a repetition penalty either way), seeded weights times a scale,
a batch (lengths 1..max_len, padding down to fully padded rows, explicit bool masks or the default ones, the token
ids' integer type), a forced first token or none and a beam size. :func:`check` runs one backend on it against the
reference: the forward stages in float64 and float32, greedy decoding and beam search in float64 (token for token
where the reference's margins decide, :mod:`.margins`), the loss, its gradient and one Adam step in float64. Where
the reference in a precision overflows, the backend must give the same non-finite values at the same places (NaN
where NaN, the same infinities) and agree on the rest.

Hypothesis draws the cases (:func:`cases`) and shrinks a failing one to a minimal :class:`Case`, whose
:meth:`Case.command` replays it: ``python scripts/fuzz_configs.py --replay '<json>'``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

import reference_numpy
from reference_numpy import decoding
from reference_numpy import training as reference_training
from reference_numpy.capture import capture_stages
from reference_numpy.config import (
    ACTIVATIONS,
    EARLY_STOPPING,
    LENGTH_NORMALIZATIONS,
    POSITIONAL_ENCODINGS,
    SINUSOIDAL_LAYOUTS,
    TrainingConfig,
    TransformerConfig,
)
from reference_numpy.model import Transformer

from . import margins, tolerance
from .cases import decoding_params
from .contract import Backend, Model
from .training_runs import Run, assert_float64_run, reference_run, weights_of

EPSILONS = (1e-12, 1e-8, 1e-6, 1e-3, 0.5)
WEIGHT_SCALES = (1e-3, 1.0, 1e3)            # the suite's; scripts/fuzz_configs.py --extreme adds 1e9 and 1e12
EXTREME_WEIGHT_SCALES = (1e9, 1e12)
TOKEN_DTYPES = ("int64", "int32", "int16", "uint8", "int8")
TRAINING = TrainingConfig(warmup_steps=4)
BEAM_SIZES = (2, 3)
REFERENCE = str(Path(reference_numpy.__file__).parent)   # the reference's files: where an overflow is located
MAX_LENGTH_PENALTY = 3.0        # alpha drawn in [0, 3]: the paper's 0.6, transformers' 1.0 and beyond
MIN_REPETITION_PENALTY = 0.25   # p drawn in [1/4, 4]: transformers' documented 1.2 and its inverse, and beyond


@dataclass(frozen=True)
class Case:
    """One point of the space: a configuration, its weights (:func:`params`: seeded, times ``weight_scale``) and a
    batch: per row the source and target lengths before padding (0: a fully padded row),
    the ids' seed, their integer type, and whether explicit random masks are passed instead of the default ones;
    the decoders' forced first token (``forced_bos_id``) and beam size. (A case recorded before the last two
    existed replays as it was: no forced token, beam size 2.)"""

    config: TransformerConfig
    seed: int
    weight_scale: float
    src_lengths: tuple[int, ...]
    tgt_lengths: tuple[int, ...]
    src_len: int
    tgt_len: int
    token_dtype: str
    explicit_masks: bool
    forced_bos_id: int | None = None
    beam_size: int = BEAM_SIZES[0]

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "config": self.config.to_dict()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Case:
        data = json.loads(text)
        return cls(**{**data, "config": TransformerConfig.from_dict(data["config"]),
                      "src_lengths": tuple(data["src_lengths"]), "tgt_lengths": tuple(data["tgt_lengths"])})

    def command(self, backend: str) -> str:
        """The shell command that replays this case on ``backend``."""
        return f"python scripts/fuzz_configs.py --backends {backend} --replay '{self.to_json()}'"


@st.composite
def configs(draw: st.DrawFn) -> TransformerConfig:
    """Any valid configuration of small sizes: odd and even head counts, d_k from 1, the special ids anywhere."""
    n_heads, d_k = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    d_k *= 1 + (n_heads * d_k) % 2                                       # d_model even (section 3.5)
    share = draw(st.booleans())
    src_vocab = draw(st.integers(3, 24))
    tgt_vocab = src_vocab if share else draw(st.integers(3, 24))
    pad, bos, eos = draw(st.permutations(range(min(src_vocab, tgt_vocab))))[:3]
    return TransformerConfig(
        src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab, d_model=n_heads * d_k, n_heads=n_heads,
        d_ff=draw(st.integers(1, 16)), n_encoder_layers=draw(st.integers(1, 2)),
        n_decoder_layers=draw(st.integers(1, 2)), dropout=0.0, layer_norm_eps=draw(st.sampled_from(EPSILONS)),
        norm_first=draw(st.booleans()), positional_encoding=draw(st.sampled_from(POSITIONAL_ENCODINGS)),
        max_len=draw(st.integers(1, 6)), share_embeddings=share, pad_id=pad, bos_id=bos, eos_id=eos)


@st.composite
def choices(draw: st.DrawFn, config: TransformerConfig) -> TransformerConfig:
    """``config`` with the choices of Hugging Face's families drawn: the activation, the sinusoidal layout
    (fairseq's from d_model 4), scaled embeddings or not, a logits bias or not, the embedding LayerNorm or not, a
    learned table's position offset (0 to 2). Drawn after everything else of a
    case, so that the cases drawn before these choices existed keep their sizes, ids and batches."""
    layouts = [layout for layout in SINUSOIDAL_LAYOUTS if layout != "fairseq" or config.d_model >= 4] \
        if config.positional_encoding == "sinusoidal" else ["interleaved"]
    config = config.replace(activation=draw(st.sampled_from(ACTIVATIONS)),
                            sinusoidal_layout=draw(st.sampled_from(layouts)), scale_embeddings=draw(st.booleans()),
                            output_bias=draw(st.booleans()))
    # the embedding LayerNorm and a learned table's rows before position 0 (BART's), drawn last of all
    offsets = st.integers(0, 2) if config.positional_encoding == "learned" else st.just(0)
    return config.replace(embedding_norm=draw(st.booleans()), position_offset=draw(offsets))


@st.composite
def cases(draw: st.DrawFn, weight_scales: tuple[float, ...] = WEIGHT_SCALES) -> Case:
    """A :class:`Case` drawn over :func:`configs`, weight scales, batch shapes, padding and mask patterns."""
    config = draw(configs())
    batch = draw(st.integers(1, 3))
    src_len, tgt_len = draw(st.integers(1, config.max_len)), draw(st.integers(1, config.max_len))
    lengths = lambda length: tuple(draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch)))
    fits = [name for name in TOKEN_DTYPES
            if np.iinfo(name).max >= max(config.src_vocab_size, config.tgt_vocab_size) - 1]
    case = Case(config, draw(st.integers(0, 2 ** 16)), draw(st.sampled_from(weight_scales)), lengths(src_len),
                lengths(tgt_len), src_len, tgt_len, draw(st.sampled_from(fits)), draw(st.booleans()))
    config = draw(conventions(draw(choices(config))))
    forcible = [token for token in range(config.tgt_vocab_size) if token not in (config.eos_id, config.pad_id)]
    case = dataclasses.replace(case, config=config, forced_bos_id=draw(st.none() | st.sampled_from(forcible)),
                               beam_size=draw(st.sampled_from(BEAM_SIZES)))
    return dataclasses.replace(case, config=draw(held_back(case.config)))


@st.composite
def held_back(draw: st.DrawFn, config: TransformerConfig) -> TransformerConfig:
    """``config`` with the rules that hold tokens back drawn (``reference_numpy/config.py``): the minimum output
    length (0, or up to two past ``max_len``), the n-gram size no hypothesis repeats (0, or 1 to 3) and the
    repetition penalty (1: none, or any p in [1/4, 4], above 1 holding repeats back, below favouring them). Drawn
    last of all, so that the cases drawn before these rules existed keep everything else."""
    return config.with_decoding(
        min_output_length=draw(st.just(0) | st.integers(1, config.max_len + 2)),
        no_repeat_ngram_size=draw(st.just(0) | st.integers(1, 3)),
        repetition_penalty=draw(st.just(1.0) | st.floats(MIN_REPETITION_PENALTY, 1 / MIN_REPETITION_PENALTY)))


@st.composite
def conventions(draw: st.DrawFn, config: TransformerConfig) -> TransformerConfig:
    """``config`` with the decoding conventions of Hugging Face's families drawn (``reference_numpy/config.py``):
    the start token (None: bos_id, or any target token), the suppressed tokens (None: pad_id and bos_id, or any set
    that leaves eos and at least one other token), their renormalization, forced eos (the token forced: None, eos,
    or any target token, suppressed ones included), the length normalization, alpha, for "hf" each
    ``early_stopping``, and the output budget (None: the source length + 50; or one for every sentence, up to two
    past ``max_len``, which caps it). Drawn after :func:`choices`, for the reason given there."""
    not_eos = [token for token in range(config.tgt_vocab_size) if token != config.eos_id]
    normalization = draw(st.sampled_from(LENGTH_NORMALIZATIONS))
    forced_eos = draw(st.booleans())
    return config.with_decoding(
        decoder_start_id=draw(st.none() | st.integers(0, config.tgt_vocab_size - 1)),
        suppressed_ids=draw(st.none() | st.lists(st.sampled_from(not_eos), unique=True, max_size=len(not_eos) - 1)),
        renormalize=draw(st.booleans()), forced_eos=forced_eos,
        forced_eos_id=draw(st.none() | st.integers(0, config.tgt_vocab_size - 1)) if forced_eos else None,
        length_normalization=normalization,
        length_penalty=draw(st.floats(0.0, MAX_LENGTH_PENALTY)),
        early_stopping=draw(st.sampled_from(EARLY_STOPPING)) if normalization == "hf" else False,
        max_output_length=draw(st.none() | st.integers(1, config.max_len + 2)))


def params(case: Case) -> dict[str, np.ndarray]:
    """The case's float64 weights in checkpoint layout: ``cases.decoding_params`` (seeded, biases and LayerNorms
    perturbed, the eos logit boosted so that decoding ends rows at different steps) times the weight scale."""
    return {name: value * case.weight_scale for name, value in decoding_params(case.config, case.seed).items()}


def inputs(case: Case) -> dict[str, np.ndarray | None]:
    """src (B, S) and tgt (B, T) of the case's integer type (any id, the special ones included, then pad_id past
    each row's length; tgt starts with bos_id where the row is not empty), labels (B, T) int64 (tgt shifted left,
    eos_id at each row's end, pad_id after), and the masks: None, or random bool (B, 1, 1, S) and (B, 1, T, T)."""
    config, rng = case.config, np.random.default_rng(case.seed)
    src = _padded(rng.integers(0, config.src_vocab_size, (len(case.src_lengths), case.src_len)),
                  case.src_lengths, config.pad_id)
    tgt = rng.integers(0, config.tgt_vocab_size, (len(case.tgt_lengths), case.tgt_len))
    tgt[:, 0] = config.bos_id
    tgt = _padded(tgt, case.tgt_lengths, config.pad_id)
    labels = np.concatenate([tgt[:, 1:], np.full((len(tgt), 1), config.pad_id)], axis=1)
    for row, length in enumerate(case.tgt_lengths):
        if length:
            labels[row, length - 1] = config.eos_id
    masks: dict[str, np.ndarray | None] = {"src_mask": None, "tgt_mask": None}
    if case.explicit_masks:
        masks = {"src_mask": rng.random((len(src), 1, 1, case.src_len)) < 0.7,
                 "tgt_mask": rng.random((len(tgt), 1, case.tgt_len, case.tgt_len)) < 0.7}
    dtype = np.dtype(case.token_dtype)
    return {"src": src.astype(dtype), "tgt": tgt.astype(dtype), "labels": labels.astype(np.int64), **masks}


def _padded(tokens: np.ndarray, lengths: tuple[int, ...], pad_id: int) -> np.ndarray:
    """``tokens`` with pad_id from each row's length on."""
    return np.where(np.arange(tokens.shape[1]) < np.array(lengths)[:, None], tokens, pad_id)


def check(case: Case, backend: Backend, not_compared: list[str] | None = None) -> list[str]:
    """The forward stages in float64 and float32, greedy and beam-search tokens (:func:`check_decoding`), the loss,
    its gradient and one Adam step in float64 of ``backend`` (an adapter of :mod:`equivalence.backends`) against the
    reference on ``case``; the disagreements found, each named (an empty list: the backend agrees). What the case
    leaves undefined -- a gradient that one rounding of the weights and activations moves by its whole scale
    (:func:`~.tolerance.gradient_determined`), a stage whose non-finite values an overflow leaves to the order of
    operations (:func:`_undetermined`), tokens after a near-tie of the reference's decoding -- is not compared, and
    said so in ``not_compared``."""
    weights, batch = params(case), inputs(case)
    found, not_compared = [], [] if not_compared is None else not_compared
    for precision in ("float64", "float32"):
        found += _forward(case, backend, weights, batch, precision, not_compared)
    model, ref64 = backend.build(case.config, weights), Transformer(case.config, weights)
    found += _decoding(case, backend, model, ref64, _labelled(batch)[0], not_compared)
    return found + _training(case, backend, model, ref64, _labelled(batch), not_compared)


def check_decoding(case: Case, backend: Backend, not_compared: list[str] | None = None) -> list[str]:
    """Greedy decoding and beam search (``case.beam_size``, the config's alpha) with ``case.forced_bos_id``, in
    float64, against the reference: greedy tokens identical up to each row's first near-tie, beam rows without one
    identical with scores within L x the float64 bound (:func:`~.tolerance.greedy_tokens_agree`,
    :func:`~.tolerance.beam_row_is_decisive`), the bound being float64's at the scale of the log-probabilities the
    reference's decoding read (:mod:`.margins`). The disagreements found; the rows or steps left undecided by a
    near-tie are said in ``not_compared``."""
    weights = params(case)
    model, ref64 = backend.build(case.config, weights), Transformer(case.config, weights)
    return _decoding(case, backend, model, ref64, _labelled(inputs(case))[0],
                     [] if not_compared is None else not_compared)


def _decoding(case: Case, backend: Backend, model: Model, ref64: Transformer, src: np.ndarray,
              not_compared: list[str]) -> list[str]:
    """:func:`check_decoding` on the case's models, already built (:func:`check` builds them once for decoding and
    training)."""
    forced, found = case.forced_bos_id, []
    with np.errstate(all="ignore"):
        greedy = decoding.greedy_decode(ref64, src, forced_bos_id=forced)
        greedy_decisions = margins.greedy_decisions(ref64, src, greedy, forced)
        beam_tokens, beam_scores = decoding.beam_search(ref64, src, case.beam_size, forced_bos_id=forced)
        beam_decisions = margins.beam_decisions(ref64, src, case.beam_size, forced_bos_id=forced)
    agree, note, _ = tolerance.greedy_tokens_agree(
        np.asarray(backend.greedy(model, src, forced_bos_id=forced)), greedy, np.asarray(greedy_decisions.margins),
        tolerance.float64_bound(greedy_decisions.scale), case.config.pad_id)
    found += [] if agree else [f"greedy float64: {note}"]
    not_compared += [f"greedy float64: {note}"] if agree and note else []
    tokens, scores = backend.beam(model, src, case.beam_size, forced_bos_id=forced)
    for row, (row_margins, scale) in enumerate(beam_decisions):
        bound = tolerance.float64_bound(scale)        # each log-probability's; a score sums at most L of them / lp >= 1
        if not tolerance.beam_row_is_decisive(list(row_margins), bound):
            not_compared.append(f"beam float64: row {row}: the reference's search has a near-tie")
        elif not tolerance.same_tokens(tokens[row], beam_tokens[row], case.config.pad_id):
            found.append(f"beam float64: row {row}: tokens {tokens[row].tolist()}, the reference's "
                         f"{beam_tokens[row].tolist()}")
        elif scores[row] != beam_scores[row] and not (                   # equal infinities agree: no hypothesis
                abs(scores[row] - beam_scores[row]) <= (len(row_margins) - 1) * bound):
            found.append(f"beam float64: row {row}: score {scores[row]!r}, the reference's {beam_scores[row]!r}")
    return found


Labelled = tuple[np.ndarray, np.ndarray, np.ndarray]     # src, tgt and labels: what the loss and training read
Arguments = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]   # src, tgt, src_mask, tgt_mask


def _labelled(batch: dict[str, np.ndarray | None]) -> Labelled:
    src, tgt, labels = batch["src"], batch["tgt"], batch["labels"]
    if src is None or tgt is None or labels is None:
        raise ValueError("a training batch needs src, tgt and labels")
    return src, tgt, labels


def _training(case: Case, backend: Backend, model: Model, ref64: Transformer, training: Labelled,
              not_compared: list[str]) -> list[str]:
    """The loss (or the reference's refusal), its gradient and one Adam step in float64, where they are defined."""
    try:
        with np.errstate(all="ignore"):
            value = float(reference_training.loss(ref64, *training))
    except ValueError as err:                               # e.g. labels all padding: the same refusal everywhere
        return _same_refusal(str(err), lambda: backend.loss(model, *training))
    if not np.isfinite(value):
        not_compared.append(f"gradients and the Adam step float64: the reference's loss overflows ({value})")
        return []
    _, ref_grads = reference_training.gradients(ref64, *training)
    sensitivity = tolerance.rounding_sensitivity(
        lambda changed: reference_training.gradients(Transformer(ref64.config, changed), *training)[1],
        weights_of(ref64))
    if not tolerance.gradient_determined(ref_grads, sensitivity):
        scale = max(float(np.max(np.abs(grad))) for grad in ref_grads.values())
        not_compared.append(f"gradients and the Adam step float64: undetermined (one rounding of the weights and "
                            f"activations moves the reference's gradient by {sensitivity:.1e}, its scale is "
                            f"{scale:.1e})")
        return []
    found = _gradients(backend, model, ref64, training, sensitivity)
    return found + _training_step(case, backend, training, sensitivity)


def _same_refusal(message: str, call: Callable[[], object]) -> list[str]:
    """[] if ``call`` raises ValueError(``message``), the reference's refusal; else what it did."""
    try:
        call()
    except ValueError as err:
        return [] if str(err) == message else [f"refused with {str(err)!r}, the reference with {message!r}"]
    return [f"accepted what the reference refuses ({message!r})"]


def _forward(case: Case, backend: Backend, weights: dict[str, np.ndarray], batch: dict[str, np.ndarray | None],
             precision: str, not_compared: list[str]) -> list[str]:
    """The forward stages in ``precision`` against the float64 reference (and the reference in ``precision``).
    A stage left undetermined by an overflow (:func:`_undetermined`) is not compared, and said so."""
    src, tgt, _ = _labelled(batch)
    arguments: Arguments = (src, tgt, batch["src_mask"], batch["tgt_mask"])
    model64 = Transformer(case.config, weights)
    with np.errstate(all="ignore"):
        ref64 = _stages(model64, arguments)
    same, sites = _overflow_sites(Transformer(case.config, weights, np.dtype(precision)), arguments)
    out = backend.forward(backend.build(case.config, weights, precision), *arguments)
    found, maps = [], tolerance.stage_maps(model64, src, tgt, batch["src_mask"], batch["tgt_mask"])
    for name in ref64:
        port = np.asarray(out[name])
        if note := _undetermined(port, same[name], sites, precision):
            not_compared.append(f"forward {precision}: {name}: {note}: which value an overflowed product takes (an "
                                "infinity of either sign or NaN) is its order of operations' choice")
        elif problem := disagreement(port, ref64[name], same[name], precision, maps.get(name), out,
                                         same):
            found.append(f"forward {precision}: {name}: {problem}")
    return found


def _stages(model: Transformer, arguments: Arguments) -> dict[str, np.ndarray]:
    """Every stage of the reference's forward pass, by the shared stage names."""
    return capture_stages(model, *arguments)[1]


# Where the reference's Eq. (1) meets its scores' overflow: its products Q K^T and weights . V, computed by
# reference_numpy.precision.attention_product (the innermost reference function on the stack, _overflow_sites).
EQ1_SITES = {"attention_product"}


def _undetermined(port: np.ndarray, same: np.ndarray, sites: set[str], precision: str) -> str | None:
    """Why ``port``'s stage departs from the reference's ``same`` (in ``precision``; ``sites``: where the reference's
    pass overflows, :func:`_overflow_sites`) only where an overflow leaves the values undetermined, or None (the
    stage is compared). Two departures are the overflow's:

    * non-finite values where the reference's are finite (:func:`_hidden_overflow`), after an overflow anywhere;
    * finite values where the reference's are not, when every overflow or invalid operation of the reference's
      pass is in Eq. (1): a score q.k past the format's range is an infinity of either sign or NaN as the order of
      its multiply-adds falls (-2.9e48, -2.5e47 and 2.6e47 exactly, NaN in the reference's float32 and -inf in
      XLA's fused multiply-adds, which then reads as a masked position). An overflow elsewhere too (a LayerNorm's
      variance past 1e38: NaN in every backend) keeps the stage compared, so that a backend hiding it is found."""
    if _hidden_overflow(port, same, sites):
        return f"non-finite where the reference in {precision} is finite, after an operation that overflows"
    if (np.isfinite(port) & ~np.isfinite(same)).any() and sites == EQ1_SITES:
        return f"finite where the reference in {precision} is not, after Eq. (1)'s scores overflow (nothing else does)"
    return None


def _hidden_overflow(port: np.ndarray, same: np.ndarray, sites: set[str]) -> bool:
    """Whether ``port``'s stage departs from the reference's ``same`` only by non-finite values where the reference
    is finite, while the reference's pass overflows in some operation (``sites``, :func:`_overflow_sites`): e.g. a
    float32 score q.k of 1.6e47 summed from terms past float32's range is -inf in NumPy's order of fused
    multiply-adds and NaN in PyTorch's and TensorFlow's kernels, and the reference's -inf then reads as a masked
    position. A backend finite where the reference is not is not excused here (an overflow the reference shows)."""
    shown = ~np.isfinite(same)
    extra = ~np.isfinite(port) & ~shown
    return bool(extra.any() and np.array_equal(port[shown], same[shown], equal_nan=True) and sites)


def _overflow_sites(model: Transformer, arguments: Arguments) -> tuple[dict[str, np.ndarray], set[str]]:
    """The stages of the reference ``model``'s forward pass (:func:`_stages`), and the reference's functions in which
    that pass overflows or meets an invalid operation (each the innermost function of :mod:`reference_numpy` on the
    stack when NumPy reports it)."""
    sites: set[str] = set()

    def record(_kind: str, _flag: int) -> None:
        frame = sys._getframe(1)
        while frame.f_back is not None and not frame.f_code.co_filename.startswith(REFERENCE):
            frame = frame.f_back
        sites.add(frame.f_code.co_qualname)

    with np.errstate(all="ignore", over="call", invalid="call", call=record):
        stages = _stages(model, arguments)
    return stages, sites


def disagreement(port: np.ndarray, ref64: np.ndarray, same: np.ndarray, precision: str,
                 step: Callable[[tolerance.Stages], np.ndarray] | None = None,
                 port_stages: tolerance.Stages | None = None,
                 same_stages: tolerance.Stages | None = None) -> str | None:
    """What is wrong with ``port`` (in ``precision``) against the float64 reference ``ref64`` and the reference in
    ``precision`` ``same``, or None: the non-finite values of ``same`` exactly (NaN where NaN, infinities of the
    same sign), and the policy's bound on the entries every one of the three has finite (for a stage that is a map
    ``step`` of earlier ones, :func:`~.tolerance.stage_agreement`, given the backend's and the reference's stages)."""
    if not _same(np.isnan(port), np.isnan(same)) or not _same(np.where(np.isinf(port), port, 0),
                                                             np.where(np.isinf(same), same, 0)):
        return (f"non-finite values differ (the reference in {precision}: {int(np.sum(~np.isfinite(same)))}, "
                f"the backend: {int(np.sum(~np.isfinite(port)))})")
    finite = np.isfinite(port) & np.isfinite(ref64) & np.isfinite(same)
    if not finite.any():
        return None
    with np.errstate(all="ignore"):
        result = tolerance.stage_agreement(port, ref64, same, precision, step, port_stages, same_stages,
                                           where=finite)
    return None if result.ok else str(result)


def _gradients(backend: Backend, model: Model, ref64: Transformer, training: Labelled, sensitivity: float) -> list[str]:
    value, grads = backend.gradients(model, *training)
    ref_value, ref_grads = reference_training.gradients(ref64, *training)
    found = [] if abs(value - ref_value) <= tolerance.float64_bound(ref_value) else [
        f"loss float64: {value!r} vs the reference's {ref_value!r}"]
    bound = tolerance.gradient_bound(ref_grads, grads, sensitivity)
    return found + [f"gradients float64: {name}: max abs error {tolerance.max_abs(grads[name], grad):.3e} > bound "
                    f"{bound:.3e}" for name, grad in ref_grads.items()
                    if not tolerance.max_abs(grads[name], grad) <= bound]


def _training_step(case: Case, backend: Backend, training: Labelled, sensitivity: float) -> list[str]:
    """One Adam step (section 5.3) within :class:`tolerance.TrainingBound` of the reference's, its gradient bound
    taking the reference's ``sensitivity`` at the weights into account (each run from its own copy of the weights:
    the reference's Adam updates its arrays in place)."""
    batch = dict(zip(("src", "tgt", "labels"), training))
    expected, bound = reference_run(case.config, params(case), TRAINING, [batch], sensitivities=[sensitivity])
    model = backend.build(case.config, params(case))
    optimizer = backend.optimizer(model, TRAINING)
    losses = [backend.train_step(model, optimizer, *training)]
    result = Run(losses, backend.export_params(model), backend.training_state(model, optimizer))
    try:
        assert_float64_run(result, expected, bound, "training step float64")
    except AssertionError as err:
        return [str(err)]
    return []


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))
