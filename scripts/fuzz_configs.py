"""Differential fuzzing over the configuration space (``equivalence/fuzz.py``, docs/equivalence.md "The
configuration space"): random configurations and inputs, every backend against the reference, for N minutes.

    python scripts/fuzz_configs.py --minutes 30                     # torch, jax, tf; weight scales 1e-3, 1, 1e3
    python scripts/fuzz_configs.py --minutes 10 --backends torch --extreme   # weights up to 1e12 as well
    python scripts/fuzz_configs.py --backends jax --replay '{"config": ...}' # one case, as a failure prints it

Each disagreement is shrunk by Hypothesis to a minimal case and printed with the command that replays it. Exit
status: 0 when nothing disagreed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
import time
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from equivalence import fuzz

BACKENDS = ("torch", "jax", "tf", "numpy")
EXAMPLES_PER_ROUND = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    parser.add_argument("--backends", default="torch,jax,tf", help="comma-separated, from " + ", ".join(BACKENDS))
    parser.add_argument("--extreme", action="store_true", help="weight scales 1e9 and 1e12 as well")
    parser.add_argument("--seed", type=int, default=0, help="the first round's seed")
    parser.add_argument("--replay", metavar="JSON", help="check one case (as a failure prints it) and stop")
    args = parser.parse_args(argv)
    names = args.backends.split(",")
    if unknown := [name for name in names if name not in BACKENDS]:
        parser.error(f"--backends: unknown backend {unknown[0]!r}; choose from {', '.join(BACKENDS)}")
    if args.minutes <= 0:
        parser.error(f"--minutes must be positive, got {args.minutes}")
    warnings.simplefilter("ignore")                         # the frameworks' notices; disagreements are printed
    adapters = {name: importlib.import_module(f"equivalence.backends.{name}") for name in names}
    if args.replay:
        return replay(fuzz.Case.from_json(args.replay), adapters)
    scales = fuzz.WEIGHT_SCALES + (fuzz.EXTREME_WEIGHT_SCALES if args.extreme else ())
    return fuzz_for(args.minutes * 60, adapters, scales, args.seed)


def replay(case: fuzz.Case, adapters: dict) -> int:
    """Check one case on every backend; print what disagrees."""
    failed = 0
    for name, adapter in adapters.items():
        not_compared = []
        found = fuzz.check(case, adapter, not_compared)
        print(f"{name}: " + ("agrees" if not found else "\n  ".join(["disagrees:", *found])))
        print("".join(f"  not compared: {note}\n" for note in not_compared), end="")
        failed += bool(found)
    return int(failed > 0)


def fuzz_for(seconds: float, adapters: dict, scales: tuple[float, ...], first_seed: int) -> int:
    """Rounds of :data:`EXAMPLES_PER_ROUND` cases per backend, a new seed each, until ``seconds`` have passed."""
    stop, counts, failures, not_compared = time.monotonic() + seconds, dict.fromkeys(adapters, 0), [], []
    for round_seed in itertools.count(first_seed):
        for name, adapter in adapters.items():
            if time.monotonic() > stop:
                print(f"{sum(counts.values())} cases ({', '.join(f'{n} {c}' for n, c in counts.items())}), "
                      f"{len(failures)} disagreement(s); {len(not_compared)} case(s) with a part left undefined by "
                      f"the case itself and not compared (e.g. {not_compared[0] if not_compared else '-'})")
                return int(bool(failures))
            failure = one_round(adapter, name, scales, round_seed, counts, not_compared)
            if failure:
                failures.append(failure)
                print(failure, flush=True)
    raise AssertionError("unreachable")


def one_round(adapter, name: str, scales: tuple[float, ...], round_seed: int, counts: dict,
              not_compared: list[str]) -> str | None:
    """One Hypothesis run over ``EXAMPLES_PER_ROUND`` cases on one backend; the shrunk failure's report, if any.
    A case with a part it leaves undefined (:func:`equivalence.fuzz.check`) adds one note to ``not_compared``."""

    @hypothesis_seed(round_seed)
    @settings(max_examples=EXAMPLES_PER_ROUND, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz.cases(scales))
    def run(case: fuzz.Case) -> None:
        counts[name] += 1
        notes = []
        found = fuzz.check(case, adapter, notes)
        release_compiled(name)
        not_compared.extend(notes[:1])
        assert not found, "\n  ".join([f"{name} disagrees: {case.command(name)}", *found])

    try:
        run()
    except AssertionError as err:
        return str(err)
    return None


def release_compiled(name: str) -> None:
    """Drop what JAX compiled for a case: every new shape is a new executable, each holding memory maps
    of its own, and a long run would otherwise reach the kernel's limit on them (XLA then fails with "LLVM
    compilation error: Cannot allocate memory" after about 25 minutes)."""
    if name == "jax":
        import jax
        jax.clear_caches()


if __name__ == "__main__":
    sys.exit(main())
