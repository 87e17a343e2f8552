"""Write ``tests/slow_tests.txt``: the tests that leave the developers' inner loop, ``pytest -m "not slow"``.

A test is *slow* when it took at least ``--threshold`` seconds (set-up, call and teardown together) in a run of the
whole suite, ``pytest --full`` (pytest-xdist's workers). A module is slow as a whole when one of its tests' set-up
took at least ``--module-setup`` seconds: a shared set-up (a module fixture: the data-parallel runs) would otherwise
move to the module's first quick test. ``tests/conftest.py`` marks every test the file names, or whose module it
names, ``slow``, beside those marked in their code (``@pytest.mark.slow``: whole training runs, exports, documents).
`pytest --full` and CI run every test; the file only decides what the default tier leaves out.

    python scripts/slow_tests.py                       # run the suite with --durations=0, then write the file
    python scripts/slow_tests.py --from run.txt        # read the durations of a saved run (pytest --durations=0)
    python scripts/slow_tests.py --from run.txt --from inner.txt   # and of an inner-loop run: both reports' slow tests
    python scripts/slow_tests.py --threshold 0.3       # a smaller inner loop

A test's time depends on what ran before it in its process (a compilation shared by a module's tests is paid by the
first that runs): after writing the file, time ``pytest -m "not slow" --durations=0`` and write the file again from
both reports, so that a test that pays such a set-up in the inner loop leaves it too.
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
DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*)$")
HEADER = """\
# The tests `pytest -m "not slow"` leaves out besides those marked in their code: each took at least {threshold} s
# (set-up, call and teardown) in a run of the whole suite or of the inner loop; a module named alone had a test
# set-up of {module_setup} s or more. Written by scripts/slow_tests.py; tests/conftest.py marks them. `pytest --full`
# and CI run every test.
"""


def durations(report: str, phases: tuple[str, ...] = ("setup", "call", "teardown")) -> dict[str, float]:
    """Each test's seconds (those of ``phases`` summed) in a pytest ``--durations=0`` report."""
    total: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        match = DURATION.match(line.strip())
        if match and match.group(2) in phases:
            total[match.group(3)] += float(match.group(1))
    return dict(total)


def slow_tests(seconds: dict[str, float], threshold: float) -> list[str]:
    """The node ids of the tests that took at least ``threshold`` seconds, sorted."""
    return sorted(test for test, took in seconds.items() if took >= threshold)


def slow_modules(setups: dict[str, float], threshold: float) -> list[str]:
    """The modules (``tests/test_x.py``) one of whose tests' set-up took at least ``threshold`` seconds, sorted."""
    return sorted({test.split("::")[0] for test, took in setups.items() if took >= threshold})


def slow_entries(reports: list[str], threshold: float, module_setup: float) -> tuple[list[str], dict[str, float]]:
    """The lines of ``slow_tests.txt`` from one or more reports (the slow modules, then every slow test outside
    them), and each test's longest time over the reports."""
    seconds: dict[str, float] = {}
    modules: set[str] = set()
    for report in reports:
        for test, took in durations(report).items():
            seconds[test] = max(took, seconds.get(test, 0.0))
        modules.update(slow_modules(durations(report, ("setup",)), module_setup))
    tests = [test for test in slow_tests(seconds, threshold) if test.split("::")[0] not in modules]
    return sorted(modules) + tests, seconds


def run_suite() -> str:
    """The ``--durations=0`` report of the whole suite (``pytest --full``)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", "--full"],
                          cwd=ROOT, capture_output=True, text=True)
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="reports", type=Path, action="append",
                        help="a saved pytest --durations=0 report (repeat for several: a test slow in any is slow)")
    parser.add_argument("--threshold", type=float, default=0.7, help="seconds (default 0.7)")
    parser.add_argument("--module-setup", type=float, default=10.0,
                        help="a module with a test set-up this long leaves whole (seconds, default 10)")
    parser.add_argument("--add", metavar="RUN", help="keep the file's entries and add the reports' slow tests, "
                        "RUN describing the reports' run in the file's header (e.g. 'a clean clone's default tier')")
    args = parser.parse_args(argv)
    if args.threshold <= 0 or args.module_setup <= 0:
        parser.error("--threshold and --module-setup must be > 0")
    reports = [report.read_text() for report in args.reports] if args.reports else [run_suite()]
    entries, seconds = slow_entries(reports, args.threshold, args.module_setup)
    if not seconds:
        parser.error("the report lists no test durations (was it run with --durations=0?)")
    header = HEADER.format(threshold=args.threshold, module_setup=args.module_setup)
    if args.add:
        kept = SLOW_TESTS.read_text().splitlines()
        header = "".join(f"{line}\n" for line in kept if line.startswith("#"))
        header += f"# Added: each test that took at least {args.threshold} s in {args.add}.\n"
        entries = [*dict.fromkeys([*(line for line in kept if line and not line.startswith("#")), *entries])]
    SLOW_TESTS.write_text(header + "".join(f"{entry}\n" for entry in entries))
    left = [test for test in seconds if test not in entries and test.split("::")[0] not in entries]
    kept = sum(seconds[test] for test in left)
    print(f"{len(seconds) - len(left)} of {len(seconds)} tests slow ({sum(seconds.values()) - kept:.0f} s); the "
          f"inner loop's tests took {kept:.0f} s; wrote {SLOW_TESTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
