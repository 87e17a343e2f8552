"""The shared checkpoint: one safetensors file read by the reference and by every port.

* tensors are flat, named as in ``docs/checkpoint-format.md``; every projection is stored
  (in, out) so that y = x @ W + b;
* the file's metadata holds ``format_version`` and ``config`` (the config as JSON);
* all tensors have one dtype, float32 or float64;
* nothing in a checkpoint is ever executed: safetensors is a JSON header plus raw bytes.

Loading validates the whole file and raises one ``ValueError`` naming the problem and the
tensor. Saving writes a temporary file and renames it, so a failed save leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save as _safetensors_save

from .config import TransformerConfig

FORMAT_VERSION = "1"
DTYPES = {"F32": np.dtype(np.float32), "F64": np.dtype(np.float64)}
_HEADER_LIMIT = 100_000_000  # safetensors' own header size limit


# ----------------------------------------------------------------------------- the name table

def parameter_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint for ``config``, name -> shape, in a fixed order."""
    d, f = config.d_model, config.d_ff
    shapes: dict[str, tuple[int, ...]] = {}
    if config.share_embeddings:
        shapes["shared_embed.weight"] = (config.src_vocab_size, d)
    else:
        shapes["src_embed.weight"] = (config.src_vocab_size, d)
        shapes["tgt_embed.weight"] = (config.tgt_vocab_size, d)
    if config.positional_encoding == "learned":
        shapes["src_pos_embed.weight"] = (config.max_len, d)
        shapes["tgt_pos_embed.weight"] = (config.max_len, d)

    def attention(prefix: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}.{proj}.weight"] = (d, d)
            shapes[f"{prefix}.{proj}.bias"] = (d,)

    def norm(prefix: str) -> None:
        shapes[f"{prefix}.weight"] = (d,)
        shapes[f"{prefix}.bias"] = (d,)

    def ffn(prefix: str) -> None:
        shapes[f"{prefix}.linear1.weight"] = (d, f)
        shapes[f"{prefix}.linear1.bias"] = (f,)
        shapes[f"{prefix}.linear2.weight"] = (f, d)
        shapes[f"{prefix}.linear2.bias"] = (d,)

    for i in range(config.n_encoder_layers):
        layer = f"encoder.layers.{i}"
        attention(f"{layer}.self_attn")
        norm(f"{layer}.self_attn_norm")
        ffn(f"{layer}.ffn")
        norm(f"{layer}.ffn_norm")
    if config.norm_first:
        norm("encoder.norm")
    for i in range(config.n_decoder_layers):
        layer = f"decoder.layers.{i}"
        attention(f"{layer}.self_attn")
        norm(f"{layer}.self_attn_norm")
        attention(f"{layer}.cross_attn")
        norm(f"{layer}.cross_attn_norm")
        ffn(f"{layer}.ffn")
        norm(f"{layer}.ffn_norm")
    if config.norm_first:
        norm("decoder.norm")
    if not config.share_embeddings:
        shapes["generator.weight"] = (d, config.tgt_vocab_size)
    return shapes


def count_parameters(config: TransformerConfig) -> int:
    """Number of trained scalars (the sinusoidal table is not a parameter)."""
    return sum(int(np.prod(shape)) for shape in parameter_shapes(config).values())


# ----------------------------------------------------------------------------- initialization

def init_params(config: TransformerConfig, seed: int = 0, dtype=np.float64,
                perturb: float = 0.0) -> dict[str, np.ndarray]:
    """Seeded initialization that gives the same bytes on every machine.

    Each tensor draws from its own stream, ``numpy.random.PCG64`` seeded with
    ``[seed, crc32(name)]``, using only uniform doubles (integer arithmetic, no libm):
    * projection matrices: Glorot/Xavier uniform, U(-a, a), a = sqrt(6 / (fan_in + fan_out));
    * embeddings (token and learned position): uniform with standard deviation d_model^-0.5,
      a = sqrt(3 / d_model);
    * biases 0 and LayerNorm weight 1, bias 0 -- or, with ``perturb > 0`` (used by tests so that
      a dropped or transposed bias is caught), U(-perturb, perturb) around those values.
    Values are computed in float64 and cast to ``dtype``.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    params = {}
    for name, shape in parameter_shapes(config).items():
        rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
        unit = 2.0 * rng.random(shape) - 1.0                              # U(-1, 1), float64
        if name.endswith("embed.weight"):
            value = unit * np.sqrt(3.0 / config.d_model)
        elif len(shape) == 2:
            value = unit * np.sqrt(6.0 / (shape[0] + shape[1]))
        elif "norm" in name and name.endswith(".weight"):
            value = 1.0 + perturb * unit
        else:
            value = perturb * unit
        params[name] = value.astype(dtype)
    return params


# ----------------------------------------------------------------------------- saving

def save_checkpoint(path: str | os.PathLike, config: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """Write ``params`` and ``config`` to a safetensors file, atomically.

    The parameters are validated exactly as :func:`load_checkpoint` would validate them.
    """
    params = {name: np.ascontiguousarray(value) for name, value in params.items()}
    validate_params(config, params)
    metadata = {"format_version": FORMAT_VERSION, "config": config.to_json()}
    data = _safetensors_save(params, metadata=metadata)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- loading

def load_checkpoint(path: str | os.PathLike, dtype=None) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """Read and validate a shared checkpoint; returns ``(config, params)``.

    ``dtype`` (float32 or float64) casts the tensors after validation; by default they keep
    the file's dtype. Raises ``ValueError`` with one line that names the problem.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist or is not a file")
    raw = path.read_bytes()
    header, data = _read_header(raw, path)
    metadata = header.pop("__metadata__", None)
    config = _read_metadata(metadata)
    params = {name: _read_tensor(name, entry, data) for name, entry in header.items()}
    validate_params(config, params)
    target = None if dtype is None else _float_dtype(dtype)
    return config, {name: params[name] if target is None else params[name].astype(target)
                    for name in parameter_shapes(config)}                        # in the table's order


def _read_header(raw: bytes, path: Path) -> tuple[dict, memoryview]:
    if raw[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05") or raw[:2] == b"PK":
        raise ValueError(f"{path.name} looks like a pickle or torch.save archive; only safetensors "
                         "checkpoints are read (pickles are never loaded)")
    if len(raw) < 8:
        raise ValueError(f"{path.name} is not a safetensors file (truncated: {len(raw)} bytes)")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > _HEADER_LIMIT:
        raise ValueError(f"{path.name} is not a safetensors file (header length {length} is implausible)")
    if 8 + length > len(raw):
        raise ValueError(f"{path.name} is truncated: header needs {length} bytes, "
                         f"file has {len(raw) - 8} after the length field")
    try:
        header = json.loads(raw[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path.name} is not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file (header is not a JSON object)")
    return header, memoryview(raw)[8 + length:]


def _read_metadata(metadata) -> TransformerConfig:
    if not isinstance(metadata, dict) or "format_version" not in metadata:
        raise ValueError("checkpoint metadata has no format_version; not a checkpoint of this project")
    if metadata["format_version"] != FORMAT_VERSION:
        raise ValueError(f"unknown checkpoint format_version {metadata['format_version']!r} "
                         f"(this library reads version {FORMAT_VERSION})")
    if "config" not in metadata:
        raise ValueError("checkpoint metadata has no config")
    try:
        return TransformerConfig.from_json(metadata["config"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"checkpoint config is invalid: {err}") from None


def _read_tensor(name: str, entry, data: memoryview) -> np.ndarray:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"tensor {name!r}: malformed header entry")
    if entry["dtype"] not in DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}; expected F32 or F64")
    dtype = DTYPES[entry["dtype"]]
    shape = tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    if not 0 <= begin <= end or end > len(data):
        raise ValueError(f"tensor {name!r}: data runs past the end of the file (file truncated?)")
    if end - begin != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes do not hold shape {shape} of {dtype}")
    return np.frombuffer(data[begin:end], dtype=dtype.newbyteorder("<")).reshape(shape).astype(dtype)


def validate_params(config: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """Check names, shapes, dtypes and finiteness against ``config``; one ``ValueError`` if wrong."""
    expected = parameter_shapes(config)
    _refuse_names("missing", [name for name in expected if name not in params])
    _refuse_names("unexpected", sorted(set(params) - set(expected)))
    dtypes = set()
    for name, shape in expected.items():
        value = params[name]
        if value.dtype not in DTYPES.values():
            raise ValueError(f"tensor {name!r} has dtype {value.dtype}; expected float32 or float64")
        dtypes.add(value.dtype)
        if value.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {value.shape}; expected {shape}")
        if not np.isfinite(value).all():
            raise ValueError(f"tensor {name!r} holds non-finite values (NaN or inf)")
    if len(dtypes) > 1:
        raise ValueError(f"tensors mix dtypes {sorted(str(t) for t in dtypes)}; a checkpoint has one dtype")


def _refuse_names(problem: str, names: list[str]) -> None:
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ValueError(f"{problem} tensor {names[0]!r}{more}")


def _float_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype
