"""One loading call, as transformers' ``from_pretrained``: ``from_pretrained(name_or_path, dtype=None)`` in the
reference and in every port (each port's ``checkpoint.py``) returns ``(model, tokenizer)`` from

* a shared checkpoint file (docs/checkpoint-format.md),
* the name of a shipped model (``"numbers-en-fr"``; :data:`~reference_numpy.checkpoint.SHIPPED_MODELS`), or
* a Hugging Face model directory of a supported family (Marian, M2M100, NLLB; ``save_pretrained``'s files),
  imported on the fly by :mod:`reference_numpy.hf_import`, nothing written.

``tokenizer`` is the one the file or directory holds, ready to encode and decode (the project's BPE, or the family's
:class:`~reference_numpy.hf_tokenizer.FamilyTokenizer`; the ``text`` extra's ``tokenizers``), or None where it holds
none; a port's model keeps its JSON text as ``model.tokenizer_json``, as its ``load_checkpoint`` does, so that its
``save_checkpoint`` writes it with the weights. ``dtype`` (float64, float32, bfloat16 or float16) rounds the weights;
by default they keep the file's dtype (a directory's float16 weights load as float32, as
:func:`~reference_numpy.hf_import.load_hf` reads them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .checkpoint import load_run, load_tokenizer_json
from .config import TransformerConfig
from .hf_import import load_hf
from .hf_tokenizer import FamilyTokenizer, read_hf_tokenizer, read_tokenizer
from .model import Transformer
from .precision import parse_dtype
from .tokenizer import Tokenizer

Loaded = Tokenizer | FamilyTokenizer | None


def is_hf_directory(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` names a directory (read as a Hugging Face model's): a file or a shipped model's name
    is a checkpoint."""
    return Path(name_or_path).is_dir()


def read_hf_directory(directory: str | os.PathLike) -> tuple[TransformerConfig, dict[str, np.ndarray], str | None]:
    """``(config, params, tokenizer JSON text or None)`` of a Hugging Face model directory, as its import would
    write them (:func:`~reference_numpy.hf_import.import_hf`), held in memory, the weights in the file's dtype."""
    config, params = load_hf(directory)
    return config, params, read_hf_tokenizer(directory, config)


def tokenizer_of(text: str | None, config: TransformerConfig) -> Loaded:
    """The tokenizer of a checkpoint's tokenizer text, None for none."""
    return None if text is None else read_tokenizer(text, config)


def model_dtype(params: dict[str, Any], dtype: npt.DTypeLike | None) -> np.dtype:
    """``dtype``, or by default the one float dtype of a checkpoint's arrays: what a model is built in."""
    return parse_dtype(next(iter(params.values())).dtype if dtype is None else dtype)


def from_pretrained(name_or_path: str | os.PathLike, dtype: npt.DTypeLike | None = None) -> tuple[Transformer, Loaded]:
    """``(model, tokenizer)`` of a checkpoint file, a shipped model's name or a Hugging Face directory (this
    module's docstring); the reference's parallel of each port's ``checkpoint.from_pretrained``."""
    if is_hf_directory(name_or_path):
        config, params, text = read_hf_directory(name_or_path)
    else:
        config, params, _ = load_run(name_or_path, dtype)
        text = load_tokenizer_json(name_or_path)
    return Transformer(config, params, model_dtype(params, dtype)), tokenizer_of(text, config)


def port_from_pretrained(name_or_path: str | os.PathLike, dtype: npt.DTypeLike | None,
                         build: Callable[[TransformerConfig, dict[str, np.ndarray], np.dtype], Any],
                         load: Callable[[str | os.PathLike, npt.DTypeLike | None], Any]) -> tuple[Any, Loaded]:
    """A port's ``from_pretrained``: a Hugging Face directory's model ``build(config, params, dtype)`` with the
    directory's tokenizer text kept as ``model.tokenizer_json``, anything else ``load(name_or_path, dtype)`` (the
    port's ``load_checkpoint``, which keeps the file's); then ``(model, tokenizer)``."""
    if is_hf_directory(name_or_path):
        config, params, text = read_hf_directory(name_or_path)
        model = build(config, params, model_dtype(params, dtype))
        model.tokenizer_json = text
    else:
        model = load(name_or_path, dtype)
    return model, tokenizer_of(model.tokenizer_json, model.config)
