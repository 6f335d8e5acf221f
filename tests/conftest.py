"""Test harness: every test process sees 8 emulated XLA CPU devices.

The variables must be set before torch_xla is first imported, which is why they
are set here, at collection time. SPMD tests live in ``tests/spmd/``; that
folder's conftest runs each of its files in a fresh process, because SPMD mode is
process-global and cannot share a process with the non-SPMD tests here.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
# The XLA CPU compiler spends most of a pipeline test's time optimising LLVM code;
# at level 0 the same programs compile about 3x faster. Numerics are unaffected.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"


import pytest  # noqa: E402

from counting import count_captures, count_schedule_builds  # noqa: E402
from tiers import DurationRecorder, add_tier_option, select_tier  # noqa: E402
from worker_order import balanced_order, expected_seconds, xdist_workers  # noqa: E402

SPMD_WORKER = os.environ.get("XPIPE_SPMD_WORKER") == "1"


@pytest.fixture(scope="session", autouse=True)
def xla_autograd_first():
    """One tiny XLA backward before any test's CPU backward.

    A CPU ``backward()`` that runs before the process's first XLA one breaks every
    later XLA backward (an internal assert in autograd's device queues). SPMD
    workers get the same through ``xpipe.mesh.spmd_device()``, which must not be
    preceded by non-SPMD XLA work, so this runs in the main process only.
    """
    if not SPMD_WORKER:
        import torch
        import torch_xla

        probe = torch.zeros(1, device=torch_xla.device(), requires_grad=True)
        (probe * 2).sum().backward()  # a bare probe.sum() does not set the queues up
    yield


def pytest_addoption(parser: pytest.Parser) -> None:
    add_tier_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: in the full tier only (grids of families x meshes, long examples, "
                                       "the checkpoint matrix); run with --tier=full or --tier=all")
    config.pluginmanager.register(DurationRecorder(), "xpipe-durations")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select_tier(config, items)
    if xdist_workers() > 1:  # every xdist worker collects, and must find the same order
        items[:] = balanced_order(items, expected_seconds(config.getoption("tier")), xdist_workers())


@pytest.fixture
def captures(monkeypatch) -> list[str]:
    """The captures of a model (torch.fx traces, torch.export runs) made from here on, in order."""
    return count_captures(monkeypatch.setattr)


@pytest.fixture
def schedule_builds(monkeypatch) -> list[str]:
    """The schedules built from here on (by name, through ``xpipe.schedule.by_name``), in order."""
    return count_schedule_builds(monkeypatch.setattr)
