"""``transformer-reference evaluate`` (issue 26): its scores against sacreBLEU run here on the same translations, its
exact-match rate against a count made here, and its refusals (one line each, before any model is loaded).
In-process through ``transformer_cli.main.main``; the test set is number words written by ``num2words``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from in_process import cli

from equivalence import backends
from transformer_cli.main import EXIT_OK, EXIT_USAGE

sacrebleu = pytest.importorskip("sacrebleu", reason="evaluate scores with sacrebleu (the text extra)")
num2words = pytest.importorskip("num2words", reason="the test set is written by num2words (the text extra)").num2words

SENTENCES = 60


@pytest.fixture
def test_set(tmp_path):
    """60 English numbers and their French, every 7th reference replaced by another number's French (so that the
    scores are neither 0 nor 100): the paths of the source and reference files."""
    numbers = np.random.default_rng(7).integers(0, 1_000_000, SENTENCES)
    french = [num2words(int(n) + 1 if i % 7 == 3 else int(n), lang="fr") for i, n in enumerate(numbers)]
    (tmp_path / "en.txt").write_text("".join(f"{num2words(int(n), lang='en')}\n" for n in numbers))
    (tmp_path / "fr.txt").write_text("".join(f"{line}\n" for line in french))
    return str(tmp_path / "en.txt"), str(tmp_path / "fr.txt")


@pytest.fixture
def no_backend(monkeypatch):
    """Fail the test if a backend is loaded: a refusal must come before any work."""
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the input was checked"))


def test_evaluate_agrees_with_sacrebleu_run_on_the_same_translations(test_set, tmp_path, capsys):
    source, reference = test_set
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                           "--batch-size", "16", "--json")
    assert status == EXIT_OK, err
    result = json.loads(out)
    status, _, err = cli(capsys, "translate", "--input", source, "--output", str(tmp_path / "hyp.txt"))
    assert status == EXIT_OK, err
    hypotheses = (tmp_path / "hyp.txt").read_text().splitlines()
    references = (tmp_path / "fr.txt").read_text().splitlines()
    bleu, chrf = sacrebleu.corpus_bleu(hypotheses, [references]), sacrebleu.corpus_chrf(hypotheses, [references])
    assert 0 < bleu.score < 100 and 0 < chrf.score < 100
    assert (result["bleu"], result["chrf"]) == (bleu.score, chrf.score)
    exact = sum(h == r for h, r in zip(hypotheses, references))
    assert exact <= SENTENCES - SENTENCES // 7
    assert (result["exact"], result["exact_match"], result["sentences"]) == (exact, exact / SENTENCES, SENTENCES)
    version = f"version:{sacrebleu.__version__}"
    assert result["bleu_signature"] == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|{version}"
    assert result["chrf_signature"] == f"nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|{version}"
    assert result["tokens"] >= SENTENCES and result["tokens_per_second"] > 0 and result["seconds"] > 0
    assert (result["backend"], result["dtype"], result["beam"], result["batch_size"]) == ("numpy", "float32", 1, 16)
    assert result["max_output_length"] is None                           # section 6.1's: the source's length + 50


def test_batches_at_once_score_the_same_translations_and_are_recorded(test_set, capsys):
    """``--batches-at-once 2 --threads 2``: the scores and counts of one batch at a time, the setting in the JSON
    and on the first printed line."""
    source, reference = test_set
    runs = {}
    for at_once in ("1", "2"):
        status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                               "--batch-size", "8", "--threads", "2", "--batches-at-once", at_once, "--json")
        assert status == EXIT_OK, err
        runs[at_once] = json.loads(out)
    scores = ("bleu", "chrf", "exact", "tokens", "sentences")
    assert [runs["2"][key] for key in scores] == [runs["1"][key] for key in scores]
    assert (runs["1"]["batches_at_once"], runs["2"]["batches_at_once"]) == (1, 2)
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                           "--threads", "2", "--batches-at-once", "2")
    assert status == EXIT_OK, err
    assert out.splitlines()[0].startswith("numbers-en-fr: numpy on cpu, float32, greedy, batches of 64, 2 at once, "
                                          "60 sentences")


def test_evaluate_prints_the_scores_with_their_signatures(test_set, capsys):
    source, reference = test_set
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                           "--beam", "2")
    assert status == EXIT_OK, err
    lines = out.splitlines()
    assert lines[0].startswith("numbers-en-fr: numpy on cpu, float32, beam 2, alpha 0.6, batches of 64, 60 sentences")
    assert lines[1].startswith("  BLEU") and "tok:13a" in lines[1]
    assert lines[2].startswith("  chrF") and "nc:6" in lines[2]
    assert lines[3].startswith("  exact") and "of 60)" in lines[3]
    assert "tokens/s" in lines[4]


def test_an_output_budget_is_applied_and_recorded(test_set, capsys):
    """``--max-output-length 1``: every sentence's output is one token (no eos fits after it), so the tokens
    generated are the sentences; the record and the header line carry the budget."""
    source, reference = test_set
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                           "--max-output-length", "1", "--json")
    assert status == EXIT_OK, err
    result = json.loads(out)
    assert (result["max_output_length"], result["tokens"]) == (1, result["sentences"])
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference", reference,
                           "--max-output-length", "1")
    assert status == EXIT_OK, err
    assert ", max_output_length 1, batches of 64" in out.splitlines()[0]


def test_files_that_do_not_pair_line_for_line_are_refused_before_any_work(test_set, tmp_path, no_backend, capsys):
    source, _ = test_set
    (tmp_path / "short.txt").write_text("un\ndeux\n")
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", source, "--reference",
                           str(tmp_path / "short.txt"))
    assert status == EXIT_USAGE and out == ""
    assert err.strip().splitlines() == [f"transformer-reference: error: --source {source!r} has {SENTENCES} lines and "
                                        f"--reference {str(tmp_path / 'short.txt')!r} has 2; they must pair line for "
                                        "line"]


@pytest.mark.parametrize("content, problem", [
    (b"eighty\n3 hundred\n", "line 2: text '3 hundred' holds characters the tokenizer has never seen: '3'"),
    (b"eighty\n\n", "line 2: text is empty"),
    (b"eighty\n\xe9t\xe9\n", "line 2: not UTF-8 text (byte 0xe9 at offset 0)"),
])
def test_a_source_line_that_cannot_be_translated_is_one_line_naming_it(tmp_path, content, problem, capsys):
    (tmp_path / "en.txt").write_bytes(content)
    (tmp_path / "fr.txt").write_text("quatre-vingts\ntrois cents\n")
    status, out, err = cli(capsys, "evaluate", "numbers-en-fr", "--source", str(tmp_path / "en.txt"),
                           "--reference", str(tmp_path / "fr.txt"))
    assert status == EXIT_USAGE and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"transformer-reference: error: --source {str(tmp_path / 'en.txt')!r}")
    assert line.endswith(problem)


def test_an_unknown_checkpoint_name_lists_the_shipped_models(test_set, capsys):
    source, reference = test_set
    status, out, err = cli(capsys, "evaluate", "numbers-en-es", "--source", source, "--reference", reference)
    assert status == EXIT_USAGE and out == ""
    assert err.strip() == ("transformer-reference: error: checkpoint 'numbers-en-es': does not exist, and no shipped "
                           "model has that name (shipped: numbers-en-fr)")
