"""The exporters' library (transformer_export) and the ports' compile and export paths, without the command line:

* the isolated process every artefact runs in cannot import the project (its check can fail);
* CTranslate2's converter names ids without a tokenizer and refuses a vocabulary that names two ids alike;
* what capture needed in the ports: Keras' ``model.export`` after a call (the model records its token inputs),
  ``torch.compile(fullgraph=True)`` with no graph break in torch's own report, the public calls still refusing
  bad ids with the reference's message, and ``compile_decoding``'s one program per shape.

The artefacts the ``export`` command writes are checked in tests/cli/test_export.py. An engine that is not installed
is a skip naming its extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from shipped import (
    beam_source,
    check_against_reference,
    reference_beams,
    reference_greedy,
    shipped_batches,
    shipped_texts,
)
from support import require

from reference_numpy import Transformer, TransformerConfig, init_params, save_checkpoint
from reference_numpy.checkpoint import load_checkpoint
from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA
from transformer_export import ctranslate2 as ctranslate2_export
from transformer_export.check import ISOLATION, run_isolated
from transformer_tasks.translation import SHIPPED, load_translator


def test_the_isolated_process_cannot_import_the_project(tmp_path):
    """The check every isolated run starts with can fail: here the project is importable (its path is added)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    repo = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.append({repo!r})" + ISOLATION],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "the project is importable" in done.stderr
    assert run_isolated("print(json.dumps([sys.flags.no_site, sys.flags.isolated]))") == [1, 1]


def test_ctranslate2_without_a_tokenizer_keeps_id_names(tmp_path):
    """A checkpoint without a tokenizer: ``<N>`` names, the specials at their ids, no tokenizer.json, and no eos
    appended to the source (the caller's id rows carry it, ``to_tokens``)."""
    require("ctranslate2", "peers")
    config = TransformerConfig.preset("tiny")
    save_checkpoint(tmp_path / "m.safetensors", config, init_params(config, seed=0))
    out = ctranslate2_export.export_ctranslate2(tmp_path / "m.safetensors", tmp_path / "model")
    names = json.loads((out / "target_vocabulary.json").read_text())
    assert names[:5] == ["<pad>", "<s>", "</s>", "<3>", "<4>"] and len(names) == config.tgt_vocab_size
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["add_source_eos"] is False


def test_ctranslate2_refuses_a_vocabulary_naming_two_ids_alike():
    """A BPE piece spelled like the name of an id beyond the tokenizer's vocabulary would make two ids one token."""
    config, _, tokenizer = load_translator()
    data = json.loads(tokenizer.to_json())
    piece = next(token for token, i in data["model"]["vocab"].items() if i == 10)
    data["model"]["vocab"][f"<{config.tgt_vocab_size - 1}>"] = data["model"]["vocab"].pop(piece)
    with pytest.raises(ValueError, match=rf"^token '<{config.tgt_vocab_size - 1}>' names two ids of the vocabulary"):
        ctranslate2_export.token_names(config, config.tgt_vocab_size, json.dumps(data))
    names = ctranslate2_export.token_names(config, config.tgt_vocab_size, tokenizer.to_json())
    assert np.unique(names).size == config.tgt_vocab_size


def test_keras_model_export_after_a_call_serves_token_ids(tmp_path, agreement):
    """Keras' own ``model.export(path)`` (no signature given) works once the model was called, as Keras asks of a
    subclassed model: the serving signature takes int64 src and tgt of any batch and length, and serves the
    reference's log-probabilities (float32 policy: the served graph is optimised by Grappler, not the eager one)."""
    tf = require("tensorflow", "tf")
    from transformer_tf.checkpoint import load_checkpoint as tf_load

    model = tf_load(SHIPPED, dtype="float32")
    src, tgt = shipped_batches()[0]
    model(src, tgt)
    model.export(str(tmp_path / "saved"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    spec = loaded.signatures["serving_default"].structured_input_signature[1]
    assert {name: (tuple(s.shape), s.dtype) for name, s in spec.items()} == {
        "src": ((None, None), tf.int64), "tgt": ((None, None), tf.int64)}
    check_against_reference("keras model.export", [loaded.serve(tf.constant(src), tf.constant(tgt)).numpy()],
                            agreement)


# Slow: Dynamo traces the forward pass twice (`explain`, then the compile) and Inductor compiles it, with C++ kernels,
# for the shipped model: what `model.compile` users run.
@pytest.mark.slow
def test_torch_forward_compiles_in_one_graph_and_the_call_still_checks_ids(agreement):
    """``torch._dynamo.explain`` (torch's own report) finds no graph break in the forward pass; a model compiled
    with ``fullgraph=True`` agrees with the reference and still refuses an id outside the vocabulary."""
    torch = require("torch", "torch")
    from transformer_torch.checkpoint import load_checkpoint as torch_load

    model = torch_load(SHIPPED, dtype=torch.float32)
    src, tgt = (torch.from_numpy(a) for a in shipped_batches()[0])
    with torch.no_grad():
        report = torch._dynamo.explain(model.forward)(src, tgt)
        assert (report.graph_count, report.graph_break_count) == (1, 0), report.break_reasons
        model.compile(fullgraph=True)
        out = model(src, tgt).numpy()
    config, params = load_checkpoint(SHIPPED)
    agreement(out, Transformer(config, params)(src.numpy(), tgt.numpy()),
              Transformer(config, params, np.float32)(src.numpy(), tgt.numpy()), port="torch.compile", device="cpu",
              dtype="float32", what="log-probs of the compiled forward pass: shipped model")
    bad = src.clone()
    bad[0, 0] = config.src_vocab_size
    with pytest.raises(ValueError, match=rf"^src holds token ids outside \[0, {config.src_vocab_size}\)$"):
        model(bad, tgt)


# About a minute: Inductor compiles the step's three programs (the greedy batch, a new capacity, the beams' symbolic
# sizes), max-autotune timing each product's kernels, into an empty cache: what compiling prints is checked (no table
# of those timings), and a program read from a cache would print nothing.
@pytest.mark.slow
def test_torch_compiled_decoding_agrees_with_the_reference_with_one_program_per_shape(agreement, capsys, tmp_path,
                                                                                      monkeypatch):
    """``transformer_torch.compile_decoding``: each cached step one ``torch.compile`` program. Teacher-forced along
    the float64 reference's greedy translations of the held-out sentences, its log-probabilities agree with the
    reference's forward pass (float32 policy) at every position a decoding loop reads (input not padding; pad and
    bos, which a step sets to -inf, left out); the port's greedy decoding and beam search (size 4, alpha 0.6) over
    it write exactly the reference's greedy tokens and its beam tokens on every row the float32 rule compares
    whole; Dynamo (its own counters) compiles one program per new shape, not per position (the cache index a
    tensor, not a constant); compiling prints nothing (no table of Inductor's kernel timings); a float64 model is
    refused."""
    torch = require("torch", "torch")
    from transformer_torch import beam_search as torch_beam_search
    from transformer_torch import compile_decoding, speed
    from transformer_torch import greedy_decode as torch_greedy_decode
    from transformer_torch.checkpoint import load_checkpoint as torch_load
    from transformer_torch.decoding import next_token_log_probs
    from transformer_torch.model import padding_mask

    config, params, tokenizer = load_translator()
    model = compile_decoding(torch_load(SHIPPED, dtype=torch.float32).eval())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # compiled here, not read from an earlier run
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    src = tokenizer.batch(shipped_texts())
    expected = reference_greedy()
    np.testing.assert_array_equal(torch_greedy_decode(model, src), expected,
                                  err_msg="greedy tokens of the compiled decoding step")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

    tgt = np.concatenate([np.full((len(src), 1), config.bos_id), expected[:, :-1]], axis=1)        # (B, T)
    step = speed.decoding_step(model, next_token_log_probs)
    with torch.inference_mode():
        memory = model.encode(torch.from_numpy(src))
        mask, cache, log_probs = padding_mask(torch.from_numpy(src), config.pad_id), model.init_cache(memory,
                                                                                                     tgt.shape[1]), []
        for index in range(tgt.shape[1]):
            out, cache = step(torch.from_numpy(tgt[:, index:index + 1]), memory, mask, cache, index)
            log_probs.append(out.numpy())
    read = tgt != config.pad_id                                             # (B, T): the positions a loop reads
    emitted = np.setdiff1d(np.arange(config.tgt_vocab_size), [config.pad_id, config.bos_id])
    agreement(np.stack(log_probs, axis=1)[read][:, emitted],
              *(Transformer(config, params, dtype)(src, tgt)[read][:, emitted] for dtype in (np.float64, np.float32)),
              port="torch compile_decoding", device="cpu", dtype="float32",
              what="log-probs of the compiled decoding step: shipped model, teacher-forced")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2       # a new capacity: one program more

    tokens, decisive = reference_beams()
    beams = torch_beam_search(model, beam_source(), BEAM_SIZE, LENGTH_PENALTY_ALPHA)[0]
    np.testing.assert_array_equal(beams[decisive], tokens[decisive], err_msg="beam tokens of the compiled step")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3       # beams' rows: the sizes now symbols
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="^compile_decoding: the model is float64; the compiled decoding step is "
                                         "float32 only$"):
        compile_decoding(torch_load(SHIPPED, dtype=torch.float64))
