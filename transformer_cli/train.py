"""``transformer-reference train``: the copy task learned in any backend with the recipe of section 5, a run saved
with its training state, resumed in any backend, and the loss curves of several backends side by side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from reference_numpy.checkpoint import TrainingState, init_params, load_run
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.training import LABEL_SMOOTHING

from . import backends
from .copy_task import EVAL_EVERY, TEST, VALIDATION, VALIDATION_SIZE, CopyTask, exact_match, teacher_forcing


@dataclass(frozen=True)
class Plan:
    """What to train: the task, the model, the optimizer and the batches (one plan for every backend)."""

    task: CopyTask
    config: TransformerConfig
    training: TrainingConfig
    steps: int
    batch_size: int
    seed: int
    dtype: str
    label_smoothing: float = LABEL_SMOOTHING
    stop_at: float | None = None          # stop once the validation set's exact-match accuracy reaches this
    start: tuple[dict[str, np.ndarray], TrainingState] | None = None   # a saved run to continue


@dataclass
class Result:
    """One backend's run: its loss per step and how well it copies afterwards."""

    backend: str
    first_step: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    accuracy: float | None = None
    validation: list[tuple[int, float]] = field(default_factory=list)   # (step, accuracy) of each check

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        return {"backend": self.backend, "first_step": self.first_step, "steps": len(self.losses),
                "final_loss": self.losses[-1] if self.losses else None, "losses": self.losses,
                "seconds": self.seconds, "tokens_per_second": self.tokens_per_second, "accuracy": self.accuracy,
                "validation": self.validation}


def resume_from(path: str) -> tuple[TransformerConfig, dict[str, np.ndarray], TrainingState]:
    """A saved run (any backend wrote it): its config, weights and training state; a file without one is refused."""
    config, params, state = load_run(path)
    if state is None:
        raise ValueError(f"--resume: {path!r} holds weights but no training state (save it with `train --out`)")
    return config, params, state


def plan_from(args) -> Plan:
    """The plan of ``train``'s flags; with ``--resume``, the saved run's model, optimizer settings and weights."""
    task = CopyTask(args.symbols, args.max_length)
    training = TrainingConfig(warmup_steps=args.warmup_steps, learning_rate_scale=args.learning_rate_scale)
    if not args.resume:
        return Plan(task, task.config(dropout=args.dropout), training, args.steps, args.batch_size, args.seed,
                    args.dtype, args.label_smoothing, args.stop_at or None)
    config, params, state = resume_from(args.resume)
    if config.src_vocab_size != 3 + task.symbols or config.max_len < task.max_length + 1:
        raise ValueError(f"--resume: {args.resume!r} has a vocabulary of {config.src_vocab_size} and max_len "
                         f"{config.max_len}; --symbols {task.symbols} and --max-length {task.max_length} do not fit")
    return Plan(task, config, state.config, args.steps, args.batch_size, args.seed, args.dtype,
                args.label_smoothing, args.stop_at or None, (params, state))


def train(adapter: ModuleType, plan: Plan, progress: Callable[[range], Iterable] = lambda steps: steps):
    """Train one backend as ``plan`` says; returns (result, model, optimizer). ``progress`` wraps the steps (a
    progress bar: its postfix shows the last loss and the tokens per second). With ``plan.stop_at``, every
    ``EVAL_EVERY`` steps greedy decoding copies the validation set, and training stops once it copies that share
    exactly (Adam's loss spikes near the optimum can otherwise leave the last step's model mid-spike)."""
    params, state = plan.start if plan.start else (init_params(plan.config, seed=plan.seed), None)
    model = adapter.build(plan.config, params, plan.dtype, "cpu")
    optimizer = adapter.optimizer(model, None if state else plan.training, state)
    first = state.step if state else 0
    result = Result(adapter.NAME, first)
    steps = progress(range(first, first + plan.steps))
    for step in steps:
        batch = plan.task.batch(plan.config, plan.batch_size, step, plan.seed)
        began = time.perf_counter()
        result.losses.append(adapter.train_step(model, optimizer, **batch, epsilon=plan.label_smoothing))
        result.seconds += time.perf_counter() - began
        result.tokens += int((batch["labels"] != plan.config.pad_id).sum())
        if hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{result.losses[-1]:.3f}", tokens_per_s=f"{result.tokens_per_second:,.0f}")
        if plan.stop_at and (step + 1 - first) % EVAL_EVERY == 0:
            result.validation.append((step + 1, evaluate(adapter, model, plan, VALIDATION_SIZE, VALIDATION)))
            if result.validation[-1][1] >= plan.stop_at:
                break
    return result, model, optimizer


def evaluate(adapter: ModuleType, model, plan: Plan, count: int, stream: int = TEST) -> float:
    """Exact-sequence accuracy of greedy decoding (section 6.1's rules) on ``count`` held-out sequences (the test
    set, or with ``stream=VALIDATION`` the set that decides when to stop)."""
    sequences = plan.task.held_out(plan.config, count, plan.seed, stream)
    decoded = adapter.greedy(model, teacher_forcing(plan.config, sequences)["src"])
    return exact_match(plan.config, decoded, sequences)


def load_adapters(names: tuple[str, ...]) -> dict[str, ModuleType]:
    adapters, missing = backends.load(names)
    if missing:
        raise ValueError(f"--backends: {missing[0].name} is {missing[0].reason}")
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
    lines = [f"{'backend':<8} {'steps':>11} {'final loss':>10} {'tokens/s':>9} {'seconds':>8} {'exact':>7}"]
    for r in results:
        accuracy = "-" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
        lines.append(f"{r.backend:<8} {f'{r.first_step + 1}-{r.first_step + len(r.losses)}':>11} "
                     f"{r.losses[-1]:>10.4f} {r.tokens_per_second:>9,.0f} {r.seconds:>8.1f} {accuracy:>7}")
    return "\n".join(lines)
