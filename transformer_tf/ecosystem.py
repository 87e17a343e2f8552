"""Training the Keras way: ``model.compile`` + ``model.fit`` / ``evaluate`` / ``predict`` on the port's
:class:`~.model.Transformer`, a ``keras.Model`` that takes Keras' one input, a ``(src, tgt)`` pair or a dict
``{"src": ..., "tgt": ...}``, with the labels as Keras' ``y`` (docs/tf.md, "Train it your framework's way").

The pieces are the port's own, not a second copy of the math: :class:`LabelSmoothedCrossEntropy` is
:func:`.training.label_smoothed_cross_entropy` as a Keras loss, :func:`adam` the paper's Adam with the schedule of
Eq. (3) of :mod:`.training` (the optimizer ``train_step`` steps with), so that ``fit`` makes ``train_step``'s
updates (tests/ports/test_ecosystem.py). Each port's ``ecosystem.py`` holds its framework's own training idiom: Keras'
``fit`` here, ``torch.utils.data`` in PyTorch, optax and orbax in JAX.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from reference_numpy.checkpoint import TrainingState
from reference_numpy.config import TrainingConfig
from reference_numpy.training import LABEL_SMOOTHING, PAPER

from . import training
from .layers import register
from .model import Transformer


@register
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """The label-smoothed loss of section 5.4 as a Keras loss, for ``model.compile(loss=...)``: the mean over the
    labels that are not ``pad_id`` of :func:`.training.label_smoothed_cross_entropy` (``y_true`` the labels (B, T),
    ``y_pred`` the model's log-probabilities (B, T, V)), in the log-probabilities' dtype: Keras' own ``Loss.__call__``
    would cast both to ``floatx`` (the labels to floats). Keras' ``fit`` reports it per batch; its epoch loss is
    the mean of the batches' losses weighted by their sentence counts (Keras' loss tracker), not by their tokens.
    Sample weights are refused: the loss weighs tokens, not sentences."""

    def __init__(self, pad_id: int, epsilon: float = LABEL_SMOOTHING, name: str = "label_smoothed_cross_entropy",
                 **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.pad_id, self.epsilon = _checked_pad_id(pad_id), _checked_epsilon(epsilon)

    def __call__(self, y_true: tf.Tensor, y_pred: tf.Tensor, sample_weight: tf.Tensor | None = None) -> tf.Tensor:
        if sample_weight is not None:
            raise ValueError("sample_weight: the label-smoothed loss weighs every non-pad token alike; "
                             "give no sample weights")
        with tf.name_scope(self.name):
            return self.call(y_true, y_pred)

    def call(self, y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        return training.label_smoothed_cross_entropy(y_pred, y_true, self.pad_id, self.epsilon)

    def get_config(self) -> dict:
        return {"name": self.name, "pad_id": self.pad_id, "epsilon": self.epsilon}


@register
class TokenAccuracy(keras.metrics.Metric):
    """The share of the labels that are not ``pad_id`` whose most likely token (the argmax of the model's
    log-probabilities) is the label, over every batch since the last reset: ``metrics=[TokenAccuracy(pad_id)]``,
    reported by ``fit`` and ``evaluate``. Counted in int64, exact."""

    def __init__(self, pad_id: int, name: str = "token_accuracy", **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.pad_id = _checked_pad_id(pad_id)
        self.correct = self.add_variable((), "zeros", dtype="int64", name="correct")
        self.total = self.add_variable((), "zeros", dtype="int64", name="total")

    def update_state(self, y_true: tf.Tensor, y_pred: tf.Tensor, sample_weight: tf.Tensor | None = None) -> None:
        labels = tf.cast(y_true, tf.int64)                                             # (B, T)
        real = labels != self.pad_id
        hits = tf.logical_and(real, tf.argmax(y_pred, axis=-1) == labels)
        self.correct.assign_add(tf.math.count_nonzero(hits, dtype=tf.int64))
        self.total.assign_add(tf.math.count_nonzero(real, dtype=tf.int64))

    def result(self) -> tf.Tensor:
        return tf.math.divide_no_nan(tf.cast(self.correct, tf.float64), tf.cast(self.total, tf.float64))

    def get_config(self) -> dict:
        return {"name": self.name, "pad_id": self.pad_id}


def adam(model: Transformer, config: TrainingConfig = PAPER) -> keras.optimizers.Optimizer:
    """The optimizer of section 5.3 for ``model.compile(optimizer=...)``: the ``keras.optimizers.Adam`` that
    :func:`.training.optimizer` steps with (the paper's update, Algorithm 1 of Kingma & Ba) and the schedule of
    Eq. (3) for ``model``'s d_model and ``config``. Keras builds it on the model's variables at the first ``fit``;
    under the ``mixed_float16`` policy ``compile`` wraps it in Keras' ``LossScaleOptimizer``. A ``.keras`` file
    (``model.save``, ``ModelCheckpoint``) holds it with its moments and step count."""
    if not isinstance(config, TrainingConfig):
        raise ValueError(f"config must be a TrainingConfig, got {type(config).__name__}")
    return training._Adam(training.learning_rate_schedule(model.config.d_model, config), config)


def fit_state(model: Transformer) -> TrainingState:
    """The training state of a model compiled with :func:`adam` and trained by ``fit``, as
    :func:`.training.training_state` gives it for ``train_step``'s runs: for ``save_checkpoint(model, path,
    training=fit_state(model))``, a run that resumes in any backend."""
    optimizer = model.optimizer
    scale = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    inner = optimizer if scale is None else scale.inner_optimizer
    if not isinstance(inner, training._Adam):
        raise ValueError(f"model: compile it with transformer_tf.ecosystem.adam(model) as its optimizer, "
                         f"got {type(inner).__name__}")
    record = training.Optimizer(inner, inner.schedule, inner.config, loss_scale=scale)
    return training.training_state(model, record)


def _checked_pad_id(pad_id: Any) -> int:
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a token id (an int >= 0), got {pad_id!r}")
    return pad_id


def _checked_epsilon(epsilon: Any) -> float:
    """The loss's own rule (:func:`.training.label_smoothed_cross_entropy`), checked when the loss is made."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
    return float(epsilon)
