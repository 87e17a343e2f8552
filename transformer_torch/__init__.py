"""PyTorch port of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

A parallel text of ``reference_numpy``: ``nn.Module``s with the reference's names, loading the
shared safetensors checkpoint and agreeing with the NumPy reference under its tolerance policy.
See ``docs/torch.md``.
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
from .ecosystem import TranslationDataset
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
from .speed import compile_decoding as compile_decoding  # a port-only name, outside __all__
from .speed import pack_weights as pack_weights  # a port-only name, outside __all__
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
    # torch.utils.data (ecosystem.py): this port's own
    "TranslationDataset",
]
