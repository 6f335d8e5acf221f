"""Runs each SPMD test file in a process of its own.

In the main pytest process, every ``test_*.py`` here is collected as one item that
re-runs pytest on that file in a subprocess with ``XPIPE_SPMD_WORKER=1``; in that
worker the tests are collected normally and switch SPMD mode on through
``xpipe.mesh.spmd_device()`` (so a file can still set XLA flags first). A file
that needs another device count says so in a line ``CPU_NUM_DEVICES = N``.
A failing worker fails the item and shows the worker's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = os.environ.get("XPIPE_SPMD_WORKER") == "1"
DEVICES = re.compile(r"^CPU_NUM_DEVICES = (\d+)$", re.MULTILINE)


class SpmdFile(pytest.File):
    """A test file run whole in an SPMD subprocess."""

    def collect(self):
        yield SpmdRun.from_parent(self, name="spmd-subprocess")


class SpmdRun(pytest.Item):
    """Runs one SPMD test file in a fresh process and fails if any of its tests fails."""

    def runtest(self) -> None:
        environment = dict(os.environ, XPIPE_SPMD_WORKER="1")
        devices = DEVICES.search(self.path.read_text())
        if devices:
            environment["CPU_NUM_DEVICES"] = devices[1]
        # --tb=short: the long form prints arguments, and repr() of some SPMD tensors crashes the worker.
        command = [sys.executable, "-m", "pytest", str(self.path), "-q", "--tb=short", "-p", "no:cacheprovider",
                   "--rootdir", str(self.config.rootpath)]
        result = subprocess.run(command, env=environment, capture_output=True, text=True)
        self.worker_output = result.stdout + result.stderr
        if result.returncode != 0:
            raise SpmdFailure(self.worker_output)
        print(self.worker_output.strip().splitlines()[-1])

    def repr_failure(self, excinfo):  # type: ignore[override]
        if isinstance(excinfo.value, SpmdFailure):
            return f"SPMD worker for {self.path.name} failed:\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} (SPMD subprocess)"


class SpmdFailure(Exception):
    """Carries a failed SPMD worker's output."""


def pytest_pycollect_makemodule(module_path: Path, parent):
    if not WORKER:
        return SpmdFile.from_parent(parent, path=module_path)
    return None
