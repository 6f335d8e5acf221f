"""Test harness: every test process sees 8 emulated XLA CPU devices.

The variables must be set before torch_xla is first imported, which is why they
are set here, at collection time. SPMD tests live in ``tests/spmd/``; that
folder's conftest runs each of its files in a fresh process, because SPMD mode is
process-global and cannot share a process with the non-SPMD tests here.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
