"""The shared checkpoint through every port's adapter: port-saved files load into the reference
bit-identically, reference-saved files load into the port exactly, and every kind of bad file
gives the reference loader's own one-line error."""

from __future__ import annotations

import importlib
import struct
import zipfile

import numpy as np
import pytest
from safetensors.numpy import save_file
from support import FRAMEWORKS, adam_moment_memory, port_backend

from equivalence.cases import VARIANTS, seeded_params
from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy.precision import round_to


def tensor_bytes(path) -> bytes:
    """A safetensors file's data section (its JSON header's key order is not fixed)."""
    raw = path.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little"):]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_port_saved_checkpoint_loads_into_reference_bit_identically(tmp_path, port, variant, dtype):
    backend, config = port_backend(port), VARIANTS[variant]
    params = {name: value.astype(dtype) for name, value in seeded_params(config).items()}
    backend.save(backend.build(config, params, dtype, "cpu"), tmp_path / "port.safetensors")
    reference_checkpoint.save_checkpoint(tmp_path / "reference.safetensors", config, params)
    loaded_config, loaded = reference_checkpoint.load_checkpoint(tmp_path / "port.safetensors")
    assert loaded_config == config and list(loaded) == list(params)
    for name, value in params.items():
        assert loaded[name].dtype == value.dtype and loaded[name].tobytes() == value.tobytes(), name
    assert tensor_bytes(tmp_path / "port.safetensors") == tensor_bytes(tmp_path / "reference.safetensors")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_reference_saved_checkpoint_loads_into_port_exactly(tmp_path, port, variant):
    backend, config = port_backend(port), VARIANTS[variant]
    params = seeded_params(config)
    reference_checkpoint.save_checkpoint(tmp_path / "reference.safetensors", config, params)
    exported = backend.export_params(backend.load(tmp_path / "reference.safetensors", "float64", "cpu"))
    assert list(exported) == list(params)
    for name, value in params.items():
        assert exported[name].dtype == np.float64 and exported[name].tobytes() == value.tobytes(), name



@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_loading_gives_the_memory_freed_back_once_the_model_is_built(tmp_path, port, monkeypatch):
    """Each port's loader drops the arrays the reader returned and then calls the reference's
    ``release_freed_memory`` (glibc keeps freed heap pages otherwise: ``scripts/bench_memory.py``)."""
    config = VARIANTS["shared_embeddings"]
    reference_checkpoint.save_checkpoint(tmp_path / "reference.safetensors", config, seeded_params(config))
    calls = []
    monkeypatch.setattr(reference_checkpoint, "release_freed_memory", lambda: calls.append(1))
    port_backend(port).load(tmp_path / "reference.safetensors", "float64", "cpu")
    assert calls == [1]


def bad_files(tmp_path) -> dict:
    config = VARIANTS["tiny"]
    params = seeded_params(config)
    metadata = {"format_version": reference_checkpoint.FORMAT_VERSION, "config": config.to_json()}
    files = {"absent": tmp_path / "absent.safetensors"}

    def write(kind, tensors, meta=metadata):
        files[kind] = tmp_path / f"{kind}.safetensors"
        save_file(tensors, str(files[kind]), metadata=meta)

    write("missing tensor", {k: v for k, v in params.items() if k != "decoder.layers.1.ffn.linear2.bias"})
    write("unexpected tensor", {**params, "encoder.layers.7.ffn.linear1.bias": np.zeros(40)})
    write("transposed", {**params, "encoder.layers.0.ffn.linear1.weight":
                         params["encoder.layers.0.ffn.linear1.weight"].T.copy()})
    write("nan", {**params, "generator.weight": np.full_like(params["generator.weight"], np.nan)})
    write("float16", {**params, "src_embed.weight": params["src_embed.weight"].astype(np.float16)})
    write("version", params, {**metadata, "format_version": "9"})
    raw = files["missing tensor"].read_bytes()
    for kind, content in (("truncated", raw[:len(raw) // 2]), ("tiny", raw[:5]),
                          ("pickle", b"\x80\x04\x95" + bytes(40)),
                          ("not json", struct.pack("<Q", 5) + b"nope!")):
        files[kind] = tmp_path / f"{kind}.bin"
        files[kind].write_bytes(content)
    files["torch.save"] = tmp_path / "model.pt"
    with zipfile.ZipFile(files["torch.save"], "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    return files


@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_bad_checkpoints_give_the_reference_errors(tmp_path, port):
    backend = port_backend(port)
    for kind, path in bad_files(tmp_path).items():
        with pytest.raises(ValueError) as expected:
            reference_checkpoint.load_checkpoint(path)
        with pytest.raises(ValueError) as port_error:
            backend.load(path, "float64", "cpu")
        assert str(port_error.value) == str(expected.value), kind
        assert "\n" not in str(port_error.value), kind


@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_loading_keeps_each_tensor_where_the_reader_read_it(tmp_path, port, monkeypatch):
    """A tensor stored in the model's dtype and layout is read straight into the framework's memory, and the model
    holds it there (no second copy: issue 27); written through after loading, the reader's array is the weight."""
    backend, config = port_backend(port), VARIANTS["shared_embeddings"]
    params = {name: value.astype(np.float32) for name, value in seeded_params(config).items()}
    reference_checkpoint.save_checkpoint(tmp_path / "f32.safetensors", config, params)
    read, original = {}, reference_checkpoint.CheckpointReader.read

    def recording(self, allocate=None):
        for name, value in original(self, allocate):
            read[name] = value
            yield name, value

    monkeypatch.setattr(reference_checkpoint.CheckpointReader, "read", recording)
    model = backend.load(tmp_path / "f32.safetensors", "float32", "cpu")
    flipped = set(importlib.import_module(f"transformer_{port}.checkpoint").transposed(config))
    for value in read.values():
        value[...] = 7.0                                                 # the read array, written after loading
    exported = backend.export_params(model)
    assert list(read) == list(params)
    assert [name for name in read if name not in flipped and not (exported[name] == 7.0).all()] == []
    assert not any((exported[name] == 7.0).any() for name in flipped)   # transposed: copies


@pytest.mark.parametrize(("stored", "loaded"), [("float64", "bfloat16"), ("bfloat16", "float32"),
                                                ("float32", "float16"), ("float16", "float64")])
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_a_file_loads_into_another_dtype_rounded_once(tmp_path, port, stored, loaded):
    """A tensor not in the model's dtype is read, rounded once by the reference's round_to, and placed."""
    backend, config = port_backend(port), VARIANTS["tiny"]
    params = {name: round_to(value, stored) for name, value in seeded_params(config).items()}
    reference_checkpoint.save_checkpoint(tmp_path / "stored.safetensors", config, params)
    exported = backend.export_params(backend.load(tmp_path / "stored.safetensors", loaded, "cpu"))
    for name, value in params.items():
        expected = round_to(value, loaded)
        assert exported[name].dtype == expected.dtype and exported[name].tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("variant", ["tiny", "shared_embeddings"])
@pytest.mark.parametrize("port", list(FRAMEWORKS))
def test_a_resumed_optimizer_holds_each_saved_moment_once_and_exactly(tmp_path, port, variant):
    """Issue 27: ``checkpoint.load_training_state`` reads each moment into memory the port's optimizer takes as
    its own: the optimizer's m and v are the saved arrays, bit for bit, and live where the state's arrays do (no
    copy; a transposed weight's moment too, read into the framework's layout)."""
    config = VARIANTS[variant]
    params = {name: value.astype(np.float32) for name, value in seeded_params(config).items()}
    rng = np.random.default_rng(3)
    first = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in params.items()}
    second = {name: rng.random(value.shape).astype(np.float32) for name, value in params.items()}
    saved = reference_checkpoint.TrainingState(reference_checkpoint.TrainingConfig(), 12, first, second)
    reference_checkpoint.save_checkpoint(tmp_path / "run.safetensors", config, params, saved)
    checkpoint = importlib.import_module(f"transformer_{port}.checkpoint")
    training = importlib.import_module(f"transformer_{port}.training")
    model = checkpoint.load_checkpoint(tmp_path / "run.safetensors")
    state = checkpoint.load_training_state(tmp_path / "run.safetensors")
    optimizer = training.optimizer(model, state=state)
    resumed = training.training_state(model, optimizer)
    assert resumed.step == 12
    for moments, expected in ((resumed.first_moments, first), (resumed.second_moments, second)):
        assert list(moments) == list(expected)
        for name, value in expected.items():
            assert moments[name].dtype == value.dtype and moments[name].tobytes() == value.tobytes(), name
    held = {name: (state.first_moments[name].ctypes.data, state.second_moments[name].ctypes.data) for name in first}
    assert adam_moment_memory(port, model, optimizer) == held
