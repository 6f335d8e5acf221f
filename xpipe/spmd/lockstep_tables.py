"""The per-clock tables of 1F1B inside the one SPMD program, read from
:class:`xpipe.schedule.Lockstep`: which slot buffer column stage 0 reads and writes,
which stages run a forward or a backward, and which slot of the ring of stashed
stage inputs each writes and reads (:mod:`xpipe.spmd.one_f_one_b` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xpipe.schedule import Lockstep


@dataclass(frozen=True)
class OneFOneBTables:
    """Per clock ``t`` of the ``T = M + 2S - 2`` clocks of a step, what each stage does.

    Attributes:
        reads: ``[T, R]`` one-hot: the slot buffer's column stage 0 reads (none once all have entered).
        gradient_writes: ``[T, R]`` one-hot: the slot buffer's column stage 0 writes an input's
            gradient into (a column read empty before).
        forwards: ``[T, S]`` 1 where the stage runs a microbatch's forward.
        backwards: ``[T, S]`` 1 where the stage runs a microbatch's backward.
        stash_writes: ``[T]`` the ring slot every stage's input is stashed in: the clock's
            index modulo ``W``.
        stash_reads: ``[T, S]`` the ring slot each stage's backward reads.
        backward_clocks: ``[T, S]`` the clock of the forward the stage's backward recomputes
            (its dropout masks are that clock's).
        ring: ``W``, the ring's slots (:attr:`xpipe.schedule.Lockstep.ring`).

    Every stage writes the same slot each clock, idle cells too: stage ``s`` reads what
    it wrote ``2(S - 1 - s) < W`` clocks later, before the slot comes round again. So
    the write is one in-place update at one index on every device, and each device
    reads its own slot.
    """

    reads: np.ndarray
    gradient_writes: np.ndarray
    forwards: np.ndarray
    backwards: np.ndarray
    stash_writes: np.ndarray
    stash_reads: np.ndarray
    backward_clocks: np.ndarray
    ring: int

    @property
    def chunks(self) -> int:
        """``M``: microbatches the step runs."""
        clocks, stages = self.forwards.shape
        return clocks - 2 * stages + 2


def one_f_one_b_tables(stages: int, chunks: int, slots: int) -> OneFOneBTables:
    """The tables for ``chunks`` microbatches (a multiple of ``stages``, ``slots`` of them
    a stage) on ``stages`` stages, read from :class:`xpipe.schedule.Lockstep`."""
    lockstep = Lockstep(stages, chunks)
    clocks, width = lockstep.clocks, lockstep.ring
    tables = OneFOneBTables(np.zeros((clocks, slots), np.float32), np.zeros((clocks, slots), np.float32),
                            np.zeros((clocks, stages), np.float32), np.zeros((clocks, stages), np.float32),
                            np.arange(clocks, dtype=np.int64) % width, np.zeros((clocks, stages), np.int64),
                            np.zeros((clocks, stages), np.int64), width)
    for clock in range(clocks):
        entering, emerged = lockstep.forward(clock, 0), lockstep.backward(clock, 0)
        if entering is not None:
            tables.reads[clock, entering // stages] = 1
        if emerged is not None:  # the microbatch whose gradient leaves stage 0
            tables.gradient_writes[clock, emerged // stages] = 1
        for stage in range(stages):
            forward, backward = lockstep.forward(clock, stage), lockstep.backward(clock, stage)
            tables.stash_reads[clock, stage] = (clock - 2 * (stages - 1 - stage)) % width
            if forward is not None:
                tables.forwards[clock, stage] = 1
            if backward is not None:
                tables.backwards[clock, stage] = 1
                tables.backward_clocks[clock, stage] = backward + stage
    return tables
