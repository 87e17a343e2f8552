"""Text in, text out: ``translate``, ``compare`` and ``plot attention`` on the shipped English-to-French numbers
model, and ``train --task numbers`` (in-process through ``transformer_cli.main.main``). Expected French is written
from French grammar here, not read from the code."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from equivalence import tolerance
from reference_numpy import TransformerConfig, init_params, save_checkpoint
from reference_numpy.checkpoint import load_tokenizer_json, load_training_state
from transformer_cli import backends
from transformer_cli.attention import attention_by_backend
from transformer_cli.compare import SENTENCES
from transformer_cli.main import EXIT_OK, EXIT_USAGE, main
from transformer_cli.translate import SHIPPED

# (English, French) by the rules: "et" in 21..71, "quatre-vingts" and "cents" take an s only at the end
GRAMMAR = [("three hundred and twelve", "trois cent douze"),
           ("seventy-one thousand, two hundred", "soixante et onze mille deux cents"),
           ("eighty thousand and eighty", "quatre-vingt mille quatre-vingts"),
           ("twenty-one", "vingt et un"),
           ("two hundred thousand and one", "deux cent mille un")]


def cli(capsys, *args: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_translate_sentences_given_as_arguments(capsys):
    status, out, err = cli(capsys, "translate", *(english for english, _ in GRAMMAR))
    assert status == EXIT_OK, err
    assert out.splitlines() == [french for _, french in GRAMMAR]


def test_translate_reads_standard_input_line_by_line(capsys, monkeypatch):
    """One output line per input line, a blank line for a blank line; case and spacing are normalised."""
    status, out, err = cli(capsys, "translate", stdin="Twenty-One\n\n  three   hundred and twelve\n",
                           monkeypatch=monkeypatch)
    assert status == EXIT_OK, err
    assert out.splitlines() == ["vingt et un", "", "trois cent douze"]


@pytest.mark.parametrize("backend", list(backends.BACKENDS))
def test_translate_in_every_backend_with_beam_search(backend, capsys):
    """Beam search (beam 4, alpha 0.6, section 6.1) in each backend, float64: the same French."""
    adapters, missing = backends.load((backend,))
    if not adapters:
        pytest.skip(missing[0].reason)
    status, out, err = cli(capsys, "translate", "--backend", backend, "--beam", "4", "--dtype", "float64",
                           *(english for english, _ in GRAMMAR[:3]))
    assert status == EXIT_OK, err
    assert out.splitlines() == [french for _, french in GRAMMAR[:3]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", list(backends.BACKENDS))
def test_translate_in_low_precision(backend, dtype, capsys):
    """``--dtype bfloat16`` and ``float16`` in each backend, greedy and beam 4: the same French (the shipped model
    decides by margins far above either format's error: docs/equivalence.md, "Low precision")."""
    adapters, missing = backends.load((backend,))
    if not adapters:
        pytest.skip(missing[0].reason)
    for beam in ("1", "4"):
        status, out, err = cli(capsys, "translate", "--backend", backend, "--beam", beam, "--dtype", dtype,
                               *(english for english, _ in GRAMMAR))
        assert status == EXIT_OK, err
        assert out.splitlines() == [french for _, french in GRAMMAR]


def test_translate_refuses_characters_the_tokenizer_never_saw(capsys):
    status, out, err = cli(capsys, "translate", "3 hundred")
    assert status == EXIT_USAGE and out == ""
    assert len(err.splitlines()) == 1 and "'3'" in err and "never seen" in err


def test_a_checkpoint_without_a_tokenizer_still_loads_and_says_it_has_none(tmp_path, capsys):
    """Ids in, ids out: compare runs on it; the text commands say it has no tokenizer."""
    path = tmp_path / "tiny.safetensors"
    config = TransformerConfig.preset("tiny")
    save_checkpoint(path, config, init_params(config, seed=0))
    assert load_tokenizer_json(path) is None
    status, _, err = cli(capsys, "translate", "--checkpoint", str(path), "twelve")
    assert status == EXIT_USAGE and "has no tokenizer" in err and len(err.splitlines()) == 1
    status, _, err = cli(capsys, "plot", "attention", str(path), "--text", "twelve", "--backends", "numpy",
                         "--out", str(tmp_path / "a.png"))
    assert status == EXIT_USAGE and "no tokenizer" in err
    status, out, err = cli(capsys, "compare", str(path), "--backends", "numpy")
    assert status == EXIT_OK, err
    assert "translations" not in out


def test_compare_by_default_shows_the_shipped_models_translations(capsys):
    """The default checkpoint is the shipped model: its sentences, the reference's translation of each, and how
    many runs wrote the same text, in the table and in JSON."""
    status, out, err = cli(capsys, "compare", "--backends", "numpy")
    assert status == EXIT_OK, err
    assert "shipped English-to-French numbers model" in out
    for english, french in GRAMMAR[:3]:
        assert f"  {english}\n    -> {french}   [1 of 1 runs identical]" in out
    status, out, err = cli(capsys, "compare", "--backends", "numpy", "--json")
    translations = json.loads(out)["translations"]
    assert [t["source"] for t in translations] == list(SENTENCES)
    assert all(t["runs"] == {"numpy/cpu/f32": t["reference"]} for t in translations)


def test_compare_on_a_seeded_preset(capsys):
    status, out, err = cli(capsys, "compare", "--preset", "tiny", "--backends", "numpy")
    assert status == EXIT_OK, err
    assert "tiny preset, seeded random weights" in out and "translations" not in out
    status, _, err = cli(capsys, "compare", str(SHIPPED), "--preset", "tiny", "--backends", "numpy")
    assert status == EXIT_USAGE and "--preset" in err


def test_plot_attention_shows_the_source_target_alignment(tmp_path, capsys):
    """Cross-attention of the shipped model, last layer, head 1 (docs/attention.png): each French word is written
    looking at the English word it translates; the picture is produced."""
    weights, query, key, _ = attention_by_backend(None, None, 1, "decoder_cross", None, None, ("numpy",))
    matrix = weights["numpy (float64)"]
    assert tolerance.max_abs(matrix.sum(axis=1), np.ones(len(matrix))) <= tolerance.float64_bound(np.ones(1))
    looked_at = {word.strip("▁"): key[int(np.argmax(row))].strip("▁") for word, row in zip(query, matrix)}
    assert looked_at == {"soixante": "seventy-one", "et": "seventy-one", "onze": "seventy-one",
                         "mille": "thousand,", "deux": "two", "cents": "hundred", "</s>": "hundred"}
    status, _, err = cli(capsys, "plot", "attention", "--head", "1", "--backends", "numpy",
                         "--text", "eighty thousand and eighty", "--out", str(tmp_path / "attention.png"))
    assert status == EXIT_OK, err
    assert (tmp_path / "attention.png").read_bytes().startswith(b"\x89PNG")


def test_train_the_numbers_task_saves_the_tokenizer_and_resumes(tmp_path, capsys):
    """A short reference run of the numbers task: its checkpoint holds the tokenizer, a resumed run keeps it, and
    the results report BLEU beside exact match."""
    out = tmp_path / "run.safetensors"
    args = ("train", "--task", "numbers", "--batch-size", "4", "--eval-size", "3", "--stop-at", "0", "--json")
    status, stdout, err = cli(capsys, *args, "--steps", "2", "--out", str(out))
    assert status == EXIT_OK, err
    result = json.loads(stdout)[0]
    assert result["steps"] == 2 and 0 <= result["accuracy"] <= 1 and 0 <= result["bleu"] <= 100
    tokenizer = load_tokenizer_json(out)
    assert tokenizer is not None and load_training_state(out).step == 2
    status, stdout, err = cli(capsys, *args, "--steps", "1", "--resume", str(out), "--out", str(out), "--force")
    assert status == EXIT_OK, err
    assert load_tokenizer_json(out) == tokenizer and load_training_state(out).step == 3


def test_train_refuses_copy_task_flags_with_the_numbers_task(capsys):
    status, _, err = cli(capsys, "train", "--task", "numbers", "--symbols", "4")
    assert status == EXIT_USAGE and "--symbols" in err and "--task copy" in err


def test_translate_names_a_backend_that_is_not_installed(capsys, monkeypatch):
    monkeypatch.setattr(backends, "load", lambda names: ({}, [backends.Missing(names[0], "not installed (x)")]))
    status, out, err = cli(capsys, "translate", "--backend", "tf", "twelve")
    assert status == EXIT_USAGE and out == ""
    assert err.strip().endswith("error: --backend: tf is not installed (x)")
