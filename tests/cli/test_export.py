"""``transformer-reference export`` (docs/deploy.md): every artefact is written by the CLI, then loaded and run in a
fresh Python process that cannot import the project (``python -I -S`` with only site-packages on its path: the
editable install's ``.pth`` hook is never run, and the script asserts that ``reference_numpy``, ``transformer_*``
and ``equivalence`` are not importable), and its answers are compared with the NumPy reference's:

* ``ctranslate2`` with the checkpoint's BPE vocabulary: CTranslate2 translates English *text* (the tokenizer's
  pieces in, pieces out) into exactly the reference's greedy and beam-4 French on held-out sentences of the shipped
  model;
* ``savedmodel``, ``jax-export``, ``torch-export``, ``onnx``: the forward pass of the shipped model, loaded by
  TensorFlow, JAX, PyTorch or onnxruntime alone, gives log-probabilities within the float32 policy
  (``equivalence.tolerance``) of the float64 reference's on a ragged batch of held-out sentences and on a batch
  and lengths the export was not traced with (one sentence, one target position: a decoding step's shapes), and
  a plain NumPy greedy loop over it, in the same process, writes exactly the reference's greedy tokens (and, by the
  artefact's tokenizer.json, its text) for the 32 held-out sentences; a planted bug in an exported graph fails both
  checks;
* every target but ``ctranslate2``: the cached decoding step exported beside the forward pass (``encode`` once,
  ``step`` per position), run by a NumPy greedy loop in the same kind of process, writes the reference's greedy
  tokens for the 32 held-out sentences and log-probabilities within the float32 policy; a transposed decoder
  self-attention W_k in the exported weights fails both; ``export --check`` runs it too;
* the command's refusals and its progress bar.

The exporters' library and the ports' compile and export paths are checked in tests/export/test_exporters.py. An
engine that is not installed is a skip naming its extra.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from shipped import (
    beam_source,
    check_against_reference,
    reference_beams,
    reference_greedy,
    reference_log_probs,
    shipped_batches,
    shipped_texts,
)
from support import require

from reference_numpy import Transformer, TransformerConfig, beam_search, greedy_decode, init_params, save_checkpoint
from reference_numpy.checkpoint import load_checkpoint, load_tokenizer_json
from reference_numpy.decoding import BEAM_SIZE, EXTRA_OUTPUT_LENGTH, LENGTH_PENALTY_ALPHA
from transformer_cli.main import EXIT_DISAGREEMENT, EXIT_OK, EXIT_USAGE, main
from transformer_export import check as export_check
from transformer_export import ctranslate2 as ctranslate2_export
from transformer_export import export as export_module
from transformer_export.check import LOADERS, run_isolated
from transformer_tasks.translation import SHIPPED, load_translator


@pytest.fixture(scope="module")
def serving(tmp_path_factory) -> Callable[[], contextlib.AbstractContextManager]:
    """``with serving():`` the artefacts' isolated processes (this module's and ``export --check``'s) run their
    runtime on one thread -- the suite runs one test process per core, and a runtime's threads spinning beside
    another process's cost more than they save (torch-export's beam search beside other tests: 62 s of CPU on two
    threads, 1.6 s on one) -- and share one JAX compilation cache, new for the module: the planted bugs' artefacts
    and the second ``export --check`` run the programs an earlier process compiled (jax-export's weights are
    arguments: a planted bug changes no program, a changed program is compiled anew)."""
    variables = {"OMP_NUM_THREADS": "1", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    @contextlib.contextmanager
    def environment() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in variables.items():
                patch.setenv(name, value)
            yield

    return environment


# ----------------------------------------------------------------------------- a process without the project


# ----------------------------------------------------------------------------- CTranslate2 with the BPE vocabulary

CT2_TRANSLATE = """
import ctranslate2, tokenizers
model, texts, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tokenizer = tokenizers.Tokenizer.from_file(model + "/tokenizer.json")
translator = ctranslate2.Translator(model, device="cpu", compute_type="float32")
eos = tokenizer.token_to_id("</s>")

def text(pieces):
    ids = [tokenizer.token_to_id(piece) for piece in pieces]
    return tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids, skip_special_tokens=False)

sources = [tokenizer.encode(text, add_special_tokens=False).tokens for text in texts]
print(json.dumps({name: [text(result.hypotheses[0]) for result in translator.translate_batch(sources, **kwargs)]
                  for name, kwargs in options.items()}))
"""


def test_ctranslate2_translates_text_as_the_reference(tmp_path, capsys, serving):
    """The shipped model exported by the CLI: CTranslate2, given the tokenizer's pieces of English sentences (no
    eos: the model's config appends it), writes pieces whose text is exactly the float64 reference's greedy and
    beam-4 (alpha 0.6) translation of every sentence (``translate_options``: the reference's decoding rules as far
    as CTranslate2 can follow them)."""
    require("ctranslate2", "peers")
    tokenizers = require("tokenizers", "text")
    out = tmp_path / "numbers-ct2"
    assert main(["export", "--to", "ctranslate2", str(SHIPPED), str(out)]) == EXIT_OK
    assert "BPE vocabulary" in capsys.readouterr().out
    config, params, tokenizer = load_translator()
    library = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    expected = [library.id_to_token(i) or f"<{i}>" for i in range(config.tgt_vocab_size)]
    assert json.loads((out / "shared_vocabulary.json").read_text()) == expected          # pieces at their ids
    assert expected[:4] == ["<pad>", "<s>", "</s>", "<unk>"] and expected[-1] == f"<{config.tgt_vocab_size - 1}>"
    texts = shipped_texts()
    src, model = tokenizer.batch(texts), Transformer(config, params)
    reference = {"greedy": reference_greedy(),
                 "beam": beam_search(model, src, BEAM_SIZE, LENGTH_PENALTY_ALPHA)[0]}
    options = {"greedy": ctranslate2_export.translate_options(config.max_len),
               "beam": ctranslate2_export.translate_options(config.max_len, BEAM_SIZE, LENGTH_PENALTY_ALPHA)}
    with serving():
        got = run_isolated(CT2_TRANSLATE, out, json.dumps(texts), json.dumps(options))
    for kind, tokens in reference.items():
        assert got[kind] == [tokenizer.decode(row) for row in tokens], kind
    assert len(set(got["beam"])) == len(texts)


# ----------------------------------------------------------------------------- the forward pass in each runtime

RUNTIMES = {"savedmodel": ("tensorflow", "tf"), "jax-export": ("jax", "jax"), "torch-export": ("torch", "torch"),
            "onnx": ("onnxruntime", "export")}
STEPS = list(export_check.STEPS)
# The planted bugs: a transposed projection, square, so every shape still fits. The encoder's W_q spoils the forward
# pass and, through the memory, the step; the decoder's self-attention W_k spoils what the step writes into its cache.
ENCODER_W_Q, DECODER_W_K = "encoder.layers.0.self_attn.q_proj.weight", "decoder.layers.0.self_attn.k_proj.weight"

# How a serving process loads each artefact (``run(src, tgt) -> log_probs``), greedy-decodes and beam-searches with
# it, NumPy only: the loaders and the loops of ``export --check`` (transformer_export/check.py), checked
# here against the reference; and, for the cached decoding step, ``encode`` and ``step`` and a greedy loop and a
# teacher-forced run over them.
RUN, GREEDY, BEAM = LOADERS, export_check.GREEDY, export_check.BEAM
# Reads OUTPUT_DIR (transformer.json) and inputs.npz (greedy_src, beam_src: source ids; src_i, tgt_i: the log-prob
# batches); argv: the greedy loops' extra output length, the beam size and alpha. The parts below fill ``results``
# (written to outputs.npz) and ``answer`` (printed as JSON with the frameworks the process imported: TensorFlow's
# import brings in JAX when it is installed; onnxruntime runs without torch).
SERVE = """
manifest = json.load(open(sys.argv[1] + "/transformer.json"))
config = manifest["config"]
inputs = np.load(sys.argv[2])
rules = (config["pad_id"], config["bos_id"], config["eos_id"], config["max_len"], int(sys.argv[4]))
results, answer = {}, {}
"""
# The forward pass: out_i (log-probs of each batch), tokens (greedy), beam_tokens (beam search); the greedy tokens'
# text (up to eos, by the artefact's tokenizer.json).
SERVE_FORWARD = """
import tokenizers
tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
results.update(tokens=greedy(inputs["greedy_src"], *rules),
               beam_tokens=beams(inputs["beam_src"], *rules, int(sys.argv[5]), float(sys.argv[6])),
               **{f"out_{i}": run(inputs[name], inputs["tgt_" + name.removeprefix("src_")])
                  for i, name in enumerate(name for name in inputs.files if name.startswith("src_"))})

def text(row):
    ids = row.tolist()
    return tokenizer.decode(ids[:ids.index(config["eos_id"])] if config["eos_id"] in ids else ids,
                            skip_special_tokens=False)

answer["texts"] = [text(row) for row in results["tokens"]]
"""
# The cached decoding step: step_tokens (the cached greedy loop's), step_log_probs (the step's along tgt_0, (B, T, V));
# the manifest's decoding_step.
SERVE_STEP = """
results.update(step_tokens=cached_greedy(inputs["greedy_src"], *rules),
               step_log_probs=stepped(inputs["src_0"], inputs["tgt_0"]))
answer["decoding_step"] = manifest["decoding_step"]
"""
SERVED = """
np.savez(sys.argv[3], **results)
print(json.dumps({**answer, "imported": sorted(name for name in ("tensorflow", "jax", "torch", "onnxruntime")
                                               if name in sys.modules)}))
"""


class Exported(NamedTuple):
    """An artefact the CLI wrote, and the command's report."""

    path: Path
    report: str


class Served(NamedTuple):
    """What an exported artefact's forward pass answered in its isolated process."""

    log_probs: list[np.ndarray]    # on each of :func:`shipped_batches`
    tokens: np.ndarray             # the greedy loop's on :func:`shipped_texts`
    texts: list[str]               # their text, by the artefact's tokenizer
    beam_tokens: np.ndarray        # the beam search's (size 4, alpha 0.6) on :func:`beam_source`


class Stepped(NamedTuple):
    """What an exported artefact's cached decoding step answered in its isolated process."""

    tokens: np.ndarray             # the cached greedy loop's on :func:`shipped_texts`
    log_probs: np.ndarray          # the step's along the ragged batch of :func:`shipped_batches`, (B, T, V)
    decoding_step: dict            # the manifest's


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Callable[..., Exported]:
    """``exported(target, transposed=None)``: the CLI's export of the shipped model to ``target`` -- with the
    checkpoint tensor ``transposed`` transposed, a planted bug, if given -- in ``target`` under a directory of its
    own, written once per module and read by every test of that artefact (each export traces the forward pass and
    the step: seconds to a minute)."""

    @functools.cache
    def export(target: str, transposed: str | None) -> Exported:
        require(*RUNTIMES[target])
        out = tmp_path_factory.mktemp(f"{target}-{transposed or 'shipped'}") / target
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as report:
            if transposed is not None:
                config, params = load_checkpoint(SHIPPED, dtype=np.float32)
                planted = {**params, transposed: np.ascontiguousarray(params[transposed].T)}
                patch.setattr(export_module, "load_checkpoint", lambda path, dtype: (config, planted))
            assert main(["export", "--to", target, "numbers-en-fr", str(out)]) == EXIT_OK
        return Exported(out, report.getvalue())

    return lambda target, transposed=None: export(target, transposed)     # one key per artefact


def run_exported(target: str, out: Path, forward: bool = True, step: bool = True
                 ) -> tuple[Served | None, Stepped | None]:
    """In one process that cannot import the project, run the artefact ``out``: its forward pass (``forward``) on
    :func:`shipped_batches`, greedy-decoding :func:`shipped_texts` (``GREEDY``) and beam-searching
    :func:`beam_source` (``BEAM``) with it; its cached decoding step (``step``), greedy-decoding :func:`shipped_texts`
    (``export_check.CACHED_GREEDY``) and stepping along the ragged batch of :func:`shipped_batches` (teacher
    forcing). inputs.npz and outputs.npz are written beside ``out``; a part not run is None."""
    require("tokenizers", "text")
    _, _, tokenizer = load_translator()
    inputs, outputs = out.parent / "inputs.npz", out.parent / "outputs.npz"
    np.savez(inputs, greedy_src=tokenizer.batch(shipped_texts()), beam_src=beam_source(),
             **{f"{name}_{i}": array for i, batch in enumerate(shipped_batches())
                for name, array in zip(("src", "tgt"), batch)})
    script = RUN[target] + SERVE
    script += GREEDY + BEAM + SERVE_FORWARD if forward else ""
    script += export_check.STEPS[target] + export_check.CACHED_GREEDY + SERVE_STEP if step else ""
    answer = run_isolated(script + SERVED, out, inputs, outputs, EXTRA_OUTPUT_LENGTH, BEAM_SIZE, LENGTH_PENALTY_ALPHA)
    imported = answer["imported"]
    assert RUNTIMES[target][0] in imported and (target != "onnx" or "torch" not in imported), imported
    results = np.load(outputs)
    served = Served([results[f"out_{i}"] for i in range(len(shipped_batches()))], results["tokens"], answer["texts"],
                    results["beam_tokens"]) if forward else None
    stepped = Stepped(results["step_tokens"], results["step_log_probs"], answer["decoding_step"]) if step else None
    return served, stepped


@pytest.fixture(scope="module")
def shipped_served(exported, serving) -> Callable[[str], tuple[Served, Stepped]]:
    """``shipped_served(target)``: the forward pass's and the step's answers of the shipped model's artefact, from
    one isolated process per target and module (loading a runtime takes seconds)."""

    @functools.cache
    def served(target: str) -> tuple[Served, Stepped]:
        with serving():
            return run_exported(target, exported(target).path)

    return served


def check_greedy_tokens(target: str, served: Served) -> None:
    """The artefact's greedy loop writes exactly the float64 reference's ``greedy_decode`` tokens, and its
    tokenizer.json their text."""
    tokenizer, expected = load_translator()[2], reference_greedy()
    np.testing.assert_array_equal(served.tokens, expected, err_msg=f"greedy tokens of the exported {target}")
    assert served.texts == [tokenizer.decode(row) for row in expected], target


def check_beam_tokens(target: str, served: Served) -> None:
    """The artefact's beam search writes exactly the float64 reference's ``beam_search`` tokens (size 4, alpha
    0.6) on every row the float32 rule compares whole: the held-out sentences and :data:`BEAM_TEXTS`, where beam
    search and greedy decoding part."""
    tokens, decisive = reference_beams()
    np.testing.assert_array_equal(served.beam_tokens[decisive], tokens[decisive],
                                  err_msg=f"beam tokens of the exported {target}")


# Up to a minute for a target's first test: it writes the module's artefact (savedmodel: Keras traces three endpoints,
# about 30 s of CPU) and runs it in the one process whose answers this and the step's test check (jax-export: XLA
# compiles the forward pass for each new shape a serving loop calls it with, about 25 s).
@pytest.mark.slow
@pytest.mark.parametrize("target", list(RUNTIMES))
def test_exported_forward_pass_and_greedy_decoding_agree_with_the_reference_without_the_project(
        target, agreement, exported, shipped_served):
    """The CLI's artefact, loaded by its runtime alone, computes the reference's log-probabilities (float32 policy)
    for any batch and lengths, and a plain greedy loop over it translates the 32 held-out sentences into exactly
    the reference's greedy tokens and text; the directory also holds the config and the checkpoint's tokenizer,
    and the export wrote nothing beside it."""
    served, _ = shipped_served(target)
    check_against_reference(target, served.log_probs, agreement)
    check_greedy_tokens(target, served)
    check_beam_tokens(target, served)
    out, report = exported(target)
    assert f"wrote {out}: a float32 " in report
    config, _, tokenizer = load_translator()
    manifest = json.loads((out / "transformer.json").read_text())
    assert TransformerConfig.from_dict(manifest["config"]) == config and manifest["target"] == target
    assert (out / "tokenizer.json").read_text() == tokenizer.to_json()
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["inputs.npz", "outputs.npz", target])


# 20 to 40 s a target: an export of the shipped model with the bug planted (its own trace and serialisation) and its
# run in the process without the project; a planted bug cannot share the correct artefact.
@pytest.mark.slow
@pytest.mark.parametrize("target", ["jax-export", "onnx"])
def test_a_planted_bug_in_the_exported_graph_fails_the_agreement(target, agreement, exported, serving):
    """The checks above can fail: an export whose graph multiplies by a transposed projection (the first encoder
    layer's W_q, square, so every shape still fits) is caught by the log-probabilities, the greedy and the beam
    tokens."""
    path = exported(target, ENCODER_W_Q).path
    with serving():
        served, _ = run_exported(target, path, step=False)
    with pytest.raises(AssertionError, match="log-probs of the exported forward pass"):
        check_against_reference(target, served.log_probs, agreement)
    with pytest.raises(AssertionError, match=f"greedy tokens of the exported {target}"):
        check_greedy_tokens(target, served)
    with pytest.raises(AssertionError, match=f"beam tokens of the exported {target}"):
        check_beam_tokens(target, served)


# ----------------------------------------------------------------------------- one cached decoding step

def check_step_against_reference(target: str, stepped: Stepped, agreement) -> None:
    """The cached greedy tokens are exactly the float64 reference's ``greedy_decode`` tokens; the step's
    log-probabilities along the ragged batch agree with the reference's forward pass (float32 policy) at every
    position whose input is not padding (the step attends to every position written; the forward pass hides a
    padded target's positions, which no decoding loop reads)."""
    (_, tgt), (ref64, ref32) = shipped_batches()[0], reference_log_probs()[0]
    read = tgt != load_translator()[0].pad_id
    agreement(stepped.log_probs[read], ref64[read], ref32[read], port=target, device="cpu", dtype="float32",
              what=f"log-probs of the exported decoding step: shipped model, {int(read.sum())} positions")
    np.testing.assert_array_equal(stepped.tokens, reference_greedy(),
                                  err_msg=f"cached greedy tokens of the exported {target}")


@pytest.mark.slow
@pytest.mark.parametrize("target", STEPS)
def test_exported_decoding_step_agrees_with_the_reference_without_the_project(target, agreement, shipped_served):
    """The CLI's artefact exports ``encode`` and ``step`` (named in transformer.json with their inputs and outputs,
    caches of any capacity up to ``max_len``); loaded by its runtime alone, a NumPy greedy loop calling encode once
    and step per position (its caches as long as its longest output) translates the 32 held-out sentences into
    exactly the reference's greedy tokens, and the step's log-probabilities agree with the reference's under the
    float32 policy."""
    _, stepped = shipped_served(target)
    config = load_translator()[0]
    manifest = dict(stepped.decoding_step)
    assert manifest.pop("max_capacity") == config.max_len
    assert {name: (entry["inputs"], entry["outputs"]) for name, entry in manifest.items()} == {
        name: (entry["inputs"], entry["outputs"]) for name, entry in export_module.STEP.items()}
    check_step_against_reference(target, stepped, agreement)


# 25 to 50 s a target: the planted export's decoding step, traced and serialised with its bug, run without the project.
@pytest.mark.slow
@pytest.mark.parametrize("target", STEPS)
def test_a_planted_bug_in_the_exported_step_fails_the_agreement(target, agreement, exported, serving):
    """The step's check can fail: an export whose first decoder layer's self-attention keys -- what the step writes
    into its cache -- come from a transposed W_k (square, so every shape still fits) is caught by the step's
    log-probabilities and by the cached greedy tokens."""
    path = exported(target, DECODER_W_K).path
    with serving():
        _, stepped = run_exported(target, path, forward=False)
    with pytest.raises(AssertionError, match=f"cached greedy tokens of the exported {target}"):
        check_step_against_reference(target, stepped, lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="log-probs of the exported decoding step"):
        check_step_against_reference(target, stepped, agreement)


# 25 to 45 s a target: `export --check` twice (the artefact, then the planted one), each exporting and starting the
# runtime's own process, as a user's command does.
@pytest.mark.slow
@pytest.mark.parametrize("target", ["savedmodel", "jax-export", "onnx"])
def test_export_check_runs_the_artefact_without_the_project_and_holds_it_to_the_reference(target, tmp_path, capsys,
                                                                                         monkeypatch, exported,
                                                                                         serving):
    """``export --check``: the artefact of the shipped model agrees (exit 0, the report names the runtimes the
    checking process imported and the float32 policy's verdict); with the planted W_q bug the same command exits 1
    and says what differs (the log-probabilities, off by 3.0 -- through the cached decoding step too, where the
    artefact has it; the 4 sentences' greedy tokens survive it). The command's export writes what the same command
    without ``--check`` wrote for the tests above (:func:`exported`): the check is run here."""
    artefacts = {transposed: exported(target, transposed).path for transposed in (None, ENCODER_W_Q)}

    def check(transposed: str | None) -> tuple[int, str]:
        monkeypatch.setattr(export_module, "export", lambda *args, **kwargs: artefacts[transposed])
        with serving():
            status = main(["export", "--to", target, "numbers-en-fr", str(tmp_path / "out"), "--check"])
        return status, capsys.readouterr().out.splitlines()[-1]

    status, report = check(None)
    assert status == EXIT_OK, report
    forward, _, step = report.partition("; cached decoding step: ")
    imported = re.match(r"checked in a process without this project \(([a-z, ]+)\): log-probabilities max abs error ",
                        forward)
    assert imported and RUNTIMES[target][0] in imported[1].split(", "), report    # TensorFlow's import brings JAX
    assert forward.endswith("greedy tokens of 4 sentences identical, beam-4 tokens identical"), report
    assert bool(step) == (target in STEPS), report
    assert not step or ("<= bound" in step and step.endswith("positions), greedy tokens identical")), report
    status, report = check(ENCODER_W_Q)
    assert status == EXIT_DISAGREEMENT, report
    forward, _, step = report.partition("; cached decoding step: ")
    assert re.search(r"log-probabilities max abs error 3\.0\d\de\+00 > bound [0-9.]+e-05 \(float32 policy\)",
                     forward), report
    assert bool(step) == (target in STEPS) and (not step or " > bound " in step), report   # the step's too


# Up to 30 s alone: the shipped model's ONNX export (shared with this module's other ONNX tests in the same worker)
# and one checking process.
def test_export_check_decodes_as_section_6_1_whatever_the_checkpoints_conventions(tmp_path, capsys, monkeypatch,
                                                                                   exported, serving):
    """The shipped model's weights with an imported Marian model's decoding conventions -- start from pad (which the
    forward pass would mask), pad alone suppressed and the rest renormalized, a budget of 5 tokens with eos forced
    at it, |Y|^1 -- and the shipped model's ONNX artefact: ``export --check`` runs its serving loops with section
    6.1's rules and holds them to the reference decoding so too (``paper_decoding``): exit 0, every verdict
    identical, as for the shipped model itself (held to the checkpoint's own conventions, the greedy tokens differ
    in every row)."""
    config, params = load_checkpoint(SHIPPED)
    marian = config.with_decoding(decoder_start_id=config.pad_id, suppressed_ids=(config.pad_id,), renormalize=True,
                                  max_output_length=5, forced_eos=True, length_normalization="hf", length_penalty=1.0)
    save_checkpoint(tmp_path / "marian.safetensors", marian, params, tokenizer=load_tokenizer_json(SHIPPED))
    artefact = exported("onnx").path
    monkeypatch.setattr(export_module, "export", lambda *args, **kwargs: artefact)
    with serving():
        status = main(["export", "--to", "onnx", str(tmp_path / "marian.safetensors"), str(tmp_path / "out"),
                       "--check"])
    report = capsys.readouterr().out.splitlines()[-1]
    assert status == EXIT_OK, report
    assert "greedy tokens of 4 sentences identical, beam-4 tokens identical; " in report, report
    assert report.endswith("positions), greedy tokens identical"), report
    src = load_translator()[2].batch(shipped_texts())
    own = greedy_decode(Transformer(marian, params), src)
    assert all(not np.array_equal(a, b) for a, b in zip(own, greedy_decode(Transformer(config, params), src)))


# An artefact with exactly one part wrong, the other the shipped model's: lines a serving script runs after the
# artefact's loader (export_check's LOADERS) or step (its STEPS), rebinding what that defined -- a forward pass that
# reads the source reversed (its padding first), or a cached step handed empty self-attention caches at every
# position (it forgets every position before the one it writes).
ONE_PART_WRONG = {
    "forward": ("LOADERS", "\n_run = run\nrun = lambda src, tgt: _run(np.ascontiguousarray(src[:, ::-1]), tgt)\n"),
    "step": ("STEPS", "\n_step = step\nstep = lambda token, index, memory, src, keys, values, *cross: _step(\n"
                      "    token, index, memory, src, np.zeros_like(keys), np.zeros_like(values), *cross)\n"),
}


def check_one_part_wrong(target: str, part: str, artefact: Path, tmp_path: Path, capsys, serving,
                         script: str = "") -> None:
    """``export --check`` of ``artefact`` (as the command's export, with ``script`` run after the loader or the
    step, :data:`ONE_PART_WRONG`) exits 1, and its report says that ``part`` -- the forward pass or the cached
    decoding step -- and that part alone is off: its log-probabilities beyond the bound; the other part's
    log-probabilities within it and its tokens identical."""
    table, _ = ONE_PART_WRONG[part]
    with pytest.MonkeyPatch.context() as patch, serving():
        patch.setattr(export_module, "export", lambda *args, **kwargs: artefact)
        patch.setitem(getattr(export_check, table), target, getattr(export_check, table)[target] + script)
        status = main(["export", "--to", target, "numbers-en-fr", str(tmp_path / f"out-{part}"), "--check"])
    report = capsys.readouterr().out.splitlines()[-1]
    forward, _, step = report.partition("; cached decoding step: ")
    assert status == EXIT_DISAGREEMENT and step, report
    wrong, right = (forward, step) if part == "forward" else (step, forward)
    assert " > bound " in wrong, report
    assert "<= bound" in right and "DIFFER" not in right and "identical" in right, report


# About 20 s a part for ONNX (the shipped model's artefact is the module's, shared with the test above): one checking
# process each; the other targets' artefacts take up to a minute to write.
@pytest.mark.parametrize("part", list(ONE_PART_WRONG))
@pytest.mark.parametrize("target", [pytest.param(target, marks=() if target == "onnx" else pytest.mark.slow)
                                    for target in STEPS])
def test_export_check_names_the_one_part_of_the_artefact_that_is_wrong(target, part, tmp_path, capsys, exported,
                                                                       serving):
    """The case the step's check exists for: an artefact whose forward pass is right and whose cached decoding
    step is wrong (and the converse), each target: ``export --check`` exits 1 and its report names the wrong part."""
    check_one_part_wrong(target, part, exported(target).path, tmp_path, capsys, serving, ONE_PART_WRONG[part][1])


# 30 to 60 s a target: the planted export (its own trace and serialisation) and two checking processes.
@pytest.mark.slow
@pytest.mark.parametrize("target", ["torch-export", "onnx"])
def test_export_check_of_an_artefact_whose_files_mix_two_exports(target, tmp_path, capsys, exported, serving):
    """The same, each program its own file: the shipped model's artefact with the step's programs (``encode``,
    ``step``) taken from the export of the planted decoder W_k bug, and the converse (its forward pass taken from
    it) -- the bug is in every program of that export."""
    suffix = target.split("-")[-1].replace("export", "pt2")
    programs = {"forward": [f"model.{suffix}"], "step": [f"encode.{suffix}", f"step.{suffix}"]}
    for part, names in programs.items():
        mixed = tmp_path / part / target
        shutil.copytree(exported(target).path, mixed)
        for name in names:
            shutil.copy(exported(target, DECODER_W_K).path / name, mixed / name)
        check_one_part_wrong(target, part, mixed, tmp_path, capsys, serving)


def test_export_check_is_for_the_forward_pass_targets(tmp_path, capsys):
    """``--check`` with ``--to ctranslate2`` (which brings its own decoder): one line, exit 2, nothing written."""
    assert main(["export", "--to", "ctranslate2", "numbers-en-fr", str(tmp_path / "out"), "--check"]) == EXIT_USAGE
    assert capsys.readouterr().err == ("transformer-reference: error: --check runs the forward-pass targets "
                                       "(savedmodel, jax-export, torch-export, onnx), not ctranslate2\n")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- capture in the ports


# ----------------------------------------------------------------------------- the command's refusals

def test_export_refuses_an_existing_output_its_input_and_a_missing_runtime(tmp_path, capsys, monkeypatch):
    """One line on stderr, exit 2, nothing written: an existing OUTPUT_DIR without --force (kept as it was), an
    OUTPUT_DIR holding the checkpoint (even with --force), a framework that is not installed (naming the extra)."""
    config = TransformerConfig.preset("tiny")
    checkpoint = tmp_path / "m.safetensors"
    save_checkpoint(checkpoint, config, init_params(config, seed=0))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("a user's file")
    monkeypatch.setitem(sys.modules, "onnxscript", None)                  # import onnxscript fails
    cases = {("onnx", "out"): f"OUTPUT_DIR: '{tmp_path / 'out'}' already exists; pass --force to replace it",
             ("onnx", "."): f"OUTPUT_DIR: writing '{tmp_path}' would replace the input '{checkpoint}'; write elsewhere",
             ("onnx", "new"): "exporting to onnx needs onnxscript: pip install 'transformer-reference[export]'"}
    for (target, output), message in cases.items():
        force = ["--force"] if output == "." else []
        assert main(["export", "--to", target, str(checkpoint), str(tmp_path / output), *force]) == EXIT_USAGE
        assert capsys.readouterr().err == f"transformer-reference: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_export_shows_a_progress_bar_over_the_programs_it_traces(tmp_path, capsys, monkeypatch):
    """On a terminal, ``export`` shows a bar over the programs it traces (jax-export: the forward pass, encode and
    step), erased once done; off a terminal it prints its report alone."""
    require("jax", "jax")
    pytest.importorskip("tqdm", reason="the progress bar is tqdm's (the 'cli' extra)")
    config = TransformerConfig.preset("tiny")
    checkpoint = tmp_path / "m.safetensors"
    save_checkpoint(checkpoint, config, init_params(config, seed=0))
    for terminal in (True, False):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
        assert main(["export", "--to", "jax-export", str(checkpoint), str(tmp_path / f"out-{terminal}")]) == EXIT_OK
        err = capsys.readouterr().err
        assert (re.search(r"export jax-export: 100%.* 3/3 ", err) is not None) == terminal, err


def test_export_command(tmp_path, capsys):
    """``export --to ctranslate2``: what it wrote; an existing directory replaced only with ``--force``; a target
    that is none refused by name."""
    require("ctranslate2", "peers")
    config, checkpoint = TransformerConfig.preset("tiny"), str(tmp_path / "m.safetensors")
    save_checkpoint(checkpoint, config, init_params(config, seed=0, dtype=np.float32))
    out = str(tmp_path / "model")
    assert main(["export", "--to", "ctranslate2", checkpoint, out]) == EXIT_OK
    assert capsys.readouterr().out.startswith(f"wrote {out}: a float32 CTranslate2 model")
    assert main(["export", "--to", "ctranslate2", checkpoint, out]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"transformer-reference: error: OUTPUT_DIR: '{out}' already exists; pass --force to replace it\n"
    assert main(["export", "--to", "ctranslate2", checkpoint, out, "--force"]) == EXIT_OK
    assert main(["export", "--to", "tflite", checkpoint, out]) == EXIT_USAGE
    assert "argument --to: invalid choice: 'tflite'" in capsys.readouterr().err
