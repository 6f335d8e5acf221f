"""The clock loop as an XLA while loop whose loop-invariant carries are held once.

``torch_xla.experimental.scan`` saves, for every iteration, each activation its
backward reads, keeping as they are only those that are slices of ``xs``. A
carry the body reads unchanged every clock (the stage weights) is read by every
backward clock too, so scan stacks one copy of it per clock: a step's peak grew
by the stage's weights with every microbatch (8 MiB of weights per device: 66 ->
163 MiB of XLA's peak from 4 to 16 microbatches).

:func:`scan_holding_once` runs scan's own forward and backward graphs (its tracing
and partition), but leaves the activations that are those carries themselves out
of the per-clock stack and carries them through the backward loop instead. Cells
that recompute their forward save only their inputs, so their weights are held
once whatever the number of clocks; cells that keep their activations still save
per clock the views of the weights their matmuls read (see docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch_xla.runtime as xr
from torch.utils._pytree import tree_flatten, tree_unflatten
# The pieces scan itself is built of (torch_xla pinned at 2.9): its tracing into
# forward and backward graphs, its while loop, and its SPMD gradient sharding.
from torch_xla.experimental.scan import _backward_shard_alike, _scan_impl_pytree, value_and_grad_partitioned

Carry = tuple


def scan_holding_once(fn: Callable, init: Carry, xs: tuple, held: Callable[[Carry], tuple]) -> Carry:
    """``scan(fn, init, xs)``'s final carry, with the carries ``held`` picks kept once.

    ``fn(carry, x) -> (carry, None)`` must return the tensors ``held(carry)`` names
    unchanged (they may still take gradients: they flow back through the carry as
    in scan). Outputs per iteration (``y``) are not supported: the clock loop has none.
    """
    flat_init, carry_spec = tree_flatten(init)
    held_ids = {id(t) for t in tree_flatten(held(init))[0]}
    held_at = tuple(i for i, t in enumerate(flat_init) if id(t) in held_ids)
    graphs = value_and_grad_partitioned(fn, init, xs, is_fn_pure=True)  # (forward, alias_input, backward)
    flat_xs, xs_spec = tree_flatten(xs)
    parts = _LoopParts(graphs, carry_spec, xs_spec, len(flat_init), held_at)
    return tree_unflatten(list(_Loop.apply(parts, *flat_init, *flat_xs)), carry_spec)


class _LoopParts:
    """The traced graphs of one loop, and which of their activations are held carries."""

    def __init__(self, graphs: tuple[Callable, Callable, Callable], carry_spec, xs_spec, carries: int,
                 held: tuple[int, ...]) -> None:
        self.forward, self.alias_input, self.backward = graphs
        self.carry_spec, self.xs_spec, self.carries, self.held = carry_spec, xs_spec, carries, held
        self.positions: tuple[int | None, ...] = ()  # per activation: the held carry it is, or None
        self.inputs: tuple[Carry, tuple] | None = None  # (init, xs), for the backward's SPMD sharding

    def forward_body(self, carry: Carry, x: tuple) -> tuple[Carry, tuple]:
        """One clock: the new carry, and the activations that are not held carries."""
        new_carry, (y, activations) = self.forward(carry, x)
        if any(leaf is not None for leaf in tree_flatten(y)[0]):
            raise ValueError("fn: scan_holding_once runs loops whose body returns (carry, None)")
        flat_carry = tree_flatten(carry)[0]
        held = [flat_carry[i] for i in self.held]
        self.positions = tuple(next((k for k, h in enumerate(held) if a is h), None) for a in activations)
        return new_carry, tuple(a for a, k in zip(activations, self.positions) if k is None)

    def backward_body(self, carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        """One clock backwards: ``((grad of the carry, held), (kept activations, x))`` ->
        ``((grad of the carry before it, held), grad of x)``."""
        grad_carry, held = carry
        kept, x_slice = x
        kept = iter(kept)
        partial_activations = tuple(next(kept) if k is None else held[k] for k in self.positions)
        activations = self.alias_input(partial_activations, x_slice)
        run = self.backward
        if xr.is_spmd():
            init, xs = self.inputs
            run = partial(_backward_shard_alike, backward=self.backward, init=init, xs=xs)
        grad_before, grad_x = run(tree_unflatten(list(grad_carry), self.carry_spec), (None, activations))
        return (tuple(tree_flatten(grad_before)[0]), held), grad_x


class _Loop(torch.autograd.Function):
    """The loop forward without autograd, saving the kept activations once per clock
    and the inputs once; the backward loop runs in reverse, carrying the held ones."""

    @staticmethod
    def forward(ctx, parts: _LoopParts, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        init = tree_unflatten(list(flat[:parts.carries]), parts.carry_spec)
        xs = tree_unflatten(list(flat[parts.carries:]), parts.xs_spec)
        with torch.no_grad():
            carry, kept = _scan_impl_pytree(parts.forward_body, init, xs)
        ctx.parts, ctx.inputs = parts, len(flat)
        ctx.save_for_backward(*flat, *kept)
        return tuple(tree_flatten(carry)[0])

    @staticmethod
    def backward(ctx, *grad_carry: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        parts = ctx.parts
        flat, kept = ctx.saved_tensors[:ctx.inputs], ctx.saved_tensors[ctx.inputs:]
        init = tree_unflatten(list(flat[:parts.carries]), parts.carry_spec)
        xs = tree_unflatten(list(flat[parts.carries:]), parts.xs_spec)
        parts.inputs = init, xs
        held = tuple(flat[i] for i in parts.held)
        with torch.no_grad():
            (grad_init, _), grad_xs = _scan_impl_pytree(parts.backward_body, (grad_carry, held), (kept, xs),
                                                        reverse=True)
        return None, *grad_init, *tree_flatten(grad_xs)[0]
