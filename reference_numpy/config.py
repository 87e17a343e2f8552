"""One frozen configuration shared by the reference and every port: the architecture (:class:`TransformerConfig`:
Table 3 and the variants) holding the decoding (:class:`DecodingConfig`: section 6.1 and the further decoding rules
of ``reference_numpy/decoding.py``) as its field ``decoding``. A checkpoint's header holds both as one flat JSON object
(:meth:`TransformerConfig.to_dict`, :meth:`TransformerConfig.from_dict`; docs/checkpoint-format.md).

Presets follow Table 3 of "Attention Is All You Need" (Vaswani et al., 2017):
``base`` (N=6, d_model=512, d_ff=2048, h=8) and ``big`` (N=6, d_model=1024,
d_ff=4096, h=16), both with the shared ~37,000-token source/target BPE
vocabulary of the WMT 2014 English-German task (section 5.1), and a ``tiny``
preset for fast tests.

Each variant and decoding rule is described here by what it computes; which imported models use it, and which of
their fields sets it: docs/huggingface.md, "Where the reference's variants come from".
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np

POSITIONAL_ENCODINGS = ("sinusoidal", "learned")
# The feed-forward network's activation (section 3.3's ReLU; SiLU and the exact GELU are variants).
ACTIVATIONS = ("relu", "silu", "gelu")
# How the sinusoidal table lays out its sines and cosines (section 3.5's interleaved pairs; halves: every sine first,
# then every cosine; "fairseq": halves over other frequencies, at positions that skip pads).
SINUSOIDAL_LAYOUTS = ("interleaved", "halves", "fairseq")
# How beam search normalizes a hypothesis's log-probability by its length, and which bookkeeping it follows
# (reference_numpy/decoding.py): "gnmt", section 6.1's ((5 + |Y|) / 6)^alpha (Wu et al., 2016) with this project's
# exact stopping rule; "hf", |Y|^alpha, keeping ``beam_size`` finished hypotheses and stopping by ``early_stopping``.
LENGTH_NORMALIZATIONS = ("gnmt", "hf")
# When an "hf" beam search with ``beam_size`` finished hypotheses stops (reference_numpy/decoding.py): at once (True),
# when no live beam can beat the worst kept one at the current length (False) or at the maximum length ("never")
EARLY_STOPPING = (False, True, "never")
LENGTH_PENALTY_ALPHA = 0.6  # section 6.1: beam search's length penalty alpha, the default of ``length_penalty``
MAX_BEAM_SIZE = 64          # the widest beam a checkpoint's ``beam_size`` or a command's --beam may ask for
# The longest wavelength of the sinusoidal encoding is 10000 * 2 pi ~ 62,832 positions (section 3.5):
# the encoding is designed for positions below it, and 2^16 is the next power of two. It also bounds
# the (max_len, d_model) position tables, allocated at construction: 512 MiB each for ``big`` in float64.
MAX_LEN_LIMIT = 2 ** 16


class _Config:
    """What both configs share: validated copies and the JSON round trip of the checkpoint's metadata."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]   # each subclass is a dataclass

    def _store(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen; this runs once, in __post_init__

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (validated like a new config)."""
        _check_field_names(type(self), changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        _check_field_names(cls, data)
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> Self:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config is not valid JSON: {err}") from None
        return cls.from_dict(data)


@dataclass(frozen=True)
class DecodingConfig(_Config):
    """How the model decodes (``reference_numpy/decoding.py``): section 6.1's beam search and budget by default, and
    the further rules an imported model may set (docs/huggingface.md says which field of which file sets each).
    Each field is checked on its own here; against the model (its vocabulary and special ids) by the
    :class:`TransformerConfig` that holds it.

    Attributes:
        decoder_start_id: the token the decoder starts from (pad or eos, say); None is ``bos_id``. The decoder
            masks no target position in decoding (the causal mask alone), so a start token equal to pad is read
            like any other token.
        suppressed_ids: the tokens decoding never produces (their log-probabilities are -inf: pad alone, say);
            None is (pad_id, bos_id), the paper's.
        renormalize: after the suppressed tokens' -inf (and before forcing a token), each step's log-probabilities
            are normalized again over the tokens left, log p - log(sum of the p left) (the same as leaving the
            suppressed tokens out of the softmax); False keeps them as the softmax gave them (section 6.1, the paper's).
            Greedy tokens are the same either way; beam scores and so beam search's choices are not.
        max_output_length: the output budget of every sentence, eos included, the start token not; None is
            section 6.1's, the sentence's non-pad source length + 50. Either is capped at ``max_len``.
        forced_eos: the last token of the output budget is forced: ``forced_last_id``.
        forced_eos_id: the token ``forced_eos`` forces, when it is not eos (a fixed id, whatever the model's eos);
            None is ``eos_id``.
        length_normalization: beam search's "gnmt" (section 6.1: ((5 + |Y|) / 6)^alpha and an exact stopping rule)
            or "hf" (|Y|^alpha, ``beam_size`` finished hypotheses kept, ``early_stopping``'s rule).
        length_penalty: beam search's alpha when a call gives none (0.6, section 6.1).
        early_stopping: when an "hf" beam search stops once ``beam_size`` hypotheses have finished (False, True or
            "never"; ``EARLY_STOPPING``), for "hf" only.
        beam_size: the beam the decoding commands (``translate``, ``evaluate``) use when given none: 1 is greedy
            decoding, the default (section 6.1 uses 4).
        min_output_length: eos is not emitted at an output step below it (its log-probability -inf; step 1 is the
            first output token, so an output holds at least ``min_output_length`` tokens, eos included, unless its
            budget ends it first). 0 (the default) and 1 hold nothing back.
        no_repeat_ngram_size: n > 0: a token that would complete an n-gram already in the hypothesis (the start
            token and the tokens so far) is not emitted; 0, the default, bans nothing.
        forced_bos_id: the first output token every decoding call forces when it is given none (a call's
            ``forced_bos_id``, e.g. ``translate --target-lang``'s language code, takes precedence): a target token
            other than eos and pad; None forces nothing.
        repetition_penalty: p > 0: at each step the score of every token already in the hypothesis (the start token
            and the tokens so far) is divided by p where it is > 0 and multiplied by p where it is < 0, before any
            other rule (p > 1 holds repeats back, p < 1 favours them); greedy decoding penalizes the generator's
            logits, beam search its log-probabilities (``reference_numpy/decoding.py``); 1.0, the default, changes
            nothing.
    """

    decoder_start_id: int | None = None
    suppressed_ids: tuple[int, ...] | None = None
    renormalize: bool = False
    max_output_length: int | None = None
    forced_eos: bool = False
    forced_eos_id: int | None = None
    length_normalization: str = "gnmt"
    length_penalty: float = LENGTH_PENALTY_ALPHA
    early_stopping: bool | str = False
    beam_size: int = 1
    min_output_length: int = 0
    no_repeat_ngram_size: int = 0
    forced_bos_id: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        """Validate every field; NumPy scalars are accepted and stored as the Python values they equal,
        ``suppressed_ids`` as a tuple."""
        for name in ("forced_eos", "renormalize"):
            self._store(name, _as_bool(name, getattr(self, name)))
        self._store("length_penalty", _as_float("length_penalty", self.length_penalty))
        penalty = self.repetition_penalty
        if not isinstance(penalty, numbers.Real) or isinstance(penalty, (bool, np.bool_)) or not 0 < penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {penalty!r}")
        self._store("repetition_penalty", float(penalty))
        for name in ("decoder_start_id", "forced_eos_id", "forced_bos_id"):
            if getattr(self, name) is not None:
                self._store(name, _as_int(name, getattr(self, name), minimum=0))
        if self.suppressed_ids is not None:
            if isinstance(self.suppressed_ids, (str, bytes)) or not isinstance(self.suppressed_ids, (list, tuple)):
                raise ValueError(f"suppressed_ids must be a list of token ids, got {self.suppressed_ids!r}")
            self._store("suppressed_ids", tuple(_as_int("suppressed_ids", token, minimum=0)
                                                for token in self.suppressed_ids))
        if self.forced_eos_id is not None and not self.forced_eos:
            raise ValueError(f"forced_eos_id ({self.forced_eos_id}) needs forced_eos true (it names the token "
                             "forced_eos forces)")
        if self.max_output_length is not None:
            self._store("max_output_length", _as_int("max_output_length", self.max_output_length, minimum=1))
        if self.length_normalization not in LENGTH_NORMALIZATIONS:
            raise ValueError(f"length_normalization must be one of {LENGTH_NORMALIZATIONS}, "
                             f"got {self.length_normalization!r}")
        if not self.length_penalty >= 0.0:
            raise ValueError(f"length_penalty must be a finite number >= 0, got {self.length_penalty!r}")
        if isinstance(self.early_stopping, np.bool_):
            self._store("early_stopping", bool(self.early_stopping))
        if not any(self.early_stopping is value or (isinstance(value, str) and self.early_stopping == value)
                   for value in EARLY_STOPPING):
            raise ValueError(f"early_stopping must be one of False, True, 'never', got {self.early_stopping!r}")
        if self.early_stopping is not False and self.length_normalization != "hf":
            raise ValueError(f"early_stopping {self.early_stopping!r} needs length_normalization 'hf' (the 'gnmt' "
                             "search stops by its own exact rule)")
        self._store("beam_size", _as_int("beam_size", self.beam_size, minimum=1))
        if self.beam_size > MAX_BEAM_SIZE:
            raise ValueError(f"beam_size must be <= {MAX_BEAM_SIZE}, got {self.beam_size}")
        for name in ("min_output_length", "no_repeat_ngram_size"):
            self._store(name, _as_int(name, getattr(self, name), minimum=0))


# The fields of the decoding (DecodingConfig), whose defaults are section 6.1's decoding: in a checkpoint's header,
# beside the architecture's own
DECODING_CONVENTIONS = tuple(f.name for f in dataclasses.fields(DecodingConfig))


@dataclass(frozen=True)
class TransformerConfig(_Config):
    """Hyper-parameters of the encoder-decoder Transformer (section 3, Table 3).

    Attributes:
        src_vocab_size: number of source tokens.
        tgt_vocab_size: number of target tokens.
        d_model: model width (section 3.1); must be even (section 3.5) and divisible by ``n_heads``.
        n_heads: number of attention heads h (section 3.2.2); d_k = d_v = d_model / h.
        d_ff: inner width of the position-wise feed-forward network (section 3.3).
        n_encoder_layers: N for the encoder stack (section 3.1).
        n_decoder_layers: N for the decoder stack (section 3.1).
        dropout: P_drop (section 5.4); used by the ports in training, ignored at inference.
        layer_norm_eps: epsilon added to the biased variance in every LayerNorm.
        norm_first: False is the paper's post-LN, LayerNorm(x + Sublayer(x)); True is pre-LN,
            x + Sublayer(LayerNorm(x)), with a final LayerNorm after each stack.
        positional_encoding: "sinusoidal" (section 3.5) or "learned" (Table 3, row E).
        max_len: number of positions in the positional table; longest sequence the model accepts
            (at most ``MAX_LEN_LIMIT`` = 65,536).
        share_embeddings: one matrix for source embedding, target embedding and the
            pre-softmax projection (section 3.4); requires equal vocabulary sizes.
        pad_id, bos_id, eos_id: special token ids (padding, beginning and end of sequence).
        activation: the feed-forward network's nonlinearity (:func:`reference_numpy.model.activation`):
            "relu" (section 3.3, Eq. 2), "silu" (x sigmoid(x)) or "gelu" (x Phi(x), the exact erf form, not the tanh
            approximation).
        sinusoidal_layout: the sinusoidal table (:func:`reference_numpy.model.sinusoidal_positional_encoding`):
            "interleaved" (section 3.5: sin in even columns, cos in odd ones), "halves" (the same frequencies, every
            sine first, then every cosine) or "fairseq" (halves over the frequencies
            10000^(-i / (D/2 - 1)), positions counted from pad_id + 1 over the non-pad tokens, padding given zeros;
            :func:`reference_numpy.variants.position_ids`; needs d_model >= 4). Only with ``positional_encoding``
            "sinusoidal".
        scale_embeddings: multiply the token embeddings by sqrt(d_model) (section 3.4); False leaves them
            unscaled.
        output_bias: a bias on the pre-softmax projection, the checkpoint tensor ``generator.bias`` (V_tgt,)
            added to every logit; the paper's projection has none (section 3.4).
        embedding_norm: a LayerNorm of each side's embeddings plus positions before its stack's first layer (the
            checkpoint tensors ``src_embed_norm``, ``tgt_embed_norm``); the paper has none.
        position_offset: with ``positional_encoding`` "learned", the rows of the trained table before position 0:
            the table holds max_len + position_offset rows and position t reads row t + position_offset (the first
            position_offset rows are never read); 0 (the paper's Table 3 row E) reads row t.

    The last six default to the paper's choices, so a config (or checkpoint) without them is the paper's model.

    ``decoding`` (a :class:`DecodingConfig`) holds how the model decodes; its defaults are section 6.1's.
    """

    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1
    layer_norm_eps: float = 1e-6
    norm_first: bool = False
    positional_encoding: str = "sinusoidal"
    max_len: int = 1024
    share_embeddings: bool = True
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    activation: str = "relu"
    sinusoidal_layout: str = "interleaved"
    scale_embeddings: bool = True
    output_bias: bool = False
    embedding_norm: bool = False
    position_offset: int = 0
    decoding: DecodingConfig = field(default_factory=lambda: DecodingConfig())

    def __post_init__(self) -> None:
        """Validate every field; NumPy scalars (``np.int64(16)``, ``np.float32(0.1)``, ``np.bool_``)
        are accepted and stored as the Python int, float or bool they equal."""
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff",
                     "n_encoder_layers", "n_decoder_layers", "max_len"):
            self._store(name, _as_int(name, getattr(self, name), minimum=1))
        for name in ("pad_id", "bos_id", "eos_id", "position_offset"):
            self._store(name, _as_int(name, getattr(self, name), minimum=0))
        for name in ("norm_first", "share_embeddings", "scale_embeddings", "output_bias", "embedding_norm"):
            self._store(name, _as_bool(name, getattr(self, name)))
        for name in ("dropout", "layer_norm_eps"):
            self._store(name, _as_float(name, getattr(self, name)))
        for name in ("positional_encoding", "activation", "sinusoidal_layout"):
            if isinstance(getattr(self, name), str):
                self._store(name, str(getattr(self, name)))
        if self.max_len > MAX_LEN_LIMIT:
            raise ValueError(f"max_len must be <= {MAX_LEN_LIMIT}, got {self.max_len}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.d_model % 2:
            raise ValueError(f"d_model ({self.d_model}) must be even for the sin/cos pairs of section 3.5")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if not self.layer_norm_eps > 0.0:
            raise ValueError(f"layer_norm_eps must be a positive finite number, got {self.layer_norm_eps!r}")
        if self.positional_encoding not in POSITIONAL_ENCODINGS:
            raise ValueError(f"positional_encoding must be one of {POSITIONAL_ENCODINGS}, "
                             f"got {self.positional_encoding!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.sinusoidal_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"sinusoidal_layout must be one of {SINUSOIDAL_LAYOUTS}, got {self.sinusoidal_layout!r}")
        if self.sinusoidal_layout != "interleaved" and self.positional_encoding != "sinusoidal":
            raise ValueError(f"sinusoidal_layout {self.sinusoidal_layout!r} needs positional_encoding 'sinusoidal', "
                             f"got {self.positional_encoding!r}")
        if self.position_offset and self.positional_encoding != "learned":
            raise ValueError(f"position_offset {self.position_offset} needs positional_encoding 'learned' (the rows "
                             f"of a trained table before position 0), got {self.positional_encoding!r}")
        if self.max_len + self.position_offset > MAX_LEN_LIMIT:
            raise ValueError(f"max_len + position_offset must be <= {MAX_LEN_LIMIT}, got "
                             f"{self.max_len + self.position_offset}")
        if self.sinusoidal_layout == "fairseq" and self.d_model < 4:
            raise ValueError(f"sinusoidal_layout 'fairseq' needs d_model >= 4 (its frequencies divide by "
                             f"d_model / 2 - 1), got d_model {self.d_model}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"share_embeddings needs src_vocab_size ({self.src_vocab_size}) == "
                             f"tgt_vocab_size ({self.tgt_vocab_size})")
        for name in ("pad_id", "bos_id", "eos_id"):
            if getattr(self, name) >= min(self.src_vocab_size, self.tgt_vocab_size):
                raise ValueError(f"{name} ({getattr(self, name)}) must be below both vocabulary sizes")
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError("pad_id, bos_id and eos_id must be three different ids")
        self._check_decoding()

    def _check_decoding(self) -> None:
        """``decoding`` (a :class:`DecodingConfig`, valid on its own) against the model: its token ids below
        ``tgt_vocab_size``, eos never suppressed, the forced first token neither eos nor pad."""
        if not isinstance(self.decoding, DecodingConfig):
            raise ValueError(f"decoding must be a DecodingConfig, got {type(self.decoding).__name__}")
        vocab, decoding = self.tgt_vocab_size, self.decoding
        if decoding.decoder_start_id is not None and decoding.decoder_start_id >= vocab:
            raise ValueError(f"decoder_start_id ({decoding.decoder_start_id}) must be below tgt_vocab_size ({vocab})")
        ids = decoding.suppressed_ids
        if ids is not None and (any(token >= vocab for token in ids) or self.eos_id in ids):
            raise ValueError(f"suppressed_ids must be ids below tgt_vocab_size ({vocab}), eos_id ({self.eos_id}) "
                             f"not among them, got {list(ids)}")
        if decoding.forced_eos_id is not None and decoding.forced_eos_id >= vocab:
            raise ValueError(f"forced_eos_id ({decoding.forced_eos_id}) must be below tgt_vocab_size ({vocab})")
        forced_bos = decoding.forced_bos_id
        if forced_bos is not None and (forced_bos >= vocab or forced_bos in (self.eos_id, self.pad_id)):
            raise ValueError(f"forced_bos_id ({forced_bos}) must be a target token id below tgt_vocab_size "
                             f"({vocab}), not eos_id or pad_id")

    def paper_decoding(self) -> Self:
        """This model with section 6.1's decoding: every field of ``decoding`` at its default."""
        return self.replace(decoding=DecodingConfig())

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (validated like a new config); a decoding field is changed by
        :meth:`with_decoding`."""
        for name in changes:
            if name in DECODING_CONVENTIONS:
                raise ValueError(f"{name} is a field of the config's decoding: config.with_decoding({name}=...)")
        return super().replace(**changes)

    def with_decoding(self, **changes: Any) -> Self:
        """A copy whose ``decoding`` has some fields changed (validated like a new config)."""
        return self.replace(decoding=self.decoding.replace(**changes))

    @property
    def start_id(self) -> int:
        """The token decoding starts from: ``decoding.decoder_start_id``, or ``bos_id`` when it is None (section
        6.1)."""
        start = self.decoding.decoder_start_id
        return self.bos_id if start is None else start

    @property
    def never_emitted(self) -> tuple[int, ...]:
        """The tokens decoding never produces: ``decoding.suppressed_ids``, or (pad_id, bos_id) when it is None."""
        suppressed = self.decoding.suppressed_ids
        return (self.pad_id, self.bos_id) if suppressed is None else suppressed

    @property
    def forced_last_id(self) -> int:
        """The token ``decoding.forced_eos`` forces at the budget's last position: ``decoding.forced_eos_id``, or
        ``eos_id`` when it is None."""
        forced = self.decoding.forced_eos_id
        return self.eos_id if forced is None else forced

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint header's one flat JSON object: every architecture field and every field of ``decoding``."""
        architecture = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "decoding"}
        return {**architecture, **self.decoding.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The config of a flat header object (:meth:`to_dict`): its decoding fields (:data:`DECODING_CONVENTIONS`)
        make ``decoding``; a header without them decodes as section 6.1 says."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        _check_field_names(cls, data, allowed=FLAT_FIELDS)
        decoding = DecodingConfig(**{name: value for name, value in data.items() if name in DECODING_CONVENTIONS})
        return cls(**{name: value for name, value in data.items() if name not in DECODING_CONVENTIONS},
                   decoding=decoding)

    @property
    def d_k(self) -> int:
        """Width of one head's queries, keys and values: d_k = d_v = d_model / h (section 3.2.2)."""
        return self.d_model // self.n_heads

    @classmethod
    def preset(cls, name: str, **changes: Any) -> TransformerConfig:
        """``base``, ``big`` (Table 3) or ``tiny``, with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name].replace(**changes)


def refuse_choices(config: TransformerConfig, target: str, **supported: tuple[Any, ...]) -> None:
    """One ValueError naming the first field whose value ``target`` (an export, a peer library) cannot express:
    ``supported`` maps a field to the values it can. Shape: nothing returned."""
    for name, values in supported.items():
        if getattr(config, name) not in values:
            raise ValueError(f"{name} {getattr(config, name)!r} is not supported by {target} "
                             f"(it supports {', '.join(repr(value) for value in values)})")


# The paper's choices of the variant fields (docs/reference.md, "The configuration"): what a target written for the
# paper's model alone supports.
PAPER_CHOICES: dict[str, tuple[Any, ...]] = {"activation": ("relu",), "sinusoidal_layout": ("interleaved",),
                                             "scale_embeddings": (True,), "output_bias": (False,),
                                             "embedding_norm": (False,), "position_offset": (0,)}


def _check_field_names(cls: type, changes: dict, allowed: Collection[str] | None = None) -> None:
    """Every name of ``changes`` a field of ``cls`` (or one of ``allowed``), or one ``ValueError`` naming the first
    that is not."""
    names = {f.name for f in dataclasses.fields(cls)} if allowed is None else set(allowed)
    unknown = sorted(set(changes) - names, key=str)
    if unknown:
        raise ValueError(f"unknown {_KINDS[cls]} field {unknown[0]!r}")


def _as_int(name: str, value: Any, minimum: int) -> int:
    """Any integer (Python or NumPy, not a bool) as a Python int, at least ``minimum``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    """Any finite real number (Python or NumPy, not a bool) as a Python float."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_bool(name: str, value: Any) -> bool:
    """A Python or NumPy bool as a Python bool (not 0 or 1)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class TrainingConfig(_Config):
    """The optimizer of section 5.3: Adam's settings and the learning-rate schedule. The defaults are
    the paper's. (Label smoothing, section 5.4, is an argument of the loss and of each training step.)

    Attributes:
        warmup_steps: the schedule's linear warmup, lrate = d_model^-0.5 * min(step^-0.5,
            step * warmup_steps^-1.5) (Eq. 3; the paper uses 4000).
        beta1, beta2, epsilon: Adam's (Kingma & Ba, 2015) decay rates and epsilon; the paper's 0.9, 0.98, 1e-9.
        learning_rate_scale: a factor on lrate; 1 is the paper's schedule (small models on toy tasks
            may take a larger one).
    """

    warmup_steps: int = 4000
    beta1: float = 0.9
    beta2: float = 0.98
    epsilon: float = 1e-9
    learning_rate_scale: float = 1.0

    def __post_init__(self) -> None:
        self._store("warmup_steps", _as_int("warmup_steps", self.warmup_steps, minimum=1))
        for name in ("beta1", "beta2", "epsilon", "learning_rate_scale"):
            self._store(name, _as_float(name, getattr(self, name)))
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("epsilon", "learning_rate_scale"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")


_KINDS = {TransformerConfig: "config", DecodingConfig: "decoding config", TrainingConfig: "training config"}
# The names of a checkpoint header's config: the architecture's fields and the decoding's, side by side
FLAT_FIELDS = frozenset({f.name for f in dataclasses.fields(TransformerConfig)} - {"decoding"}) | \
    frozenset(DECODING_CONVENTIONS)


PRESETS: dict[str, TransformerConfig] = {
    # Table 3, "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1; shared 37k BPE vocabulary.
    "base": TransformerConfig(),
    # Table 3, "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3.
    "big": TransformerConfig(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
    # Fast tests: every size different, so a swapped axis or a transposed matrix fails loudly.
    "tiny": TransformerConfig(src_vocab_size=19, tgt_vocab_size=23, d_model=16, n_heads=4, d_ff=40,
                              n_encoder_layers=2, n_decoder_layers=3, dropout=0.1, max_len=64,
                              share_embeddings=False),
}
