"""The bytes each part of a step holds on one device, from a model's profile and a
layout: the terms :mod:`xpipe.planner.timeline` lays out moment by moment, for GPipe
and circular (:func:`step_terms`) and for 1F1B (:func:`lockstep_terms`).

docs/planning.md ("How the prediction is made") derives each term from XLA's
buffer assignment on the emulated devices.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from xpipe.layout import MeshAxes, is_vocabulary_table, loss_segments, microbatch_slots, outer_step_numel
from xpipe.planner.memory import DeviceMemory
from xpipe.planner.profile import ModelProfile
from xpipe.planner.timeline import LockstepTerms, StepTerms
from xpipe.schedule import Lockstep

if TYPE_CHECKING:
    from xpipe.planner.search import Layout


def _vocabulary_table(profile: ModelProfile) -> tuple[int, ...] | None:
    """The largest weight around the body longer than it is wide: the embedding or LM head."""
    tables = [shape for shape in profile.outer_weights if is_vocabulary_table(shape)]
    return max(tables, key=math.prod) if tables else None


def _loss_segments(profile: ModelProfile, layout: Layout, batch: int) -> int:
    """The segments the loss runs over on ``layout`` (``xpipe.layout.loss_segments``, the
    executor's rule), from the logits a device would make for its rows."""
    table = _vocabulary_table(profile)
    if table is None:
        return 1
    logits = layout.outer_rows(batch) * profile.tokens_per_row * table[0] / layout.tensor
    return loss_segments(profile.tokens_per_row, logits)


def _loss_accumulator_bytes(profile: ModelProfile, axes: MeshAxes) -> int:
    """The loss over sequence segments adds up the LM head's gradient in float32, each row
    group on its own devices (``xpipe.spmd.segmented_loss``): a tensor device's share of
    the vocabulary table, 4 bytes an element."""
    return 4 * outer_step_numel([_vocabulary_table(profile)], axes)


def step_terms(profile: ModelProfile, layout: Layout, depth: int, rows: int, batch: int, weights: DeviceMemory,
               loop_clocks: tuple[int, int]) -> StepTerms:
    """The bytes each part of a GPipe or circular step holds on the busiest device
    (:class:`StepTerms`): the conveyor's slot buffer and stage state, the inputs each clock
    of the recomputing loop keeps, everything each clock of the keeping loop saves, one
    recomputed cell's working set, the layers around the body on the device's rows, and
    the weights. ``depth``: block slots per model stage; ``rows``: a microbatch's on one
    device; ``loop_clocks``: the forward clocks of the loop that recomputes and of the
    one that keeps (:func:`xpipe.recompute.first_kept_clock` splits them)."""
    stream = rows * profile.stream_bytes_per_row
    conveyed = stream / layout.tensor  # each tensor device carries its share between stages (Packing.ways)
    block = _block_saved(profile, layout, rows)
    cell = depth * block  # one stage's blocks
    # What a recomputed cell keeps: its input as the conveyor holds it, or per block (each slot
    # recomputed on its own) every block's input, whole. Gathered per block, the backward recomputes
    # one block at a time, each after the gradient it serves (xpipe.spmd.ordering.after_gradient):
    # one block's activations at once; otherwise the cell's.
    slot_input = conveyed if layout.sequence_parallel else stream  # a block's input: its slices, or whole
    recomputed = slot_input * depth if layout.gather == "block" else conveyed
    working = block if layout.gather == "block" else cell
    slots = microbatch_slots(layout.chunks, layout.stages)
    # Every forward clock keeps, on every stage, what its loop keeps: the idle cells run real rows.
    recomputing, keeping = loop_clocks
    segments = _loss_segments(profile, layout, batch)
    # The layers around the body: mostly the logits, split by vocabulary over "tensor" (layout.outer_step_spec),
    # made one sequence segment at a time for the loss (xpipe.spmd.segmented_loss).
    around = layout.outer_rows(batch) * profile.outer_saved_bytes_per_row / segments / layout.tensor
    # Gathered once per step, the weights get gradients of their size (per_device counts both); per block,
    # each slot's gradient is reduced into the resting shard as the backward makes it, and only the outer
    # layers' is whole.
    copies = weights.gathered // 2 if layout.gather == "step" else weights.gathered
    gradients = copies if layout.gather == "step" else weights.gathered_outer
    # The recomputing loop keeps its cells' inputs, the stage's weights among them (every round's, on a
    # circular stage); a keeping clock keeps what its cell read: the round's weights.
    return StepTerms(
        resting=_resting(weights), gathered=copies, gathered_gradients=gradients,
        outer_gradients=weights.gathered_outer,
        kept_weights=weights.kept_per_clock, kept_round_weights=weights.kept_per_clock // layout.virtual,
        conveyor=int((slots + 1) * conveyed), recomputing_input=int(recomputed), keeping_cell=int(cell),
        working=int(working), attention_gradient=_attention_gradient(profile, layout, rows),
        loss=int(around),
        loss_accumulator=_loss_accumulator_bytes(profile, layout.axes) if segments > 1 else 0,
        recomputing=recomputing, keeping=keeping)


def lockstep_terms(profile: ModelProfile, layout: Layout, depth: int, rows: int,
                   weights: DeviceMemory) -> LockstepTerms:
    """The bytes each part of a 1F1B step holds on the busiest device (:class:`LockstepTerms`):
    the weights gathered for the step with the carry of their gradients (where nothing is
    gathered, the copy of its stage's weights each block slot reads, and the gradient of the
    layers before the body, whose buffer XLA makes before the loops); the slot buffer, the ring
    of ``2S - 1`` stashed stage inputs, the two streams and the stacks each clock's two permutes
    send; one block of the forward beside one recomputed cell of the backward (with
    ``checkpoint="never"``, a ring of ``2S - 1`` cells' activations besides, the forward's whole
    cell and the backward's cell read out of the ring, and the head's weight gradient of the
    clock with its sum, in place of the logits, at another moment); one microbatch's logits,
    split over the stages where its rows are cut for the head
    (:meth:`xpipe.schedule.Lockstep.head_pieces`) and by vocabulary over "tensor"; and, after the
    loops, what the gradients are reduced from (:func:`_lockstep_weights`); before them, gathered for
    the step with fsdp or tensor, what gathering the layers around the body holds (:func:`_entering_the_loops`)."""
    conveyed = rows * profile.stream_bytes_per_row / layout.tensor
    kept_per_row = profile.block_kept_bytes_per_row or profile.block_saved_bytes_per_row
    # Where weights are sharded, XLA also holds the collectives' buffers (padded gathered copies, the
    # halves' partial sums) that no term names: the saved bytes' double count stands in for them.
    block = _block_saved(profile, layout, rows, None if layout.axes.sharding else kept_per_row)
    gathered, reduced = _lockstep_weights(profile, layout, weights)
    streams = 2 + 2 * 2  # the forward and backward streams; each permute's stack of a stream and a column
    slots = microbatch_slots(layout.chunks, layout.stages)
    lockstep = Lockstep(layout.stages, layout.chunks)
    buffers = (slots + lockstep.ring + streams) * conveyed
    cell = depth * block
    kept = layout.checkpoint == "never"  # each cell's activations wait in a ring of their own, none recomputed
    if kept:  # the ring, the clock's new cell before it is written in, and the backward's cell read out of it
        buffers += lockstep.ring * depth * _block_saved(profile, layout, rows, kept_per_row)
    table = _vocabulary_table(profile)
    head_gradient = 2 * outer_step_numel([table], layout.axes) * profile.itemsize if kept and table else 0
    return LockstepTerms(
        resting=_resting(weights), gathered=gathered, buffers=int(buffers),
        forward=int(cell if kept else block), working=int(block if layout.gather == "block" else cell),
        attention_gradient=_attention_gradient(profile, layout, rows),
        head=int(rows / lockstep.head_pieces(rows) * profile.outer_saved_bytes_per_row / layout.tensor),
        head_gradient=head_gradient, reduced=reduced, entering=_entering_the_loops(profile, layout),
        warm_up=layout.stages - 1, steady=layout.stages * slots)


def _lockstep_weights(profile: ModelProfile, layout: Layout, weights: DeviceMemory) -> tuple[int, int]:
    """What a 1F1B step holds of the weights besides those at rest: in the loops, and after them.

    In the loops: the step's gathered copies with their gradients' carry; where nothing is
    sharded the carry is the resting gradients, and XLA holds one copy of the stage's weights
    (the slices its block slots read) and the gradient of the layers before the body, a zeroed
    buffer it makes before the loops. After them: the carry each gradient is reduced from into
    the resting gradients (their size where nothing is sharded; gathered per step, the gathered
    weights'; per block, the outer layers'), and that gradient of the layers before the body."""
    outer = outer_step_numel(profile.outer_weights, layout.axes) * profile.itemsize
    if not layout.axes.sharding:
        return weights.gathered // 2 + outer, weights.gradients + outer
    carry = weights.gathered // 2 if layout.gather == "step" else weights.gathered_outer
    return weights.gathered, carry + outer


def _entering_the_loops(profile: ModelProfile, layout: Layout) -> int:
    """What a 1F1B step gathered for the step holds before its loops beside the gathered
    weights (XLA's buffer assignment, where the 8-token cells peak): the zeroed gradient
    of the layers around the body, and with "tensor" the vocabulary table gathered whole
    over "fsdp" before each device slices its part of the vocabulary out of it."""
    if not layout.axes.sharding or layout.gather != "step":
        return 0
    table = _vocabulary_table(profile)
    whole = math.prod(table) if table and layout.tensor > 1 else 0
    return (outer_step_numel(profile.outer_weights, layout.axes) + whole) * profile.itemsize


def _block_saved(profile: ModelProfile, layout: Layout, rows: int, per_row: float | None = None) -> float:
    """What one block saves for one microbatch of ``rows`` on one device (``per_row``, by
    default ``profile.block_saved_bytes_per_row``, a row): what is as wide as the stream
    whole (split by sequence with sequence parallelism), the rest split over "tensor"."""
    saved = profile.block_saved_bytes_per_row if per_row is None else per_row
    whole = 0.0 if layout.sequence_parallel else profile.block_stream_saved_bytes_per_row
    return rows * (whole + (saved - whole) / layout.tensor)


def _attention_gradient(profile: ModelProfile, layout: Layout, rows: int) -> int:
    """The gradient of one attention's probabilities for a microbatch of ``rows`` on one
    device, split by heads over "tensor": what a backward clock holds beside its cell."""
    return int(rows * profile.block_attention_bytes_per_row / layout.tensor)


def _resting(weights: DeviceMemory) -> dict[str, int]:
    """What stays the whole step, by kind: the weights, their gradients and the optimizer's state."""
    return {"parameters": weights.parameters, "gradients": weights.gradients, "optimizer": weights.optimizer}
