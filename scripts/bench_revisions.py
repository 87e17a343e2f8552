"""``bench``'s backend tasks at two revisions of this project, side by side: did a change make a port slower?

Each revision is checked out (``git archive``) into a temporary directory; processes of the two take turns, ``--rounds``
of each (before, after, after, before, ...: a change of the machine's load falls on both), and every process times
``bench --peers``' backend tasks -- the forward pass (8 x N x N), greedy decoding of one sentence and of eight, beam 4
of one, N = ``--length`` (default 128) tokens -- of every backend on the preset's seeded weights through that
revision's own adapters (``transformer_bench.bench.backend_engine``), interleaved, the first call apart, medians of
``--repeats``. The result: per backend and task the median over the rounds' medians at each revision, their spread,
and after / before.

Writes ``docs/results/<date>-bench-revisions.json`` and ``.md`` (``--out``; existing files are refused, never
replaced), with the machine, versions and the 1-minute load average over the run (``--note`` says what else ran).

    python scripts/bench_revisions.py BEFORE AFTER [--rounds 3] [--repeats 5] [--threads 1] [--preset base]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from equivalence import runtime  # noqa: E402
from transformer_bench.timing import cpu_name  # noqa: E402

BACKENDS = ("numpy", "torch", "jax", "tf")
# One process: the revision's own bench machinery, the backend tasks of ``bench --peers``, medians as JSON on stdout
TIMED = """
import json, sys
from equivalence import backends, runtime
from transformer_bench.bench import PEER_BATCH, Inputs, backend_engine, bench_inputs, bench_model
from transformer_bench.timing import round_robin
preset, length, repeats, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
names = tuple(sys.argv[5].split(","))
runtime.configure(threads)
_, config, params = bench_model(preset, None)
src, tgt, decode_src = bench_inputs(config, 8, length, length, length, PEER_BATCH)
inputs = Inputs((src, tgt), decode_src[:1], decode_src)
adapters, _ = backends.load(names)
engines = [backend_engine(adapter, config, params, inputs, True, False) for adapter in adapters.values()]
timings = round_robin({(engine.name, task): call for engine in engines for task, call in engine.calls.items()},
                      repeats)
print(json.dumps([[name, task, timing.median] for (name, task), timing in timings.items()]))
"""


def checkout(revision: str, into: Path) -> Path:
    """The tree of ``revision`` (a commit of this repository) extracted into ``into`` (a new directory)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision], check=True,
                             capture_output=True).stdout
    into.mkdir()
    with tempfile.TemporaryFile() as raw:
        raw.write(archive)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as tar:
            tar.extractall(into, filter="data")
    return into


def timed(tree: Path, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """One process of ``tree``'s revision: (backend, task) -> median seconds."""
    env = os.environ | runtime.blas_threads(args.threads) | {"PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", TIMED, args.preset, str(args.length), str(args.repeats),
                           str(args.threads), args.backends], cwd=tree, env=env, check=True, capture_output=True,
                          text=True)
    return {(name, task): seconds for name, task, seconds in json.loads(done.stdout.splitlines()[-1])}


def load_average() -> float:
    return os.getloadavg()[0]


def report(args: argparse.Namespace, runs: dict[str, list[dict]], loads: list[float]) -> tuple[dict, str]:
    """The JSON record and its Markdown table."""
    keys = list(runs["before"][0])
    rows = []
    for key in keys:
        before = [run[key] for run in runs["before"]]
        after = [run[key] for run in runs["after"]]
        rows.append({"backend": key[0], "task": key[1], "before": statistics.median(before),
                     "before_range": [min(before), max(before)], "after": statistics.median(after),
                     "after_range": [min(after), max(after)],
                     "ratio": statistics.median(after) / statistics.median(before)})
    record = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "before": args.before,
              "after": args.after, "machine": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
              "load": [min(loads), max(loads)], "note": args.note, "rows": rows}
    ms = lambda seconds: f"{seconds * 1e3:,.1f}"
    lines = [f"# `bench` at two revisions, {record['date']}", "",
             f"`python scripts/bench_revisions.py {args.before} {args.after} --rounds {args.rounds} --repeats "
             f"{args.repeats} --threads {args.threads} --preset {args.preset} --length {args.length}`", "",
             f"Machine: {record['machine']}, {record['cores']} cores; threads {args.threads}; python "
             f"{sys.version.split()[0]}. Load: 1-minute load average {min(loads):.1f}-{max(loads):.1f} over the run."
             + (f" {args.note}" if args.note else ""), "",
             f"Milliseconds per call, the median of {args.rounds} processes' medians of {args.repeats} (min-max); "
             "after / before.", "",
             "| backend | task | before | after | after / before |", "|---|---|---|---|---|"]
    lines += [f"| {row['backend']} | {row['task']} | {ms(row['before'])} ({ms(row['before_range'][0])}-"
              f"{ms(row['before_range'][1])}) | {ms(row['after'])} ({ms(row['after_range'][0])}-"
              f"{ms(row['after_range'][1])}) | {row['ratio']:.3f} |" for row in rows]
    return record, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("after", help="the later revision")
    parser.add_argument("--rounds", type=int, default=3, help="processes of each revision")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each task in a process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--length", type=int, default=128, help="the forward pass's source and target length and "
                                                                  "the decoding budget N (at least 51)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--note", default="")
    parser.add_argument("--out", help="the result files' path without suffix (default docs/results/<date>-bench-"
                                      "revisions)")
    args = parser.parse_args(argv)
    out = Path(args.out or ROOT / "docs" / "results" / f"{datetime.date.today().isoformat()}-bench-revisions")
    if any(out.with_suffix(suffix).exists() for suffix in (".json", ".md")):
        parser.error(f"{out}.json or .md exists: a result file is never replaced (give --out)")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    loads = [load_average()]
    with tempfile.TemporaryDirectory() as scratch:
        trees = {which: checkout(getattr(args, which), Path(scratch) / which) for which in ("before", "after")}
        for turn in range(args.rounds):
            for which in ("before", "after") if turn % 2 == 0 else ("after", "before"):
                runs[which].append(timed(trees[which], args))
                loads.append(load_average())
                print(f"round {turn + 1}: {which} done", file=sys.stderr)
    record, table = report(args, runs, loads)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
