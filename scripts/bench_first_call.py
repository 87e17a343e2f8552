"""The first translation: how long a user waits for ``transformer-reference translate --backend B "one sentence"``
run as a fresh process, in every backend, beside the floor no command can go under, the framework's own import.

For each backend, in each round: the import floor (``python -c "import jax"``: numpy, torch, jax, tensorflow), a
cold translate (an empty cache of compiled programs, equivalence/compile_cache.py: everything compiled) and a
warm one (the same command again: its programs read back). The backends take turns within a round, in reverse order
every other round, so that a change of the machine's load falls on all of them. Each command's wall time is timed
from outside (process start to exit), and its CPU time (user and system, every thread: less changed than the wall
time by other work on the machine); every process gets the same threads (``--threads``: the command's flag and the
BLAS's and OpenMP's environment). The shipped model, translate's default. A framework cache the user set
(``JAX_COMPILATION_CACHE_DIR``, ``TF_XLA_FLAGS``, ``TORCHINDUCTOR_CACHE_DIR``) is removed from the commands'
environment, so that they use the cache under test.

Writes ``docs/results/<date>-first-call.json`` and ``.md`` (``--out``; existing files are refused, never replaced):
per backend the medians of the rounds, their spread (min-max), warm less floor, and whether it meets the target
(warm within :data:`BAR` s of the import),
with the machine, the versions and the 1-minute load average over the run (``--note`` says what else ran).

    python scripts/bench_first_call.py [--rounds 3] [--threads 1] [--backends numpy,torch,jax,tf] [--note TEXT]
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from equivalence import backends, compile_cache, runtime  # noqa: E402
from transformer_bench.timing import cpu_name  # noqa: E402

LOCK = "/tmp/bench.lock"            # the project's benchmarks run one at a time
SENTENCE = "three hundred and twelve"
BAR = 2.0                           # s: issue 73, a warm translate within this of the framework's import
FLOOR = {"numpy": "numpy", "torch": "torch", "jax": "jax", "tf": "tensorflow"}      # backend -> module imported
FRAMEWORK_CACHES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                    "JAX_ENABLE_COMPILATION_CACHE", "TF_XLA_FLAGS", "TORCHINDUCTOR_CACHE_DIR")
KINDS = ("floor", "cold", "warm")
CPU_KINDS = tuple(f"{kind}_cpu" for kind in KINDS)


def environment(threads: int, cache: Path) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in FRAMEWORK_CACHES}
    return env | runtime.blas_threads(threads) | {compile_cache.ENVIRONMENT: str(cache), "PYTHONPATH": str(ROOT)}


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall seconds of ``command`` from start to exit, the CPU seconds it used (user and system, every thread),
    and its output; a failure stops the benchmark."""
    start, used = time.perf_counter(), cpu_of_children()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds, cpu = time.perf_counter() - start, cpu_of_children() - used
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return seconds, cpu, done.stdout


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_round(backend: str, threads: int, workdir: Path, round_number: int) -> dict[str, float]:
    cache = workdir / f"{backend}-{round_number}"                       # empty: the cold run compiles everything
    env = environment(threads, cache)
    floor, floor_cpu, _ = timed([sys.executable, "-c", f"import {FLOOR[backend]}"], env)
    translate = [sys.executable, "-m", "transformer_cli", "translate", "--backend", backend, "--threads", str(threads),
                 SENTENCE]
    cold, cold_cpu, cold_text = timed(translate, env)
    warm, warm_cpu, warm_text = timed(translate, env)
    if warm_text != cold_text:
        raise SystemExit(f"{backend}: the warm run translated {warm_text!r}, the cold one {cold_text!r}")
    return {"floor": floor, "cold": cold, "warm": warm, "floor_cpu": floor_cpu, "cold_cpu": cold_cpu,
            "warm_cpu": warm_cpu, "load": os.getloadavg()[0]}


def summary(runs: list[dict[str, float]]) -> dict:
    """Per kind (wall and CPU seconds), the median of the rounds and their spread; warm less floor, and the bar."""
    row = {kind: {"median": statistics.median(run[kind] for run in runs), "min": min(run[kind] for run in runs),
                  "max": max(run[kind] for run in runs)} for kind in (*KINDS, *CPU_KINDS)}
    row["warm_above_floor"] = row["warm"]["median"] - row["floor"]["median"]
    row["warm_above_floor_cpu"] = row["warm_cpu"]["median"] - row["floor_cpu"]["median"]
    row["meets_bar"] = row["warm_above_floor"] <= BAR
    return row


def versions() -> dict[str, str | None]:
    return {"python": platform.python_version(),
            **{framework: compile_cache.framework_version(framework) for framework in compile_cache.FRAMEWORKS}}


def markdown(result: dict) -> str:
    lines = [f"# The first translation, {result['date']}", "",
             f"`{result['command']}`", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores; threads {result['threads']}; "
             f"versions {', '.join(f'{name} {version}' for name, version in result['versions'].items())}.",
             f"Load: 1-minute load average {result['load']['min']:.1f}-{result['load']['max']:.1f} over the run. "
             f"{result['note']}".rstrip(), "",
             f"Seconds, median of {result['rounds']} rounds (min-max); the bar: warm within {BAR:.0f} s of the "
             "import.", "",
             "| backend | import floor | cold translate | warm translate | warm - floor | bar |",
             "|---|---|---|---|---|---|"]
    for backend, row in result["backends"].items():
        lines.append(f"| {backend} | {' | '.join(cells(row, KINDS))} | {row['warm_above_floor']:.2f} | "
                     f"{'met' if row['meets_bar'] else 'missed'} |")
    lines += ["", "CPU seconds of the same processes (user and system, every thread), which other work on the "
              "machine changes less than their wall time:", "",
              "| backend | import floor | cold translate | warm translate | warm - floor |", "|---|---|---|---|---|"]
    for backend, row in result["backends"].items():
        lines.append(f"| {backend} | {' | '.join(cells(row, CPU_KINDS))} | {row['warm_above_floor_cpu']:.2f} |")
    return "\n".join(lines) + "\n"


def cells(row: dict, kinds: tuple[str, ...]) -> list[str]:
    return [f"{row[kind]['median']:.2f} ({row[kind]['min']:.2f}-{row[kind]['max']:.2f})" for kind in kinds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", default=",".join(FLOOR))
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args()
    date = datetime.date.today().isoformat()
    written = [args.out / f"{date}-first-call{suffix}" for suffix in (".json", ".md")]
    if any(path.exists() for path in written):
        parser.error(f"--out: {args.out} already holds today's result files; a result file is never replaced")
    names = [name for name in args.backends.split(",") if backends.installed(name)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with open(LOCK, "w") as lock, tempfile.TemporaryDirectory() as workdir:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for number in range(args.rounds):
            for name in names if number % 2 == 0 else names[::-1]:
                runs[name].append(one_round(name, args.threads, Path(workdir), number))
                print(f"round {number + 1}: {name} " + ", ".join(f"{kind} {runs[name][-1][kind]:.2f} s"
                                                               for kind in KINDS), file=sys.stderr)
    loads = [run["load"] for rows in runs.values() for run in rows]
    result = {"date": date, "command": shlex.join(["python", "scripts/bench_first_call.py", *sys.argv[1:]]),
              "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "platform": platform.platform()},
              "versions": versions(), "threads": args.threads, "rounds": args.rounds, "sentence": SENTENCE,
              "load": {"min": min(loads), "max": max(loads)}, "note": args.note,
              "backends": {name: summary(rows) for name, rows in runs.items()}, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    written[0].write_text(json.dumps(result, indent=2) + "\n")
    written[1].write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
