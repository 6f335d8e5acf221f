"""Runs each test file here in a process of its own (non-SPMD, 8 devices).

These files build many devices-executor pipelines and run ``pipe.step``. Run in
the main test process after many other pipelines, torch_xla 2.9 crashed inside
``_xla_sync_multi`` (a segmentation fault or abort; reproduced with
``tests/test_real_models.py`` and these tests in one process, not with either
alone); a process per file keeps each run within what was seen to work.
"""

from subprocess_files import collector

pytest_pycollect_makemodule = collector("XPIPE_OWN_PROCESS_WORKER", "own-process")
