"""TensorFlow/Keras port of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

A parallel text of ``reference_numpy`` written as Keras 3 layers on the TensorFlow backend,
Keras' default backend. Importing the package changes no setting: if Keras is configured for
another backend (``KERAS_BACKEND``, ``~/.keras/keras.json``) the import stops with an ImportError.
"""

import keras

from reference_numpy import __version__ as __version__

if keras.backend.backend() != "tensorflow":
    raise ImportError(f"transformer_tf needs the TensorFlow backend of Keras, but Keras is configured for "
                      f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow before importing keras")

from .capture import capture_stages  # noqa: E402
from .checkpoint import (  # noqa: E402
    from_checkpoint_layout,
    from_params,
    load_checkpoint,
    name_table,
    save_checkpoint,
    to_checkpoint_layout,
    to_params,
    transposed,
)
from .decoding import beam_search, greedy_decode  # noqa: E402
from .device import deterministic, devices, full_precision, resolve_device  # noqa: E402
from .ecosystem import LabelSmoothedCrossEntropy, TokenAccuracy, adam, fit_state  # noqa: E402
from .incremental import KVCache, at_position  # noqa: E402
from .model import (  # noqa: E402
    Decoder,
    DecoderLayer,
    Embeddings,
    Encoder,
    EncoderLayer,
    Generator,
    LayerNorm,
    MultiHeadAttention,
    PositionalEncoding,
    PositionwiseFeedForward,
    Transformer,
    activation,
    causal_mask,
    log_softmax,
    masked_softmax,
    padding_mask,
    residual,
    scaled_dot_product_attention,
    sinusoidal_positional_encoding,
    target_mask,
    zero_fully_masked_rows,
)
from .speed import compiled_forward as compiled_forward  # noqa: E402  (a port-only name, outside __all__)
from .training import (  # noqa: E402
    gradients,
    label_smoothed_cross_entropy,
    learning_rate_schedule,
    loss,
    optimizer,
    train_step,
    training_state,
)
from .variants import position_ids  # noqa: E402

__all__ = [
    "KVCache", "at_position",
    "Decoder", "DecoderLayer", "Embeddings", "Encoder", "EncoderLayer", "Generator", "LayerNorm",
    "MultiHeadAttention", "PositionalEncoding", "PositionwiseFeedForward", "Transformer",
    "activation", "causal_mask", "log_softmax", "padding_mask", "position_ids", "residual",
    "masked_softmax", "zero_fully_masked_rows", "scaled_dot_product_attention",
    "sinusoidal_positional_encoding", "target_mask",
    "capture_stages",
    "beam_search", "greedy_decode",
    "from_checkpoint_layout", "from_params", "load_checkpoint", "name_table", "save_checkpoint",
    "to_checkpoint_layout", "to_params", "transposed",
    "gradients", "label_smoothed_cross_entropy", "learning_rate_schedule", "loss", "optimizer", "train_step",
    "training_state",
    "deterministic", "devices", "full_precision", "resolve_device",
    # Keras' compile/fit (ecosystem.py): this port's own
    "LabelSmoothedCrossEntropy", "TokenAccuracy", "adam", "fit_state",
]
