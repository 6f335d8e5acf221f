"""Keep the step's collectives out of the clock loops' way.

On XLA's CPU runtime (the emulated devices every test runs on) a collective of
the step that neither feeds a clock loop nor reads its results may run while the
loop runs, on some devices before the loop's collectives and on others after:
each device then waits in a different collective, and the runtime aborts the
process at a rendezvous timeout (the runs that showed it: docs/performance.md,
"Ordering the step's collectives"). A TPU runs each device's collectives in the program's order and has no such
hazard. The loops are fenced instead: what runs before a loop is finished before
it starts, and what runs after it (the head, its loss, their gradients) starts
after it ends, forward and backward. The loss's loops over sequence segments
(:mod:`xpipe.spmd.segmented_loss`) start after the count of labels its mean
divides by, whose reduction over the row groups would otherwise run beside them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from xpipe._xla import optimization_barrier_


class _Fence(torch.autograd.Function):
    """Identity on its tensors, through one optimization barrier; its backward passes
    their gradients through one too."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fenced = [tensor.clone() for tensor in tensors]
        optimization_barrier_(fenced)
        return tuple(fenced)

    @staticmethod
    def backward(ctx, *gradients: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        present = [gradient.clone() for gradient in gradients if gradient is not None]
        optimization_barrier_(present)
        fenced = iter(present)
        return tuple(None if gradient is None else next(fenced) for gradient in gradients)


def fenced(first: torch.Tensor, rest: Any) -> tuple[torch.Tensor, Any]:
    """``first`` and the tensors in ``rest`` (a pytree; what is not a tensor passes
    as it is), each computed before any is used, and their gradients likewise."""
    leaves, spec = tree_flatten(rest)
    places = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    first, *tensors = _Fence.apply(first, *(leaves[index] for index in places))
    for index, tensor in zip(places, tensors):
        leaves[index] = tensor
    return first, tree_unflatten(leaves, spec)


def tied_to(tensors: list[torch.Tensor], anchor: torch.Tensor) -> list[torch.Tensor]:
    """``tensors``, each made to depend on ``anchor`` by data, so that nothing computed
    from them can start before ``anchor`` exists: in a clock loop's body, where XLA's
    CPU compiler drops optimization barriers before it schedules (and so gathered
    every slot's weights at the body's start).

    Every tensor is ``[S * P, ...]``, a row per device (sharded over the batch axes):
    each device's rows are tied to its own first element of ``anchor``, so nothing
    moves between devices. The tie is that element (no gradient flows back to
    ``anchor``) times zero, added to every floating tensor: XLA does not fold ``x * 0``
    for floats, since a NaN or an infinity stays one; a non-finite ``anchor`` thus
    turns what is tied to it into NaN, where the step's numbers are lost anyway.
    """
    tie = anchor.detach().flatten(1)[:, :1] * 0  # [S * P, 1]
    return [t + tie.to(t.dtype).view(-1, *[1] * (t.dim() - 1)) if t.is_floating_point() else t for t in tensors]


def behind(x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``x``, tied to ``anchor`` element by element both ways: nothing computed from it
    starts before ``anchor`` exists, and ``anchor``'s gradient, to which the tie adds
    zero, is not complete before ``x``'s is. ``anchor`` broadcasts against ``x`` in the
    layout ``x`` has, so the tie moves nothing between devices.

    In a clock loop's body two collectives that no data orders may start in another
    order on each device of XLA's CPU runtime, and it can deadlock. The conveyor's
    permute of the slot buffer's columns reads nothing the blocks make; behind the
    stage's output it runs after the blocks' collectives, and in the backward its
    gradient's before theirs.
    """
    return x + anchor * 0


def read_after(values: Any, anchor: torch.Tensor) -> Any:
    """``values`` (a pytree; what is not a tensor passes as it is), each tensor made to
    depend by data on ``anchor``'s first element, so that nothing computed from them,
    collectives included, starts before ``anchor`` exists. Each keeps its values: the
    tie adds a zero made from that element (zero too where the element is not finite),
    in the tensor's dtype, or or-s a bool tensor with False. XLA brings the element to
    every device with one all-reduce of one number, itself after ``anchor``.

    The optimization barrier of :func:`fenced` does not hold what the layers after the
    body read from the step's inputs (the loss's count of labels): the compiler drops
    it, and their reductions were free to run beside the clock loops.
    """
    zero = torch.nan_to_num(anchor.detach().flatten()[0] * 0, nan=0.0, posinf=0.0, neginf=0.0)
    leaves, spec = tree_flatten(values)
    tied = [leaf | zero.bool() if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bool
            else leaf + zero.to(leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return tree_unflatten(tied, spec)


def after_gradient(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors[:-1]`` tied to ``tensors[-1]`` (:func:`tied_to`), a gradient, then that
    gradient: a recomputation fed by them (:func:`xpipe.recompute.recompute`'s
    ``fence``) cannot start before the gradient it serves exists, so that a backward
    recomputes its blocks one at a time."""
    *kept, gradient = tensors
    return tied_to(kept, gradient) + [gradient]
