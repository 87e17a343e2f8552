"""``transformer-reference export --to TARGET CHECKPOINT OUTPUT_DIR``: a shared checkpoint as an artefact that its
framework's runtime loads and runs without this project (docs/deploy.md).

Every target is a directory holding the framework's artefact of the float32 forward pass (section 3, Figure 1:
token ids src (B, S) and tgt (B, T), the target shifted right, to log-probabilities (B, T, V_tgt); padding masks
computed from ``pad_id`` inside, any batch and any lengths up to ``max_len``), and beside it ``transformer.json``
(the model config: its pad, bos and eos ids and ``max_len`` are what a caller needs; the target; the inputs'
and output's names; for a target that exports one cached decoding step, ``decoding_step``: its largest cache
capacity and its functions' names, inputs and outputs, :data:`STEP`) and, if the checkpoint holds one,
``tokenizer.json`` (the shared BPE vocabulary of section 5.1, a Hugging Face ``tokenizers`` JSON text):

* ``savedmodel``: the Keras port's model through Keras' ``ExportArchive`` (what ``model.export`` runs) -- a
  TensorFlow SavedModel whose ``serve`` endpoint (and ``serving_default`` signature) takes int64 ``src`` and
  ``tgt``; beside it one cached decoding step, the ``encode`` and ``step`` endpoints (:data:`STEP`, int64 ids);
  ``tf.saved_model.load``;
* ``jax-export``: the JAX port's forward pass through ``jax.jit`` and ``jax.export.export`` with symbolic batch
  and lengths (``b``, ``s``, ``t``; s, t <= max_len), serialized to ``forward.jax``; it takes the weights as
  its first argument, a dict of float32 arrays by checkpoint name (``weights.npz``), then int32 ``src`` and
  ``tgt``: ``jax.export.deserialize(...).call(weights, src, tgt)``; beside it one cached decoding step,
  ``encode.jax`` and ``step.jax`` (:data:`STEP`, the weights first too);
* ``torch-export``: the PyTorch port's model through ``torch.export.export`` with dynamic batch and lengths,
  saved by ``torch.export.save`` as ``model.pt2``; ``torch.export.load(...).module()(src, tgt)``; beside it one
  cached decoding step, ``encode.pt2`` and ``step.pt2`` (:data:`STEP`, int64 ids and index);
* ``onnx``: the same captured programs through torch's ONNX exporter (``torch.onnx.export(..., dynamo=True)``),
  ``model.onnx``, inputs ``src``, ``tgt`` (int64), output ``log_probs``, and ``encode.onnx``, ``step.onnx``
  (:data:`STEP`'s input and output names); run by onnxruntime;
* ``ctranslate2``: :mod:`transformer_export.ctranslate2` (a CTranslate2 model directory, its vocabulary the tokenizer's
  pieces);
* ``hf``: :mod:`transformer_hf.exporter` (a Hugging Face Marian or M2M100 model directory, and the tokenizer,
  for transformers' ``AutoModelForSeq2SeqLM`` and ``AutoTokenizer``).

The traced forward passes read no tensor on the host, so an artefact does not check that ids are below the
vocabulary size (the ports' public calls do, before their compiled code): a serving process must pass ids of
the vocabulary. Each export is refused, with one ``ValueError``, when OUTPUT_DIR exists (unless ``force``) or
holds the checkpoint, or when the framework is not installed; it is written into a temporary sibling directory
and renamed into place (:func:`transformer_export.ctranslate2.write_into_place`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from equivalence import runtime
from reference_numpy import records
from reference_numpy.checkpoint import load_checkpoint, resolve_checkpoint
from reference_numpy.config import TransformerConfig
from transformer_export.ctranslate2 import (
    TOKENIZER_FILE,
    check_output,
    export_ctranslate2,
    write_into_place,
)
from transformer_export.outputs import refuse_input
from transformer_hf.exporter import save_hf
from transformer_hf.registry import family_for
from transformer_hf.tokenizer_files import TOKENIZER_CONFIG
from transformer_hf.tokenizers import load_tokenizer_json

MANIFEST = "transformer.json"
MANIFEST_RECORD = {"target": str, "dtype": str, "inputs": list, "output": str, "files": list, "config": dict,
                   "decoding_step": dict}                   # the fields of transformer.json (decoding_step: optional)
INPUTS, OUTPUT = ("src", "tgt"), "log_probs"
# One cached decoding step (docs/deploy.md), float32 arrays and int ids, batch B and source length S of any size,
# the self-attention caches of any capacity C up to max_len (the caller's: the longest output it decodes; each step
# writes a new cache, so a smaller one is cheaper), the projected memory stacked over the N decoder layers:
# ``encode(src (B, S)) -> memory (B, S, D), cross_keys, cross_values (N, B, H, S, d_k)``;
# ``step(token (B, 1), index (), memory, src, self_keys, self_values (N, B, H, C, d_k), cross_keys, cross_values)
# -> log_probs (B, V) of the token after position ``index`` (whose input is ``token``), next_self_keys,
# next_self_values`` (the caches with position ``index`` written; names of their own, as ONNX asks). Greedy
# decoding starts with zero self-attention caches and token = bos at index 0.
STEP = {"encode": {"inputs": ["src"], "outputs": ["memory", "cross_keys", "cross_values"]},
        "step": {"inputs": ["token", "index", "memory", "src", "self_keys", "self_values", "cross_keys",
                            "cross_values"], "outputs": ["log_probs", "next_self_keys", "next_self_values"]}}
EXAMPLE_BATCH, EXAMPLE_LENGTH, EXAMPLE_CAPACITY = 2, 3, 5   # the example a tracer runs: sizes above 1, which torch
                                                            # keeps symbolic, each its own


Progress = Callable[[Iterable], Iterable]


def export(target: str, checkpoint: str | os.PathLike, output_dir: str | os.PathLike, force: bool = False,
           progress: Progress | None = None) -> Path:
    """Write ``checkpoint`` (a file or a shipped model's name) as ``target``'s artefact in ``output_dir`` (see the
    module docstring); ``progress`` wraps the list of programs traced (e.g. a ``tqdm`` bar: seconds each).
    Returns the output directory."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target == "ctranslate2":
        return export_ctranslate2(checkpoint, output_dir, force)
    if target == "hf":
        return export_hf(checkpoint, output_dir, force)
    path = resolve_checkpoint(checkpoint)
    refuse_input(os.fspath(output_dir), [os.fspath(path)], "OUTPUT_DIR")
    check_output(output_dir, force)
    writer = WRITERS[target]
    for module, extra in writer.requires:
        _require(module, extra, target)
    config, params = load_checkpoint(path, dtype=np.float32)
    tokenizer = load_tokenizer_json(path)

    def write(directory: Path) -> None:
        writer(config, params, directory, progress or (lambda programs: programs))
        manifest: dict[str, Any] = {"target": target, "dtype": "float32", "inputs": list(INPUTS), "output": OUTPUT,
                                    "files": writer.files, "config": config.to_dict()}
        if writer.steps:
            manifest["decoding_step"] = {"max_capacity": config.max_len, **{
                function: {"name": writer.steps[function], **names} for function, names in STEP.items()}}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        if tokenizer is not None:
            (directory / TOKENIZER_FILE).write_text(tokenizer, encoding="utf-8")

    return write_into_place(output_dir, force, write)


def export_hf(checkpoint: str | os.PathLike, output_dir: str | os.PathLike, force: bool = False) -> Path:
    """Write ``checkpoint`` (a file or a shipped model's name) as a Hugging Face model directory ``output_dir``
    (:func:`transformer_hf.exporter.save_hf`; its tokenizer too if it holds one): refused over the checkpoint,
    and over an existing ``output_dir`` unless ``force``."""
    path = resolve_checkpoint(checkpoint)
    refuse_input(os.fspath(output_dir), [os.fspath(path)], "OUTPUT_DIR")
    check_output(output_dir, force)
    config, params = load_checkpoint(path)
    family_for(config)                                                  # refused before anything is written
    tokenizer = load_tokenizer_json(path)
    return write_into_place(output_dir, force, lambda directory: save_hf(config, params, directory, tokenizer))


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """An artefact's ``transformer.json``, type-checked before use (:mod:`reference_numpy.records`: one
    ``ValueError`` naming the field), its config a valid ``TransformerConfig``."""
    name = f"artefact manifest {MANIFEST}"
    text = (Path(directory) / MANIFEST).read_text(encoding="utf-8")
    manifest = records.record(records.parse_json(text, name), name, MANIFEST_RECORD, optional=("decoding_step",))
    if "decoding_step" in manifest:
        records.record(manifest["decoding_step"], name, {"max_capacity": int, **dict.fromkeys(STEP, dict)},
                       within="decoding_step")
    try:
        TransformerConfig.from_dict(manifest["config"])
    except ValueError as err:
        raise ValueError(f"{name} field 'config' is invalid: {err}") from None
    return manifest


def _require(module: str, extra: str, target: str) -> None:
    """Import ``module`` quietly (:func:`equivalence.runtime.import_framework`); a ``ValueError`` naming the
    extra that installs it if it is not installed."""
    try:
        runtime.import_framework(module)
    except ModuleNotFoundError:
        raise ValueError(f"exporting to {target} needs {module}: pip install 'transformer-reference[{extra}]'") \
            from None


Write = Callable[[TransformerConfig, dict[str, np.ndarray], Path, Progress], None]


@dataclass(frozen=True)
class Writer:
    """A writer ``(config, params, directory, progress)`` of a target's artefact (``progress`` wraps the list of
    programs it traces), the files it writes, the (module, extra) it needs and, if it exports the cached decoding
    step, the names of its ``encode`` and ``step`` (:data:`STEP`)."""

    write: Write
    files: list[str]
    requires: tuple[tuple[str, str], ...]
    steps: dict[str, str] | None = None

    def __call__(self, config: TransformerConfig, params: dict[str, np.ndarray], directory: Path,
                 progress: Progress) -> None:
        self.write(config, params, directory, progress)


def _writer(files: list[str], *requires: tuple[str, str], steps: dict[str, str] | None = None,
            ) -> Callable[[Write], Writer]:
    """A decorator: the writer it wraps as a :class:`Writer` that writes ``files``, needs ``requires`` and
    exports ``steps``."""
    return lambda function: Writer(function, files, requires, steps)


def example_tokens(config: TransformerConfig) -> np.ndarray:
    """The ids a tracer runs the forward pass on (any ids of the vocabulary: the graph does not depend on them)."""
    return np.full((EXAMPLE_BATCH, EXAMPLE_LENGTH), config.eos_id, dtype=np.int64)


# ----------------------------------------------------------------------------- TensorFlow: a SavedModel

@_writer(["saved_model.pb", "variables/", "assets/", "fingerprint.pb"], ("tensorflow", "tf"),
         steps={"encode": "encode", "step": "step"})
def write_savedmodel(config: TransformerConfig, params: dict[str, np.ndarray], directory: Path,
                     progress: Progress) -> None:
    """The Keras port's float32 model through Keras' ``ExportArchive`` (what ``model.export`` runs) with int64
    (B, S), (B, T) inputs as the ``serve`` endpoint, and beside it the cached decoding step's ``encode`` and
    ``step`` endpoints (:data:`STEP`; int64 ids, capacity up to ``max_len``) through the port's ``encode``,
    ``init_cache``, ``decode`` and ``generator``."""
    import keras
    import tensorflow as tf

    from transformer_tf.checkpoint import from_params
    from transformer_tf.model import KVCache, padding_mask

    model = from_params(config, params, dtype="float32")
    signature = [tf.TensorSpec((None, None), tf.int64, name=name) for name in INPUTS]
    archive = keras.export.ExportArchive()
    archive.track_and_add_endpoint("serve", model, signature)

    def encode(src: tf.Tensor) -> tuple:
        memory = model.encode(src, training=False)
        cross = [layer[1] for layer in model.init_cache(memory, 1)]              # the memory's keys and values
        return memory, tf.stack([c.keys for c in cross]), tf.stack([c.values for c in cross])

    def step(token: tf.Tensor, index: tf.Tensor, memory: tf.Tensor, src: tf.Tensor, self_keys: tf.Tensor,
             self_values: tf.Tensor, cross_keys: tf.Tensor, cross_values: tf.Tensor) -> tuple:
        cache = tuple((KVCache(self_keys[i], self_values[i], position=index), KVCache(cross_keys[i], cross_values[i]))
                      for i in range(config.n_decoder_layers))
        out, cache = model.decode(token, memory, padding_mask(src, config.pad_id), cache=cache, training=False)
        log_probs = model.generator(out)[:, 0]                                       # (B, V)
        return log_probs, tf.stack([own.keys for own, _ in cache]), tf.stack([own.values for own, _ in cache])

    layers, heads, d_k = config.n_decoder_layers, config.n_heads, config.d_k
    src = tf.TensorSpec((None, None), tf.int64, name="src")
    archive.add_endpoint("encode", encode, [src])
    archive.add_endpoint("step", step, [
        tf.TensorSpec((None, 1), tf.int64, name="token"), tf.TensorSpec((), tf.int64, name="index"),
        tf.TensorSpec((None, None, config.d_model), tf.float32, name="memory"), src,
        *(tf.TensorSpec((layers, None, heads, None, d_k), tf.float32, name=name)
          for name in ("self_keys", "self_values")),
        *(tf.TensorSpec((layers, None, heads, None, d_k), tf.float32, name=name)
          for name in ("cross_keys", "cross_values"))])
    for program in progress([archive]):                 # one program: Keras traces its three endpoints here
        program.write_out(str(directory), verbose=False)


# ----------------------------------------------------------------------------- JAX: jax.export

@_writer(["forward.jax", "encode.jax", "step.jax", "weights.npz"], ("jax", "jax"), ("flax", "jax"),
         steps={"encode": "encode.jax", "step": "step.jax"})
def write_jax_export(config: TransformerConfig, params: dict[str, np.ndarray], directory: Path,
                     progress: Progress) -> None:
    """The JAX port's float32 forward pass and its cached decoding step (``encode.jax``, ``step.jax``: see
    :data:`STEP`), ``jax.export``-ed with symbolic batch and lengths, and its weights."""
    import jax

    weights = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in params.items()}
    functions = {"forward": (jax_forward(config, params), jax_input_specs(config, weights)),
                 **jax_step_functions(config, params, weights)}
    for name, (function, specs) in progress(functions.items()):
        exported = jax.export.export(jax.jit(function))(*specs)
        (directory / f"{name}.jax").write_bytes(exported.serialize())
    np.savez(directory / "weights.npz", **weights)   # type: ignore[arg-type]  # numpy's stub: a ** key might be allow_pickle


def jax_model(config: TransformerConfig, params: dict[str, np.ndarray]) -> Callable:
    """``model(weights)``: the JAX port's float32 model with ``weights`` (float32 arrays by checkpoint name, the JAX
    layout being the checkpoint's) in place of its parameters, to call inside a traced function."""
    import jax.numpy as jnp
    from flax import nnx

    from transformer_jax.checkpoint import from_params, name_table

    graphdef, state, *rest = nnx.split(from_params(config, params, dtype=jnp.float32), nnx.Param, ...)
    name_of = {path: name for name, path in name_table(config).items()}
    slots = [(keys, variable, name_of[".".join(map(str, keys))]) for keys, variable in nnx.to_flat_state(state)]

    def model(weights: dict[str, jnp.ndarray]) -> Any:
        given = nnx.from_flat_state([(keys, variable.replace(weights[name])) for keys, variable, name in slots])
        return nnx.merge(graphdef, given, *rest)

    return model


def jax_forward(config: TransformerConfig, params: dict[str, np.ndarray]) -> Callable:
    """``forward(weights, src, tgt)``: the JAX port's model (:func:`jax_model`) in inference mode."""
    model = jax_model(config, params)
    return lambda weights, src, tgt: model(weights)(src, tgt, deterministic=True)


def jax_step_functions(config: TransformerConfig, params: dict[str, np.ndarray],
                       weights: dict[str, np.ndarray]) -> dict[str, tuple[Callable, tuple]]:
    """``encode(weights, src)`` and ``step(weights, token, index, memory, src, self_keys, self_values, cross_keys,
    cross_values)`` (:data:`STEP`) through the JAX port's ``encode``, ``init_cache``, ``decode`` and ``generator``,
    each with its argument specs: symbolic batch ``b``, source length ``s`` and capacity ``c`` (each at most
    ``max_len``)."""
    import jax
    import jax.numpy as jnp

    from transformer_jax.model import KVCache, padding_mask

    model = jax_model(config, params)

    def encode(weights: dict[str, jnp.ndarray], src: jnp.ndarray) -> tuple:
        transformer = model(weights)
        memory = transformer.encode(src, deterministic=True)
        cross = [layer[1] for layer in transformer.init_cache(memory, 1)]        # the memory's keys and values
        return memory, jnp.stack([c.keys for c in cross]), jnp.stack([c.values for c in cross])

    def step(weights: dict[str, jnp.ndarray], token: jnp.ndarray, index: jnp.ndarray, memory: jnp.ndarray,
             src: jnp.ndarray, self_keys: jnp.ndarray, self_values: jnp.ndarray, cross_keys: jnp.ndarray,
             cross_values: jnp.ndarray) -> tuple:
        transformer = model(weights)
        cache = tuple((KVCache(self_keys[i], self_values[i], position=index), KVCache(cross_keys[i], cross_values[i]))
                      for i in range(config.n_decoder_layers))
        out, cache = transformer.decode(token, memory, padding_mask(src, config.pad_id), cache=cache,
                                        deterministic=True)
        log_probs = transformer.generator(out)[:, 0]                                 # (B, V)
        return log_probs, jnp.stack([own.keys for own, _ in cache]), jnp.stack([own.values for own, _ in cache])

    shapes = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in weights.items()}
    batch, src_len = jax.export.symbolic_shape("b, s", constraints=[f"s <= {config.max_len}"])
    encode_specs = (shapes, jax.ShapeDtypeStruct((batch, src_len), np.int32))
    batch, src_len, capacity = jax.export.symbolic_shape(            # c only in the step's: a scope of its own
        "b, s, c", constraints=[f"s <= {config.max_len}", f"c <= {config.max_len}"])
    own = jax.ShapeDtypeStruct((config.n_decoder_layers, batch, config.n_heads, capacity, config.d_k), np.float32)
    cross = jax.ShapeDtypeStruct((config.n_decoder_layers, batch, config.n_heads, src_len, config.d_k), np.float32)
    src = jax.ShapeDtypeStruct((batch, src_len), np.int32)
    step_specs = (shapes, jax.ShapeDtypeStruct((batch, 1), np.int32), jax.ShapeDtypeStruct((), np.int32),
                  jax.ShapeDtypeStruct((batch, src_len, config.d_model), np.float32), src, own, own, cross, cross)
    return {"encode": (encode, encode_specs), "step": (step, step_specs)}


def jax_input_specs(config: TransformerConfig, weights: dict[str, np.ndarray]) -> tuple:
    """The exported function's arguments: the weights' shapes, and int32 ids of symbolic batch ``b`` and lengths
    ``s``, ``t`` of at most ``max_len``."""
    import jax

    batch, src_len, tgt_len = jax.export.symbolic_shape(
        "b, s, t", constraints=[f"s <= {config.max_len}", f"t <= {config.max_len}"])
    shapes = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in weights.items()}
    return shapes, jax.ShapeDtypeStruct((batch, src_len), np.int32), jax.ShapeDtypeStruct((batch, tgt_len), np.int32)


# ----------------------------------------------------------------------------- PyTorch: torch.export and ONNX

def torch_programs(config: TransformerConfig, params: dict[str, np.ndarray]) -> dict[str, tuple]:
    """The PyTorch port's float32 model in eval mode (``forward``) and its cached decoding step (``encode``,
    ``step``: :data:`STEP`, through the port's ``encode``, ``init_cache``, ``decode`` and ``generator``), each with
    the example inputs to trace it on and their dynamic dimensions for ``torch.export``: batch, lengths and the
    caches' capacity (each up to ``max_len``)."""
    import torch

    from transformer_torch.checkpoint import from_params
    from transformer_torch.model import KVCache, padding_mask

    model = from_params(config, params, dtype=torch.float32).eval()
    batch = torch.export.Dim("batch")
    lengths = [torch.export.Dim(f"{name}_length", max=config.max_len) for name in INPUTS]
    example = tuple(torch.from_numpy(example_tokens(config)) for _ in INPUTS)

    class Function(torch.nn.Module):                    # the model as a submodule: its weights are the program's
        def __init__(self) -> None:
            super().__init__()
            self.model = model

    class Encode(Function):
        def forward(self, src: torch.Tensor) -> tuple:
            memory = self.model.encode(src)
            cross = [layer[1] for layer in self.model.init_cache(memory, 1)]     # the memory's keys and values
            return memory, torch.stack([c.keys for c in cross]), torch.stack([c.values for c in cross])

    class Step(Function):
        def forward(self, token: torch.Tensor, index: torch.Tensor, memory: torch.Tensor, src: torch.Tensor,
                    self_keys: torch.Tensor, self_values: torch.Tensor, cross_keys: torch.Tensor,
                    cross_values: torch.Tensor) -> tuple:
            cache = tuple((KVCache(self_keys[i], self_values[i], position=index),
                           KVCache(cross_keys[i], cross_values[i]))
                          for i in range(config.n_decoder_layers))
            out, cache = self.model.decode(token, memory, padding_mask(src, config.pad_id), cache=cache)
            log_probs = self.model.generator(out)[:, 0]                                 # (B, V)
            return log_probs, torch.stack([own.keys for own, _ in cache]), torch.stack([own.values for own, _ in cache])

    src = example[0]
    with torch.no_grad():
        memory, cross_keys, cross_values = Encode()(src)
    own = torch.zeros(config.n_decoder_layers, len(src), config.n_heads, EXAMPLE_CAPACITY, config.d_k)
    step_example = (src[:, :1].clone(), torch.tensor(1), memory, src, own, own.clone(), cross_keys, cross_values)
    capacity = torch.export.Dim("capacity", max=config.max_len)
    caches = (*[{1: batch, 3: capacity}] * 2, *[{1: batch, 3: lengths[0]}] * 2)
    return {"forward": (model, example, tuple({0: batch, 1: length} for length in lengths)),
            "encode": (Encode().eval(), (src,), ({0: batch, 1: lengths[0]},)),
            "step": (Step().eval(), step_example, ({0: batch}, None, *[{0: batch, 1: lengths[0]}] * 2, *caches))}


def _program_files(suffix: str) -> dict[str, str]:
    """Each PyTorch program's file: ``model.SUFFIX`` (the forward pass), ``encode.SUFFIX``, ``step.SUFFIX``."""
    return {"forward": f"model.{suffix}", **{function: f"{function}.{suffix}" for function in STEP}}


PT2, ONNX = _program_files("pt2"), _program_files("onnx")


@_writer(list(PT2.values()), ("torch", "torch"), steps={function: PT2[function] for function in STEP})
def write_torch_export(config: TransformerConfig, params: dict[str, np.ndarray], directory: Path,
                       progress: Progress) -> None:
    """``torch.export.export`` of the PyTorch port's float32 model (``model.pt2``) and of its cached decoding step
    (``encode.pt2``, ``step.pt2``: :data:`STEP`)."""
    import torch

    for function, (module, example, dynamic) in progress(torch_programs(config, params).items()):
        with torch.no_grad():
            program = torch.export.export(module, example, dynamic_shapes=dynamic)
        torch.export.save(program, directory / PT2[function])


@_writer(list(ONNX.values()), ("torch", "torch"), ("onnxscript", "export"), ("onnx", "export"),
         steps={function: ONNX[function] for function in STEP})
def write_onnx(config: TransformerConfig, params: dict[str, np.ndarray], directory: Path,
               progress: Progress) -> None:
    """torch's ONNX exporter (``dynamo=True``: from ``torch.export``'s program) on the PyTorch port's float32
    model, inputs ``src``, ``tgt`` and output ``log_probs`` (``model.onnx``), and on its cached decoding step
    (``encode.onnx``, ``step.onnx``: :data:`STEP`'s names)."""
    import torch

    names = {"forward": {"inputs": list(INPUTS), "outputs": [OUTPUT]}, **STEP}
    for function, (module, example, dynamic) in progress(torch_programs(config, params).items()):
        with torch.no_grad(), _exporter_notices_held():
            program = torch.onnx.export(module, example, dynamo=True, dynamic_shapes=dynamic,
                                        input_names=names[function]["inputs"],
                                        output_names=names[function]["outputs"], verbose=False)
        program.save(str(directory / ONNX[function]))   # type: ignore[union-attr]  # torch's stub: dynamo=True returns one


@contextlib.contextmanager
def _exporter_notices_held() -> Iterator[None]:
    """torch's ONNX exporter without the notices it prints on every export of a correct program: operators of
    torchvision (not installed) skipped, an axis name shared by inputs, a deprecation inside torch."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used", category=UserWarning)
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        registration.setLevel(level)


def describe(target: str, output: Path) -> str:
    """What the export wrote into ``output``, for the command's report."""
    if target == "ctranslate2":
        vocabulary = "the checkpoint's BPE vocabulary" if (output / TOKENIZER_FILE).exists() else "<N> token names"
        return f"a float32 CTranslate2 model with {vocabulary} (ctranslate2.Translator)"
    if target == "hf":
        family = json.loads((output / "config.json").read_text(encoding="utf-8"))["model_type"]
        tokenizer = ("and its tokenizer (AutoTokenizer)" if (output / TOKENIZER_CONFIG).exists()   # every family's
                     else "without a tokenizer (the checkpoint holds none)")
        return f"a Hugging Face {family} model (AutoModelForSeq2SeqLM.from_pretrained) {tokenizer}"
    return DESCRIPTIONS[target]


DESCRIPTIONS = {"savedmodel": "a float32 TensorFlow SavedModel of the forward pass and cached decoding step "
                              "(tf.saved_model.load(OUTPUT_DIR).serve(src, tgt), .encode, .step)",
                "jax-export": "a float32 jax.export forward pass, cached decoding step and their weights "
                              "(jax.export.deserialize)",
                "torch-export": "a float32 torch.export program of the forward pass and its cached decoding step "
                                "(torch.export.load(OUTPUT_DIR/model.pt2), encode.pt2, step.pt2)",
                "onnx": "a float32 ONNX model of the forward pass and its cached decoding step "
                        "(onnxruntime.InferenceSession(OUTPUT_DIR/model.onnx), encode.onnx, step.onnx)"}
WRITERS = {"savedmodel": write_savedmodel, "jax-export": write_jax_export, "torch-export": write_torch_export,
           "onnx": write_onnx}
TARGETS = ("ctranslate2", "hf", *WRITERS)
