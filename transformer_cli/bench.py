"""``bench``: forward pass and greedy decoding (cached and uncached) of every installed backend on
the same weights and inputs; warm-up excluded, compile time reported separately.

FLOPs are counted analytically (2 per multiply-add of every matrix product, see
:mod:`transformer_cli.timing`); achieved GFLOP/s are compared with this machine's float32
matrix-multiply rate, measured in NumPy by :func:`transformer_cli.timing.matmul_rate`.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass

import numpy as np

from reference_numpy import TransformerConfig, init_params
from reference_numpy.decoding import EXTRA_OUTPUT_LENGTH

from . import backends
from .timing import cpu_name, decode_flops, encode_flops, forward_flops, gflop_rate, matmul_rate, measure, numpy_product

MATMUL_SIZE = 2048
MATMUL_REPEATS = 5


@dataclass
class Measurement:
    backend: str
    device: str
    task: str                  # "forward", "greedy (cached)", "greedy (uncached)"
    seconds: float             # median of the timed repeats
    first_call_seconds: float  # the warm-up call: includes tracing/compilation
    flops: float
    tokens: int | None = None  # decoded tokens (greedy)

    @property
    def compile_seconds(self) -> float:
        return max(0.0, self.first_call_seconds - self.seconds)

    @property
    def gflops(self) -> float:
        return gflop_rate(self.flops, self.seconds)


@dataclass
class BenchReport:
    preset: str
    shapes: dict
    machine: dict
    matmul_gflops: float
    measurements: list[Measurement]
    missing: list

    def to_json(self) -> dict:
        return {"preset": self.preset, "shapes": self.shapes, "machine": self.machine,
                "matmul_gflops": self.matmul_gflops, "missing": [asdict(m) for m in self.missing],
                "measurements": [{**asdict(m), "compile_seconds": m.compile_seconds, "gflops": m.gflops,
                                  "fraction_of_matmul_rate": m.gflops / self.matmul_gflops}
                                 for m in self.measurements]}


def machine_description() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__}


def bench_inputs(config: TransformerConfig, batch: int, src_len: int, tgt_len: int, decode_tokens: int):
    """Seeded token ids: a (batch, src_len) source and (batch, tgt_len) target for the forward
    pass, and one source sentence of decode_tokens - EXTRA_OUTPUT_LENGTH tokens (section 6.1's budget:
    source length + 50) to decode."""
    rng = np.random.default_rng(0)
    first = max(config.pad_id, config.bos_id, config.eos_id) + 1
    src = rng.integers(first, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(first, config.tgt_vocab_size, size=(batch, tgt_len))
    tgt[:, 0] = config.bos_id
    decode_src = rng.integers(first, config.src_vocab_size, size=(1, max(1, decode_tokens - EXTRA_OUTPUT_LENGTH)))
    return src, tgt, decode_src


def bench(preset: str = "base", batch: int = 8, src_len: int = 128, tgt_len: int = 128, decode_tokens: int = 128,
          names: tuple[str, ...] = backends.BACKENDS, repeats: int = 3, uncached: bool = True,
          progress=None) -> BenchReport:
    """Time every installed backend (float32, first device of each) on one seeded checkpoint."""
    config = TransformerConfig.preset(preset)
    for flag, length in (("--src-len", src_len), ("--tgt-len", tgt_len), ("--decode-tokens", decode_tokens)):
        if length > config.max_len:
            raise ValueError(f"{flag} {length} exceeds the {preset} preset's max_len ({config.max_len})")
    adapters, missing = backends.load(tuple(names))
    backends.require_any(tuple(names), adapters, missing)
    params = init_params(config, seed=0, dtype=np.float32)
    src, tgt, decode_src = bench_inputs(config, batch, src_len, tgt_len, decode_tokens)
    tasks = []
    for adapter in adapters.values():
        tasks.append((adapter, "forward"))
        if adapter.NAME != "numpy":
            tasks.append((adapter, "greedy (cached)"))
        if uncached:
            tasks.append((adapter, "greedy (uncached)"))
    rate = matmul_rate(numpy_product(MATMUL_SIZE), MATMUL_SIZE, MATMUL_REPEATS)
    models = {}
    measurements = []
    for adapter, task in (progress(tasks) if progress else tasks):
        device = adapter.devices()[0]
        if adapter.NAME not in models:
            models[adapter.NAME] = adapter.build(config, params, "float32", device)
        model = models[adapter.NAME]
        if task == "forward":
            timing = measure(lambda: adapter.forward(model, src, tgt), repeats)
            measurements.append(Measurement(adapter.NAME, device, task, timing.median, timing.first,
                                            forward_flops(config, batch, src_len, tgt_len)))
            continue
        cached = task == "greedy (cached)"
        timing = measure(lambda: adapter.greedy(model, decode_src, use_cache=cached), 1 if not cached else repeats)
        steps, source = int((np.asarray(timing.result) != config.pad_id).sum()), decode_src.shape[1]
        flops = encode_flops(config, 1, source) + decode_flops(config, 1, source, steps, cached)
        measurements.append(Measurement(adapter.NAME, device, task, timing.median, timing.first, flops, steps))
    shapes = {"batch": batch, "src_len": src_len, "tgt_len": tgt_len, "decode_tokens": decode_tokens,
              "dtype": "float32"}
    return BenchReport(preset, shapes, machine_description(), rate, measurements, missing)


def format_bench(report: BenchReport) -> str:
    shapes = report.shapes
    lines = [f"preset {report.preset}, float32; forward batch {shapes['batch']} x {shapes['src_len']} x "
             f"{shapes['tgt_len']}; greedy decoding of up to {shapes['decode_tokens']} tokens (batch 1)",
             f"machine: {report.machine['cpu']}, {report.machine['cores']} cores; "
             f"measured float32 matmul rate (NumPy, {MATMUL_SIZE}^2): {report.matmul_gflops:.1f} GFLOP/s", "",
             f"{'backend':<8}{'device':<8}{'task':<19}{'time':>11}{'compile':>10}{'tokens':>8}{'GFLOP/s':>10}"
             f"{'of matmul':>11}"]
    for m in report.measurements:
        lines.append(f"{m.backend:<8}{m.device:<8}{m.task:<19}{m.seconds * 1e3:>9.1f}ms{m.compile_seconds:>9.2f}s"
                     f"{'' if m.tokens is None else m.tokens:>8}{m.gflops:>10.1f}"
                     f"{m.gflops / report.matmul_gflops:>10.0%}")
    ratios = [f"{name}: cached decoding {speedup:.1f}x faster per token" for name, speedup in cache_speedups(report)]
    lines += [""] + ratios if ratios else []
    lines += [f"{m.name}: {m.reason}" for m in report.missing]
    return "\n".join(lines)


def cache_speedups(report: BenchReport) -> list[tuple[str, float]]:
    """Per backend: uncached over cached time per decoded token."""
    by_key = {(m.backend, m.task): m for m in report.measurements}
    speedups = []
    for name in dict.fromkeys(m.backend for m in report.measurements):
        cached, uncached = by_key.get((name, "greedy (cached)")), by_key.get((name, "greedy (uncached)"))
        if cached and uncached:
            per_token = lambda run: run.seconds / max(1, run.tokens)
            speedups.append((name, per_token(uncached) / per_token(cached)))
    return speedups


def plot_bench(report: BenchReport, path) -> None:
    """Two bar charts: forward GFLOP/s per backend against the matmul rate, and time per decoded
    token, cached and uncached."""
    from .plots import pyplot
    plt = pyplot()
    names = list(dict.fromkeys(m.backend for m in report.measurements))
    find = {(m.backend, m.task): m for m in report.measurements}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    left.bar(names, [find[(n, "forward")].gflops if (n, "forward") in find else 0 for n in names], color="tab:blue")
    left.axhline(report.matmul_gflops, color="black", linestyle="--", label="float32 matmul rate (NumPy)")
    left.set_ylabel("achieved GFLOP/s")
    left.set_title(f"forward, batch {report.shapes['batch']} x {report.shapes['src_len']} x {report.shapes['tgt_len']}")
    left.legend(fontsize="small", loc="lower right")
    width = 0.4
    for offset, task, color in ((-width / 2, "greedy (uncached)", "tab:orange"),
                                (width / 2, "greedy (cached)", "tab:green")):
        per_token = [1e3 * find[(n, task)].seconds / max(1, find[(n, task)].tokens) if (n, task) in find else 0
                     for n in names]
        right.bar(np.arange(len(names)) + offset, per_token, width, label=task, color=color)
    right.set_xticks(range(len(names)), names)
    right.set_ylabel("ms per decoded token")
    right.set_title(f"greedy decoding, {report.shapes['decode_tokens']} tokens, batch 1")
    right.legend(fontsize="small")
    fig.suptitle(f"{report.preset} preset, float32 ({report.machine['cpu']}, {report.machine['cores']} cores)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
