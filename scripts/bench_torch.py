"""Benchmark of the PyTorch port (float32, CPU or the first GPU).

1. Forward pass, ``base`` preset, batch 8 x 128 source x 128 target tokens: the port vs
   ``torch.nn.Transformer`` holding the same weights (``transformer_torch.interop``; eval mode
   and inference mode, so torch takes its encoder fast path).
2. Greedy decoding forced to run every step (eos ignored): the port with its key/value cache,
   the port recomputing the prefix, and ``nn.Transformer`` (which has no cache) at 128 tokens;
   the port cached vs uncached at 256 tokens, with the per-token time at several lengths.
3. Beam search (beam 4, alpha 0.6) of one 78-token source: at most 128 steps.
4. Where the forward pass's and a cached greedy step's time go (``torch.profiler``): the linear layers, attention, the
   rest; and the output projection (37000 x 512) for one row by ``F.linear`` (the BLAS torch is
   built with) and by the port's ``_linear`` (oneDNN's inner product), and every weight a cached
   step reads, one row each, back to back (the step's products alone), with the weight bytes read
   per second.
5. The same weights' products for ``--rows`` rows at once (a batched beam search's step: 16 sentences x beam 4 by
   default), in GFLOP/s, by four kernels: the port's ``_linear``, ``F.linear``, ``torch.addmm`` on a copy of the
   weight stored (in, out), and MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on the weight packed once for that
   row count, as Inductor's freezing packs it), where torch has it.

Times are medians over ``--repeats`` runs after a warm-up run. GFLOP/s count the matrix
products only (formulas printed). The timed part holds an exclusive lock on /tmp/bench.lock
so that benchmarks of workers sharing the machine do not overlap; the script takes the lock
itself (do not also wrap it in ``flock``):

    python scripts/bench_torch.py [--quick] [--threads N] [--decode-batch B] [--write docs/results/DATE-bench-torch.md]

``--write`` writes the report as a result file (docs/benchmarks-torch.md cites the latest); an existing file is
refused, never replaced.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference_numpy import TransformerConfig, init_params  # noqa: E402
from transformer_bench.timing import (  # noqa: E402
    bench_lock,
    cpu_name,
    decode_flops,
    forward_flops,
    gflop_rate,
    measure,
    read_every_step,
    timed,
)
from transformer_torch import checkpoint, interop  # noqa: E402
from transformer_torch.decoding import beam_search, next_token_log_probs  # noqa: E402
from transformer_torch.device import devices, full_precision  # noqa: E402
from transformer_torch.model import _linear, padding_mask  # noqa: E402

PROFILED_STEPS = 20
PROFILED_FORWARDS = 3
FORWARD_FLOPS = ("forward FLOPs = 2 x [N_enc (4 B S D^2 + 2 B S^2 D + 2 B S D F) + N_dec (6 B T D^2 + 2 B S D^2 "
                 "+ 2 B T^2 D + 2 B T S D + 2 B T D F) + B T D V]")
STEP_FLOPS = ("cached step t FLOPs = 2 x [N_dec (6 B D^2 + 2 B t D + 2 B S D + 2 B D F) + B D V] "
              "(+ 2 x N_dec 2 B S D^2 once for the memory's keys/values); uncached step t: the forward's decoder "
              "terms with T = t, plus B D V")


def synchronized(result):
    """``result`` once the GPU, if any, has finished computing it (CUDA runs asynchronously)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result


def forced_greedy(step, steps: int, bos: int, batch: int, device) -> list[float]:
    """Run ``steps`` greedy steps ignoring eos; returns each step's wall time."""
    tgt = synchronized(torch.full((batch, 1), bos, dtype=torch.long, device=device))
    times = []
    for _ in range(steps):
        seconds, token = timed(lambda: synchronized(step(tgt).argmax(dim=-1)))
        times.append(seconds)
        tgt = synchronized(torch.cat([tgt, token[:, None]], dim=1))
    return times


def first_device() -> str:
    """The first GPU when one is visible, else "cpu"."""
    return devices()[1] if len(devices()) > 1 else "cpu"


def machine() -> list[str]:
    return [f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs visible",
            f"Python {platform.python_version()}, torch {torch.__version__}, NumPy {np.__version__}",
            f"torch threads: {torch.get_num_threads()}, device: {first_device()}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shorter decodes")
    parser.add_argument("--write", type=Path, help="also write the report (Markdown) to this file")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--decode-batch", type=int, default=1, help="sentences decoded at once (default 1)")
    parser.add_argument("--rows", type=int, default=64,
                        help="rows of the products timed by kernel (default 64: 16 sentences x beam 4)")
    args = parser.parse_args()
    if args.write is not None and args.write.exists():
        parser.error(f"--write: {args.write} exists; a result file is never replaced")
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else 5
    batch, src_len, tgt_len = (2, 32, 32) if args.quick else (8, 128, 128)
    lengths = (16, 32) if args.quick else (128, 256)
    decode_batch, decode_repeats = args.decode_batch, (1 if args.quick else 3)

    device = first_device()
    if device.startswith("cuda"):
        full_precision()
    config = TransformerConfig.preset("base")
    model = checkpoint.from_params(config, init_params(config, seed=0, dtype=np.float32), torch.float32, device)
    wrapper = interop.to_nn_transformer(model)
    rng = np.random.default_rng(0)
    src = torch.as_tensor(rng.integers(3, config.src_vocab_size, (batch, src_len)), device=device)
    tgt = torch.as_tensor(rng.integers(3, config.tgt_vocab_size, (batch, tgt_len)), device=device)
    tgt[:, 0] = config.bos_id
    dec_src = src[:decode_batch]
    dec_mask = padding_mask(dec_src, config.pad_id)

    lines = ["# PyTorch port benchmark", "", *(f"* {line}" for line in machine()),
             f"* command: `python {' '.join(sys.argv)}` "
             f"(median of {repeats} runs after a warm-up run; float32; eval + inference mode)",
             f"* {FORWARD_FLOPS}", f"* {STEP_FLOPS}", ""]
    rows = []
    with bench_lock(), torch.inference_mode():
        flops = forward_flops(config, batch, src_len, tgt_len)
        ours = measure(lambda: synchronized(model(src, tgt)), repeats)
        theirs = measure(lambda: synchronized(wrapper(src, tgt)), repeats)
        diff = float((ours.result - theirs.result).abs().max())
        ratio = ours.median / theirs.median
        rows.append((f"forward B={batch} S={src_len} T={tgt_len}: port", ours.median, flops, ""))
        rows.append(("forward: nn.Transformer (same weights)", theirs.median, flops, f"port/nn time ratio {ratio:.2f}"))

        memory = model.encode(dec_src, dec_mask)
        nn_memory = wrapper.encode(dec_src, dec_mask)
        per_token, speed_ups = {}, {}
        for steps in lengths:
            runs = {}
            for name, make_step in {
                "port cached": lambda: _cached_step(model, memory, dec_mask, steps),
                "port uncached": lambda: (lambda t: next_token_log_probs(model, t, memory, dec_mask)),
                "nn.Transformer (no cache)": lambda: (lambda t: wrapper.generator(
                    wrapper.decode(t, nn_memory, dec_mask)[:, -1:])[:, 0]),
            }.items():
                if name.startswith("nn") and steps != lengths[0]:
                    continue
                run = lambda n: forced_greedy(make_step(), n, config.bos_id, decode_batch, device)
                runs[name] = measure(lambda: run(steps), decode_repeats, warm_up=lambda: run(8))
                seconds, step_times = runs[name].median, runs[name].result
                flops = decode_flops(config, decode_batch, src_len, steps, name == "port cached")
                rows.append((f"greedy {steps} tokens, B={decode_batch}: {name}", seconds, flops,
                             f"{1e3 * seconds / steps:.2f} ms/token"))
                per_token[(name, steps)] = step_times
            speed_ups[steps] = runs["port uncached"].median / runs["port cached"].median
            rows.append((f"greedy {steps} tokens: uncached / cached", None, None, f"speed-up {speed_ups[steps]:.1f}x"))

        beam_src = src[:1, :lengths[0] - 50] if lengths[0] > 50 else src[:1, :8]   # max output length = S + 50
        beam = measure(lambda: beam_search(model, beam_src), decode_repeats)
        rows.append((f"beam search, beam 4, alpha 0.6, S={beam_src.shape[1]}", beam.median, None,
                     f"{beam.result[0].shape[1]} steps, {1e3 * beam.median / beam.result[0].shape[1]:.2f} ms/step"))
        profile = [*forward_profile(model, src, tgt), "", *step_profile(model, memory, dec_mask)]
        kernels = [*projection_kernels(model, device, repeats), "", *kernel_rates(model, device, args.rows, repeats)]

    lines += ["| what | median time | GFLOP/s | note |", "|---|---:|---:|---|"]
    for what, seconds, flops, note in rows:
        time_s = "" if seconds is None else f"{seconds * 1e3:.1f} ms"
        rate = "" if flops is None else f"{gflop_rate(flops, seconds):.1f}"
        lines.append(f"| {what} | {time_s} | {rate} | {note} |")
    lines += ["", f"Forward outputs, port vs nn.Transformer: max abs difference {diff:.2e} (float32).", "",
              "Per-token time (ms, median over the 8 steps ending at that length):", "",
              "| decoder | " + " | ".join(str(n) for n in _checkpoints(lengths[-1])) + " |",
              "|---|" + "---:|" * len(_checkpoints(lengths[-1]))]
    for (name, steps), times in per_token.items():
        if steps == lengths[-1]:
            cells = [f"{1e3 * statistics.median(times[n - 8:n]):.2f}" for n in _checkpoints(steps)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *profile, "", *kernels]
    lines += ["", *targets(rows, per_token, speed_ups[lengths[-1]], lengths[-1]), "",
              "Timings are wall-clock on a machine whose cores may be shared with other jobs; the lock only "
              "keeps benchmarks apart, so expect noise between steps of one run (see the per-token table)."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.write:
        with args.write.open("x") as file:                   # "x": an existing result file is never replaced
            file.write(report)


def forward_profile(model, src, tgt) -> list[str]:
    """Where the forward pass's time goes, from ``torch.profiler`` over ``PROFILED_FORWARDS`` calls: the linear
    layers (their FLOPs and rate), attention, the log-softmax, and everything else."""
    synchronized(model(src, tgt))                                                        # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_FORWARDS):
            synchronized(model(src, tgt))
    kinds = {"linear layers": ("linear_pointwise", "addmm", "aten::mm"), "attention": ("scaled_dot_product",),
             "log-softmax": ("_log_softmax",)}
    events = prof.key_averages()
    parts = {kind: sum(event.self_cpu_time_total for event in events if any(name in event.key for name in names))
             / 1e6 / PROFILED_FORWARDS for kind, names in kinds.items()}
    total = sum(event.self_cpu_time_total for event in events) / 1e6 / PROFILED_FORWARDS
    parts["everything else"] = total - sum(parts.values())
    config, (batch, src_len), tgt_len = model.config, src.shape, tgt.shape[1]
    linear_flops = forward_flops(config, batch, src_len, tgt_len) - attention_flops(config, batch, src_len, tgt_len)
    notes = {"linear layers": f"{linear_flops / 1e9:.1f} GFLOP, {gflop_rate(linear_flops, parts['linear layers']):.0f}"
                              " GFLOP/s", "attention": "SDPA kernels", "log-softmax": "over the vocabulary",
             "everything else": "other kernels, Python, dispatch"}
    return [f"Forward pass, B={batch} S={src_len} T={tgt_len} (torch.profiler over {PROFILED_FORWARDS} calls; "
            f"{1e3 * total:.1f} ms per call, profiler included):", "", "| part | ms per call | share | note |",
            "|---|---:|---:|---|", *(f"| {kind} | {1e3 * value:.1f} | {value / total:.0%} | {notes[kind]} |"
                                     for kind, value in parts.items())]


def attention_flops(config, batch: int, src_len: int, tgt_len: int) -> int:
    """The attention products' FLOPs of a forward pass (Q K^T and weights V; 2 per multiply-add): the
    encoder's self-attention, the decoder's self- and encoder-decoder attention."""
    d = config.d_model
    return 2 * 2 * batch * d * (config.n_encoder_layers * src_len * src_len
                                + config.n_decoder_layers * (tgt_len * tgt_len + tgt_len * src_len))


def step_profile(model, memory, src_mask) -> list[str]:
    """Where the time of a cached greedy step goes, from ``torch.profiler`` over ``PROFILED_STEPS`` steps: the
    linear layers (the weights they read per step, and at what rate), attention, and everything else."""
    batch, bos = len(memory), model.config.bos_id
    step = _cached_step(model, memory, src_mask, PROFILED_STEPS + 4)
    forced_greedy(step, 4, bos, batch, memory.device)                                    # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        times = forced_greedy(step, PROFILED_STEPS, bos, batch, memory.device)
    kinds = {"linear layers": ("linear_pointwise", "addmm", "aten::mm"), "attention": ("scaled_dot_product",)}
    parts = {kind: sum(event.self_cpu_time_total for event in prof.key_averages()
                       if any(name in event.key for name in names)) / 1e6 / PROFILED_STEPS
             for kind, names in kinds.items()}
    per_step, weights = sum(times) / PROFILED_STEPS, step_weight_bytes(model)
    parts["everything else"] = per_step - sum(parts.values())
    notes = {"linear layers": f"{weights / 1e6:.1f} MB of weights read per step, "
                              f"{weights / parts['linear layers'] / 1e9:.1f} GB/s",
             "attention": "SDPA kernels", "everything else": "other kernels, Python, dispatch"}
    return [f"Cached greedy step, B={batch} (torch.profiler over {PROFILED_STEPS} steps; {1e3 * per_step:.2f} ms "
            "per step, profiler included):", "", "| part | ms per step | share | note |", "|---|---:|---:|---|",
            *(f"| {kind} | {1e3 * value:.2f} | {value / per_step:.0%} | {notes[kind]} |"
              for kind, value in parts.items())]


def step_weight_bytes(model) -> int:
    """Bytes of weights one cached decoding step reads: every decoder projection but the encoder-decoder
    attention's keys and values (projected once per sentence), and the output projection."""
    decoder = sum(p.numel() * p.element_size() for name, p in model.decoder.named_parameters()
                  if p.dim() == 2 and read_every_step(f"decoder.{name}"))
    return decoder + output_projection(model).numel() * output_projection(model).element_size()


def output_projection(model) -> torch.Tensor:
    """The generator's (V, D) weight: its own, or the shared embedding."""
    return model.generator.weight if model.generator.embeddings is None else model.generator.embeddings.weight


def projection_kernels(model, device, repeats: int) -> list[str]:
    """One row through the output projection (V x D): ``F.linear`` vs the port's ``_linear``; weight bytes per
    second."""
    weight = output_projection(model)
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=device)
    lines = [f"Output projection {tuple(weight.shape)} x one row (median of {10 * repeats} calls):", "",
             "| kernel | median time | weight read rate |", "|---|---:|---:|"]
    for name, kernel in (("F.linear (torch's BLAS)", torch.nn.functional.linear), ("the port's _linear", _linear)):
        run = measure(lambda: synchronized(kernel(x, weight)), 10 * repeats)
        rate = weight.numel() * weight.element_size() / run.median / 1e9
        lines.append(f"| {name} | {1e3 * run.median:.2f} ms | {rate:.1f} GB/s |")
    step = step_products(model, device)
    run = measure(lambda: synchronized(step()), 10 * repeats)
    lines.append(f"| every weight a step reads ({step_weight_bytes(model) / 1e6:.1f} MB), one row each, back to back, "
                 f"the port's _linear | {1e3 * run.median:.2f} ms | {step_weight_bytes(model) / run.median / 1e9:.1f} "
                 "GB/s |")
    return lines


def kernel_rates(model, device, rows: int, repeats: int) -> list[str]:
    """Each distinct weight shape of a cached step (:func:`step_layers` and the output projection) times ``rows`` rows,
    with a bias, in GFLOP/s (median of ``10 * repeats`` calls) by each kernel of :func:`product_kernels`."""
    shapes = [*dict.fromkeys(tuple(module.weight.shape) for module in step_layers(model)),
              tuple(output_projection(model).shape)]
    lines = [f"A step's products for {rows} rows, by kernel (GFLOP/s, median of {10 * repeats} calls):", ""]
    table = {}
    for out, width in shapes:
        weight, bias = torch.randn(out, width, device=device), torch.randn(out, device=device)
        x = torch.randn(rows, width, device=device)
        exact = x.double() @ weight.double().t() + bias.double()
        bound = (width + 1) * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t() + bias.double().abs())
        for name, kernel in product_kernels(weight, bias, rows).items():
            error = (kernel(x).double() - exact).abs()
            assert bool((error <= bound).all()), f"{name}: off the exact product beyond float32's GEMM bound"
            seconds = measure(lambda: synchronized(kernel(x)), 10 * repeats).median
            table.setdefault(name, {})[(out, width)] = gflop_rate(2 * rows * width * out, seconds)
    lines += ["| kernel | " + " | ".join(f"{rows} x {width} -> {out}" for out, width in shapes) + " |",
              "|---|" + "---:|" * len(shapes)]
    lines += [f"| {name} | " + " | ".join(f"{rate:.1f}" for rate in rates.values()) + " |"
              for name, rates in table.items()]
    return lines


def product_kernels(weight: torch.Tensor, bias: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor],
                                                                                              torch.Tensor]]:
    """x W^T + b by the port's ``_linear`` (oneDNN's inner product on the CPU), ``F.linear`` (torch's BLAS on the
    (out, in) weight), ``torch.addmm`` on a copy stored (in, out), and, on a CPU whose torch has it, MKL's GEMM on
    the weight packed for ``rows`` rows."""
    transposed = weight.t().contiguous()                                  # (in, out)
    kernels = {"the port's _linear": lambda x: _linear(x, weight, bias),
               "F.linear, weight (out, in)": lambda x: torch.nn.functional.linear(x, weight, bias),
               "torch.addmm, weight (in, out)": lambda x: torch.addmm(bias, x, transposed)}
    if weight.is_cpu and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        kernels["MKL packed GEMM"] = lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    return kernels


def step_layers(model) -> list[torch.nn.Linear]:
    """The decoder's linear layers a cached step reads (:func:`read_every_step`), in order."""
    return [module for name, module in model.decoder.named_modules()
            if isinstance(module, torch.nn.Linear) and read_every_step(f"decoder.{name}")]


def step_products(model, device):
    """A call that runs one row through every weight a cached step reads (:func:`step_weight_bytes`), with its
    bias, by the port's ``_linear``: the step's matrix-vector products alone."""
    layers = step_layers(model)
    weight = output_projection(model)
    rows = {n: torch.randn(1, n, dtype=weight.dtype, device=device) for n in {m.in_features for m in layers}}
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=device)

    def run():
        with torch.inference_mode():
            for module in layers:
                _linear(rows[module.in_features], module.weight, module.bias)
            return _linear(x, weight)
    return run


def _cached_step(model, memory, src_mask, steps: int):
    """A step function over a fresh cache of ``steps`` positions: feeds the last position of ``tgt``."""
    cache = model.init_cache(memory, steps)

    def step(tgt):
        nonlocal cache
        log_probs, cache = next_token_log_probs(model, tgt[:, -1:], memory, src_mask, cache, tgt.shape[1] - 1)
        return log_probs
    return step


def _checkpoints(steps: int) -> list[int]:
    return [n for n in (16, 32, 64, 128, 192, 256) if n <= steps]


def targets(rows, per_token, speed_up: float, longest: int) -> list[str]:
    """The issue's targets, checked on the measured numbers."""
    forward_port, forward_nn = rows[0][1], rows[1][1]
    cached = per_token[("port cached", longest)]
    first, last = statistics.median(cached[8:16]), statistics.median(cached[longest - 8:])
    verdict = lambda ok: "met" if ok else "NOT met"
    return ["## Targets", "",
            f"* forward no slower than torch.nn.Transformer: port/nn time ratio {forward_port / forward_nn:.2f} "
            f"-> {verdict(forward_port <= forward_nn)}",
            f"* cached decoding >= 5x faster than uncached at {longest} tokens: {speed_up:.1f}x "
            f"-> {verdict(speed_up >= 5)}",
            f"* per-token time flat with the cache: {1e3 * first:.2f} ms at 16 tokens, {1e3 * last:.2f} ms at "
            f"{longest} tokens (ratio {last / first:.2f}) -> {verdict(last / first <= 1.5)} "
            "(flat = within 1.5x; the attention over t cached keys is the only length-dependent term)"]


if __name__ == "__main__":
    main()
