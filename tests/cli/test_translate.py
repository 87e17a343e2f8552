"""Text in, text out: ``translate``, ``compare`` and ``plot attention`` on the shipped English-to-French numbers
model, and ``train --task numbers`` (in-process through ``transformer_cli.main.main``). Expected French is written
from French grammar here, not read from the code."""

from __future__ import annotations

import importlib
import io
import json
import os

import numpy as np
import pytest
from in_process import cli

from equivalence import backends, tolerance
from equivalence.oracle import SENTENCES
from reference_numpy import TransformerConfig, init_params, save_checkpoint
from reference_numpy.checkpoint import load_tokenizer_json, load_training_state
from transformer_cli.commands.attention import attention_by_backend
from transformer_cli.main import EXIT_OK, EXIT_USAGE
from transformer_tasks.translation import SHIPPED

# (English, French) by the rules: "et" in 21..71, "quatre-vingts" and "cents" take an s only at the end
GRAMMAR = [("three hundred and twelve", "trois cent douze"),
           ("seventy-one thousand, two hundred", "soixante et onze mille deux cents"),
           ("eighty thousand and eighty", "quatre-vingt mille quatre-vingts"),
           ("twenty-one", "vingt et un"),
           ("two hundred thousand and one", "deux cent mille un")]


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


@pytest.mark.parametrize("backend", list(backends.BACKENDS))
def test_an_output_budget_keeps_the_first_words(backend, capsys):
    """``--max-output-length 2``: greedy decoding stops after two tokens (the shipped model's tokens are words), so
    each translation is the first two words of its French; 0 is refused naming the flag."""
    adapters, missing = backends.load((backend,))
    if not adapters:
        pytest.skip(missing[0].reason)
    status, out, err = cli(capsys, "translate", "--backend", backend, "--max-output-length", "2",
                           *(english for english, _ in GRAMMAR))
    assert status == EXIT_OK, err
    assert out.splitlines() == [" ".join(french.split()[:2]) for _, french in GRAMMAR]
    status, out, err = cli(capsys, "translate", "--backend", backend, "--max-output-length", "0", "twenty-one")
    assert (status, out) == (EXIT_USAGE, "") and "--max-output-length" in err


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
    """Cross-attention of the shipped model, last layer, head 3 (docs/attention.png): each French word is written
    looking at the English word it translates; the picture is produced."""
    weights, query, key, _ = attention_by_backend(None, None, 3, "decoder_cross", None, None, ("numpy",))
    matrix = weights["numpy (float64)"]
    assert tolerance.max_abs(matrix.sum(axis=1), np.ones(len(matrix))) <= tolerance.float64_bound(np.ones(1))
    looked_at = {word.strip("▁"): key[int(np.argmax(row))].strip("▁") for word, row in zip(query, matrix)}
    assert looked_at == {"soixante": "seventy-one", "et": "seventy-one", "onze": "seventy-one",
                         "mille": "thousand,", "deux": "two", "cents": "hundred", "</s>": "</s>"}
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


# ----------------------------------------------------------------------------- files in batches (issue 26)

def number_words(count: int, seed: int, distinct: int | None = None, lang: str = "en") -> list[str]:
    """``count`` numbers below a million as ``num2words`` writes them, drawn with ``seed`` from ``distinct``
    numbers (all of them by default)."""
    num2words = pytest.importorskip("num2words", reason="number words need num2words (the text extra)").num2words
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 1_000_000, distinct or count)
    return [num2words(int(n), lang=lang) for n in rng.choice(pool, count)]


# 21 s alone (31 to 61 s in a whole run): the reference decodes each of the 200 distinct lines alone, and the command
# the 1,000 lines in 16 batches of 64 -- a count of lines at which every number recurs in other batches and places.
def test_a_file_in_batches_gives_each_lines_own_translation(tmp_path, capsys):
    """1,000 lines (200 distinct numbers, so each recurs in other batches and places), translated by ``--input`` in
    batches of 64 sorted by length, are the lines each decoded alone by the reference (greedy, float64), in the
    file's order."""
    from equivalence.backends import numpy as reference_adapter
    from transformer_tasks.translation import load_translator

    lines = number_words(1000, seed=26, distinct=200)
    (tmp_path / "en.txt").write_text("".join(f"{line}\n" for line in lines))
    status, _, err = cli(capsys, "translate", "--input", str(tmp_path / "en.txt"), "--output", str(tmp_path / "fr.txt"),
                         "--batch-size", "64", "--dtype", "float64")
    assert status == EXIT_OK, err
    config, params, tokenizer = load_translator()
    model = reference_adapter.build(config, params, "float64")
    alone = {line: tokenizer.decode(reference_adapter.greedy(model, tokenizer.batch([line]))[0]) for line in set(lines)}
    assert (tmp_path / "fr.txt").read_text().splitlines() == [alone[line] for line in lines]


def test_every_backend_writes_the_same_file_in_float64(tmp_path, capsys):
    """50 lines, batches of 25: every installed backend writes the reference's text, line for line."""
    (tmp_path / "en.txt").write_text("".join(f"{line}\n" for line in number_words(50, seed=5)))
    texts = {}
    for backend in backends.BACKENDS:
        if not backends.load((backend,))[0]:
            continue
        out = tmp_path / f"{backend}.txt"
        status, _, err = cli(capsys, "translate", "--backend", backend, "--dtype", "float64", "--batch-size", "25",
                             "--input", str(tmp_path / "en.txt"), "--output", str(out))
        assert status == EXIT_OK, err
        texts[backend] = out.read_text()
    assert len(texts["numpy"].splitlines()) == 50 and all(texts["numpy"].splitlines())
    assert {name: text == texts["numpy"] for name, text in texts.items()} == dict.fromkeys(texts, True)


@pytest.mark.parametrize("backend", list(backends.BACKENDS))
def test_batches_at_once_write_the_lines_each_decoded_alone(backend, tmp_path, capsys):
    """``--batches-at-once 2 --threads 2``: 24 lines in 6 batches of 4, two decoded at a time in threads of their own
    (float64, greedy), are the lines each decoded alone by the reference, in the file's order."""
    from equivalence.backends import numpy as reference_adapter
    from transformer_tasks.translation import load_translator

    if not backends.load((backend,))[0]:
        pytest.skip(f"{backend} is not installed")
    lines = number_words(24, seed=9)
    (tmp_path / "en.txt").write_text("".join(f"{line}\n" for line in lines))
    status, _, err = cli(capsys, "translate", "--backend", backend, "--dtype", "float64", "--batch-size", "4",
                         "--threads", "2", "--batches-at-once", "2", "--input", str(tmp_path / "en.txt"),
                         "--output", str(tmp_path / "fr.txt"))
    assert status == EXIT_OK, err
    config, params, tokenizer = load_translator()
    model = reference_adapter.build(config, params, "float64")
    alone = [tokenizer.decode(reference_adapter.greedy(model, tokenizer.batch([line]))[0]) for line in lines]
    assert (tmp_path / "fr.txt").read_text().splitlines() == alone


def test_a_line_that_cannot_be_translated_is_reported_and_the_rest_translated(tmp_path, capsys):
    """A blank line gives a blank line; a line with characters the tokenizer never saw, one longer than the model's
    positions and one that is not UTF-8 are each one stderr line naming their number and an empty output line;
    the others are translated, and the status is 2."""
    too_long = " ".join(["seventy-one"] * 64)              # 64 tokens at least, and eos
    (tmp_path / "en.txt").write_bytes(b"\n".join([b"twenty-one", b"", b"3 hundred", too_long.encode(), b"\xffoops",
                                                  b"three hundred and twelve"]) + b"\n")
    status, out, err = cli(capsys, "translate", "--input", str(tmp_path / "en.txt"))
    assert status == EXIT_USAGE
    assert out.splitlines() == ["vingt et un", "", "", "", "", "trois cent douze"]
    problems = err.splitlines()
    assert len(problems) == 3 and "Traceback" not in err
    where = repr(str(tmp_path / "en.txt"))
    assert problems[0].endswith(f"{where}, line 3: text '3 hundred' holds characters the tokenizer has never seen: "
                                "'3'")
    assert f"{where}, line 4: source length " in problems[1] and "exceeds max_len 64" in problems[1]
    assert problems[2].endswith(f"{where}, line 5: not UTF-8 text (byte 0xff at offset 0)")


def test_standard_input_from_a_file_is_batched_and_a_pipe_read_line_by_line(tmp_path, monkeypatch):
    """``< FILE`` is read whole (batched); a pipe, which may be a conversation, one line at a time."""
    from transformer_cli.commands.translate import is_file

    (tmp_path / "en.txt").write_text("eighty\n")
    with open(tmp_path / "en.txt") as redirected:
        assert is_file(redirected)
    read, write = os.pipe()
    with os.fdopen(read) as pipe, os.fdopen(write, "w"):
        assert not is_file(pipe)
    assert not is_file(io.StringIO("eighty\n"))


def test_the_output_file_never_replaces_an_existing_file_or_the_input(tmp_path, capsys, monkeypatch):
    (tmp_path / "en.txt").write_text("eighty\n")
    (tmp_path / "fr.txt").write_text("mine\n")
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the flags were checked"))
    translate = ("translate", "--input", str(tmp_path / "en.txt"), "--output")
    for args, words in (((str(tmp_path / "fr.txt"),), ("--output", "already exists", "--force")),
                        ((str(tmp_path / "en.txt"), "--force"), ("--output", "would replace the input"))):
        status, _, err = cli(capsys, *translate, *args)
        assert status == EXIT_USAGE and len(err.splitlines()) == 1 and all(word in err for word in words), err
    with open(tmp_path / "en.txt") as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        status, _, err = cli(capsys, "translate", "--output", str(tmp_path / "en.txt"), "--force")
    assert status == EXIT_USAGE and "would replace the input (standard input reads it)" in err
    assert (tmp_path / "fr.txt").read_text() == "mine\n" and (tmp_path / "en.txt").read_text() == "eighty\n"
    status, _, err = cli(capsys, "translate", "twelve", "--input", str(tmp_path / "en.txt"))
    assert status == EXIT_USAGE and "not both" in err


# ----------------------------------------------------------------------------- models by name, tokenizers kept

PORTS = {"torch": "transformer_torch", "jax": "transformer_jax", "tf": "transformer_tf"}


def port(name: str):
    """A port's package, skipped (with its reason) where its framework is not installed."""
    adapters, missing = backends.load((name,))
    if not adapters:
        pytest.skip(missing[0].reason)
    return importlib.import_module(PORTS[name])


def test_the_shipped_model_loads_by_name_in_every_backend():
    """``load_checkpoint("numbers-en-fr")`` is the shipped file, in the reference and in each port."""
    from reference_numpy import load_checkpoint

    config, params = load_checkpoint("numbers-en-fr")
    shipped_config, shipped = load_checkpoint(SHIPPED)
    assert config == shipped_config and all(np.array_equal(params[n], shipped[n]) for n in shipped)
    for name in PORTS:
        module = port(name)
        model = module.load_checkpoint("numbers-en-fr")
        assert model.config == config
        weights = module.to_params(model)
        assert all(np.array_equal(weights[n], shipped[n]) for n in shipped), name
    assert load_tokenizer_json("numbers-en-fr") == load_tokenizer_json(SHIPPED) is not None


def test_a_file_wins_over_a_name_and_an_unknown_name_lists_the_shipped_ones(tmp_path, monkeypatch, capsys):
    from reference_numpy import load_checkpoint

    monkeypatch.chdir(tmp_path)
    tiny = TransformerConfig.preset("tiny")
    save_checkpoint("numbers-en-fr", tiny, init_params(tiny, seed=0))
    assert load_checkpoint("numbers-en-fr")[0] == tiny
    message = ("checkpoint 'numbers-en-es': does not exist, and no shipped model has that name (shipped: "
               "numbers-en-fr)")
    with pytest.raises(ValueError) as caught:
        load_checkpoint("numbers-en-es")
    assert str(caught.value) == message
    for name in PORTS:
        with pytest.raises(ValueError) as caught:
            port(name).load_checkpoint("numbers-en-es")
        assert str(caught.value) == message, name
    status, _, err = cli(capsys, "translate", "--checkpoint", "numbers-en-es", "twelve")
    assert status == EXIT_USAGE and err.strip().endswith(message)


def test_translate_takes_a_shipped_models_name(capsys):
    status, out, err = cli(capsys, "translate", "--checkpoint", "numbers-en-fr", GRAMMAR[0][0])
    assert status == EXIT_OK, err
    assert out == f"{GRAMMAR[0][1]}\n"


@pytest.mark.parametrize("backend", list(backends.BACKENDS))
def test_a_loaded_model_saved_with_its_tokenizer_translates(backend, tmp_path, capsys):
    """The tokenizer travels beside the model, never in it: ``from_pretrained`` gives the shipped model and its
    tokenizer, each backend's save (as after fine-tuning) writes the tokenizer it is given, and ``translate
    --checkpoint`` reads the copy; a port's save given none writes none, and anything but a JSON text or None is the
    reference's one message."""
    from transformer_hf import from_pretrained

    saved = tmp_path / "saved.safetensors"
    if backend == "numpy":
        model, tokenizer = from_pretrained("numbers-en-fr")
        save_checkpoint(saved, model.config, model.params, tokenizer=tokenizer.to_json())
    else:
        module = port(backend)
        model, tokenizer = from_pretrained("numbers-en-fr", backend)
        assert not hasattr(model, "tokenizer_json")
        module.save_checkpoint(model, saved, tokenizer=tokenizer.to_json())
        module.save_checkpoint(model, tmp_path / "bare.safetensors")
        assert load_tokenizer_json(tmp_path / "bare.safetensors") is None
        with pytest.raises(ValueError, match=r"^tokenizer must be a tokenizer's JSON text .*, got True$"):
            module.save_checkpoint(model, tmp_path / "bad.safetensors", tokenizer=True)
    assert load_tokenizer_json(saved) == load_tokenizer_json(SHIPPED)
    status, out, err = cli(capsys, "translate", "--checkpoint", str(saved), GRAMMAR[1][0])
    assert status == EXIT_OK, err
    assert out == f"{GRAMMAR[1][1]}\n"
