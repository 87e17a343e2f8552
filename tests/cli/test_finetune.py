"""``train --init``: an imported Hugging Face model (tiny random Marian and M2M100 with SentencePiece tokenizers trained
here, tests/families/test_hf_tokenizers.py) fine-tuned on a small parallel corpus in every backend, checked against
transformers (the outside implementation): the first batch's ids are its tokenizer's ``input_ids`` and
``text_target`` labels with the decoder input its ``shift_tokens_right`` makes; the first loss is its model's
label-smoothed cross-entropy on that batch; every backend's first step is the float64 reference's
(:class:`~equivalence.tolerance.TrainingBound`); the loss falls, the result translates and resumes. A Marian model
with separate vocabularies: its first batch and loss."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest
from support import SOURCE, TARGET, backend, exact_tables, tiny_separate_marian

from equivalence import backends
from equivalence.training_runs import Run, assert_float64_run, reference_run
from reference_numpy.checkpoint import load_checkpoint, load_run
from transformer_cli.commands import train
from transformer_cli.main import build_parser, main

transformers = pytest.importorskip("transformers", reason="the oracle is transformers (peers extra)")
torch = pytest.importorskip("torch", reason="transformers' models run on PyTorch")

BACKENDS = ["numpy", "torch", "jax", "tf"]
STEPS = 3
LANGUAGES = {"marian": [], "m2m100": ["--source-lang", "en", "--target-lang", "fr"]}
# Eq. (3) over a warm-up of STEPS steps at its full scale: steps of ~1e-2 on the tiny models, which the loss feels
RECIPE = ["--warmup-steps", str(STEPS), "--learning-rate-scale", "1", "--eval-every", "0", "--eval-size", "2"]


@pytest.fixture(scope="module", params=["marian", "m2m100"])
def family(request, marian, m2m100, tmp_path_factory) -> dict:
    """One imported model, its corpus files (the training pairs, validated on themselves) and its oracles."""
    model = {"marian": marian, "m2m100": m2m100}[request.param]
    root = tmp_path_factory.mktemp(f"finetune-{request.param}")
    (root / "train.src").write_text("\n".join(SOURCE) + "\n", encoding="utf-8")
    (root / "train.tgt").write_text("\n".join(TARGET) + "\n", encoding="utf-8")
    files = ["--source", str(root / "train.src"), "--target", str(root / "train.tgt"),
             "--valid-source", str(root / "train.src"), "--valid-target", str(root / "train.tgt")]
    tokenizer = model["oracle"] if request.param == "marian" else model["oracle"]("en", "fr")
    return {**model, "name": request.param, "root": root, "files": files, "languages": LANGUAGES[request.param],
            "tokenizer": tokenizer}


def finetune_args(family: dict, *extra: str) -> list[str]:
    return ["train", "--init", str(family["checkpoint"]), *family["files"], *family["languages"], *RECIPE, *extra]


def first_batch(family: dict) -> tuple[train.Plan, dict[str, np.ndarray]]:
    plan = train.plan_from(build_parser().parse_args(finetune_args(family, "--dtype", "float64")))
    return plan, plan.task.batch(plan.config, plan.batch_size, 0, plan.seed)


def hf_model(family: dict):
    """transformers' model of the directory in float64, its sinusoid tables the reference's float64 ones (its own
    are float32, checked against the reference's in tests/families/test_hf_import.py): float64 arithmetic alone."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(family["directory"]).double().eval()
    exact_tables({"marian": "marian", "m2m100": "m2m_100"}[family["name"]], model,
                 load_checkpoint(family["checkpoint"])[0])
    return model


def transformers_batch(family: dict) -> dict[tuple[int, ...], tuple[list[int], list[int]]]:
    """Each training pair's ``input_ids`` -> (labels, decoder input ids) as transformers forms them for training:
    the tokenizer's ``text_target`` labels, shifted right by the model's ``shift_tokens_right``."""
    config = hf_model(family).config
    shift = transformers.models.marian.modeling_marian.shift_tokens_right if family["name"] == "marian" else \
        transformers.models.m2m_100.modeling_m2m_100.shift_tokens_right
    pairs = {}
    for source, target in zip(SOURCE, TARGET):
        encoded = family["tokenizer"](source, text_target=target)
        labels = torch.tensor([encoded["labels"]])
        decoder = shift(labels, config.pad_token_id, config.decoder_start_token_id)[0].tolist()
        pairs[tuple(encoded["input_ids"])] = (encoded["labels"], decoder)
    assert len(pairs) == len(SOURCE)
    return pairs


def unpadded(row: np.ndarray, pad_id: int, keep_first: bool = False) -> list[int]:
    length = len(row) - int(np.argmax(row[::-1] != pad_id)) if keep_first else int((row != pad_id).sum())
    return [int(i) for i in row[:max(length, 1 if keep_first else 0)]]


def test_the_first_batch_is_what_transformers_forms_for_training(family):
    """Source ids with the language code (M2M100), labels with the target's, the decoder input the labels shifted
    right after the model's decoder start token (Marian: its pad, which the batch holds as a real first token)."""
    plan, batch = first_batch(family)
    expected, pad = transformers_batch(family), plan.config.pad_id
    assert len(batch["src"]) == len(SOURCE)                    # the whole corpus in one batch
    for src, tgt, labels in zip(batch["src"], batch["tgt"], batch["labels"]):
        want_labels, want_decoder = expected[tuple(unpadded(src, pad))]
        assert unpadded(labels, pad) == want_labels
        assert [int(i) for i in tgt[:len(want_decoder)]] == want_decoder
        assert np.all(tgt[len(want_decoder):] == pad)


@pytest.mark.slow                          # the runs: eight fine-tunes, JAX's and TensorFlow's compiled
def test_the_first_loss_is_transformers_label_smoothed_loss_of_the_imported_weights(family, runs):
    """The reference's first loss (float64) equals PyTorch's label-smoothed cross-entropy (epsilon 0.1 over every
    class, padding ignored: section 5.4) of transformers' model, from the directory, on transformers' own batch."""
    plan, _ = first_batch(family)
    pairs = transformers_batch(family)
    pad_rows = lambda rows, value: torch.tensor([row + [value] * (max(map(len, rows)) - len(row)) for row in rows])
    src = pad_rows([list(ids) for ids in pairs], plan.config.pad_id)
    labels = pad_rows([labels for labels, _ in pairs.values()], -100)
    decoder = pad_rows([decoder for _, decoder in pairs.values()], plan.config.pad_id)
    with torch.no_grad():
        logits = hf_model(family)(input_ids=src, attention_mask=src != plan.config.pad_id,
                                  decoder_input_ids=decoder).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=-100, label_smoothing=0.1).item()
    assert runs["numpy"]["losses"][0] == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.fixture(scope="module")
def separate(tmp_path_factory) -> dict:
    """The tiny Marian model with separate source and target vocabularies (support.tiny_separate_marian), as
    :func:`family` gives a model."""
    model = tiny_separate_marian(tmp_path_factory.mktemp("finetune-separate"))
    root = model["directory"].parent
    (root / "train.src").write_text("\n".join(SOURCE) + "\n", encoding="utf-8")
    (root / "train.tgt").write_text("\n".join(TARGET) + "\n", encoding="utf-8")
    files = ["--source", str(root / "train.src"), "--target", str(root / "train.tgt"),
             "--valid-source", str(root / "train.src"), "--valid-target", str(root / "train.tgt")]
    return {**model, "name": "marian", "root": root, "files": files, "languages": [], "tokenizer": model["oracle"]}


def test_separate_vocabularies_fine_tune_on_transformers_batch_and_loss(separate):
    """Marian's separate vocabularies: the labels by the target vocabulary, the first batch the one transformers
    forms, and the reference's first loss (one float64 step) its model's label-smoothed loss on it."""
    test_the_first_batch_is_what_transformers_forms_for_training(separate)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(finetune_args(separate, "--backends", "numpy", "--dtype", "float64", "--steps", "1", "--out",
                                  str(separate["root"] / "numpy.safetensors"), "--json")) == 0
    test_the_first_loss_is_transformers_label_smoothed_loss_of_the_imported_weights(
        separate, {"numpy": json.loads(printed.getvalue())[0]})


@pytest.fixture(scope="module")
def runs(family) -> dict[str, dict]:
    """A float64 fine-tune of STEPS steps in every backend installed, saved after each step; its --json result."""
    results = {}
    for name in BACKENDS:
        if backends.load((name,))[1]:
            continue                                                   # the tests of the backend skip, naming why
        out, printed = family["root"] / f"{name}.safetensors", io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(finetune_args(family, "--backends", name, "--dtype", "float64", "--steps", str(STEPS),
                                      "--out", str(out), "--save-every", "1", "--keep", str(STEPS), "--json",
                                      "--force")) == 0
        results[name] = {"out": out, **json.loads(printed.getvalue())[0]}
    return results


@pytest.mark.slow                          # the runs: eight fine-tunes, JAX's and TensorFlow's compiled
@pytest.mark.parametrize("name", BACKENDS)
def test_every_backends_first_step_is_the_references_and_the_loss_falls(family, runs, name):
    if name not in runs:
        backend(name)                                                  # a skip naming what to install
    plan, batch = first_batch(family)
    config, params = load_checkpoint(family["checkpoint"])
    expected, bound = reference_run(dataclasses.replace(config, dropout=0.0), params, plan.training, [batch])
    _, weights, state = load_run(str(train.step_file(str(runs[name]["out"]), 1)))
    assert state is not None and state.step == 1
    assert_float64_run(Run(runs[name]["losses"][:1], weights, state), expected, bound, name)
    losses = runs[name]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses      # one batch per epoch: the same pairs


@pytest.mark.slow                          # the runs: eight fine-tunes, JAX's and TensorFlow's compiled
@pytest.mark.parametrize("name", BACKENDS)
def test_the_fine_tuned_model_translates(family, runs, name, capsys):
    assert main(["translate", "--checkpoint", str(runs[name]["out"]), "--backend", name, "--dtype", "float64",
                 *family["languages"], SOURCE[0], SOURCE[1]]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.slow                          # the runs: eight fine-tunes, JAX's and TensorFlow's compiled
def test_the_fine_tuned_run_resumes(family, runs, capsys):
    out = family["root"] / "resumed.safetensors"
    assert main(["train", "--resume", str(runs["numpy"]["out"]), *family["files"], *family["languages"],
                 "--backends", "numpy", "--dtype", "float64", "--steps", "1", "--eval-every", "0",
                 "--eval-size", "0", "--out", str(out), "--force"]) == 0
    assert load_run(str(out))[2].step == STEPS + 1


@pytest.mark.parametrize("flags, message", [
    (["--preset", "tiny"], "--preset: --init"),
    (["--vocab-size", "100"], "--vocab-size: --init"),
    (["--layer-norm-eps", "1e-5"], "--layer-norm-eps: --init"),
    (["--task", "numbers"], "--task numbers: --init fine-tunes a checkpoint on a corpus"),
])
def test_flags_that_conflict_with_the_checkpoint_are_refused(family, flags, message, capsys):
    assert main([*finetune_args(family), *flags]) == 2
    assert message in capsys.readouterr().err


def test_resume_and_init_together_are_refused(family, capsys):
    assert main([*finetune_args(family), "--resume", str(family["checkpoint"])]) == 2
    assert "--resume: --init" in capsys.readouterr().err


def test_the_languages_are_checked(marian, m2m100, family, capsys):
    if family["name"] == "m2m100":
        assert main(["train", "--init", str(m2m100["checkpoint"]), *family["files"], "--source-lang", "en"]) == 2
        assert "--target-lang: this m2m_100 model needs" in capsys.readouterr().err
    else:
        assert main([*finetune_args(family), "--source-lang", "en"]) == 2
        assert "--source-lang: this marian model takes no" in capsys.readouterr().err
