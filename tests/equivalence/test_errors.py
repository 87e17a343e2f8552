"""Every bad input gets the same answer in every backend: one table of cases, each run against
the NumPy reference and every installed port through the public entry points (the model call,
the compiled forward passes, ``encode``, ``decode``, greedy decoding and beam search).

A case either expects a ``ValueError`` whose message is one line, starts with the name of the
argument, field or tensor at fault, and is the reference's message word for word; or it is a
documented acceptance (token ids of any integer dtype) whose result must equal, exactly, the
result of int64 ids in the same backend. The configuration's own cases, which involve no
backend, are a second table below (docs/reference.md, "Bad input", states every rule).

A port whose framework is not installed is a skip with its reason, never a pass.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from equivalence import cases
from reference_numpy import TransformerConfig
from reference_numpy.decoding import check_decoding_args

FRAMEWORKS = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}
CONFIG = cases.VARIANTS["tiny"]                 # src vocabulary 19, tgt vocabulary 23, 4 heads, d_model 16, max_len 64
SRC = np.array([[5, 6, 7, 2], [8, 9, 2, 0]])    # (B, S) = (2, 4); 0 is pad_id
TGT = np.array([[1, 4, 5], [1, 6, 0]])          # (B, T) = (2, 3)
SRC_MASK = (SRC != 0)[:, None, None, :]         # (B, 1, 1, S)
MEMORY = np.zeros((2, 4, CONFIG.d_model))       # (B, S, D), float64 like the models


# ----------------------------------------------------------------------------- one driver per backend

class Driver:
    """The public entry points of one backend's float64 ``tiny`` model; this base class drives the
    reference. Inputs are NumPy arrays or lists unless a case asks for the backend's own tensor."""

    name, package = "numpy", "reference_numpy"

    def __init__(self):
        self.module = importlib.import_module(self.package)
        self.backend = importlib.import_module(f"equivalence.backends.{self.name}")
        self.model = self.backend.build(CONFIG, cases.seeded_params(CONFIG), "float64")

    def tensor(self, array: np.ndarray):
        """``array`` as the backend's own tensor, of the same dtype."""
        return array

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        return self.model(src, tgt, src_mask, tgt_mask)

    def compiled(self, src, tgt, src_mask=None, tgt_mask=None):
        """The backend's compiled forward pass; the reference (and PyTorch) compile nothing: the model call."""
        return self.forward(src, tgt, src_mask, tgt_mask)

    def adapter_forward(self, src, tgt):
        """The backend adapter's forward pass (every stage), as ``compare`` and the agreement suite run it."""
        return self.backend.forward(self.model, src, tgt)["log_probs"]

    def encode(self, src, src_mask=None):
        return self.model.encode(src, src_mask)

    def decode(self, tgt, memory: np.ndarray | list, src_mask=None, tgt_mask=None):
        """``decode`` given ``memory`` as the backend's own tensor, or nested lists as they are."""
        memory = self.tensor(memory) if isinstance(memory, np.ndarray) else memory
        return self.model.decode(tgt, memory, src_mask, tgt_mask)

    def greedy(self, src):
        return self.module.greedy_decode(self.model, src)

    def beam(self, src, beam_size=2, alpha=0.6):
        return self.module.beam_search(self.model, src, beam_size, alpha)

    def training_loss(self, src, tgt, labels):
        """The section 5.4 loss: the reference's ``loss``, the ports' ``gradients`` (compiled in JAX)."""
        if self.name == "numpy":
            return self.backend.loss(self.model, src, tgt, labels)
        return self.backend.gradients(self.model, src, tgt, labels)[0]


class TorchDriver(Driver):
    name, package = "torch", "transformer_torch"

    def tensor(self, array):
        import torch
        return torch.as_tensor(array)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        import torch
        with torch.no_grad():
            return super().forward(src, tgt, src_mask, tgt_mask)


class JaxDriver(Driver):
    name, package = "jax", "transformer_jax"

    def __init__(self):
        import jax
        jax.config.update("jax_enable_x64", True)   # the float64 model is used directly; the port never turns x64 on
        super().__init__()

    def tensor(self, array):
        import jax.numpy as jnp
        return jnp.asarray(array)

    def compiled(self, src, tgt, src_mask=None, tgt_mask=None):
        from transformer_jax.speed import compiled_forward
        return compiled_forward(self.model, src, tgt, src_mask, tgt_mask)


class TfDriver(Driver):
    name, package = "tf", "transformer_tf"

    def tensor(self, array):
        import tensorflow as tf
        return tf.constant(array)

    def compiled(self, src, tgt, src_mask=None, tgt_mask=None):
        return self._compiled_forward(src, tgt, src_mask, tgt_mask)

    @functools.cached_property
    def _compiled_forward(self):
        from transformer_tf.speed import compiled_forward
        return compiled_forward(self.model)                       # one tf.function for the module


DRIVERS = {driver.name: driver for driver in (Driver, TorchDriver, JaxDriver, TfDriver)}


@functools.cache
def driver_for(name: str) -> Driver:
    if name in FRAMEWORKS:
        framework = FRAMEWORKS[name]
        pytest.importorskip(framework, reason=f"{framework} is not installed (pip install '.[{name}]')")
    return DRIVERS[name]()


@pytest.fixture(params=list(DRIVERS))
def driver(request) -> Driver:
    return driver_for(request.param)


# ----------------------------------------------------------------------------- the table

@dataclasses.dataclass(frozen=True)
class Refused:
    """``call(driver)`` raises a one-line ValueError matching ``message`` (which starts with the argument's name)."""

    name: str
    call: Callable[[Driver], Any]
    message: str


@dataclasses.dataclass(frozen=True)
class Accepted:
    """``call(driver)`` returns exactly what ``same_as(driver)`` returns (the documented result)."""

    name: str
    call: Callable[[Driver], Any]
    same_as: Callable[[Driver], Any]


def with_id(tokens: np.ndarray, row: int, column: int, value: int) -> np.ndarray:
    tokens = tokens.copy()
    tokens[row, column] = value
    return tokens


# The messages, as the docs state them (docs/reference.md, "Bad input"); each starts with the argument's name.
def outside(name: str, vocab: int) -> str:
    return re.escape(f"{name} holds token ids outside [0, {vocab})") + "$"


def not_integer(name: str, dtype: str) -> str:
    return re.escape(f"{name} must hold integer token ids, got dtype {dtype}") + "$"


def empty(name: str, shape: tuple) -> str:
    return re.escape(f"{name} must hold at least one sequence of at least one token, got shape {shape}") + "$"


def ragged(name: str) -> str:
    return re.escape(f"{name} must be a rectangular array, got nested sequences of different lengths") + "$"


def not_boolean(name: str, dtype: str) -> str:
    return re.escape(f"{name} must be boolean (True = may attend), got dtype {dtype}") + "$"


def misfit(name: str, shape: tuple, scores: tuple) -> str:
    return re.escape(f"{name} of shape {shape} does not broadcast to the attention scores (B, H, Tq, Tk) = "
                     f"{scores}") + "$"


def bad_memory(shape: tuple) -> str:
    return re.escape(f"memory must have shape (batch, source length, d_model) = (2, S, 16) with S >= 1, "
                     f"got {shape}") + "$"


def zero_dimensional(name: str) -> str:
    return re.escape(f"{name} must have an axis of key positions at least (..., Tk), got a 0-d array; None attends "
                     "everywhere") + "$"


def bad_alpha(value: str) -> str:
    return re.escape(f"alpha must be a finite number >= 0, got {value}") + "$"


def too_long(name: str) -> str:
    return re.escape(f"{name} length 65 exceeds max_len 64") + "$"


def bad_beam_size(value: str) -> str:
    return re.escape(f"beam_size must be a positive int, got {value}") + "$"


REFUSED = [
    # ---- the model call: token ids
    Refused("src id = vocabulary size", lambda d: d.forward(with_id(SRC, 0, 1, 19), TGT), outside("src", 19)),
    Refused("negative src id", lambda d: d.forward(with_id(SRC, 1, 0, -1), TGT), outside("src", 19)),
    Refused("tgt id = vocabulary size", lambda d: d.forward(SRC, with_id(TGT, 1, 2, 23)), outside("tgt", 23)),
    Refused("out-of-range id in the backend's own tensor",
            lambda d: d.forward(d.tensor(with_id(SRC, 0, 0, 1000)), TGT), outside("src", 19)),
    Refused("float src", lambda d: d.forward(SRC.astype(np.float64), TGT), not_integer("src", "float64")),
    Refused("float src in the backend's own tensor", lambda d: d.forward(d.tensor(SRC.astype(np.float32)), TGT),
            not_integer("src", "float32")),
    Refused("bool tgt", lambda d: d.forward(SRC, TGT > 0), not_integer("tgt", "bool")),
    Refused("src of rank 1", lambda d: d.forward(SRC[0], TGT),
            re.escape("src must have shape (batch, length), got (4,)")),
    Refused("tgt of rank 3", lambda d: d.forward(SRC, TGT[None]),
            re.escape("tgt must have shape (batch, length), got (1, 2, 3)")),
    Refused("src longer than max_len", lambda d: d.forward(np.full((2, 65), 5), TGT), too_long("src")),
    Refused("tgt longer than max_len", lambda d: d.forward(SRC, np.full((2, 65), 5)), too_long("tgt")),
    Refused("ragged src lists", lambda d: d.forward([[5, 6, 2], [7, 2]], TGT), ragged("src")),
    Refused("ragged tgt lists", lambda d: d.forward(SRC, [[1, 4], [1]]), ragged("tgt")),
    # ---- empty inputs: one documented refusal everywhere
    Refused("empty batch", lambda d: d.forward(np.zeros((0, 4), int), np.zeros((0, 3), int)), empty("src", (0, 4))),
    Refused("zero-length src", lambda d: d.forward(np.zeros((2, 0), int), TGT), empty("src", (2, 0))),
    Refused("zero-length tgt", lambda d: d.forward(SRC, np.zeros((2, 0), int)), empty("tgt", (2, 0))),
    # ---- batches that do not match
    Refused("tgt batch larger than src batch", lambda d: d.forward(SRC, np.concatenate([TGT, TGT[:1]])),
            r"tgt batch size 3 differs from src batch size 2$"),
    Refused("tgt batch of 1 for a src batch of 2 (no broadcasting)", lambda d: d.forward(SRC, TGT[:1]),
            r"tgt batch size 1 differs from src batch size 2$"),
    # ---- masks
    Refused("float src_mask", lambda d: d.forward(SRC, TGT, SRC_MASK.astype(np.float64)),
            not_boolean("src_mask", "float64")),
    Refused("0/1 integer tgt_mask", lambda d: d.forward(SRC, TGT, None, np.tril(np.ones((3, 3), np.int64))),
            not_boolean("tgt_mask", "int64")),
    Refused("float src_mask in the backend's own tensor",
            lambda d: d.forward(SRC, TGT, d.tensor(SRC_MASK.astype(np.float32))), not_boolean("src_mask", "float32")),
    Refused("src_mask of the wrong shape", lambda d: d.forward(SRC, TGT, np.ones((2, 3), bool)),
            misfit("src_mask", (2, 3), (2, 4, 4, 4))),
    Refused("src_mask fitting the encoder but not the decoder",
            lambda d: d.forward(SRC, TGT, np.ones((2, 1, 4, 4), bool)),
            misfit("src_mask", (2, 1, 4, 4), (2, 4, 3, 4))),
    Refused("src_mask with more axes than the scores", lambda d: d.forward(SRC, TGT, np.ones((1, 2, 1, 1, 4), bool)),
            misfit("src_mask", (1, 2, 1, 1, 4), (2, 4, 4, 4))),
    Refused("tgt_mask of the wrong shape", lambda d: d.forward(SRC, TGT, None, np.ones((4, 4), bool)),
            misfit("tgt_mask", (4, 4), (2, 4, 3, 3))),
    Refused("ragged src_mask lists", lambda d: d.forward(SRC, TGT, [[True, True], [True]]), ragged("src_mask")),
    Refused("0-d src_mask", lambda d: d.forward(SRC, TGT, np.array(True)), zero_dimensional("src_mask")),
    Refused("0-d tgt_mask as a Python bool", lambda d: d.forward(SRC, TGT, None, False),
            zero_dimensional("tgt_mask")),
    # ---- compiled entry points check before compiling (JAX's gave NaN, TensorFlow's clamped the id)
    Refused("compiled: src id = vocabulary size", lambda d: d.compiled(with_id(SRC, 0, 1, 19), TGT),
            outside("src", 19)),
    Refused("compiled: src id 1000", lambda d: d.compiled(with_id(SRC, 0, 1, 1000), TGT), outside("src", 19)),
    Refused("compiled: tgt id = vocabulary size", lambda d: d.compiled(SRC, with_id(TGT, 0, 1, 23)),
            outside("tgt", 23)),
    Refused("compiled: float src", lambda d: d.compiled(SRC.astype(np.float64), TGT), not_integer("src", "float64")),
    Refused("compiled: empty batch", lambda d: d.compiled(np.zeros((0, 4), int), np.zeros((0, 3), int)),
            empty("src", (0, 4))),
    Refused("compiled: src_mask of the wrong shape", lambda d: d.compiled(SRC, TGT, np.ones((2, 3), bool)),
            misfit("src_mask", (2, 3), (2, 4, 4, 4))),
    Refused("compiled: 0-d src_mask", lambda d: d.compiled(SRC, TGT, np.array(True)), zero_dimensional("src_mask")),
    Refused("adapter forward: src id = vocabulary size", lambda d: d.adapter_forward(with_id(SRC, 0, 1, 19), TGT),
            outside("src", 19)),
    Refused("training loss: src id = vocabulary size",
            lambda d: d.training_loss(with_id(SRC, 0, 1, 19), TGT, np.roll(TGT, -1, axis=1)), outside("src", 19)),
    # ---- encode
    Refused("encode: src id = vocabulary size", lambda d: d.encode(with_id(SRC, 0, 1, 19)), outside("src", 19)),
    Refused("encode: empty batch", lambda d: d.encode(np.zeros((0, 4), int)), empty("src", (0, 4))),
    Refused("encode: float src_mask", lambda d: d.encode(SRC, SRC_MASK.astype(np.float64)),
            not_boolean("src_mask", "float64")),
    Refused("encode: src_mask of the wrong shape", lambda d: d.encode(SRC, np.ones((2, 3), bool)),
            misfit("src_mask", (2, 3), (2, 4, 4, 4))),
    Refused("encode: 0-d src_mask", lambda d: d.encode(SRC, True), zero_dimensional("src_mask")),
    # ---- decode
    Refused("decode: memory of the wrong width", lambda d: d.decode(TGT, np.zeros((2, 4, 8))), bad_memory((2, 4, 8))),
    Refused("decode: memory of the wrong batch", lambda d: d.decode(TGT, np.zeros((3, 4, 16))), bad_memory((3, 4, 16))),
    Refused("decode: memory of rank 2", lambda d: d.decode(TGT, np.zeros((4, 16))), bad_memory((4, 16))),
    Refused("decode: memory of no source position", lambda d: d.decode(TGT, np.zeros((2, 0, 16))),
            bad_memory((2, 0, 16))),
    Refused("decode: float32 memory for a float64 model", lambda d: d.decode(TGT, MEMORY.astype(np.float32)),
            r"memory must have the model's dtype float64, got float32$"),
    Refused("decode: tgt id = vocabulary size", lambda d: d.decode(with_id(TGT, 0, 0, 23), MEMORY), outside("tgt", 23)),
    Refused("decode: zero-length tgt", lambda d: d.decode(np.zeros((2, 0), int), MEMORY), empty("tgt", (2, 0))),
    Refused("decode: src_mask not fitting the memory", lambda d: d.decode(TGT, MEMORY, np.ones((2, 1, 1, 5), bool)),
            misfit("src_mask", (2, 1, 1, 5), (2, 4, 3, 4))),
    Refused("decode: 0-d src_mask", lambda d: d.decode(TGT, MEMORY, np.array(True)), zero_dimensional("src_mask")),
    Refused("decode: tgt_mask of the wrong shape",
            lambda d: d.decode(TGT, MEMORY, SRC_MASK, np.ones((2, 1, 3, 4), bool)),
            misfit("tgt_mask", (2, 1, 3, 4), (2, 4, 3, 3))),
    # ---- greedy decoding
    Refused("greedy: src id = vocabulary size", lambda d: d.greedy(with_id(SRC, 0, 1, 19)), outside("src", 19)),
    Refused("greedy: float src", lambda d: d.greedy(SRC.astype(np.float64)), not_integer("src", "float64")),
    Refused("greedy: src longer than max_len", lambda d: d.greedy(np.full((1, 65), 5)), too_long("src")),
    Refused("greedy: empty batch", lambda d: d.greedy(np.zeros((0, 3), int)), empty("src", (0, 3))),
    Refused("greedy: zero-length src", lambda d: d.greedy(np.zeros((2, 0), int)), empty("src", (2, 0))),
    Refused("greedy: ragged src lists", lambda d: d.greedy([[5, 6, 2], [7, 2]]), ragged("src")),
    # ---- beam search
    Refused("beam: zero-length src", lambda d: d.beam(np.zeros((1, 0), int)), empty("src", (1, 0))),
    Refused("beam: empty batch", lambda d: d.beam(np.zeros((0, 3), int)), empty("src", (0, 3))),
    Refused("beam: src id = vocabulary size", lambda d: d.beam(with_id(SRC, 0, 1, 19)), outside("src", 19)),
    Refused("beam: beam_size True", lambda d: d.beam(SRC, beam_size=True), bad_beam_size("True")),
    Refused("beam: beam_size 0", lambda d: d.beam(SRC, beam_size=0), bad_beam_size("0")),
    Refused("beam: beam_size 2.0", lambda d: d.beam(SRC, beam_size=2.0), bad_beam_size("2.0")),
    Refused("beam: beam_size '4'", lambda d: d.beam(SRC, beam_size="4"), bad_beam_size("'4'")),
    Refused("beam: alpha nan", lambda d: d.beam(SRC, alpha=float("nan")), bad_alpha("nan")),
    Refused("beam: alpha inf", lambda d: d.beam(SRC, alpha=float("inf")), bad_alpha("inf")),
    Refused("beam: negative alpha", lambda d: d.beam(SRC, alpha=-0.5), bad_alpha("-0.5")),
    Refused("beam: alpha '0.6'", lambda d: d.beam(SRC, alpha="0.6"), bad_alpha("'0.6'")),
    Refused("beam: alpha True", lambda d: d.beam(SRC, alpha=True), bad_alpha("True")),
]

ACCEPTED = [
    *[Accepted(f"{dtype} token ids", lambda d, dtype=dtype: d.forward(SRC.astype(dtype), TGT.astype(dtype)),
               lambda d: d.forward(SRC, TGT))
      for dtype in ("int8", "uint8", "uint32", "uint64")],
    Accepted("uint8 token ids in the backend's own tensors",
             lambda d: d.forward(d.tensor(SRC.astype(np.uint8)), d.tensor(TGT.astype(np.uint8))),
             lambda d: d.forward(SRC, TGT)),
    Accepted("compiled: uint8 token ids", lambda d: d.compiled(SRC.astype(np.uint8), TGT.astype(np.uint8)),
             lambda d: d.compiled(SRC, TGT)),
    Accepted("encode: uint16 token ids", lambda d: d.encode(SRC.astype(np.uint16)), lambda d: d.encode(SRC)),
    Accepted("decode: memory as nested lists of Python floats (float64, as NumPy reads them)",
             lambda d: d.decode(TGT, MEMORY.tolist()), lambda d: d.decode(TGT, MEMORY)),
]


def caught(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@functools.cache
def reference_message(case_name: str) -> str:
    case = next(case for case in REFUSED if case.name == case_name)
    return str(caught(lambda: case.call(driver_for("numpy"))))


@pytest.mark.parametrize("case", REFUSED, ids=[case.name for case in REFUSED])
def test_bad_input_gets_the_reference_one_line_value_error(driver, case):
    error = caught(lambda: case.call(driver))
    message = str(error)
    assert type(error) is ValueError, f"{driver.name}: {type(error).__name__}: {message}"
    assert "\n" not in message and "\x1b" not in message, f"{driver.name}: not one plain line: {message!r}"
    assert re.match(case.message, message), f"{driver.name}: {message!r} does not match {case.message!r}"
    assert message == reference_message(case.name), f"{driver.name} and the reference word it differently"


@pytest.mark.parametrize("case", ACCEPTED, ids=[case.name for case in ACCEPTED])
def test_documented_acceptance_gives_the_plain_result(driver, case):
    got, want = _numpy(case.call(driver)), _numpy(case.same_as(driver))
    assert got.shape == want.shape and got.size > 0, f"{driver.name}: {got.shape} vs {want.shape}"
    np.testing.assert_array_equal(got, want)


def _numpy(value) -> np.ndarray:
    return np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)


def test_decoding_arguments_accept_numpy_scalars_as_the_numbers_they_equal():
    """Every port's beam search calls this shared check first (the table's beam cases show it)."""
    beam_size, alpha = check_decoding_args(np.int64(2), np.float32(0.5))
    assert (beam_size, alpha) == (2, 0.5) and type(beam_size) is int and type(alpha) is float
    assert check_decoding_args(1, 0) == (1, 0.0)                            # alpha 0: no length penalty


# ----------------------------------------------------------------------------- the configuration

BASE = TransformerConfig.preset("base")
CONFIG_REFUSED = [
    ("layer_norm_eps inf", dict(layer_norm_eps=float("inf")), r"layer_norm_eps must be a finite number, got inf$"),
    ("layer_norm_eps nan", dict(layer_norm_eps=float("nan")), r"layer_norm_eps must be a finite number, got nan$"),
    ("layer_norm_eps 0", dict(layer_norm_eps=0.0), r"layer_norm_eps must be a positive finite number, got 0\.0$"),
    ("layer_norm_eps negative", dict(layer_norm_eps=-1e-6), r"layer_norm_eps must be a positive finite number"),
    ("dropout nan", dict(dropout=float("nan")), r"dropout must be a finite number, got nan$"),
    ("dropout inf", dict(dropout=float("inf")), r"dropout must be a finite number, got inf$"),
    ("dropout True", dict(dropout=True), r"dropout must be a finite number, got True$"),
    ("dropout 1", dict(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1\.0$"),
    ("max_len 10**10", dict(max_len=10 ** 10), r"max_len must be <= 65536, got 10000000000$"),
    ("max_len 2**16 + 1", dict(max_len=2 ** 16 + 1), r"max_len must be <= 65536, got 65537$"),
    ("n_heads a NumPy float", dict(n_heads=np.float64(2.0)), r"n_heads must be an int, got np\.float64\(2\.0\)$"),
    ("d_model a NumPy bool", dict(d_model=np.bool_(True)), r"d_model must be an int, got np\.True_$"),
    ("norm_first 1", dict(norm_first=1), r"norm_first must be a bool, got 1$"),
    ("positional_encoding 'rotary'", dict(positional_encoding="rotary"), r"positional_encoding must be one of"),
]
UNKNOWN_FIELD = {
    "preset": lambda: TransformerConfig.preset("tiny", d_modle=16),
    "replace": lambda: BASE.replace(d_modle=16),
    "from_dict": lambda: TransformerConfig.from_dict({"d_modle": 16}),
    "from_json": lambda: TransformerConfig.from_json('{"d_modle": 16}'),
}


@pytest.mark.parametrize("changes, message", [case[1:] for case in CONFIG_REFUSED],
                         ids=[case[0] for case in CONFIG_REFUSED])
def test_bad_config_field_gets_one_line_value_error(changes, message):
    for build in (lambda: BASE.replace(**changes), lambda: TransformerConfig.preset("tiny", **changes)):
        error = caught(build)
        assert type(error) is ValueError and "\n" not in str(error), repr(error)
        assert re.match(message, str(error)), str(error)


@pytest.mark.parametrize("how", list(UNKNOWN_FIELD))
def test_unknown_config_field_is_the_same_value_error_everywhere(how):
    error = caught(UNKNOWN_FIELD[how])
    assert type(error) is ValueError and str(error) == "unknown config field 'd_modle'", repr(error)


def test_numpy_scalars_are_accepted_as_the_numbers_they_equal():
    config = TransformerConfig.preset("tiny", d_model=np.int64(16), n_heads=np.int32(4), max_len=np.uint16(64),
                                      dropout=np.float32(0.5), layer_norm_eps=np.float64(1e-6),
                                      norm_first=np.bool_(True), share_embeddings=np.bool_(False))
    assert config == TransformerConfig.preset("tiny", norm_first=True, dropout=0.5)
    assert [type(getattr(config, name)) for name in ("d_model", "n_heads", "max_len", "dropout", "norm_first")] == \
        [int, int, int, float, bool]
    assert TransformerConfig.from_json(config.to_json()) == config          # plain JSON numbers


def test_the_largest_max_len_is_accepted():
    assert TransformerConfig.preset("tiny", max_len=2 ** 16).max_len == 65536
