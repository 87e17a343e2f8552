"""TensorFlow/Keras port of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

A parallel text of ``reference_numpy`` written as Keras 3 layers on the TensorFlow backend.
Importing the package selects that backend when none is configured
(``KERAS_BACKEND=tensorflow``) and refuses to run on any other.
"""

import os

from reference_numpy import __version__

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402  (the backend must be chosen before Keras is imported)

if keras.backend.backend() != "tensorflow":
    raise ImportError(f"transformer_tf needs the TensorFlow backend of Keras, but Keras is configured for "
                      f"{keras.backend.backend()!r}; set KERAS_BACKEND=tensorflow before importing keras")

from .checkpoint import from_params, load_checkpoint, save_checkpoint, to_params  # noqa: E402
from .decoding import beam_search, greedy_decode  # noqa: E402
from .model import (Decoder, DecoderLayer, Embeddings, Encoder, EncoderLayer, Generator,  # noqa: E402
                    LayerNorm, MultiHeadAttention, PositionalEncoding, PositionwiseFeedForward,
                    Transformer, causal_mask, compiled_forward, log_softmax, padding_mask, residual,
                    scaled_dot_product_attention, sinusoidal_positional_encoding, target_mask)
from .training import gradients, label_smoothed_cross_entropy, loss  # noqa: E402

__all__ = [
    "from_params", "load_checkpoint", "save_checkpoint", "to_params",
    "beam_search", "greedy_decode", "gradients", "label_smoothed_cross_entropy", "loss",
    "Decoder", "DecoderLayer", "Embeddings", "Encoder", "EncoderLayer", "Generator", "LayerNorm",
    "MultiHeadAttention", "PositionalEncoding", "PositionwiseFeedForward", "Transformer",
    "causal_mask", "compiled_forward", "log_softmax", "padding_mask", "residual",
    "scaled_dot_product_attention", "sinusoidal_positional_encoding", "target_mask",
]
