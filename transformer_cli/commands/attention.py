"""Attention weights of one layer and head from every requested backend, for ``plot attention``. With a checkpoint
that holds a tokenizer (the default: the shipped numbers model), the input is a sentence and the target its float64
reference translation, and the axes are labelled with the tokens' pieces: cross-attention then shows which source
words each target word is written from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from equivalence import backends
from equivalence.backends import numpy as reference
from equivalence.oracle import SENTENCES, compare_inputs
from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import Tokenizer
from transformer_bench.compare import load_source
from transformer_hf.tokenizers import FamilyTokenizer


def parse_tokens(text: str | None, name: str) -> np.ndarray | None:
    """``--src``/``--tgt``: space-separated token ids as a (1, T) int64 array (None: not given); anything else,
    an id past int64's range included, is one error naming the flag."""
    if text is None:
        return None
    try:
        return np.array([[int(token) for token in text.split()]], dtype=np.int64)
    except (ValueError, OverflowError):
        raise ValueError(f"--{name} must be space-separated integer token ids, got {text!r}") from None


def default_inputs(config: TransformerConfig, params: dict[str, np.ndarray],
                   tokenizer: Tokenizer | FamilyTokenizer | None,
                   text: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, tgt, the ids tgt's positions write) of one sentence: ``text`` (or the second of compare's sentences)
    and its float64 reference greedy translation from the decoder start token (with an M2M100/NLLB tokenizer's
    target language forced first, as ``translate`` does); without a tokenizer, compare's first id sentence."""
    if tokenizer is None:
        if text is not None:
            raise ValueError("--text: this checkpoint has no tokenizer; give token ids with --src and --tgt")
        defaults = compare_inputs(config)
        return defaults["src"][:1], defaults["tgt"][:1], defaults["tgt"][0, 1:]
    src = tokenizer.batch([SENTENCES[1] if text is None else text], "--text")
    tokens = reference.greedy(reference.build(config, params, "float64"), src,
                              forced_bos_id=getattr(tokenizer, "forced_bos_id", None))[0]
    written = tokens[:np.argmax(tokens == config.eos_id) + 1] if (tokens == config.eos_id).any() else tokens
    return src, np.array([[config.start_id, *written[:-1]]]), written


def attention_by_backend(checkpoint: str | Path | None, layer: int | None, head: int, kind: str, src_text: str | None,
                         tgt_text: str | None, names: tuple[str, ...], text: str | None = None,
                         preset: str | None = None, device: str = "cpu",
                         languages: tuple[str | None, str | None] = (None, None),
                         ) -> tuple[dict[str, np.ndarray], list[str], list[str], str]:
    """(label -> (Tq, Tk) weights, query labels, key labels, title) for the first batch row (``layer`` None: the
    last of its stack). Decoder queries are
    labelled with the token each position writes (its input shifted by one), so a row of cross-attention reads
    "to write this word, look at these source words". ``languages`` (``--source-lang``, ``--target-lang``): an
    imported M2M100/NLLB model's (or a multilingual Marian model's), as ``translate`` takes them."""
    _, config, params, tokenizer = load_source(checkpoint, preset, languages)
    layers = config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers
    layer = layers - 1 if layer is None else layer
    if not 0 <= layer < layers:
        raise ValueError(f"--layer must be in [0, {layers}) for {kind} attention in this checkpoint, got {layer}")
    if not 0 <= head < config.n_heads:
        raise ValueError(f"--head must be in [0, {config.n_heads}), got {head}")
    src, tgt = parse_tokens(src_text, "src"), parse_tokens(tgt_text, "tgt")
    written = None if tgt is None else tgt[0, 1:]
    if src is None or tgt is None:
        default_src, default_tgt, default_written = default_inputs(config, params, tokenizer, text)
        src = default_src if src is None else src
        tgt, written = (default_tgt, default_written) if tgt is None else (tgt, written)
    adapters, missing = backends.load(names)
    backends.require_any(names, adapters, missing)
    devices = {name: backends.device_for(adapter, device) for name, adapter in adapters.items()}
    weights = {}
    for adapter in adapters.values():
        model = adapter.build(config, params, "float64", devices[adapter.NAME])
        weights[f"{adapter.NAME} (float64)"] = np.asarray(
            adapter.attention_weights(model, src, tgt, layer, kind))[0, head]
    def label(ids: Any, side: str = "target") -> list[str]:
        return tokenizer.tokens(ids, side) if tokenizer else [str(int(t)) for t in ids]
    src_labels, tgt_labels = label(src[0], "source"), label(tgt[0])
    written_labels = [*label(written), "(next)"][:tgt.shape[1]]
    query, key = (src_labels, src_labels) if kind == "encoder" else \
        (written_labels, tgt_labels) if kind == "decoder_self" else (written_labels, src_labels)
    rows = "" if kind == "encoder" else "; rows: the token each position writes"
    return weights, query, key, f"{kind} attention, layer {layer}, head {head}{rows}"
