"""What one clock of the spmd executor's loop runs: every stage's block slots, on every
row group at once, on the microbatch the conveyor hands it.

:class:`ClockBody` is the body of the ``scan`` that :class:`xpipe.spmd.executor.SpmdPipeline`
runs (through :func:`xpipe.spmd.conveyor.make_tick`, which moves the stream between
stages around it). With ``gather="step"`` the stage's weights enter already gathered
and every stage's ``K`` slots run under one ``torch.vmap``; with ``gather="block"``
each slot gathers its own weights from their resting shards right before it runs,
and recomputes them in the backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.func import functional_call

from xpipe.recompute import recompute
from xpipe.schedule import Schedule
from xpipe.spmd.conveyor import make_tick
from xpipe.spmd.dropout import hashed_dropout
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.ordering import after_gradient, behind, tied_to
from xpipe.spmd.placement import Placement
from xpipe.spmd.sequence_parallel import SequenceSlices
from xpipe.spmd.sides import Packing
from xpipe.spmd.stashed_activations import StashedActivations
from xpipe.spmd.stacked_weights import StackedWeights
from xpipe.tensor.packed_projections import PackedLinear


@dataclass(frozen=True)
class SpmdOptions:
    """What a Pipe asks of the spmd executor, checked by the build.

    Attributes:
        schedule: what every step runs: GPipe's, or circular's with ``schedule.virtual``
            model stages per stage group, over the padded microbatch count.
        chunks: microbatches per step, as the user asked (at most ``schedule.chunks``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        dims: per block parameter, the dim "tensor" splits, or None.
        gather: when the "fsdp" shards are gathered: ``"step"`` or ``"block"``.
        templates: the block the clock loop runs, in train (True) and eval mode (None:
            block 0 in both), where packed weights are split part by part
            (:func:`xpipe.tensor.packed_projections.split_packed`).
        packed: the linears whose packed weights the loop gets tensor-major.
        sequence_parallel: hold the stream between the blocks' tensor-parallel regions
            as sequence slices over "tensor" (:mod:`xpipe.spmd.sequence_parallel`).
        model_loss_items: what the loss the model returns averages over, per piece of
            its labels (:func:`xpipe.reduction.model_loss_items_each` of the model), for
            1F1B's ``pipe(...)``.
    """

    schedule: Schedule
    chunks: int
    checkpoint: str
    dims: list[int | None]
    gather: str = "step"
    templates: Mapping[bool, torch.fx.GraphModule] | None = None
    packed: Sequence[PackedLinear] = ()
    sequence_parallel: bool = False
    model_loss_items: Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor] | None = None


class ClockBody:
    """One clock of every stage on every row group.

    Args:
        body: the stacked block weights.
        placement: where each tensor lives on the mesh.
        mesh: the mesh (for sequence parallelism's annotations).
        side_rows: per side input, whether it travels with its microbatch's rows.
        block_constants: the blocks' own constants by name, each with the dtype it is
            read back in (they ride in the loop's carry, as float).
        depth: ``K``, block slots per model stage; virtual: ``V``, rounds.
        options: the executor's options (``gather``, ``sequence_parallel``).
    """

    def __init__(self, body: StackedWeights, placement: Placement, mesh: xs.Mesh, side_rows: tuple[bool, ...],
                 block_constants: Mapping[str, torch.dtype], depth: int, virtual: int, options: SpmdOptions) -> None:
        self.body, self.placement, self.mesh = body, placement, mesh
        self.side_rows, self.block_constants = side_rows, dict(block_constants)
        self.depth, self.virtual = depth, virtual
        self.gather, self.sequence_parallel = options.gather, options.sequence_parallel
        self._ticks: dict[tuple, Callable] = {}

    def tick(self, template: nn.Module, recomputed: bool, packing: Packing, ring: bool) -> Callable:
        """The loop body for one block template (its mode), recomputation and stream
        packing; kept, so that scan's trace cache finds it again."""
        modes = tuple(module.training for module in template.modules())  # dropout on or off
        key = (id(template), recomputed, packing, modes, ring)
        if key not in self._ticks:
            stages = self.stages(template, packing)
            if recomputed and self.gather != "block":  # a gathered slot recomputes itself
                stages = partial(_recomputed_stages, stages)
            axes = self.placement.axes
            self._ticks[key] = make_tick(axes.stage, self.placement.replicas, stages, ring)
        return self._ticks[key]

    def stages(self, template: nn.Module, packing: Packing) -> Callable[..., torch.Tensor]:
        """Every stage's block slots on every row group, ``(weights, valid, state, rounds,
        keys) -> state``: the weights gathered for the step, or with ``gather="block"``
        each slot's gathered from their resting shards right before it runs."""
        if self.gather == "block":
            return partial(self._run_gathered_slots, template, packing)
        return partial(self._run_stages, template, packing)

    def stashed(self, template: nn.Module, packing: Packing) -> StashedActivations:
        """Every stage's blocks as :meth:`stages` runs them with ``gather="step"``, keeping
        the activations the backward reads (1F1B's ``checkpoint="never"``)."""
        return StashedActivations(partial(self._run_one_stage, template, packing), self._entering,
                                  self.placement.to_conveyor)

    def _run_stages(self, template: nn.Module, packing: Packing, weights: tuple[torch.Tensor, ...],
                    valid: torch.Tensor, state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor
                    ) -> torch.Tensor:
        """All stages on all row groups at once: ``[S * P, rows, F] -> same``."""
        weights, state = self._entering(weights, state)
        one_stage = partial(self._run_one_stage, template, packing)
        return self.placement.to_conveyor(torch.vmap(one_stage)(weights, valid, state, rounds, keys))

    def _entering(self, weights: tuple[torch.Tensor, ...], state: torch.Tensor
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The weights and the stream as the loop carries them, held as the stages read
        them (``gather="step"``)."""
        count = len(self.body.names)
        weights = (*self.placement.pinned_body(weights[:count], self.body.dims), *weights[count:])
        return weights, self.placement.from_conveyor(state)

    def _run_one_stage(self, template: nn.Module, packing: Packing, weights: tuple[torch.Tensor, ...],
                       valid: torch.Tensor, x: torch.Tensor, round_: torch.Tensor, key: torch.Tensor
                       ) -> torch.Tensor:
        """One stage's ``K`` block slots of its current round on one row group; empty
        slots pass the stream through.

        ``x`` is ``[rows, F]``: the stream and the per-row side inputs, packed;
        ``weights`` each block weight ``[V * K, numel]``, then the constant side inputs,
        then the block's own constants (they ride along: scan takes no captured tensor);
        ``valid`` ``[V * K]``; ``round_`` the one-hot round ``[V]``; ``key`` the int32
        key of the cell (see :mod:`xpipe.spmd.dropout`).
        """
        count = len(self.body.names)
        valid, *blocks = (self._of_round(w, round_) for w in (valid, *weights[:count]))
        # Unbound, not indexed: an unbind's gradient is one stack of the slots' gradients, an
        # index's a padded copy of the whole stack per slot (1F1B's backward held them all).
        per_slot = [w.unbind(0) for w in blocks]
        for slot in range(self.depth):
            x = self._run_one_block(template, packing, slot, tuple(w[slot] for w in per_slot), weights[count:],
                                    valid[slot], x, key)
        return x

    def _run_gathered_slots(self, template: nn.Module, packing: Packing, weights: tuple[torch.Tensor, ...],
                            valid: torch.Tensor, state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor
                            ) -> torch.Tensor:
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
            run = partial(self._gathered_slot, template, packing, slot, len(extras))
            state = recompute(run, state, keys, slot_valid, *extras, *slot_shards, fence=after_gradient)
        return self.placement.to_conveyor(state)

    def _gathered_slot(self, template: nn.Module, packing: Packing, slot: int, extra_count: int,
                       state: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, *tensors: torch.Tensor
                       ) -> torch.Tensor:
        extras, shards = tensors[:extra_count], tensors[extra_count:]
        whole = tuple(self.placement.gathered_slot(shard, math.prod(shape), split=dim is not None)
                      for shard, shape, dim in zip(shards, self.body.shapes, self.body.dims))
        run = torch.vmap(partial(self._run_one_block, template, packing, slot))
        return run(whole, extras, valid, state, keys)

    def _run_one_block(self, template: nn.Module, packing: Packing, slot: int, block: tuple[torch.Tensor, ...],
                       extras: tuple[torch.Tensor, ...], valid: torch.Tensor, x: torch.Tensor,
                       key: torch.Tensor) -> torch.Tensor:
        """Block slot ``slot`` on one row group: ``x`` ``[rows, F]`` packed as for
        :meth:`_run_one_stage`, ``block`` each block weight ``[numel]``, ``extras`` the
        constant side inputs then the block's own constants; an empty slot
        (``valid`` 0) passes the stream through."""
        stream, *per_row = packing.unpack(x)
        per_row, constants, held = iter(per_row), iter(extras), iter(packing.held)
        sides = [next(per_row) if rows else next(constants).to(next(held)) for rows in self.side_rows]
        own_constants = {name: next(constants).to(dtype) for name, dtype in self.block_constants.items()}
        params = {name: self.body.unstored(index, w) for index, (name, w) in
                  enumerate(zip(self.body.names, block))} | own_constants
        slices = SequenceSlices(stream.shape, self.mesh, self.placement.batch_axes) if self.sequence_parallel else None
        if slices is not None:
            stream = slices.sliced(stream)
        with ShardableOps(), hashed_dropout(key, slot), slices or contextlib.nullcontext():
            y = functional_call(template, params, (stream, *sides))
        if slices is not None:
            y = slices.sliced(y)
        return packing.with_stream(x, torch.where(valid > 0, y, stream))

    def _slot_of_round(self, stacked: torch.Tensor, slot: int, rounds: torch.Tensor) -> torch.Tensor:
        """``[S * P, V * K, ...] -> [S * P, ...]``: slot ``slot`` of each device's current
        round (``rounds`` one-hot ``[S * P, V]``), picked by a product, locally.

        The product is taken with one round too: it makes the pick a value of the clock,
        so XLA cannot hoist the gather that follows out of the loop (it would gather
        every slot's weights whole before the loop, as ``gather="step"`` does).
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


def _recomputed_stages(run: Callable, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                       state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return recompute(lambda v, s, r, k, *w: run(w, v, s, r, k), valid, state, rounds, keys, *weights,
                     fence=_stream_after_gradient)


def _stream_after_gradient(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A recomputed clock's kept tensors (``valid``, the stream, ...) and the gradient of
    its output (last), the stream tied to that gradient (:func:`xpipe.spmd.ordering.behind`;
    the same layout, so nothing moves): the recomputation's collectives then run after
    the conveyor's permute that brings the gradient, never beside it."""
    valid, stream, *rest, gradient = tensors
    return [valid, behind(stream, gradient), *rest, gradient]
