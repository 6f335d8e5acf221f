"""The processes that write one checkpoint together: this process alone, or, on a
pod, one process per host, joined by ``torch.distributed``'s default group.

Each process writes the shards its devices hold (DCP agrees one plan over the
group, each piece written by one process); process 0 makes the staging
directory, writes the manifest from every process's file hashes and puts the
checkpoint in place. The group carries only small Python objects (a path, file
hashes, an outcome), so a CPU backend (gloo) is what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
import torch_xla.runtime as xr

T = TypeVar("T")

JOIN_SECONDS = 30.0  # how long the processes of a save or load wait for one another to call it


@dataclass(frozen=True)
class SaveGroup:
    """This process's ``rank`` among the ``size`` processes that write a checkpoint."""

    rank: int = 0
    size: int = 1

    @classmethod
    def of_process_group(cls) -> SaveGroup:
        """torch.distributed's default group where one is set up, else this process alone."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @classmethod
    def of_run(cls) -> SaveGroup:
        """The group of this run: torch.distributed's default group where one is set up,
        else this process alone. A run of several XLA processes (hosts) without a group
        over all of them is refused: each host would write a checkpoint of its own shards
        in place of the others'."""
        group = cls.of_process_group()
        world, processes = group.size, xr.process_count()
        if processes > 1 and world != processes:
            raise RuntimeError(f"xpipe.save: this run has {processes} processes (hosts) and "
                               f"{'no torch.distributed process group' if world == 1 else f'a group of {world}'}; "
                               "the hosts write one checkpoint together over a group of all of them: call "
                               "torch.distributed.init_process_group('gloo', init_method='xla://') on every host "
                               "before the first save")
        return group

    @property
    def alone(self) -> bool:
        return self.size == 1

    def joined(self, action: str, path: Path) -> None:
        """Every process of the group has called ``action`` (``"xpipe.save"`` or
        ``"xpipe.load"``) for one ``path``, checked before anything is written or read.

        A process that does not call it is named within ``JOIN_SECONDS`` (on a gloo
        group, through its monitored barrier; another backend waits for its own
        timeout). Paths that differ, as ``f"ckpt-{rank}"`` gives under DDP, are refused
        on every process, naming each: the processes write one checkpoint together,
        so each would put its shards into the checkpoint of process 0's path.
        """
        if self.alone:
            return
        if dist.get_backend() == "gloo":
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=JOIN_SECONDS), wait_all_ranks=True)
            except RuntimeError as error:
                reason = str(error).strip().splitlines()[0]
                raise RuntimeError(f"{action}: not every one of the {self.size} processes of this run called it "
                                   f"within {JOIN_SECONDS:g} s ({reason}). Every process (one per host) calls "
                                   f"{action} at the same point of the run, with the same path: together they "
                                   "write one checkpoint") from None
        paths: list[Any] = [None] * self.size
        dist.all_gather_object(paths, os.path.abspath(path))
        if len(set(paths)) > 1:
            given = ", ".join(f"process {rank}: {value!r}" for rank, value in enumerate(paths))
            raise ValueError(f"path: the {self.size} processes of this run share one checkpoint, at one path, "
                             f"but {action} was given different ones ({given}); pass every process the same "
                             "path (not one per rank: each process writes, or reads, its own shards there)")

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
