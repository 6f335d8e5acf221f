"""The order a run's items go in, so that pytest-xdist's workers finish together.

With ``-n N --dist worksteal``, xdist hands the first ``len(items) // N`` items to
the first worker, the next share to the second, and so on, in collection order; a
worker that runs dry steals the tail of the longest queue. In collection order
the long items (an SPMD file is one item of several minutes) bunch up on one
worker, and the other waits: the full tier took 16 min 41 s where its items add
up to 13 min a worker. So the items are dealt, longest first, to the worker whose
share holds the fewest seconds yet, each share the size xdist will cut, and each
share runs longest first: the short items end every queue, where stealing evens
the finish. A file's items stay together in a share, so that its module fixtures
(the compiled pipelines its tests share) are built once a worker.

Each item's seconds come from ``tests/durations.json``, which
``tools/test_durations.py --write-durations`` writes from a run's records; an
item it does not list counts as ``UNLISTED_SECONDS``. The order changes when the
tests run, never what they check.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNLISTED_SECONDS = 1.0


@dataclass
class _Share:
    """The items one worker receives, and their seconds."""

    size: int
    seconds: float = 0.0
    items: list[pytest.Item] = field(default_factory=list)

    @property
    def room(self) -> int:
        return self.size - len(self.items)


def xdist_workers() -> int:
    """How many xdist workers this run has (0 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


def expected_seconds(tier: str, path: Path = DURATIONS) -> dict[str, float]:
    """Each listed item's seconds in ``tier`` (``all``: both tiers' added up)."""
    recorded = json.loads(path.read_text()) if path.exists() else {}
    seconds: dict[str, float] = {}
    for each in ("quick", "full") if tier == "all" else (tier,):
        for nodeid, value in recorded.get(each, {}).items():
            seconds[nodeid] = seconds.get(nodeid, 0.0) + value
    return seconds


def share_sizes(count: int, workers: int) -> list[int]:
    """How many of ``count`` items xdist's worksteal scheduler sends each worker first."""
    sizes = []
    for index in range(workers):
        sizes.append(count // (workers - index))
        count -= sizes[-1]
    return sizes


def balanced_order(items: list[pytest.Item], seconds: dict[str, float], workers: int) -> list[pytest.Item]:
    """``items`` in the order that gives each of ``workers`` an even share of the seconds
    (see the module's docstring)."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(group: list[pytest.Item]) -> float:
        return sum(seconds.get(item.nodeid, UNLISTED_SECONDS) for item in group)

    shares = [_Share(size) for size in share_sizes(len(items), workers)]
    for group in sorted(files.values(), key=cost, reverse=True):
        while group:
            share = min((s for s in shares if s.room), key=lambda s: s.seconds)
            taken, group = group[:share.room], group[share.room:]
            share.items += taken
            share.seconds += cost(taken)
    return [item for share in shares for item in share.items]
