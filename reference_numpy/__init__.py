"""Pure-NumPy reference of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

The reference *defines* the math that the PyTorch, JAX/Flax and TensorFlow/Keras ports are
checked against. It imports nothing but NumPy, ml_dtypes (bfloat16) and the NumPy side of safetensors for I/O.
"""

__version__ = "0.1.0"  # the distribution's one version: pyproject.toml and every package read it here

from .capture import capture_stages
from .checkpoint import (
    FORMAT_VERSION,
    TrainingState,
    count_parameters,
    init_params,
    load_checkpoint,
    load_training_state,
    parameter_shapes,
    save_checkpoint,
    validate_params,
)
from .config import PRESETS, DecodingConfig, TrainingConfig, TransformerConfig
from .decoding import beam_search, greedy_decode, length_penalty, max_output_lengths
from .incremental import KVCache, at_position
from .model import (
    Decoder,
    DecoderLayer,
    Embeddings,
    Encoder,
    EncoderLayer,
    Generator,
    LayerNorm,
    Linear,
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
from .variants import position_ids

__all__ = [
    "FORMAT_VERSION", "PRESETS", "DecodingConfig", "TrainingConfig", "TrainingState", "TransformerConfig",
    "count_parameters", "init_params",
    "load_checkpoint", "load_training_state", "parameter_shapes", "save_checkpoint",
    "validate_params",
    "beam_search", "greedy_decode", "length_penalty", "max_output_lengths",
    "KVCache", "at_position",
    "Decoder", "DecoderLayer", "Embeddings", "Encoder", "EncoderLayer", "Generator", "LayerNorm",
    "Linear", "MultiHeadAttention", "PositionalEncoding", "PositionwiseFeedForward", "Transformer",
    "activation", "causal_mask", "log_softmax", "padding_mask", "position_ids", "residual",
    "masked_softmax", "zero_fully_masked_rows", "scaled_dot_product_attention",
    "sinusoidal_positional_encoding", "target_mask",
    "capture_stages",
]
