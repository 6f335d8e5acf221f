"""The conveyor: how microbatches enter, cross and leave the stacked stages.

A step's batch lives on the mesh as a *slot buffer* ``[S * D, R, rows, F]``:
the device of stage ``s`` and data replica ``d`` (index ``s * D + d``) holds ``R``
slots (microbatches) of ``rows`` rows with ``F`` features each. For batch-first
input this is just a view of the batch sharded over ``("stage", "data")``, so it
costs no communication. Which rows form a
microbatch is the executor's choice; row-wise models give the same result.

Each forward clock ``t`` of the GPipe schedule:

1. stage 0 takes its input from column ``t // S`` of the input buffer, every other
   stage takes the previous stage's output (``shift(state, 1)``);
2. every stage runs its blocks (``[S * D, rows, F]`` in, same out);
3. the active input column moves one stage down (``shift(column, -1)``), so
   the next microbatch reaches stage 0; the active output column does too, and
   the last stage writes its result into it.

Both column moves travel in one collective-permute, the state in another: two
per clock, and their mirror images in the backward loop.

Idle cells (a stage before its first microbatch arrives, or after its last has
left) still compute, and their results are dropped. They run on real rows (the
state starts as a copy of each device's first slot; in the drain stage 0 re-reads
a column), never on zeros: an all-zero attention mask that travels with the
stream would mask every key, and the NaN of such a softmax survives being
multiplied by a zero gradient. The output column of
microbatch ``m`` is written ``S`` times as it moves, and comes to rest in the
very slot its input started in; so the output buffer is again a plain view of
the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from xpipe.collectives import shift
from xpipe.schedule import FORWARD, Schedule


@dataclass(frozen=True)
class Layout:
    """Shape of a step's slot buffer ``[stages * data, slots, rows, features]``."""

    stages: int  # S
    data: int  # D
    chunks: int  # microbatches the user asked for
    slots: int  # R = ceil(chunks / stages): microbatches per stage
    rows: int  # rows of one microbatch on one data replica
    batch: int  # rows the user passed (fewer than padded_batch when padded)

    @property
    def padded_chunks(self) -> int:
        """Microbatches run: ``chunks`` rounded up to fill every stage's slots."""
        return self.stages * self.slots

    @property
    def padded_batch(self) -> int:
        return self.padded_chunks * self.data * self.rows


def make_layout(batch: int, chunks: int, stages: int, data: int) -> Layout:
    """Lay ``batch`` rows out as ``chunks`` microbatches over a ``data x stages`` mesh.

    A batch that does not split evenly (the last, smaller batch of an epoch) is
    padded with copies of its last row, which only the stacked body sees: the layers before
    and after it, and the output, get exactly the rows given.
    """
    return Layout(stages, data, chunks, -(-chunks // stages), max(1, -(-batch // (chunks * data))), batch)


def to_slots(x: torch.Tensor, layout: Layout, microbatched: bool) -> torch.Tensor:
    """Put one tensor of the stream into the flat slot order ``[S * D * R * rows, ...]``.

    ``x`` is ``[batch, ...]``: batch-first rows, already in slot order (padded with
    copies of the last row at the end), or, when ``microbatched``, ``chunks`` microbatches one
    after the other, which are padded and moved into place.
    """
    if not microbatched:
        return _pad(x, 0, layout.padded_batch)
    micro = x.view(layout.chunks, layout.batch // layout.chunks, *x.shape[1:])
    micro = _pad(_pad(micro, 1, layout.data * layout.rows), 0, layout.padded_chunks)  # [M', D * rows, ...]
    grid = micro.reshape(layout.stages, layout.slots, layout.data, layout.rows, *micro.shape[2:])
    return grid.transpose(1, 2).reshape(layout.padded_batch, *micro.shape[2:])


def from_slots(y: torch.Tensor, layout: Layout, microbatched: bool) -> torch.Tensor:
    """Inverse of :func:`to_slots`: ``[S * D * R * rows, ...] -> [batch, ...]``."""
    if not microbatched:
        return y[: layout.batch]
    grid = y.reshape(layout.stages, layout.data, layout.slots, layout.rows, *y.shape[1:])
    micro = grid.transpose(1, 2).reshape(layout.padded_chunks, layout.data * layout.rows, *y.shape[1:])
    return micro[: layout.chunks, : layout.batch // layout.chunks].flatten(0, 1)


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with copies of its last entry along ``dim`` appended up to ``size``:
    padding rows are real rows, so they run as safely as any (see idle cells above)."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*x.shape[:dim], missing, *x.shape[dim + 1:])], dim)


def column_tables(schedule: Schedule, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """One-hot input and output columns per forward clock, ``[clocks, R]`` each.

    Row ``t`` of the input table marks the column stage 0 reads at clock ``t``
    (none in the drain); row ``t`` of the output table marks the column the last
    stage writes (none in the fill).

    Raises:
        ValueError: if the schedule's forward is not the fill-drain wavefront
            (stage ``s`` runs microbatch ``t - s`` at clock ``t``) this conveyor runs.
    """
    rows = schedule.forward_clocks()
    last = layout.stages - 1
    inputs = np.zeros((len(rows), layout.slots), np.float32)
    outputs = np.zeros((len(rows), layout.slots), np.float32)
    for clock, row in enumerate(rows):
        for stage, action in enumerate(row):
            expected = clock - stage
            running = action.microbatch if action is not None and action.kind == FORWARD else None
            if running != (expected if 0 <= expected < layout.padded_chunks else None):
                raise ValueError(f"schedule: the spmd executor runs fill-drain forwards; {schedule.name!r} "
                                 f"runs {action} on stage {stage} at clock {clock}")
        if clock < layout.padded_chunks:
            inputs[clock, clock // layout.stages] = 1
        if clock >= last:
            outputs[clock, (clock - last) // layout.stages] = 1
    return inputs, outputs


StageFn = Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_tick(stages: int, data: int, run_stages: StageFn) -> Callable:
    """The body of the clock loop, for ``torch_xla.experimental.scan``.

    Every tensor's dim 0 is the mesh's ``S * D`` devices, stage-major, so moving
    a slice one stage on is a shift by ``D`` places. Carry:
    ``(state [S*D, rows, F], inputs [S*D, R, rows, F], outputs [S*D, R, rows, F],
    valid [S*D, K], weights)``; per clock: the one-hot input and output columns ``[R]``
    and the int32 key of the cell each device runs ``[S*D]`` (for dropout masks).
    """

    def next_stage(x: torch.Tensor, direction: int) -> torch.Tensor:
        if stages > 1:
            return shift(x, direction * data)
        # Nothing moves with one stage; ``x * 0`` (not zeros_like) keeps every carry
        # in the traced graph, as scan needs a gradient for each.
        return x * 0

    def tick(carry, columns):
        state, inputs, outputs, valid, weights = carry
        read, write, keys = columns
        device = torch.arange(stages * data, device=state.device)
        first = (device < data).view(-1, *[1] * (state.dim() - 1))
        last = (device >= (stages - 1) * data).view(-1, *[1] * (state.dim() - 1))
        read_mask = _column_mask(read, inputs)
        write_mask = _column_mask(write, outputs)
        # In the drain no microbatch enters; stage 0 runs a column it already ran instead
        # of zeros, whose result is dropped (see the module docstring on idle cells).
        entering = torch.where(read.sum() > 0, (inputs * read_mask).sum(1), inputs[:, 0])  # [S*D, rows, F]
        leaving = (outputs * write_mask).sum(1)
        state = run_stages(weights, valid, torch.where(first, entering, next_stage(state, 1)), keys)
        moved = next_stage(torch.stack([entering, leaving], 1), -1)  # both columns, one permute
        leaving = torch.where(last, state, moved[:, 1])
        inputs = torch.where(read_mask > 0, moved[:, 0].unsqueeze(1), inputs)
        outputs = torch.where(write_mask > 0, leaving.unsqueeze(1), outputs)
        return (state, inputs, outputs, valid, weights), None

    return tick


def _column_mask(onehot: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``[R]`` -> ``[1, R, 1, ...]`` to broadcast against a slot buffer."""
    return onehot.view(1, -1, *([1] * (buffer.dim() - 2)))
