"""Calling a test module's function in a new Python process: what a run resumed
after a restart is, and the only way to test that nothing carries over but the
checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def call_in_fresh_process(module_file: str, function: str, *args: str) -> None:
    """Run ``function(*args)`` from the test module at ``module_file`` in a new
    process with this one's environment (the emulated devices, XLA flags); raises
    ``CalledProcessError`` with the process's output if it fails."""
    module = Path(module_file)
    code = (f"import sys; sys.path[:0] = {[str(module.parent), str(TESTS)]!r}; "
            f"from {module.stem} import {function}; {function}(*{args!r})")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                            timeout=600)
    if result.returncode:
        raise subprocess.CalledProcessError(result.returncode, function, result.stdout, result.stderr)
