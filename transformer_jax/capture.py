"""The intermediate stages of the forward pass through Flax's ``nnx.capture`` (the reference's
``reference_numpy/capture.py``: the shared stage names, each the output of one module of the model).
``nnx.capture(..., method_outputs=nnx.Intermediate)`` sows every module method's output as an
``nnx.Intermediate`` for the call and returns them, the model left as it was (also when the call raises);
traced inside ``jax.jit`` (:func:`.speed.forward`) the stages are the compiled program's outputs."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from reference_numpy.capture import StagedModel, stage_paths


def capture_stages(model: StagedModel, *args: Any, **kwargs: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(model(*args, **kwargs), stages)``: the forward pass's output and its stages by the shared names, in
    forward order: each stage module's ``__call__`` output as ``nnx.capture`` sowed it (one per call, the last
    taken; the forward pass calls each stage module once)."""
    try:
        out, sown = nnx.capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(*args, **kwargs)
    finally:                        # nnx.capture takes its records off the modules only when the call returns
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module) and hasattr(node, "__captures__"):
                delattr(node, "__captures__")
    outputs = dict(nnx.to_flat_state(sown))
    return out, {name: outputs[(*path, "__call__")].get_value()[-1]
                 for name, path in stage_paths(model.config).items()}
