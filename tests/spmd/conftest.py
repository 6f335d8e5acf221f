"""Runs each SPMD test file in a process of its own.

SPMD mode is process-global: each ``test_*.py`` here runs in a subprocess with
``XPIPE_SPMD_WORKER=1`` (see ``subprocess_files``), where its tests switch SPMD
mode on through ``xpipe.mesh.spmd_device()`` (so a file can still set XLA flags
first). Shared fixtures of those files live here too.
"""

import pytest
from subprocess_files import collector

pytest_pycollect_makemodule = collector("XPIPE_SPMD_WORKER", "spmd")


@pytest.fixture
def segment_every_loss(monkeypatch):
    """The test models' logits are small: segment their loss all the same (the bound,
    ``xpipe.layout.LOSS_SEGMENTS_FROM``, is for real vocabularies)."""
    import xpipe.layout  # here, not at the top: a worker's test file sets XLA's flags before xpipe is imported

    monkeypatch.setattr(xpipe.layout, "LOSS_SEGMENTS_FROM", 0)
