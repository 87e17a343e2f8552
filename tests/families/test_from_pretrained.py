"""``transformer_hf.from_pretrained(name_or_path, backend, dtype=None)`` -> ``(model, tokenizer)`` in the reference
and every port (``transformer_hf/pretrained.py``): a checkpoint file, the shipped ``numbers-en-fr`` and a tiny random
Hugging Face Marian directory (support.tiny_separate_marian, built and saved by transformers), imported in memory.

Oracles: the file's tensors as the safetensors library reads them (no code of the project's reader), transformers'
MarianTokenizer for the directory's tokenizer and transformers' ``generate`` for its greedy tokens."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from support import FRAMEWORKS, SOURCE, float64_inference, port_backend

from equivalence.cases import VARIANTS, seeded_params
from reference_numpy.checkpoint import SHIPPED_MODELS, save_checkpoint
from reference_numpy.tokenizer import Tokenizer
from transformer_hf import from_pretrained
from transformer_hf.tokenizers import FamilyTokenizer

BACKENDS = ("numpy", *FRAMEWORKS)




def loaded(name: str, name_or_path, dtype=None):
    """``(params in checkpoint layout, tokenizer)`` of ``from_pretrained`` in backend ``name``."""
    adapter = port_backend(name) if name != "numpy" else None
    with float64_inference(name) if name != "torch" else contextlib.nullcontext():
        model, tokenizer = from_pretrained(name_or_path, name, dtype=dtype)
        params = model.params if adapter is None else adapter.export_params(model)
        return {key: np.asarray(value) for key, value in params.items()}, tokenizer


def safetensors_tensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return load_file(str(path))


@pytest.mark.parametrize("name", BACKENDS)
def test_from_pretrained_loads_a_checkpoint_file_in_its_dtype_or_another(name, tmp_path):
    config = VARIANTS["tiny"]
    path = tmp_path / "tiny.safetensors"
    save_checkpoint(path, config, seeded_params(config))
    stored = safetensors_tensors(path)
    params, tokenizer = loaded(name, path)
    assert tokenizer is None and params.keys() == stored.keys()
    for key, value in stored.items():
        assert params[key].dtype == np.float64
        np.testing.assert_array_equal(params[key], value, err_msg=key)
    params, _ = loaded(name, path, "float32")
    for key, value in stored.items():
        np.testing.assert_array_equal(params[key], value.astype(np.float32), err_msg=key)


@pytest.mark.parametrize("name", BACKENDS)
def test_from_pretrained_loads_the_shipped_model_by_name_with_its_tokenizer(name):
    params, tokenizer = loaded(name, "numbers-en-fr")
    for key, value in safetensors_tensors(SHIPPED_MODELS["numbers-en-fr"]).items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode("three hundred and twelve")
    assert tokenizer.decode(ids) == "three hundred and twelve"


@pytest.mark.parametrize("name", BACKENDS)
def test_from_pretrained_imports_a_hugging_face_directory_in_memory(name, separate_marian):
    """The directory's weights as its import writes them, nothing written into it, and its tokenizer giving
    transformers' MarianTokenizer's ids."""
    directory = separate_marian["directory"]
    before = sorted(path.name for path in directory.iterdir())
    params, tokenizer = loaded(name, directory)
    assert sorted(path.name for path in directory.iterdir()) == before
    for key, value in safetensors_tensors(separate_marian["checkpoint"]).items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)
    assert isinstance(tokenizer, FamilyTokenizer) and tokenizer.family == "marian"
    for text in SOURCE:
        assert tokenizer.ids(text) == separate_marian["oracle"](text).input_ids, text


def test_jax_from_pretrained_greedy_decodes_a_hugging_face_directory_as_generate(separate_marian):
    """transformers' ``generate`` (greedy, the directory's generation config) on the sentences its tokenizer
    encodes; the JAX port from ``from_pretrained(directory, dtype="float64")``, on the ids its own tokenizer gives."""
    torch = pytest.importorskip("torch", reason="torch is not installed: transformers' models need it")
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install '.[jax]')")
    transformer_jax = pytest.importorskip("transformer_jax")
    batch = separate_marian["oracle"](SOURCE, return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = separate_marian["model"].generate(**batch, do_sample=False, num_beams=1).numpy()[:, 1:]
    with jax.enable_x64(True):
        model, tokenizer = from_pretrained(separate_marian["directory"], "jax", dtype="float64")
        src = tokenizer.batch(SOURCE)
        np.testing.assert_array_equal(src, batch["input_ids"].numpy())
        tokens = np.asarray(transformer_jax.greedy_decode(model, src))
    width, pad = max(tokens.shape[1], expected.shape[1]), model.config.pad_id
    same = lambda rows: np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=pad)   # noqa: E731
    assert len({tuple(row) for row in expected}) > 1                     # sentences decoded apart
    np.testing.assert_array_equal(same(tokens), same(expected))


@pytest.mark.parametrize("name", BACKENDS)
def test_from_pretrained_of_nothing_is_one_value_error(name, tmp_path):
    with pytest.raises(ValueError, match=r"^checkpoint '.*missing': does not exist, and no shipped model has that "
                                         r"name \(shipped: numbers-en-fr\)$"):
        loaded(name, tmp_path / "missing")
    with pytest.raises(ValueError, match=r"config\.json"):
        loaded(name, tmp_path)
