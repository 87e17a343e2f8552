"""The shared checkpoint: name table, seeded initialization, round trip, and one clear error for
every kind of bad file."""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import pickle
import re
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from equivalence.cases import VARIANTS
from reference_numpy import (
    FORMAT_VERSION,
    TransformerConfig,
    init_params,
    load_checkpoint,
    parameter_shapes,
    save_checkpoint,
)
from reference_numpy.checkpoint import CheckpointReader, TrainingState, load_training_state
from reference_numpy.config import TrainingConfig

TINY = VARIANTS["tiny"]


def documented_init(config, name, shape, seed, perturb):
    """docs/checkpoint-format.md's scheme from PCG64's raw 64-bit outputs: u = (x >> 11) * 2^-53."""
    raw = np.random.PCG64([seed, zlib.crc32(name.encode())]).random_raw(int(np.prod(shape)))
    unit = 2.0 * ((raw >> np.uint64(11)).astype(np.float64) * 2.0 ** -53) - 1.0
    if name.endswith("embed.weight"):
        value = unit * math.sqrt(3.0 / config.d_model)
    elif len(shape) == 2:
        value = unit * math.sqrt(6.0 / (shape[0] + shape[1]))
    elif name.endswith("norm.weight"):
        value = 1.0 + perturb * unit
    else:
        value = perturb * unit
    return value.reshape(shape)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("perturb", [0.0, 0.1])
def test_seeded_init_is_the_documented_bit_exact_scheme(variant, perturb):
    config = VARIANTS[variant]
    params = init_params(config, seed=3, perturb=perturb)
    for name, shape in parameter_shapes(config).items():
        np.testing.assert_array_equal(params[name], documented_init(config, name, shape, 3, perturb), err_msg=name)


def test_seeds_differ_and_float32_is_the_cast_of_float64():
    a, b = init_params(TINY, seed=0), init_params(TINY, seed=1)
    assert all(not np.array_equal(a[name], b[name]) for name in a if name.endswith("proj.weight"))
    f32 = init_params(TINY, seed=0, dtype=np.float32)
    assert all(np.array_equal(f32[name], a[name].astype(np.float32)) for name in a)


def test_names_and_shapes_are_the_documented_layout():
    shapes = parameter_shapes(TINY)
    assert shapes["encoder.layers.0.self_attn.q_proj.weight"] == (16, 16)
    assert shapes["encoder.layers.1.ffn.linear1.weight"] == (16, 40)              # (in, out)
    assert shapes["decoder.layers.2.ffn.linear2.weight"] == (40, 16)
    assert shapes["generator.weight"] == (16, 23)
    assert shapes["src_embed.weight"] == (19, 16) and shapes["tgt_embed.weight"] == (23, 16)
    assert "encoder.norm.weight" not in shapes and "src_pos_embed.weight" not in shapes
    assert "encoder.norm.weight" in parameter_shapes(VARIANTS["pre_ln"])
    assert parameter_shapes(VARIANTS["learned_pe"])["tgt_pos_embed.weight"] == (64, 16)
    shared = parameter_shapes(VARIANTS["shared_embeddings"])
    assert shared["shared_embed.weight"] == (23, 16) and "generator.weight" not in shared
    documented = open("docs/checkpoint-format.md").read()
    for name in {**shapes, **parameter_shapes(VARIANTS["pre_ln"]), **parameter_shapes(VARIANTS["learned_pe"]),
                 **shared}:
        generic = name.replace(".layers.0.", ".layers.{i}.").replace(".layers.1.", ".layers.{i}.") \
                      .replace(".layers.2.", ".layers.{i}.")
        assert f"`{generic}`" in documented, f"{generic} missing from docs/checkpoint-format.md"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_save_then_load_gives_identical_arrays(tmp_path, variant, dtype):
    config = VARIANTS[variant]
    params = init_params(config, seed=5, dtype=dtype, perturb=0.1)
    save_checkpoint(tmp_path / "model.safetensors", config, params)
    loaded_config, loaded = load_checkpoint(tmp_path / "model.safetensors")
    assert loaded_config == config and list(loaded) == list(params)
    for name in params:
        assert loaded[name].dtype == dtype
        np.testing.assert_array_equal(loaded[name], params[name])


def test_load_can_cast(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", TINY, init_params(TINY, dtype=np.float32))
    _, params = load_checkpoint(tmp_path / "m.safetensors", dtype=np.float64)
    assert {value.dtype for value in params.values()} == {np.dtype(np.float64)}
    with pytest.raises(ValueError, match="dtype must be one of float64, float32, bfloat16, float16, got int8"):
        load_checkpoint(tmp_path / "m.safetensors", dtype=np.int8)


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_checkpoints_are_stored_in_low_precision_and_load_into_any(tmp_path, stored):
    """A BF16 or F16 file holds the correctly rounded weights; it loads into every format, exactly (a low format's
    numbers are float32's and float64's too) or rounded again (bfloat16 <-> float16)."""
    exact = init_params(TINY, perturb=0.1)
    save_checkpoint(tmp_path / "m.safetensors", TINY, init_params(TINY, dtype=stored, perturb=0.1))
    raw = (tmp_path / "m.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    codes = {entry["dtype"] for name, entry in json.loads(raw[8:8 + length]).items() if name != "__metadata__"}
    assert codes == {"BF16" if stored == "bfloat16" else "F16"}
    _, params = load_checkpoint(tmp_path / "m.safetensors")
    significand, subnormal = (8, -133) if stored == "bfloat16" else (11, -24)     # bits; the subnormals' spacing
    for name, value in params.items():
        assert value.dtype.name == stored
        error = np.abs(value.astype(np.float64) - exact[name])
        half_ulp = np.maximum(np.ldexp(np.abs(exact[name]), -significand), np.ldexp(1.0, subnormal - 1))
        assert np.all(error <= half_ulp), name
    for target in ("float64", "float32", "bfloat16", "float16"):
        _, loaded = load_checkpoint(tmp_path / "m.safetensors", dtype=target)
        for name, value in loaded.items():
            assert value.dtype.name == target
            expected = params[name].astype(np.float64)
            if {stored, target} == {"bfloat16", "float16"}:      # rounded once from float32, where both are exact
                expected = expected.astype(np.float32).astype(target).astype(np.float64)
            np.testing.assert_array_equal(value.astype(np.float64), expected)


def test_metadata_holds_format_version_and_config(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", TINY, init_params(TINY))
    raw = (tmp_path / "m.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    metadata = json.loads(raw[8:8 + length])["__metadata__"]
    assert metadata["format_version"] == FORMAT_VERSION
    assert TransformerConfig.from_json(metadata["config"]) == TINY


# ----------------------------------------------------------------------------- bad files

def write(tmp_path, tensors, metadata=None):
    path = tmp_path / "bad.safetensors"
    default = {"format_version": FORMAT_VERSION, "config": TINY.to_json()}
    save_file(tensors, str(path), metadata=default if metadata is None else metadata)
    return path


def good_params():
    return init_params(TINY, seed=0)


def edited(**changes):
    params = good_params()
    for name, value in changes.items():
        name = name.replace("__", ".")
        if value is None:
            del params[name]
        else:
            params[name] = value
    return params


BAD_TENSORS = {
    "missing": (edited(encoder__layers__1__ffn__linear2__bias=None),
                "missing tensor 'encoder.layers.1.ffn.linear2.bias'"),
    "unexpected": ({**good_params(), "encoder.layers.9.ffn.linear1.bias": np.zeros(40)},
                   "unexpected tensor 'encoder.layers.9.ffn.linear1.bias'"),
    "wrong shape": (edited(generator__weight=np.zeros((23, 16))),
                    r"tensor 'generator.weight' has shape \(23, 16\); expected \(16, 23\)"),
    "integer dtype": (edited(decoder__layers__0__self_attn__q_proj__bias=np.zeros(16, np.int64)),
                      "has dtype I64; expected F32, F64, BF16 or F16"),
    "mixed dtypes": (edited(encoder__layers__0__ffn_norm__bias=np.zeros(16, np.float32)), "tensors mix dtypes"),
    "mixed low dtypes": (edited(encoder__layers__0__ffn_norm__bias=np.zeros(16, np.float16)), "tensors mix dtypes"),
    "nan": (edited(src_embed__weight=np.full((19, 16), np.nan)), "tensor 'src_embed.weight' holds non-finite"),
    "inf": (edited(encoder__layers__0__ffn__linear1__bias=np.full(40, np.inf)),
            "tensor 'encoder.layers.0.ffn.linear1.bias' holds non-finite"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_give_one_clear_error(tmp_path, case):
    tensors, message = BAD_TENSORS[case]
    path = write(tmp_path, tensors)
    with pytest.raises(ValueError, match=message) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("metadata, message", [
    ({"format_version": "99", "config": TINY.to_json()}, "unknown checkpoint format_version '99'"),
    ({"config": TINY.to_json()}, "no format_version"),
    ({}, "no format_version"),
    ({"format_version": FORMAT_VERSION}, "metadata has no config"),
    ({"format_version": FORMAT_VERSION, "config": '{"d_model": 15}'}, "checkpoint config is invalid: d_model"),
])
def test_bad_metadata_gives_one_clear_error(tmp_path, metadata, message):
    path = write(tmp_path, good_params(), metadata)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_truncated_file(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", TINY, good_params())
    raw = (tmp_path / "m.safetensors").read_bytes()
    for cut, message in ((len(raw) - 100, "truncated or corrupt: the tensor data does not fill the file"),
                         (200, "truncated: the header runs past the end of the file"),
                         (5, r"not a safetensors file \(too short to hold a header; truncated\?\)")):
        (tmp_path / "cut.safetensors").write_bytes(raw[:cut])
        with pytest.raises(ValueError, match=message):
            load_checkpoint(tmp_path / "cut.safetensors")


def test_pickle_is_refused_and_never_loaded(tmp_path):
    class Bomb:
        def __reduce__(self):
            return (open, (str(tmp_path / "executed"), "w"))

    (tmp_path / "m.pt").write_bytes(pickle.dumps({"weights": Bomb()}, protocol=4))
    with pytest.raises(ValueError, match="pickle or torch.save archive"):
        load_checkpoint(tmp_path / "m.pt")
    assert not (tmp_path / "executed").exists()
    with zipfile.ZipFile(tmp_path / "archive.pt", "w") as archive:            # torch.save's format
        archive.writestr("archive/data.pkl", pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="pickle or torch.save archive"):
        load_checkpoint(tmp_path / "archive.pt")


@pytest.mark.parametrize("content, message", [
    (b"hello world, not a checkpoint", "not a safetensors file"),
    (struct.pack("<Q", 4) + b"[1,2]", r"malformed safetensors header \(not a JSON object\)"),
    (struct.pack("<Q", 2) + b"[]", r"malformed safetensors header \(not a JSON object\)"),
    (struct.pack("<Q", 5) + b"nope!", r"malformed safetensors header \(expected ident at line 1 column 2\)"),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", "malformed safetensors header"),
])
def test_non_safetensors_files(tmp_path, content, message):
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "x.safetensors")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere.safetensors")


def test_failed_save_writes_nothing(tmp_path):
    params = good_params()
    params["encoder.layers.0.ffn.linear1.bias"] = np.zeros(41)
    with pytest.raises(ValueError, match="encoder.layers.0.ffn.linear1.bias"):
        save_checkpoint(tmp_path / "m.safetensors", TINY, params)
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_atomically(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, TINY, init_params(TINY, seed=1))
    save_checkpoint(path, TINY, init_params(TINY, seed=2))
    np.testing.assert_array_equal(load_checkpoint(path)[1]["generator.weight"],
                                  init_params(TINY, seed=2)["generator.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


# ----------------------------------------------------------------------------- malformed headers

def layout(params, **changes):
    """Header entries and data of ``params`` laid out back to back, then ``changes`` applied to
    single entries (``name=dict(...)``); the file is written byte by byte, as the library would
    refuse to write a bad one."""
    entries, chunks, offset = {}, [], 0
    for name, value in params.items():
        raw = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
        entries[name] = {"dtype": {4: "F32", 8: "F64"}[value.itemsize], "shape": list(value.shape),
                         "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    for name, change in changes.items():
        entries[name.replace("__", ".")].update(change)
    return entries, b"".join(chunks)


def handmade(tmp_path, entries, data, metadata=None):
    metadata = {"format_version": FORMAT_VERSION, "config": TINY.to_json()} if metadata is None else metadata
    header = json.dumps({"__metadata__": metadata, **entries}).encode()
    path = tmp_path / "handmade.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def load_error(path) -> str:
    with pytest.raises(ValueError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {str(path)!r}: "), message
    return message


def test_handmade_layout_of_good_params_loads(tmp_path):
    """The helper below writes valid files: every refusal after it is the edit's doing."""
    params = good_params()
    config, loaded = load_checkpoint(handmade(tmp_path, *layout(params)))
    assert config == TINY and all(np.array_equal(loaded[name], params[name]) for name in params)


def test_overlapping_tensors_are_refused(tmp_path):
    """Two tensors sharing bytes: the q bias points at the k bias's bytes and its own are dropped."""
    params = good_params()
    shared = "decoder.layers.0.self_attn.k_proj.bias"
    entries, data = layout({name: value for name, value in params.items() if name != shared.replace("k_", "q_")})
    entries[shared.replace("k_", "q_")] = dict(entries[shared])
    message = load_error(handmade(tmp_path, entries, data))
    assert re.search(r"tensor 'decoder\.layers\.0\.self_attn\.[qk]_proj\.bias' has invalid data_offsets "
                     r"\(tensors lie back to back, with no overlap and no gap\)", message), message


def test_gaps_and_reversed_offsets_are_refused(tmp_path):
    params = good_params()
    last = list(params)[-1]
    entries, data = layout(params)
    begin, end = entries[last]["data_offsets"]
    entries[last]["data_offsets"] = [begin + 8, end + 8]                       # 8 unused bytes before it
    gapped = data[:begin] + bytes(8) + data[begin:]
    assert f"tensor '{last}' has invalid data_offsets" in load_error(handmade(tmp_path, entries, gapped))
    entries, data = layout(params)
    entries[last]["data_offsets"] = [end, begin]
    assert f"tensor '{last}' has invalid data_offsets" in load_error(handmade(tmp_path, entries, data))


@pytest.mark.parametrize("change, message", [
    ({"shape": ["16"]}, 'invalid type: string "16", expected usize'),
    ({"shape": [16.0]}, "invalid type: floating point `16.0`, expected usize"),
    ({"shape": [-16]}, "invalid value: integer `-16`, expected usize"),
    ({"shape": 16}, "invalid type: integer `16`, expected a sequence"),
    ({"data_offsets": [0]}, "invalid length 1, expected a tuple of size 2"),
    ({"data_offsets": [-128, 0]}, "invalid value: integer `-128`, expected usize"),
    ({"data_offsets": [0.0, 128.0]}, "invalid type: floating point `0.0`, expected usize"),
    ({"dtype": "F99"}, "unknown variant `F99`"),
    ({"dtype": None}, "invalid type: null"),
])
def test_malformed_entries_get_one_line_naming_the_file(tmp_path, change, message):
    entries, data = layout(good_params(), encoder__layers__0__self_attn__q_proj__bias=change)
    text = load_error(handmade(tmp_path, entries, data))
    assert "malformed safetensors header (" in text and message in text, text


@pytest.mark.parametrize("change, message", [
    ({"shape": [17]}, "a tensor's data_offsets do not match its shape and dtype"),
    ({"shape": [2 ** 62, 16]}, "a tensor's shape is too large"),
])
def test_offsets_that_do_not_fit_the_shape(tmp_path, change, message):
    entries, data = layout(good_params(), encoder__layers__0__self_attn__q_proj__bias=change)
    assert load_error(handmade(tmp_path, entries, data)).endswith(message)


def test_missing_field_bad_entry_bad_metadata_and_trailing_bytes(tmp_path):
    entries, data = layout(good_params())
    del entries["generator.weight"]["data_offsets"]
    assert "missing field `data_offsets`" in load_error(handmade(tmp_path, entries, data))
    entries, data = layout(good_params())
    entries["generator.weight"] = [0, 8]
    assert "malformed safetensors header (" in load_error(handmade(tmp_path, entries, data))
    entries, data = layout(good_params())
    assert "expected a string" in load_error(handmade(tmp_path, entries, data, {"format_version": 1}))
    assert "the tensor data does not fill the file" in load_error(handmade(tmp_path, entries, data + bytes(8)))


@pytest.mark.parametrize("code, itemsize", [("F8_E4M3", 1), ("I64", 8), ("I32", 4), ("U8", 1), ("BOOL", 1),
                                            ("C64", 8)])
def test_other_dtypes_are_refused_by_name(tmp_path, code, itemsize):
    """Formats other than F32, F64, BF16 and F16 are refused by their code before any array is made."""
    params = good_params()
    name = "encoder.layers.1.ffn_norm.bias"
    entries, data = layout({key: value for key, value in params.items() if key != name})
    entries[name] = {"dtype": code, "shape": [16], "data_offsets": [len(data), len(data) + 16 * itemsize]}
    message = load_error(handmade(tmp_path, entries, data + bytes(16 * itemsize)))
    assert message.endswith(f"tensor '{name}' has dtype {code}; expected F32, F64, BF16 or F16"), message


def test_loaded_arrays_are_copies_that_outlive_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, TINY, good_params())
    _, params = load_checkpoint(path)
    assert all(value.base is None and value.flags.writeable for value in params.values())
    if Path("/proc/self/maps").exists():                                        # Linux: neither mapped nor open
        assert str(path) not in Path("/proc/self/maps").read_text()
        assert not [fd for fd in Path("/proc/self/fd").iterdir() if fd.exists() and fd.resolve() == path]
    path.unlink()
    np.testing.assert_array_equal(params["generator.weight"], good_params()["generator.weight"])


# ----------------------------------------------------------------------------- training state (format version 2)

def training_state(params, step=3, **changes):
    rng = np.random.default_rng(5)
    moments = [{name: rng.standard_normal(value.shape) for name, value in params.items()} for _ in range(2)]
    state = TrainingState(TrainingConfig(warmup_steps=40), step, moments[0],
                          {name: value ** 2 for name, value in moments[1].items()})
    return state._replace(**changes)


def test_training_state_round_trips_beside_the_parameters(tmp_path):
    params = good_params()
    state = training_state(params)
    save_checkpoint(tmp_path / "run.safetensors", TINY, params, training=state)
    config, loaded = load_checkpoint(tmp_path / "run.safetensors")
    assert config == TINY and list(loaded) == list(params)
    again = load_training_state(tmp_path / "run.safetensors")
    assert again.step == 3 and again.config == TrainingConfig(warmup_steps=40)
    for mine, theirs in ((state.first_moments, again.first_moments), (state.second_moments, again.second_moments)):
        assert set(theirs) == set(params) and all(np.array_equal(mine[name], theirs[name]) for name in params)
    as32 = load_training_state(tmp_path / "run.safetensors", dtype="float32")
    assert all(value.dtype == np.float32 for value in as32.first_moments.values())
    with safe_open(tmp_path / "run.safetensors", framework="numpy") as handle:
        names, metadata = set(handle.keys()), handle.metadata()
    assert names == set(params) | {f"adam.{m}.{name}" for m in "mv" for name in params}
    assert json.loads(metadata["training"]) == {"step": 3, "config": TrainingConfig(warmup_steps=40).to_dict()}


def test_a_file_without_training_state_has_none(tmp_path):
    save_checkpoint(tmp_path / "m.safetensors", TINY, good_params())
    assert load_training_state(tmp_path / "m.safetensors") is None


def test_version_1_files_still_load(tmp_path):
    """A file written before the training state existed (format_version "1", parameters only)."""
    path = write(tmp_path, good_params(), {"format_version": "1", "config": TINY.to_json()})
    config, params = load_checkpoint(path)
    assert config == TINY and all(np.array_equal(params[name], good_params()[name]) for name in params)
    assert load_training_state(path) is None


@pytest.mark.parametrize("change, problem", [
    (lambda s: s._replace(first_moments={k: v for k, v in s.first_moments.items() if k != "generator.weight"}),
     "missing tensor 'adam.m.generator.weight'"),
    (lambda s: s._replace(second_moments={**s.second_moments, "encoder.norm.weight": np.ones(16)}),
     "unexpected tensor 'adam.v.encoder.norm.weight'"),
    (lambda s: s._replace(first_moments={**s.first_moments, "generator.weight": np.zeros((23, 16))}),
     "tensor 'adam.m.generator.weight' has shape (23, 16)"),
    (lambda s: s._replace(second_moments={**s.second_moments, "generator.weight": -np.ones((16, 23))}),
     "tensor 'adam.v.generator.weight' holds non-finite or negative values"),
    (lambda s: s._replace(first_moments={**s.first_moments, "generator.weight": np.full((16, 23), np.nan)}),
     "tensor 'adam.m.generator.weight' holds non-finite values"),
    (lambda s: s._replace(step=-1), "training step must be an int >= 0, got -1"),
    (lambda s: s._replace(step=True), "training step must be an int >= 0, got True"),
    (lambda s: s._replace(config={"warmup_steps": 4}), "training config must be a TrainingConfig, got dict"),
])
def test_a_bad_training_state_is_refused_naming_the_tensor(tmp_path, change, problem):
    state = change(training_state(good_params()))
    with pytest.raises(ValueError, match=re.escape(problem)):
        save_checkpoint(tmp_path / "run.safetensors", TINY, good_params(), training=state)
    assert not (tmp_path / "run.safetensors").exists()


@pytest.mark.parametrize("metadata, tensors, problem", [
    ({"training": "{not json"}, {}, "training record is not JSON text (JSONDecodeError: "),
    ({"training": json.dumps({"step": 1})}, {}, "training record field 'config' is missing"),
    ({"training": json.dumps({"step": 1, "config": {"warmup": 1}})}, {},
     "training record field 'config' is invalid: unknown training config field 'warmup'"),
    ({"training": json.dumps({"step": "1", "config": {}})}, {},
     "training record field 'step' must be an integer, got \"1\""),
    ({"training": json.dumps({"step": -1, "config": {}})}, {}, "training step must be an int >= 0, got -1"),
    ({}, {"adam.m.generator.weight": np.zeros((16, 23))}, "unexpected tensor 'adam.m.generator.weight'"),
])
def test_a_bad_training_record_in_a_file_is_one_line(tmp_path, metadata, tensors, problem):
    params = good_params()
    moments = {f"adam.{m}.{name}": np.zeros_like(value) for m in "mv" for name, value in params.items()} \
        if "training" in metadata else {}
    path = write(tmp_path, {**params, **moments, **tensors},
                 {"format_version": FORMAT_VERSION, "config": TINY.to_json(), **metadata})
    for read in (load_checkpoint, load_training_state):
        with pytest.raises(ValueError, match=re.escape(problem)) as err:
            read(path)
        assert str(err.value).startswith(f"checkpoint {str(path)!r}: ") and "\n" not in str(err.value)


_TRIM_PROBE = """
import ctypes
ctypes.CDLL(None).mallopt(-1, 1 << 30)      # M_TRIM_THRESHOLD: free() itself gives back nothing
import numpy as np
from pathlib import Path
from reference_numpy.checkpoint import release_freed_memory

def anonymous_mib():
    status = Path("/proc/self/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith("RssAnon:")).split()[1]) / 1024

large, small = [], []
for _ in range(512):
    large.append(np.ones(96 * 1024 // 4, np.float32))
    small.append(np.ones(512, np.float32))
large.clear()
before = anonymous_mib()
release_freed_memory()
print(before - anonymous_mib(), len(small))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim") or not Path("/proc/self/status").exists(),
                    reason="needs glibc's malloc_trim and Linux's /proc (what release_freed_memory acts on)")
def test_release_freed_memory_returns_the_freed_heap_pages():
    """Arrays of 96 KiB (under glibc's mmap threshold: on the heap) interleaved with 2 KiB ones that stay
    (above NumPy's small-block cache, so they sit between the large ones on the heap): freeing the large
    ones leaves 48 MiB of free pages between live chunks, which glibc keeps; the call must give most of
    them back. Run in a fresh interpreter: in a long-lived process the freed chunks may reuse pages that
    earlier frees had already given back, and the measure would depend on what ran before. glibc's trim threshold
    is raised first: where the heap's earlier layout let the large arrays end up at its top (every run under a
    fixed PYTHONHASHSEED, as tox sets), free() itself gave them back and the call had nothing to return."""
    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert float(out[0]) > 24, f"the freed heap pages stayed resident: {out[0]} MiB of 48 returned"
    assert out[1] == "512"


def test_the_reader_checks_the_header_before_reading_any_tensor(tmp_path):
    """CheckpointReader: a wrong shape is refused when the reader is made, from the header alone (no tensor read:
    every allocation is recorded), with load_checkpoint's one-line error naming the file."""
    params = good_params()
    params["encoder.layers.0.ffn.linear1.weight"] = params["encoder.layers.0.ffn.linear1.weight"].T.copy()
    path = write(tmp_path, params)
    with pytest.raises(ValueError) as expected:
        load_checkpoint(path)
    with pytest.raises(ValueError) as made:
        CheckpointReader(path)
    assert str(made.value) == str(expected.value)
    assert str(made.value).startswith(f"checkpoint {str(path)!r}: tensor 'encoder.layers.0.ffn.linear1.weight' has sh")


def test_the_reader_reads_each_tensor_into_the_memory_given_then_the_training_state(tmp_path):
    params, allocated = good_params(), []
    save_checkpoint(tmp_path / "run.safetensors", TINY, params, training=training_state(params))
    reader = CheckpointReader(tmp_path / "run.safetensors")
    assert reader.config == TINY and reader.dtype == np.float64 and reader.training is None

    def allocate(name, shape, dtype):
        allocated.append((name, np.full(shape, -1.0, dtype)))
        return allocated[-1][1]

    read = list(reader.read(allocate))
    assert [name for name, _ in read] == list(parameter_shapes(TINY)) == [name for name, _ in allocated]
    assert all(value is given for (_, value), (_, given) in zip(read, allocated))
    assert all(np.array_equal(value, params[name]) for name, value in read)
    assert reader.training.step == 3 and set(reader.training.first_moments) == set(params)


def test_the_reader_refuses_a_non_finite_tensor_when_it_reaches_it(tmp_path):
    params = good_params()
    last = list(params)[-1]
    params[last] = np.full_like(params[last], np.inf)
    tensors = CheckpointReader(write(tmp_path, params)).read()
    assert [name for name, _ in itertools.islice(tensors, len(params) - 1)] == list(parameter_shapes(TINY))[:-1]
    with pytest.raises(ValueError, match=rf"bad.safetensors': tensor '{re.escape(last)}' holds non-finite"):
        next(tensors)
