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

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map
from torch_xla.experimental.scan import scan

from xpipe._batch import check_outputs
from xpipe._batchnorm import RunningStatistics, normalizes_over_rows
from xpipe.capture.stacking import StackedModel
from xpipe.layout import spread
from xpipe.recompute import first_kept_clock
from xpipe.schedule import SPMD_SCHEDULES as SCHEDULES, gpipe
from xpipe.spmd.clock import ClockBody, SpmdOptions
from xpipe.spmd.conveyor import SlotLayout, column_tables, from_slots, slot_layout, to_slots
from xpipe.spmd.dropout import cell_keys
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.one_f_one_b import Head, OneFOneBStep, check_even_rows, model_loss
from xpipe.spmd.ordering import fenced, read_after
from xpipe.spmd.placement import Placement
from xpipe.spmd.segmented_loss import LossOverSegments
from xpipe.spmd.sequence_parallel import check_sequence_dim
from xpipe.spmd.sides import Packing, packing_for
from xpipe.spmd.stacked_weights import StackedWeights
from xpipe.spmd.state_map import StateMap
from xpipe.tensor.packed_projections import packed_parts

# Those executor="auto" picks it for: 1F1B here asks for checkpoint="always" or "never", and pipe.step.
AUTO_SCHEDULES = ("gpipe", "circular")


class _Entry(NamedTuple):
    """A step's batch as it enters the body: after the layers before it, in the slot buffer."""

    layout: SlotLayout
    microbatched: bool
    packing: Packing
    slots: torch.Tensor  # [S * P, R, rows, F]
    constants: tuple[torch.Tensor, ...]  # the side inputs held whole
    skips: tuple[torch.Tensor, ...]  # what the layers after the body read besides its output
    outer: dict[nn.Module, dict[str, torch.Tensor]]  # the outer layers' weights, as the step holds them


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
        device: the SPMD XLA device.
        keys: the wrapped module's ``state_dict`` keys, in order, each with the keys
            that name the same tensor (tied weights).
        options: the schedule, chunks, recomputation, tensor split and gather choice
            (:class:`xpipe.spmd.clock.SpmdOptions`).

    Attributes:
        state: where each ``state_dict`` key lives (:class:`xpipe.spmd.state_map.StateMap`).
        body: the stacked block weights (:class:`xpipe.spmd.stacked_weights.StackedWeights`).
    """

    def __init__(self, stacked: StackedModel, mesh: xs.Mesh, device: torch.device, keys: dict[str, tuple[str, ...]],
                 options: SpmdOptions) -> None:
        super().__init__()
        schedule = options.schedule
        self.mesh = mesh
        self.sequence_parallel = options.sequence_parallel
        self.placement = Placement(mesh, options.sequence_parallel)
        self.stages = self.placement.axes.stage
        self.replicas = self.placement.replicas  # P: row groups per stage (data x fsdp)
        self.chunks, self.checkpoint = options.chunks, options.checkpoint
        self.pre = stacked.pre
        self.post = stacked.post
        self.batch_norm = RunningStatistics([self.pre, self.post])  # PyTorch's running statistics, not XLA's
        self.placement.place_outer([self.pre, self.post])
        self.loss_over_segments = LossOverSegments(self.placement)  # no device holds a sequence's logits for the loss
        self.side_rows = stacked.side_rows  # per side input: travels with its microbatch, or held whole
        self.skip_rows = stacked.skip_rows  # per skip: split with the microbatches (1F1B), or held whole
        self.exported = stacked.exported
        self.block_count = len(stacked.blocks)
        if schedule.name not in SCHEDULES or schedule.stages != self.stages:
            raise ValueError(f"schedule: the spmd executor runs {' or '.join(SCHEDULES)} over the mesh's "
                             f"{self.stages} stages, not {schedule.name!r} over {schedule.stages}")
        self.schedule = schedule
        # The forward-only loop pipe(x) runs (1F1B's inference is GPipe's forward).
        self._forward_schedule = gpipe(self.stages, schedule.chunks) if schedule.name == "1f1b" else schedule
        self.virtual = schedule.virtual  # V: model stages per stage group, run round the ring (circular)
        self.per_stage = spread(self.block_count, self.stages * self.virtual)  # per model stage
        self.depth = max(self.per_stage)  # K: block slots per model stage
        # Kept out of the module tree (a dict is not a submodule): their weights are not ours.
        self._templates = dict(options.templates or {True: stacked.blocks[0], False: stacked.blocks[0]})
        # The blocks' own constants, equal in every block (stacking's check): block 0's, on the device in the
        # form the clock loop carries them, with the dtype each is read back in.
        constants = dict(stacked.blocks[0].named_buffers())
        self._carried_constants = [_differentiable(buffer).to(device) for buffer in constants.values()]
        self._flags = _RequiresGrad(stacked.blocks)
        self._block_slots = block_slots(self.per_stage, self.stages, self.depth)
        self.body = StackedWeights.from_blocks(stacked.blocks, self._block_slots, self.virtual * self.depth, device,
                                               self.placement, options.dims, packed_parts(options.packed))
        self.state = StateMap(self.body, stacked, keys)
        self._clock = ClockBody(self.body, self.placement, mesh, self.side_rows,
                                {name: buffer.dtype for name, buffer in constants.items()}, self.depth, self.virtual,
                                options)
        self.gather = options.gather
        self.model_loss_items = options.model_loss_items

    def train(self, mode: bool = True) -> SpmdPipeline:
        """Also sets the mode of the block that the stacked weights run through."""
        super().train(mode)
        for template in self._templates.values():
            template.train(mode)
        return self

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's positional inputs."""
        return tuple(node.name for node in self.pre.graph.nodes if node.op == "placeholder")

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None):
        """Run one step's forward; see :class:`xpipe.Pipe` for the contract."""
        if self.schedule.name == "1f1b" and torch.is_grad_enabled():
            return self._one_f_one_b_output(inputs, microbatch_dim)
        entry = self._entering(inputs, microbatch_dim)
        layout, microbatched = entry.layout, entry.microbatched
        slots, after = fenced(entry.slots, (entry.skips, entry.outer[self.post]))  # the loop waits for all before it
        finished = self._run_clocks(self.placement.conveyed(slots), layout, entry.packing, entry.constants)
        finished, (skips, post_weights) = fenced(finished, after)  # and what follows it starts when it ends
        finished = self.placement.whole_rows(finished)
        skips = read_after(skips, finished)  # what the layers after it reduce of the inputs too (labels)
        finished = from_slots(entry.packing.stream(finished.reshape(layout.padded_batch, -1)), layout, microbatched)
        with ShardableOps(), self.batch_norm.updating(), self.loss_over_segments:
            output = functional_call(self.post, post_weights, (finished, *skips))
        if self.exported is not None:
            output = self.exported.folded(output)
        check_outputs(output, layout.batch)
        if not microbatched:
            return output
        with self.loss_over_segments:  # logits in the loader's layout still take pipe.step's loss a segment at a time
            return tree_map(lambda y: _in_microbatches(y, self.chunks, microbatch_dim), output)

    def _entering(self, inputs: tuple, microbatch_dim: int | None) -> _Entry:
        """The layers before the body on the batch, and the slot buffer they fill."""
        self._flags.check_unchanged()
        self.state.check_whole()
        if self.exported is not None:
            self.exported.check_mode(self.training)
            self.exported.check_inputs(inputs, microbatch_dim)
        microbatched = microbatch_dim is not None
        device = self.body.weights[0].device
        natural = tree_map(partial(_batch_first, device=device, microbatch_dim=microbatch_dim), inputs)
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
        return _Entry(layout, microbatched, packing, slots, constants, tuple(skips), outer)

    def step(self, inputs: tuple, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             microbatch_dim: int | None) -> torch.Tensor:
        """``pipe.step``: the forward, ``loss_fn`` of the whole batch's output (a language
        model's cross-entropy a segment of the logits at a time), and its backward; under
        1F1B, each microbatch's loss and backward inside the clock loops."""
        if self.schedule.name == "1f1b":
            head = partial(Head.of_loss_fn, loss_fn=loss_fn)
            _, loss = self._one_f_one_b_loss(inputs, target, head, microbatch_dim)
        else:
            output = self(*inputs, microbatch_dim=microbatch_dim)
            device = self.body.weights[0].device
            with self.loss_over_segments:
                loss = loss_fn(output, tree_map(lambda t: t.to(device), target))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn: must return a scalar tensor")
        loss.backward()
        return loss.detach()

    def _one_f_one_b_output(self, inputs: tuple, microbatch_dim: int | None) -> Any:
        """``pipe(...)`` under gradients with 1F1B: the step runs whole, each microbatch's
        backward inside it, on the loss the model returns (Hugging Face's ``labels=``),
        each microbatch's weighted by its share of the labels the loss counts
        (:func:`xpipe.reduction.model_loss_items_each`); returned in what the model
        returns, the loss alone."""
        names = self.input_names
        labels = names.index("labels") if "labels" in names else None
        target = inputs[0 if labels is None else labels]

        def items(targets: torch.Tensor) -> torch.Tensor:
            return self.model_loss_items(None if labels is None else targets, targets)

        head = partial(Head, loss=model_loss, items=items, mean=True)
        runner, loss = self._one_f_one_b_loss(inputs, target, head, microbatch_dim)
        return runner.as_output(loss)

    def _one_f_one_b_loss(self, inputs: tuple, target: Any, head: Callable[..., Head],
                          microbatch_dim: int | None) -> tuple[OneFOneBStep, torch.Tensor]:
        """The step's loss under 1F1B (:mod:`xpipe.spmd.one_f_one_b`), whose backward
        gives every gradient; ``head(post, fold, skip_rows)`` the loss's :class:`Head`."""
        if self.training and normalizes_over_rows(self.post):
            raise ValueError("module: the layers after the body hold a BatchNorm, which in training normalizes over "
                             "the whole batch; schedule='1f1b' under the spmd executor runs those layers one "
                             "microbatch at a time, which would normalize over each microbatch's rows instead. Use "
                             "schedule='gpipe' (or 'circular')")
        entry = self._entering(inputs, microbatch_dim)
        check_even_rows(entry.layout)
        if entry.skips and self.skip_rows is None:
            raise ValueError("sample_input: schedule='1f1b' under the spmd executor runs the layers after the body "
                             "on each microbatch, and they read tensors made before the body; pass sample_input=<a "
                             "batch as the model takes it> to Pipe so that xpipe can tell which have a row per batch "
                             "row")
        slots, (skips, post_weights) = fenced(entry.slots, (entry.skips, entry.outer[self.post]))
        fold = self.exported.folded if self.exported is not None else _unchanged
        template = self._templates[self.training]
        stashed = self._clock.stashed(template, entry.packing) if self.checkpoint == "never" else None
        runner = OneFOneBStep(self.placement, self._clock.stages(template, entry.packing),
                              head(self.post, fold, self.skip_rows or ()), entry.packing, stashed)
        batch_first = partial(_batch_first, device=self.body.weights[0].device, microbatch_dim=microbatch_dim)
        loss = runner.loss(self.placement.conveyed(slots), target, skips, entry.layout, entry.microbatched,
                           step_seed(self.training, slots.device), self._clock_weights(entry.constants),
                           self._valid_mask(slots), post_weights,
                           lambda t: to_slots(batch_first(t), entry.layout, entry.microbatched))
        return runner, loss

    def _run_clocks(self, slots: torch.Tensor, layout: SlotLayout, packing: Packing,
                    constants: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tables = column_tables(self._forward_schedule, layout)
        reads, writes, from_ring = (torch.tensor(t, device=slots.device, dtype=slots.dtype)
                                    for t in (tables.reads, tables.writes, tables.from_ring))
        rounds = torch.nn.functional.one_hot(torch.tensor(tables.rounds), self.virtual)  # [T, S, V]
        rounds = rounds.repeat_interleave(self.replicas, 1).to(slots.device, slots.dtype)  # [T, S * P, V]
        clocks = torch.arange(len(reads), dtype=torch.int32, device=slots.device)
        keys = cell_keys(step_seed(self.training, slots.device), clocks, self.stages, self.replicas)
        state = self.placement.conveyed(slots[:, 0].clone())  # idle cells run real rows (see conveyor)
        carry = (state, slots, self._valid_mask(slots), self._clock_weights(constants))
        plain_from = first_kept_clock(self._forward_schedule, self.checkpoint)
        ring = bool(tables.from_ring.any())
        for start, end, recomputed in ((0, plain_from, True), (plain_from, len(reads), False)):
            if end > start:
                columns = (reads[start:end], writes[start:end], from_ring[start:end], rounds[start:end],
                           keys[start:end])
                tick = self._clock.tick(self._templates[self.training], recomputed, packing, ring)
                carry, _ = scan(tick, carry, columns, is_fn_pure=True)
        return carry[1]

    def _clock_weights(self, constants: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What the clock loop carries for the blocks: their stacked weights, gathered for
        the step or at rest (``gather``), then the constant side inputs and the blocks' own
        constants, a copy for every row group."""
        place = self.placement.resting_body if self.gather == "block" else self.placement.gathered_body
        weights = tuple(place(w, split=dim is not None)
                        for w, dim in zip(self.body.step_weights(self.placement.axes.tensor), self.body.dims))
        weights += tuple(self.placement.per_device(_differentiable(c)) for c in constants)  # they ride along
        return weights + tuple(self.placement.per_device(carried) for carried in self._carried_constants)

    def _valid_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[S * P, V * K]``: 1 where a stage's slot holds a block, 0 for padding slots."""
        mask = slot_mask(self._block_slots, self.stages, self.virtual * self.depth)
        return self.placement.gathered_body(mask.to(like.device, like.dtype))


def block_slots(per_stage: tuple[int, ...], stages: int, depth: int) -> list[tuple[int, int]]:
    """The (stage, slot) of each block of the body, in order, from the blocks of each
    model stage (``per_stage``): model stage ``j`` runs on stage ``j % S`` in round
    ``j // S``, whose blocks fill slots ``round * K`` to ``round * K + K - 1``."""
    return [(model_stage % stages, model_stage // stages * depth + slot)
            for model_stage, count in enumerate(per_stage) for slot in range(count)]


def slot_mask(slots: list[tuple[int, int]], stages: int, width: int) -> torch.Tensor:
    """``[S, width]``: 1 at each (stage, slot) of ``slots``, 0 for padding slots."""
    mask = torch.zeros(stages, width)
    for stage, slot in slots:
        mask[stage, slot] = 1
    return mask


def step_seed(training: bool, device: torch.device) -> torch.Tensor:
    """A seed for a step's dropout masks, from torch's default generator
    (``torch.manual_seed`` makes a run repeatable); data, so no recompile."""
    if not training:
        return torch.zeros((), dtype=torch.int32, device=device)
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int32).to(device)


class _RequiresGrad:
    """The blocks' ``requires_grad`` flags as the body was stacked with them: read once,
    so that a change after the build is refused rather than ignored."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.named = [list(block.named_parameters()) for block in blocks]
        self.frozen = [[not p.requires_grad for _, p in named] for named in self.named]

    def check_unchanged(self) -> None:
        for named, frozen in zip(self.named, self.frozen):
            for (name, parameter), was_frozen in zip(named, frozen):
                if parameter.requires_grad == was_frozen:
                    raise ValueError(
                        f"module: requires_grad of {name!r} changed after the Pipe was built; the spmd "
                        "executor stacks the blocks' weights when it is built. Set requires_grad before "
                        "wrapping the model (or build a new Pipe)")


def _batch_first(x: torch.Tensor, device: torch.device, microbatch_dim: int | None) -> torch.Tensor:
    """``x`` on ``device``, batch-first (a loader's microbatches one after the other)."""
    x = x.to(device)
    return x if microbatch_dim is None else x.movedim(microbatch_dim, 0).flatten(0, 1)


def _in_microbatches(y: torch.Tensor, chunks: int, microbatch_dim: int) -> torch.Tensor:
    """``[chunks * b, ...]`` as ``chunks`` microbatches along ``microbatch_dim``."""
    y = y.unflatten(0, (chunks, -1))
    return y if microbatch_dim == 0 else y.movedim(0, microbatch_dim)


def _unchanged(value: Any) -> Any:
    return value


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _differentiable(constant: torch.Tensor) -> torch.Tensor:
    """``constant`` as a scan carry takes it: floating (scan makes a gradient for every
    carry); an integer one (an index list torch.export lifted) as float32, exact for
    the small values :func:`xpipe.capture.stacking._check_alike` lets through; a bool
    one (a causal mask held once) as float32 0 and 1."""
    return constant if constant.is_floating_point() else constant.to(torch.float32)
