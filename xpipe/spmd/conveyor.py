"""The conveyor: how microbatches enter, cross and leave the stacked stages.

A step's batch lives on the mesh as a *slot buffer* ``[S * P, R, rows, F]``:
the device of stage ``s`` and replica ``d`` (index ``s * D + d``; the ``D``
replicas of a stage are its data x fsdp devices, each with rows of its own) holds ``R``
slots (microbatches) of ``rows`` rows with ``F`` features each. For batch-first
input this is just a view of the batch sharded over ``("stage", "data", "fsdp")``, so it
costs no communication. Which rows form a
microbatch is the executor's choice; row-wise models give the same result.

Each forward clock ``t`` of the GPipe schedule:

1. stage 0 takes its input from column ``t // S`` of the buffer, every other
   stage takes the previous stage's output (``shift(state, 1)``);
2. every stage runs its blocks (``[S * P, rows, F]`` in, same out);
3. the column being read moves one stage towards stage 0 (``shift(column, -1)``),
   so the next microbatch reaches stage 0; the column being written does too,
   and the last stage writes its result into its bottom slot.

Both column moves travel in one collective-permute, the state in another: two
per clock, and their mirror images in the backward loop. The output of
microbatch ``m`` is written ``S`` times as its column moves, and comes to rest
in the very slot its input started in: the buffer ends the step as a plain view
of the output batch. A column is read empty from the top before it is written
from the bottom, so inputs and outputs share the one buffer.

A circular schedule (``V`` rounds of the ring) runs the same loop ``V * M``
clocks long: in later rounds stage 0 reads the outputs of the round before,
which rest in their slots until their turn (see :func:`column_tables`).

Idle cells (a stage before its first microbatch arrives, or after its last has
left) still compute, and their results are dropped. They run on real rows (the
state starts as a copy of each device's first slot; in the drain stage 0 re-reads
a column), never on zeros: an all-zero attention mask that travels with the
stream would mask every key, and the NaN of such a softmax survives being
multiplied by a zero gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from xpipe.collectives import rotate, shift
from xpipe.layout import microbatch_slots
from xpipe.schedule import FORWARD, Schedule
from xpipe.spmd.ordering import behind


@dataclass(frozen=True)
class SlotLayout:
    """Shape of a step's slot buffer ``[stages * replicas, slots, rows, features]``."""

    stages: int  # S
    replicas: int  # P: row groups per stage (the mesh's data x fsdp devices of a stage)
    chunks: int  # microbatches the user asked for
    slots: int  # R = ceil(chunks / stages): microbatches per stage
    rows: int  # rows of one microbatch on one replica
    batch: int  # rows the user passed (fewer than padded_batch when padded)

    @property
    def padded_chunks(self) -> int:
        """Microbatches run: ``chunks`` rounded up to fill every stage's slots."""
        return self.stages * self.slots

    @property
    def padded_batch(self) -> int:
        return self.padded_chunks * self.replicas * self.rows


def slot_layout(batch: int, chunks: int, stages: int, replicas: int) -> SlotLayout:
    """Lay ``batch`` rows out as ``chunks`` microbatches over ``stages x replicas`` devices.

    A batch that does not split evenly (the last, smaller batch of an epoch) is
    padded with copies of its last row, which only the stacked body sees: the layers before
    and after it, and the output, get exactly the rows given.
    """
    rows = max(1, -(-batch // (chunks * replicas)))
    return SlotLayout(stages, replicas, chunks, microbatch_slots(chunks, stages), rows, batch)


def to_slots(x: torch.Tensor, layout: SlotLayout, microbatched: bool) -> torch.Tensor:
    """Put one tensor of the stream into the flat slot order ``[S * P * R * rows, ...]``.

    ``x`` is ``[batch, ...]``: batch-first rows, already in slot order (padded with
    copies of the last row at the end), or, when ``microbatched``, ``chunks`` microbatches one
    after the other, which are padded and moved into place.
    """
    if not microbatched:
        return _pad(x, 0, layout.padded_batch)
    micro = x.view(layout.chunks, layout.batch // layout.chunks, *x.shape[1:])
    micro = _pad(_pad(micro, 1, layout.replicas * layout.rows), 0, layout.padded_chunks)  # [M', P * rows, ...]
    grid = micro.reshape(layout.stages, layout.slots, layout.replicas, layout.rows, *micro.shape[2:])
    return grid.transpose(1, 2).reshape(layout.padded_batch, *micro.shape[2:])


def from_slots(y: torch.Tensor, layout: SlotLayout, microbatched: bool) -> torch.Tensor:
    """Inverse of :func:`to_slots`: ``[S * P * R * rows, ...] -> [batch, ...]``."""
    if not microbatched:
        return y[: layout.batch]
    grid = y.reshape(layout.stages, layout.replicas, layout.slots, layout.rows, *y.shape[1:])
    micro = grid.transpose(1, 2).reshape(layout.padded_chunks, layout.replicas * layout.rows, *y.shape[1:])
    return micro[: layout.chunks, : layout.batch // layout.chunks].flatten(0, 1)


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with copies of its last entry along ``dim`` appended up to ``size``:
    padding rows are real rows, so they run as safely as any (see idle cells above)."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim)


@dataclass(frozen=True)
class ClockTables:
    """What the conveyor does at each forward clock ``t`` of a step (``T`` clocks)."""

    reads: np.ndarray  # [T, R] one-hot: the buffer column stage 0 reads (none in the drain, or off the ring)
    writes: np.ndarray  # [T, R] one-hot: the buffer column the last stage writes (none in the fill)
    from_ring: np.ndarray  # [T]: 1 where stage 0 takes what the last stage made one clock before
    rounds: np.ndarray  # [T, S] int: the round of the ring each stage runs (clamped in idle cells)


def column_tables(schedule: Schedule, layout: SlotLayout) -> ClockTables:
    """The conveyor's tables for ``schedule``: GPipe's fill-drain, or circular's
    ``V`` rounds of it back to back.

    Each clock stage 0 reads the next microbatch: in the first round from the
    buffer; in later ones the last stage's output of round ``v - 1``. That output
    is written into the buffer as in the last round, where it rests in its
    microbatch's own slot until stage 0 reads it again ``M`` clocks after it
    entered (reading a column empties it from the top as writing fills it from
    the bottom, so one buffer serves both). With one slot per stage (``M = S``)
    the output is needed the very next clock, before it could climb back up the
    column; stage 0 then takes it straight off the ring.

    Raises:
        ValueError: if the schedule's forward is not the wavefront this conveyor
            runs (stage ``s`` runs round ``(t - s) // M``, microbatch ``(t - s) % M``
            at clock ``t``, rounds back to back).
    """
    rows = schedule.forward_clocks()
    stages, chunks, rounds = layout.stages, layout.padded_chunks, schedule.virtual
    span = rounds * chunks  # clocks stage 0 works
    tables = ClockTables(np.zeros((len(rows), layout.slots), np.float32),
                         np.zeros((len(rows), layout.slots), np.float32),
                         np.zeros(len(rows), np.float32), np.zeros((len(rows), stages), np.int64))
    for clock, row in enumerate(rows):
        for stage, action in enumerate(row):
            cell = clock - stage
            expected = (cell // chunks * stages + stage, cell % chunks) if 0 <= cell < span else None
            running = (action.stage, action.microbatch) if action is not None and action.kind == FORWARD else None
            if running != expected:
                raise ValueError(f"schedule: the spmd executor runs fill-drain forwards round the stage ring; "
                                 f"{schedule.name!r} runs {action} on rank {stage} at clock {clock}")
            tables.rounds[clock, stage] = min(max(cell, 0) // chunks, rounds - 1)
        if clock < span and (clock < stages or layout.slots > 1):
            tables.reads[clock, clock % chunks // stages] = 1
        elif clock < span:
            tables.from_ring[clock] = 1
        if stages - 1 <= clock < span + stages - 1:
            tables.writes[clock, (clock - stages + 1) % chunks // stages] = 1
    return tables


StageFn = Callable[..., torch.Tensor]


def make_tick(stages: int, replicas: int, run_stages: StageFn, ring: bool = False) -> Callable:
    """The body of the clock loop, for ``torch_xla.experimental.scan``.

    Every tensor's dim 0 is the mesh's ``S * P`` devices, stage-major, so moving
    a slice one stage on is a shift by ``D`` places. Carry:
    ``(state [S*D, rows, F], buffer [S*D, R, rows, F], valid [S*D, V, K], weights)``;
    per clock: the one-hot read and write columns ``[R]``, the ring flag ``[]``,
    each device's one-hot round ``[S*D, V]`` and the int32 key of the cell it runs
    ``[S*D]`` (for dropout masks). ``ring``: the state moves round the ring (the
    last stage's to stage 0), for circular schedules that take it from there.
    """

    def next_stage(x: torch.Tensor, direction: int, around: bool = False) -> torch.Tensor:
        if around:
            return rotate(x, direction * replicas)
        if stages > 1:
            return shift(x, direction * replicas)
        # Nothing moves with one stage; ``x * 0`` (not zeros_like) keeps every carry
        # in the traced graph, as scan needs a gradient for each.
        return x * 0

    def tick(carry, columns):
        state, buffer, valid, weights = carry
        read, write, from_ring, rounds, keys = columns
        device = torch.arange(stages * replicas, device=state.device)
        first = (device < replicas).view(-1, *[1] * (state.dim() - 1))
        last = (device >= (stages - 1) * replicas).view(-1, *[1] * (state.dim() - 1))
        read_mask = _column_mask(read, buffer)
        write_mask = _column_mask(write, buffer)
        # In the drain no microbatch enters; stage 0 runs a column it already ran instead
        # of zeros, whose result is dropped (see the module docstring on idle cells).
        entering = torch.where(read.sum() > 0, (buffer * read_mask).sum(1), buffer[:, 0])  # [S*D, rows, F]
        leaving = (buffer * write_mask).sum(1)
        previous = next_stage(state, 1, ring)
        entering_now = torch.where(from_ring > 0, previous, entering)
        state = run_stages(weights, valid, torch.where(first, entering_now, previous), rounds, keys)
        columns = behind(torch.stack([entering, leaving], 1), state.unsqueeze(1))  # both columns, one permute,
        moved = next_stage(columns, -1)  # ordered with the blocks' collectives
        leaving = torch.where(last, state, moved[:, 1])
        buffer = torch.where(read_mask > 0, moved[:, 0].unsqueeze(1), buffer)
        buffer = torch.where(write_mask > 0, leaving.unsqueeze(1), buffer)
        return (state, buffer, valid, weights), None

    return tick


def _column_mask(onehot: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``[R]`` -> ``[1, R, 1, ...]`` to broadcast against a slot buffer."""
    return onehot.view(1, -1, *([1] * (buffer.dim() - 2)))
