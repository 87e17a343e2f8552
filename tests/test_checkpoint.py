"""The shared checkpoint: name table, seeded initialization, round trip, and one clear error for
every kind of bad file."""

from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
import zlib

import numpy as np
import pytest
from safetensors.numpy import save_file

from reference_numpy import (FORMAT_VERSION, TransformerConfig, init_params, load_checkpoint, parameter_shapes,
                             save_checkpoint)
from reference_numpy.cases import VARIANTS

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
    with pytest.raises(ValueError, match="dtype must be float32 or float64"):
        load_checkpoint(tmp_path / "m.safetensors", dtype=np.float16)


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
    "missing": (edited(encoder__layers__1__ffn__linear2__bias=None), "missing tensor 'encoder.layers.1.ffn.linear2.bias'"),
    "unexpected": ({**good_params(), "encoder.layers.9.ffn.linear1.bias": np.zeros(40)},
                   "unexpected tensor 'encoder.layers.9.ffn.linear1.bias'"),
    "wrong shape": (edited(generator__weight=np.zeros((23, 16))),
                    r"tensor 'generator.weight' has shape \(23, 16\); expected \(16, 23\)"),
    "wrong dtype": (edited(decoder__layers__0__self_attn__q_proj__bias=np.zeros(16, np.float16)),
                    "tensor 'decoder.layers.0.self_attn.q_proj.bias' has dtype F16; expected F32 or F64"),
    "integer dtype": (edited(decoder__layers__0__self_attn__q_proj__bias=np.zeros(16, np.int64)),
                      "has dtype I64; expected F32 or F64"),
    "mixed dtypes": (edited(encoder__layers__0__ffn_norm__bias=np.zeros(16, np.float32)), "tensors mix dtypes"),
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
    for cut, message in ((len(raw) - 100, "data runs past the end of the file"), (200, "is truncated"),
                         (5, "truncated: 5 bytes")):
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
    (struct.pack("<Q", 4) + b"[1,2]", "header is not JSON"),
    (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
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
    np.testing.assert_array_equal(load_checkpoint(path)[1]["generator.weight"], init_params(TINY, seed=2)["generator.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
