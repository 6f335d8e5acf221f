"""The suite's two tiers, and the durations each run records.

The quick tier (the default) runs every public feature at least once and every
exactness check that guards against a silently wrong result; the full tier adds
the grids (families x meshes, the checkpoint matrix) and the long examples, each
test marked ``@pytest.mark.full`` (a whole file by ``pytestmark = pytest.mark.full``).
``--tier=full`` runs only the marked tests, ``--tier=all`` both.

With ``XPIPE_DURATIONS=<folder>`` the main pytest process and every own-process
worker write each test's seconds (setup, call and teardown) there as JSON;
``tools/test_durations.py`` reads them. Under pytest-xdist (``-n 2``) the main
process is xdist's controller, which receives every test's report; xdist's own
workers write nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

TIERS = ("quick", "full", "all")
FULL_FILE = re.compile(r"^pytestmark = .*pytest\.mark\.full", re.MULTILINE)
FULL_MARK = re.compile(r"pytest\.mark\.full\b|^from tiers import .*\bin_full_tier\b", re.MULTILINE)


def in_full_tier(*values) -> pytest.param:
    """A parametrized case that runs in the full tier only (a grid's further points)."""
    return pytest.param(*values, marks=pytest.mark.full)


def add_tier_option(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default="quick",
                     help="quick (the default: every feature once, every exactness check), full (only the tests "
                          "marked full: grids and long examples) or all")


def file_tiers(text: str) -> set[str]:
    """The tiers a test file's tests belong to, read from its text (for a file that
    runs in a process of its own, which is not collected here)."""
    if FULL_FILE.search(text):
        return {"full"}
    return {"quick", "full"} if FULL_MARK.search(text) else {"quick"}


def in_tier(item: pytest.Item, tier: str) -> bool:
    """Whether ``item`` runs in ``tier``."""
    if tier == "all":
        return True
    tiers = getattr(item, "tiers", None)
    if tiers is not None:
        return tier in tiers
    return (item.get_closest_marker("full") is not None) == (tier == "full")


def select_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the items of the tier asked for; report the others as deselected."""
    tier = config.getoption("tier")
    kept, dropped = [], []
    for item in items:
        (kept if in_tier(item, tier) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def own_process_worker() -> bool:
    """Whether this process runs one file for the main process (tests/subprocess_files.py)."""
    return bool(os.environ.get("XPIPE_SPMD_WORKER") or os.environ.get("XPIPE_OWN_PROCESS_WORKER"))


def xdist_worker() -> bool:
    """Whether this process is one of pytest-xdist's workers (whose controller reports)."""
    return "PYTEST_XDIST_WORKER" in os.environ and not own_process_worker()


class DurationRecorder:
    """Each test's seconds in this process, and the run's total."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        folder = os.environ.get("XPIPE_DURATIONS")
        if not folder or xdist_worker():
            return
        record = {"worker": own_process_worker(), "tier": session.config.getoption("tier"),
                  "total_s": time.monotonic() - self.started,
                  "tests": [{"nodeid": n, "seconds": s, "outcome": self.outcomes.get(n, "passed")}
                            for n, s in self.seconds.items()]}
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{os.getpid()}.json").write_text(json.dumps(record, indent=1))

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        if own_process_worker() or xdist_worker():
            return
        minutes, seconds = divmod(round(time.monotonic() - self.started), 60)
        ran = sum(1 for outcome in self.outcomes.values() if outcome != "skipped")
        terminalreporter.write_line(f"xpipe {config.getoption('tier')} tier: {ran} items in {minutes} min {seconds} s "
                                    "(per-test durations: python tools/test_durations.py)")
