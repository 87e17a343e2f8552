"""Low precision: the recipe every backend follows in bfloat16 and float16 (``docs/equivalence.md``, "Low precision").

A model in a *low* format P (bfloat16 or float16) stores in P: every weight, every activation passed between the
paper's concepts (the residual stream, each sublayer's output, the feed-forward hidden layer, the attention heads)
and the key/value cache. Each concept is computed *wide* from its P inputs and rounded once to P at its output:

* a linear map y = x W + b (Eq. (2), the projections of section 3.2.2, the pre-softmax projection of section 3.4):
  products and their sum, bias included, wide; y rounded to P;
* attention, Eq. (1): the scores Q K^T / sqrt(d_k), the mask, the softmax and the weighted sum of the values wide;
  the output (and the weights, when returned) rounded to P;
* LayerNorm (section 3.1): mean, variance, normalization, gain and bias wide; the output rounded to P;
* elementwise steps -- the residual addition (3.1), x sqrt(d_model) (3.4), adding the positional encoding (3.5),
  ReLU -- are P arithmetic: the exact result rounded to P (the positional table itself is rounded to P);
* the log-softmax over the pre-softmax logits (already rounded to P), the loss of section 5.4 and the scores of
  beam search (6.1) are float32: ``score_dtype`` is float32.

This is what each framework's own mixed-precision idiom gives (torch autocast runs softmax, LayerNorm and
log-softmax in float32 and products with float32 accumulation; Flax's ``dtype`` for the computation beside
``param_dtype`` for storage; Keras' float32 LayerNorm and softmax under ``mixed_bfloat16``), written once so that
the four backends round at the same points. "Wide" is float32 in the ports (their frameworks' accumulation
width) and float64 in the reference, whose every rounding is then the *correct* rounding of the exact result
(:func:`round_to`): the recipe's ideal, which ``tests/reference/test_oracle.py`` checks bit for bit against a hand
computation. Products of two P numbers are exact in float32 (8 + 8 and 11 + 11 significant bits), so the ports' wide
values differ from the ideal only by float32 sums, and their P results only where a float32 sum lands across a rounding
boundary.

float32 and float64 models compute as before: ``wide`` and ``narrow`` are the identity for them.

A second recipe, **autocast** (mixed precision, :func:`autocast`: "mixed-bfloat16", "mixed-float16"), is the one the
frameworks' own mixed-precision switches are built for: see the section "The autocast recipe" below.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import numpy.typing as npt

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
LOW = (BFLOAT16, FLOAT16)
DTYPES = (np.dtype(np.float64), np.dtype(np.float32), BFLOAT16, FLOAT16)
DTYPE_NAMES = tuple(dtype.name for dtype in DTYPES)   # "float64", "float32", "bfloat16", "float16"


def parse_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """``dtype`` (a name, a NumPy or ml_dtypes type) as one of :data:`DTYPES`; anything else is one ValueError."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or parsed not in DTYPES:                            # (np.dtype("float64") == None holds)
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype if parsed is None else parsed}")
    return parsed


def parse_precision(name: npt.DTypeLike) -> tuple[np.dtype, np.dtype | None]:
    """A precision's name as (the dtype the model is stored in, the autocast dtype or None): one of
    :data:`DTYPE_NAMES` (the model in that dtype, today's recipe for bfloat16 and float16) or of
    :data:`AUTOCAST_NAMES` ("mixed-bfloat16", "mixed-float16": a float32 model under :func:`autocast`); anything else
    is one ValueError naming the argument, the same in every backend."""
    if isinstance(name, str) and name in AUTOCAST_NAMES:
        return np.dtype(np.float32), LOW[AUTOCAST_NAMES.index(name)]
    try:
        return parse_dtype(name), None
    except ValueError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES + AUTOCAST_NAMES)}, got {name!r}") from None


def is_low(dtype: npt.DTypeLike) -> bool:
    """Whether ``dtype`` is a low format (bfloat16, float16) that computes by the recipe."""
    return np.dtype(dtype) in LOW


def score_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """The dtype of log-probabilities, the loss and beam scores of a model in ``dtype``: float32 for P."""
    return np.dtype(np.float32) if is_low(dtype) else np.dtype(dtype)


def wide(x: np.ndarray) -> np.ndarray:
    """A P array as float64 (exact), for a concept computed wide; other arrays unchanged."""
    return x.astype(np.float64) if is_low(x.dtype) else x


def narrow(x: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
    """A concept's wide result rounded once to the model's ``dtype`` when it is low; unchanged otherwise."""
    return round_to(x, dtype) if is_low(dtype) else x


def round_to(x: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """``x`` correctly rounded (to nearest, ties to even) to ``dtype``, from any precision.

    NumPy's and ml_dtypes' casts from float64 to bfloat16 go through float32 and so round twice (1 + 2^-8 + 2^-30
    becomes 1, not 1 + 2^-7); here the significand is rounded in one step: x is scaled so that one unit in the last
    place of ``dtype`` at x's magnitude (the subnormal spacing below the normal range) is 1, rounded by ``np.rint``
    (ties to even, exact in float64), scaled back, and sent to infinity from halfway past the largest finite value.
    """
    dtype, x = np.dtype(dtype), np.asarray(x)
    if not is_low(dtype):
        return x.astype(dtype, copy=False)
    x = x.astype(np.float64)
    unit = _ulp_exponent(x, dtype)
    rounded = np.ldexp(np.rint(np.ldexp(x, -unit)), unit)
    largest = float(ml_dtypes.finfo(dtype).max)
    overflow = np.abs(x) >= largest + float(np.ldexp(1.0, _ulp_exponent(np.float64(largest), dtype))) / 2
    rounded = np.where(overflow, np.copysign(np.inf, x), rounded)
    return np.where(np.isfinite(x), rounded, x).astype(dtype)


def spacing(x: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """One unit in the last place of the low format ``dtype`` at |x| (the distance from a number of ``dtype`` of
    that magnitude to the next larger one), in float64."""
    return np.ldexp(1.0, _ulp_exponent(np.abs(np.asarray(x, dtype=np.float64)), np.dtype(dtype)))


def _ulp_exponent(x: npt.ArrayLike, dtype: np.dtype) -> np.ndarray:
    """log2 of one unit in the last place of ``dtype`` at the magnitude of ``x``: with |x| = m 2^e, m in [0.5, 1),
    a significand of nmant + 1 bits has its last at 2^(e - nmant - 1); below the normal range, the subnormals'."""
    info = ml_dtypes.finfo(dtype)
    _, exponent = np.frexp(x)
    return np.maximum(exponent - (info.nmant + 1), info.minexp - info.nmant)


# ----------------------------------------------------------------------------- training in a low precision

LOSS_SCALE = 2.0 ** 15        # float16's first loss scale (Keras' default; a power of two: scaling is exact)
LOSS_SCALE_GROWTH_INTERVAL = 2000  # finite steps in a row before the scale doubles (torch, Keras and Flax defaults)


def check_trainable(dtype: npt.DTypeLike) -> None:
    """Training updates float32 or float64 weights: a low-precision *model* is refused with one ValueError, the same
    in every backend (a float32 model trains in a low precision with ``optimizer(..., dtype=...)``)."""
    if is_low(dtype):
        raise ValueError(f"training needs float32 or float64 weights, got a {np.dtype(dtype).name} model: load the "
                         f"checkpoint in float32 and give the optimizer dtype={np.dtype(dtype).name!r} (mixed "
                         f"precision: float32 master weights, each step computed in {np.dtype(dtype).name})")


def training_dtype(model_dtype: npt.DTypeLike, dtype: npt.DTypeLike | None) -> np.dtype:
    """The precision a training step computes in: ``dtype`` (any of :data:`DTYPES`; None: the model's own). A low one
    needs a float32 model, whose weights are the master copy; one ValueError otherwise, the same in every backend."""
    model_dtype = parse_dtype(model_dtype)
    check_trainable(model_dtype)
    dtype = model_dtype if dtype is None else parse_dtype(dtype)
    if dtype != model_dtype and not (is_low(dtype) and model_dtype == np.float32):
        raise ValueError(f"a {model_dtype.name} model trains in {model_dtype.name}, got dtype={dtype.name!r} "
                         f"(bfloat16 and float16 steps keep float32 master weights: load the model in float32)")
    return dtype


def uses_loss_scaling(dtype: npt.DTypeLike) -> bool:
    """float16 training scales the loss (its smallest normal number is 6e-5: small gradients would flush to zero);
    bfloat16 has float32's exponent range and does not."""
    return np.dtype(dtype) == FLOAT16


# ----------------------------------------------------------------------------- the autocast recipe (mixed precision)
#
# What torch.autocast(device_type, dtype=P) does to a float32 model, read in torch's source
# (torch/testing/_internal/autocast_test_lists.py, AutocastCPUTestLists and AutocastTestLists: the op lists of
# aten/src/ATen/autocast_mode.cpp), named here as the recipe every backend follows:
#
# * parameters stay float32; the embeddings (embedding is on no list: it runs in its weight's float32), x sqrt(d_model)
#   and the positional encoding are float32;
# * each linear map (``linear``, ``matmul``, ``bmm``, ``addmm``: the lower-precision lists ``nn_16``/``torch_16``)
#   casts its inputs to P -- x, W and the bias -- accumulates in float32 and returns P: y = round_P(x_P W_P + b_P),
#   rounded once (measured: torch's CPU linear under autocast is this value but for float32 sums, the bias inside;
#   Keras' ``Dense.call`` and Flax's ``nnx.Linear`` add the bias after a rounded product unless the product is
#   kept in float32: the ports compute the product with a float32 result, add the bias, and round once);
# * the attention products Q K^T and weights . V (``matmul``) likewise: P inputs, float32 accumulation, the result
#   rounded to P -- the scores Q K^T are a P tensor, as in every framework's explicit attention under its switch
#   (torch's ``matmul``, Keras' and Flax's ``einsum`` in the compute dtype);
# * softmax (with the scaling by 1/sqrt(d_k) and the mask), LayerNorm, log-softmax and the loss are float32: CUDA's
#   autocast list ``torch_fp32`` holds softmax, log_softmax and layer_norm. On the CPU they are on no list and run in
#   their input's dtype, so the PyTorch port widens the scores explicitly; Keras' ``LayerNormalization.call``
#   (keras/src/layers/normalization/layer_normalization.py) computes in float32 but casts its output to the compute
#   dtype and Flax's ``nnx.LayerNorm`` returns its ``dtype`` (flax/nnx/nn/normalization.py, ``_normalize``), and
#   Flax's attention runs the softmax in its ``dtype`` unless ``force_fp32_for_softmax`` (flax/nnx/nn/attention.py):
#   the recipe takes torch's float32 everywhere and the Keras and Flax ports compute their own LayerNorm and softmax
#   in float32 under their switch;
# * a P tensor added to a float32 one is float32 (type promotion: ``torch_expect_builtin_promote`` lists add, mul,
#   div of float32 and P as float32): the residual stream x + Sublayer(x) stays float32, and the LayerNorm it feeds
#   and the decoder's output with it;
# * ReLU of a P tensor is P (exact); the attention heads and the feed-forward hidden layer are P; the keys and
#   values a decoding cache holds are the projections' P values.
#
# In the reference the products are exact (float64) from the P-rounded inputs and rounded once to P (correctly, by
# :func:`round_to`); everything float32 is NumPy's float32 arithmetic, as in the float32 reference.

AUTOCAST_NAMES = ("mixed-bfloat16", "mixed-float16")   # the command line's names of the autocast recipe in P
_AUTOCAST: contextvars.ContextVar[np.dtype | None] = contextvars.ContextVar("autocast", default=None)


@contextlib.contextmanager
def autocast(dtype: npt.DTypeLike) -> Iterator[None]:
    """Run a float32 reference model by the autocast recipe in ``dtype`` (bfloat16 or float16) inside the block, as
    ``torch.autocast(device_type, dtype)`` does a torch module; a float64 model, or a model stored in P, is unchanged
    (its own recipe). Anything but bfloat16 or float16 is one ValueError naming ``dtype``."""
    parsed = parse_dtype(dtype)
    if not is_low(parsed):
        raise ValueError(f"dtype must be one of bfloat16, float16 under autocast, got {parsed.name}")
    token = _AUTOCAST.set(parsed)
    try:
        yield
    finally:
        _AUTOCAST.reset(token)


def autocast_dtype() -> np.dtype | None:
    """The autocast dtype P of the enclosing :func:`autocast` block, None outside one."""
    return _AUTOCAST.get()


def product_dtype(dtype: npt.DTypeLike) -> np.dtype:
    """The dtype a product (a linear map, Q K^T, weights . V) of a model in ``dtype`` computes in: under
    :func:`autocast` a float32 model's products are P; otherwise the model's own ``dtype``."""
    dtype, mixed = np.dtype(dtype), autocast_dtype()
    return mixed if mixed is not None and dtype == np.float32 else dtype


def product(a: np.ndarray, b: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
    """a @ b by the recipe of its ``dtype`` (:func:`product_dtype`): in a low precision P both inputs rounded to P,
    the products and their sum exact, the result rounded once to P; in float32 or float64 the plain product."""
    dtype = np.dtype(dtype)
    if not is_low(dtype):
        return a @ b
    return round_to(wide(cast(a, dtype)) @ wide(cast(b, dtype)), dtype)


def cast(x: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
    """``x`` in ``dtype``: unchanged if it is, rounded once otherwise (:func:`round_to`: an autocast input)."""
    return x if x.dtype == np.dtype(dtype) else round_to(x, dtype)


def attention_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b, a product of Eq. (1) (Q K^T, weights . V) of wide inputs: under :func:`autocast` the recipe's P product
    (:func:`product`) read as float32, the precision the softmax computes in; otherwise the plain product."""
    mixed = autocast_dtype()
    return a @ b if mixed is None else product(a, b, mixed).astype(np.float32)


Concept = TypeVar("Concept", bound=Callable[..., Any])


def computed_wide(concept: Concept) -> Concept:
    """``concept`` (a function of arrays returning a tuple of arrays) entered and left by the recipe: its P array
    arguments widened on entry (:func:`wide`), each array it returns rounded once (:func:`narrow`) to the precision it
    computes for -- its first argument's dtype, or under :func:`autocast` the autocast dtype P."""

    @functools.wraps(concept)
    def entered_and_left(first: np.ndarray, *args: Any, **kwargs: Any) -> tuple:
        mixed = autocast_dtype()
        dtype = first.dtype if mixed is None else mixed
        results = concept(wide(first), *(wide(a) if isinstance(a, np.ndarray) else a for a in args), **kwargs)
        return tuple(None if result is None else narrow(result, dtype) for result in results)

    return entered_and_left  # type: ignore[return-value]


def check_autocast_training(mixed: npt.DTypeLike | None, dtype: npt.DTypeLike | None) -> None:
    """Training a model built in a mixed precision (``mixed``: its autocast dtype, None for any other model): its
    float32 weights step with the framework's Adam, each step's loss and gradients its own under autocast (float16's
    loss scaled by the framework's scaler); a ``dtype`` beside it is one ValueError, the same in every backend."""
    if mixed is not None and dtype is not None:
        raise ValueError(f"a mixed-{np.dtype(mixed).name} model trains in its own recipe, got dtype={dtype!r}")
