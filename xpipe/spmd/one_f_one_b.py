"""1F1B inside the one SPMD program: each microbatch's backward runs in the clock
loop, as soon as its forward has left the last stage.

In lockstep, stage ``s`` runs the forward of the ``i``-th microbatch to enter the
pipeline at clock ``i + s`` and its backward at clock ``i + 2S - 2 - s``: the last
stage runs the layers after the body, the loss and the backward right after the
forward. Forwards fall in clocks ``0 .. M+S-2`` and backwards in ``S-1 .. M+2S-3``,
so the step is three XLA while loops: ``S - 1`` clocks of forwards, ``M`` of both,
``S - 1`` of backwards. That is ``(M + S - 1)`` clocks of a forward and a backward,
GPipe's compute and bubble, where one loop of clocks that all run both would cost
``(M + 2S - 2) / (M + S - 1)`` of it.

Stage ``s`` keeps a microbatch's stage input from its forward to its backward,
``2(S - 1 - s) + 1`` clocks: a ring of ``2S - 1`` stashed inputs per device, whatever
``M`` is (GPipe keeps ``M``). The backward recomputes the stage's forward from its
stashed input (``checkpoint="always"``) and takes its vector-Jacobian product in
the loop body; the weight gradients add up in the loop's carry, and are reduced
over each stage's devices once, after the loops, by the backward of the gather
that gave every device its stage's weights (with ``gather="block"``, each slot's
to its resting shards every clock, as the slot gathers them).

Every device runs the same program: in the steady loop each runs a forward, the
layers after the body with the loss, and a backward. The microbatch leaving the
last stage is cut into as many pieces of its rows as split evenly, up to ``S``
(:meth:`xpipe.schedule.Lockstep.head_pieces`), one to each of the last stages
(a collective-permute a piece sent on; its gradient comes back the same way), so
that each device runs those layers on ``1/pieces`` of it: with ``S`` pieces the
step does their work once, as GPipe does. The stages given no piece run them on
rows of their own, and their results are dropped.

How microbatches move: stage 0 reads them from the slot buffer as GPipe's
conveyor does (:mod:`xpipe.spmd.conveyor`), the ``i``-th to enter from slot
``i // S`` of stage ``i % S``; the gradient of a stage input leaves stage 0 into
the same buffer, into a column already read empty, which climbs one stage a
clock: it comes to rest in stage ``S - 1 - i % S``, and one flip of the stage axis
after the loops puts it back where the input came from.

The loss and every gradient are made in the forward of the step's autograd
function (:class:`_Step`), the gradients for a loss gradient of one; its backward
scales them by the loss's actual gradient. The loss is ``pipe.step``'s
``loss_fn`` of each microbatch's output and target, or the loss the model itself
returns (``pipe(..., labels=...)``), each weighted by its share of what the loss
averages over (:class:`Head`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.func import functional_call
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from xpipe._xla import while_loop
from xpipe.collectives import shift
from xpipe.reduction import declared, loss_fn_items_each
from xpipe.schedule import Lockstep
from xpipe.spmd.conveyor import SlotLayout
from xpipe.spmd.dropout import cell_keys, hashed_dropout
from xpipe.spmd.lockstep_tables import OneFOneBTables, one_f_one_b_tables
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.placement import Placement
from xpipe.spmd.sides import Packing
from xpipe.spmd.stashed_activations import StashedActivations


HEAD_SLOT = -1  # the layers after the body draw dropout masks as a block slot of their own would


def check_loss_fn(loss_fn: Callable[..., Any]) -> None:
    """1F1B takes each microbatch's loss in the clock loop, weighted by its share of what
    ``loss_fn`` averages over; it must say how it reduces (no whole-batch check can run)."""
    if declared(loss_fn) is None:
        raise ValueError(
            "loss_fn: schedule='1f1b' under the spmd executor takes each microbatch's loss inside the clock loop and "
            "weighs it by its share of what loss_fn averages over, so loss_fn must say how it reduces: pass a torch "
            "loss (e.g. nn.CrossEntropyLoss()), or give your function `reduction` ('mean' or 'sum') and, for "
            "ignored integer targets, `ignore_index` attributes")


@dataclass(frozen=True)
class Head:
    """What runs on a microbatch as it leaves the last stage: the layers after the
    body, on its stream and the skips (each with a row per batch row, per
    ``skip_rows``, or held whole), then ``loss`` of what the model returns (``fold``
    of their output) and the target.

    ``items`` gives, from the targets laid out ``[M, P, rows, ...]``, what each
    microbatch's loss averages over on each row group (``[M, P]``); with ``mean``
    the step's loss weighs each by its share of them, else adds them up.
    """

    post: torch.nn.Module
    fold: Callable[[Any], Any]
    skip_rows: tuple[bool, ...]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    items: Callable[[torch.Tensor], torch.Tensor]
    mean: bool

    @classmethod
    def of_loss_fn(cls, post: torch.nn.Module, fold: Callable[[Any], Any], skip_rows: tuple[bool, ...],
                   loss_fn: Callable[..., torch.Tensor]) -> Head:
        """``pipe.step``'s: the user's ``loss_fn``, which must say how it reduces."""
        check_loss_fn(loss_fn)
        return cls(post, fold, skip_rows, loss_fn, partial(loss_fn_items_each, loss_fn, pieces=2),
                   declared(loss_fn).reduction == "mean")


def model_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The loss a model returns (``output.loss``: Hugging Face's ``labels=``)."""
    loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("schedule: '1f1b' under the spmd executor runs each microbatch's backward inside the step, "
                         "with the loss: train with pipe.step(inputs, target) (build the Pipe with loss_fn=...), or "
                         "pipe(...) of a model that returns its loss (labels=); run pipe(x) for its output under "
                         "torch.no_grad()")
    return loss


class OneFOneBStep:
    """One ``pipe.step`` of 1F1B over the stacked stages.

    Args:
        placement: where each tensor lives on the mesh.
        run_stages: every stage's blocks on every row group, ``(weights, valid, state,
            rounds, keys) -> state`` (:meth:`xpipe.spmd.clock.ClockBody.stages`).
        head: the layers after the body and the loss.
        packing: how the stream and the per-row side inputs share the conveyor's features.
        stashed: with ``checkpoint="never"``, the stages' forward that keeps its
            activations in a ring beside the stashed inputs, and their backward from them
            (None: each backward recomputes its stage's forward from the stashed input).
    """

    def __init__(self, placement: Placement, run_stages: Callable[..., torch.Tensor], head: Head,
                 packing: Packing, stashed: StashedActivations | None = None) -> None:
        self.placement, self.run_stages, self.head, self.packing = placement, run_stages, head, packing
        self.stashed = stashed
        self.stages, self.replicas = placement.axes.stage, placement.replicas
        self.output_form: tuple[TreeSpec, int] | None = None  # what the model returns, and where the loss is in it

    def as_output(self, loss: torch.Tensor) -> Any:
        """What the model returns, with the step's ``loss`` in place of a microbatch's and
        nothing else (no microbatch's logits are kept): for ``pipe(...).loss``."""
        spec, place = self.output_form
        leaves = [None] * spec.num_leaves
        leaves[place] = loss
        return tree_unflatten(leaves, spec)

    def loss(self, slots: torch.Tensor, target: Any, skips: tuple[torch.Tensor, ...], layout: SlotLayout,
             microbatched: bool, seed: torch.Tensor, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
             post_weights: dict[str, torch.Tensor], to_slots: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The step's loss, whose backward gives every gradient.

        ``slots`` is the slot buffer ``[S * P, R, rows, F]``; ``target`` the user's
        target and ``skips`` the model's, batch-first; ``weights`` what the clock loop
        carries for the blocks; ``to_slots`` puts a batch-first tensor in the slot order,
        as the inputs went.
        """
        tables = one_f_one_b_tables(self.stages, layout.padded_chunks, layout.slots)
        leaves, _ = tree_flatten(target)
        if len(leaves) != 1 or not isinstance(leaves[0], torch.Tensor):
            raise ValueError("target: schedule='1f1b' under the spmd executor takes one target tensor")
        pieces = Lockstep(self.stages, layout.padded_chunks).head_pieces(layout.rows)

        def by_piece(batch_first: torch.Tensor) -> torch.Tensor:
            """``[M, P, pieces, rows / pieces, ...]``: each row group's rows of each
            microbatch cut into the pieces the stages take the loss of."""
            return self._by_entry(to_slots(batch_first), layout).unflatten(2, (pieces, -1))

        targets = by_piece(leaves[0])
        shares = self._shares(targets, layout, microbatched)
        rows = tuple(skip for skip, has_rows in zip(skips, self.head.skip_rows) if has_rows)
        if any(skip.requires_grad for skip in rows):
            raise ValueError("module: the layers after the body read a tensor with a row per batch row, made before "
                             "the body from the weights; schedule='1f1b' under the spmd executor takes the gradient "
                             "of none such; use schedule='gpipe'")
        columns = tuple(self._by_steady_clock(laid) for laid in (targets, *(by_piece(skip) for skip in rows)))
        shares = self._by_steady_clock(shares, idle_zero=True)
        held = (*post_weights.values(), *(skip for skip, has_rows in zip(skips, self.head.skip_rows) if not has_rows))
        return _Step.apply(self, tables, tuple(post_weights), seed, slots, valid, columns, shares, pieces,
                           len(weights), *weights, *held)

    def _by_entry(self, grid: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
        """``[S * P * R * rows, ...]`` in slot order -> ``[M, P, rows, ...]`` in the order
        the microbatches enter the pipeline: the ``i``-th from slot ``i // S`` of stage
        ``i % S`` (the conveyor's reads)."""
        grid = grid.reshape(self.stages, self.replicas, layout.slots, layout.rows, *grid.shape[1:])
        return grid.movedim(2, 0).flatten(0, 1)

    def _shares(self, targets: torch.Tensor, layout: SlotLayout, microbatched: bool) -> torch.Tensor:
        """``[M, P, pieces]``: each piece's share of the step's loss, per microbatch (0 for
        padding), from the targets laid out ``[M, P, pieces, rows / pieces, ...]``."""
        real = _real_pieces(layout, microbatched)  # [S, P, R]
        real = torch.tensor(real.transpose(2, 0, 1).reshape(-1, self.replicas, 1), dtype=torch.float32,
                            device=targets.device).expand(*targets.shape[:3])
        if not self.head.mean:
            return real
        counts = self.head.items(targets.flatten(1, 2)).view(real.shape) * real
        return counts / counts.sum()

    def _by_steady_clock(self, by_piece: torch.Tensor, idle_zero: bool = False) -> torch.Tensor:
        """``[M, P, pieces, ...] -> [M, S * P, ...]``: per clock of the steady loop, the
        microbatch leaving the last stage (the ``k``-th clock's is the ``k``-th to have
        entered), its ``j``-th piece on stage ``S - pieces + j``'s devices; on the stages
        before those (whose results are dropped) a copy of its first piece, or with
        ``idle_zero`` zeros."""
        idle = by_piece[:, :, :1].expand(-1, -1, self.stages - by_piece.shape[2], *by_piece.shape[3:])
        if idle_zero:
            idle = torch.zeros_like(idle)
        spread = torch.cat([idle, by_piece], 2).movedim(2, 1).flatten(1, 2)
        return self.placement.annotated(spread, (None, self.placement.batch_axes, *[None] * (spread.dim() - 2)))

    def run(self, tables: OneFOneBTables, names: tuple[str, ...], seed: torch.Tensor, slots: torch.Tensor,
            valid: torch.Tensor, columns: tuple[torch.Tensor, ...], shares: torch.Tensor, pieces: int,
            weights: tuple[torch.Tensor, ...], held: tuple[torch.Tensor, ...]
            ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The three loops: the step's loss, and the gradients of the slot buffer, the
        blocks' weights and what the layers after the body hold whole (their weights
        ``names``, then the whole skips), for a loss gradient of one. ``pieces``: how the
        microbatch leaving the last stage is cut (:meth:`xpipe.schedule.Lockstep.head_pieces`)."""
        device, replicas = slots.device, self.replicas
        clocks = len(tables.reads)

        def per_device(table: np.ndarray, dtype: torch.dtype | None = slots.dtype) -> torch.Tensor:
            return torch.as_tensor(table, dtype=dtype).repeat_interleave(replicas, 1).to(device)  # [T, S * P, ...]

        keys = cell_keys(seed, torch.arange(clocks, dtype=torch.int32, device=device), self.stages, replicas)
        clock_columns = (torch.as_tensor(tables.reads, dtype=slots.dtype).to(device),
                         torch.as_tensor(tables.gradient_writes, dtype=slots.dtype).to(device),
                         per_device(tables.forwards), per_device(tables.backwards),
                         torch.as_tensor(tables.stash_writes).to(device), per_device(tables.stash_reads, None), keys,
                         keys.gather(0, per_device(tables.backward_clocks, None)))
        held = tuple(self.placement.per_device(t) for t in held)
        rounds = torch.ones(slots.shape[0], 1, dtype=slots.dtype, device=device)
        first = slots[:, 0]  # idle cells run real rows (see xpipe.spmd.conveyor)
        stash = first.unsqueeze(1).expand(-1, tables.ring, *first.shape[1:]).clone()  # the ring
        kept = self._kept_ring(weights, valid, first, rounds, keys[0], tables.ring)
        carry = (first.clone(), torch.zeros_like(first), stash, kept, slots,
                 tuple(torch.zeros_like(w) for w in weights), tuple(_zero_gradient(t) for t in held),
                 torch.zeros(slots.shape[0], dtype=torch.float32, device=device), weights, held, valid, rounds)
        for cells, start, end in Lockstep(self.stages, tables.chunks).loops:
            forward, backward = "F" in cells, "B" in cells
            if end > start:  # the microbatch leaving the last stage: in the steady loop alone
                head_columns = (shares, columns) if forward and backward else ()
                columns_now = (*(column[start:end] for column in clock_columns), *head_columns)
                carry, _ = while_loop(_Clock(self, names, pieces, forward, backward), carry, columns_now)
        gradients, weight_grads, held_grads, losses = carry[4], carry[5], carry[6], carry[7]
        # The gradient of the i-th microbatch to enter rests in stage S - 1 - i % S: flipped back to stage i % S.
        gradients = gradients.unflatten(0, (self.stages, replicas)).flip(0).flatten(0, 1)
        held_grads = [g.sum(0) if g.is_floating_point() else None for g in held_grads]  # the row groups' added up
        return losses.sum(), [gradients, *weight_grads, *held_grads]

    def _kept_ring(self, weights: tuple[torch.Tensor, ...], valid: torch.Tensor, x: torch.Tensor,
                   rounds: torch.Tensor, keys: torch.Tensor, slots: int) -> tuple[torch.Tensor, ...]:
        """With :attr:`stashed`, a ring of ``slots`` for each activation the stages'
        backward reads, ``[S * P, slots, ...]``, as zeros (their shapes from a trace of the
        forward that runs nothing); none without."""
        if self.stashed is None:
            return ()
        _, kept = self.stashed.forward(weights, valid, x, rounds, keys)
        return tuple(torch.zeros(k.shape[0], slots, *k.shape[1:], dtype=k.dtype, device=k.device) for k in kept)

    def next_stage(self, x: torch.Tensor, stages: int) -> torch.Tensor:
        """``x`` (``[S * P, ...]``, stage-major) moved ``stages`` stages up (positive) or
        down (negative): one collective-permute."""
        if self.stages > 1:
            return shift(x, stages * self.replicas)
        return x * 0  # nothing moves with one stage; kept in the traced graph

    def run_head(self, names: tuple[str, ...], held: tuple[torch.Tensor, ...], state: torch.Tensor,
                 pieces: int, columns: tuple[torch.Tensor, ...], share: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The layers after the body and the loss on the last stage's output, cut into
        ``pieces`` over the last stages (:meth:`_spread`), each weighted by its ``share``
        (0 on the stages given no piece): the losses ``[S * P]``, the gradient of the
        stage output (the last stage's; zeros elsewhere) and of each row group's copy of
        what they hold whole (``held``: their weights ``names``, then the whole skips).
        Their dropout masks come from ``keys``, the cell each row group's stage ran
        (:mod:`xpipe.spmd.dropout`), as the blocks' do."""
        head = self.head

        def one_group(x: torch.Tensor, target: torch.Tensor, rows: tuple[torch.Tensor, ...], key: torch.Tensor,
                      *held_: torch.Tensor) -> torch.Tensor:
            weights, whole, rows = dict(zip(names, held_)), iter(held_[len(names):]), iter(rows)
            skips = [next(rows) if has_rows else next(whole) for has_rows in head.skip_rows]
            with ShardableOps(), hashed_dropout(key, HEAD_SLOT):
                output = head.fold(functional_call(head.post, weights, (self.packing.stream(x), *skips)))
            loss = head.loss(output, target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn: must return a scalar tensor")
            self.output_form = _form_of(output, loss)
            return loss.float()

        with torch.enable_grad():
            leaves = [state.detach().requires_grad_(),
                      *(t.detach().requires_grad_() if t.is_floating_point() else t for t in held)]
            losses = torch.vmap(one_group)(self._spread(leaves[0], pieces), columns[0], columns[1:], keys,
                                           *leaves[1:])
            losses = torch.where(share > 0, losses * share.float(), torch.zeros_like(losses))
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            found = iter(torch.autograd.grad(losses.sum(), wanted, allow_unused=True))
        found = [_zero_gradient(leaf) if not leaf.requires_grad else _or_zero(next(found), leaf) for leaf in leaves]
        return losses.detach(), found[0], found[1:]

    def _spread(self, state: torch.Tensor, pieces: int) -> torch.Tensor:
        """``[S * P, rows, ...] -> [S * P, rows / pieces, ...]``: the last stage's rows cut
        into ``pieces``, the ``j``-th on stage ``S - pieces + j`` (the stages before keep a
        piece of their own). The ``k``-th of ``pieces - 1`` collective-permutes moves every
        stage's piece ``pieces - 1 - k`` down ``k`` stages, where stage ``S - 1 - k`` keeps
        what came from the last; the gradient returns by the opposite permutes."""
        cut = state.unflatten(1, (pieces, -1))
        device = torch.arange(state.shape[0], device=state.device).view(-1, *[1] * (state.dim() - 1))
        stage = device.div(self.replicas, rounding_mode="floor")
        spread = cut[:, -1]
        for down in range(1, pieces):
            moved = self.next_stage(cut[:, pieces - 1 - down], -down)
            spread = torch.where(stage == self.stages - 1 - down, moved, spread)
        return spread


def check_even_rows(layout: SlotLayout) -> None:
    """1F1B takes a microbatch's loss on each device's rows of it, so no device may hold
    both the user's rows and padding: the batch must split evenly into ``chunks``
    microbatches of equal rows on each of a stage's devices."""
    if layout.chunks * layout.replicas * layout.rows != layout.batch:
        raise ValueError(
            f"batch: schedule='1f1b' under the spmd executor needs a batch that splits into chunks={layout.chunks} "
            f"microbatches of equal rows on each of a stage's {layout.replicas} devices; {layout.batch} rows do not. "
            f"Pass a batch of a multiple of {layout.chunks * layout.replicas} rows (drop_last=True on the loader)")


def _real_pieces(layout: SlotLayout, microbatched: bool) -> np.ndarray:
    """``[S, P, R]``: whether each device's rows of each slot are the user's (padding
    fills the rest: the slots past ``chunks``; :func:`check_even_rows` holds)."""
    stage, replica, slot = np.meshgrid(np.arange(layout.stages), np.arange(layout.replicas), np.arange(layout.slots),
                                       indexing="ij")
    if microbatched:  # microbatch s * R + r on every device of the stage
        return stage * layout.slots + slot < layout.chunks
    return (stage * layout.replicas + replica) * layout.slots + slot < layout.chunks * layout.replicas


def _stage_vjp(run_stages: Callable[..., torch.Tensor], weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
               x: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor, gradient: torch.Tensor
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every stage's forward from its stashed input ``x`` (``run_stages``: run again, or
    with ``checkpoint="never"`` reading what the forward kept,
    :meth:`StashedActivations.reading`), and the gradients of its input and weights for
    its output's ``gradient``."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(), *(w.detach().requires_grad_() for w in weights)]
        y = run_stages(tuple(leaves[1:]), valid, leaves[0], rounds, keys)
        found = torch.autograd.grad(y, leaves, gradient, allow_unused=True)
    found = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(found, leaves)]
    return found[0], found[1:]


def _form_of(output: Any, loss: torch.Tensor) -> tuple[TreeSpec, int] | None:
    """``output``'s structure and the place of ``loss`` among its leaves (None if not there)."""
    leaves, spec = tree_flatten(output)
    return next(((spec, place) for place, leaf in enumerate(leaves) if leaf is loss), None)


def _zero_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """Where a tensor's gradient adds up (a float zero of its shape; for an integer
    tensor, which has none, a zero that stays one)."""
    return torch.zeros_like(tensor, dtype=tensor.dtype if tensor.is_floating_point() else torch.float32)


def _or_zero(gradient: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if gradient is None else gradient


def _where(live: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` where ``live`` (``[S * P]``) is set, else 0; a NaN of an idle cell stays out."""
    return torch.where(live.view(-1, *[1] * (x.dim() - 1)) > 0, x, torch.zeros_like(x))


def _written(ring: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``ring`` (``[S * P, W, ...]``) with ``x`` (``[S * P, ...]``) written into slot
    ``slot`` (a scalar, the same on every device): one in-place update."""
    return ring.index_copy(1, slot.view(1), x.unsqueeze(1))


def _read(ring: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Slot ``slots[d]`` of ``ring`` on each device ``d`` (a gather along the slot dim,
    local to the device)."""
    index = slots.view(-1, *[1] * (ring.dim() - 1)).expand(ring.shape[0], 1, *ring.shape[2:])
    return ring.gather(1, index).squeeze(1)


class _Clock:
    """The body of one of the three loops: a forward, a backward, or both (with the
    layers after the body and the loss, for the microbatch leaving the last stage)."""

    def __init__(self, step: OneFOneBStep, names: tuple[str, ...], pieces: int, forward: bool, backward: bool
                 ) -> None:
        self.step, self.names, self.pieces, self.forward, self.backward = step, names, pieces, forward, backward

    def __call__(self, carry: tuple, columns: tuple) -> tuple[tuple, tuple]:
        step = self.step
        (state, gradient, stash, rings, buffer, weight_grads, held_grads, losses, weights, held, valid, rounds) = carry
        read, write, forwards, backwards, stash_write, stash_read, keys, backward_keys, *head = columns
        devices = state.shape[0]
        device = torch.arange(devices, device=state.device).view(-1, 1, 1)
        first, last = device < step.replicas, device >= devices - step.replicas
        read_mask, write_mask = read.view(1, -1, 1, 1), write.view(1, -1, 1, 1)
        # One permute each way: up the stages the forward stream and the gradients'
        # column, down them the backward stream and the inputs' column.
        up = step.next_stage(torch.stack([state, (buffer * write_mask).sum(1)], 1), 1)
        down = step.next_stage(torch.stack([gradient, (buffer * read_mask).sum(1)], 1), -1)
        entering = torch.where(read.sum() > 0, (buffer * read_mask).sum(1), buffer[:, 0])
        buffer = torch.where(read_mask > 0, down[:, 1].unsqueeze(1), buffer)
        if self.forward:
            x = torch.where(first, entering, up[:, 0])
            stash = _written(stash, stash_write, x)
            if step.stashed is None:
                with torch.no_grad():
                    state = step.run_stages(weights, valid, x, rounds, keys)
            else:
                state, kept = step.stashed.forward(weights, valid, x, rounds, keys)
                rings = tuple(_written(ring, stash_write, k) for ring, k in zip(rings, kept))
        if self.backward:
            incoming = down[:, 0]
            if self.forward:  # the last stage's gradient is its loss's, this clock
                share, head_columns = head
                loss, from_loss, found = step.run_head(self.names, held, state, self.pieces, head_columns, share,
                                                       keys)
                incoming = torch.where(last, from_loss, incoming)
                losses = losses + loss
                held_grads = tuple(total + g for total, g in zip(held_grads, found))
            run = step.run_stages if step.stashed is None else step.stashed.reading(
                tuple(_read(ring, stash_read) for ring in rings))
            gradient, found = _stage_vjp(run, weights, valid, _read(stash, stash_read), rounds, backward_keys,
                                         incoming)
            gradient = _where(backwards, gradient)
            weight_grads = tuple(total + _where(backwards, g) for total, g in zip(weight_grads, found))
            leaving = torch.where(first, gradient, up[:, 1])
            buffer = torch.where(write_mask > 0, leaving.unsqueeze(1), buffer)
        return (state, gradient, stash, rings, buffer, weight_grads, held_grads, losses, weights, held, valid,
                rounds), ()


class _Step(torch.autograd.Function):
    """The step's loss; its forward makes every gradient (for a loss gradient of one),
    its backward scales them by the loss's actual gradient."""

    @staticmethod
    def forward(ctx, step: OneFOneBStep, tables: OneFOneBTables, names: tuple[str, ...], seed: torch.Tensor,
                slots: torch.Tensor, valid: torch.Tensor, columns: tuple[torch.Tensor, ...], shares: torch.Tensor,
                pieces: int, count: int, *tensors: torch.Tensor) -> torch.Tensor:
        loss, found = step.run(tables, names, seed, slots, valid, columns, shares, pieces, tensors[:count],
                               tensors[count:])
        ctx.present = [g is not None for g in found]
        ctx.save_for_backward(*(g for g in found if g is not None))
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        saved = iter(ctx.saved_tensors)
        grad_slots, *rest = (_scaled(next(saved), grad) if present else None for present in ctx.present)
        return (None, None, None, None, grad_slots, None, None, None, None, None, *rest)


def _scaled(gradient: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    return gradient * by.to(gradient.dtype)
