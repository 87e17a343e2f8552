"""One reading of text files (issue 42): ``translate --input`` (and standard input), ``evaluate`` and ``train
--source/--target`` read a file's lines alike -- a line ends at LF, CRLF or a lone CR, a byte-order mark at the start
is dropped (``transformer_tasks.textfiles``); ``export --check`` checks the artefact's own tokenizer; a framework's
start-up notices (TensorFlow's oneDNN lines) are held on every path that imports one, ``export`` included.

In-process through ``main(argv)``; the TensorFlow case through the installed command (a fresh interpreter is the
only one that imports TensorFlow anew)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from in_process import cli, one_error_line

from equivalence import runtime
from reference_numpy import Transformer, TransformerConfig, beam_search, greedy_decode, init_params, save_checkpoint
from reference_numpy.checkpoint import load_checkpoint, load_tokenizer_json
from transformer_cli.main import EXIT_DISAGREEMENT, EXIT_OK, EXIT_USAGE
from transformer_export import check as export_check
from transformer_export import export as export_module
from transformer_tasks.textfiles import lines_of

SENTENCES = ("eighty", "seventy-one", "twelve")
TRANSLATIONS = ("quatre-vingts", "soixante et onze", "douze")
ENDINGS = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}
SCRIPT = shutil.which("transformer-reference", path=str(Path(sys.executable).parent))


def text_file(path: Path, lines: tuple[str, ...], ending: bytes, bom: bool = False) -> str:
    """``lines`` written with ``ending`` after each (the last one's left out for a lone CR: an old Mac file)."""
    data = ending.join(line.encode() for line in lines) + (b"" if ending == b"\r" else ending)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
    return str(path)


# ----------------------------------------------------------------------------- the lines of a file

@pytest.mark.parametrize("ending", list(ENDINGS))
def test_every_line_end_gives_the_same_lines_read_whole_or_byte_by_byte(ending):
    data = b"\xef\xbb\xbf" + ENDINGS[ending].join([b"one", b"", b"two", b"three"]) + ENDINGS[ending]
    assert list(lines_of([data])) == [b"one", b"", b"two", b"three"]
    assert list(lines_of([data[i:i + 1] for i in range(len(data))])) == [b"one", b"", b"two", b"three"]
    assert list(lines_of([b"mixed\r\nends\rand\nnone"])) == [b"mixed", b"ends", b"and", b"none"]
    assert list(lines_of([b"form\x0cfeed \xe2\x80\xa8 stay"])) == [b"form\x0cfeed \xe2\x80\xa8 stay"]


def test_a_line_is_given_as_soon_as_its_end_arrives():
    """A CR ends its line at once (a pipe may be a conversation): the line is given before the next chunk is read,
    and an LF arriving after it is the same line end."""
    arrived = []

    def chunks():
        for chunk in (b"eighty\r", b"\ntwelve\r", b"one"):
            arrived.append(chunk)
            yield chunk

    lines = lines_of(chunks())
    assert next(lines) == b"eighty" and arrived == [b"eighty\r"]
    assert next(lines) == b"twelve" and len(arrived) == 2
    assert list(lines) == [b"one"]


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_translate_input_evaluate_and_train_read_the_same_lines(ending, tmp_path, monkeypatch, capsys):
    """One file of three sentences (a byte-order mark first), with each line end: ``translate --input`` writes three
    translations, ``evaluate`` scores three sentences, ``train`` reads three pairs (its ``--valid-size 3`` refusal
    counts them, before any work)."""
    monkeypatch.chdir(tmp_path)
    english = text_file(tmp_path / "en.txt", SENTENCES, ENDINGS[ending], bom=True)
    french = text_file(tmp_path / "fr.txt", TRANSLATIONS, ENDINGS[ending])
    status, out, err = cli(capsys, "translate", "--input", english)
    assert status == EXIT_OK and out.splitlines() == list(TRANSLATIONS), err
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", english, "--reference", french, "--json")
    assert status == EXIT_OK and json.loads(out)["sentences"] == 3 and json.loads(out)["exact"] == 3, err
    status, _, err = cli(capsys, "train", "--source", english, "--target", french, "--valid-size", "3")
    assert status == EXIT_USAGE
    one_error_line(err, "--valid-size 3: the corpus holds 3 pairs")


def test_standard_input_splits_lines_at_a_lone_cr_as_a_file_does(monkeypatch, capsys):
    """A pipe (read line by line as lines arrive) of CR-ended lines: one translation per line."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"eighty\rseventy-one\r\ntwelve\r")))
    status, out, err = cli(capsys, "translate")
    assert status == EXIT_OK and out.splitlines() == list(TRANSLATIONS), err


# ----------------------------------------------------------------------------- export --check: the artefact's tokenizer

def perfect_runtime(script, output_dir, inputs, outputs, extra_length, beam_size, alpha):
    """Stands in for the isolated process: the float64 reference's answers, as a flawless artefact of the shipped
    model gives them, so that only the artefact's tokenizer can fail the check."""
    model = Transformer(*load_checkpoint("numbers-en-fr"))
    with np.load(inputs) as given:
        src, tgt = given["src"], given["tgt"]
    np.savez(outputs, log_probs=model(src, tgt).astype(np.float32), tokens=greedy_decode(model, src),
             beam_tokens=beam_search(model, src, beam_size, alpha)[0])
    return ["onnxruntime"]


def damaged(tokenizer: str, damage: str) -> str | None:
    """The shipped model's tokenizer JSON as an artefact may hold it: intact, cut in half, two pieces' ids swapped,
    or missing (None)."""
    if damage == "cut":
        return tokenizer[:len(tokenizer) // 2]
    if damage == "swapped":
        data = json.loads(tokenizer)
        vocab = data["model"]["vocab"]
        first, second = sorted(vocab, key=vocab.get)[-2:]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        return json.dumps(data)
    return None if damage == "missing" else tokenizer


@pytest.mark.parametrize("damage, status, verdict", [
    ("none", EXIT_OK, "identical (the checkpoint's)"),
    ("cut", EXIT_DISAGREEMENT, "DIFFER (unreadable: tokenizer is not a tokenizers JSON text"),
    ("swapped", EXIT_DISAGREEMENT, "DIFFER (another vocabulary than the checkpoint's)"),
    ("missing", EXIT_DISAGREEMENT, "DIFFER (missing; the checkpoint has a tokenizer)"),
])
def test_export_check_checks_the_artefacts_own_tokenizer(damage, status, verdict, tmp_path, monkeypatch, capsys):
    """An artefact whose forward pass is flawless and whose tokenizer.json is not the checkpoint's fails the check
    (exit 1), naming the file and what differs. (Without a tokenizer it can read, the check runs ``compare``'s seeded
    batch.)"""
    config, _ = load_checkpoint("numbers-en-fr")
    artefact = tmp_path / "artefact"
    artefact.mkdir()
    (artefact / "transformer.json").write_text(json.dumps({
        "target": "onnx", "dtype": "float32", "inputs": ["src", "tgt"], "output": "log_probs", "files": ["model.onnx"],
        "config": config.to_dict()}))
    if (text := damaged(load_tokenizer_json("numbers-en-fr"), damage)) is not None:
        (artefact / "tokenizer.json").write_text(text)
    monkeypatch.setattr(export_module, "export", lambda *args, **kwargs: artefact)
    monkeypatch.setattr(export_check, "run_isolated", perfect_runtime)
    done, out, err = cli(capsys, "export", "--to", "onnx", "numbers-en-fr", str(tmp_path / "out"), "--check")
    assert done == status, out + err
    wrote, tokenizer, checked = out.splitlines()
    assert tokenizer.startswith(f"tokenizer.json of the artefact: {verdict}"), tokenizer
    assert checked.endswith(" sentences identical, beam-4 tokens identical"), checked     # the model is flawless


# ----------------------------------------------------------------------------- TensorFlow's start-up notices

def test_a_framework_imported_by_any_command_has_its_notices_held(tmp_path, monkeypatch, capfd):
    """``runtime.import_framework`` (what ``backends.load``, ``export`` and ``bench``'s products import through)
    holds what a framework's native code writes to file descriptor 2 while it loads; ``export``'s one-line error then
    stands alone. A stand-in framework writes TensorFlow's notice."""
    (tmp_path / "noisy_framework.py").write_text(
        "import os\nos.write(2, b'I0000 port.cc:153] oneDNN custom operations are on.\\n')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.delitem(sys.modules, "noisy_framework", raising=False)
    writer = export_module.WRITERS["savedmodel"]
    monkeypatch.setitem(export_module.WRITERS, "savedmodel", export_module.Writer(
        writer.write, writer.files, (("noisy_framework", "tf"),), writer.steps))
    (tmp_path / "broken.safetensors").write_bytes(b"not a checkpoint")
    status, out, err = cli(capfd, "export", "--to", "savedmodel", str(tmp_path / "broken.safetensors"),
                              str(tmp_path / "out"))
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, "broken.safetensors")
    assert "noisy_framework" in sys.modules and runtime.imported("noisy_framework")


@pytest.mark.slow
@pytest.mark.skipif(SCRIPT is None, reason="the package is not installed (pip install -e .)")
def test_export_to_savedmodel_prints_its_one_line_error_and_no_tensorflow_notice(tmp_path):
    """Through the installed command, TensorFlow imported anew: the error of a checkpoint that cannot be read is the
    only line on stderr."""
    pytest.importorskip("tensorflow", reason="TensorFlow is not installed (pip install '.[tf]')")
    (tmp_path / "broken.safetensors").write_bytes(b"not a checkpoint")
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([SCRIPT, "export", "--to", "savedmodel", "broken.safetensors", "out"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == EXIT_USAGE and done.stdout == ""
    one_error_line(done.stderr, "broken.safetensors")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_a_tokenizer_needs_none_in_its_artefact(tmp_path):
    """Neither has a tokenizer: nothing to check (the seeded batch is run); an artefact that has one is refused."""
    config = TransformerConfig.preset("tiny")
    save_checkpoint(tmp_path / "tiny.safetensors", config, init_params(config, seed=0))
    assert export_check.artefact_tokenizer(tmp_path, config, None) == (None, None)
    (tmp_path / "tokenizer.json").write_text(load_tokenizer_json("numbers-en-fr"))
    numbers, _ = load_checkpoint("numbers-en-fr")
    tokenizer, verdict = export_check.artefact_tokenizer(tmp_path, numbers, None)
    assert tokenizer is not None and verdict == export_check.Verdict(False, "the checkpoint has no tokenizer")
