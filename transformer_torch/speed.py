"""The kernel choice that makes the PyTorch port's inference fast on a CPU; the math is in :mod:`.model`.

Two seams. :func:`linear`, which ``layers._linear`` (every linear map of the model: the projections of
:class:`~.model.MultiHeadAttention`, both layers of :class:`~.model.PositionwiseFeedForward`, the
:class:`~.model.Generator`) calls for x W^T + b once the precision recipe has made its operands float32 or
float64. It computes what ``F.linear`` computes, by oneDNN's inner product where that is faster: batch-1 decoding
reads the 37000 x 512 output projection at about 50 GB/s instead of MKL's 16 GB/s, and large products run at twice
MKL's rate (docs/benchmarks-torch.md; docs/torch.md, "Speed and memory"). And attention,
which ``model.scaled_dot_product_attention`` (Eq. (1)) hands to torch's fused kernel (:func:`attention`) when
neither its weights nor its gradients are asked for (:func:`fused`), and whose products along a beam-search
cache's hypotheses ``incremental.beam_attention`` computes without gathering keys and values (:func:`beam_scores`,
:func:`beam_mix`). This module imports nothing from the model, nor from :mod:`.incremental`, which imports it.

Two opt-ins. :func:`pack_weights` has :func:`linear` multiply by oneDNN's packed copy of each of a model's
weights, made once, in the blocked layout its kernel reads fastest (docs/torch.md, "Speed and memory"); the
adapter's models take it (``equivalence/backends/torch.py``). :func:`compile_decoding` has the decoders
(``decoding.greedy_decode``, ``decoding.beam_search``) run each cached step of a float32 model as one program
compiled by ``torch.compile`` (:func:`decoding_step`), where eager PyTorch dispatches about 300 operators a step and
reads the decoder's small weights at half the bandwidth (docs/benchmarks.md, "The PyTorch port compiled").
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from reference_numpy.incremental import at_position, attended_width

_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# elements (256 KB in float32): below, oneDNN's fixed cost per call, higher than MKL's, outweighs its faster
# reading of the weight (docs/benchmarks-torch.md)
_ONEDNN_MIN_WEIGHT = 1 << 16
# Inductor's options for :func:`compile_decoding`'s program: the weights folded in as constants (``freezing``: each
# packed once for the kernel chosen) and every product's kernel chosen by timing Inductor's C++ GEMM template
# against aten's on its own shape (``max_autotune``), without printing the timings (``..._displayed``: 0).
COMPILE_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                   "max_autotune_report_choices_stats": False, "autotune_num_choices_displayed": 0}
_PROGRAMS = "_compiled_decoding"     # a compiled model's attribute: its programs, step function -> compiled call
# held while a program is made or runs: searches in several threads take turns (Dynamo's compilation is not
# thread-safe)
_ONE_AT_A_TIME = threading.RLock()
# :func:`pack_weights`' weights -> None until their first product, then ((version, address) when packed, the packed
# copy): a weight changed in place (a new version) or given new storage (a new address) is packed again
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# the rows oneDNN is told a packed weight will meet; the layout it picks serves other row counts as well
_PACK_ROWS = 64
# :func:`top_k`'s blocks of columns: the maximum of each picks the blocks that can hold a row's largest values
_TOP_K_BLOCK = 128
Model = TypeVar("Model", bound=torch.nn.Module)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b for a weight stored (out, in), as ``F.linear``.

    Without autograd, a float32 weight of at least ``_ONEDNN_MIN_WEIGHT`` elements on the CPU
    goes to oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel
    torch.compile's CPU backend emits for a linear layer) on the same weight tensor, or on its packed copy
    where :func:`pack_weights` asked for one: ``F.linear``
    goes to the BLAS library torch is built with (MKL), whose matrix-vector product reads an
    (out, in) weight far below the memory bandwidth (batch-1 decoding) and whose large
    products run slower than oneDNN's on some CPUs (the numbers: docs/benchmarks-torch.md). Every other case
    (float64, a GPU, gradients, small weights, oneDNN switched off by
    ``torch.backends.mkldnn.enabled = False``, a traced call -- ``torch.compile`` chooses its own kernel,
    ``torch.export`` and ONNX take the portable operator -- and a call under ``torch.autocast``, whose dispatch
    casts ``F.linear``'s inputs to its dtype and which the direct oneDNN call would bypass) is ``F.linear``.

    Shape: x (..., in), weight (out, in), bias (out,) -> (..., out).
    """
    if (_ONEDNN_LINEAR and x.dtype == torch.float32 and x.is_cpu and weight.is_cpu
            and weight.numel() >= _ONEDNN_MIN_WEIGHT and torch.backends.mkldnn.enabled
            and not torch.compiler.is_compiling()
            and autocast_dtype(x) is None
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


def top_k(x: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``torch.topk(x, count, dim=1)``: each row's ``count`` largest values, descending, and indices of those values
    (as there, no promise which of equal values), found among the ``count`` blocks of :data:`_TOP_K_BLOCK` columns of
    the highest maxima and the columns after the last whole block. Exact: a block left out has ``count`` chosen
    blocks' maxima at least as large as each of its values, so it holds none of the ``count`` largest that the
    chosen columns do not match. The maxima take one vectorized pass over ``x``, a fraction of ``torch.topk``'s
    time over a beam step's K x V candidates on the CPU; ``torch.topk`` itself where the blocks are too few, off
    the CPU and when traced. Shape: x (B, n) -> values, indices (B, count)."""
    rows, width = x.shape
    blocks = width // _TOP_K_BLOCK
    if blocks <= count or not x.is_cpu or torch.compiler.is_compiling():
        return torch.topk(x, count, dim=1)
    maxima = x[:, :blocks * _TOP_K_BLOCK].reshape(rows, blocks, _TOP_K_BLOCK).amax(dim=2)       # (B, blocks)
    starts = torch.topk(maxima, count, dim=1).indices * _TOP_K_BLOCK                            # (B, count)
    block = torch.arange(_TOP_K_BLOCK, device=x.device)
    tail = torch.arange(blocks * _TOP_K_BLOCK, width, device=x.device).expand(rows, -1)
    columns = torch.cat([(starts[:, :, None] + block).reshape(rows, -1), tail], dim=1)          # (B, C)
    values, picked = torch.topk(x.gather(1, columns), count, dim=1)                             # (B, count)
    return values, columns.gather(1, picked)


def pack_weights(model: Model) -> Model:
    """Have :func:`linear` multiply by oneDNN's packed copy of each of ``model``'s parameters (in the blocked layout
    its inner product reads fastest; the results are x W^T + b as before, to float32 rounding); returns ``model``.

    A copy is made at the weight's first product on :func:`linear`'s oneDNN path (so a weight that path never
    multiplies, a lookup table or a small one, is never copied) and kept beside the model, as much memory again as
    those weights, until the model is freed. It is made again when the weight has changed in place (``copy_``,
    an optimizer's step, ``load_state_dict``: a new version) or has new storage (``.to``); a change through ``.data``,
    which PyTorch does not count, goes unseen: call :func:`pack_weights` again after one. A parameter made under
    ``torch.inference_mode`` (which counts no versions) is multiplied as it is.
    """
    for parameter in model.parameters():
        _PACKED[parameter] = None
    return model


def _packed(weight: Tensor) -> Tensor:
    """``weight`` as :func:`linear`'s oneDNN path multiplies it: its packed copy if :func:`pack_weights` registered
    it (made, or made again, if the weight is not as it was packed), else the weight itself, as is one made under
    ``torch.inference_mode``, which counts no versions (nothing would tell it changed)."""
    if weight not in _PACKED or weight.is_inference():
        return weight
    stamp, held = (weight._version, weight.data_ptr()), _PACKED[weight]
    if held is None or held[0] != stamp:
        held = _PACKED[weight] = stamp, torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
    return held[1]


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy's broadcast of shapes (a fraction of torch's cost), or torch's when traced: its sizes are then
    symbols, which NumPy would turn into the example's constants."""
    return tuple(torch.broadcast_shapes(*shapes)) if torch.compiler.is_compiling() else np.broadcast_shapes(*shapes)


def fused(*tensors: Tensor) -> bool:
    """Whether :func:`attention` (torch's fused kernel) may compute Eq. (1) of these tensors: not under
    ``torch.autocast``, whose recipe rounds the scores Q K^T to its dtype (a ``matmul``; the fused kernel keeps them
    in float32), and not when autograd records it. Its backward is then the softmax's own, w * (g - sum(w * g)),
    as in the reference and the other frameworks: the fused kernel's backward forms g - sum(w * g) as
    dP - rowsum(dO * O), two equal numbers computed differently, whose float64 rounding (eps |dO| |V|) a saturated
    softmax multiplies by |K| into dQ where the exact gradient is zero (docs/equivalence.md, "The configuration
    space")."""
    return autocast_dtype(tensors[0]) is None and not (torch.is_grad_enabled()
                                                       and any(tensor.requires_grad for tensor in tensors))


def autocast_dtype(tensor: Tensor) -> torch.dtype | None:
    """The dtype of an enclosing ``torch.autocast`` of ``tensor``'s device type (``torch.is_autocast_enabled``,
    ``torch.get_autocast_dtype``), None outside one: the model then computes by the autocast recipe
    (``reference_numpy/precision.py``)."""
    device_type = tensor.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V by ``torch.nn.functional.scaled_dot_product_attention`` (bool mask, True =
    take part, as in the model); a query row whose mask has no True entry sees no key: its output is zero (the
    kernel alone would give NaN).

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v), mask broadcastable to (..., Tq, Tk)
    -> (..., Tq, d_v).
    """
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value)
    batch = broadcast_shapes(mask.shape[:-2], query.shape[:-2], key.shape[:-2])
    query, key, value = (t.expand(*batch, *t.shape[-2:]) for t in (query, key, value))  # (..., T, d_k)
    hidden = ~mask.any(dim=-1, keepdim=True)                            # (..., Tq or 1, 1) rows that see no key
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask | hidden)
    return out.masked_fill(hidden, 0.0)                                 # fully masked row -> zeros


def beam_scores(query: Tensor, key: Tensor, beams: Tensor) -> Tensor:
    """Q K^T along each query row's hypothesis (a cache's ``beams`` table: position c of the hypothesis in row
    b*K + j is in row b*K + beams[b, j, c]) without gathering keys: every query row of a sentence against every
    key row of it (K times the products, a few KB), then at each position the score against the row ``beams``
    names. Shape: query (N, H, Tq, d_k), key (N, H, C, d_k), beams (B, K, C) -> (N, H, Tq, C)."""
    batch, k, capacity = beams.shape
    _, heads, length, _ = query.shape
    every = _every_row(query, beams) @ key.transpose(-1, -2)             # (N, H, K*Tq, C)
    every = every.reshape(batch, k, heads, k, length, capacity)          # (B, Ki, H, Kj, Tq, C)
    scores = torch.where(_picked(beams), every, 0.0).sum(dim=1)          # (B, H, Kj, Tq, C)
    return scores.transpose(1, 2).reshape(batch * k, heads, length, capacity)


def beam_mix(weights: Tensor, value: Tensor, beams: Tensor) -> Tensor:
    """weights V along each query row's hypothesis without gathering values: each key row's values weighted by
    the weights of the positions it holds for every query row, summed over key rows. Under ``torch.autocast`` the
    autocast recipe's product: P-rounded weights and values, float32 sums, the result in P.
    Shape: weights (N, H, Tq, C), value (N, H, C, d_v), beams (B, K, C) -> (N, H, Tq, d_v)."""
    mixed = autocast_dtype(weights)
    if mixed is not None:     # autocast: one product of P inputs accumulated in float32, not a P sum of partial ones
        with torch.autocast(weights.device.type, enabled=False):
            return beam_mix(weights.to(mixed).float(), value.to(mixed).float(), beams).to(mixed)
    batch, k, capacity = beams.shape
    _, heads, length, _ = weights.shape
    every = _every_row(weights, beams).reshape(batch, k, heads, k, length, capacity)   # (B, Ki, H, Kj, Tq, C)
    every = torch.where(_picked(beams), every, 0.0).reshape(batch * k, heads, k * length, capacity)
    out = every @ value                                                  # (N, H, K*Tq, d_v)
    out = out.reshape(batch, k, heads, k, length, -1).sum(dim=1)         # (B, H, Kj, Tq, d_v)
    return out.transpose(1, 2).reshape(batch * k, heads, length, -1)


def _every_row(x: Tensor, beams: Tensor) -> Tensor:
    """For key row b*K + i, the rows of all K query rows of sentence b, one after the other.

    Shape: x (N, H, Tq, Z), beams (B, K, C) -> (N, H, K*Tq, Z).
    """
    batch, k, _ = beams.shape
    _, heads, length, width = x.shape
    x = x.reshape(batch, 1, k, heads, length, width).permute(0, 1, 3, 2, 4, 5)   # (B, 1, H, K, Tq, Z)
    x = x.expand(batch, k, heads, k, length, width)                       # (B, Ki, H, Kj, Tq, Z)
    return x.reshape(batch * k, heads, k * length, width)


def _picked(beams: Tensor) -> Tensor:
    """(B, Ki, 1, Kj, 1, C) bool: position c of query row b*K + j is in key row b*K + i."""
    k = beams.shape[1]
    return beams[:, None, None, :, None, :] == torch.arange(k, device=beams.device).reshape(1, k, 1, 1, 1, 1)


def compile_decoding(model: Model) -> Model:
    """Have ``greedy_decode`` and ``beam_search`` run each cached step of ``model`` (float32, in ``eval()`` mode)
    as one program of ``torch.compile`` (``fullgraph=True``: no graph break; :data:`COMPILE_OPTIONS`), the cache
    index a 0-d tensor so that every position runs the same program, each self-attention cache handed over as the
    first W positions an eager step reads (``attended_width``: :func:`decoding_step`); returns ``model``.

    Each new shape (batch, source length, the width W) is compiled at its first step: tens of seconds
    (max-autotune times each product's kernels), after which Dynamo treats the sizes that changed as symbols. The
    weights are folded into the program (a second, packed copy of them): compile once they are final --
    ``torch._dynamo.reset()`` drops every compiled program. Decoding without a cache (``use_cache=False``) stays
    eager. A model of another dtype is refused (``ValueError``): Inductor fuses elementwise operations and keeps
    their intermediates in float32, which would drop the roundings the bfloat16 and float16 recipes make, and
    float64 is the checking precision, not a speed path.
    """
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:
        raise ValueError(f"compile_decoding: the model is {str(dtype).removeprefix('torch.')}; "
                         f"the compiled decoding step is float32 only")
    setattr(model, _PROGRAMS, {})       # on the model (not in a table keyed by it: its programs hold it)
    return model


def decoding_step(model: torch.nn.Module, step: Callable[..., Any]) -> Callable[..., Any]:
    """``step(model, tgt, memory, src_mask, cache, cache_index)`` (the decoders' cached step, returning
    ``(log_probs, cache)``) with ``model`` bound: as it is, or for a model given to :func:`compile_decoding` compiled
    once per model, its ``cache_index`` handed over as a 0-d tensor (the model then writes the cache as new tensors,
    ``index_copy``) and each self-attention cache as its first W positions (``attended_width``, as an eager step
    reads them: :func:`_narrowed`), the new positions then written back in place (:func:`_written_back`). A search
    that crosses a width hands the program a wider cache: Dynamo compiles it once more, with W a symbol. Searches
    in several threads (``translate --batches-at-once``) take turns (:data:`_ONE_AT_A_TIME`)."""
    programs = getattr(model, _PROGRAMS, None)
    if programs is None:
        return functools.partial(step, model)
    with _ONE_AT_A_TIME:
        if step not in programs:
            programs[step] = _compiled(model, step)
        return programs[step]


def _compiled(model: torch.nn.Module, step: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`decoding_step`'s compiled call of ``step`` with ``model`` bound."""
    program = torch.compile(_Bound(model, step), fullgraph=True)
    options = torch._inductor.config.patch(COMPILE_OPTIONS)    # built once: entering it costs 17 us, not 76

    def compiled(tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: tuple, cache_index: int) -> Any:
        written = cache_index + tgt.shape[1]
        with _ONE_AT_A_TIME, options, warnings.catch_warnings():    # read while compiling, at a shape's first call
            warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)  # inside Inductor
            out, stepped = program(tgt, memory, src_mask, _narrowed(cache, written),
                                   torch.tensor(cache_index, device=tgt.device))
        return out, _written_back(cache, stepped, cache_index, written)
    return compiled


def _narrowed(cache: tuple, written: int) -> tuple:
    """Each layer's self-attention cache (:class:`~.model.KVCache`: keys, values, a beams table) as views of its first W
    positions, W = ``attended_width(C, written)``: the narrowest width holding the ``written`` positions (section
    3.2.3's mask hides the rest), so that a compiled step's work grows with the hypothesis, not with the capacity C;
    the memory's keys and values as they are. Shape: keys, values (N, H, C, d_k) -> (N, H, W, d_k); a table
    (B, K, C) -> (B, K, W)."""
    def narrow(own: Any) -> Any:
        width = attended_width(own.keys.shape[2], written)
        beams = own.beams if isinstance(own.beams, tuple) else own.beams[:, :, :width]
        return own._replace(keys=own.keys[:, :, :width], values=own.values[:, :, :width], beams=beams)
    return tuple((narrow(own), memory) for own, memory in cache)


def _written_back(cache: tuple, stepped: tuple, start: int, end: int) -> tuple:
    """``cache`` with positions start .. end - 1 of each self-attention cache (keys, values, beams table) set, in
    place, to those of the compiled step's new caches ``stepped`` (W positions each, :func:`_narrowed`), as an
    eager step writes them; returns ``cache`` at position ``end``."""
    for (own, _), (new, _) in zip(cache, stepped):
        for tensor, written in zip((own.keys, own.values, own.beams), (new.keys, new.values, new.beams)):
            if not isinstance(tensor, tuple):
                tensor[:, :, start:end] = written[:, :, start:end]
    return at_position(cache, end)


class _Bound(torch.nn.Module):
    """``step`` with ``model`` bound, as a module: Inductor folds a compiled module's own weights into its program
    (``freezing``), not those of a module a compiled function is handed."""

    def __init__(self, model: torch.nn.Module, step: Callable[..., Any]):
        super().__init__()
        self.model, self.step = model, step

    def forward(self, *args: Any) -> Any:
        return self.step(self.model, *args)
