"""Test files that run whole in a process of their own (the SPMD tests, and the
devices tests that build many pipelines).

In the main pytest process, each such ``test_*.py`` is collected as one item that
re-runs pytest on that file in a subprocess with ``<variable>=1``; in that worker
the tests are collected normally. A file that needs another device count says so
in a line ``CPU_NUM_DEVICES = N``. The worker runs this process's tier
(``tiers.file_tiers`` reads which tiers a file holds from its text). A failing
worker fails the item and shows the worker's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import file_tiers

DEVICES = re.compile(r"^CPU_NUM_DEVICES = (\d+)$", re.MULTILINE)


class OwnProcessFile(pytest.File):
    """A test file run whole in a subprocess."""

    variable = ""  # the environment variable that marks the worker
    label = ""

    def collect(self):
        run = OwnProcessRun.from_parent(self, name=f"{self.label}-subprocess")
        run.tiers = file_tiers(self.path.read_text())
        yield run


class OwnProcessRun(pytest.Item):
    """Runs one test file in a fresh process and fails if any of its tests fails."""

    def runtest(self) -> None:
        environment = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
        environment[self.parent.variable] = "1"
        devices = DEVICES.search(self.path.read_text())
        if devices:
            environment["CPU_NUM_DEVICES"] = devices[1]
        # --tb=short: the long form prints arguments, and repr() of some SPMD tensors crashes the worker.
        command = [sys.executable, "-m", "pytest", str(self.path), "-q", "--tb=short", "-p", "no:cacheprovider",
                   "--rootdir", str(self.config.rootpath), f"--tier={self.config.getoption('tier')}", "-p", "no:xdist"]
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        self.worker_output = result.stdout + result.stderr
        if result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED:
            pytest.skip(f"{self.path.name} has no test in this tier")
        if result.returncode != 0:
            raise WorkerFailure(self.worker_output)
        print(self.worker_output.strip().splitlines()[-1])

    def repr_failure(self, excinfo):  # type: ignore[override]
        if isinstance(excinfo.value, WorkerFailure):
            return f"worker for {self.path.name} failed:\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} ({self.parent.label} subprocess)"


class WorkerFailure(Exception):
    """Carries a failed worker's output."""


def collector(variable: str, label: str):
    """A ``pytest_pycollect_makemodule`` hook that runs each file of the folder whose
    conftest uses it in a subprocess, unless this process is that subprocess."""
    file_class = type(f"{label.title()}File", (OwnProcessFile,), {"variable": variable, "label": label})

    def pytest_pycollect_makemodule(module_path: Path, parent):
        if os.environ.get(variable) != "1":
            return file_class.from_parent(parent, path=module_path)
        return None

    return pytest_pycollect_makemodule
