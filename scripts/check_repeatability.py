"""Run (part of) the suite several times and check every run reports the same results: the
same outcome for every test and the same measured errors in the agreement summary.

    python scripts/check_repeatability.py --runs 20 -- tests/equivalence/test_agreement.py -k "cpu and tiny"

The comparison ignores only timings.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

TIMING = re.compile(r"\s+in [0-9.]+s( \([0-9:]+\))?")


def results(pytest_args: list[str]) -> str:
    """The run's per-test outcomes and its agreement summary, timings removed."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n0", "-rA", "-q", *pytest_args],
                         capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines()
             if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR")) or re.match(r"\w+\s+(cpu|cuda|gpu)", line)
             or " passed" in line]
    return "\n".join(TIMING.sub("", line) for line in lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args()
    first = results(args.pytest_args)
    if not first:
        raise SystemExit("the first run reported nothing; check the pytest arguments")
    for run in range(2, args.runs + 1):
        if results(args.pytest_args) != first:
            print(f"run {run} differs from run 1")
            return 1
    print(f"{args.runs} runs, identical results ({len(first.splitlines())} result lines each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
