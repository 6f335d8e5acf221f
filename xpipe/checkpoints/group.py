"""The processes that write one checkpoint together: this process alone, or, on a
pod, one process per host, joined by ``torch.distributed``'s default group.

Each process writes the shards its devices hold (DCP agrees one plan over the
group, each chunk written by one process); process 0 makes the staging
directory, writes the manifest from every process's file hashes and puts the
checkpoint in place. The group carries only small Python objects (a path, file
hashes, an outcome), so a CPU backend (gloo) is what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist
import torch_xla.runtime as xr

T = TypeVar("T")


@dataclass(frozen=True)
class SaveGroup:
    """This process's ``rank`` among the ``size`` processes that write a checkpoint."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of_run(cls) -> SaveGroup:
        """The group of this run: torch.distributed's default group where one is set up,
        else this process alone. A run of several XLA processes (hosts) without a group
        over all of them is refused: each host would write a checkpoint of its own shards
        in place of the others'."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        processes = xr.process_count()
        if processes > 1 and world != processes:
            raise RuntimeError(f"xpipe.save: this run has {processes} processes (hosts) and "
                               f"{'no torch.distributed process group' if world == 1 else f'a group of {world}'}; "
                               "the hosts write one checkpoint together over a group of all of them: call "
                               "torch.distributed.init_process_group('gloo', init_method='xla://') on every host "
                               "before the first save")
        return cls(dist.get_rank() if world > 1 else 0, world)

    @property
    def alone(self) -> bool:
        return self.size == 1

    def from_first(self, make: Callable[[], T]) -> T:
        """``make()`` run on process 0, its result given to every process."""
        if self.alone:
            return make()
        value = [make() if self.rank == 0 else None]
        dist.broadcast_object_list(value, src=0)
        return value[0]

    def on_every_process(self, action: Callable[[], T]) -> list[T]:
        """``action()`` run on every process, the results of all (by rank) on each. If it
        raised anywhere, every process raises: the one where it did with its own error,
        the others naming that process."""
        if self.alone:
            return [action()]
        error: Exception | None = None
        try:
            outcome: tuple[bool, Any] = (True, action())
        except Exception as raised:  # noqa: BLE001 - every process must hear of it first
            error, outcome = raised, (False, f"{type(raised).__name__}: {raised}")
        outcomes: list[Any] = [None] * self.size
        dist.all_gather_object(outcomes, outcome)
        if error is not None:
            raise error
        for rank, (ok, value) in enumerate(outcomes):
            if not ok:
                raise RuntimeError(f"xpipe.save: process {rank} of {self.size} failed: {value}")
        return [value for _, value in outcomes]
