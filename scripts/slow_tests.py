"""Write ``tests/slow_tests.txt``: the tests that leave the developers' inner loop, ``pytest -m "not slow"``.

A test is *slow* when it took at least ``--threshold`` seconds (set-up, call and teardown together) in a run of the
whole suite as the README runs it (two pytest-xdist workers). ``tests/conftest.py`` marks every test the file names
``slow``, beside those marked in their code (``@pytest.mark.slow``: whole training runs, exports, documents). The
README's command and CI run every test; the file only decides what the inner loop leaves out.

    python scripts/slow_tests.py                       # run the suite with --durations=0, then write the file
    python scripts/slow_tests.py --from run.txt        # read the durations of a saved run (pytest --durations=0)
    python scripts/slow_tests.py --threshold 0.3       # a smaller inner loop

A test's time depends on what ran before it in its process (a module's shared set-up is paid by its first test):
after writing the file, time ``pytest -m "not slow"`` and write it again from a run of the whole suite if a test
that now pays a set-up stands out.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_TESTS = ROOT / "tests" / "slow_tests.txt"
# One line of pytest's --durations report: "12.34s call     tests/test_x.py::test_y[a-b]".
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S.*)$")
HEADER = """\
# The tests `pytest -m "not slow"` leaves out besides those marked in their code: each took at least {threshold} s
# (set-up, call and teardown) in a run of the whole suite. Written by scripts/slow_tests.py; tests/conftest.py
# marks them. The README's command and CI run every test.
"""


def durations(report: str) -> dict[str, float]:
    """Each test's seconds (set-up, call and teardown summed) in a pytest ``--durations=0`` report."""
    total: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        match = DURATION.match(line.strip())
        if match:
            total[match.group(2)] += float(match.group(1))
    return dict(total)


def slow_tests(seconds: dict[str, float], threshold: float) -> list[str]:
    """The node ids of the tests that took at least ``threshold`` seconds, sorted."""
    return sorted(test for test, took in seconds.items() if took >= threshold)


def run_suite() -> str:
    """The ``--durations=0`` report of the whole suite, run as the README runs it."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0"],
                          cwd=ROOT, capture_output=True, text=True)
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="report", type=Path, help="a saved pytest --durations=0 report")
    parser.add_argument("--threshold", type=float, default=0.7, help="seconds (default 0.7)")
    args = parser.parse_args(argv)
    if args.threshold <= 0:
        parser.error("--threshold must be > 0")
    seconds = durations(args.report.read_text() if args.report else run_suite())
    if not seconds:
        parser.error("the report lists no test durations (was it run with --durations=0?)")
    slow = slow_tests(seconds, args.threshold)
    SLOW_TESTS.write_text(HEADER.format(threshold=args.threshold) + "".join(f"{test}\n" for test in slow))
    kept = sum(took for test, took in seconds.items() if took < args.threshold)
    print(f"{len(slow)} of {len(seconds)} tests slow ({sum(seconds.values()) - kept:.0f} s); the inner loop's "
          f"tests took {kept:.0f} s; wrote {SLOW_TESTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
