"""Shared test plumbing: the agreement check (the project's one tolerance policy) and a
summary of the measured error/bound ratios printed at the end of the run."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from equivalence import tolerance

# (port, device, dtype, what) -> list of (error, bound); filled by ``check_agreement``.
AGREEMENT_LOG: dict[tuple[str, str, str, str], list[tuple[float, float]]] = defaultdict(list)


def check_agreement(port_out, ref64, ref32, *, port: str, device: str, dtype: str,
                    what: str) -> tolerance.Agreement:
    """Assert the policy of :mod:`equivalence.tolerance`, after checking the port kept ``dtype``."""
    port_out = np.asarray(port_out)
    assert port_out.dtype == np.dtype(dtype), f"{what}: {port} returned {port_out.dtype}, asked for {dtype}"
    result = tolerance.assert_agrees(port_out, ref64, ref32, what=f"{port}/{device}/{dtype}/{what}")
    AGREEMENT_LOG[(port, device, dtype, what.split(":")[0])].append((result.error, result.bound))
    return result


def pytest_sessionfinish(session):
    """In a pytest-xdist worker: hand this worker's agreement log to the controller, which prints the summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["agreement"] = [[list(key), rows] for key, rows in AGREEMENT_LOG.items()]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the pytest-xdist controller: gather a finished worker's agreement log."""
    for key, rows in getattr(node, "workeroutput", {}).get("agreement", []):
        AGREEMENT_LOG[tuple(key)].extend(tuple(row) for row in rows)


def pytest_terminal_summary(terminalreporter):
    if not AGREEMENT_LOG:
        return
    terminalreporter.section("agreement with the reference (worst error / bound)")
    terminalreporter.write_line(f"{'port':<8}{'device':<9}{'dtype':<9}{'check':<22}{'n':>5}"
                                f"{'max error':>12}{'worst ratio':>13}")
    for (port, device, dtype, what), rows in sorted(AGREEMENT_LOG.items()):
        errors = np.array(rows)
        ratio = float(np.max(errors[:, 0] / errors[:, 1]))
        terminalreporter.write_line(f"{port:<8}{device:<9}{dtype:<9}{what:<22}{len(rows):>5}"
                                    f"{errors[:, 0].max():>12.2e}{ratio:>13.3f}")


@pytest.fixture(scope="session")
def agreement():
    return check_agreement
