"""Keep the step's collectives out of the clock loops' way.

On XLA's CPU runtime (the emulated devices every test runs on) a collective of
the step that neither feeds a clock loop nor reads its results may run while the
loop runs, on some devices before the loop's collectives and on others after:
each device then waits in a different collective, and the runtime aborts the
process at a rendezvous timeout (measured: GPT-2 on 2 stages x 2 fsdp x 2
tensor with its head split by vocabulary, 7 runs in 24, devices in the head's
all-reduce over "tensor" while others waited in the loop's collective-permute).
A TPU runs each device's collectives in the program's order and has no such
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
    CPU compiler drops optimization barriers before it schedules (measured: with or
    without one, the body of a stage of 8 blocks gathered per block gathered all 8
    slots' weights at its start, and its backward ran all 8 recomputations first,
    holding their attention probabilities at once).

    Every tensor is ``[S * P, ...]``, a row per device (sharded over the batch axes):
    each device's rows are tied to its own first element of ``anchor``, so nothing
    moves between devices. The tie is that element (no gradient flows back to
    ``anchor``) times zero, added to every floating tensor: XLA does not fold ``x * 0``
    for floats, since a NaN or an infinity stays one; a non-finite ``anchor`` thus
    turns what is tied to it into NaN, where the step's numbers are lost anyway.
    """
    tie = anchor.detach().flatten(1)[:, :1] * 0  # [S * P, 1]
    return [t + tie.to(t.dtype).view(-1, *[1] * (t.dim() - 1)) if t.is_floating_point() else t for t in tensors]


def after_gradient(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors[:-1]`` tied to ``tensors[-1]`` (:func:`tied_to`), a gradient, then that
    gradient: a recomputation fed by them (:func:`xpipe.recompute.recompute`'s
    ``fence``) cannot start before the gradient it serves exists, so that a backward
    recomputes its blocks one at a time."""
    *kept, gradient = tensors
    return tied_to(kept, gradient) + [gradient]
