"""The conveyor's layout and clock tables, on the CPU.

Simulates the conveyor with labels instead of tensors to check the claim its
design rests on: every microbatch enters stage 0 at its clock, and its output
comes to rest in the slot its input started in.
"""

import numpy as np
import pytest
import torch

from xpipe.schedule import gpipe
from xpipe.spmd.conveyor import column_tables, from_slots, make_layout, to_slots


def simulate(stages: int, chunks: int):
    layout = make_layout(chunks, chunks, stages, 1)
    reads, writes = column_tables(gpipe(stages, layout.padded_chunks), layout)
    inputs = [[("in", s, r) for r in range(layout.slots)] for s in range(stages)]
    outputs = [[None] * layout.slots for _ in range(stages)]
    pipeline = [None] * stages
    fed = []
    for clock in range(len(reads)):
        read = np.flatnonzero(reads[clock])
        entering = inputs[0][read[0]] if read.size else None
        pipeline = [entering] + pipeline[:-1]  # stage s now works on what stage s-1 had
        fed.append(entering)
        if read.size:
            column = [inputs[s][read[0]] for s in range(1, stages)] + [None]
            for s in range(stages):
                inputs[s][read[0]] = column[s]
        write = np.flatnonzero(writes[clock])
        if write.size:
            column = [outputs[s][write[0]] for s in range(1, stages)] + [("out",) + pipeline[-1][1:]]
            for s in range(stages):
                outputs[s][write[0]] = column[s]
    return layout, fed, outputs


@pytest.mark.parametrize("stages, chunks", [(1, 1), (2, 2), (4, 8), (4, 4), (4, 1), (3, 7), (8, 32)])
def test_each_output_comes_to_rest_where_its_input_started(stages, chunks):
    layout, fed, outputs = simulate(stages, chunks)
    slots_in_feed_order = [("in", t % stages, t // stages) for t in range(layout.padded_chunks)]
    assert fed[: layout.padded_chunks] == slots_in_feed_order
    assert all(entry is None for entry in fed[layout.padded_chunks:])
    assert outputs == [[("out", s, r) for r in range(layout.slots)] for s in range(stages)]


def test_tables_mark_one_column_per_clock():
    layout = make_layout(8, 8, 4, 1)
    reads, writes = column_tables(gpipe(4, 8), layout)
    assert reads.shape == writes.shape == (11, 2)
    assert reads.sum(1).tolist() == [1] * 8 + [0] * 3
    assert writes.sum(1).tolist() == [0] * 3 + [1] * 8


def test_layout_pads_chunks_to_fill_every_stage():
    layout = make_layout(batch=12, chunks=3, stages=4, data=2)
    assert (layout.slots, layout.rows, layout.padded_chunks, layout.padded_batch) == (1, 2, 4, 16)


@pytest.mark.parametrize("batch, chunks, rows, padded", [(10, 4, 2, 16), (12, 4, 2, 16), (3, 4, 1, 8)])
def test_layout_pads_a_batch_that_does_not_split(batch, chunks, rows, padded):
    """A ragged last batch runs: rows per replica rounded up, rows added for the body only."""
    layout = make_layout(batch, chunks, 4, 2)
    assert (layout.rows, layout.padded_batch) == (rows, padded)


@pytest.mark.parametrize("microbatched, batch, chunks", [
    (False, 24, 6), (False, 10, 4), (False, 6, 3),  # batch-first, ragged ones included
    (True, 24, 6), (True, 6, 3),  # a microbatch dim always holds chunks equal microbatches
])
def test_slots_round_trip(microbatched, batch, chunks):
    layout = make_layout(batch=batch, chunks=chunks, stages=4, data=2)
    x = torch.arange(batch * 3.0).view(batch, 3)
    flat = to_slots(x, layout, microbatched)
    assert flat.shape == (layout.padded_batch, 3)
    assert set(map(tuple, flat.tolist())) == set(map(tuple, x.tolist())), "padding rows are copies of real rows"
    torch.testing.assert_close(from_slots(flat, layout, microbatched), x)
