"""Attention weights of one layer and head from every requested backend, for ``plot attention``."""

from __future__ import annotations

import numpy as np

from reference_numpy import load_checkpoint

from . import backends
from .compare import compare_inputs, default_checkpoint


def parse_tokens(text: str | None, name: str) -> np.ndarray | None:
    if text is None:
        return None
    try:
        return np.array([[int(token) for token in text.split()]])
    except ValueError:
        raise ValueError(f"--{name} must be space-separated integer token ids, got {text!r}") from None


def attention_by_backend(checkpoint, layer: int, head: int, kind: str, src_text: str | None,
                         tgt_text: str | None, names: tuple[str, ...]):
    """(label -> (Tq, Tk) weights, query labels, key labels, title) for the first batch row."""
    config, params = default_checkpoint() if checkpoint is None else load_checkpoint(checkpoint, dtype=np.float64)
    layers = config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers
    if not 0 <= layer < layers:
        raise ValueError(f"--layer must be in [0, {layers}) for {kind} attention in this checkpoint, got {layer}")
    if not 0 <= head < config.n_heads:
        raise ValueError(f"--head must be in [0, {config.n_heads}), got {head}")
    defaults = compare_inputs(config)
    src = parse_tokens(src_text, "src")
    tgt = parse_tokens(tgt_text, "tgt")
    src = defaults["src"][:1] if src is None else src
    tgt = defaults["tgt"][:1] if tgt is None else tgt
    adapters, missing = backends.load(names)
    backends.require_any(names, adapters, missing)
    weights = {}
    for adapter in adapters.values():
        model = adapter.build(config, params, "float64", "cpu")
        weights[f"{adapter.NAME} (float64)"] = np.asarray(
            adapter.attention_weights(model, src, tgt, layer, kind))[0, head]
    src_labels, tgt_labels = [str(t) for t in src[0]], [str(t) for t in tgt[0]]
    query, key = (src_labels, src_labels) if kind == "encoder" else \
        (tgt_labels, tgt_labels if kind == "decoder_self" else src_labels)
    return weights, query, key, f"{kind} attention, layer {layer}, head {head}"
