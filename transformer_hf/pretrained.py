"""One loading call, as transformers' ``from_pretrained``: ``from_pretrained(name_or_path, backend="numpy",
dtype=None, device=None)`` returns ``(model, tokenizer)`` of the reference or of a port (``backend``: numpy, torch,
jax or tf) from

* a shared checkpoint file (docs/checkpoint-format.md),
* the name of a shipped model (``"numbers-en-fr"``; ``reference_numpy.checkpoint.SHIPPED_MODELS``), or
* a Hugging Face model directory of a supported family (``save_pretrained``'s files), imported on the fly by
  :mod:`.importer`, nothing written.

``tokenizer`` is the one the file or directory holds, ready to encode and decode (the project's BPE, or the family's
:class:`.tokenizers.FamilyTokenizer`; the ``text`` extra's ``tokenizers``), or None where it holds none. The model holds
no tokenizer: the pair travels together, and a save writes the tokenizer it is given (``save_checkpoint(model, path,
tokenizer=tokenizer.to_json())``). ``dtype`` (float64, float32, bfloat16 or float16) rounds the weights; by default they
keep the file's dtype (a directory's float16 weights load as float32, as :func:`.importer.load_hf` reads them).
``device`` places a PyTorch or JAX model (by default the framework's own choice); TensorFlow places its model by
``tf.device``, the reference on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from reference_numpy.checkpoint import load_run
from reference_numpy.model import Transformer
from reference_numpy.precision import parse_dtype

from .importer import read_hf_directory
from .tokenizers import AnyTokenizer, load_tokenizer_json, tokenizer_of

BACKENDS = ("numpy", "torch", "jax", "tf")


def is_hf_directory(name_or_path: str | os.PathLike) -> bool:
    """Whether ``name_or_path`` names a directory (read as a Hugging Face model's): a file or a shipped model's name
    is a checkpoint."""
    return Path(name_or_path).is_dir()


def model_dtype(params: dict[str, Any], dtype: npt.DTypeLike | None) -> np.dtype:
    """``dtype``, or by default the one float dtype of a checkpoint's arrays: what a model is built in."""
    return parse_dtype(next(iter(params.values())).dtype if dtype is None else dtype)


def from_pretrained(name_or_path: str | os.PathLike, backend: str = "numpy", dtype: npt.DTypeLike | None = None,
                    device: str | None = None) -> tuple[Any, AnyTokenizer | None]:
    """``(model, tokenizer)`` of a checkpoint file, a shipped model's name or a Hugging Face directory in
    ``backend`` (the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if device is not None and backend in ("numpy", "tf"):
        raise ValueError(f"device: the {backend} backend takes none (the reference runs on the CPU; TensorFlow "
                         "places a model by tf.device)")
    placed = {} if device is None else {"device": device}
    port = None if backend == "numpy" else _port(backend)
    if is_hf_directory(name_or_path):
        config, params, text = read_hf_directory(name_or_path)
        dtype = model_dtype(params, dtype)
        model = Transformer(config, params, dtype) if port is None else port.from_params(config, params, dtype,
                                                                                         **placed)
    elif port is None:
        config, params, _ = load_run(name_or_path, dtype)
        model, text = Transformer(config, params, model_dtype(params, dtype)), load_tokenizer_json(name_or_path)
    else:
        model, text = port.load_checkpoint(name_or_path, dtype, **placed), load_tokenizer_json(name_or_path)
    return model, tokenizer_of(text, model.config)


def _port(backend: str) -> Any:
    """The port package of ``backend``, imported when asked for (each needs its framework)."""
    if backend == "torch":
        import transformer_torch
        return transformer_torch
    if backend == "jax":
        import transformer_jax
        return transformer_jax
    import transformer_tf
    return transformer_tf
