"""The intermediate stages of the forward pass, captured from outside the model.

Every backend names the same stages, in forward order: the embedded source ("src_embed"), each encoder layer's
output ("encoder.layers.{i}"), the encoder's ("encoder"), then the same on the target side ("tgt_embed",
"decoder.layers.{i}", "decoder") and the log-probabilities ("log_probs"). Each stage is the output of one
module of the model (:func:`stage_paths`), so the math carries no switch for them: the caller records those
modules' outputs while the forward pass runs, by each framework's own means -- PyTorch's forward hooks, Flax's
``nnx.capture``, a recorder around each Keras layer's ``call`` and, here in plain Python, a recorder put in each
module's place for the call (:func:`capture_stages`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .config import TransformerConfig
from .model import Transformer

Path = tuple[str | int, ...]     # attribute names and list indices from the model to one of its modules


class StagedModel(Protocol):
    """What capturing the stages reads of a model, in any backend: its configuration, and its call."""

    @property
    def config(self) -> TransformerConfig: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def stage_paths(config: TransformerConfig) -> dict[str, Path]:
    """The shared stage names, in forward order, each with the path of the module whose output it is: the
    positional encodings' (the embedded inputs), each layer's, each stack's, the generator's."""
    def stack(name: str, layers: int) -> dict[str, Path]:
        return {**{f"{name}.layers.{i}": (name, "layers", i) for i in range(layers)}, name: (name,)}

    embedded = ("src_embed_norm", "tgt_embed_norm") if config.embedding_norm else ("src_pos", "tgt_pos")
    return {"src_embed": (embedded[0],), **stack("encoder", config.n_encoder_layers),
            "tgt_embed": (embedded[1],), **stack("decoder", config.n_decoder_layers), "log_probs": ("generator",)}


def stage_modules(model: StagedModel) -> dict[str, Any]:
    """The module whose output each stage is (:func:`stage_paths`), in any backend's model."""
    return {name: _at(model, path) for name, path in stage_paths(model.config).items()}


def _at(root: Any, path: Path) -> Any:
    """The module at ``path`` from ``root``."""
    for key in path:
        root = root[key] if isinstance(key, int) else getattr(root, key)
    return root


def capture_stages(model: Transformer, *args: Any, **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(model(*args, **kwargs), stages)``: the forward pass's output and its stages by the shared names, in
    forward order. Plain Python has no hooks: for the call, a :class:`_Recorder` stands in each stage module's
    place, and the modules are put back after it (also when it raises)."""
    paths, modules = stage_paths(model.config), stage_modules(model)
    stages: dict[str, np.ndarray] = {}
    places = {name: (_at(model, path[:-1]), path[-1]) for name, path in paths.items()}  # before any module moves
    for name, place in places.items():
        _put(place, _Recorder(modules[name], name, stages))
    try:
        out = model(*args, **kwargs)
    finally:
        for name, place in places.items():
            _put(place, modules[name])
    return out, {name: stages[name] for name in paths}


class _Recorder:
    """A stage module as the caller installs it for one call: called as the module is, it keeps the module's
    output under the stage's name."""

    def __init__(self, module: Any, name: str, stages: dict[str, Any]):
        self.module, self.name, self.stages = module, name, stages

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        self.stages[self.name] = out
        return out


def _put(place: tuple[Any, str | int], module: Any) -> None:
    """Set the module at ``place``: (its owner, the attribute name or list index)."""
    owner, key = place
    if isinstance(key, int):
        owner[key] = module
    else:
        setattr(owner, key, module)
