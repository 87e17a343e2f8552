"""Training the Flax way: a user's own ``nnx.jit`` step over ``nnx.Optimizer`` with optax's Adam and the schedule
of Eq. (3) -- the optimizer ``train_step`` steps with -- and the training state saved and restored with
orbax-checkpoint, the ecosystem's format, beside the project's safetensors file (docs/jax.md, "Train it your
framework's way"). Each port's ``ecosystem.py`` holds its framework's own training idiom: Keras' ``fit`` in
TensorFlow, ``torch.utils.data`` in PyTorch, optax and orbax here.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from flax import nnx

from reference_numpy.config import TrainingConfig
from reference_numpy.training import PAPER

from . import training
from .model import Transformer


def adam(model: Transformer, config: TrainingConfig = PAPER) -> nnx.Optimizer:
    """``nnx.Optimizer`` over ``model``'s parameters with optax's Adam of section 5.3 (``eps_root=0``: the paper's
    update) and the schedule of Eq. (3): what :func:`.training.optimizer` holds as ``adam``, for a loop of one's own
    (``optimizer.update(model, grads)`` in an ``nnx.jit`` step). Its step counts are optax's int32 and nnx's
    uint32, as Flax makes them (``train_step``'s are int64)."""
    if not isinstance(config, TrainingConfig):
        raise ValueError(f"config must be a TrainingConfig, got {type(config).__name__}")
    return nnx.Optimizer(model, training._adam(model.config.d_model, config), wrt=nnx.Param)


def save_training(directory: str | os.PathLike, model: Transformer, optimizer: nnx.Optimizer) -> None:
    """The model's weights and the optimizer's state (Adam's moments and step counts) as an orbax checkpoint in
    ``directory`` (a new directory; an absolute path is made of a relative one), written when this returns."""
    checkpointer = _orbax().StandardCheckpointer()
    checkpointer.save(Path(directory).absolute(), nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()


def restore_training(directory: str | os.PathLike, model: Transformer, optimizer: nnx.Optimizer) -> None:
    """Put the weights and optimizer state that :func:`save_training` wrote into ``model`` and ``optimizer`` (of the
    same config and dtype: orbax restores into their state's shapes and dtypes), so that the run goes on."""
    restored = _orbax().StandardCheckpointer().restore(Path(directory).absolute(), nnx.state((model, optimizer)))
    nnx.update((model, optimizer), restored)


def _orbax() -> ModuleType:
    """``orbax.checkpoint``, imported when a training state is saved or restored: importing it with the package would
    add about 0.2 s to every command's start (docs/benchmarks.md, "The first translation")."""
    import orbax.checkpoint

    return orbax.checkpoint
