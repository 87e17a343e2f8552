"""The shared checkpoint: one safetensors file read by the reference and by every port.

* tensors are flat, named as in ``docs/checkpoint-format.md``; every projection is stored
  (in, out) so that y = x @ W + b;
* the file's metadata holds ``format_version`` and ``config`` (the config as JSON);
* optionally (format version 2) a training run's state: Adam's moments as ``adam.m.NAME`` and
  ``adam.v.NAME`` beside each tensor, and ``training`` (step count, training config and a float16 run's loss
  scale, JSON);
* optionally a tokenizer (``tokenizer``: its JSON text, with ``tokenizer_version``), so that one file is a complete
  translator: the project's BPE (:mod:`reference_numpy.tokenizer`), checked here, or a record another layer writes and
  reads, which the reference stores and returns as data (:class:`StoredTokenizer`);
* all tensors have one dtype: float32, float64, bfloat16 or float16 (safetensors' F32, F64, BF16, F16);
* nothing in a checkpoint is ever executed: safetensors is a JSON header plus raw bytes.

Every loader takes a path or the name of a shipped model (:data:`SHIPPED_MODELS`, :func:`resolve_checkpoint`): an
existing file always wins over a name.

Loading lets the safetensors library read and check the file, validates the checkpoint on top
and raises one ``ValueError`` naming the file, the problem and the tensor. Saving writes a
``.partial`` file beside the target and renames it, so the target is never half-written; a ``.partial`` file left
by a save that was killed (SIGKILL, power loss) is removed by the next save to that path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import io
import json
import mmap
import os
import re
import secrets
import stat
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as _safetensors_save

from . import precision, records
from .config import TrainingConfig, TransformerConfig
from .precision import BFLOAT16, FLOAT16, parse_dtype, round_to
from .tokenizer import TOKENIZER_VERSION, check_tokenizer_json

try:
    import fcntl
except ImportError:                     # Windows: no advisory locks, so no .partial file is taken for abandoned
    fcntl = None  # type: ignore[assignment]  # the module is absent there; its uses check for None

FORMAT_VERSION = "2"
READABLE_VERSIONS = ("1", "2")  # version 1: parameters only, no training state
MOMENTS = ("adam.m.", "adam.v.")  # prefixes of Adam's first and second moments of each tensor
DTYPES = {"F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "BF16": BFLOAT16, "F16": FLOAT16}
MAX_STEP = 2 ** 63 - 1  # a run's step count is an int64 in every backend: [0, MAX_STEP] (docs/training.md)
PARTIAL_SUFFIX = ".partial"  # NAME.<8 hex digits>.partial: a save in progress, or one that was interrupted
# The trained models shipped with the package, by name: package data of the reference (pyproject.toml), so that
# every layer above it -- the ports, the harness, the command line's default model -- finds them by name.
_SHIPPED_DIRECTORY = Path(__file__).resolve().parent / "models"
SHIPPED_MODELS = {"numbers-en-fr": _SHIPPED_DIRECTORY / "numbers-en-fr.safetensors"}
# A checkpoint's tokenizer is of one of two kinds, told apart by its text and written beside it as tokenizer_version:
# BPE, the project's own (reference_numpy/tokenizer.py), checked against the config here; RECORD, a record that another
# layer writes and reads (an imported model's tokenizer: its fields, checks and code live in that layer,
# docs/checkpoint-format.md), which the reference stores and returns as data: a JSON object naming its "family".
BPE, RECORD = "bpe", "record"
TOKENIZER_VERSIONS = {BPE: TOKENIZER_VERSION, RECORD: "2"}


class StoredTokenizer(NamedTuple):
    """A checkpoint's tokenizer as data: its JSON ``text`` and its ``kind``, :data:`BPE` or :data:`RECORD`."""

    text: str
    kind: str


def stored_tokenizer(text: str) -> StoredTokenizer:
    """``text`` with its kind: a record when it is a JSON object naming its ``family``, else the project's BPE."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        data = None
    return StoredTokenizer(text, RECORD if isinstance(data, dict) and "family" in data else BPE)


def check_stored_tokenizer(stored: StoredTokenizer, config: TransformerConfig) -> None:
    """A tokenizer as the reference checks it, with the standard library: the project's BPE against ``config``
    (:func:`reference_numpy.tokenizer.check_tokenizer_json`); a record as a JSON object whose ``family`` is a
    string (the layer that reads a record checks its other fields). One ``ValueError`` naming the field."""
    if stored.kind == BPE:
        check_tokenizer_json(stored.text, config)
    else:
        records.record(records.parse_json(stored.text, "tokenizer"), "tokenizer", {"family": str}, others=True)


# ----------------------------------------------------------------------------- the name table

class Parameter(NamedTuple):
    """One trained tensor of the architecture: its checkpoint ``name`` and ``shape``, its ``kind`` (what it is in
    any framework, the key of each port's layout table: ``shared_embedding``, ``embedding``, ``position``,
    ``linear.weight``, ``linear.bias``, ``layernorm.gain``, ``layernorm.bias``, ``generator``, ``generator.bias``) and
    its ``module``
    (the layer it belongs to, its name's prefix; for an embedding or a learned position table, the side: ``src`` or
    ``tgt``)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    module: str


def parameters(config: TransformerConfig) -> list[Parameter]:
    """Every tensor of a checkpoint for ``config``, in a fixed order: the architecture walked once (sections
    3.1-3.4). :func:`parameter_shapes` and each port's name table are computed from it."""
    d, f = config.d_model, config.d_ff
    tensors: list[Parameter] = []

    def linear(module: str, n_in: int, n_out: int) -> None:                  # y = x @ W + b, W stored (in, out)
        tensors.extend((Parameter(f"{module}.weight", (n_in, n_out), "linear.weight", module),
                        Parameter(f"{module}.bias", (n_out,), "linear.bias", module)))

    def attention(module: str) -> None:                                       # section 3.2.2
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear(f"{module}.{proj}", d, d)

    def norm(module: str) -> None:
        tensors.extend((Parameter(f"{module}.weight", (d,), "layernorm.gain", module),
                        Parameter(f"{module}.bias", (d,), "layernorm.bias", module)))

    def ffn(module: str) -> None:                                             # section 3.3
        linear(f"{module}.linear1", d, f)
        linear(f"{module}.linear2", f, d)

    if config.share_embeddings:                                               # section 3.4: one matrix, three uses
        tensors.append(Parameter("shared_embed.weight", (config.src_vocab_size, d), "shared_embedding", "shared"))
    else:
        tensors.extend(Parameter(f"{side}_embed.weight", (vocab, d), "embedding", side)
                       for side, vocab in (("src", config.src_vocab_size), ("tgt", config.tgt_vocab_size)))
    if config.positional_encoding == "learned":                               # section 3.5's alternative
        tensors.extend(Parameter(f"{side}_pos_embed.weight", (config.max_len + config.position_offset, d),
                                 "position", side) for side in ("src", "tgt"))
    if config.embedding_norm:                                                 # before each stack's first layer
        norm("src_embed_norm")
        norm("tgt_embed_norm")
    for i in range(config.n_encoder_layers):                                  # section 3.1
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
        tensors.append(Parameter("generator.weight", (d, config.tgt_vocab_size), "generator", "generator"))
    if config.output_bias:                                                    # a bias added to every logit
        tensors.append(Parameter("generator.bias", (config.tgt_vocab_size,), "generator.bias", "generator"))
    return tensors


def parameter_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint for ``config``, name -> shape, in a fixed order (:func:`parameters`)."""
    return {tensor.name: tensor.shape for tensor in parameters(config)}


def count_parameters(config: TransformerConfig) -> int:
    """Number of trained scalars (the sinusoidal table is not a parameter)."""
    return sum(int(np.prod(shape)) for shape in parameter_shapes(config).values())


# ----------------------------------------------------------------------------- initialization

def init_params(config: TransformerConfig, seed: int = 0, dtype: npt.DTypeLike = np.float64,
                perturb: float = 0.0) -> dict[str, np.ndarray]:
    """Seeded initialization that gives the same bytes on every machine.

    Each tensor draws from its own stream, ``numpy.random.PCG64`` seeded with
    ``[seed, crc32(name)]``, using only uniform doubles (integer arithmetic, no libm):
    * projection matrices: Glorot/Xavier uniform, U(-a, a), a = sqrt(6 / (fan_in + fan_out));
    * embeddings (token and learned position): uniform with standard deviation d_model^-0.5,
      a = sqrt(3 / d_model);
    * biases 0 and LayerNorm weight 1, bias 0 -- or, with ``perturb > 0`` (used by tests so that
      a dropped or transposed bias is caught), U(-perturb, perturb) around those values.
    Values are computed in float64 and rounded to ``dtype``.
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
        params[name] = round_to(value, dtype)
    return params


class LossScaleState(NamedTuple):
    """Where float16's dynamic loss scaling stands (Micikevicius et al., 2018): ``value``, the scale the next step
    multiplies the loss by (a float32 number > 0, as every framework holds it), and ``good_steps``, the finite steps
    in a row since the scale last changed (in [0, ``precision.LOSS_SCALE_GROWTH_INTERVAL``): the scale doubles when it
    reaches the interval)."""

    value: float
    good_steps: int


class TrainingState(NamedTuple):
    """Where a training run stands (section 5.3): enough to continue it in any backend.

    ``first_moments`` and ``second_moments`` are Adam's m_t and v_t (not bias-corrected) for every
    checkpoint tensor, by checkpoint name and in checkpoint layout; ``step`` is t, the number of
    optimizer steps taken (the next step uses t + 1 for the bias correction and the schedule);
    ``loss_scale`` is a float16 mixed-precision run's loss scale, None for any other run (and for a file saved
    before it was kept: a float16 run resumed from it starts again from ``precision.LOSS_SCALE``).
    """

    config: TrainingConfig
    step: int
    first_moments: dict[str, np.ndarray]
    second_moments: dict[str, np.ndarray]
    loss_scale: LossScaleState | None = None

    def astype(self, dtype: npt.DTypeLike) -> TrainingState:
        """A copy with the moments cast to ``dtype`` (a run saved in float32 resumes in float64 and back)."""
        cast = lambda moments: {name: round_to(value, dtype) for name, value in moments.items()}
        return self._replace(first_moments=cast(self.first_moments), second_moments=cast(self.second_moments))


# ----------------------------------------------------------------------------- saving

def save_checkpoint(path: str | os.PathLike, config: TransformerConfig, params: dict[str, np.ndarray],
                    training: TrainingState | None = None, tokenizer: str | None = None) -> None:
    """Write ``params`` and ``config`` (and a run's ``training`` state, and a ``tokenizer``'s JSON text) to a
    safetensors file, atomically.

    The tensors and the tokenizer are validated exactly as :func:`load_checkpoint` would validate them. The
    bytes are written to ``NAME.<8 hex digits>.partial`` beside the file and flushed to disk,
    then renamed over it, so ``path`` always holds a complete file, the old one or the new one.
    A symbolic link is written through (its target is replaced, the link kept). A new file's
    permissions follow the umask; a replaced file keeps its own; a write-protected file is not
    replaced. A file-system failure raises one ``ValueError`` naming ``path`` and leaves it as it was.
    """
    params = {name: np.ascontiguousarray(value) for name, value in params.items()}
    validate_params(config, params)
    metadata = {"format_version": FORMAT_VERSION, "config": config.to_json()}
    if training is not None:
        validate_training_state(config, params, training)
        metadata["training"] = json.dumps(_training_record(training), sort_keys=True)
        params = {**params, **{prefix + name: np.ascontiguousarray(value) for prefix, moments in
                               zip(MOMENTS, (training.first_moments, training.second_moments)) for name, value in
                               moments.items()}}
    if tokenizer is not None:
        if not isinstance(tokenizer, str):
            raise ValueError(f"tokenizer must be a tokenizer's JSON text (Tokenizer.to_json()) or None, got "
                             f"{tokenizer!r}")
        stored = stored_tokenizer(tokenizer)
        check_stored_tokenizer(stored, config)
        metadata.update(tokenizer=tokenizer, tokenizer_version=TOKENIZER_VERSIONS[stored.kind])
    data = _safetensors_save(params, metadata=metadata)
    try:
        _replace_atomically(Path(os.path.realpath(path)), data)
    except OSError as err:
        raise ValueError(f"cannot save checkpoint {os.fspath(path)!r}: {err.strerror or err}") from None


def _training_record(training: TrainingState) -> dict:
    """The ``training`` metadata of a validated state: its step, its config and, if it has one, its loss scale."""
    record = {"step": training.step, "config": training.config.to_dict()}
    if training.loss_scale is not None:
        record["loss_scale"] = training.loss_scale._asdict()
    return record


def _replace_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to a ``.partial`` file beside ``target``, then rename it over ``target``. The writer holds an
    exclusive lock on its ``.partial`` file until the rename, so that another save can tell it from one left by a
    killed process (no lock held), which it removes first (:func:`_remove_abandoned`)."""
    mode = _kept_mode(target)
    _remove_abandoned(target)
    partial, fd = _locked_partial(target)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            if mode is not None:
                os.chmod(partial, mode)
            os.replace(partial, target)
        finally:
            os.close(fd)                                             # releases the lock, after the rename
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _locked_partial(target: Path) -> tuple[Path, int]:
    """A new ``NAME.<8 hex digits>.partial`` beside ``target``, open for writing and locked; one that another save
    removed between its creation and the lock (as abandoned) is replaced by a fresh name."""
    while True:
        partial = target.with_name(f"{target.name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)  # minus umask
        if fcntl is None:
            return partial, fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return partial, fd
        os.close(fd)


def _remove_abandoned(target: Path) -> list[Path]:
    """Remove the ``.partial`` files beside ``target`` that no living save holds (a save killed mid-write leaves
    one); returns them. A save in progress holds its lock and is left alone."""
    if fcntl is None:
        return []
    pattern = re.compile(re.escape(target.name) + r"\.[0-9a-f]{8}" + re.escape(PARTIAL_SUFFIX))
    removed = []
    for partial in target.parent.glob(f"{glob.escape(target.name)}.*{PARTIAL_SUFFIX}"):
        if not pattern.fullmatch(partial.name):
            continue
        try:
            fd = os.open(partial, os.O_RDONLY)
        except OSError:
            continue                                                 # gone meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(partial)):    # not renamed into place meanwhile
                partial.unlink()
                removed.append(partial)
        except OSError:
            pass                                                     # locked: a save in progress
        finally:
            os.close(fd)
    return removed


def _kept_mode(target: Path) -> int | None:
    """The permission bits of the file about to be replaced (None if there is none); refuses a
    target that is not a regular file or that this process may not write."""
    try:
        status = os.stat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(status.st_mode):
        raise OSError("not a regular file")
    if not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, "the file is write-protected; it was not replaced")
    return stat.S_IMODE(status.st_mode) & 0o777


# ----------------------------------------------------------------------------- loading

def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """The file a loader reads: ``name_or_path`` itself if it exists (a path always wins over a name), else the
    shipped model of that name (:data:`SHIPPED_MODELS`); neither is one ``ValueError`` listing the shipped names."""
    path = Path(name_or_path)
    if os.path.lexists(path):
        return path
    if os.fspath(name_or_path) in SHIPPED_MODELS:
        return SHIPPED_MODELS[os.fspath(name_or_path)]
    raise ValueError(f"checkpoint {os.fspath(name_or_path)!r}: does not exist, and no shipped model has that name "
                     f"(shipped: {', '.join(SHIPPED_MODELS)})")


_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK")  # pickle protocols 2-5; zip (torch.save)
_LIBRARY_PROBLEMS = (                                                        # safetensors' words -> ours
    ("header too small", "not a safetensors file (too short to hold a header; truncated?)"),
    ("header too large", "not a safetensors file (implausible header length)"),
    ("invalid header length", "truncated: the header runs past the end of the file"),
    ("incomplete metadata, file not fully covered",
     "truncated or corrupt: the tensor data does not fill the file as the header says"),
    (r"invalid offset for tensor `(.*)`",
     r"tensor '\1' has invalid data_offsets (tensors lie back to back, with no overlap and no gap)"),
    ("invalid shape, data type, or offset for tensor", "a tensor's data_offsets do not match its shape and dtype"),
    ("overflow computing buffer size", "a tensor's shape is too large"),
    (r"invalid JSON in header: invalid type: .*, expected struct HashMetadata",
     "malformed safetensors header (not a JSON object)"),
    (r"invalid (?:JSON|UTF-8) in header: (.*)", r"malformed safetensors header (\1)"),
)


def load_checkpoint(path: str | os.PathLike,
                    dtype: npt.DTypeLike | None = None) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """Read and validate a shared checkpoint, a file or a shipped model's name (``"numbers-en-fr"``,
    :func:`resolve_checkpoint`); returns ``(config, params)`` in the table's order.

    The safetensors library reads the file and checks its header (offsets, shapes, dtypes);
    this function adds the checkpoint's own checks (metadata, version, config, names, shapes,
    one float dtype, finite values). ``dtype`` (float32, float64, bfloat16 or float16) rounds the tensors
    after validation, one tensor at a time (the weights are never held twice); by default they keep the
    file's dtype: a file stored in any of the four loads into any other. The arrays are copies: nothing
    refers to the file once this returns (while it reads, the operating system maps the file, whose pages
    count in the process's RSS until it is closed). Raises one ``ValueError`` of one line naming the file
    and the problem.
    """
    config, params, _ = load_run(path, dtype)
    return config, params


def release_freed_memory() -> None:
    """Give the memory freed while loading back to the operating system.

    A port copies each array :func:`load_checkpoint` returned into its framework's own memory and drops
    the array. glibc's allocator keeps the freed pages of the arrays it placed on its heap (those under
    its mmap threshold, at most 32 MiB each) for later use, so a process that loaded ``big`` would go on
    holding most of a second copy of the weights (``scripts/bench_memory.py`` measures it, with and without this
    call: docs/benchmarks.md, "Loading memory"). ``malloc_trim(0)`` returns them; on a C library
    without it (not glibc) this does nothing.
    """
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def mapped_array(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A new array in an anonymous memory map of its own: page-aligned (a framework may use it in place), and given
    back to the system as soon as it is dropped. A buffer a loader reads a tensor into and then drops (to copy it
    into another layout) goes here: the C library's allocator would keep it in its heap, and the loading peak with
    it (``scripts/bench_memory.py``: PyTorch's peak went from 1.04x to 1.10-1.34x with its transposed weights read
    into its own allocations)."""
    dtype, size = np.dtype(dtype), int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(size * dtype.itemsize, 1)), dtype, size).reshape(shape)


def load_training_state(path: str | os.PathLike, dtype: npt.DTypeLike | None = None) -> TrainingState | None:
    """The training state saved with the parameters (format version 2), or None if the file has
    none; validated and cast like :func:`load_checkpoint` (the weights are read and checked one at a time, and
    dropped: :meth:`CheckpointReader.read_training`). Each moment is an array in an anonymous memory map of its own
    (:func:`mapped_array`: page-aligned), which JAX and TensorFlow take as their own without a copy (each port's
    ``training.optimizer``); cast to another ``dtype``, a copy."""
    return CheckpointReader(path).read_training(dtype=dtype)


def load_tokenizer_json(path: str | os.PathLike) -> str | None:
    """The JSON text of the tokenizer saved in the checkpoint (checked as :func:`check_stored_tokenizer` checks it),
    or None if it has none. Reads the file's header only. (The project's BPE tokenizer, ready to encode and
    decode: ``Tokenizer.from_json(text, config)``.)"""
    return _read_header(path)[0].get("tokenizer")


def load_stored_tokenizer(path: str | os.PathLike) -> tuple[StoredTokenizer, TransformerConfig] | None:
    """The checkpoint's tokenizer as data (:class:`StoredTokenizer`), with the config it belongs to; None if the file
    has none. Reads the file's header only."""
    metadata, config = _read_header(path)
    return None if "tokenizer" not in metadata else (stored_tokenizer(metadata["tokenizer"]), config)


def _read_header(path: str | os.PathLike) -> tuple[dict, TransformerConfig]:
    """The file's metadata and its validated config (and tokenizer), without the tensors."""
    file = resolve_checkpoint(path)
    with _naming(path):
        metadata, config, _, _, _ = _read_file(file, tensors=False)
    return metadata, config


def load_run(path: str | os.PathLike, dtype: npt.DTypeLike | None = None,
             ) -> tuple[TransformerConfig, dict[str, np.ndarray], TrainingState | None]:
    """``(config, params, training state or None)`` from one read of the file: :func:`load_checkpoint` and
    :func:`load_training_state` together, for resuming a run."""
    target = None if dtype is None else parse_dtype(dtype)
    reader = CheckpointReader(path)
    params = {name: value if target is None else round_to(value, target)      # cast as read: never two copies
              for name, value in reader.read()}                               # of the weights; the table's order
    state = reader.training
    if target is not None:
        state = state and state.astype(target)
    return reader.config, params, state


class CheckpointReader:
    """A checkpoint read one tensor at a time, so that a backend puts each tensor straight into its framework's
    memory and never holds the weights twice (docs/checkpoint-format.md, "Reading a file").

    Made, it has read and checked the file's header: the metadata (a tokenizer's included, which it does not
    keep: :func:`load_stored_tokenizer` reads it), ``config``, ``dtype`` (the tensors' one dtype) and every tensor's
    name, shape and dtype (:func:`validate_params`'s checks but finiteness). A problem is
    :func:`load_checkpoint`'s one ``ValueError``, raised where it is met: a header's before any tensor is read.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path, self._file = path, resolve_checkpoint(path)
        self.training: TrainingState | None = None
        with _naming(path):
            _, self.config, self._record, self._start, self._entries = _read_file(self._file)
            self.dtype = _check_entries(self.config, self._entries)

    def read(self, allocate: Allocate | None = None, moments: Allocate | None = None,
             ) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, array)`` for every parameter in the table's order (:func:`parameter_shapes`), each read into
        ``allocate(name, shape, dtype)`` (a new writable array of the file's ``dtype``; by default a NumPy array; a
        backend gives a view of memory its framework allocated) and checked (finite) as it is read.
        After the last it reads and checks the training state, if any, as ``training`` (None until then, and for a
        file without one), each moment into ``moments(name, shape, dtype)`` (``name`` is ``adam.m.NAME`` or
        ``adam.v.NAME``; by default :func:`mapped_array`). An array that is not C-contiguous (a backend's transposed
        layout) is filled through a temporary copy of that one tensor."""
        with _naming(self.path), open(self._file, "rb") as file:
            for name in parameter_shapes(self.config):
                value = _read_tensor(file, self._start, name, self._entries[name], allocate or _new_array)
                _check_finite(name, value)
                yield name, value
            read = {name: _read_tensor(file, self._start, name, self._entries[name], moments or _mapped_array)
                    for name in sorted(self._entries) if name.startswith(MOMENTS)}
            self.training = _training_state(self.config, parameter_stand_ins(self.config, self.dtype), self._record,
                                            read)

    def read_record(self) -> TrainingState | None:
        """The training state as the header describes it, no tensor read: its config, step and loss scale, and each
        Adam moment as a stand-in of its shape and dtype that holds no memory; checked as :meth:`read` checks a state
        but for the moments' values (finite, second moments >= 0), which only reading them shows. None: the file
        holds no training state."""
        moments = {name: np.broadcast_to(np.zeros((), DTYPES[entry["dtype"]]), entry["shape"])
                   for name, entry in self._entries.items() if name.startswith(MOMENTS)}
        with _naming(self.path):
            return _training_state(self.config, parameter_stand_ins(self.config, self.dtype), self._record, moments)

    def read_training(self, moments: Allocate | None = None, dtype: npt.DTypeLike | None = None,
                      ) -> TrainingState | None:
        """The training state alone (``training`` after :meth:`read`): every weight is read and checked as
        :meth:`read` does, into a buffer of its own that is dropped before the next is read, so that the weights
        are never held; the moments are read into ``moments`` as :meth:`read` says (cast to ``dtype``, if given:
        a copy)."""
        target = None if dtype is None else parse_dtype(dtype)
        for _ in self.read(_mapped_array, moments):
            pass
        return self.training if self.training is None or target is None else self.training.astype(target)


Allocate = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]   # (name, shape, dtype) -> array to read into


def _new_array(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype)


def _mapped_array(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return mapped_array(shape, dtype)


def parameter_stand_ins(config: TransformerConfig, dtype: npt.DTypeLike) -> dict[str, np.ndarray]:
    """Every parameter of ``config`` as an array of its shape and ``dtype`` that holds no memory (one zero,
    broadcast): what :func:`validate_training_state` reads of the parameters, for a backend whose weights live in
    its framework (no copy of them is made to check a state)."""
    zero = np.zeros((), dtype)
    return {name: np.broadcast_to(zero, shape) for name, shape in parameter_shapes(config).items()}


@contextlib.contextmanager
def _naming(path: str | os.PathLike) -> Iterator[None]:
    """A problem met while reading ``path`` as one ``ValueError`` of one line naming the file."""
    try:
        yield
    except (SafetensorError, OSError) as err:
        raise ValueError(f"checkpoint {os.fspath(path)!r}: {_library_problem(err)}") from None
    except ValueError as err:
        raise ValueError(f"checkpoint {os.fspath(path)!r}: {err}") from None


def _training_state(config: TransformerConfig, params: dict[str, np.ndarray], training: dict | None,
                    moments: dict[str, np.ndarray]) -> TrainingState | None:
    """The ``training`` metadata and the ``adam.*`` tensors as a validated :class:`TrainingState`."""
    if training is None:
        _refuse_names("unexpected", sorted(moments))                     # moments without a training record
        return None
    first, second = ({name[len(prefix):]: value for name, value in moments.items() if name.startswith(prefix)}
                     for prefix in MOMENTS)
    state = TrainingState(training["config"], training["step"], first, second, training["loss_scale"])
    validate_training_state(config, params, state)
    return state


def validate_training_state(config: TransformerConfig, params: dict[str, np.ndarray], state: TrainingState) -> None:
    """Check a training state against the parameters it belongs to: a ``TrainingConfig``, a step
    count in [0, ``MAX_STEP``] (the int64 count of every backend's optimizer), a loss scale if any
    (:func:`validate_loss_scale`), and one first and one second moment per tensor with its shape and dtype, finite,
    second moments >= 0. One ``ValueError`` naming the field or the tensor (``adam.m.NAME``/``adam.v.NAME``)."""
    if not isinstance(state.config, TrainingConfig):
        raise ValueError(f"training config must be a TrainingConfig, got {type(state.config).__name__}")
    if not isinstance(state.step, (int, np.integer)) or isinstance(state.step, bool) or state.step < 0:
        raise ValueError(f"training step must be an int >= 0, got {state.step!r}")
    if state.step > MAX_STEP:
        raise ValueError(f"training step must be <= 2**63 - 1 (an int64 count in every backend), got {state.step}")
    if state.loss_scale is not None:
        validate_loss_scale(state.loss_scale)
    for prefix, moments in zip(MOMENTS, (state.first_moments, state.second_moments)):
        _refuse_names("missing", [prefix + name for name in params if name not in moments])
        _refuse_names("unexpected", sorted(prefix + name for name in set(moments) - set(params)))
        for name, value in moments.items():
            value, expected = np.asarray(value), params[name]
            if value.shape != expected.shape or value.dtype != expected.dtype:
                raise ValueError(f"tensor {prefix + name!r} has shape {value.shape} and dtype {value.dtype}; "
                                 f"expected {expected.shape} and {expected.dtype}, as {name!r}")
            if not np.isfinite(value).all() or (prefix == MOMENTS[1] and (value < 0).any()):
                raise ValueError(f"tensor {prefix + name!r} holds non-finite"
                                 f"{' or negative' if prefix == MOMENTS[1] else ''} values")


def validate_loss_scale(loss_scale: LossScaleState) -> None:
    """A saved loss scale as every backend can hold it: ``value`` a finite float32 number > 0 (each framework's scale
    is a float32), ``good_steps`` an int in [0, ``LOSS_SCALE_GROWTH_INTERVAL``). One ``ValueError`` naming the
    field."""
    value, good_steps = loss_scale
    if (not isinstance(value, (float, int, np.floating, np.integer)) or isinstance(value, bool)
            or not 0 < value <= float(np.finfo(np.float32).max) or float(np.float32(value)) != value):
        raise ValueError(f"training loss_scale.value must be a finite float32 number > 0, got {value!r}")
    interval = precision.LOSS_SCALE_GROWTH_INTERVAL
    if (not isinstance(good_steps, (int, np.integer)) or isinstance(good_steps, bool)
            or not 0 <= good_steps < interval):
        raise ValueError(f"training loss_scale.good_steps must be an int in [0, {interval}) (the growth interval), "
                         f"got {good_steps!r}")


def _regular_file(path: Path) -> Path:
    """``path`` if it is a regular file and not a pickle or torch.save archive (those are never read)."""
    if not path.is_file():
        raise ValueError("does not exist or is not a regular file")
    with open(path, "rb") as handle:
        if handle.read(2) in _PICKLE_MAGIC:
            raise ValueError("looks like a pickle or torch.save archive; only safetensors checkpoints "
                             "are read (pickles are never loaded)")
    return path


def _read_file(path: Path, tensors: bool = True) -> tuple[dict, TransformerConfig, dict | None, int, dict]:
    """(metadata, config, training record or None, where the tensors' data starts, the header's entry of each
    tensor by name: none unless ``tensors``), checked.

    safetensors' own reader checks the header (offsets, shapes, dtypes: tensors back to back, covering the file);
    the tensors' bytes are then read by :class:`CheckpointReader` (:func:`_read_tensor`), not through the library's
    memory map, whose pages would count in the process's memory beside the copies until it is closed."""
    with safe_open(_regular_file(path), framework="numpy") as handle:
        metadata = handle.metadata()
        config, training = _read_metadata(metadata)
    if not tensors:
        return metadata, config, training, 0, {}
    with open(path, "rb") as file:
        return metadata, config, training, *_tensor_entries(file)


def _tensor_entries(file: io.BufferedReader) -> tuple[int, dict]:
    """Where the tensors' data starts in a safetensors ``file`` and its header's entries by name (a little-endian
    u64 header size, then the header's JSON; safetensors checked both)."""
    size = int.from_bytes(file.read(8), "little")
    entries = json.loads(file.read(size))
    entries.pop("__metadata__", None)
    return 8 + size, entries


def _check_entries(config: TransformerConfig, entries: dict) -> np.dtype:
    """The header's tensors checked against ``config`` before any is read (:func:`validate_params` but finiteness;
    the moments' own checks come with their values); their one dtype."""
    for name in sorted(entries):
        if entries[name]["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {entries[name]['dtype']}; expected F32, F64, BF16 or F16")
    _check_layout(config, {name: (tuple(entry["shape"]), DTYPES[entry["dtype"]])
                           for name, entry in entries.items() if not name.startswith(MOMENTS)})
    return DTYPES[entries[next(iter(parameter_shapes(config)))]["dtype"]]


def _library_problem(err: Exception) -> str:
    """safetensors' or the operating system's complaint, as one line of this project's words."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = " ".join(str(err).split()).removeprefix("Error while deserializing header: ")
    for pattern, problem in _LIBRARY_PROBLEMS:
        if match := re.match(pattern, text):
            return match.expand(problem)
    return f"not a readable safetensors file ({text})"


def _read_metadata(metadata: dict[str, str] | None) -> tuple[TransformerConfig, dict | None]:
    """The model config and, if the file holds a training state, ``{"step", "config"}``; a tokenizer, if the
    file holds one, is checked against the config."""
    if not isinstance(metadata, dict) or "format_version" not in metadata:
        raise ValueError("checkpoint metadata has no format_version; not a checkpoint of this project")
    if metadata["format_version"] not in READABLE_VERSIONS:
        raise ValueError(f"unknown checkpoint format_version {metadata['format_version']!r} "
                         f"(this library reads versions {', '.join(READABLE_VERSIONS)})")
    if "config" not in metadata:
        raise ValueError("checkpoint metadata has no config")
    try:
        config = TransformerConfig.from_json(metadata["config"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"checkpoint config is invalid: {err}") from None
    _check_tokenizer_record(metadata, config)
    if "training" not in metadata or metadata["format_version"] == "1":
        return config, None
    return config, _read_training_record(metadata["training"])


TRAINING_RECORD = {"step": int, "config": dict, "loss_scale": dict}    # a file's "training" record: its fields
LOSS_SCALE_RECORD = {"value": records.NUMBER, "good_steps": int}        # and its loss scale's


def _read_training_record(text: str) -> dict:
    """A file's ``training`` record (JSON text) as ``{"step", "config", "loss_scale"}``, each field type-checked
    (:mod:`.records`) before use; the values themselves are checked with the moments (:func:`_training_state`)."""
    name = "training record"
    training = records.record(records.parse_json(text, name), name, TRAINING_RECORD, optional=("loss_scale",))
    scale = training.get("loss_scale")
    if scale is not None:
        records.record(scale, name, LOSS_SCALE_RECORD, within="loss_scale")
    try:
        config = TrainingConfig.from_dict(training["config"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name} field 'config' is invalid: {err}") from None
    return {"step": training["step"], "config": config,
            "loss_scale": None if scale is None else LossScaleState(scale["value"], scale["good_steps"])}


def _check_tokenizer_record(metadata: dict, config: TransformerConfig) -> None:
    if "tokenizer" not in metadata:
        return
    stored = stored_tokenizer(metadata["tokenizer"])
    expected = TOKENIZER_VERSIONS[stored.kind]              # 1: a tokenizers JSON text; 2: a record
    if metadata.get("tokenizer_version") != expected:
        raise ValueError(f"unknown tokenizer_version {metadata.get('tokenizer_version')!r} "
                         f"(this library reads version {expected})")
    check_stored_tokenizer(stored, config)


def _read_tensor(file: io.BufferedReader, start: int, name: str, entry: dict, allocate: Allocate) -> np.ndarray:
    """Tensor ``name`` (its header ``entry``: dtype, shape, data_offsets) read from ``file`` into ``allocate(name,
    shape, dtype)``, in native byte order (safetensors stores little-endian)."""
    array = allocate(name, tuple(entry["shape"]), DTYPES[entry["dtype"]])
    target = array if array.flags.c_contiguous else mapped_array(array.shape, array.dtype)
    file.seek(start + entry["data_offsets"][0])
    if file.readinto(target.reshape(-1).view(np.uint8)) != target.nbytes:  # type: ignore[arg-type]  # a buffer
        raise ValueError("truncated or corrupt: the tensor data does not fill the file as the header says")
    if sys.byteorder == "big":
        target.byteswap(inplace=True)
    if target is not array:
        array[...] = target                                              # into the backend's layout
    return array


def validate_params(config: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """Check names, shapes, dtypes and finiteness against ``config``; one ``ValueError`` if wrong."""
    _check_layout(config, {name: (value.shape, value.dtype) for name, value in params.items()})
    for name in parameter_shapes(config):
        _check_finite(name, params[name])


def _check_layout(config: TransformerConfig, layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Names, shapes and one float dtype (``layout``: name -> (shape, dtype)) against ``config``."""
    expected = parameter_shapes(config)
    _refuse_names("missing", [name for name in expected if name not in layout])
    _refuse_names("unexpected", sorted(set(layout) - set(expected)))
    for name, shape in expected.items():
        found, dtype = layout[name]
        if dtype not in DTYPES.values():
            raise ValueError(f"tensor {name!r} has dtype {dtype}; expected float32, float64, bfloat16 or float16")
        if found != shape:
            raise ValueError(f"tensor {name!r} has shape {found}; expected {shape}")
    dtypes = {dtype for _, dtype in layout.values()}
    if len(dtypes) > 1:
        raise ValueError(f"tensors mix dtypes {sorted(str(t) for t in dtypes)}; a checkpoint has one dtype")


_FINITE_CHUNK = 2 ** 20  # elements checked at a time: the check's own memory stays small beside a large tensor


def _check_finite(name: str, value: np.ndarray) -> None:
    flat = value.reshape(-1)
    if not all(np.isfinite(flat[i:i + _FINITE_CHUNK]).all() for i in range(0, flat.size, _FINITE_CHUNK)):
        raise ValueError(f"tensor {name!r} holds non-finite values (NaN or inf)")


def _refuse_names(problem: str, names: list[str]) -> None:
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ValueError(f"{problem} tensor {names[0]!r}{more}")

