"""Reading a Hugging Face model directory: its JSON files, and its weights -- ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) through safetensors' own reader, or a pickled ``pytorch_model.bin`` (or the shards
of ``pytorch_model.bin.index.json``, as larger M2M100 and NLLB models come) only through
``torch.load(weights_only=True)``, which constructs tensors and nothing else. Nothing here runs transformers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_FILE, SAFETENSORS_FILE, SHARDED_INDEX, PICKLE_FILE, PICKLE_INDEX = (
    "config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json")              # in the order transformers' from_pretrained looks for them
GENERATION_FILE = "generation_config.json"


def read_json(path: Path) -> Any:
    """The JSON value of the file ``path``; one ``ValueError`` naming it if it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read {os.fspath(path)!r}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None


def read_config(directory: str | os.PathLike, name: str = CONFIG_FILE) -> dict[str, Any]:
    """The JSON object of the directory's ``config.json`` (or the file ``name``)."""
    if not Path(directory).is_dir():
        raise ValueError(f"{os.fspath(directory)!r} is not a directory (a Hugging Face model directory)")
    path = Path(directory) / name
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)!r} must hold a JSON object")
    return data


def read_generation(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The directory's ``generation_config.json``, None if it has none (its settings are then ``config.json``'s,
    as older files hold them)."""
    return read_config(directory, GENERATION_FILE) if (Path(directory) / GENERATION_FILE).exists() else None


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The files the weights are read from, the first of these the directory holds: ``model.safetensors``, the
    shards its index names, ``pytorch_model.bin``, the shards its index names (a large M2M100 or NLLB model's)."""
    root = Path(directory)
    for name in (SAFETENSORS_FILE, SHARDED_INDEX, PICKLE_FILE, PICKLE_INDEX):
        if (root / name).exists():
            return _shards(root / name) if name.endswith(".index.json") else [root / name]
    raise ValueError(f"{os.fspath(root)!r} holds no {SAFETENSORS_FILE}, {SHARDED_INDEX}, {PICKLE_FILE} or "
                     f"{PICKLE_INDEX}")


def _shards(index_path: Path) -> list[Path]:
    """The files a sharded checkpoint's index names in its ``weight_map``: files of its own directory."""
    weight_map = read_config(index_path.parent, index_path.name).get("weight_map")
    shards = list(weight_map.values()) if isinstance(weight_map, dict) else []
    if not shards or any(not isinstance(shard, str) or Path(shard).name != shard for shard in shards):
        raise ValueError(f"{os.fspath(index_path)!r}: weight_map must name shard files of the directory")
    return [index_path.parent / shard for shard in sorted(set(shards))]


def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """The directory's state dict as NumPy arrays, float16 and bfloat16 widened to float32 (exactly)."""
    weights: dict[str, np.ndarray] = {}
    for path in weight_files(directory):
        if path.suffix == ".bin":                   # pytorch_model.bin, or a shard of its index
            weights.update(_read_pickle(path))
        else:
            weights.update(_read_safetensors(path))
    return weights


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file; bfloat16 ones (which NumPy has no type for) widened to float32 exactly, from their
    bytes (a bfloat16 number is the upper half of the float32 with the same value)."""
    from safetensors import safe_open
    try:
        with safe_open(os.fspath(path), framework="numpy") as file:
            names = list(file.keys())
            brain = {name for name in names if file.get_slice(name).get_dtype() == "BF16"}
            weights = {name: _widened(file.get_tensor(name)) for name in names if name not in brain}
    except Exception as err:  # noqa: BLE001 - OSError, or safetensors' SafetensorError: not a safetensors file
        raise ValueError(f"cannot read {os.fspath(path)!r}: {str(err).splitlines()[0]}") from None
    if brain:
        with open(path, "rb") as raw:               # the header safetensors has just validated
            size = int.from_bytes(raw.read(8), "little")
            header = json.loads(raw.read(size))
            for name in brain:
                begin, end = header[name]["data_offsets"]
                raw.seek(8 + size + begin)
                halves = np.frombuffer(raw.read(end - begin), dtype="<u2")
                weights[name] = (halves.astype(np.uint32) << 16).view(np.float32).reshape(header[name]["shape"])
    return weights


def _read_pickle(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{os.fspath(path)!r} is a pickle: reading it needs PyTorch (its weights-only loader); "
                         "pip install 'transformer-reference[torch]', or give the model as model.safetensors") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - the weights-only unpickler refuses anything but tensors
        raise ValueError(f"cannot read {os.fspath(path)!r}: {_pickle_refusal(err)}; the import reads a pickle only "
                         "with torch's weights-only loader (or give the model as model.safetensors)") from None
    if not isinstance(state, dict):
        raise ValueError(f"{os.fspath(path)!r} does not hold a state dict")
    return {name: tensor.detach().float().numpy() if tensor.dtype in (torch.bfloat16, torch.float16)
            else tensor.detach().numpy() for name, tensor in state.items()}


def _pickle_refusal(err: Exception) -> str:
    """The reason torch's weights-only loader gave for refusing a file, in one line: the Python object it holds (a
    class the loader will not construct: unpickling one may run code), or torch's own words for a file that is no
    pickle of tensors -- without its advice to load the file anyway, or its terminal codes."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    unsafe = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if unsafe:
        return f"it holds a Python object ({unsafe.group(1)}) besides tensors, and unpickling one may run code"
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    first = detail.group(1) if detail else (text.strip().splitlines() or [type(err).__name__])[0]
    return f"it is not a pickle of tensors alone ({first.strip()})"


def _widened(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if array.dtype == np.float16 else array
