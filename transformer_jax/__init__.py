"""JAX/Flax NNX port of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

A parallel text of ``reference_numpy`` (see ``docs/ports.md`` and ``docs/jax.md``). Importing it
changes no process-wide setting: float64 models need ``jax_enable_x64``, which the user turns on
(``jax.config.update("jax_enable_x64", True)``, or ``with jax.enable_x64(True):``).
"""

from reference_numpy import __version__ as __version__

from .capture import capture_stages
from .checkpoint import (
    from_checkpoint_layout,
    from_params,
    load_checkpoint,
    name_table,
    save_checkpoint,
    to_checkpoint_layout,
    to_params,
    transposed,
)
from .decoding import beam_search, greedy_decode
from .device import deterministic, devices, full_precision, resolve_device
from .ecosystem import adam, restore_training, save_training
from .incremental import KVCache, at_position
from .model import (
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
from .speed import compiled_forward as compiled_forward
from .speed import forward as forward
from .training import (
    gradients,
    label_smoothed_cross_entropy,
    learning_rate_schedule,
    loss,
    optimizer,
    train_step,
    training_state,
)
from .variants import position_ids

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
    # optax and orbax (ecosystem.py): this port's own
    "adam", "restore_training", "save_training",
]
