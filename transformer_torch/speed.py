"""The kernel choice that makes the PyTorch port's inference fast on a CPU; the math is in :mod:`.model`.

One seam: :func:`linear`, which ``model._linear`` (every linear map of the model: the projections of
:class:`~.model.MultiHeadAttention`, both layers of :class:`~.model.PositionwiseFeedForward`, the
:class:`~.model.Generator`) calls for x W^T + b once the precision recipe has made its operands float32 or
float64. It computes what ``F.linear`` computes, by oneDNN's inner product where that is faster: batch-1 decoding
reads the 37000 x 512 output projection at about 50 GB/s instead of MKL's 16 GB/s, and large products run at twice
MKL's rate (docs/benchmarks-torch.md, "Before and after"; docs/torch.md, "Speed and memory"). This module imports
nothing from the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# elements (256 KB in float32): below, oneDNN's fixed cost per call, higher than MKL's, outweighs its faster
# reading of the weight (docs/benchmarks-torch.md, "Before and after")
_ONEDNN_MIN_WEIGHT = 1 << 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T + b for a weight stored (out, in), as ``F.linear``.

    Without autograd, a float32 weight of at least ``_ONEDNN_MIN_WEIGHT`` elements on the CPU
    goes to oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel
    torch.compile's CPU backend emits for a linear layer) on the same weight tensor: ``F.linear``
    goes to the BLAS library torch is built with (MKL), whose matrix-vector product reads an
    (out, in) weight far below the memory bandwidth (batch-1 decoding) and whose large
    products run slower than oneDNN's on some CPUs (the numbers: docs/benchmarks-torch.md). Every other case
    (float64, a GPU, gradients, small weights, oneDNN switched off by
    ``torch.backends.mkldnn.enabled = False``, and a traced call -- ``torch.compile`` chooses its own kernel,
    ``torch.export`` and ONNX take the portable operator) is ``F.linear``.

    Shape: x (..., in), weight (out, in), bias (out,) -> (..., out).
    """
    if (_ONEDNN_LINEAR and x.dtype == torch.float32 and x.is_cpu and weight.is_cpu
            and weight.numel() >= _ONEDNN_MIN_WEIGHT and torch.backends.mkldnn.enabled
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad)))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
