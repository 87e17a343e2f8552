"""JSON records read defensively (issue 42): a checkpoint's training record and loss scale, its tokenizer, and an
exported artefact's manifest (``transformer.json``), malformed as a file can be -- not an object (a list, a string,
a number, null), a field missing, a field of another type -- are each one ``ValueError`` naming the record and the
field, the same message in every backend (each reads files through the reference's readers,
``reference_numpy.records``; through the command line, one line: tests/cli/test_train_runs.py)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from support import BACKENDS, checkpoint_with, port_backend

from reference_numpy import TransformerConfig, init_params, records, save_checkpoint
from reference_numpy.config import TrainingConfig
from reference_numpy.tokenizer import TOKENIZER_VERSION
from transformer_export.export import MANIFEST, read_manifest

TINY = TransformerConfig.preset("tiny")
TRAINING = {"step": 3, "config": TrainingConfig().to_dict()}
SCALE = {"value": 2.0 ** 15, "good_steps": 0}
RECORD = "training record"

MALFORMED_TRAINING = {
    "a list": ([3, {}], f"{RECORD} must be a JSON object, got [3, {{}}]"),
    "a string": ("3", f'{RECORD} must be a JSON object, got "3"'),
    "a number": (3, f"{RECORD} must be a JSON object, got 3"),
    "null": (None, f"{RECORD} must be a JSON object, got null"),
    "no step": ({"config": {}}, f"{RECORD} field 'step' is missing"),
    "a string step": ({**TRAINING, "step": "3"}, f'{RECORD} field \'step\' must be an integer, got "3"'),
    "a null step": ({**TRAINING, "step": None}, f"{RECORD} field 'step' must be an integer, got null"),
    "a true step": ({**TRAINING, "step": True}, f"{RECORD} field 'step' must be an integer, got true"),
    "a list config": ({**TRAINING, "config": []}, f"{RECORD} field 'config' must be a JSON object, got []"),
    "an unknown field": ({**TRAINING, "steps": 3}, f"{RECORD} has an unknown field 'steps'; expected step, config, "
                                                   "loss_scale"),
    "a list loss scale": ({**TRAINING, "loss_scale": [2.0 ** 15, 0]},
                          f"{RECORD} field 'loss_scale' must be a JSON object, got [32768.0, 0]"),
    "a string loss scale": ({**TRAINING, "loss_scale": "32768"},
                            f'{RECORD} field \'loss_scale\' must be a JSON object, got "32768"'),
    "a number loss scale": ({**TRAINING, "loss_scale": 32768},
                            f"{RECORD} field 'loss_scale' must be a JSON object, got 32768"),
    "no good_steps": ({**TRAINING, "loss_scale": {"value": 2.0 ** 15}},
                      f"{RECORD} field 'loss_scale.good_steps' is missing"),
    "a string scale": ({**TRAINING, "loss_scale": {**SCALE, "value": "32768"}},
                       f'{RECORD} field \'loss_scale.value\' must be a number, got "32768"'),
    "fractional good_steps": ({**TRAINING, "loss_scale": {**SCALE, "good_steps": 0.5}},
                              f"{RECORD} field 'loss_scale.good_steps' must be an integer, got 0.5"),
    "an unknown scale field": ({**TRAINING, "loss_scale": {**SCALE, "scale": 1}},
                               f"{RECORD} field 'loss_scale' has an unknown field 'scale'; expected value, "
                               "good_steps"),
}

VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4}
TOKENIZER = {"model": {"type": "BPE", "vocab": VOCAB}, "added_tokens": [{"content": "<pad>", "id": 0}]}
MALFORMED_TOKENIZERS = {
    "a list": ([], "tokenizer must be a JSON object, got []"),
    "a string": ("BPE", 'tokenizer must be a JSON object, got "BPE"'),
    "a number": (3, "tokenizer must be a JSON object, got 3"),
    "null": (None, "tokenizer must be a JSON object, got null"),
    "no model": ({"added_tokens": []}, "tokenizer field 'model' is missing"),
    "a list model": ({**TOKENIZER, "model": []}, "tokenizer field 'model' must be a JSON object, got []"),
    "a list vocabulary": ({**TOKENIZER, "model": {"type": "BPE", "vocab": ["a"]}},
                          "tokenizer field 'model.vocab' must be a JSON object, got [\"a\"]"),
    "a string id": ({**TOKENIZER, "model": {"type": "BPE", "vocab": {**VOCAB, "a": "4"}}},
                    "tokenizer field 'model.vocab.a' must be an integer, got \"4\""),
    "a null type": ({**TOKENIZER, "model": {"type": None, "vocab": VOCAB}},
                    "tokenizer field 'model.type' must be a string, got null"),
    "an object of added tokens": ({**TOKENIZER, "added_tokens": {}},
                                  "tokenizer field 'added_tokens' must be a JSON array, got {}"),
    "an added token without id": ({**TOKENIZER, "added_tokens": [{"content": "<pad>"}]},
                                  "tokenizer field 'added_tokens[0].id' is missing"),
}


def adapter(name: str):
    """The command line's adapter of backend ``name``: the reference's, or an installed port's."""
    return importlib.import_module("equivalence.backends.numpy") if name == "numpy" else port_backend(name)


def refusal(read, *args) -> str:
    with pytest.raises(ValueError) as caught:
        read(*args)
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("case", list(MALFORMED_TRAINING))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_malformed_training_record_is_one_error_naming_its_field_in_every_backend(backend, case, tmp_path):
    record, problem = MALFORMED_TRAINING[case]
    path = checkpoint_with(tmp_path / "run.safetensors", training=json.dumps(record))
    expected = f"checkpoint {str(path)!r}: {problem}"
    assert refusal(adapter(backend).load_training_state, path, "float32") == expected
    assert refusal(adapter(backend).load, path, "float32", "cpu") == expected


@pytest.mark.parametrize("case", list(MALFORMED_TOKENIZERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_malformed_tokenizer_is_one_error_naming_its_field_in_every_backend(backend, case, tmp_path):
    text, problem = MALFORMED_TOKENIZERS[case]
    path = checkpoint_with(tmp_path / "model.safetensors", tokenizer=json.dumps(text),
                           tokenizer_version=TOKENIZER_VERSION)
    assert refusal(adapter(backend).load, path, "float32", "cpu") == f"checkpoint {str(path)!r}: {problem}"


MANIFEST_RECORD = {"target": "onnx", "dtype": "float32", "inputs": ["src", "tgt"], "output": "log_probs",
                   "files": ["model.onnx"], "config": TINY.to_dict()}
NAME = f"artefact manifest {MANIFEST}"
MALFORMED_MANIFESTS = {
    "a list": ([], f"{NAME} must be a JSON object, got []"),
    "a string": ("onnx", f'{NAME} must be a JSON object, got "onnx"'),
    "a number": (1, f"{NAME} must be a JSON object, got 1"),
    "null": (None, f"{NAME} must be a JSON object, got null"),
    "no config": ({k: v for k, v in MANIFEST_RECORD.items() if k != "config"}, f"{NAME} field 'config' is missing"),
    "a list config": ({**MANIFEST_RECORD, "config": []}, f"{NAME} field 'config' must be a JSON object, got []"),
    "a bad config": ({**MANIFEST_RECORD, "config": {**TINY.to_dict(), "d_model": "16"}},
                     f"{NAME} field 'config' is invalid: d_model must be an int, got '16'"),
    "a string decoding step": ({**MANIFEST_RECORD, "decoding_step": "step"},
                               f'{NAME} field \'decoding_step\' must be a JSON object, got "step"'),
    "a step without capacity": ({**MANIFEST_RECORD, "decoding_step": {"encode": {}, "step": {}}},
                                f"{NAME} field 'decoding_step.max_capacity' is missing"),
}


@pytest.mark.parametrize("case", list(MALFORMED_MANIFESTS))
def test_a_malformed_artefact_manifest_is_one_error_naming_its_field(case, tmp_path):
    manifest, problem = MALFORMED_MANIFESTS[case]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert refusal(read_manifest, tmp_path) == problem


def test_a_good_manifest_reads_back_and_export_check_reads_it_so(tmp_path, monkeypatch):
    (tmp_path / MANIFEST).write_text(json.dumps(MANIFEST_RECORD))
    assert read_manifest(tmp_path) == MANIFEST_RECORD
    from transformer_export import check as export_check
    assert export_check.read_manifest is read_manifest


def test_a_record_check_tells_json_kinds_apart():
    assert records.check(3, int, "x") == 3 and records.check(2.5, records.NUMBER, "x") == 2.5
    for value, kind, words in ((True, int, "an integer, got true"), (False, records.NUMBER, "a number, got false"),
                               (1.0, int, "an integer, got 1.0"), ("a" * 100, dict, 'a JSON object, got "aaaa')):
        with pytest.raises(ValueError, match=f"^x must be {words}"):
            records.check(value, kind, "x")
    assert len(records.shown("a" * 100)) == 40
    with pytest.raises(ValueError, match=r"^y is not JSON text \(JSONDecodeError: "):
        records.parse_json("{", "y")


def test_a_saved_run_with_a_loss_scale_still_reads(tmp_path):
    from reference_numpy.checkpoint import LossScaleState, TrainingState, load_training_state
    params = init_params(TINY, dtype=np.float32)
    zeros = {name: np.zeros_like(value) for name, value in params.items()}
    state = TrainingState(TrainingConfig(), 7, zeros, zeros, LossScaleState(2.0 ** 15, 3))
    save_checkpoint(tmp_path / "run.safetensors", TINY, params, training=state)
    read = load_training_state(tmp_path / "run.safetensors")
    assert read.step == 7 and read.loss_scale == state.loss_scale and read.config == state.config
