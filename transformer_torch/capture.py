"""The intermediate stages of the forward pass through PyTorch's forward hooks (the reference's
``reference_numpy/capture.py``: the shared stage names, each the output of one module of the model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from reference_numpy.capture import StagedModel, stage_modules


def capture_stages(model: StagedModel, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """``(model(*args, **kwargs), stages)``: the forward pass's output and its stages by the shared names, in
    forward order, each recorded by a forward hook on its module for the call (removed after it, also when it
    raises)."""
    modules = stage_modules(model)
    stages: dict[str, Tensor] = {}
    hooks = [module.register_forward_hook(_recorder(name, stages)) for name, module in modules.items()]
    try:
        out = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return out, {name: stages[name] for name in modules}


def _recorder(name: str, stages: dict[str, Any]) -> Callable:
    """A forward hook keeping its module's output under the stage's ``name``."""
    def hook(_module: Any, _inputs: Any, out: Any) -> None:
        stages[name] = out
    return hook
