"""Training on a user's own corpus (issue 26): files written here -- English number words to Spanish ones, by
``num2words`` -- trained through the command line in every installed backend (float64 losses within the reference
run's training bound), token-count batching (section 5.1: no batch over its budget, every sentence once an epoch),
checkpoints saved every N steps and averaged (section 6.1) -- checked against a hand average read with safetensors'
own reader --, the standalone ``average`` command, bad files refused in one line before any training, and the
progress bar closing where a run stops."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from in_process import cli

from equivalence import backends, tolerance
from equivalence.training_runs import Run, assert_float64_run, reference_run
from reference_numpy import Transformer, TransformerConfig, init_params, save_checkpoint, training
from reference_numpy.checkpoint import (
    load_checkpoint,
    load_run,
    load_tokenizer_json,
    load_training_state,
)
from reference_numpy.config import TrainingConfig
from reference_numpy.tokenizer import Tokenizer
from transformer_cli import extras
from transformer_cli.commands import train as train_module
from transformer_cli.main import EXIT_OK, EXIT_USAGE, build_parser
from transformer_hf.tokenizers import load_tokenizer
from transformer_tasks.batches import CountedBatches
from transformer_tasks.copy import VALIDATION as VALIDATION_SPLIT
from transformer_tasks.copy import CopyTask
from transformer_tasks.corpus import CorpusTask, read_corpus

for _library in ("tokenizers", "num2words", "sacrebleu"):
    pytest.importorskip(_library, reason=f"{_library} (the text extra) is not installed")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="safetensors is not installed")

INSTALLED = tuple(backends.load(tuple(backends.BACKENDS))[0])
TRAINING, VALIDATION = 300, 16                      # lines of the training and validation files
BUDGET = 512                                        # --tokens-per-batch of the runs here


def one_error_line(err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("transformer-reference: error:"), err
    assert all(word in lines[0] for word in words), err
    return lines[0]


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    """English and Spanish number words below 10,000, one per line: a training pair of files and a validation pair
    of files (numbers never trained on)."""
    from num2words import num2words

    directory = tmp_path_factory.mktemp("corpus")
    numbers = np.random.default_rng(26).choice(10_000, TRAINING + VALIDATION, replace=False)
    files = {}
    for part, chosen in (("train", numbers[:TRAINING]), ("valid", numbers[TRAINING:])):
        for language in ("en", "es"):
            files[f"{part}.{language}"] = write_lines(directory / f"{part}.{language}",
                                                      [num2words(int(n), lang=language) for n in chosen])
    return files


def corpus_flags(corpus: dict[str, str]) -> list[str]:
    return ["--source", corpus["train.en"], "--target", corpus["train.es"], "--valid-source", corpus["valid.en"],
            "--valid-target", corpus["valid.es"], "--preset", "tiny", "--vocab-size", "200",
            "--tokens-per-batch", str(BUDGET)]


@pytest.fixture(scope="module")
def task(corpus) -> tuple[CorpusTask, TransformerConfig]:
    made = CorpusTask(*read_corpus(corpus["train.en"], corpus["train.es"], None, corpus["valid.en"],
                                   corpus["valid.es"], None), preset="tiny").with_tokenizer(200)
    config = made.config(dropout=0.0)
    return made.fitted(config, BUDGET), config


# ----------------------------------------------------------------------------- token-count batching (section 5.1)

def test_token_batches_hold_every_sentence_once_an_epoch_within_the_budget(task):
    """Two epochs of batches: each batch's source and target tensors hold at most BUDGET positions (padding
    included); the sources of one epoch's batches are the training file's sentences, each once; batches group
    similar lengths (the length ranges of two batches overlap at most at one end); the second epoch draws other
    batches in another order, of the same shapes; a step's batch is the same whenever it is drawn (a resumed run
    sees it)."""
    made, config = task
    expected = Counter(made.tokenizer.normalize(line) for line in made.training.sources)
    assert sum(expected.values()) == TRAINING
    per_epoch = len(made.epoch_batches(BUDGET, 0, 0))
    assert 1 < per_epoch < TRAINING
    epochs, shapes = [], []
    for epoch in range(2):
        batches = [made.batch(config, BUDGET, step, 0) for step in range(epoch * per_epoch, (epoch + 1) * per_epoch)]
        for batch in batches:
            assert batch["src"].size <= BUDGET and batch["tgt"].size <= BUDGET and batch["labels"].size <= BUDGET
            assert batch["tgt"].shape == batch["labels"].shape and len(batch["src"]) == len(batch["tgt"])
        seen = Counter(made.tokenizer.decode(row) for batch in batches for row in batch["src"])
        assert seen == expected, f"epoch {epoch}: sentences missing or repeated"
        ranges = [longest_sides(batch, config) for batch in batches]
        for i, (low, high) in enumerate(ranges):
            assert all(high <= other_low or other_high <= low for other_low, other_high in ranges[i + 1:])
        epochs.append([made.tokenizer.decode(batch["src"][0]) for batch in batches])
        shapes.append(sorted(batch["src"].shape + batch["tgt"].shape for batch in batches))
    assert epochs[0] != epochs[1]
    assert shapes[0] == shapes[1]                     # JAX and TensorFlow compile each shape once, in epoch 0
    again = made.batch(config, BUDGET, per_epoch + 3, 0)
    assert all(np.array_equal(again[name], made.batch(config, BUDGET, per_epoch + 3, 0)[name]) for name in again)


def test_the_held_out_split_is_disjoint_from_the_pairs_the_trainer_draws(corpus, tmp_path):
    """``train --corpus PAIRS.tsv`` without validation files: the streams the trainer consumes -- the plan's
    training batches of a whole epoch and its validation batch -- are read back as text. The validation pairs are
    the default min(1000, 5%) of the file's (15 of 300), none of them in the training stream, and training plus
    validation is the file's pairs, each exactly once."""
    english, spanish = (Path(corpus[name]).read_text(encoding="utf-8").splitlines() for name in ("train.en",
                                                                                                 "train.es"))
    write_lines(tmp_path / "pairs.tsv", [f"{e}\t{s}" for e, s in zip(english, spanish)])
    plan = train_module.plan_from(build_parser().parse_args(
        ["train", "--corpus", str(tmp_path / "pairs.tsv"), "--preset", "tiny", "--vocab-size", "200",
         "--tokens-per-batch", str(BUDGET), "--backends", "numpy"]))
    made, config = plan.task, plan.config
    assert isinstance(made, CorpusTask)
    texts = lambda batch: Counter((made.learned.decode(source), made.learned.decode(labels))
                                  for source, labels in zip(batch["src"], batch["labels"]))
    per_epoch = len(made.epoch_batches(plan.batch_size, 0, plan.seed))
    trained = sum((texts(made.batch(config, plan.batch_size, step, plan.seed)) for step in range(per_epoch)),
                  Counter())
    validated = texts(made.held_out_batch(config, plan.validation_size, VALIDATION_SPLIT, plan.seed)[0])
    everything = Counter((made.learned.normalize(e), made.learned.normalize(s)) for e, s in zip(english, spanish))
    assert len(everything) == TRAINING                            # no pair twice in the file: a pair is one line
    assert plan.validation_size == sum(validated.values()) == round(0.05 * TRAINING)
    assert not set(validated) & set(trained), "validation pairs in the training stream"
    assert trained + validated == everything and sum(trained.values()) == TRAINING - plan.validation_size


def longest_sides(batch: dict[str, np.ndarray], config: TransformerConfig) -> tuple[int, int]:
    """The least and the greatest of the rows' longer side (source + eos or target + eos) in a batch."""
    sides = np.maximum((batch["src"] != config.pad_id).sum(axis=1), (batch["labels"] != config.pad_id).sum(axis=1))
    return int(sides.min()), int(sides.max())


# ----------------------------------------------------------------------------- train in every backend, average

# About 45 s: one command trains and validates in every installed backend (the multi-backend run is what is
# checked), compiling each framework's training step and greedy decoding once.
@pytest.mark.slow
def test_a_corpus_trains_in_every_backend_saves_every_step_and_averages(corpus, tmp_path, monkeypatch, capsys):
    """One command, every installed backend, float64, no dropout: each backend's losses are the reference run's
    within its training bound (equivalence/training_runs.py) on the same batches; the run is validated every 2
    steps (loss, exact match, BLEU); checkpoints at steps 1, 2, 3 of which the last 2 are kept; --out is the
    element-wise average of those two, computed here with safetensors' own reader, without training state and
    with the tokenizer."""
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", *corpus_flags(corpus), "--backends", ",".join(INSTALLED), "--dtype",
                           "float64", "--steps", "3", "--warmup-steps", "2", "--learning-rate-scale", "1",
                           "--eval-every", "2", "--eval-size", "0", "--save-every", "1", "--keep", "2", "--average",
                           "2", "--out", "run-{backend}.safetensors", "--json")
    assert status == EXIT_OK, err
    results = {result["backend"]: result for result in json.loads(out)}
    assert tuple(results) == INSTALLED

    config, _ = load_checkpoint("run-numpy-step3.safetensors")
    made = CorpusTask(*read_corpus(corpus["train.en"], corpus["train.es"], None, corpus["valid.en"],
                                   corpus["valid.es"], None), load_tokenizer("run-numpy-step3.safetensors"),
                      "tiny").fitted(config, BUDGET)
    expected, bound = reference_run(config, init_params(config, seed=0),
                                    TrainingConfig(warmup_steps=2, learning_rate_scale=1.0),
                                    [made.batch(config, BUDGET, step, 0) for step in range(3)])
    for name, result in results.items():
        for step, (loss, reference, limit) in enumerate(zip(result["losses"], expected.losses, bound.losses), 1):
            assert abs(loss - reference) <= limit, f"{name}: loss at step {step}: {loss} vs {reference}"
        assert [check["step"] for check in result["validation"]] == [2]
        check = result["validation"][0]
        assert check["loss"] > 0 and 0 <= check["exact"] <= 1 and 0 <= check["bleu"] <= 100
        kept = [f"run-{name}-step{step}.safetensors" for step in (2, 3)]
        assert result["saved"] == kept and result["averaged"] == kept
        assert not (tmp_path / f"run-{name}-step1.safetensors").exists()
        assert load_training_state(tmp_path / kept[-1]).step == 3            # a kept checkpoint resumes the run
        check_hand_average(tmp_path / f"run-{name}.safetensors", [tmp_path / path for path in kept])
    assert abs(results[INSTALLED[-1]]["validation"][0]["loss"] - results["numpy"]["validation"][0]["loss"]) < 1e-9


def test_a_corpus_trains_data_parallel_its_batches_padded_to_equal_shards(corpus, tmp_path, monkeypatch, capsys):
    """``--data-parallel 2`` on a corpus (PyTorch's DDP; the installed command's data-parallel runs:
    tests/reference/test_data_parallel.py): a token-count batch of an odd number of sentences gets a row of padding,
    which adds nothing to the loss or its gradient (section 5.4 counts target tokens), so the run's losses, weights and
    Adam moments are the single-process reference's within the training bound."""
    if "torch" not in INSTALLED:
        pytest.skip("needs PyTorch (pip install -e '.[torch,text]')")
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", *corpus_flags(corpus), "--backends", "torch", "--data-parallel", "2",
                           "--dtype", "float64", "--steps", "3", "--warmup-steps", "2", "--eval-every", "0",
                           "--eval-size", "0", "--json", "--out", str(tmp_path / "run.safetensors"))
    assert status == EXIT_OK, err
    config, params, state = load_run(tmp_path / "run.safetensors")
    made = CorpusTask(*read_corpus(corpus["train.en"], corpus["train.es"], None, corpus["valid.en"],
                                   corpus["valid.es"], None), load_tokenizer(tmp_path / "run.safetensors"),
                      "tiny").fitted(config, BUDGET)
    batches = [made.batch(config, BUDGET, step, 0) for step in range(3)]
    assert any(len(batch["src"]) % 2 for batch in batches), "no batch of an odd number of sentences: nothing padded"
    expected, bound = reference_run(config, init_params(config, seed=0),
                                    TrainingConfig(warmup_steps=2, learning_rate_scale=0.5), batches)
    assert_float64_run(Run(json.loads(out)[0]["losses"], params, state), expected, bound,
                       "torch, a corpus on 2 replicas")


def test_rows_of_padding_change_neither_the_loss_nor_its_gradient(task):
    """The padding rows above, in the reference: the loss and every gradient of a batch with two rows of padding
    appended are the batch's own (float64 policy)."""
    made, config = task
    batch = made.batch(config, BUDGET, 0, 0)
    padded = CountedBatches(made, config, BUDGET, 0, world_size=len(batch["src"]) + 2)(0)
    rows = len(batch["src"])
    assert len(padded["src"]) == rows + 2 and (padded["src"][rows:] == config.pad_id).all()
    assert (padded["labels"][rows:] == config.pad_id).all() and (padded["tgt"][rows:] == config.pad_id).all()
    model = Transformer(config, init_params(config, seed=0))
    loss, grads = training.gradients(model, **batch)
    padded_loss, padded_grads = training.gradients(model, **padded)
    tolerance.assert_agrees(np.array(padded_loss), np.array(loss), np.array(loss), what="loss", precision="float64")
    for name, grad in grads.items():
        tolerance.assert_agrees(padded_grads[name], grad, grad, what=name, precision="float64")


def check_hand_average(out: Path, inputs: list[Path]) -> None:
    """``out`` holds the element-wise mean of the inputs' weights (read with safetensors' own reader, averaged
    here in float64 and rounded once to the files' dtype), no optimizer state, and the inputs' tokenizer."""
    tensors = [safetensors_numpy.load_file(path) for path in inputs]
    averaged = safetensors_numpy.load_file(out)
    assert set(averaged) == {name for name in tensors[0] if not name.startswith("adam")}
    for name, value in averaged.items():
        hand = np.mean([t[name].astype(np.float64) for t in tensors], axis=0).astype(tensors[0][name].dtype)
        assert value.dtype == tensors[0][name].dtype and np.array_equal(value, hand), name
    assert load_training_state(out) is None
    assert load_tokenizer_json(out) == load_tokenizer_json(inputs[0]) is not None


def test_a_tsv_corpus_holds_out_its_validation_and_resumes_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):
    """``--corpus PAIRS.tsv`` with a held-out split (--valid-size): the reference's run of 5 steps equals 3 steps
    saved and 2 resumed (same batches across the epoch boundary, the saved tokenizer); the validation set is the
    20 held-out pairs, scored at the end too."""
    monkeypatch.chdir(tmp_path)
    english, spanish = (Path(corpus[name]).read_text(encoding="utf-8").splitlines() for name in ("train.en",
                                                                                                 "train.es"))
    write_lines(tmp_path / "pairs.tsv", [f"{e}\t{s}" for e, s in zip(english, spanish)])
    flags = ["--corpus", "pairs.tsv", "--valid-size", "20", "--preset", "tiny", "--vocab-size", "200",
             "--tokens-per-batch", "2048", "--backends", "numpy", "--eval-every", "0", "--json"]

    def run(*args: str) -> dict:
        status, out, err = cli(capsys, "train", *flags, *args)
        assert status == EXIT_OK, err
        return json.loads(out)[0]

    whole = run("--steps", "5", "--eval-size", "0")
    first = run("--steps", "3", "--eval-size", "0", "--out", "run.safetensors")
    rest = run("--steps", "2", "--resume", "run.safetensors", "--out", "rest.safetensors")
    assert first["losses"] + rest["losses"] == whole["losses"] and rest["first_step"] == 3
    assert 0 <= rest["accuracy"] <= 1 and 0 <= rest["bleu"] <= 100
    run("--steps", "1", "--eval-size", "0", "--layer-norm-eps", "1e-5", "--out", "eps.safetensors")
    assert run("--steps", "1", "--eval-size", "0", "--resume", "eps.safetensors")["first_step"] == 1   # --preset kept
    status, _, err = cli(capsys, "train", *flags, "--steps", "1", "--eval-size", "21")
    one_error_line(err, "--eval-size 21", "validation set holds 20 pairs")


def test_a_corpus_trains_in_the_fastest_installed_backend_by_default(corpus, tmp_path, monkeypatch, capsys):
    """Without --backends, a corpus (like the numbers task) trains in the fastest installed backend and says which
    on stderr; the copy task keeps the reference. A backend not installed is never chosen."""
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(capsys, "train", *corpus_flags(corpus), "--steps", "1", "--eval-every", "0",
                           "--eval-size", "0", "--json")
    assert status == EXIT_OK, err
    chosen = json.loads(out)[0]["backend"]
    assert f"--backends {chosen}, the fastest backend installed here" in err
    assert chosen == train_module.default_backends("numbers")[0] and train_module.default_backends("copy") == ("numpy",)
    if len(INSTALLED) > 1:
        assert chosen != "numpy"
    monkeypatch.setattr(backends, "installed", lambda name: name == "numpy")
    assert train_module.default_backends("corpus") == ("numpy",)


# ----------------------------------------------------------------------------- bad files, refused before training

BAD = {
    "missing": ({"train.en": None}, [], ["--source", "train.en", "No such file"]),
    "line counts": ({"train.es": ["uno", "dos"]}, [], ["--target", "2 lines", "has 3"]),
    "one side empty": ({"train.es": ["uno", "  ", "tres"]}, [], ["--target", "train.es", "line 2", "empty"]),
    "not UTF-8": ({"train.en": b"one\ntw\xe9\nthree\n"}, [], ["--source", "train.en", "line 2", "not UTF-8"]),
    "too long": ({"train.en": ["one", " ".join(["two"] * 70), "three"]}, ["--preset", "tiny"],
                 ["--source", "train.en", "line 2", "max_len 64"]),
    "over the budget": ({"train.en": ["one", "two three four", "five"]}, ["--tokens-per-batch", "3"],
                        ["--source", "train.en", "line 2", "4 tokens", "more than --tokens-per-batch 3"]),
    "unseen characters": ({"valid.en": ["fünf"]}, [], ["--valid-source", "valid.en", "line 1", "'ü'"]),
    "columns": ({"pairs.tsv": ["one\tuno", "two\tdos\tzwei"]}, [], ["--corpus", "pairs.tsv", "line 2", "3 tab"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_are_refused_in_one_line_before_any_training(case, tmp_path, monkeypatch, capsys):
    """A missing file, line counts that differ, a line empty on one side, bytes that are not UTF-8, a sentence
    longer than max_len or than a batch after BPE, characters the training side never had, a row of three
    columns: one line naming the flag, the file and the line, and no backend loaded."""
    monkeypatch.chdir(tmp_path)
    files = {"train.en": ["one", "two", "three"], "train.es": ["uno", "dos", "tres"], "valid.en": ["four"],
             "valid.es": ["tres"]}
    changes, flags, words = BAD[case]
    for name, lines in {**files, **changes}.items():
        if isinstance(lines, bytes):
            (tmp_path / name).write_bytes(lines)
        elif lines is not None:
            write_lines(tmp_path / name, lines)
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the files were checked"))
    sides = (["--corpus", "pairs.tsv"] if "pairs.tsv" in changes else
             ["--source", "train.en", "--target", "train.es", "--valid-source", "valid.en", "--valid-target",
              "valid.es"])
    status, out, err = cli(capsys, "train", *sides, "--backends", "numpy", *flags)
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, *words)


@pytest.mark.parametrize("args, words", [
    (["--batch-size", "8"], ["--batch-size is a flag of --task copy and --task numbers"]),
    (["--average", "2"], ["--average 2", "--save-every"]),
    (["--save-every", "2", "--average", "3", "--keep", "2", "--out", "run.safetensors"], ["--average 3", "--keep 2"]),
    (["--save-every", "2"], ["--save-every", "--out"]),
    (["--task", "numbers"], ["--source is a flag of --task corpus"]),
    (["--valid-size", "3"], ["--valid-size 3", "3 pairs"]),
    (["--out", "train.en"], ["--out", "would replace the input"]),
])
def test_corpus_flags_that_do_not_fit_are_refused_before_any_work(args, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "train.en", ["one", "two", "three"])
    write_lines(tmp_path / "train.es", ["uno", "dos", "tres"])
    monkeypatch.setattr(backends, "load", lambda *_: pytest.fail("a backend was loaded before the flags were checked"))
    status, out, err = cli(capsys, "train", "--source", "train.en", "--target", "train.es", "--backends", "numpy",
                           *args)
    assert status == EXIT_USAGE and out == ""
    one_error_line(err, *words)
    assert (tmp_path / "train.en").read_text() == "one\ntwo\nthree\n"


def test_step_checkpoints_of_the_run_never_replace_a_file_without_force(tmp_path, monkeypatch, capsys):
    """A file named as a checkpoint this run may write (run-step2 of a run of 3 steps) is kept: the run is refused
    before any work; a step the run cannot reach (run-step9) does not stand in its way."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run-step2.safetensors").write_bytes(b"a user's file")
    (tmp_path / "run-step9.safetensors").write_bytes(b"another")
    copy = ["--symbols", "3", "--max-length", "3", "--batch-size", "4", "--eval-size", "0", "--eval-every", "0"]
    status, _, err = cli(capsys, "train", *copy, "--steps", "3", "--out", "run.safetensors", "--save-every", "2")
    assert status == EXIT_USAGE
    one_error_line(err, "--save-every", "run-step2.safetensors", "--force")
    assert (tmp_path / "run-step2.safetensors").read_bytes() == b"a user's file"
    status, _, err = cli(capsys, "train", *copy, "--steps", "1", "--out", "run.safetensors", "--save-every", "2")
    assert status == EXIT_OK, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-step1.safetensors", "run-step2.safetensors",
                                                          "run-step9.safetensors", "run.safetensors"]


# ----------------------------------------------------------------------------- average

@pytest.fixture
def checkpoints(tmp_path) -> list[Path]:
    """Three float32 checkpoints of one model (different seeds) sharing a tokenizer."""
    config = TransformerConfig.preset("tiny", src_vocab_size=23, share_embeddings=True)
    tokenizer = Tokenizer.train(["abc", "cab"], 23, config).to_json()
    paths = []
    for seed in range(3):
        paths.append(tmp_path / f"run-step{seed}.safetensors")
        save_checkpoint(paths[-1], config, init_params(config, seed=seed, dtype=np.float32), tokenizer=tokenizer)
    return paths


def test_average_writes_the_hand_average_of_the_weights_with_the_tokenizer(checkpoints, tmp_path, capsys):
    out = tmp_path / "average.safetensors"
    status, stdout, err = cli(capsys, "average", str(out), *map(str, checkpoints))
    assert status == EXIT_OK, err
    assert "average of 3 checkpoints" in stdout and "no training state" in stdout
    check_hand_average(out, checkpoints)


def test_average_refuses_other_models_dtypes_and_its_inputs(checkpoints, tmp_path, capsys):
    """Another config, another dtype: one line naming the file and the field or tensor. OUT is never an input
    (even with --force) and an existing OUT is kept without --force."""
    config, params = load_checkpoint(checkpoints[0])
    other = tmp_path / "other.safetensors"
    save_checkpoint(other, config.replace(d_ff=48), init_params(config.replace(d_ff=48), seed=0))
    wide = tmp_path / "wide.safetensors"
    save_checkpoint(wide, config, {name: value.astype(np.float64) for name, value in params.items()},
                    tokenizer=load_tokenizer_json(checkpoints[0]))
    out = str(tmp_path / "average.safetensors")
    for bad, words in ((other, ["other.safetensors", "d_ff 48, not 40"]), (wide, ["wide.safetensors", "float64"])):
        status, _, err = cli(capsys, "average", out, str(checkpoints[0]), str(bad))
        assert status == EXIT_USAGE
        one_error_line(err, *words)
    status, _, err = cli(capsys, "average", str(checkpoints[1]), *map(str, checkpoints), "--force")
    one_error_line(err, "would replace the input")
    Path(out).write_bytes(b"kept")
    status, _, err = cli(capsys, "average", out, *map(str, checkpoints))
    one_error_line(err, "already exists", "--force")
    assert Path(out).read_bytes() == b"kept"


# ----------------------------------------------------------------------------- the progress bar

def test_the_bar_closes_at_the_step_where_validation_stopped_the_run(monkeypatch):
    """A run that validation stops at step 3 of 10: the bar's total becomes 3 (it ends full, not frozen at 3/10)
    and it says why; each validation shows its own progress (a 'validate' bar)."""
    from tqdm import tqdm

    adapter = backends.load(("numpy",))[0]["numpy"]
    monkeypatch.setattr(CopyTask, "score", lambda self, config, decoded, expected: {"exact": 1.0})
    task = CopyTask(3, 3)
    plan = train_module.Plan(task, task.config(dropout=0.0), TrainingConfig(warmup_steps=10), 10, 4, 0, "float32",
                             stop_at=0.9, eval_every=3, validation_size=8)
    screen, asked = io.StringIO(), []

    def progress(items, what, unit):
        asked.append(what)
        return tqdm(items, desc=what, file=screen, ascii=True)

    result, _, _ = train_module.train(adapter, plan, progress)
    assert len(result.losses) == 3 and asked == ["train", "validate"]
    last = screen.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in last and "stopped at step 3: validation 100.0%" in last, screen.getvalue()


def test_finish_leaves_a_plain_list_alone():
    items = [1, 2]
    extras.finish(items, 1, "stopped")
    assert items == [1, 2]
