"""Entry point of ``transformer-reference``.

    transformer-reference compare [CHECKPOINT] [--json] [--plot FILE.png]
    transformer-reference init OUT.safetensors [--preset tiny] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
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

    names = tuple(name for name in args.backends.split(",") if name)
    report = compare(args.checkpoint, names, args.perturb,
                     progress=lambda plan: tqdm(plan, desc="compare", unit="run", file=sys.stderr,
                                                disable=args.json or not sys.stderr.isatty()))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_table(report))
    if args.plot:
        plot_errors(report, args.plot)
    return 0 if report.ok else 1


def run_init(args) -> int:
    config = TransformerConfig.preset(args.preset)
    save_checkpoint(args.out, config, init_params(config, seed=args.seed, dtype=np.dtype(args.dtype)))
    print(f"wrote {args.out}: {args.preset} preset, seed {args.seed}, {args.dtype}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"compare": run_compare, "init": run_init}[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
