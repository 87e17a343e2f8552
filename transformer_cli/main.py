"""Entry point of ``transformer-reference``.

    transformer-reference compare [CHECKPOINT] [--json] [--plot FILE.png]
    transformer-reference bench [--preset base] [--json] [--plot FILE.png]
    transformer-reference plot pe [--length 100] [--d-model 512] [--out pe.png]
    transformer-reference plot attention [CHECKPOINT] [--layer 0] [--head 0] [--kind encoder] [--out attention.png]
    transformer-reference init OUT.safetensors [--preset tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from reference_numpy import TransformerConfig, init_params, save_checkpoint

from . import backends


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transformer-reference",
                                     description="The Transformer of 'Attention Is All You Need' in NumPy, PyTorch, "
                                                 "JAX/Flax and TensorFlow/Keras, checked against one reference.")
    commands = parser.add_subparsers(dest="command", required=True)

    compare = commands.add_parser("compare", help="every installed backend vs the NumPy reference, stage by stage")
    compare.add_argument("checkpoint", nargs="?", help="a shared safetensors checkpoint (default: seeded base preset)")
    compare.add_argument("--backends", default=",".join(backends.PORTS),
                         help=f"comma-separated subset of {','.join(backends.PORTS)} (default: all)")
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    compare.add_argument("--plot", metavar="FILE.png", help="draw the error per stage per backend")
    compare.add_argument("--perturb", metavar="BACKEND:TENSOR",
                         help="change one tensor of one backend by 1e-6 to see where the comparison catches it")

    bench = commands.add_parser("bench", help="time forward and greedy decoding of every installed backend")
    bench.add_argument("--preset", default="base", help="base, big or tiny (default: base)")
    bench.add_argument("--batch", type=int, default=8)
    bench.add_argument("--src-len", type=int, default=128)
    bench.add_argument("--tgt-len", type=int, default=128)
    bench.add_argument("--decode-tokens", type=int, default=128, help="greedy decoding budget (batch 1)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats after the warm-up (median)")
    bench.add_argument("--no-uncached", action="store_true", help="skip the (slow) uncached decoding")
    bench.add_argument("--backends", default=",".join(backends.BACKENDS))
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="bar chart of achieved GFLOP/s")

    plot = commands.add_parser("plot", help="draw the positional encoding or attention weights")
    pictures = plot.add_subparsers(dest="picture", required=True)
    pe = pictures.add_parser("pe", help="heat map of the sinusoidal positional-encoding table (section 3.5)")
    pe.add_argument("--length", type=int, default=100)
    pe.add_argument("--d-model", type=int, default=512)
    pe.add_argument("--out", default="pe.png")
    attention = pictures.add_parser("attention", help="attention weights of one layer and head, per backend")
    attention.add_argument("checkpoint", nargs="?", help="a shared checkpoint (default: seeded base preset)")
    attention.add_argument("--layer", type=int, default=0)
    attention.add_argument("--head", type=int, default=0)
    attention.add_argument("--kind", default="encoder", choices=["encoder", "decoder_self", "decoder_cross"])
    attention.add_argument("--src", help="source token ids, space-separated (default: a fixed sentence)")
    attention.add_argument("--tgt", help="target token ids starting with bos (default: a fixed sentence)")
    attention.add_argument("--backends", default=",".join(backends.BACKENDS),
                           help="one backend, or several side by side (default: every installed one)")
    attention.add_argument("--out", default="attention.png")

    init = commands.add_parser("init", help="write a seeded checkpoint (docs/checkpoint-format.md)")
    init.add_argument("out", help="output .safetensors path")
    init.add_argument("--preset", default="tiny", help="base, big or tiny (default: tiny)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    return parser


def run_compare(args) -> int:
    from tqdm import tqdm

    from .compare import compare
    from .report import format_table, plot_errors

    report = compare(args.checkpoint, _names(args.backends), args.perturb,
                     progress=lambda plan: tqdm(plan, desc="compare", unit="run", file=sys.stderr,
                                                disable=args.json or not sys.stderr.isatty()))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_table(report))
    if args.plot:
        plot_errors(report, args.plot)
    return 0 if report.ok else 1


def run_bench(args) -> int:
    from tqdm import tqdm

    from .bench import bench, format_bench, plot_bench

    report = bench(args.preset, args.batch, args.src_len, args.tgt_len, args.decode_tokens,
                   _names(args.backends), args.repeats, not args.no_uncached,
                   progress=lambda tasks: tqdm(tasks, desc="bench", unit="task", file=sys.stderr,
                                               disable=args.json or not sys.stderr.isatty()))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_bench(report))
    if args.plot:
        plot_bench(report, args.plot)
    return 0


def run_plot(args) -> int:
    from . import plots

    if args.picture == "pe":
        plots.plot_positional_encoding(args.length, args.d_model, args.out)
    else:
        from .attention import attention_by_backend
        weights, query_tokens, key_tokens, title = attention_by_backend(
            args.checkpoint, args.layer, args.head, args.kind, args.src, args.tgt, _names(args.backends))
        plots.plot_attention(weights, query_tokens, key_tokens, title, args.out)
    print(f"wrote {args.out}")
    return 0


def _names(text: str) -> tuple[str, ...]:
    return tuple(name for name in text.split(",") if name)


def run_init(args) -> int:
    config = TransformerConfig.preset(args.preset)
    save_checkpoint(args.out, config, init_params(config, seed=args.seed, dtype=np.dtype(args.dtype)))
    print(f"wrote {args.out}: {args.preset} preset, seed {args.seed}, {args.dtype}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow info logs (all but its pre-init oneDNN notice)
    args = build_parser().parse_args(argv)
    try:
        return {"compare": run_compare, "bench": run_bench, "plot": run_plot, "init": run_init}[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
