"""The SPMD executor: one XLA program per step over a ("data", "stage", "fsdp") mesh.

The repeated body's weights are stacked ``[S, V * K, ...]`` (``K`` blocks per
model stage, ``V`` model stages per stage group for a circular schedule) and
sharded on "stage" (and "fsdp"); the layers before and after the body run
data-parallel over the whole mesh. Where each tensor lives, and when it is
gathered, is :mod:`xpipe.spmd.placement`'s. The clock loop (GPipe's, or
circular's ``V`` rounds of it) is one ``torch_xla.experimental.scan`` (an XLA
while loop), so the program does not grow with the number of microbatches.

With ``gather="step"`` every operation inside the loop is local to a device except
the two shifts of :mod:`xpipe.spmd.conveyor` (and, with "tensor", the blocks' own
reductions). The stage weights enter the loop already gathered, one copy per
device (``[S * P, K, ...]``, ``P`` devices per stage), so their gradients
accumulate locally across clocks and are reduced over the stage's devices once,
after the loop, by the backward of that gathering. With ``gather="block"`` they
enter as each device's resting shard, and each block slot gathers its own weights
over "fsdp" right before it runs, every clock, and again when the backward
recomputes it; each clock reduces the gradients it made back to the shards.

The layers after the body run inside :class:`~xpipe.spmd.segmented_loss.LossOverSegments`,
so that a language model's loss makes its logits a segment of the sequence at a
time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map
from torch_xla.experimental.scan import scan

from xpipe._batch import check_outputs
from xpipe._batchnorm import RunningStatistics
from xpipe.capture.stacking import StackedModel
from xpipe.layout import spread
from xpipe.recompute import first_kept_clock, recompute
from xpipe.schedule import Schedule
from xpipe.spmd.conveyor import SlotLayout, column_tables, from_slots, slot_layout, make_tick, to_slots
from xpipe.spmd.dropout import cell_keys, hashed_dropout
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.ordering import after_gradient, behind, fenced, read_after, tied_to
from xpipe.spmd.placement import Placement
from xpipe.spmd.segmented_loss import LossOverSegments
from xpipe.spmd.sequence_parallel import SequenceSlices, check_sequence_dim
from xpipe.spmd.sides import Packing, packing_for
from xpipe.spmd.stacked_weights import StackedWeights
from xpipe.spmd.state_map import StateMap
from xpipe.tensor.packed_projections import PackedLinear, packed_parts

SCHEDULES = ("gpipe", "circular")  # the schedules whose clock loop this executor runs


def padded_chunks(chunks: int, stages: int) -> int:
    """The microbatches every step runs for ``chunks`` of them: rounded up to fill
    every stage's slots (see :func:`xpipe.spmd.conveyor.slot_layout`); the padding
    microbatches run too."""
    return slot_layout(chunks, chunks, stages, 1).padded_chunks


class SpmdPipeline(nn.Module):
    """Runs a :class:`StackedModel` as a GPipe (or circular) pipeline under SPMD.

    Args:
        stacked: the model cut around its repeated body.
        mesh: a mesh with a "stage" axis, and "data" and "fsdp" (``xpipe.make_mesh``).
        schedule: what every step runs: GPipe's, or circular's with ``schedule.virtual``
            model stages per stage group (model stage ``j`` on stage ``j % S``), over
            :func:`padded_chunks` microbatches.
        chunks: microbatches per step, as the user asked (at most ``schedule.chunks``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        device: the SPMD XLA device.
        keys: the wrapped module's ``state_dict`` keys, in order, each with the keys
            that name the same tensor (tied weights).
        dims: per block parameter, the dim "tensor" splits, or None (:func:`xpipe.tensor.rules.tensor_dims`).
        gather: when the "fsdp" shards are gathered: ``"step"`` or ``"block"``.
        templates: the block the clock loop runs, in train (True) and eval mode: block 0,
            or its copy that splits ``packed`` part by part
            (:func:`xpipe.tensor.packed_projections.split_packed`), one per mode where it was
            captured again as operations (``xpipe.build.split_packed_weights``).
        packed: the linears whose packed weights the loop gets tensor-major.
        sequence_parallel: hold the stream between the blocks' tensor-parallel regions
            as sequence slices over "tensor" (:mod:`xpipe.spmd.sequence_parallel`).

    Attributes:
        state: where each ``state_dict`` key lives (:class:`xpipe.spmd.state_map.StateMap`).
    """

    def __init__(self, stacked: StackedModel, mesh: xs.Mesh, schedule: Schedule, chunks: int, checkpoint: str,
                 device: torch.device, keys: dict[str, tuple[str, ...]], dims: list[int | None],
                 gather: str = "step", templates: Mapping[bool, torch.fx.GraphModule] | None = None,
                 packed: Sequence[PackedLinear] = (), sequence_parallel: bool = False) -> None:
        super().__init__()
        self.gather = gather
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.placement = Placement(mesh, sequence_parallel)
        self.stages = self.placement.axes.stage
        self.replicas = self.placement.replicas  # P: row groups per stage (data x fsdp)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.pre = stacked.pre
        self.post = stacked.post
        self.batch_norm = RunningStatistics([self.pre, self.post])  # PyTorch's running statistics, not XLA's
        self.placement.place_outer([self.pre, self.post])
        self.loss_over_segments = LossOverSegments(self.placement)  # no device holds a sequence's logits for the loss
        self.side_rows = stacked.side_rows  # per side input: travels with its microbatch, or held whole
        self.exported = stacked.exported
        self.block_count = len(stacked.blocks)
        if schedule.name not in SCHEDULES or schedule.stages != self.stages:
            raise ValueError(f"schedule: the spmd executor runs {' or '.join(SCHEDULES)} over the mesh's "
                             f"{self.stages} stages, not {schedule.name!r} over {schedule.stages}")
        self.schedule = schedule
        self.virtual = schedule.virtual  # V: model stages per stage group, run round the ring (circular)
        self.per_stage = spread(self.block_count, self.stages * self.virtual)  # per model stage
        self.depth = max(self.per_stage)  # K: block slots per model stage
        # Kept out of the module tree (a dict is not a submodule): their weights are not ours.
        self._templates = dict(templates or {True: stacked.blocks[0], False: stacked.blocks[0]})
        # The blocks' own constants, equal in every block (stacking's check): block 0's, on the device in the
        # form the clock loop carries them, with the dtype each is read back in.
        self._block_constants = {name: (_differentiable(buffer).to(device), buffer.dtype)
                                 for name, buffer in stacked.blocks[0].named_buffers()}
        self._block_parameters = [list(block.named_parameters()) for block in stacked.blocks]
        self._frozen = [[not p.requires_grad for _, p in named] for named in self._block_parameters]
        self.body = StackedWeights.from_blocks(stacked.blocks, self._slots(), self.virtual * self.depth, device,
                                               self.placement, dims, packed_parts(packed))
        self.state = StateMap(self.body, stacked, keys)
        self._ticks: dict[tuple, Callable] = {}

    def train(self, mode: bool = True) -> SpmdPipeline:
        """Also sets the mode of the block that the stacked weights run through."""
        super().train(mode)
        for template in self._templates.values():
            template.train(mode)
        return self

    def _template(self) -> nn.Module:
        """The block the clock loop runs in the Pipe's mode."""
        return self._templates[self.training]

    def _slots(self) -> list[tuple[int, int]]:
        """The (stage, slot) of each block of the body, in order: model stage ``j``
        runs on stage ``j % S`` in round ``j // S``, whose blocks fill slots
        ``round * K`` to ``round * K + K - 1``."""
        return [(model_stage % self.stages, model_stage // self.stages * self.depth + slot)
                for model_stage, count in enumerate(self.per_stage) for slot in range(count)]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's positional inputs."""
        return tuple(node.name for node in self.pre.graph.nodes if node.op == "placeholder")

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None):
        """Run one step's forward; see :class:`xpipe.Pipe` for the contract."""
        self._check_flags_unchanged()
        self.state.check_whole()
        if self.exported is not None:
            self.exported.check_mode(self.training)
            self.exported.check_inputs(inputs, microbatch_dim)
        device = self.body.weights[0].device
        microbatched = microbatch_dim is not None
        natural = tree_map(lambda x: x.to(device) if not microbatched else
                           x.to(device).movedim(microbatch_dim, 0).flatten(0, 1), inputs)
        layout = slot_layout(tree_flatten(natural)[0][0].shape[0], self.chunks, self.stages, self.replicas)
        outer = self.placement.gathered_outer([self.pre, self.post])
        with ShardableOps(), self.batch_norm.updating():
            stream, *rest = _as_tuple(functional_call(self.pre, outer[self.pre], natural))
        if self.sequence_parallel:  # checked by the build where a sample_input showed the stream
            check_sequence_dim(tuple(stream.shape), "on this batch")
        sides, skips = rest[:len(self.side_rows)], rest[len(self.side_rows):]
        per_row = [side for side, rows in zip(sides, self.side_rows) if rows]
        constants = tuple(side for side, rows in zip(sides, self.side_rows) if not rows)
        packing = packing_for(stream, per_row, constants, ways=self.placement.axes.tensor)
        slots = to_slots(self.placement.whole_rows(packing.pack([stream, *per_row])), layout, microbatched)
        # Features flattened: torch_xla shards tensors of at most 5 dims.
        slots = slots.reshape(self.stages * self.replicas, layout.slots, layout.rows, -1)
        slots, after = fenced(slots, (skips, outer[self.post]))  # the loop starts when all before it is done
        finished = self._run_clocks(self.placement.conveyed(slots), layout, packing, constants)
        finished, (skips, post_weights) = fenced(finished, after)  # and what follows it starts when it ends
        finished = self.placement.whole_rows(finished)
        skips = read_after(skips, finished)  # what the layers after it reduce of the inputs too (labels)
        finished = from_slots(packing.stream(finished.reshape(layout.padded_batch, -1)), layout, microbatched)
        with ShardableOps(), self.batch_norm.updating(), self.loss_over_segments:
            output = functional_call(self.post, post_weights, (finished, *skips))
        if self.exported is not None:
            output = self.exported.folded(output)
        check_outputs(output, layout.batch)
        if not microbatched:
            return output
        with self.loss_over_segments:  # logits in the loader's layout still take pipe.step's loss a segment at a time
            return tree_map(lambda y: _in_microbatches(y, self.chunks, microbatch_dim), output)

    def _check_flags_unchanged(self) -> None:
        """``requires_grad`` of a block weight is read once, when the body is stacked."""
        for named, frozen in zip(self._block_parameters, self._frozen):
            for (name, parameter), was_frozen in zip(named, frozen):
                if parameter.requires_grad == was_frozen:
                    raise ValueError(
                        f"module: requires_grad of {name!r} changed after the Pipe was built; the spmd "
                        "executor stacks the blocks' weights when it is built. Set requires_grad before "
                        "wrapping the model (or build a new Pipe)")

    def _run_clocks(self, slots: torch.Tensor, layout: SlotLayout, packing: Packing,
                    constants: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tables = column_tables(self.schedule, layout)
        reads, writes, from_ring = (torch.tensor(t, device=slots.device, dtype=slots.dtype)
                                    for t in (tables.reads, tables.writes, tables.from_ring))
        rounds = torch.nn.functional.one_hot(torch.tensor(tables.rounds), self.virtual)  # [T, S, V]
        rounds = rounds.repeat_interleave(self.replicas, 1).to(slots.device, slots.dtype)  # [T, S * P, V]
        clocks = torch.arange(len(reads), dtype=torch.int32, device=slots.device)
        keys = cell_keys(self._step_seed(slots.device), clocks, self.stages, self.replicas)
        state = self.placement.conveyed(slots[:, 0].clone())  # idle cells run real rows (see conveyor)
        valid = self._valid_mask(slots)
        place = self.placement.resting_body if self.gather == "block" else self.placement.gathered_body
        weights = tuple(place(w, split=dim is not None)
                        for w, dim in zip(self.body.step_weights(self.placement.axes.tensor), self.body.dims))
        weights += tuple(self.placement.per_device(_differentiable(c)) for c in constants)  # they ride along
        weights += tuple(self.placement.per_device(carried) for carried, _ in self._block_constants.values())
        carry = (state, slots, valid, weights)
        plain_from = first_kept_clock(self.schedule, self.checkpoint)
        ring = bool(tables.from_ring.any())
        for start, end, recomputed in ((0, plain_from, True), (plain_from, len(reads), False)):
            if end > start:
                columns = (reads[start:end], writes[start:end], from_ring[start:end], rounds[start:end],
                           keys[start:end])
                carry, _ = scan(self._tick(recomputed, packing, ring), carry, columns, is_fn_pure=True)
        return carry[1]

    def _step_seed(self, device: torch.device) -> torch.Tensor:
        """A seed for this step's dropout masks, from torch's default generator
        (``torch.manual_seed`` makes a run repeatable); data, so no recompile."""
        if not self.training:
            return torch.zeros((), dtype=torch.int32, device=device)
        return torch.randint(0, 2**31 - 1, (), dtype=torch.int32).to(device)

    def _tick(self, recomputed: bool, packing: Packing, ring: bool) -> Callable:
        """The loop body for one stream packing; kept, so that scan's trace cache finds it again."""
        modes = tuple(module.training for module in self._template().modules())  # dropout on or off
        key = (recomputed, packing, modes, ring)
        if key not in self._ticks:
            if self.gather == "block":
                stages = partial(self._run_gathered_slots, packing)
            else:
                run = partial(self._run_stages, packing)
                stages = partial(self._recomputed_stages, run) if recomputed else run
            self._ticks[key] = make_tick(self.stages, self.replicas, stages, ring)
        return self._ticks[key]

    def _run_stages(self, packing: Packing, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                    state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """All stages on all data replicas at once: ``[S * D, rows, F] -> same``."""
        count = len(self.body.names)
        weights = (*self.placement.pinned_body(weights[:count], self.body.dims), *weights[count:])
        state = self.placement.from_conveyor(state)
        return self.placement.to_conveyor(torch.vmap(partial(self._run_one_stage, packing))(weights, valid, state,
                                                                                           rounds, keys))

    @staticmethod
    def _recomputed_stages(run: Callable, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                           state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return recompute(lambda v, s, r, k, *w: run(w, v, s, r, k), valid, state, rounds, keys, *weights,
                         fence=_stream_after_gradient)

    def _run_one_stage(self, packing: Packing, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                       x: torch.Tensor, round_: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """One stage's ``K`` block slots of its current round on one replica; empty
        slots pass the stream through.

        ``x`` is ``[rows, F]``: the stream and the per-row side inputs, packed;
        ``weights`` each block weight ``[V * K, numel]``, then the constant side inputs,
        then the block's own constants (they ride along: scan takes no captured tensor);
        ``valid`` ``[V * K]``; ``round_`` the one-hot round ``[V]``; ``key`` the int32
        key of the cell (see :mod:`xpipe.spmd.dropout`).
        """
        count = len(self.body.names)
        valid, *blocks = (self._of_round(w, round_) for w in (valid, *weights[:count]))
        for slot in range(self.depth):
            x = self._run_one_block(packing, slot, tuple(w[slot] for w in blocks), weights[count:], valid[slot], x,
                                    key)
        return x

    def _run_gathered_slots(self, packing: Packing, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                            state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """All stages on all row groups, one block slot at a time, each slot's weights
        gathered from their resting shards right before it runs (``gather="block"``).

        Each slot is recomputed in the backward, its gather with it, so that what a clock
        keeps for the backward is the slot's input and its shards: no gathered weight
        outlives its block, forward or backward.
        """
        count = len(self.body.names)
        shards, extras = weights[:count], weights[count:]
        state = self.placement.from_conveyor(state)
        for slot in range(self.depth):
            # Gathered when the slot before it has run, not all at the loop body's start.
            slot_shards = tied_to([self._slot_of_round(w, slot, rounds) for w in shards], state)
            slot_valid = self._slot_of_round(valid, slot, rounds)
            run = partial(self._gathered_slot, packing, slot, len(extras))
            state = recompute(run, state, keys, slot_valid, *extras, *slot_shards, fence=after_gradient)
        return self.placement.to_conveyor(state)

    def _gathered_slot(self, packing: Packing, slot: int, extra_count: int, state: torch.Tensor, keys: torch.Tensor,
                       valid: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        extras, shards = tensors[:extra_count], tensors[extra_count:]
        whole = tuple(self.placement.gathered_slot(shard, math.prod(shape), split=dim is not None)
                      for shard, shape, dim in zip(shards, self.body.shapes, self.body.dims))
        run = torch.vmap(partial(self._run_one_block, packing, slot))
        return run(whole, extras, valid, state, keys)

    def _run_one_block(self, packing: Packing, slot: int, block: tuple[torch.Tensor, ...],
                       extras: tuple[torch.Tensor, ...], valid: torch.Tensor, x: torch.Tensor,
                       key: torch.Tensor) -> torch.Tensor:
        """Block slot ``slot`` on one replica: ``x`` ``[rows, F]`` packed as for
        :meth:`_run_one_stage`, ``block`` each block weight ``[numel]``, ``extras`` the
        constant side inputs then the block's own constants; an empty slot
        (``valid`` 0) passes the stream through."""
        stream, *per_row = packing.unpack(x)
        per_row, constants, held = iter(per_row), iter(extras), iter(packing.held)
        sides = [next(per_row) if rows else next(constants).to(next(held)) for rows in self.side_rows]
        own_constants = {name: next(constants).to(dtype) for name, (_, dtype) in self._block_constants.items()}
        params = {name: self.body.unstored(index, w) for index, (name, w) in
                  enumerate(zip(self.body.names, block))} | own_constants
        slices = SequenceSlices(stream.shape, self.mesh, self.placement.batch_axes) if self.sequence_parallel else None
        if slices is not None:
            stream = slices.sliced(stream)
        with ShardableOps(), hashed_dropout(key, slot), slices or contextlib.nullcontext():
            y = functional_call(self._template(), params, (stream, *sides))
        if slices is not None:
            y = slices.sliced(y)
        return packing.with_stream(x, torch.where(valid > 0, y, stream))

    def _slot_of_round(self, stacked: torch.Tensor, slot: int, rounds: torch.Tensor) -> torch.Tensor:
        """``[S * P, V * K, ...] -> [S * P, ...]``: slot ``slot`` of each device's current
        round (``rounds`` one-hot ``[S * P, V]``), picked by a product, locally.

        The product is taken with one round too: it makes the pick a value of the clock,
        so XLA cannot hoist the gather that follows out of the loop (it did: every
        slot's weights whole before the loop, as ``gather="step"``).
        """
        per_round = stacked.unflatten(1, (self.virtual, self.depth))[:, :, slot]
        return (per_round * rounds.view(*rounds.shape, *[1] * (per_round.dim() - 2))).sum(1)

    def _of_round(self, slots: torch.Tensor, round_: torch.Tensor) -> torch.Tensor:
        """``[V * K, ...] -> [K, ...]``: the slots of the round ``round_`` (one-hot ``[V]``)
        names; by a product, not an index, so that every device's pick stays local."""
        if self.virtual == 1:
            return slots
        per_round = slots.unflatten(0, (self.virtual, self.depth))
        return (per_round * round_.view(-1, *[1] * (per_round.dim() - 1))).sum(0)

    def _valid_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[S * P, V * K]``: 1 where a stage's slot holds a block, 0 for padding slots."""
        mask = torch.zeros(self.stages, self.virtual * self.depth)
        for stage, slot in self._slots():
            mask[stage, slot] = 1
        return self.placement.gathered_body(mask.to(like.device, like.dtype))


def _in_microbatches(y: torch.Tensor, chunks: int, microbatch_dim: int) -> torch.Tensor:
    """``[chunks * b, ...]`` as ``chunks`` microbatches along ``microbatch_dim``."""
    y = y.unflatten(0, (chunks, -1))
    return y if microbatch_dim == 0 else y.movedim(0, microbatch_dim)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _differentiable(constant: torch.Tensor) -> torch.Tensor:
    """``constant`` as a scan carry takes it: floating (scan makes a gradient for every
    carry); an integer one (an index list torch.export lifted) as float32, exact for
    the small values :func:`xpipe.capture.stacking._check_alike` lets through; a bool
    one (a causal mask held once) as float32 0 and 1."""
    return constant if constant.is_floating_point() else constant.to(torch.float32)


def _stream_after_gradient(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A recomputed clock's kept tensors (``valid``, the stream, ...) and the gradient of
    its output (last), the stream tied to that gradient (:func:`xpipe.spmd.ordering.behind`;
    the same layout, so nothing moves): the recomputation's collectives then run after
    the conveyor's permute that brings the gradient, never beside it."""
    valid, stream, *rest, gradient = tensors
    return [valid, behind(stream, gradient), *rest, gradient]
