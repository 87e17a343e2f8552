"""``compare``: every installed backend on every device in float64 and float32 (or the precisions asked for:
bfloat16 and float16 too), stage by stage, against the float64 NumPy reference, under the project's one tolerance
policy; with a checkpoint that holds a tokenizer (the default: the shipped English-to-French numbers model), the
sentences each run translates."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import cast

import numpy as np

from equivalence import backends, tolerance
from equivalence.oracle import (
    DTYPES,
    SENTENCES,
    Oracle,
    build_oracle,
    compare_inputs,
    greedy_verdict,
    non_finite_kind,
    translation_source,
)
from reference_numpy import TransformerConfig, init_params, load_checkpoint
from reference_numpy.checkpoint import load_tokenizer_json
from reference_numpy.tokenizer import Tokenizer
from transformer_bench.timing import measure
from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer
from transformer_tasks.translation import SHIPPED, SHIPPED_NAME, with_languages

# --precision-report's default: one panel each, the two recipes of each low format side by side
PRECISION_REPORT_DTYPES = ("float32", "bfloat16", "mixed-bfloat16", "float16", "mixed-float16")
DEFAULT_SEED = 0
TIMED_REPEATS = 3


@dataclass
class StageResult:
    stage: str
    max_abs_error: float
    max_relative_error: float
    bound: float
    ok: bool
    non_finite: str | None = None   # "nan" or "inf" when the backend's output holds such values
    added: bool = False             # the errors are those the stage adds to its inputs' (tolerance.stage_agreement)


@dataclass
class Run:
    backend: str
    device: str
    dtype: str
    stages: list[StageResult] = field(default_factory=list)
    forward_ms: float | None = None         # the forward pass by the framework's production path (log_probs)
    forward_path: str = ""                  # that path, in words (the adapter's FORWARD_PATH)
    greedy_identical: bool | None = None
    greedy_note: str = ""
    translations: list[str] | None = None   # the greedy outputs as text, when the checkpoint has a tokenizer
    error: str | None = None
    tokens: np.ndarray | None = field(default=None, repr=False)   # the greedy outputs

    @property
    def first_failing_stage(self) -> str | None:
        return next((result.stage for result in self.stages if not result.ok), None)

    @property
    def first_non_finite_stage(self) -> str | None:
        return next((result.stage for result in self.stages if result.non_finite), None)

    @property
    def ok(self) -> bool:
        return (self.error is None and self.first_failing_stage is None and self.first_non_finite_stage is None
                and self.greedy_identical is not False)

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.device}/{SHORT_NAMES[self.dtype]}"


SHORT_NAMES = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
               "mixed-bfloat16": "mixed-bf16", "mixed-float16": "mixed-f16"}   # the autocast recipe


@dataclass
class Report:
    source: str
    config: TransformerConfig
    runs: list[Run]
    missing: list[backends.Missing]
    sentences: tuple[str, ...] = ()         # the source sentences, when the checkpoint has a tokenizer
    translations: list[str] | None = None   # the float64 reference's greedy translations of them

    @property
    def ok(self) -> bool:
        """Every run agrees -- and there was at least one: comparing nothing is not agreement."""
        return bool(self.runs) and all(run.ok for run in self.runs)

    def to_json(self) -> dict:
        """Plain JSON values; a NaN or infinite error or bound becomes null (JSON has no NaN)."""
        return finite_or_null({
            "checkpoint": self.source,
            "config": self.config.to_dict(),
            "policy": {"float64_relative": tolerance.FLOAT64_RELATIVE, "float32_factor": tolerance.FLOAT32_FACTOR,
                       "low_precision_factor": tolerance.LOW_PRECISION_FACTOR},
            "ok": self.ok,
            "runs": [{**{key: value for key, value in asdict(run).items() if key != "tokens"},
                      "first_failing_stage": run.first_failing_stage,
                      "first_non_finite_stage": run.first_non_finite_stage, "ok": run.ok} for run in self.runs],
            "missing": [asdict(missing) for missing in self.missing],
            "translations": [{"source": source, "reference": reference, "runs": {run.label: run.translations[i] for run
                                                                                 in self.runs if run.translations}}
                             for i, (source, reference) in enumerate(zip(self.sentences, self.translations or []))],
        })


def finite_or_null(value):
    """``value`` with every non-finite float inside it replaced by None."""
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite_or_null(item) for item in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def seeded_checkpoint(preset: str) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """A preset (Table 3's ``base``, ``big``, or ``tiny``) with seeded random weights, made on the fly."""
    config = TransformerConfig.preset(preset)
    return config, init_params(config, seed=DEFAULT_SEED)


def run_backend(adapter: ModuleType, device: str, dtype: str, config: TransformerConfig, params: dict[str, np.ndarray],
                oracle: Oracle) -> Run:
    run, inputs = Run(adapter.NAME, device, dtype), oracle.inputs
    try:
        model = adapter.build(config, params, dtype, device)
        stages = cast(tolerance.Stages, adapter.forward(model, **inputs))
        timing = measure(lambda: adapter.log_probs(model, **inputs), TIMED_REPEATS)  # after a warm-up (compilation)
        run.forward_ms, run.forward_path = 1e3 * timing.median, adapter.FORWARD_PATH
        same = oracle.stages.get(dtype, oracle.stages64)                   # the reference in dtype (float64: itself)
        for name, ref64 in oracle.stages64.items():
            stage = np.asarray(stages[name])
            result = tolerance.stage_agreement(stage, ref64, same[name], dtype, oracle.stage_maps.get(name), stages,
                                               same)
            run.stages.append(StageResult(name, result.error, result.relative_error, result.bound, result.ok,
                                          non_finite_kind(stage), result.added))
        run.tokens = np.asarray(adapter.greedy(model, inputs["src"]))
        run.greedy_identical, run.greedy_note = greedy_verdict(run.tokens, oracle, dtype, config.pad_id)
    except Exception as err:  # noqa: BLE001 - one backend's failure is reported, the others still run
        run.error = f"{type(err).__name__}: {err}".splitlines()[0]
    return run


def parse_perturbation(text: str | None) -> tuple[str, str] | None:
    """``BACKEND:TENSOR`` -> (backend, tensor)."""
    if text is None:
        return None
    backend_name, _, tensor = text.partition(":")
    if backend_name not in backends.BACKENDS or not tensor:
        raise ValueError(f"--perturb must be BACKEND:TENSOR with BACKEND in {', '.join(backends.BACKENDS)}, "
                         f"got {text!r}")
    return backend_name, tensor


def perturbed(params: dict[str, np.ndarray], tensor: str) -> dict[str, np.ndarray]:
    """A copy of ``params`` with one tensor changed by one part in a million (a simulated port bug)."""
    if tensor not in params:
        raise ValueError(f"--perturb names tensor {tensor!r}, which is not in the checkpoint")
    changed = dict(params)
    changed[tensor] = params[tensor] * (1 + 1e-6) + 1e-6
    return changed


def load_source(checkpoint: str | Path | None, preset: str | None,
                languages: tuple[str | None, str | None] = (None, None)
                ) -> tuple[str, TransformerConfig, dict[str, np.ndarray], Tokenizer | FamilyTokenizer | None]:
    """(description, config, float64 params, tokenizer or None) of ``compare``'s model: a checkpoint, a seeded
    preset, or by default the shipped model; ``languages`` (``--source-lang``, ``--target-lang``), when given, set
    the tokenizer's (an imported M2M100/NLLB model's sentences are encoded only with them)."""
    if languages != (None, None) and (preset is not None or load_tokenizer_json(SHIPPED if checkpoint is None
                                                                                  else checkpoint) is None):
        flag = "--source-lang" if languages[0] is not None else "--target-lang"
        raise ValueError(f"{flag}: the model has no tokenizer to encode sentences with")
    if preset is not None:
        if checkpoint is not None:
            raise ValueError("--preset: give a checkpoint or a preset, not both")
        return (f"{preset} preset, seeded random weights (seed {DEFAULT_SEED})", *seeded_checkpoint(preset), None)
    path = SHIPPED if checkpoint is None else checkpoint
    config, params = load_checkpoint(path, dtype=np.float64)
    tokenizer = load_tokenizer(path)
    if tokenizer is not None and languages != (None, None):
        tokenizer = with_languages(tokenizer, *languages)
    return SHIPPED_NAME if checkpoint is None else str(checkpoint), config, params, tokenizer


def compare(checkpoint: str | Path | None = None, names: tuple[str, ...] = backends.PORTS,
            perturb: str | None = None, progress: Callable[[list], Iterable] | None = None, preset: str | None = None,
            dtypes: tuple[str, ...] = DTYPES, device: str | None = None,
            languages: tuple[str | None, str | None] = (None, None)) -> Report:
    """Run the comparison in ``dtypes``, on every device of each port or on ``device`` (cpu, gpu:N); ``progress`` wraps
    the list of runs (e.g. ``tqdm``).

    The model is ``checkpoint``, or a seeded ``preset``, or by default the shipped English-to-French numbers model.
    The NumPy reference in every precision of ``dtypes`` but float64 (the yardstick of that precision's bound)
    always runs besides ``names``; a request of which nothing is
    installed, or a ``perturb`` of a backend that does not run, is a ``ValueError``: a
    comparison that compares nothing must not report agreement. NaN and inf are reported per
    stage, so NumPy's own overflow warnings are silenced here.
    """
    fault = parse_perturbation(perturb)
    source, config, params, tokenizer = load_source(checkpoint, preset, languages)
    if fault:
        perturbed(params, fault[1])                                            # validate the tensor name early
    adapters, missing = backends.load(tuple(dict.fromkeys(("numpy", *names))))
    backends.require_any(names, adapters, missing)
    if fault and fault[0] not in adapters:
        raise ValueError(f"--perturb names backend {fault[0]!r}, which does not run here "
                         "(not in --backends, or not installed)")
    devices = {name: adapter.devices() if device is None else [backends.device_for(adapter, device)]
               for name, adapter in adapters.items()}
    src = translation_source(tokenizer, config) if tokenizer else None
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        oracle = build_oracle(config, params, **(compare_inputs(config) if src is None else {"src": src}),
                              dtypes=dtypes)
        report = Report(source, config, run_plan(adapters, devices, config, params, oracle, fault, progress, dtypes),
                        missing)
    if src is not None and tokenizer is not None:
        report.sentences = SENTENCES
        report.translations = [tokenizer.decode(row) for row in oracle.greedy]
        for run in report.runs:
            run.translations = None if run.tokens is None else [tokenizer.decode(row) for row in run.tokens]
    return report


def run_plan(adapters: dict[str, ModuleType], devices: dict[str, list[str]], config: TransformerConfig,
             params: dict[str, np.ndarray], oracle: Oracle, fault: tuple[str, str] | None,
             progress: Callable[[list], Iterable] | None, dtypes: tuple[str, ...] = DTYPES) -> list[Run]:
    """Every adapter on each of its ``devices`` in every precision of ``dtypes`` (the reference in each but float64,
    the truth), on the oracle's inputs."""
    plan = [(adapter, device, dtype) for name, adapter in adapters.items() for device in devices[name]
            for dtype in dtypes if not (adapter.NAME == "numpy" and dtype == "float64")]
    runs = []
    for adapter, device, dtype in (progress(plan) if progress else plan):
        weights = perturbed(params, fault[1]) if fault and fault[0] == adapter.NAME else params
        runs.append(run_backend(adapter, device, dtype, config, weights, oracle))
    return runs
