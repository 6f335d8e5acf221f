"""Runs each SPMD test file in a process of its own.

SPMD mode is process-global: each ``test_*.py`` here runs in a subprocess with
``XPIPE_SPMD_WORKER=1`` (see ``subprocess_files``), where its tests switch SPMD
mode on through ``xpipe.mesh.spmd_device()`` (so a file can still set XLA flags
first).
"""

from subprocess_files import collector

pytest_pycollect_makemodule = collector("XPIPE_SPMD_WORKER", "spmd")
