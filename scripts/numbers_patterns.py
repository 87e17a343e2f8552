"""How the shipped model (or any numbers-task checkpoint) translates each kind of number: exact match per zero
pattern (``transformer_tasks.numbers.zero_pattern``: ``x00,00x`` is "one hundred thousand and two"), in every
backend, greedy decoding, over the test split's numbers of the pattern and over a seeded sample of all numbers of the
pattern (which may hold numbers seen in training: the test split, a uniform sample, holds few numbers of the rare
patterns). Prints a Markdown table (docs/training.md, the model card) or ``--json``.

    python scripts/numbers_patterns.py [--checkpoint numbers-en-fr] [--backends numpy,torch,jax,tf]
                                       [--per-pattern 100] [--dtype float32] [--json]

Exit status 0 when every pattern scores at least ``--at-least`` (default 0.99) in every backend on both sets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends  # noqa: E402
from transformer_tasks.numbers import SPLIT_SEED, NumbersTask, english, french, patterns, zero_pattern  # noqa: E402
from transformer_tasks.translation import SHIPPED, translator  # noqa: E402


def sets(per_pattern: int) -> dict[str, dict[str, np.ndarray]]:
    """For each pattern, the test split's numbers of it and a seeded sample of ``per_pattern`` of all of it."""
    test = NumbersTask().split.test
    rng = np.random.Generator(np.random.PCG64(SPLIT_SEED))
    found = {}
    for pattern, numbers in sorted(patterns().items(), key=lambda group: (len(group[0]), group[0])):
        sample = numbers if len(numbers) <= per_pattern else np.sort(rng.choice(numbers, per_pattern, replace=False))
        found[pattern] = {"test": test[[zero_pattern(n) == pattern for n in test]], "sample": sample}
    return found


def exact(translate, numbers: np.ndarray) -> list[bool]:
    return [hypothesis == french(n) for n, hypothesis in zip(numbers, translate([english(n) for n in numbers]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=SHIPPED)
    parser.add_argument("--backends", default=",".join(backends.BACKENDS))
    parser.add_argument("--per-pattern", type=int, default=100)
    parser.add_argument("--dtype", default="float32", choices=["float64", "float32"])
    parser.add_argument("--at-least", type=float, default=0.99)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    adapters, missing = backends.load(tuple(args.backends.split(",")))
    for absent in missing:
        print(f"{absent.name}: {absent.reason}", file=sys.stderr)
    groups = sets(args.per_pattern)
    results = {name: {} for name in adapters}
    for name, adapter in adapters.items():
        translate = translator(adapter, args.checkpoint, args.dtype, batch_size=256)
        for pattern, numbers in groups.items():
            results[name][pattern] = {kind: exact(translate, chosen) for kind, chosen in numbers.items()}
        print(f"{name}: done", file=sys.stderr)
    worst = min((np.mean(scores) for by_pattern in results.values() for kinds in by_pattern.values()
                 for scores in kinds.values() if scores), default=1.0)
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "dtype": args.dtype, "results": {
            name: {p: {k: {"numbers": len(v), "exact": int(sum(v))} for k, v in kinds.items()}
                   for p, kinds in by_pattern.items()} for name, by_pattern in results.items()}}, indent=1))
    else:
        print(table(groups, results))
    return 0 if worst >= args.at_least and not missing else 1


def table(groups: dict, results: dict) -> str:
    """Markdown: a row per pattern, an example, and each backend's exact match on the test numbers and the sample."""
    names = list(results)
    lines = ["| pattern | example | test numbers | " + " | ".join(f"{n}: test, sample" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for pattern, numbers in groups.items():
        example = english(numbers["sample"][len(numbers["sample"]) // 2])
        cells = [", ".join(percent(results[n][pattern][kind]) for kind in ("test", "sample")) for n in names]
        lines.append(f"| `{pattern}` | {example} | {len(numbers['test'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def percent(scores: list[bool]) -> str:
    return f"{100 * np.mean(scores):.0f}%" if scores else "-"


if __name__ == "__main__":
    raise SystemExit(main())
