"""The adapter contract: the module every backend provides to the harness, NumPy in and NumPy out.

An adapter is a module (``equivalence.backends.numpy``, ``.torch``, ``.jax``, ``.tf``) whose attributes are the
members of :class:`Backend`, with the same argument names and defaults; a type checker accepts the module where a
``Backend`` is expected, and ``tests/equivalence/test_equivalence.py`` checks each module's signatures against this
class. ``model`` is the backend's own model object; every array argument or result is a NumPy array.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import Batches
from reference_numpy.decoding import BEAM_SIZE
from reference_numpy.training import LABEL_SMOOTHING

Model = Any       # the backend's own Transformer
Optimizer = Any   # the backend's training.Optimizer: its framework's Adam, schedule, config, P model and loss scale
Tokens = np.ndarray                  # token ids (B, S or T), any integer dtype
Mask = np.ndarray | None             # a boolean mask (True = may attend), broadcastable to the scores; None: default
Path = str | os.PathLike[str]        # a checkpoint file
Progress = Callable[[int, float], object] | None   # (step, loss) after each step; a true return ends the run


class Backend(Protocol):
    """What the agreement suite and the ``compare`` command call on every backend."""

    NAME: str
    """The backend's name: "numpy", "torch", "jax" or "tf"."""

    FORWARD_PATH: str
    """How :meth:`log_probs` runs the forward pass, in a few words (``compare``'s speed row names it)."""

    def devices(self) -> list[str]:
        """Devices usable here: "cpu", then accelerators ("cuda:N" or "gpu:N")."""
        ...

    def build(self, config: TransformerConfig, params: dict[str, np.ndarray], dtype: str = "float64",
              device: str = "cpu") -> Model:
        """A model in ``dtype`` ("float64", "float32", "bfloat16" or "float16") on ``device`` from checkpoint-layout
        arrays (a low precision computes by the recipe of ``reference_numpy/precision.py``)."""
        ...

    def load(self, path: Path, dtype: str = "float64", device: str = "cpu") -> Model:
        """A model from a shared checkpoint file (``docs/checkpoint-format.md``)."""
        ...

    def load_training_state(self, path: Path, dtype: str | None = None) -> TrainingState | None:
        """A saved run's training state (None if the file holds none), Adam's moments read straight into memory the
        backend's :meth:`optimizer` takes as its own without a copy (the port's ``checkpoint.load_training_state``);
        cast to ``dtype``, if given and not the file's, a copy."""
        ...

    def save(self, model: Model, path: Path, training: TrainingState | None = None,
             tokenizer: str | None = None) -> None:
        """Write the model's weights (and a run's ``training`` state, from :meth:`training_state`, and a
        ``tokenizer``'s JSON text) as a shared checkpoint."""
        ...

    def export_params(self, model: Model) -> dict[str, np.ndarray]:
        """The model's weights in checkpoint layout (name -> NumPy array, linear weights (in, out))."""
        ...

    def forward(self, model: Model, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
                ) -> dict[str, np.ndarray]:
        """Every stage of the forward pass (inference), by the shared stage names, in order."""
        ...

    def log_probs(self, model: Model, src: Tokens, tgt: Tokens, src_mask: Mask = None, tgt_mask: Mask = None
                  ) -> np.ndarray:
        """The forward pass's output alone, (B, T, V) log-probabilities (inference), through the backend's
        fastest call for it: the compiled forward pass where the framework compiles (what ``bench`` times)."""
        ...

    def component(self, model: Model, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """One component (``equivalence.recipes.COMPONENTS``) on NumPy inputs (``equivalence.recipes.run_component``
        names the keys), with the weights of layer 0 of each stack."""
        ...

    def component_gradients(self, model: Model, name: str, inputs: dict[str, np.ndarray], grad_out: np.ndarray
                            ) -> dict[str, np.ndarray]:
        """The gradient of sum(component(inputs) * grad_out) with respect to each float input of ``name``
        (``equivalence.recipes.GRADIENT_INPUTS``: attention's query, key and value, LayerNorm's x), by the backend's
        own backward pass, in the model's dtype; ``grad_out`` is rounded to it first."""
        ...

    def greedy(self, model: Model, src: Tokens, use_cache: bool = True, forced_bos_id: int | None = None
               ) -> np.ndarray:
        """Greedy tokens (B, L) without the start token, right-padded with pad_id (section 6.1, the rules of
        ``reference_numpy/decoding.py``; ``forced_bos_id`` the forced first token)."""
        ...

    def beam(self, model: Model, src: Tokens, beam_size: int = BEAM_SIZE, alpha: float | None = None,
             use_cache: bool = True, forced_bos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Beam-search tokens (B, L) as :meth:`greedy`, and the length-normalized scores (B,) (section 6.1)."""
        ...

    def attention_weights(self, model: Model, src: Tokens, tgt: Tokens, layer: int, kind: str = "encoder"
                          ) -> np.ndarray:
        """Attention weights (B, H, Tq, Tk) of one layer's ``kind`` of attention (``equivalence.recipes.
        ATTENTION_KINDS``: "encoder", "decoder_self", "decoder_cross"), default masks."""
        ...

    def loss(self, model: Model, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING) -> float:
        """The label-smoothed cross-entropy of section 5.4 with dropout off, as a Python float."""
        ...

    def gradients(self, model: Model, src: Tokens, tgt: Tokens, labels: Tokens, epsilon: float = LABEL_SMOOTHING
                  ) -> tuple[float, dict[str, np.ndarray]]:
        """``(loss, grads)``: :meth:`loss` and its gradient for every checkpoint tensor, by checkpoint name, in
        checkpoint layout (NumPy float64 for a float64 model; a bfloat16 or float16 model's by the recipe, in P)."""
        ...

    def optimizer(self, model: Model, config: TrainingConfig | None = None,
                  state: TrainingState | None = None, dtype: str | None = None) -> Optimizer:
        """The backend's Adam with the schedule of section 5.3 for ``model`` (``config`` or the paper's); with
        ``state``, a saved run's moments, step count and (unless ``config`` is given) its training config. ``dtype``
        bfloat16 or float16 (a float32 model): mixed precision, each step in that precision over float32 masters."""
        ...

    def loss_scale(self, optimizer: Optimizer) -> float | None:
        """The current loss scale of a float16 mixed-precision optimizer (its framework's scaler); None otherwise."""
        ...

    def train_step(self, model: Model, optimizer: Optimizer, src: Tokens, tgt: Tokens, labels: Tokens,
                   epsilon: float = LABEL_SMOOTHING) -> float:
        """One training step of section 5 (dropout as the model's config says): the loss before the update."""
        ...

    def training_state(self, model: Model, optimizer: Optimizer) -> TrainingState:
        """The optimizer's state in checkpoint layout (NumPy arrays in the model's dtype)."""
        ...

    def train_data_parallel(self, config: TransformerConfig, params: dict[str, np.ndarray],
                            training: TrainingConfig | None, state: TrainingState | None, batches: Batches,
                            first_step: int, steps: int, world_size: int, dtype: str = "float32", device: str = "cpu",
                            epsilon: float = LABEL_SMOOTHING, progress: Progress = None
                            ) -> tuple[dict[str, np.ndarray], TrainingState, list[float]]:
        """A data-parallel run over ``world_size`` replicas on the framework's own engine (``data_parallel.train``
        of the backend: the reference simulates the shards in one process): ``batches(step)`` is the whole batch of
        each step, the run starts from ``params`` with a new optimizer (``training``) or a saved ``state``;
        ``progress(step, loss)`` after each step (a true return ends the run after that step). Returns the weights
        (checkpoint layout), the run's state and the whole batches' losses."""
        ...
