"""``bench``: the forward pass and decoding of every installed backend -- and, with ``--peers``, of the engines
a user would pick instead (:mod:`transformer_bench.peers`) -- on the same weights and inputs, timed interleaved
(:func:`transformer_bench.timing.round_robin`: each round runs every engine once, in turn), medians with their
spread, the warm-up call reported apart as compile time.

Every figure is set against anchors the command measures itself, in every round beside the engines
(:class:`Anchors`): the machine's best float32 matrix-multiply rate (the fastest of NumPy, PyTorch, JAX and
TensorFlow, whichever are installed, each named), its memory bandwidth, and from it the lower bound of a
cached decoding step, the bytes it must read (:func:`transformer_bench.timing.decode_step_bytes`) over the
bandwidth. FLOPs are counted analytically
(2 per multiply-add of every matrix product, see :mod:`transformer_bench.timing`).

Without ``--peers``: forward, cached and uncached greedy decoding of batch 1 (section 6.1's budget: source
length + 50 tokens). With ``--peers``: forward, greedy decoding of batch 1 and of batch :data:`PEER_BATCH`,
beam search (beam 4, alpha 0.6) of batch 1, the backends with their key/value caches (the NumPy reference,
which recomputes every prefix by design, runs the forward pass only), the peers through their own APIs,
told to emit exactly ``decode_tokens`` tokens where they can be.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from equivalence import backends, runtime
from equivalence.oracle import ordinary_ids
from reference_numpy import TransformerConfig, init_params
from reference_numpy.checkpoint import load_checkpoint
from reference_numpy.decoding import BEAM_SIZE, EXTRA_OUTPUT_LENGTH
from reference_numpy.precision import parse_precision
from transformer_bench.timing import (
    BANDWIDTH_OPERATION,
    Timing,
    cpu_name,
    decode_flops,
    decode_step_bytes,
    encode_flops,
    forward_flops,
    gemm_products,
    gflop_rate,
    memory_read,
    round_robin,
)

if TYPE_CHECKING:
    from transformer_bench.peers import Peer

MATMUL_SIZE = 2048
BANDWIDTH_MIB = 256
PEER_BATCH = 8
GEMM, BANDWIDTH = "anchor: GEMM", "anchor: memory read"     # the anchors' keys among the timed calls
BUSY_SPREAD = 0.3       # a call whose slowest repeat is this much (of its median) above its fastest: a busy machine

FORWARD = "forward"
TASKS = (FORWARD, "greedy (cached)", "greedy (uncached)")                           # without --peers
PEER_TASKS = (FORWARD, "greedy batch 1", f"greedy batch {PEER_BATCH}", "beam 4 batch 1")  # with --peers
COMPILED = "torch (compiled)"   # --compiled: the PyTorch port's cached decoding under compile_decoding
ROWS = {"greedy (cached)": 1, "greedy (uncached)": 1, "greedy batch 1": 1, f"greedy batch {PEER_BATCH}": PEER_BATCH,
        "beam 4 batch 1": BEAM_SIZE}            # rows a decoding step of each task runs (beam search: its beams)


@dataclass
class Measurement:
    backend: str               # the engine: a backend, or a peer
    device: str
    task: str                  # one of TASKS or PEER_TASKS
    seconds: float             # median of the timed repeats
    first_call_seconds: float  # the warm-up call: includes tracing/compilation
    flops: float
    tokens: int | None = None  # decoding: the steps the call ran (the output's length; batch > 1: its longest row)
    min_seconds: float = 0.0   # the fastest and slowest timed repeats
    max_seconds: float = 0.0
    kind: str = "backend"      # "backend" or "peer"
    repeats: int = 0           # timed calls after the warm-up

    @property
    def compile_seconds(self) -> float:
        return max(0.0, self.first_call_seconds - self.seconds)

    @property
    def gflops(self) -> float:
        return gflop_rate(self.flops, self.seconds)

    @property
    def unit_seconds(self) -> float:
        """The forward pass's time, or a decoding call's time per step (per token at batch 1)."""
        return self.seconds if self.tokens is None else self.seconds / max(1, self.tokens)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median of the timed repeats (0 with fewer than two)."""
        return (self.max_seconds - self.min_seconds) / self.seconds if self.repeats > 1 and self.seconds else 0.0


@dataclass
class Anchors:
    """What this machine can do at best, measured by the command itself."""

    gemm_gflops: dict[str, float]   # framework -> float32 (MATMUL_SIZE)^2 product rate
    bandwidth_gb_per_s: float       # BANDWIDTH_OPERATION's read rate
    step_bytes: dict[str, float]    # decoding task -> bytes one of its steps reads (timing.decode_step_bytes)

    @property
    def best_gemm(self) -> tuple[str, float]:
        return max(self.gemm_gflops.items(), key=lambda item: item[1])

    def bound_seconds(self, task: str) -> float:
        """The lower bound of one step of a decoding task: its bytes at the measured bandwidth."""
        return self.step_bytes[task] / (self.bandwidth_gb_per_s * 1e9)

    def to_json(self) -> dict:
        name, rate = self.best_gemm
        return {"gemm_gflops": self.gemm_gflops, "gemm_size": MATMUL_SIZE, "best_gemm": {"framework": name,
                                                                                        "gflops": rate},
                "bandwidth": {"operation": BANDWIDTH_OPERATION.format(mib=BANDWIDTH_MIB),
                              "gb_per_s": self.bandwidth_gb_per_s},
                "step_bytes": self.step_bytes,
                "bound_seconds_per_step": {task: self.bound_seconds(task) for task in self.step_bytes}}


@dataclass
class BenchReport:
    name: str                  # the preset's name, or the checkpoint's path (``checkpoint``)
    shapes: dict
    machine: dict
    anchors: Anchors
    measurements: list[Measurement]
    missing: list
    computes: dict = field(default_factory=dict)    # engine -> {task: what its timed call computes}
    peers: bool = False
    checkpoint: bool = False   # the weights and config a checkpoint's, not a preset's seeded ones

    @property
    def model(self) -> str:
        """What was timed, in words: "preset NAME" or "checkpoint PATH"."""
        return f"{'checkpoint' if self.checkpoint else 'preset'} {self.name}"

    def best_peer(self, task: str) -> Measurement | None:
        runs = [m for m in self.measurements if m.kind == "peer" and m.task == task]
        return min(runs, key=lambda m: m.unit_seconds, default=None)

    def ratios(self, m: Measurement) -> dict[str, float | str | None]:
        """The measurement against its anchors: forward GFLOP/s over the best GEMM rate; a decoding step's
        time over its bandwidth bound; its time (per step) over the best peer's."""
        best = self.best_peer(m.task) if self.peers else None
        return {"ratio_to_best_gemm": m.gflops / self.anchors.best_gemm[1] if m.task == FORWARD else None,
                "ratio_to_bound": None if m.task == FORWARD else m.unit_seconds / self.anchors.bound_seconds(m.task),
                "ratio_to_best_peer": m.unit_seconds / best.unit_seconds if best else None,
                "best_peer": best.backend if best else None}

    @property
    def busy(self) -> str | None:
        """A warning if the repeats of some call spread more than ``BUSY_SPREAD``: the machine was busy, so the
        figures are not the machine's (None otherwise)."""
        worst = max(self.measurements, key=lambda m: m.spread, default=None)
        if worst is None or worst.spread <= BUSY_SPREAD:
            return None
        return (f"the repeats of {worst.backend} {worst.task} spread {100 * worst.spread:.0f}% around their median: "
                "the machine was busy, so these times are not its own; rerun with the cores free")

    def to_json(self) -> dict:
        return {"preset": None if self.checkpoint else self.name,
                "checkpoint": self.name if self.checkpoint else None, "shapes": self.shapes,
                "machine": self.machine, "peers": self.peers, "busy": self.busy,
                "anchors": self.anchors.to_json(), "missing": [asdict(m) for m in self.missing],
                "computes": self.computes,
                "measurements": [{**asdict(m), "compile_seconds": m.compile_seconds, "gflops": m.gflops,
                                  "unit_seconds": m.unit_seconds, **self.ratios(m)} for m in self.measurements]}


@dataclass
class Engine:
    """One engine's timed calls: task -> a call returning its output (decoding: token ids (B, L))."""

    name: str
    kind: str
    device: str
    calls: dict[str, Callable[[], object]]
    computes: dict[str, str]
    once: tuple[str, ...] = ()      # tasks timed with one repeat: decoding without a cache, slow by design


def machine_description() -> dict:
    """The machine, Python, and each framework's version and threads (``runtime.settings``)."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "runtime": runtime.settings()}


class Inputs(NamedTuple):
    """What the engines run on: the forward pass's (src, tgt), and the source sentences to decode, batch 1 and
    the whole decoding batch."""

    forward: tuple[np.ndarray, np.ndarray]
    one: np.ndarray
    batch: np.ndarray


def bench_inputs(config: TransformerConfig, batch: int, src_len: int, tgt_len: int, decode_tokens: int,
                 decode_batch: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded token ids, none of them pad, bos or eos (:func:`equivalence.oracle.ordinary_ids`): a (batch, src_len)
    source and (batch, tgt_len) target for the forward pass (starting with the decoder's start token), and
    ``decode_batch`` source sentences of decode_tokens - EXTRA_OUTPUT_LENGTH tokens (section 6.1's budget: source
    length + 50) to decode."""
    rng = np.random.default_rng(0)
    source_ids, target_ids = ordinary_ids(config)
    src = source_ids[rng.integers(0, len(source_ids), size=(batch, src_len))]
    tgt = target_ids[rng.integers(0, len(target_ids), size=(batch, tgt_len))]
    tgt[:, 0] = config.start_id
    source_length = max(1, decode_tokens - EXTRA_OUTPUT_LENGTH)
    decode_src = source_ids[rng.integers(0, len(source_ids), size=(decode_batch, source_length))]
    return src, tgt, decode_src


def bench_model(preset: str | None, checkpoint: str | os.PathLike | None
                ) -> tuple[str, TransformerConfig, dict[str, np.ndarray]]:
    """(name, config, float32 weights) of what ``bench`` times: ``checkpoint`` (a path or a shipped model's name:
    its config, decoding conventions and weights -- an imported opus-mt model's, say), or ``preset`` with seeded
    random weights (``base`` when neither is given). A checkpoint's own output budget (``max_output_length``) gives
    way to section 6.1's, ``--decode-tokens`` for every engine: an imported model's 511 tokens would have the ports
    decode 511 steps where the peers decode N."""
    if checkpoint is None:
        preset = preset or "base"
        config = TransformerConfig.preset(preset)
        return preset, config, init_params(config, seed=0, dtype=np.float32)
    if preset is not None:
        raise ValueError("--preset: give a checkpoint or a preset, not both")
    config, params = load_checkpoint(checkpoint, dtype=np.float32)
    return os.fspath(checkpoint), config.with_decoding(max_output_length=None), params


def bench(preset: str | None = None, batch: int = 8, src_len: int = 128, tgt_len: int = 128, decode_tokens: int = 128,
          names: tuple[str, ...] = tuple(backends.BACKENDS), repeats: int = 3, uncached: bool = True,
          progress: Callable[[list], Iterable] | None = None, peers: bool = False, dtype: str = "float32",
          device: str = "cpu", compiled: bool = False, checkpoint: str | os.PathLike | None = None) -> BenchReport:
    """Time every installed backend (in ``dtype``, on ``device``: cpu, gpu:N) -- and with ``peers`` every installed
    peer, float32 only; with ``compiled`` the PyTorch port's decoding compiled too (:data:`COMPILED`) -- on one
    model (:func:`bench_model`: a seeded preset, or a checkpoint's weights and decoding conventions), interleaved;
    the anchors measured on the way. Beam search uses the model's length penalty (the presets': alpha 0.6)."""
    name, config, params = bench_model(preset, checkpoint)
    if peers and dtype != "float32":
        raise ValueError(f"--peers times the peers in float32; --dtype {dtype} would compare unlike with unlike")
    if compiled and dtype != "float32":
        raise ValueError(f"--compiled times PyTorch's compiled decoding step, float32 only, not --dtype {dtype}")
    for flag, length in (("--src-len", src_len), ("--tgt-len", tgt_len), ("--decode-tokens", decode_tokens)):
        if length > config.max_len:
            model = f"the {name} preset's" if checkpoint is None else "the checkpoint's"
            raise ValueError(f"{flag} {length} exceeds {model} max_len ({config.max_len})")
    adapters, missing = backends.load(tuple(names))
    backends.require_any(tuple(names), adapters, missing)
    devices = {name: backends.device_for(adapter, device) for name, adapter in adapters.items()}
    src, tgt, decode_src = bench_inputs(config, batch, src_len, tgt_len, decode_tokens, PEER_BATCH if peers else 1)
    inputs = Inputs((src, tgt), decode_src[:1], decode_src)
    engines = [backend_engine(adapter, config, params, inputs, peers, uncached, dtype, devices[name])
               for name, adapter in adapters.items()]
    if compiled and "torch" in adapters:
        engines.append(backend_engine(adapters["torch"], config, params, inputs, peers, uncached, dtype,
                                      devices["torch"], compiled=True))
    elif compiled:
        missing.append(backends.Missing(COMPILED, "not measured (the PyTorch backend is not loaded)"))
    if peers:
        from transformer_bench import peers as peer_module
        built, unavailable = peer_module.load(config, params, runtime.threads())
        engines += [peer_engine(peer, inputs, decode_tokens, config.decoding.length_penalty) for peer in built.values()]
        missing += unavailable + [backends.Missing(peer.NAME, f"{task}: not measured ({reason})")
                                  for peer in built.values() for task, reason in peer.NOT_MEASURED.items()]
    tasks = PEER_TASKS if peers else TASKS
    source = decode_src.shape[1]
    read, read_bytes = memory_read(BANDWIDTH_MIB)
    anchor_calls = {**{(GEMM, name): product for name, product in gemm_products(MATMUL_SIZE).items()},
                    (BANDWIDTH, "numpy"): read}
    calls = {(engine.name, task): engine.calls[task] for task in tasks for engine in engines if task in engine.calls}
    once = {(engine.name, task) for engine in engines for task in engine.once}
    counts = {key: 1 if key in once else repeats for key in (*anchor_calls, *calls)}
    timings = round_robin({**anchor_calls, **calls}, counts, progress)       # the anchors too, in every round
    anchors = Anchors({name: gflop_rate(2 * MATMUL_SIZE ** 3, timings[(GEMM, name)].median)
                       for kind, name in anchor_calls if kind == GEMM},
                      read_bytes / timings[(BANDWIDTH, "numpy")].median / 1e9,
                      {task: decode_step_bytes(config, ROWS[task], source, decode_tokens,
                                                        parse_precision(dtype)[0].itemsize)   # the stored weights
                       for task in tasks[1:]})
    kinds = {engine.name: (engine.kind, engine.device) for engine in engines}
    measurements = [measurement(config, key, timings[key], *kinds[key[0]], (batch, src_len, tgt_len), source)
                    for key in calls]
    shapes = {"batch": batch, "src_len": src_len, "tgt_len": tgt_len, "decode_tokens": decode_tokens,
              "decode_batch": PEER_BATCH if peers else 1, "beam_size": BEAM_SIZE,
              "alpha": config.decoding.length_penalty, "dtype": dtype}
    return BenchReport(name, shapes, machine_description(), anchors, measurements, missing,
                       {engine.name: engine.computes for engine in engines}, peers, checkpoint is not None)


def backend_engine(adapter: ModuleType, config: TransformerConfig, params: dict[str, np.ndarray], inputs: Inputs,
                   peers: bool, uncached: bool,
                   dtype: str = "float32", device: str = "cpu", compiled: bool = False) -> Engine:
    """A backend's model (in ``dtype``, on the adapter's ``device``) and its timed calls (see the module docstring);
    ``compiled`` (PyTorch, :data:`COMPILED`): the model given to ``transformer_torch.compile_decoding``, its cached
    decoding calls alone."""
    model = adapter.build(config, params, dtype, device)
    src, tgt = inputs.forward
    calls: dict[str, Callable[[], object]] = {FORWARD: lambda: adapter.log_probs(model, src, tgt)}
    computes = {FORWARD: "the inference forward pass (adapter.log_probs; JAX's and TF's compiled_forward, with XLA): "
                         "(B, T, V) log-probabilities"}
    cached = adapter.NAME != "numpy"
    if peers and cached:
        calls.update({"greedy batch 1": lambda: adapter.greedy(model, inputs.one),
                      f"greedy batch {PEER_BATCH}": lambda: adapter.greedy(model, inputs.batch),
                      "beam 4 batch 1": lambda: adapter.beam(model, inputs.one)[0]})
        greedy = "greedy_decode with the key/value cache, the model's decoding rules: stops at eos or after source " \
                 "length + 50"
        normalization = {"gnmt": "((5 + |Y|) / 6)^alpha, section 6.1", "hf": "|Y|^alpha, Hugging Face's"}
        decoding = config.decoding
        computes.update({"greedy batch 1": greedy, f"greedy batch {PEER_BATCH}": greedy,
                         "beam 4 batch 1": f"beam_search(beam 4, alpha {decoding.length_penalty}; scores divided by "
                                           f"{normalization[decoding.length_normalization]}) with the key/value "
                                           "cache, the model's decoding rules: up to source length + 50 tokens"})
    if not peers and cached:
        calls["greedy (cached)"] = lambda: adapter.greedy(model, inputs.one, use_cache=True)
        computes["greedy (cached)"] = "greedy_decode with the key/value cache, up to source length + 50 tokens"
    if not peers and uncached and not compiled:
        calls["greedy (uncached)"] = lambda: adapter.greedy(model, inputs.one, use_cache=False)
        computes["greedy (uncached)"] = "greedy_decode recomputing the whole prefix every step"
    if not compiled:
        return Engine(adapter.NAME, "backend", device, calls, computes, ("greedy (uncached)",))
    from transformer_torch import compile_decoding

    compile_decoding(model)
    step = " -- each cached step one program of torch.compile (transformer_torch.compile_decoding)"
    return Engine(COMPILED, "backend", device, {task: calls[task] for task in calls if task != FORWARD},
                  {task: computes[task] + step for task in calls if task != FORWARD})


def peer_engine(peer: Peer, inputs: Inputs, steps: int, alpha: float) -> Engine:
    """A peer's timed calls: forward, greedy batch 1 and PEER_BATCH, beam 4 batch 1 (length penalty ``alpha``) --
    those it has."""
    src, tgt = inputs.forward
    calls: dict[str, Callable[[], object]] = {FORWARD: lambda: peer.forward(src, tgt),
                                              "greedy batch 1": lambda: peer.greedy(inputs.one, steps),
                                              f"greedy batch {PEER_BATCH}": lambda: peer.greedy(inputs.batch, steps)}
    beam = peer.beam
    if beam is not None:
        calls["beam 4 batch 1"] = lambda: beam(inputs.one, steps, BEAM_SIZE, alpha)
    return Engine(peer.NAME, "peer", "cpu", calls, {task: peer.COMPUTES[task.split()[0]] for task in calls},
                  tuple(task for task in calls if task.split()[0] in peer.UNCACHED))


def measurement(config: TransformerConfig, key: tuple[str, str], timing: Timing, kind: str, device: str,
                forward_shape: tuple[int, int, int], source: int) -> Measurement:
    """One cell: the timing, the FLOPs of the work (decoding: the cached count, whatever the engine does)."""
    (name, task), (batch, src_len, tgt_len) = key, forward_shape
    if task == FORWARD:
        flops, tokens = forward_flops(config, batch, src_len, tgt_len), None
    else:
        rows, tokens = ROWS[task], int(np.shape(cast(np.ndarray, timing.result))[1])  # token ids; beam: its beams
        flops = encode_flops(config, rows, source) + decode_flops(config, rows, source, tokens, True)
    return Measurement(name, device, task, timing.median, timing.first, flops, tokens, timing.minimum,
                       timing.maximum, kind, len(timing.times))


def format_bench(report: BenchReport) -> str:
    shapes, anchors = report.shapes, report.anchors
    name, rate = anchors.best_gemm
    others = ", ".join(f"{n} {r:.1f}" for n, r in anchors.gemm_gflops.items() if n != name)
    decoding = (f"greedy decoding of {shapes['decode_tokens']} tokens, batch 1 and {shapes['decode_batch']}; beam "
                f"{shapes['beam_size']} (alpha {shapes['alpha']}), batch 1" if report.peers else
                f"greedy decoding of up to {shapes['decode_tokens']} tokens (batch 1)")
    lines = [f"{report.model}, {shapes['dtype']}; forward batch {shapes['batch']} x {shapes['src_len']} x "
             f"{shapes['tgt_len']}; {decoding}",
             f"machine: {report.machine['cpu']}, {report.machine['cores']} cores",
             f"best float32 GEMM ({MATMUL_SIZE}^2): {rate:.1f} GFLOP/s ({name}{'; ' + others if others else ''})",
             f"memory bandwidth: {anchors.bandwidth_gb_per_s:.1f} GB/s "
             f"({BANDWIDTH_OPERATION.format(mib=BANDWIDTH_MIB)}, median)",
             "(the anchors are timed in every round, with the engines)"]
    first_decoding = next(task for task in anchors.step_bytes)
    lines.append(f"bytes read per decoding step, batch 1: {anchors.step_bytes[first_decoding] / 1e6:.1f} MB -> lower "
                 f"bound {anchors.bound_seconds(first_decoding) * 1e3:.3g} ms/token")
    for task in dict.fromkeys(m.task for m in report.measurements):
        lines += ["", *_task_table(report, task)]
    ratios = [f"{n}: cached decoding {speedup:.1f}x faster per token" for n, speedup in cache_speedups(report)]
    lines += [""] + ratios if ratios else []
    if report.peers:
        lines += ["", "what each timed call computes:"]
        lines += [f"  {', '.join(engines)} -- {', '.join(tasks)}: {text}"
                  for text, (engines, tasks) in _by_text(report.computes).items()]
    lines += [f"{m.name}: {m.reason}" for m in report.missing]
    return "\n".join(lines)


def _task_table(report: BenchReport, task: str) -> list[str]:
    """One task's rows: median and spread, compile time, and the ratios to the anchors and the best peer."""
    forward = task == FORWARD
    unit = "" if forward else (" per token" if ROWS[task] == 1 and "beam" not in task else " per step")
    header = (f"{task}{unit}", "engine", "device", "median", "min-max", "compile",
              "GFLOP/s" if forward else "steps", "of best GEMM" if forward else "x bound")
    lines = [f"{header[0]}", f"  {header[1]:<22}{header[2]:<8}{header[3]:>11}{header[4]:>19}{header[5]:>9}"
             f"{header[6]:>9}{header[7]:>14}{'x best peer' if report.peers else '':>13}".rstrip()]
    for m in (m for m in report.measurements if m.task == task):
        scale = 1e3 / max(1, m.tokens or 0)                                 # forward: no tokens
        ratios = report.ratios(m)
        anchor = f"{ratios['ratio_to_best_gemm']:.0%}" if forward else f"{ratios['ratio_to_bound']:.2f}"
        peer = "" if ratios["ratio_to_best_peer"] is None else f"{ratios['ratio_to_best_peer']:.2f}"
        spread = f"{m.min_seconds * scale:.1f}-{m.max_seconds * scale:.1f} ms"
        lines.append(f"  {m.backend:<22}{m.device:<8}{m.unit_seconds * 1e3:>9.2f}ms{spread:>19}"
                     f"{m.compile_seconds:>8.2f}s{m.gflops if forward else m.tokens:>9.{1 if forward else 0}f}"
                     f"{anchor:>14}{peer:>13}".rstrip())
    return lines


def _by_text(computes: dict[str, dict[str, str]]) -> dict[str, tuple[list[str], list[str]]]:
    """engine -> {task: text} as text -> (the engines, the tasks) that share it, in order."""
    grouped: dict[str, tuple[list[str], list[str]]] = {}
    for engine, texts in computes.items():
        for task, text in texts.items():
            engines, tasks = grouped.setdefault(text, ([], []))
            engines += [engine] if engine not in engines else []
            tasks += [task] if task not in tasks else []
    return grouped


def cache_speedups(report: BenchReport) -> list[tuple[str, float]]:
    """Per backend: uncached over cached time per decoded token."""
    by_key = {(m.backend, m.task): m for m in report.measurements}
    speedups = []
    for name in dict.fromkeys(m.backend for m in report.measurements):
        cached, uncached = by_key.get((name, "greedy (cached)")), by_key.get((name, "greedy (uncached)"))
        if cached and uncached:
            speedups.append((name, uncached.unit_seconds / cached.unit_seconds))
    return speedups
