"""``transformer-reference train``: a task (the copy task, English to French number words, or a user's parallel
corpus) learned in any backend with the recipe of section 5, validated as it goes, a run saved with its training
state (and the task's tokenizer), every N steps too, the last checkpoints averaged (section 6.1), resumed in any
backend, and the loss curves of several backends side by side. ``--init CHECKPOINT`` starts a new run on a corpus
from a checkpoint's weights, model and tokenizer (a fine-tune; an imported Hugging Face model's included)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from equivalence import backends
from equivalence.contract import Model, Optimizer
from reference_numpy import checkpoint as reference_checkpoint
from reference_numpy.checkpoint import (
    LossScaleState,
    TrainingState,
    init_params,
    load_checkpoint,
    load_run,
    save_checkpoint,
)
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.precision import AUTOCAST_NAMES, is_low, round_to
from reference_numpy.tokenizer import pad_rows
from reference_numpy.training import LABEL_SMOOTHING
from transformer_cli.arguments import refuse_existing
from transformer_cli.extras import finish
from transformer_export.outputs import refuse_input
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer, load_tokenizer_json
from transformer_tasks import copy as copy_task
from transformer_tasks import corpus as corpus_task
from transformer_tasks import numbers as numbers_task
from transformer_tasks.batches import CountedBatches, Task
from transformer_tasks.copy import TEST, VALIDATION, CopyTask
from transformer_tasks.corpus import CorpusTask, read_corpus, token_batches
from transformer_tasks.numbers import NumbersTask

# each task's recipe (docs/training.md)
TASKS: dict[str, dict[str, Any]] = {"copy": copy_task.DEFAULTS, "numbers": numbers_task.DEFAULTS,
                                    "corpus": corpus_task.DEFAULTS}
COPY_ONLY = {"symbols": 10, "max_length": 10}                           # flags of the copy task and their defaults
TASK_FLAGS = {**{name: ("copy",) for name in COPY_ONLY}, "batch_size": ("copy", "numbers"),   # flags of some tasks
              **{name: ("corpus",) for name in corpus_task.FLAGS}}
SAVED_SETTINGS = ("warmup_steps", "learning_rate_scale", "dropout", "layer_norm_eps")   # a resumed run's, from its file
# The installed backend ``train --task numbers`` (and a corpus) runs by default: the first of these, fastest first on
# the numbers model here (time per step: docs/results/2026-11-23-numbers-task-training.md); the copy task, the
# reference
FASTEST = ("torch", "tf", "jax", "numpy")
EVALUATION_TOKENS = 2048          # positions of src (and of tgt) in one batch of validation or evaluation

Progress = Callable[[Iterable, str, str], Iterable]     # (items, what is done: "train", "validate", unit) -> items


def no_progress(items: Iterable, what: str, unit: str) -> Iterable:
    return items


class TrainingRecord(NamedTuple):
    """A saved run's training record, as its file's header holds it: the optimizer's settings, the steps taken and a
    float16 run's loss scale (the moments are tensors, which the header only names)."""

    config: TrainingConfig
    step: int
    loss_scale: LossScaleState | None = None


class Resumed(NamedTuple):
    """A saved run to continue (``--resume``): its file and its checked training record. The plan holds no array of
    it: each backend reads the weights and Adam's moments itself when it trains (:func:`resumed`)."""

    path: str
    record: TrainingRecord


@dataclass(frozen=True)
class Plan:
    """What to train: the task, the model, the optimizer and the batches (one plan for every backend)."""

    task: Task
    config: TransformerConfig
    training: TrainingConfig
    steps: int
    batch_size: int                       # sentences per batch; a corpus's positions per batch (section 5.1)
    seed: int
    dtype: str
    label_smoothing: float = LABEL_SMOOTHING
    stop_at: float | None = None          # stop once the validation set's exact-match accuracy reaches this
    eval_every: int = 100                 # steps between validation checks (0: none)
    validation_size: int = 500
    world_size: int = 1                   # data-parallel replicas (the framework's own engine) when > 1
    start: Resumed | None = None          # a saved run to continue (its path and header, no arrays)
    device: str = "cpu"                   # --device: cpu or gpu:N (single-process runs)
    eval_size: int = 1000                 # held-out pairs scored at the end (0: none)
    init: str | None = None               # a checkpoint whose weights a new run starts from (--init, a fine-tune)

    @property
    def tokenizer_json(self) -> str | None:
        """The task's tokenizer as saved with the run (None for a task of bare ids)."""
        tokenizer = getattr(self.task, "tokenizer", None)
        return tokenizer.to_json() if tokenizer else None

    @property
    def first_step(self) -> int:
        """The steps taken before this run: a resumed run's count, else 0."""
        return self.start.record.step if self.start else 0

    @property
    def weights(self) -> str:
        """The dtype the model is built in: ``dtype``, or float32 masters in mixed precision (bfloat16, float16); a
        mixed precision's name (mixed-bfloat16, mixed-float16: float32 weights under the framework's switch) as it
        is."""
        return self.dtype if self.dtype in AUTOCAST_NAMES else self.masters

    @property
    def masters(self) -> str:
        """The dtype of the weights and Adam's moments: ``dtype``, or float32 in any mixed precision."""
        return "float32" if self.dtype in AUTOCAST_NAMES or is_low(self.dtype) else self.dtype


@dataclass
class Result:
    """One backend's run: its loss per step, its validation checks and how well it translates afterwards."""

    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    accuracy: float | None = None         # exact match on the test set
    bleu: float | None = None             # corpus BLEU on the test set (translation tasks)
    validation: list[dict] = field(default_factory=list)   # each check: step, loss, exact (and bleu)
    interrupted: bool = False             # stopped by SIGINT/SIGTERM after its last completed step
    saved: list[str] = field(default_factory=list)         # the --save-every checkpoints kept
    averaged: list[str] = field(default_factory=list)      # the checkpoints whose average is --out

    @property
    def last_step(self) -> int:
        """The steps the run has completed in all (a resumed run's count included)."""
        return self.first_step + len(self.losses)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"backend": self.backend, "first_step": self.first_step, "steps": len(self.losses),
                "final_loss": self.losses[-1] if self.losses else None, "losses": self.losses,
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second, "accuracy": self.accuracy,
                "bleu": self.bleu, "validation": self.validation, "interrupted": self.interrupted,
                "saved": self.saved, "averaged": self.averaged}


def resume_from(path: str) -> tuple[TransformerConfig, Resumed]:
    """A saved run (any backend wrote it): its config and its training record, read from the file's header alone
    (no tensor is read) and checked as loading the run checks them (the record's fields, and one moment of each
    tensor's shape and dtype); a file without one is refused. The tensors' values (finite, second moments >= 0) are
    checked as each backend reads them (:func:`resumed`)."""
    reader = reference_checkpoint.CheckpointReader(path)
    state = reader.read_record()
    if state is None:
        raise no_training_state(path)
    return reader.config, Resumed(path, TrainingRecord(state.config, state.step, state.loss_scale))


def no_training_state(path: str) -> ValueError:
    return ValueError(f"--resume: {path!r} holds weights but no training state (save it with `train --out`)")


def resumed(adapter: ModuleType, plan: Plan, device: str) -> tuple[Model, TrainingState]:
    """The run ``plan.start`` names, in ``adapter`` on ``device``: its weights by the backend's own loader
    (``load``, in ``plan.weights``) and its training state by the backend's ``load_training_state`` (each port's
    reads Adam's moments into memory its optimizer takes as its own), so that no NumPy copy of the weights or the
    moments is held beside the framework's while the run trains."""
    assert plan.start is not None
    path = plan.start.path
    model = adapter.load(path, plan.weights, device)
    state = adapter.load_training_state(path, plan.masters)
    if state is None:
        raise no_training_state(path)
    if model.config != plan.config or state.step != plan.start.record.step:
        raise ValueError(f"--resume: {path!r} was replaced by another run after the run began; resume from a file "
                         "that no backend writes")
    return model, state


def refuse_overwritten_resume(args: argparse.Namespace) -> None:
    """With several backends, each reads the ``--resume`` file when it starts: an earlier backend's ``--out`` must
    not replace it (the later ones would continue that backend's run, not the saved one)."""
    if not (args.resume and args.out and len(args.backends or ()) > 1):
        return
    names = list(args.backends)
    for index, name in enumerate(names[:-1]):
        out = args.out.replace("{backend}", name)
        if os.path.exists(out) and os.path.samefile(out, args.resume):
            raise ValueError(f"--out {out}: it is the run --resume reads, which {', '.join(names[index + 1:])} would "
                             f"read after {name} replaced it; save each backend's run elsewhere")


def task_name(args: argparse.Namespace) -> str:
    """``--task``, or the one the flags imply (a corpus with its files or ``--init``, else copy); a flag of another
    task is refused, and ``--init`` with another task than a corpus."""
    task = args.task or ("corpus" if args.init or any(getattr(args, name) for name in corpus_task.FILES) else "copy")
    if args.init and task != "corpus":
        raise ValueError(f"--task {task}: --init fine-tunes a checkpoint on a corpus (--task corpus, with --source "
                         "and --target or --corpus)")
    for name, tasks in TASK_FLAGS.items():
        if getattr(args, name) is not None and task not in tasks:
            raise ValueError(f"--{name.replace('_', '-')} is a flag of {' and '.join(f'--task {t}' for t in tasks)}")
    return task


def default_backends(task: str) -> tuple[str, ...]:
    """The backend a run trains in when ``--backends`` is not given: the reference for the copy task, else the
    fastest installed (``FASTEST``)."""
    return ("numpy",) if task == "copy" else (next(name for name in FASTEST if backends.installed(name)),)


def plan_from(args: argparse.Namespace) -> Plan:
    """The plan of ``train``'s flags (a flag left out takes its task's default); with ``--resume``, the saved
    run's model, optimizer settings, step count and tokenizer, read from its header (:func:`resume_from`; each backend
    reads its weights and moments when it trains). Every flag is checked here, and the file's header, before any
    backend is loaded."""
    task = task_name(args)
    if args.init:
        check_init_flags(args)
    if args.data_parallel > 1 and (args.dtype in AUTOCAST_NAMES or is_low(args.dtype)):
        raise ValueError(f"--data-parallel trains in float32 or float64; --dtype {args.dtype} runs on one process")
    recipe = {name: value if (value := getattr(args, name, None)) is not None else default
              for name, default in TASKS[task].items()}
    if args.stop_at and not recipe["eval_every"]:
        raise ValueError(f"--stop-at {args.stop_at}: stopping needs validation, which --eval-every 0 turns off")
    start, config, training = None, None, TrainingConfig(warmup_steps=recipe["warmup_steps"],
                                                         learning_rate_scale=recipe["learning_rate_scale"])
    if args.resume:
        config, start = resume_from(args.resume)
        training = start.record.config
        check_saved_settings(args, config, training)
        refuse_overwritten_resume(args)
    if args.init:
        config = initial_config(args.init, args.dropout)
    made = make_task(args, task, config)
    eval_size = check_sizes(made, args.eval_size, None if task == "corpus" else recipe["validation_size"])
    if isinstance(made, CorpusTask) and made.tokenizer is None:
        made = made.with_tokenizer(args.vocab_size or corpus_task.VOCAB_SIZE)   # a new run's (seconds)
    config = config or new_model(made, args)
    budget = recipe["tokens_per_batch" if task == "corpus" else "batch_size"]
    made = fitted(made, config, budget)
    if task != "corpus" and budget % args.data_parallel:                  # a corpus batch is padded to fit
        raise ValueError(f"--batch-size {budget} does not split into --data-parallel {args.data_parallel} equal "
                         "shards")
    return Plan(made, config, training, recipe["steps"], budget, args.seed, args.dtype, args.label_smoothing,
                (recipe["stop_at"] or None) if recipe["eval_every"] else None, recipe["eval_every"],
                made.held_out_size(VALIDATION) if isinstance(made, CorpusTask) else recipe["validation_size"],
                args.data_parallel, start, args.device, eval_size, args.init)


def new_model(made: Task, args: argparse.Namespace) -> TransformerConfig:
    """A new run's model: the task's, with ``--dropout`` (default 0) and ``--layer-norm-eps`` if given."""
    eps = {} if args.layer_norm_eps is None else {"layer_norm_eps": args.layer_norm_eps}
    return made.config(dropout=args.dropout or 0.0, **eps)


INIT_CONFLICTS = ("resume", "preset", "vocab_size", "layer_norm_eps")   # flags of a model --init's checkpoint fixes


def check_init_flags(args: argparse.Namespace) -> None:
    """``--init`` fine-tunes with the checkpoint's model and tokenizer (on a corpus, :func:`task_name`): a flag
    choosing another model or vocabulary, or a run to resume, is refused, naming the flag."""
    for name in INIT_CONFLICTS:
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')}: --init {args.init!r} gives the model, its vocabulary "
                             "and its tokenizer, and starts a new run; leave the flag out")


def initial_config(path: str, dropout: float | None) -> TransformerConfig:
    """The model of ``--init``'s checkpoint, read from its header alone (its weights are read as each backend
    builds the model, :func:`initial_params`), with ``--dropout`` if given (default 0, as every run's)."""
    config = reference_checkpoint.CheckpointReader(path).config
    return dataclasses.replace(config, dropout=dropout or 0.0)


def initial_params(plan: Plan) -> dict[str, np.ndarray]:
    """The weights a new run starts from: ``--init``'s checkpoint's, else the seeded initialisation."""
    return load_checkpoint(plan.init)[1] if plan.init else init_params(plan.config, seed=plan.seed)


def check_saved_settings(args: argparse.Namespace, config: TransformerConfig, training: TrainingConfig) -> None:
    """A resumed run keeps the model and optimizer settings saved with it: a flag asking for another value
    (``SAVED_SETTINGS``) is refused, never silently ignored."""
    saved = {"warmup_steps": training.warmup_steps, "learning_rate_scale": training.learning_rate_scale,
             "dropout": config.dropout, "layer_norm_eps": config.layer_norm_eps}
    for name in SAVED_SETTINGS:
        if (value := getattr(args, name)) is not None and value != saved[name]:
            raise ValueError(f"--{name.replace('_', '-')} {value}: the run in {args.resume!r} was saved with "
                             f"{saved[name]}, which resuming keeps; leave the flag out")


def make_task(args: argparse.Namespace, task: str, config: TransformerConfig | None) -> Task:
    """The task ``task``, checked against a resumed run's model (``config``, or None for a new run: a numbers
    task or a corpus then has no tokenizer yet, see :func:`plan_from`)."""
    if task == "copy":
        copy = CopyTask(args.symbols or COPY_ONLY["symbols"], args.max_length or COPY_ONLY["max_length"])
        if config and (config.src_vocab_size != 3 + copy.symbols or config.max_len < copy.max_length + 1):
            raise ValueError(f"--resume: {args.resume!r} has a vocabulary of {config.src_vocab_size} and max_len "
                             f"{config.max_len}; --symbols {copy.symbols} and --max-length {copy.max_length} do "
                             "not fit")
        return copy
    flag, path = ("--init", args.init) if args.init else ("--resume", args.resume)
    tokenizer = None if config is None else load_tokenizer(path)
    if config is not None and tokenizer is None:
        raise ValueError(f"{flag}: {path!r} has no tokenizer; it is not a run of --task {task}")
    if isinstance(tokenizer, FamilyTokenizer) and task != "corpus":
        raise ValueError(f"{flag}: {path!r} holds an imported {tokenizer.family} tokenizer; --task {task} "
                         "trains with the project's own BPE")
    if isinstance(tokenizer, FamilyTokenizer):
        tokenizer = tokenizer.with_languages(args.source_lang, args.target_lang)
    elif args.source_lang or args.target_lang:
        raise ValueError(f"--{'source' if args.source_lang else 'target'}-lang: the run's tokenizer (the project's "
                         "BPE) takes no language; an imported Hugging Face model's (--init) may")
    if task == "numbers":
        assert not isinstance(tokenizer, FamilyTokenizer)           # refused above
        return NumbersTask(tokenizer)
    made = CorpusTask(*read_corpus(args.source, args.target, args.corpus, args.valid_source, args.valid_target,
                                   args.valid_size), tokenizer, args.preset)
    if config is not None and args.preset and config != made.model(config.src_vocab_size, dropout=config.dropout,
                                                                    layer_norm_eps=config.layer_norm_eps):
        raise ValueError(f"--preset {args.preset}: the run in {args.resume!r} is another model, which resuming "
                         "keeps; leave the flag out")
    if config is not None and args.vocab_size and args.vocab_size < config.src_vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size}: the run in {args.resume!r} has {config.src_vocab_size} "
                         "ids, which resuming keeps; leave the flag out")
    return made


def check_sizes(task: Task, eval_size: int | None, validation_size: int | None) -> int:
    """``--eval-size`` (default: 1,000 pairs, or the whole held-out set if smaller) and ``--valid-size`` fit the
    held-out sets, checked before any work; returns the evaluation's size."""
    name = lambda split: "validation" if isinstance(task, CorpusTask) else split    # a corpus's only held-out set
    for flag, size, split in (("--eval-size", eval_size, TEST), ("--valid-size", validation_size, VALIDATION)):
        held = task.held_out_size(split)
        if size and held is not None and size > held:
            raise ValueError(f"{flag} {size}: the {name(split)} set holds {held} pairs")
    return eval_size if eval_size is not None else min(1000, task.held_out_size(TEST) or 1000)


def fitted(task: Task, config: TransformerConfig, budget: int) -> Task:
    """The task checked against the model and made ready to draw batches: a copy task's sequences fit max_len,
    a numbers task has its tokenizer (learned from the training pool, seconds), a corpus its sentences' ids."""
    if isinstance(task, CopyTask) and task.max_length + 1 > config.max_len:
        raise ValueError(f"--max-length {task.max_length}: a sequence and its eos take {task.max_length + 1} "
                         f"positions, more than the model's max_len {config.max_len}")
    if isinstance(task, NumbersTask):
        return task.with_tokenizer(config)
    return task.fitted(config, budget) if isinstance(task, CorpusTask) else task


def step_file(out: str, step: int) -> str:
    """The file ``--save-every`` saves the run in at ``step``, beside ``out``: ``OUT-step{N}.safetensors``."""
    stem, suffix = os.path.splitext(out)
    return f"{stem}-step{step}{suffix}"


def planned_steps(args: argparse.Namespace) -> range:
    """The steps a run of ``train``'s flags may save at: after a resumed run's count (read from its header alone)
    up to ``--steps`` more (the task's default), as :func:`plan_from` plans them."""
    first = resume_from(args.resume)[1].record.step if args.resume else 0
    steps = args.steps if args.steps is not None else TASKS[task_name(args)]["steps"]
    return range(first + 1, first + steps + 1)


def check_step_files(out: str, steps: range, inputs: list[str], force: bool) -> None:
    """Before any work: no file ``--save-every`` may save beside ``out`` (at one of ``steps``) replaces one of the
    run's ``inputs`` (through any link; never, even with ``--force``), nor an existing file without ``--force``."""
    stem, suffix = os.path.splitext(os.path.basename(out))
    pattern = re.compile(re.escape(stem) + r"-step(\d+)" + re.escape(suffix))
    for entry in os.scandir(os.path.dirname(out) or "."):
        if (match := pattern.fullmatch(entry.name)) and int(match.group(1)) in steps:
            path = step_file(out, int(match.group(1)))
            refuse_input(path, inputs, "--save-every")
            refuse_existing(path, "--save-every", force)


@dataclass
class Snapshots:
    """``--save-every``: the run saved every ``every`` steps of the whole count (and at its last step) beside
    ``out``, as ``OUT-step{N}.safetensors``, with its training state (unless ``weights_only``) and ``tokenizer``;
    the last ``keep`` files this run wrote are kept and older ones removed (never a file it did not write, see
    :func:`check_step_files`)."""

    out: str
    every: int
    keep: int
    tokenizer: str | None = None
    weights_only: bool = False
    saved: list[str] = field(default_factory=list)

    def path(self, step: int) -> str:
        return step_file(self.out, step)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, step: int, adapter: ModuleType, model: Model, state: Callable[[], TrainingState]) -> None:
        """Save the run at ``step`` (``state()`` its training state), unless already saved there."""
        path = self.path(step)
        if self.saved[-1:] == [path]:
            return
        adapter.save(model, path, None if self.weights_only else state(), self.tokenizer)
        self.saved.append(path)
        for old in self.saved[:-self.keep]:
            os.remove(old)
        del self.saved[:-self.keep]


def average_checkpoints(paths: list[str]) -> tuple[TransformerConfig, dict[str, np.ndarray], str | None]:
    """The element-wise average of the checkpoints' weights (section 6.1: "a single model obtained by averaging the
    last 5 checkpoints"), summed in float64 and stored in their dtype, with their tokenizer; no optimizer state.
    The files must hold one model (config), each tensor in one dtype, and one tokenizer: a ``ValueError`` naming
    the first file (and field or tensor) that differs from the first file."""
    config, first = load_checkpoint(paths[0])
    tokenizer, total = load_tokenizer_json(paths[0]), {name: value.astype(np.float64) for name, value in first.items()}
    for path in paths[1:]:
        other, params = load_checkpoint(path)
        if other != config:
            ours, theirs = config.to_dict(), other.to_dict()                  # the header's fields, decoding's too
            changed = next(name for name in ours if theirs[name] != ours[name])
            raise ValueError(f"{path!r} is another model than {paths[0]!r}: {changed} {theirs[changed]}, not "
                             f"{ours[changed]}")
        for name, value in params.items():
            if value.dtype != first[name].dtype:
                raise ValueError(f"{path!r}: tensor {name!r} is {value.dtype}, {first[name].dtype} in {paths[0]!r}; "
                                 "average checkpoints of one dtype")
            total[name] += value
        if load_tokenizer_json(path) != tokenizer:
            raise ValueError(f"{path!r}: its tokenizer differs from {paths[0]!r}'s")
    return config, {name: round_to(value / len(paths), first[name].dtype) for name, value in total.items()}, tokenizer


def saves(every: int, first: int, steps: int) -> int:
    """The checkpoints ``--save-every every`` saves in a run of ``steps`` steps after step ``first``: one at each
    multiple of ``every`` and one at the last step."""
    last = first + steps
    return last // every - first // every + (1 if last % every else 0)


def check_average(count: int | None, every: int | None, plan: Plan) -> None:
    """``--average K``, before any work: the run, if it takes all its steps, saves at least K checkpoints."""
    if count and every and count > (saved := saves(every, plan.first_step, plan.steps)):
        raise ValueError(f"--average {count}: --steps {plan.steps} with --save-every {every} give {saved} "
                         f"checkpoint{'s' if saved > 1 else ''}; average at most {saved}, or save more often")


def average_run(adapter: ModuleType, plan: Plan, snapshots: Snapshots, count: int, path: str,
                result: Result) -> Model:
    """``--average``: the average of the run's last ``count`` checkpoints (fewer only if the run stopped before its
    last step: :func:`check_average`) written to ``path`` (weights and tokenizer, no training state) and built in
    ``adapter`` for the final evaluation."""
    result.averaged = snapshots.saved[-count:]
    config, params, tokenizer = average_checkpoints(result.averaged)
    save_checkpoint(path, config, params, tokenizer=tokenizer)
    return adapter.build(config, params, plan.weights, backends.device_for(adapter, plan.device))


def set_up(adapter: ModuleType, plan: Plan) -> tuple[Model, Optimizer]:
    """The model and optimizer :func:`train` starts from in ``adapter``: the seeded weights and a new optimizer, or
    the run ``plan.start`` names (:func:`resumed`), whose moments the optimizer then holds alone (a port's are the
    arrays read, the reference's a copy of them); mixed precision with a low ``plan.dtype``."""
    compute = plan.dtype if plan.dtype not in AUTOCAST_NAMES and is_low(plan.dtype) else None   # mixed-*: the model's
    device = backends.device_for(adapter, plan.device)
    model, state = resumed(adapter, plan, device) if plan.start else (
        adapter.build(plan.config, initial_params(plan), plan.weights, device), None)
    return model, adapter.optimizer(model, None if state else plan.training, state, compute)


def train(adapter: ModuleType, plan: Plan, progress: Progress = no_progress,
          stopping: Callable[[], bool] = lambda: False, snapshots: Snapshots | None = None
          ) -> tuple[Result, Model, TrainingState]:
    """Train one backend as ``plan`` says; returns (result, model, the run's training state). ``progress`` wraps
    the steps (a progress bar: its postfix shows the last loss, the tokens per second and the last validation)
    and each evaluation's batches. Every ``plan.eval_every`` steps the validation set is scored
    (:func:`validated`), and with ``plan.stop_at`` training stops once that share of it comes out exactly right
    (Adam's loss spikes near the optimum can otherwise leave the last step's model mid-spike). ``snapshots``
    saves the run as it goes. With ``plan.world_size`` > 1 the steps run data-parallel on the framework's own
    engine (:func:`train_data_parallel`). Once ``stopping()`` is true (a SIGINT or SIGTERM), the run ends after
    the step it is in (``result.interrupted``)."""
    if plan.world_size > 1:
        return train_data_parallel(adapter, plan, progress, stopping, snapshots)
    model, optimizer = set_up(adapter, plan)
    first = plan.first_step
    result, batches = Result(adapter.NAME, first), CountedBatches(plan.task, plan.config, plan.batch_size, plan.seed)
    steps = progress(range(first, first + plan.steps), "train", "step")
    state_now = lambda: adapter.training_state(model, optimizer)
    advance = iter(steps)                          # held: a bar left by `break` stays open until `ended` closes it
    for step in advance:
        batch = batches(step)
        began = time.perf_counter()
        result.losses.append(adapter.train_step(model, optimizer, **batch, epsilon=plan.label_smoothing))
        result.seconds += time.perf_counter() - began
        result.tokens = sum(batches.tokens.values())
        if snapshots and snapshots.due(step + 1):
            snapshots.take(step + 1, adapter, model, state_now)
        result.interrupted = stopping()
        stop = result.interrupted or validated(adapter, model, plan, result, step + 1, progress)
        show(steps, result)
        if stop:
            break
    state = state_now()
    return ended(steps, plan, result, snapshots, adapter, model, state), model, state


def ended(steps: Iterable, plan: Plan, result: Result, snapshots: Snapshots | None, adapter: ModuleType, model: Model,
          state: TrainingState) -> Result:
    """The run's end: saved at its last step (with ``snapshots``), and its progress bar closed there, saying why
    it stopped before ``plan.steps``."""
    if snapshots and result.losses:
        snapshots.take(result.last_step, adapter, model, lambda: state)
        result.saved = list(snapshots.saved)
    if result.interrupted:
        finish(steps, len(result.losses), f"interrupted at step {result.last_step}")
    elif len(result.losses) < plan.steps:
        finish(steps, len(result.losses), f"stopped at step {result.last_step}: validation "
                                          f"{in_words(result.validation[-1])}")
    return result


def in_words(check: dict) -> str:
    """A validation check's scores, short: exact match (and BLEU)."""
    return f"{100 * check['exact']:.1f}%" + (f", BLEU {check['bleu']:.1f}" if "bleu" in check else "")


def show(steps: Iterable, result: Result) -> None:
    """The last loss, the tokens per second and the last validation in the progress bar's postfix."""
    if hasattr(steps, "set_postfix"):
        shown = {"loss": f"{result.losses[-1]:.3f}", "tokens_per_s": f"{result.tokens_per_second:,.0f}"}
        if result.validation:
            shown["validation"] = in_words(result.validation[-1])
        steps.set_postfix(shown)


def validated(adapter: ModuleType, model: Model, plan: Plan, result: Result, done: int, progress: Progress) -> bool:
    """At every ``plan.eval_every``-th step of the run (``done`` steps done in all), the validation set's scores,
    recorded; True once its exact match reaches ``plan.stop_at``."""
    if not plan.eval_every or (done - result.first_step) % plan.eval_every:
        return False
    scores = evaluate(adapter, model, plan, plan.validation_size, VALIDATION, progress)
    result.validation.append({"step": done, **scores})
    return plan.stop_at is not None and scores["exact"] >= plan.stop_at


def train_data_parallel(adapter: ModuleType, plan: Plan, progress: Progress,
                        stopping: Callable[[], bool] = lambda: False, snapshots: Snapshots | None = None
          ) -> tuple[Result, Model, TrainingState]:
    """:func:`train` over ``plan.world_size`` replicas by the backend's ``train_data_parallel``: in pieces that end
    where the run is validated or saved, each piece continuing the last one's weights and optimizer state
    (``seconds`` counts the engine's start-up too). Once ``stopping()``, the engine ends its piece after the step
    it is in (``progress`` returning true) and the run ends there. The engines take NumPy weights and moments: a
    resumed run is read into NumPy here (``load_run``), unlike :func:`train`'s, and each piece's result is too."""
    params, state = initial_params(plan), None
    if plan.start:
        _, params, state = load_run(plan.start.path)
    if plan.start and state is None:
        raise no_training_state(plan.start.path)
    first = state.step if state else 0
    result = Result(adapter.NAME, first)
    batches = CountedBatches(plan.task, plan.config, plan.batch_size, plan.seed, plan.world_size)
    steps = progress(range(first, first + plan.steps), "train", "step")
    advance = iter(steps)

    def on_step(step: int, loss: float) -> bool:
        result.losses.append(loss)
        result.tokens = sum(batches.tokens.values())
        next(advance, None)
        show(steps, result)
        return stopping()

    done, end = first, first + plan.steps
    while done < end:
        began = time.perf_counter()
        params, state, _ = adapter.train_data_parallel(
            plan.config, params, None if state else plan.training, state, batches, done,
            piece_end(plan, snapshots, first, done, end) - done, plan.world_size, plan.dtype, "cpu",
            plan.label_smoothing, on_step)
        done = first + len(result.losses)
        result.seconds += time.perf_counter() - began
        result.interrupted = stopping()
        model = adapter.build(plan.config, params, plan.dtype, "cpu")
        if snapshots and snapshots.due(done):
            snapshots.take(done, adapter, model, lambda: state)
        if result.interrupted or validated(adapter, model, plan, result, done, progress):
            break
        show(steps, result)
    if done == end:
        next(advance, None)                                     # let a progress bar close
    assert state is not None                                    # a run has steps (--steps >= 1): a piece ran
    return ended(steps, plan, result, snapshots, adapter, model, state), model, state


def piece_end(plan: Plan, snapshots: Snapshots | None, first: int, done: int, end: int) -> int:
    """Where the data-parallel piece starting after ``done`` steps ends: the run's end, its next validation or its
    next checkpoint, whichever comes first."""
    ends = [end]
    if plan.eval_every:
        ends.append(done + plan.eval_every - (done - first) % plan.eval_every)
    if snapshots:
        ends.append(done + snapshots.every - done % snapshots.every)
    return min(ends)


def evaluate(adapter: ModuleType, model: Model, plan: Plan, count: int, split: str = TEST,
             progress: Progress = no_progress) -> dict[str, float]:
    """The task's scores (``exact``, and ``bleu`` for translation) of greedy decoding (section 6.1's rules) on
    ``count`` held-out pairs, and ``loss``, their label-smoothed loss (section 5.4) under teacher forcing: the
    test set, or with ``split=VALIDATION`` the set that decides when to stop. The pairs go in batches of similar
    lengths of at most ``EVALUATION_TOKENS`` positions, one ``progress`` step each."""
    batch, references = plan.task.held_out_batch(plan.config, count, split, plan.seed)
    pad = plan.config.pad_id
    lengths = np.stack([(batch["src"] != pad).sum(axis=1), (batch["labels"] != pad).sum(axis=1)], axis=1)
    decoded: list[list[int]] = [[] for _ in range(count)]
    total, tokens = 0.0, 0
    for rows in progress(token_batches(lengths, EVALUATION_TOKENS), "validate" if split == VALIDATION else "evaluate",
                         "batch"):
        part = trimmed({name: value[rows] for name, value in batch.items()}, pad)
        labels = int((part["labels"] != pad).sum())
        total, tokens = total + labels * adapter.loss(model, **part, epsilon=plan.label_smoothing), tokens + labels
        for row, output in zip(rows, adapter.greedy(model, part["src"], forced_bos_id=forced_bos_id(plan.task))):
            decoded[row] = list(output)
    # each task scores the references its own held_out_batch gave (sequences, or sentences)
    scores = plan.task.score(plan.config, pad_rows(decoded, pad), references)    # type: ignore[arg-type]
    return {"loss": total / tokens, **scores}


def forced_bos_id(task: Task) -> int | None:
    """The token decoding emits first: an imported M2M100/NLLB tokenizer's target language, else none."""
    return task.forced_bos_id if isinstance(task, CorpusTask) else None


def trimmed(batch: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded rows without the columns that hold padding only: src by its own, tgt and labels by the labels
    (the decoder's first token may be pad, Marian's start token)."""
    width = lambda rows: int((rows != pad_id).sum(axis=1).max())
    return {"src": batch["src"][:, :width(batch["src"])],
            **{name: batch[name][:, :width(batch["labels"])] for name in ("tgt", "labels")}}


def load_adapters(names: tuple[str, ...], flag: str = "--backends") -> dict[str, ModuleType]:
    """The adapters of ``names``; one not installed is a ``ValueError`` naming ``flag`` and what to install."""
    adapters, missing = backends.load(names)
    if missing:
        raise ValueError(f"{flag}: {missing[0].name} is {missing[0].reason}")
    return adapters


def plot_losses(results: list[Result], path: str) -> None:
    """The loss curves of every backend, one panel each, side by side on one scale."""
    from transformer_cli.extras import require
    plt = require("matplotlib.pyplot", "--plot")
    figure, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, result in zip(axes[0], results):
        steps = np.arange(result.first_step + 1, result.first_step + len(result.losses) + 1)
        ax.plot(steps, result.losses, linewidth=1)
        accuracy = "" if result.accuracy is None else f", {100 * result.accuracy:.1f}% exact"
        ax.set_title(f"{result.backend}: {result.tokens_per_second:,.0f} tokens/s{accuracy}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("label-smoothed loss (section 5.4)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def format_results(results: list[Result]) -> str:
    lines = [f"{'backend':<8} {'steps':>11} {'final loss':>10} {'tokens/s':>9} {'seconds':>8} {'exact':>7} "
             f"{'BLEU':>6}"]
    for r in results:
        accuracy = "-" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
        bleu = "-" if r.bleu is None else f"{r.bleu:.1f}"
        lines.append(f"{r.backend:<8} {f'{r.first_step + 1}-{r.first_step + len(r.losses)}':>11} "
                     f"{r.losses[-1]:>10.4f} {r.tokens_per_second:>9,.0f} {r.seconds:>8.1f} {accuracy:>7} {bleu:>6}")
    return "\n".join(lines)
