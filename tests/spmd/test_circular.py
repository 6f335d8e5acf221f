"""The circular schedule under SPMD: ``V`` rounds of the stage ring in one clock loop.

Model stage ``j`` runs on stage group ``j % S``. Each test compares with the same
model unpipelined (``equivalence``: fp32 both sides, rtol 1e-4, atol 1e-5).
"""

import pytest
import torch

import xpipe
from equivalence import assert_pipe_matches, assert_step_matches, train_steps
from pipe_checks import batch_for, loss_of, tiny_lm
from tiers import in_full_tier


@pytest.mark.parametrize("data, stages, virtual, blocks, chunks, checkpoint", [
    in_full_tier(2, 4, 2, 8, 4, "never"),  # one slot per stage: stage 0 takes each output straight off the ring
    (2, 4, 2, 11, 12, "always"),  # 11 blocks on 8 model stages: some stages hold an empty slot
    (2, 4, 2, 8, 5, "never"),  # 5 microbatches padded to 8: two slots, outputs wait for their next round
    in_full_tier(4, 2, 4, 8, 2, "except_last"),  # four rounds of a two-stage ring
    in_full_tier(1, 8, 2, 16, 8, "always"),
])
def test_circular_equals_the_plain_model(data, stages, virtual, blocks, chunks, checkpoint):
    pipe = assert_pipe_matches(tiny_lm(blocks), *batch_for(tiny_lm(blocks), chunks * data), loss_of,
                               chunks=chunks, mesh=xpipe.make_mesh(stages, data), checkpoint=checkpoint,
                               schedule="circular", virtual=virtual)
    assert pipe.executor == "spmd" and pipe.schedule.name == "circular" and pipe.schedule.virtual == virtual
    assert len(pipe.partition.balance) == stages * virtual
    assert sum(pipe.runner.per_stage) == blocks
    assert pipe.schedule.chunks == -(-chunks // stages) * stages, "the schedule that runs, padding included"


@pytest.mark.parametrize("schedule, virtual, data, stages, blocks, checkpoint", [
    ("gpipe", 1, 1, 8, 8, "never"),
    in_full_tier("circular", 2, 1, 8, 16, "except_last"),
    in_full_tier("circular", 2, 2, 4, 8, "always"),
    in_full_tier("circular", 2, 2, 4, 8, "except_last"),
    in_full_tier("circular", 2, 2, 4, 8, "never"),
    ("circular", 2, 2, 4, 7, "except_last"),  # the last model stage holds only the final norm and head
])
def test_step_with_the_loss_inside_equals_the_plain_model(schedule, virtual, data, stages, blocks, checkpoint):
    model = tiny_lm(blocks)
    batch, targets = batch_for(model, 8 * data)
    assert_step_matches(model, batch, targets, loss_of, chunks=8, mesh=xpipe.make_mesh(stages, data),
                        checkpoint=checkpoint, schedule=schedule, virtual=virtual)


def test_five_circular_steps_compile_once():
    model = tiny_lm()
    pipe = xpipe.Pipe(model, chunks=8, mesh=xpipe.make_mesh(4, 2), schedule="circular", virtual=2,
                      loss_fn=loss_of)
    batch, targets = batch_for(model, 16)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses, compiles = train_steps(lambda: pipe.step(batch, targets), optimizer, backward=False)
    assert compiles[1:] == [compiles[0]] * 4, f"compiles after each step: {compiles}"
    assert losses[-1] < losses[0]


def test_a_ring_with_too_few_blocks_is_refused():
    with pytest.raises(ValueError, match=r"virtual: the model's body has 5 blocks, too few for 8 model stages "
                                         r"\(stages x virtual\) to hold a layer each"):
        xpipe.Pipe(tiny_lm(5), chunks=4, mesh=xpipe.make_mesh(4, 2), schedule="circular", virtual=2)
    with pytest.raises(ValueError, match="chunks: a circular pipeline needs at least stages=4 microbatches"):
        xpipe.Pipe(tiny_lm(), chunks=2, mesh=xpipe.make_mesh(4, 2), schedule="circular", virtual=2)
