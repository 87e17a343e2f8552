"""Translate the numbers task's whole test split (1,000 English numbers) with the shipped model in every backend,
in float64, greedy and with beam search (beam 4, alpha 0.6: section 6.1), and check each port against the NumPy
reference sentence by sentence.

For every backend and kind of decoding: the sentences whose tokens (padding removed) and whose text are the
reference's, each other sentence listed (source, the reference's text, the backend's); for beam search, the
largest |score - reference score| and the worst ratio of a sentence's difference to the float64 policy's bound
(``equivalence.tolerance.float64_bound``: 1e-12 x max(1, |reference score|)); exact match and BLEU against the
French references (``NumbersTask.score``); the wall time (informational). The sentences are decoded in batches.

    python scripts/check_translations.py [--count 1000] [--backends numpy,torch,jax,tf] [--batch-size 100] [--json]

The NumPy reference always runs: it is what the ports are checked against. Exit status 0 when every requested
backend gives the reference's tokens and text on every sentence, greedy and beam, with beam scores within the
policy; 1 otherwise (a requested backend that is not installed included); 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import backends  # noqa: E402
from equivalence.tolerance import FLOAT64_RELATIVE, float64_bound  # noqa: E402
from reference_numpy import TransformerConfig  # noqa: E402
from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA  # noqa: E402
from reference_numpy.tokenizer import Tokenizer  # noqa: E402
from transformer_tasks.numbers import TEST, NumbersTask  # noqa: E402
from transformer_tasks.progress import progress_bar  # noqa: E402
from transformer_tasks.translation import SHIPPED, load_translator  # noqa: E402

REFERENCE = "numpy"
KINDS = ("greedy", "beam")
DTYPE = "float64"
TEST_SIZE = len(NumbersTask().split.test)


@dataclass
class Decoded:
    """One backend's translations of the split: token rows without padding by kind, beam scores (B,), seconds."""

    tokens: dict[str, list[tuple[int, ...]]] = field(default_factory=lambda: {kind: [] for kind in KINDS})
    scores: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("build", *KINDS), 0.0))


def unpadded(tokens, pad_id: int) -> list[tuple[int, ...]]:
    """Each row of ``tokens`` (B, L) without its pad ids (the decoders never emit pad before the end)."""
    return [tuple(int(t) for t in row if t != pad_id) for row in np.asarray(tokens)]


def decode(adapter: ModuleType, config: TransformerConfig, params: dict[str, np.ndarray], src: np.ndarray,
           batch_size: int, progress) -> Decoded:
    """Greedy and beam-search outputs of ``src`` (B, S) from one backend's float64 model, ``batch_size`` rows at a
    time; ``progress`` wraps the list of batch starts."""
    out = Decoded()
    began = time.perf_counter()
    model = adapter.build(config, params, DTYPE, "cpu")
    out.seconds["build"] = time.perf_counter() - began
    for start in progress(list(range(0, len(src), batch_size))):
        batch = src[start:start + batch_size]                                       # (b, S)
        began = time.perf_counter()
        out.tokens["greedy"] += unpadded(adapter.greedy(model, batch), config.pad_id)
        middle = time.perf_counter()
        tokens, scores = adapter.beam(model, batch, BEAM_SIZE, LENGTH_PENALTY_ALPHA)
        out.seconds["greedy"] += middle - began
        out.seconds["beam"] += time.perf_counter() - middle
        out.tokens["beam"] += unpadded(tokens, config.pad_id)
        out.scores += [float(s) for s in np.asarray(scores, dtype=np.float64)]
    return out


def differences(port: Decoded, reference: Decoded, kind: str, sources: list[str], tokenizer: Tokenizer) -> dict:
    """The sentences of one kind whose tokens or text differ from the reference's, and the counts of identical."""
    same_tokens = same_text = 0
    differing = []
    for row, (mine, theirs) in enumerate(zip(port.tokens[kind], reference.tokens[kind], strict=True)):
        text, reference_text = tokenizer.decode(mine), tokenizer.decode(theirs)
        same_tokens += mine == theirs
        same_text += text == reference_text
        if mine != theirs or text != reference_text:
            differing.append({"row": row, "source": sources[row], "reference": reference_text, "backend": text,
                              "reference_tokens": list(theirs), "backend_tokens": list(mine)})
    return {"identical_tokens": same_tokens, "identical_text": same_text, "differing": differing}


def score_agreement(port: Decoded, reference: Decoded) -> dict:
    """max |port - reference| of the beam scores, and the worst ratio of a sentence's difference to its bound."""
    diff = np.abs(np.array(port.scores) - np.array(reference.scores))                    # (B,)
    bounds = np.array([float64_bound(score) for score in reference.scores])            # (B,)
    return {"max_score_difference": float(diff.max(initial=0.0)),
            "worst_score_ratio": float((diff / bounds).max(initial=0.0))}


def quality(task: NumbersTask, config: TransformerConfig, decoded: Decoded, references: list[str]) -> dict:
    """Exact match and BLEU of each kind against the French references."""
    return {kind: task.score(config, decoded.tokens[kind], references) for kind in KINDS}


def check(adapters: dict[str, ModuleType], config: TransformerConfig, params: dict[str, np.ndarray],
          tokenizer: Tokenizer, count: int, batch_size: int, checkpoint: str,
          missing: Sequence[backends.Missing] = (), quiet: bool = False) -> dict:
    """Decode the first ``count`` test sentences in the reference and every adapter (``missing``: the requested
    backends that are not installed); the report (see ``table``)."""
    task = NumbersTask(tokenizer)
    src, references = task.held_out(config, count, TEST, 0)                              # (B, S)
    sources = [tokenizer.decode(row) for row in src]
    runs = {name: decode(adapter, config, params, src, batch_size, progress_bar(name, "batch", quiet))
            for name, adapter in adapters.items()}
    reference = runs[REFERENCE]
    results = {}
    for name, run in runs.items():
        scores = quality(task, config, run, references)
        results[name] = {"build_seconds": run.seconds["build"]}
        for kind in KINDS:
            result = {**scores[kind], "seconds": run.seconds[kind]}
            if name != REFERENCE:
                result |= differences(run, reference, kind, sources, tokenizer)
                if kind == "beam":
                    result |= score_agreement(run, reference)
            results[name][kind] = result
    report = {"checkpoint": checkpoint, "count": count, "batch_size": batch_size, "dtype": DTYPE,
              "beam_size": BEAM_SIZE, "alpha": LENGTH_PENALTY_ALPHA, "reference": REFERENCE, "backends": results,
              "missing": [{"name": m.name, "reason": m.reason} for m in missing]}
    report["failures"] = failures(report)
    return report | {"identical": not report["failures"]}


def failures(report: dict) -> list[str]:
    """Why the ports are not identical to the reference: differing sentences, beam scores beyond the policy, a
    requested backend missing, or no port compared at all (empty: identical)."""
    count, ports = report["count"], {name: r for name, r in report["backends"].items() if name != REFERENCE}
    found = [f"{name} {kind}: {len(r[kind]['differing'])} of {count} sentences differ" for name, r in ports.items()
             for kind in KINDS if r[kind]["differing"]]
    found += [f"{name} beam scores beyond the float64 policy (worst ratio {r['beam']['worst_score_ratio']:.3g})"
              for name, r in ports.items() if r["beam"]["worst_score_ratio"] > 1.0]
    found += [f"{missing['name']} not checked" for missing in report["missing"]]
    return found + ([] if ports else ["no port compared"])


def table(report: dict) -> str:
    """The report as plain text: one line per backend and kind, then every differing sentence and the verdict."""
    count = report["count"]
    lines = [f"numbers test split: {count} sentences, {report['checkpoint']}, {report['dtype']}, "
             f"batches of {report['batch_size']}",
             f"greedy, and beam search with beam {report['beam_size']} and alpha {report['alpha']} (section 6.1); "
             f"every backend against the {report['reference']} reference",
             f"beam scores: ratio = |score - reference score| / ({FLOAT64_RELATIVE:g} x max(1, |reference score|)), "
             "the float64 policy holds at ratio <= 1", "",
             f"{'backend':<8} {'kind':<7} {'same tokens':>11} {'same text':>11} {'exact':>7} {'BLEU':>6} "
             f"{'max|score diff|':>15} {'worst ratio':>11} {'time':>8}"]
    for name, result in report["backends"].items():
        for kind in KINDS:
            row = result[kind]
            same = [f"{row[key]}/{count}" if key in row else "reference" for key in ("identical_tokens",
                                                                                     "identical_text")]
            diff, ratio = ((f"{row['max_score_difference']:.2e}", f"{row['worst_score_ratio']:.3g}")
                           if "worst_score_ratio" in row else ("", ""))
            lines.append(f"{name:<8} {kind:<7} {same[0]:>11} {same[1]:>11} {100 * row['exact']:>6.1f}% "
                         f"{row['bleu']:>6.2f} {diff:>15} {ratio:>11} {row['seconds']:>7.1f}s")
    lines.append("time: wall seconds of decoding the sentences (informational); model builds: " + ", ".join(
        f"{name} {result['build_seconds']:.1f}s" for name, result in report["backends"].items()))
    for name, result in report["backends"].items():
        for kind in KINDS:
            for row in result[kind].get("differing", []):
                tokens = (f" (tokens {row['reference_tokens']} vs {row['backend_tokens']})"
                          if row["reference"] == row["backend"] else "")
                lines.append(f"{name} {kind} differs on sentence {row['row']}: {row['source']!r}: reference "
                             f"{row['reference']!r}, {name} {row['backend']!r}{tokens}")
    lines += [f"{missing['name']}: {missing['reason']}" for missing in report["missing"]]
    lines.append(f"identical: every backend gives the reference's tokens and text on all {count} sentences, greedy "
                 "and beam, with beam scores within the float64 policy" if report["identical"] else
                 f"NOT identical: {'; '.join(report['failures'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=TEST_SIZE, help="the first COUNT sentences of the test split")
    parser.add_argument("--backends", default=",".join(backends.BACKENDS), help="comma-separated backends")
    parser.add_argument("--batch-size", type=int, default=100, help="sentences decoded at once")
    parser.add_argument("--checkpoint", type=Path, help="a numbers-task checkpoint (default: the shipped model)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        if not 1 <= args.count <= TEST_SIZE:
            raise ValueError(f"--count must be from 1 to {TEST_SIZE}, got {args.count}")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
        ports = tuple(dict.fromkeys(name for name in args.backends.split(",") if name != REFERENCE))
        if not ports:
            raise ValueError(f"--backends: name at least one of {', '.join(backends.PORTS)} to check against the "
                             f"{REFERENCE} reference")
        adapters, missing = backends.load((REFERENCE, *ports))
        backends.require_any(ports, adapters, missing)
        config, params, tokenizer = load_translator(args.checkpoint, np.float64)
    except ValueError as err:
        parser.error(str(err))
    checkpoint = str(args.checkpoint) if args.checkpoint else f"the shipped model ({SHIPPED.name})"
    report = check(adapters, config, params, tokenizer, args.count, args.batch_size, checkpoint, missing, args.quiet)
    print(json.dumps(report, indent=2, allow_nan=False) if args.json else table(report))
    return 0 if report["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
