"""``transformer-reference train``: a task (the copy task, or English to French number words) learned in any backend
with the recipe of section 5, a run saved with its training state (and the task's tokenizer), resumed in any
backend, and the loss curves of several backends side by side."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from reference_numpy.checkpoint import TrainingState, init_params, load_run, load_tokenizer
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.precision import is_low
from reference_numpy.training import LABEL_SMOOTHING

from . import backends, copy_task, numbers_task
from .copy_task import TEST, VALIDATION, CopyTask
from .numbers_task import NumbersTask

TASKS = {"copy": copy_task.DEFAULTS, "numbers": numbers_task.DEFAULTS}   # each task's recipe (docs/training.md)
COPY_ONLY = {"symbols": 10, "max_length": 10}                           # flags of the copy task and their defaults
SAVED_SETTINGS = ("warmup_steps", "learning_rate_scale", "dropout")      # flags a resumed run takes from its file


@dataclass(frozen=True)
class Plan:
    """What to train: the task, the model, the optimizer and the batches (one plan for every backend)."""

    task: CopyTask | NumbersTask
    config: TransformerConfig
    training: TrainingConfig
    steps: int
    batch_size: int
    seed: int
    dtype: str
    label_smoothing: float = LABEL_SMOOTHING
    stop_at: float | None = None          # stop once the validation set's exact-match accuracy reaches this
    eval_every: int = 100                 # steps between validation checks
    validation_size: int = 500
    world_size: int = 1                   # data-parallel replicas (the framework's own engine) when > 1
    start: tuple[dict[str, np.ndarray], TrainingState] | None = None   # a saved run to continue
    device: str = "cpu"                   # --device: cpu or gpu:N (single-process runs)

    @property
    def tokenizer_json(self) -> str | None:
        """The task's tokenizer as saved with the run (None for a task of bare ids)."""
        tokenizer = getattr(self.task, "tokenizer", None)
        return tokenizer.to_json() if tokenizer else None


@dataclass
class Result:
    """One backend's run: its loss per step and how well it copies afterwards."""

    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    accuracy: float | None = None         # exact match on the test set
    bleu: float | None = None             # corpus BLEU on the test set (translation tasks)
    validation: list[tuple[int, float]] = field(default_factory=list)   # (step, accuracy) of each check
    interrupted: bool = False             # stopped by SIGINT/SIGTERM after its last completed step

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
                "bleu": self.bleu, "validation": self.validation, "interrupted": self.interrupted}


def resume_from(path: str) -> tuple[TransformerConfig, dict[str, np.ndarray], TrainingState]:
    """A saved run (any backend wrote it): its config, weights and training state; a file without one is refused."""
    config, params, state = load_run(path)
    if state is None:
        raise ValueError(f"--resume: {path!r} holds weights but no training state (save it with `train --out`)")
    return config, params, state


def plan_from(args) -> Plan:
    """The plan of ``train``'s flags (a flag left out takes its task's default); with ``--resume``, the saved
    run's model, optimizer settings, weights and tokenizer."""
    if args.data_parallel > 1 and is_low(args.dtype):
        raise ValueError(f"--data-parallel trains in float32 or float64; --dtype {args.dtype} runs on one process")
    recipe = {name: value if (value := getattr(args, name, None)) is not None else default
              for name, default in TASKS[args.task].items()}
    start, config, training = None, None, TrainingConfig(warmup_steps=recipe["warmup_steps"],
                                                         learning_rate_scale=recipe["learning_rate_scale"])
    if args.resume:
        config, params, state = resume_from(args.resume)
        start, training = (params, state), state.config
        check_saved_settings(args, config, training)
    task = make_task(args, args.resume, config)
    config = config or task.config(dropout=args.dropout or 0.0)
    check_sizes(task, config, args.eval_size)
    if isinstance(task, NumbersTask):
        task = task.with_tokenizer(config)              # a new run's: learned from the training pool (seconds)
    if recipe["batch_size"] % args.data_parallel:
        raise ValueError(f"--batch-size {recipe['batch_size']} does not split into --data-parallel "
                         f"{args.data_parallel} equal shards")
    return Plan(task, config, training, recipe["steps"], recipe["batch_size"], args.seed, args.dtype,
                args.label_smoothing, recipe["stop_at"] or None, recipe["eval_every"], recipe["validation_size"],
                args.data_parallel, start, args.device)


def check_saved_settings(args, config: TransformerConfig, training: TrainingConfig) -> None:
    """A resumed run keeps the model and optimizer settings saved with it: a flag asking for another value
    (``SAVED_SETTINGS``) is refused, never silently ignored."""
    saved = {"warmup_steps": training.warmup_steps, "learning_rate_scale": training.learning_rate_scale,
             "dropout": config.dropout}
    for name in SAVED_SETTINGS:
        if (value := getattr(args, name)) is not None and value != saved[name]:
            raise ValueError(f"--{name.replace('_', '-')} {value}: the run in {args.resume!r} was saved with "
                             f"{saved[name]}, which resuming keeps; leave the flag out")


def make_task(args, resume: str | None, config: TransformerConfig | None) -> CopyTask | NumbersTask:
    """The task of ``--task``, checked against a resumed run's model (``config``, or None for a new run: a numbers
    task then has no tokenizer yet, see :func:`plan_from`)."""
    if args.task == "numbers":
        given = [name for name in COPY_ONLY if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a flag of --task copy")
        if config is None:
            return NumbersTask()
        tokenizer = load_tokenizer(resume)
        if tokenizer is None:
            raise ValueError(f"--resume: {resume!r} has no tokenizer; it is not a run of --task numbers")
        return NumbersTask(tokenizer)
    task = CopyTask(*(getattr(args, name) or default for name, default in COPY_ONLY.items()))
    if config and (config.src_vocab_size != 3 + task.symbols or config.max_len < task.max_length + 1):
        raise ValueError(f"--resume: {resume!r} has a vocabulary of {config.src_vocab_size} and max_len "
                         f"{config.max_len}; --symbols {task.symbols} and --max-length {task.max_length} do not fit")
    return task


def check_sizes(task: CopyTask | NumbersTask, config: TransformerConfig, eval_size: int) -> None:
    """The task fits the model and ``--eval-size`` the test set, checked before any work."""
    if isinstance(task, CopyTask) and task.max_length + 1 > config.max_len:
        raise ValueError(f"--max-length {task.max_length}: a sequence and its eos take {task.max_length + 1} "
                         f"positions, more than the model's max_len {config.max_len}")
    available = task.held_out_size(TEST)
    if available is not None and eval_size > available:
        raise ValueError(f"--eval-size {eval_size}: the test set holds {available} pairs")


def train(adapter: ModuleType, plan: Plan, progress: Callable[[range], Iterable] = lambda steps: steps,
          stopping: Callable[[], bool] = lambda: False):
    """Train one backend as ``plan`` says; returns (result, model, the run's training state). ``progress`` wraps
    the steps (a progress bar: its postfix shows the last loss and the tokens per second). With
    ``plan.stop_at``, every ``plan.eval_every`` steps greedy decoding runs on the validation set, and training
    stops once that share of it comes out exactly right (Adam's loss spikes near the optimum can otherwise leave
    the last step's model mid-spike). With ``plan.world_size`` > 1 the steps run data-parallel on the
    framework's own engine (:func:`train_data_parallel`). Once ``stopping()`` is true (a SIGINT or SIGTERM), the
    run ends after the step it is in (``result.interrupted``)."""
    if plan.world_size > 1:
        return train_data_parallel(adapter, plan, progress, stopping)
    params, state = plan.start if plan.start else (init_params(plan.config, seed=plan.seed), None)
    weights, compute = ("float32", plan.dtype) if is_low(plan.dtype) else (plan.dtype, None)   # mixed precision
    model = adapter.build(plan.config, params, weights, backends.device_for(adapter, plan.device))
    optimizer = adapter.optimizer(model, None if state else plan.training, state, compute)
    first = state.step if state else 0
    result, batches = Result(adapter.NAME, first), CountedBatches(plan.task, plan.config, plan.batch_size, plan.seed)
    steps = progress(range(first, first + plan.steps))
    for step in steps:
        batch = batches(step)
        began = time.perf_counter()
        result.losses.append(adapter.train_step(model, optimizer, **batch, epsilon=plan.label_smoothing))
        result.seconds += time.perf_counter() - began
        result.tokens = sum(batches.tokens.values())
        show(steps, result)
        result.interrupted = stopping()
        if result.interrupted or validated(adapter, model, plan, result, step + 1):
            break
    return result, model, adapter.training_state(model, optimizer)


def show(steps: Iterable, result: Result) -> None:
    """The last loss and the tokens per second in the progress bar's postfix."""
    if hasattr(steps, "set_postfix"):
        steps.set_postfix(loss=f"{result.losses[-1]:.3f}", tokens_per_s=f"{result.tokens_per_second:,.0f}")


def validated(adapter: ModuleType, model, plan: Plan, result: Result, done: int) -> bool:
    """At every ``plan.eval_every``-th step of the run (``done`` steps done in all), the validation set's exact
    match, recorded; True once it reaches ``plan.stop_at``."""
    if not plan.stop_at or (done - result.first_step) % plan.eval_every:
        return False
    result.validation.append((done, evaluate(adapter, model, plan, plan.validation_size, VALIDATION)["exact"]))
    return result.validation[-1][1] >= plan.stop_at


@dataclass
class CountedBatches:
    """``task.batch`` of one plan as a picklable function of the step (the engines shard it), counting the
    target tokens of the batches drawn in this process."""

    task: CopyTask | NumbersTask
    config: TransformerConfig
    batch_size: int
    seed: int
    tokens: dict[int, int] = field(default_factory=dict)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        batch = self.task.batch(self.config, self.batch_size, step, self.seed)
        self.tokens[step] = int((batch["labels"] != self.config.pad_id).sum())
        return batch


def train_data_parallel(adapter: ModuleType, plan: Plan, progress: Callable[[range], Iterable],
                        stopping: Callable[[], bool] = lambda: False):
    """:func:`train` over ``plan.world_size`` replicas by the backend's ``train_data_parallel``: in pieces of
    ``plan.eval_every`` steps when the validation set decides when to stop, each piece continuing the last one's
    weights and optimizer state (``seconds`` counts the engine's start-up too). Once ``stopping()``, the engine
    ends its piece after the step it is in (``progress`` returning true) and the run ends there."""
    params, state = plan.start if plan.start else (init_params(plan.config, seed=plan.seed), None)
    first = state.step if state else 0
    result, batches = Result(adapter.NAME, first), CountedBatches(plan.task, plan.config, plan.batch_size, plan.seed)
    steps = progress(range(first, first + plan.steps))
    advance = iter(steps)

    def on_step(step: int, loss: float) -> bool:
        result.losses.append(loss)
        result.tokens = sum(batches.tokens.values())
        next(advance, None)
        show(steps, result)
        return stopping()

    done, end = first, first + plan.steps
    while done < end:
        count = min(plan.eval_every if plan.stop_at else plan.steps, end - done)
        began = time.perf_counter()
        params, state, _ = adapter.train_data_parallel(
            plan.config, params, None if state else plan.training, state, batches, done, count, plan.world_size,
            plan.dtype, "cpu", plan.label_smoothing, on_step)
        done = first + len(result.losses)
        result.seconds += time.perf_counter() - began
        result.interrupted = stopping()
        model = adapter.build(plan.config, params, plan.dtype, "cpu")
        if result.interrupted or validated(adapter, model, plan, result, done):
            break
    next(advance, None)                                         # let a progress bar close
    return result, model, state


def evaluate(adapter: ModuleType, model, plan: Plan, count: int, split: str = TEST) -> dict[str, float]:
    """The task's scores (``exact``, and ``bleu`` for translation) of greedy decoding (section 6.1's rules) on
    ``count`` held-out pairs: the test set, or with ``split=VALIDATION`` the set that decides when to stop."""
    src, references = plan.task.held_out(plan.config, count, split, plan.seed)
    return plan.task.score(plan.config, adapter.greedy(model, src), references)


def jax_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (``--xla_force_host_platform_device_count``) for a JAX mesh on a machine
    without accelerators; JAX reads the flag when it starts, so this runs before it is imported."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={count}"])


def load_adapters(names: tuple[str, ...], flag: str = "--backends") -> dict[str, ModuleType]:
    """The adapters of ``names``; one not installed is a ``ValueError`` naming ``flag`` and what to install."""
    adapters, missing = backends.load(names)
    if missing:
        raise ValueError(f"{flag}: {missing[0].name} is {missing[0].reason}")
    return adapters


def plot_losses(results: list[Result], path: str) -> None:
    """The loss curves of every backend, one panel each, side by side on one scale."""
    from .extras import require
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
