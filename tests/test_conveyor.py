"""The conveyor's layout and clock tables, on the CPU.

Simulates the conveyor with labels instead of tensors to check the claim its
design rests on: every microbatch enters stage 0 at its clock (in each round of
a circular schedule), and its output comes to rest in the slot its input
started in.
"""

import numpy as np
import pytest
import torch

from xpipe.schedule import by_name, circular, gpipe
from xpipe.spmd.conveyor import column_tables, from_slots, slot_layout, to_slots


def simulate(stages: int, chunks: int, rounds: int = 1):
    """Run the conveyor's tables on labels ``(slot's stage, slot, times through the
    stages)``: what stage 0 is fed at each clock, and the buffer at the end."""
    layout = slot_layout(chunks, chunks, stages, 1)
    schedule = gpipe(stages, layout.padded_chunks) if rounds == 1 else circular(stages, layout.padded_chunks, rounds)
    tables = column_tables(schedule, layout)
    buffer = [[(s, r, 0) for r in range(layout.slots)] for s in range(stages)]
    pipeline = [None] * stages  # what each stage holds after the clock: its input, run once more
    fed = []
    for clock in range(len(tables.reads)):
        read, write = np.flatnonzero(tables.reads[clock]), np.flatnonzero(tables.writes[clock])
        finished = pipeline[-1]
        entering = buffer[0][read[0]] if read.size else finished if tables.from_ring[clock] else None
        pipeline = [entering] + pipeline[:-1]
        pipeline = [None if cell is None else cell[:2] + (cell[2] + 1,) for cell in pipeline]
        fed.append(entering)
        for column, is_written in ((read, False), (write, True)):
            if column.size:
                moved = [buffer[s][column[0]] for s in range(1, stages)]
                bottom = pipeline[-1] if is_written else None
                for s, item in enumerate(moved + [bottom]):
                    buffer[s][column[0]] = item
    return layout, fed, buffer, tables


@pytest.mark.parametrize("stages, chunks, rounds", [
    (1, 1, 1), (2, 2, 1), (4, 8, 1), (4, 4, 1), (4, 1, 1), (3, 7, 1), (8, 32, 1),
    (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 7, 3), (8, 8, 2), (2, 6, 3), (1, 1, 3), (1, 3, 2),
])
def test_each_microbatch_enters_on_time_and_comes_to_rest_in_its_slot(stages, chunks, rounds):
    layout, fed, buffer, tables = simulate(stages, chunks, rounds)
    chunks = layout.padded_chunks
    expected = [(p % stages, p // stages, v * stages) for v in range(rounds) for p in range(chunks)]
    assert fed[: rounds * chunks] == expected, "round v of each microbatch enters stage 0 at clock v * M + m"
    assert all(entry is None for entry in fed[rounds * chunks:])
    assert buffer == [[(s, r, rounds * stages) for r in range(layout.slots)] for s in range(stages)]
    assert bool(tables.from_ring.any()) == (rounds > 1 and layout.slots == 1)


def test_tables_mark_one_column_per_clock():
    layout = slot_layout(8, 8, 4, 1)
    tables = column_tables(gpipe(4, 8), layout)
    assert tables.reads.shape == tables.writes.shape == (11, 2)
    assert tables.reads.sum(1).tolist() == [1] * 8 + [0] * 3
    assert tables.writes.sum(1).tolist() == [0] * 3 + [1] * 8
    tables = column_tables(circular(4, 8, 2), layout)
    assert tables.reads.sum(1).tolist() == [1] * 16 + [0] * 3
    assert tables.writes.sum(1).tolist() == [0] * 3 + [1] * 16
    assert tables.rounds[:, 0].tolist() == [0] * 8 + [1] * 11  # idle cells keep their last round
    assert tables.rounds[:, 3].tolist() == [0] * 11 + [1] * 8


def test_a_schedule_the_conveyor_does_not_run_is_refused():
    with pytest.raises(ValueError, match="schedule: the spmd executor runs fill-drain forwards round the stage "
                                         "ring; '1f1b' runs 0B0 on rank 0 at clock 2"):
        column_tables(by_name("1f1b", 2, 4), slot_layout(4, 4, 2, 1))


def test_layout_pads_chunks_to_fill_every_stage():
    layout = slot_layout(batch=12, chunks=3, stages=4, replicas=2)
    assert (layout.slots, layout.rows, layout.padded_chunks, layout.padded_batch) == (1, 2, 4, 16)


@pytest.mark.parametrize("batch, chunks, rows, padded", [(10, 4, 2, 16), (12, 4, 2, 16), (3, 4, 1, 8)])
def test_layout_pads_a_batch_that_does_not_split(batch, chunks, rows, padded):
    """A ragged last batch runs: rows per replica rounded up, rows added for the body only."""
    layout = slot_layout(batch, chunks, 4, 2)
    assert (layout.rows, layout.padded_batch) == (rows, padded)


@pytest.mark.parametrize("microbatched, batch, chunks", [
    (False, 24, 6), (False, 10, 4), (False, 6, 3),  # batch-first, ragged ones included
    (True, 24, 6), (True, 6, 3),  # a microbatch dim always holds chunks equal microbatches
])
def test_slots_round_trip(microbatched, batch, chunks):
    layout = slot_layout(batch=batch, chunks=chunks, stages=4, replicas=2)
    x = torch.arange(batch * 3.0).view(batch, 3)
    flat = to_slots(x, layout, microbatched)
    assert flat.shape == (layout.padded_batch, 3)
    assert set(map(tuple, flat.tolist())) == set(map(tuple, x.tolist())), "padding rows are copies of real rows"
    torch.testing.assert_close(from_slots(flat, layout, microbatched), x)
