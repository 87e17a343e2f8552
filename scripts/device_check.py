"""The agreement that matters on a GPU, in one command: each port on the device against the CPU float64 reference,
under the project's one tolerance policy (``equivalence/tolerance.py``), with no install step and nothing from the
network -- the frameworks already there, the project read from the checkout (``PYTHONPATH``).

    PYTHONPATH=. python3 scripts/device_check.py --out DIR              # every check, first GPU (H200: 315 s)
    PYTHONPATH=. python3 scripts/device_check.py --quick --out DIR      # a subset (H200: 132 s)
    python scripts/device_check.py --device cpu --quick                 # the same code on the CPU (the suite's run)

Sections (``--sections``), each check one row:

* ``forward``: ``compare``'s run of each port (``transformer_bench/compare.py``: every forward stage under the
  policy, the greedy tokens by its rule) on the shipped model's sentences, in float64, float32 (TF32 off: each port's
  ``device.full_precision``), bfloat16, float16 and the autocast recipes mixed-bfloat16 and mixed-float16 (``--quick``:
  float64, float32, bfloat16); the row is the stage of the largest error / bound.
* ``decoding``: greedy and beam-search tokens on the shipped model and on a tiny random Marian built by transformers
  in-process and imported (``transformer_hf/importer.py``): float64 identical to the reference's (beam scores
  within the float64 bound), float32 identical except past a near-tie its bound allows (``equivalence.margins``;
  the random Marian's float32 beam search has no decisive row, :data:`DECODED`).
* ``training``: optimizer steps from seeded weights (``equivalence/training_runs.py``): float64 within the carried
  ``TrainingBound``, float32 and the mixed precisions by the rule on the update (``--quick``: float64, float32).
* ``determinism``: forward, greedy, beam and two training steps twice, under each port's ``device.deterministic``
  switch (PyTorch's deterministic algorithms, XLA's deterministic GPU ops, TensorFlow's op determinism): bit-identical.
* ``speed``: ``bench``'s calls (``transformer_bench/bench.py``: forward, greedy batch 1 and 8, beam 4) on the
  ``base`` preset and an opus-mt-shaped import (``--quick``: the ``tiny`` preset), median ms; informational.

A backend that is not installed, or that sees no such device, is a ``skip`` row with its reason; a check that raises
is an ``error`` row with the exception's line, and the run goes on. Progress lines go out as the checks run; at the
end one table, and with ``--out DIR`` ``DIR/device_check.json`` (rows and environment: GPUs and driver from
``nvidia-smi``, framework, CUDA and cuDNN versions, the TF32 settings, the date; rewritten after every row, with
``"finished": false`` until the run ends) and ``DIR/device_check.txt`` (the table).
``--perturb BACKEND:TENSOR`` (as ``compare``'s) changes one tensor of that backend's forward-section weights by one
part in a million: a simulated port bug the check must report.

Exit status: 0 when every row agrees (and at least one port ran a check); 1 on any disagreement or error; 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PORTS = ("torch", "jax", "tf")
SECTIONS = ("forward", "decoding", "training", "determinism", "speed")
FORWARD_DTYPES = ("float64", "float32", "bfloat16", "float16", "mixed-bfloat16", "mixed-float16")
QUICK_FORWARD_DTYPES = FORWARD_DTYPES[:3]
TRAINING_PRECISIONS = ("float64", "float32", "bfloat16", "float16")   # the last two: mixed precision
# tests/equivalence/test_training.py's run: the float32 rule's yardstick is that run's own error
TRAINING_STEPS = 10
SPEED_REPEATS = 3
QUICK_DECODE_TOKENS = 8
# Every size different, so that a transposed or swapped tensor fails on its shape or its values
# (tests/helpers/support.py)
TINY_MARIAN = dict(vocab_size=29, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
                   activation_function="swish", scale_embedding=True, pad_token_id=28, eos_token_id=0,
                   decoder_start_token_id=28, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
MARIAN_SOURCE_LENGTHS = (7, 4, 6)     # the tiny Marian's source rows, eos included (ragged: padded after eos)
# The searches compared on each model, (dtype, kind). The random Marian's float32 beam search is not: at its bound
# (about 1e-5) every row's search passes near a tie (4 beams over 29 ids, 19 steps), so no row is decisive -- the
# shipped model's float32 beam search is compared, every row of it decisive.
DECODED = {"numbers-en-fr": (("float64", "greedy"), ("float64", "beam"), ("float32", "greedy"), ("float32", "beam")),
           "tiny Marian": (("float64", "greedy"), ("float64", "beam"), ("float32", "greedy"))}
STATUSES = ("ok", "FAIL", "error", "skip", "info")


@dataclass
class Row:
    """One check: its measured error against its bound (tokens: rows that differ, against 0; training: the largest
    error / bound, against 1), and its status (``STATUSES``)."""

    section: str
    backend: str
    device: str
    check: str
    status: str
    error: float | None = None
    bound: float | None = None
    note: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        if self.error is None or self.bound is None:
            return None
        return self.error / self.bound if self.bound else (0.0 if self.error == 0 else float("inf"))


@dataclass
class Outcome:
    """What a check measured; ``ok`` None: ``error <= bound``."""

    error: float | None = None
    bound: float | None = None
    note: str = ""
    ok: bool | None = None
    skip: str = ""         # why the check cannot run here (a skip row, never a pass)

    @property
    def agrees(self) -> bool:
        if self.ok is not None:
            return self.ok
        return self.error is not None and self.bound is not None and self.error <= self.bound


@dataclass
class Checks:
    """The rows so far, each printed as it is made (a run cut short still shows where it was)."""

    device: str
    out: Path | None = None            # DIR/device_check.json, rewritten after every row (a run cut short keeps them)
    report: dict = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        print(f"[{time.monotonic() - self.start:6.0f}s] {row_line(row)}", flush=True)
        self.save(finished=False)
        return row

    def save(self, finished: bool) -> None:
        """Write the JSON report: the rows so far, ``finished`` once the run has ended (and its verdict)."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        status = exit_status(self.rows)
        report = {**self.report, "finished": finished, "ok": finished and status == 0,
                  "seconds": time.monotonic() - self.start,
                  "rows": [{**asdict(row), "ratio": row.ratio} for row in self.rows]}
        (self.out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))

    def run(self, section: str, backend: str, check: str, measure: Callable[[], Outcome], device: str | None = None,
            info: bool = False) -> Row:
        """Run one check: an ``AssertionError`` is a disagreement (FAIL), any other exception an ``error`` row with
        its one line; ``info`` rows (timings) are never a verdict."""
        device = self.device if device is None else device
        print(f"[{time.monotonic() - self.start:6.0f}s] {section} {backend}/{device} {check} ...", flush=True)
        began = time.monotonic()
        try:
            outcome = measure()
            status = "skip" if outcome.skip else "info" if info else "ok" if outcome.agrees else "FAIL"
        except AssertionError as err:
            outcome, status = Outcome(note=one_line(err)), "FAIL"
        except Exception as err:  # noqa: BLE001 - one check's failure is a row; the others still run
            outcome, status = Outcome(note=f"{type(err).__name__}: {one_line(err)}"), "error"
        return self.add(Row(section, backend, device, check, status, outcome.error, outcome.bound,
                            outcome.skip or outcome.note, time.monotonic() - began))

    def skip(self, section: str, backend: str, check: str, reason: str) -> Row:
        return self.add(Row(section, backend, self.device, check, "skip", note=reason))


def one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def row_line(row: Row) -> str:
    number = lambda value: "-" if value is None else f"{value:.3g}"     # noqa: E731
    return (f"{row.section:<12}{row.backend:<7}{row.device:<7}{row.check:<36}{number(row.error):>10} "
            f"{number(row.bound):>10} {number(row.ratio):>9}  {row.status:<6}{row.seconds:>6.1f}s  {row.note}")


def table(rows: list[Row]) -> str:
    header = (f"{'section':<12}{'port':<7}{'device':<7}{'check':<36}{'error':>10} {'bound':>10} {'ratio':>9}  "
              f"{'status':<6}{'time':>7}  note")
    counts = ", ".join(f"{sum(row.status == status for row in rows)} {status}" for status in STATUSES)
    return "\n".join([header, *(row_line(row) for row in rows), "", counts])


def exit_status(rows: list[Row]) -> int:
    """1 on any disagreement or error, and when no port compared anything (a check of nothing is no agreement)."""
    if any(row.status in ("FAIL", "error") for row in rows):
        return 1
    return 0 if any(row.status == "ok" and row.backend in PORTS for row in rows) else 1


# ----------------------------------------------------------------------------- the ports and their devices

def isolate(device: str) -> None:
    """Before any framework is imported: ``--device cpu`` hides every GPU from every framework; on a GPU, JAX and
    TensorFlow take memory as they need it, beside PyTorch in one process, instead of most of it at start."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")


def load_ports(checks: Checks, names: tuple[str, ...]) -> dict[str, tuple[ModuleType, str]]:
    """Each port that runs here: its adapter and its name of the device. A port not installed, or without the
    device, is a skip row with its reason; one that fails to import, an error row."""
    from equivalence import backends

    ports = {}
    for name in names:
        absent = backends.absent_frameworks(name)
        if absent:
            checks.skip("setup", name, "backend", f"not installed ({' and '.join(absent)} missing)")
            continue
        loaded: dict = {}
        row = checks.run("setup", name, "import, device, TF32 off", lambda: _prepare(name, checks.device, loaded))
        if row.status == "ok":
            ports[name] = loaded[name]
    return ports


def _prepare(name: str, device: str, loaded: dict) -> Outcome:
    """Import the port's adapter and find the device; before its first computation JAX's deterministic GPU ops are
    asked for, and PyTorch's cuBLAS workspace fixed before its CUDA context starts (its determinism switch thrown
    once, then off until the determinism section); TF32 off (each port's ``device.full_precision``)."""
    from equivalence import backends

    adapter = backends.load((name,))[0][name]
    port_device = importlib.import_module(f"transformer_{name}.device")
    if name in ("torch", "jax"):
        port_device.deterministic(True)
    if name == "torch":
        port_device.deterministic(False)
    try:
        loaded[name] = (adapter, backends.device_for(adapter, device))
    except ValueError as err:
        return Outcome(skip=f"no {device} here: {one_line(err)}")
    port_device.full_precision()
    return Outcome(ok=True, note=f"{adapter.NAME} on {loaded[name][1]}")


@contextlib.contextmanager
def deterministic(name: str) -> Iterator[None]:
    """The port's determinism switch around a block (TensorFlow's cannot be turned off: it stays on)."""
    port_device = importlib.import_module(f"transformer_{name}.device")
    port_device.deterministic(True)
    try:
        yield
    finally:
        if name == "torch":
            port_device.deterministic(False)


# ----------------------------------------------------------------------------- forward: compare's runs

def forward_section(checks: Checks, ports: dict, quick: bool, perturb: str | None) -> None:
    from transformer_bench import compare

    dtypes = QUICK_FORWARD_DTYPES if quick else FORWARD_DTYPES
    fault = compare.parse_perturbation(perturb)
    state: dict = {}
    checks.run("forward", "numpy", "reference in every precision", lambda: _forward_oracle(state, dtypes),
               device="cpu")
    if "oracle" not in state:
        return
    for name, (adapter, device) in ports.items():
        params = compare.perturbed(state["params"], fault[1]) if fault and fault[0] == name else state["params"]
        for dtype in dtypes:
            checks.run("forward", name, f"stages+greedy {dtype}",
                       lambda: _compare_run(compare.run_backend(adapter, device, dtype, state["config"], params,
                                                                state["oracle"])))


def _forward_oracle(state: dict, dtypes: tuple[str, ...]) -> Outcome:
    """compare's oracle on the shipped model's sentences: the float64 reference's stages and translations, the
    reference's own stages in every other precision (the yardsticks)."""
    from transformer_bench import compare

    _, config, params, tokenizer = compare.load_source(None, None)
    src = compare.translation_source(tokenizer, config) if tokenizer else None
    assert src is not None, "the shipped model's tokenizer does not encode compare's sentences"
    state.update(config=config, params=params, oracle=compare.build_oracle(config, params, src, dtypes=dtypes))
    return Outcome(ok=True, note=f"{len(src)} sentences, {', '.join(dtypes)}")


def _compare_run(run) -> Outcome:
    """A compare run as a row: its stage of the largest error / bound, its verdict (every stage, greedy tokens)."""
    if run.error:
        raise RuntimeError(run.error)
    worst = max(run.stages, key=lambda stage: stage.max_abs_error / stage.bound if stage.bound else float("inf"))
    notes = [f"worst stage {worst.stage}" + (" (added)" if worst.added else "")]
    if run.first_failing_stage:
        notes.append(f"first over its bound: {run.first_failing_stage}")
    if run.first_non_finite_stage:
        notes.append(f"non-finite from {run.first_non_finite_stage}")
    notes.append("greedy identical" if run.greedy_identical else f"greedy differs {run.greedy_note}".strip())
    notes += [run.greedy_note] if run.greedy_identical and run.greedy_note else []
    return Outcome(worst.max_abs_error, worst.bound, "; ".join(notes) + f"; forward {run.forward_ms:.1f} ms",
                   ok=run.ok)


# ----------------------------------------------------------------------------- decoding: greedy and beam tokens

def decoding_section(checks: Checks, ports: dict, workdir: Path) -> None:
    models: dict = {}
    checks.run("decoding", "numpy", "shipped model", lambda: _shipped_model(models), device="cpu")
    if _transformers_missing():
        checks.skip("decoding", "numpy", "tiny random Marian", _transformers_missing())
    else:
        checks.run("decoding", "numpy", "tiny random Marian", lambda: _tiny_marian(models, workdir), device="cpu")
    for model_name, (config, params, src) in models.items():
        oracles: dict = {}
        checks.run("decoding", "numpy", f"{model_name}: reference decisions",
                   lambda: _decoding_oracles(oracles, config, params, src), device="cpu")
        for name, (adapter, device) in ports.items():
            built: dict = {}                                     # dtype -> [the port's model], built once
            for dtype, kind in DECODED[model_name] if oracles else ():
                checks.run("decoding", name, f"{model_name} {kind} {dtype}",
                           lambda: _decoded(adapter, built.setdefault(dtype, []), config, params, dtype, device,
                                            kind, oracles[(kind, dtype)]))


def _transformers_missing() -> str:
    """Why the tiny Marian cannot be built here ('' when it can): transformers' model needs PyTorch."""
    absent = [name for name in ("transformers", "torch") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(absent)} not installed: the Marian is transformers' MarianMTModel" if absent else ""


def _shipped_model(models: dict) -> Outcome:
    from transformer_bench import compare

    _, config, params, tokenizer = compare.load_source(None, None)
    src = compare.translation_source(tokenizer, config) if tokenizer else None
    assert src is not None, "the shipped model's tokenizer does not encode compare's sentences"
    models["numbers-en-fr"] = (config, params, src)
    return Outcome(ok=True, note=f"{len(src)} sentences")


def _tiny_marian(models: dict, workdir: Path) -> Outcome:
    """transformers' MarianMTModel of :data:`TINY_MARIAN`, every weight random, saved and imported."""
    from reference_numpy import load_checkpoint

    path = marian_checkpoint(workdir / "tiny-marian", TINY_MARIAN, randomize=True)
    config, params = load_checkpoint(path)
    models["tiny Marian"] = (config, params, marian_source(config))
    return Outcome(ok=True, note=f"imported: {config.n_encoder_layers}+{config.n_decoder_layers} layers, "
                                 f"{config.tgt_vocab_size} ids, beam {config.decoding.beam_size}")


def marian_checkpoint(directory: Path, sizes: dict, randomize: bool) -> Path:
    """transformers' ``MarianMTModel(MarianConfig(**sizes))`` (seeded; ``randomize``: every weight but the position
    tables N(0, 0.5^2), as LayerNorms and biases are constants at initialisation), saved with ``save_pretrained``
    and imported as ``directory/model.safetensors``."""
    import torch
    import transformers

    from transformer_hf.importer import import_hf

    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**sizes)).eval()
    if randomize:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if "embed_positions" not in name:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    model.save_pretrained(directory / "hf")
    import_hf(directory / "hf", directory / "model.safetensors")
    return directory / "model.safetensors"


def marian_source(config) -> np.ndarray:
    """Source rows of ordinary ids (:func:`equivalence.oracle.ordinary_ids`) of :data:`MARIAN_SOURCE_LENGTHS`, eos
    last, padded."""
    from equivalence.oracle import ordinary_ids

    ids = ordinary_ids(config)[0]
    rng = np.random.default_rng(0)
    src = np.full((len(MARIAN_SOURCE_LENGTHS), max(MARIAN_SOURCE_LENGTHS)), config.pad_id)
    for row, length in enumerate(MARIAN_SOURCE_LENGTHS):
        src[row, :length - 1] = ids[rng.integers(0, len(ids), length - 1)]
        src[row, length - 1] = config.eos_id
    return src


def _decoding_oracles(oracles: dict, config, params, src) -> Outcome:
    """The float64 reference's greedy and beam search, their margins and the bound of float64's and float32's
    log-probabilities along them (``equivalence.margins.decoding_oracle``)."""
    from equivalence.backends import numpy as reference
    from equivalence.margins import decoding_oracle

    model64 = reference.build(config, params, "float64")
    for dtype in ("float64", "float32"):
        model = model64 if dtype == "float64" else reference.build(config, params, dtype)
        for kind in ("greedy", "beam"):
            oracles[(kind, dtype)] = decoding_oracle(model64, model, src, kind)
    return Outcome(ok=True, note=f"{len(src)} rows, greedy up to {oracles[('greedy', 'float64')].tokens.shape[1]} "
                                 f"tokens")


def _decoded(adapter, model: list, config, params, dtype: str, device: str, kind: str, oracle) -> Outcome:
    """A port's tokens against the reference's: float64 identical (beam scores within the float64 bound); float32
    by the near-tie rules of ``equivalence.tolerance``, at least one row compared whole. ``model``: the port's
    model, built on the first call and kept for the next."""
    from equivalence import tolerance

    model[:] = model or [adapter.build(config, params, dtype, device)]
    out = adapter.greedy(model[0], oracle.src) if kind == "greedy" else adapter.beam(model[0], oracle.src)
    tokens = out if kind == "greedy" else out[0]
    rows = len(oracle.tokens)
    if dtype == "float64":
        differ = sum(not tolerance.same_tokens(row, ref, config.pad_id) for row, ref in zip(tokens, oracle.tokens))
        differ += abs(len(tokens) - rows)
        if kind == "greedy":
            return Outcome(differ, 0, f"{rows - differ} of {rows} rows identical")
        scores = tolerance.agreement(out[1], oracle.scores, precision="float64")
        return Outcome(scores.error, scores.bound, f"{rows - differ} of {rows} rows identical; beam scores",
                       ok=differ == 0 and scores.ok)
    if kind == "greedy":
        agree, note, full = tolerance.greedy_tokens_agree(tokens, oracle.tokens, oracle.margins, oracle.bound,
                                                          config.pad_id)
        return Outcome(None, None, f"{full} of {rows} rows compared whole" + (f"; {note}" if note else ""),
                       ok=agree and full > 0)
    clear = [row for row, margins in enumerate(oracle.margins) if tolerance.beam_row_is_decisive(margins, oracle.bound)]
    differ = [row for row in clear if not tolerance.same_tokens(tokens[row], oracle.tokens[row], config.pad_id)]
    return Outcome(len(differ), 0, f"{len(clear)} of {rows} rows decisive, compared" +
                   (f"; rows {differ} differ" if differ else ""), ok=bool(clear) and not differ)


# ----------------------------------------------------------------------------- training steps

def training_section(checks: Checks, ports: dict, quick: bool) -> None:
    steps, precisions = TRAINING_STEPS, TRAINING_PRECISIONS[:2] if quick else TRAINING_PRECISIONS
    reference: dict = {}
    checks.run("training", "numpy", f"reference runs, {steps} steps",
               lambda: _reference_runs(reference, steps, precisions), device="cpu")
    if "float64" not in reference:
        return
    for name, (adapter, device) in ports.items():
        for precision in precisions:
            check = f"{steps} steps {'' if precision in ('float64', 'float32') else 'mixed-'}{precision}"
            checks.run("training", name, check, lambda: _trained(adapter, device, precision, reference))


def training_case(steps: int) -> tuple:
    """tests/equivalence/test_training.py's case: the ``tiny`` variant without dropout, its seeded weights, the paper's
    Adam and schedule, a different ragged batch each step."""
    from equivalence.cases import VARIANTS, seeded_params, training_inputs
    from reference_numpy.config import TrainingConfig

    config = VARIANTS["tiny"].replace(dropout=0.0)
    batches = [training_inputs(config, seed=step) for step in range(steps)]
    return config, seeded_params(config), TrainingConfig(), batches


def train(adapter, config, params, training, batches, dtype: str, device: str, compute: str | None = None):
    """One run of ``adapter`` from ``params`` (``compute``: a float32 model in that mixed precision)."""
    from equivalence.training_runs import Run

    model = adapter.build(config, params, dtype, device)
    optimizer = adapter.optimizer(model, training, None, compute)
    losses = [adapter.train_step(model, optimizer, **batch) for batch in batches]
    return Run(losses, adapter.export_params(model), adapter.training_state(model, optimizer))


def _reference_runs(reference: dict, steps: int, precisions: tuple[str, ...]) -> Outcome:
    """The float64 reference's run with its bound, and the reference's own run in every other precision."""
    from equivalence.backends import numpy as numpy_backend
    from equivalence.training_runs import reference_run

    config, params, training, batches = case = training_case(steps)
    reference["case"] = case
    reference["float64"] = reference_run(config, params, training, batches)
    for precision in precisions[1:]:
        compute = None if precision == "float32" else precision
        reference[precision] = train(numpy_backend, config, params, training, batches, "float32", "cpu", compute)
    return Outcome(ok=True, note=f"the tiny variant, {', '.join(precisions)}")


def _trained(adapter, device: str, precision: str, reference: dict) -> Outcome:
    from equivalence.training_runs import assert_float64_run, assert_precision_run

    config, params, training, batches = reference["case"]
    ref64, bound = reference["float64"]
    if precision == "float64":
        result = train(adapter, config, params, training, batches, "float64", device)
        worst = assert_float64_run(result, ref64, bound, adapter.NAME)
        return Outcome(worst, 1.0, "largest error / bound: losses, weights, Adam moments (TrainingBound)")
    compute = None if precision == "float32" else precision
    result = train(adapter, config, params, training, batches, "float32", device, compute)
    worst = assert_precision_run(result, ref64, reference[precision], params, precision, adapter.NAME)
    return Outcome(worst, 1.0, "largest error / bound: losses, updates, Adam moments")


# ----------------------------------------------------------------------------- determinism

def determinism_section(checks: Checks, ports: dict) -> None:
    for name, (adapter, device) in ports.items():
        checks.run("determinism", name, "float32 twice: bit-identical", lambda: _twice(name, adapter, device))


def _twice(name: str, adapter, device: str) -> Outcome:
    """Forward, greedy and beam search of the shipped model on compare's sentences and two training steps of the
    training case, each run twice from the same weights under the port's switch: the number of outputs whose bits
    differ (0 allowed)."""
    from transformer_bench import compare

    _, config, params, tokenizer = compare.load_source(None, None)
    src = compare.translation_source(tokenizer, config) if tokenizer else None
    assert src is not None, "the shipped model's tokenizer does not encode compare's sentences"
    tgt = compare.compare_inputs(config)["tgt"][:1].repeat(len(src), axis=0)
    small, initial, training, batches = training_case(2)

    def outputs() -> list:
        model = adapter.build(config, params, "float32", device)
        run = train(adapter, small, initial, training, batches, "float32", device)
        return [adapter.log_probs(model, src, tgt), adapter.greedy(model, src), *adapter.beam(model, src),
                *run.losses, *run.params.values(), *run.state.first_moments.values()]

    with deterministic(name):
        first, second = outputs(), outputs()
    differ = sum(not np.array_equal(a, b) for a, b in zip(first, second))
    return Outcome(differ, 0, f"{len(first)} outputs (forward, greedy, beam, training) compared bit for bit")


# ----------------------------------------------------------------------------- speed: bench's calls

def speed_section(checks: Checks, ports: dict, quick: bool, repeats: int, workdir: Path) -> None:
    models: dict = {}
    for model_name in (("tiny",) if quick else ("base", "opus-mt shape")):
        if model_name == "opus-mt shape" and _transformers_missing():
            checks.skip("speed", "numpy", model_name, _transformers_missing())
            continue
        checks.run("speed", "numpy", f"{model_name}: weights", lambda: _bench_model(models, model_name, workdir),
                   device="cpu")
    for model_name, (config, params, shapes) in models.items():
        for name, (adapter, device) in ports.items():
            timings: dict = {}
            row = checks.run("speed", name, f"{model_name}: build and time",
                             lambda: _timed(timings, adapter, config, params, shapes, device, repeats))
            for task, timing in timings.items() if row.status == "ok" else ():
                steps = "" if task == "forward" else f", {np.shape(timing.result)[1]} steps"
                checks.add(Row("speed", name, device, f"{model_name}: {task}", "info", note=(
                    f"{1e3 * timing.median:.2f} ms median ({1e3 * timing.minimum:.2f}-{1e3 * timing.maximum:.2f}), "
                    f"first call {timing.first:.2f} s{steps}")))


def _bench_model(models: dict, model_name: str, workdir: Path) -> Outcome:
    """bench's weights: a seeded preset, or the opus-mt-shaped import (scripts/bench_translate.py's OPUS_MT with
    opus-mt's own 512 positions, transformers' seeded initialisation); bench's shapes (``tiny``: small ones)."""
    from transformer_bench import bench

    if model_name == "opus-mt shape":
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_translate import OPUS_MT

        checkpoint = marian_checkpoint(workdir / "opus-mt", {**OPUS_MT, "max_position_embeddings": 512}, False)
        _, config, params = bench.bench_model(None, checkpoint)
    else:
        _, config, params = bench.bench_model(model_name, None)
    if model_name == "tiny":                   # a smoke test of the calls: a short budget, small shapes
        config = config.with_decoding(max_output_length=QUICK_DECODE_TOKENS)
    shapes = (2, 16, 16, QUICK_DECODE_TOKENS) if model_name == "tiny" else (8, 128, 128, 128)   # B, S, T, decoded
    models[model_name] = (config, params, shapes)
    return Outcome(ok=True, note=f"d_model {config.d_model}, {config.n_encoder_layers}+{config.n_decoder_layers} "
                                 f"layers, {config.tgt_vocab_size} ids; forward {shapes[0]}x{shapes[1]}x{shapes[2]}, "
                                 f"decoding {shapes[3]} tokens")


def _timed(timings: dict, adapter, config, params, shapes: tuple, device: str, repeats: int) -> Outcome:
    """bench's backend engine with its ``--peers`` calls (forward, greedy batch 1 and 8, beam 4 batch 1), float32,
    timed interleaved after a warm-up call each (bench's ``round_robin``)."""
    from transformer_bench import bench
    from transformer_bench.timing import round_robin

    batch, src_len, tgt_len, decode_tokens = shapes
    src, tgt, decode_src = bench.bench_inputs(config, batch, src_len, tgt_len, decode_tokens, bench.PEER_BATCH)
    inputs = bench.Inputs((src, tgt), decode_src[:1], decode_src)
    engine = bench.backend_engine(adapter, config, params, inputs, True, False, "float32", device)
    timings.update(round_robin(engine.calls, repeats))
    return Outcome(ok=True, note=f"{len(timings)} calls, {repeats} repeats each")


# ----------------------------------------------------------------------------- environment

def environment(ports: dict) -> dict:
    """The machine: date, Python, GPUs and driver (``nvidia-smi``), and each port's framework with its CUDA, cuDNN
    and precision settings as the framework reports them."""
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform(), "numpy": np.__version__,
           "nvidia_smi": nvidia_smi(), "packages": package_versions(), "frameworks": {}}
    for name in ports:
        try:
            env["frameworks"][name] = FRAMEWORK_INFO[name]()
        except Exception as err:  # noqa: BLE001 - a framework that cannot describe itself is noted, not fatal
            env["frameworks"][name] = {"error": f"{type(err).__name__}: {one_line(err)}"}
    return env


def nvidia_smi() -> list[dict] | str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    fields = ("name", "driver_version", "memory.total", "compute_cap")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as err:
        return f"nvidia-smi failed: {one_line(err)}"
    return [dict(zip(fields, (value.strip() for value in line.split(",")))) for line in out.splitlines() if line]


def package_versions() -> dict[str, str]:
    """Installed versions of the packages the checks use (and any JAX CUDA plugin), by their distributions."""
    names = {"numpy", "safetensors", "ml-dtypes", "torch", "jax", "jaxlib", "flax", "optax", "tensorflow",
             "tensorflow-cpu", "keras", "transformers", "tokenizers", "sentencepiece"}
    names |= {dist.metadata["Name"] for dist in importlib.metadata.distributions()
              if (dist.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "nvidia-cudnn"))}
    versions = {}
    for name in sorted(names):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def _torch_info() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "gpus": gpus, "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _jax_info() -> dict:
    import jax

    return {"version": jax.__version__, "backend": jax.default_backend(),
            "devices": [f"{device.platform}: {device.device_kind}" for device in jax.devices()],
            "default_matmul_precision": jax.config.jax_default_matmul_precision,   # type: ignore[attr-defined]
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _tf_info() -> dict:
    import tensorflow as tf

    build = tf.sysconfig.get_build_info()
    return {"version": tf.__version__, "cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version"),
            "gpus": [gpu.name for gpu in tf.config.list_physical_devices("GPU")],
            "tf32": tf.config.experimental.tensor_float_32_execution_enabled()}


FRAMEWORK_INFO = {"torch": _torch_info, "jax": _jax_info, "tf": _tf_info}


# ----------------------------------------------------------------------------- the command

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="gpu", help="gpu (the first), gpu:N, or cpu (every GPU hidden)")
    parser.add_argument("--backends", default=",".join(PORTS), help=f"comma-separated, of {', '.join(PORTS)}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="a subset (H200: 132 s)")
    parser.add_argument("--repeats", type=int, default=SPEED_REPEATS, help="timed calls per speed measurement")
    parser.add_argument("--perturb", metavar="BACKEND:TENSOR",
                        help="change one tensor of BACKEND's forward weights by 1e-6 (a simulated bug)")
    parser.add_argument("--out", type=Path, help="directory for device_check.json and device_check.txt")
    args = parser.parse_args(argv)
    args.device = "gpu:0" if args.device == "gpu" else args.device
    args.backends = tuple(name for name in args.backends.split(",") if name)
    args.sections = tuple(name for name in args.sections.split(",") if name)
    for flag, values, allowed in (("--backends", args.backends, PORTS), ("--sections", args.sections, SECTIONS)):
        unknown = [value for value in values if value not in allowed]
        if unknown or not values:
            parser.error(f"{flag}: choose from {', '.join(allowed)}, got {','.join(values) or 'nothing'}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        from transformer_bench.compare import parse_perturbation

        parse_perturbation(args.perturb)
    except ValueError as err:
        parser.error(str(err))
    return args


def run_sections(checks: Checks, ports: dict, args: argparse.Namespace, workdir: Path) -> None:
    sections = {"forward": lambda: forward_section(checks, ports, args.quick, args.perturb),
                "decoding": lambda: decoding_section(checks, ports, workdir),
                "training": lambda: training_section(checks, ports, args.quick),
                "determinism": lambda: determinism_section(checks, ports),
                "speed": lambda: speed_section(checks, ports, args.quick, args.repeats, workdir)}
    for section in args.sections:
        print(f"--- {section}", flush=True)
        sections[section]()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    isolate(args.device)
    checks = Checks(args.device, args.out, {"arguments": sys.argv[1:] if argv is None else argv})
    ports = load_ports(checks, args.backends)
    checks.report["environment"] = environment(ports)
    print(json.dumps(checks.report["environment"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        run_sections(checks, ports, args, Path(workdir))
    status, text = exit_status(checks.rows), table(checks.rows)
    seconds = time.monotonic() - checks.start
    text += f"\n{'every check agrees' if status == 0 else 'DISAGREEMENT OR ERROR'}; {seconds:.0f} s"
    print("\n" + text, flush=True)
    checks.save(finished=True)
    if args.out is not None:
        (args.out / "device_check.txt").write_text(text + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
