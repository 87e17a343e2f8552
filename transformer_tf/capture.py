"""The intermediate stages of the forward pass through a recorder around each stage layer's ``call`` (the
reference's ``reference_numpy/capture.py``: the shared stage names, each the output of one layer of the model).
Keras has no hooks on a layer's call; a layer's ``call`` is looked up on the layer, so a recorder set on the
instance for the call sees its output, eagerly and in a traced ``tf.function`` alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from reference_numpy.capture import StagedModel, stage_modules


def capture_stages(model: StagedModel, *args: Any, **kwargs: Any) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
    """``(model(*args, **kwargs), stages)``: the forward pass's output and its stages by the shared names, in
    forward order, each recorded by a recorder set as its layer's ``call`` for the call (the class's ``call``
    back after it, also when it raises)."""
    layers = stage_modules(model)
    stages: dict[str, tf.Tensor] = {}
    for name, layer in layers.items():
        layer.call = _recorder(layer.call, name, stages)
    try:
        out = model(*args, **kwargs)
    finally:
        for layer in layers.values():
            del layer.call
    return out, {name: stages[name] for name in layers}


def _recorder(call: Callable, name: str, stages: dict[str, Any]) -> Callable:
    """``call`` keeping its output under the stage's ``name``."""
    def recorded(*args: Any, **kwargs: Any) -> Any:
        stages[name] = call(*args, **kwargs)
        return stages[name]
    return recorded
