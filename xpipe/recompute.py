"""Activation recomputation (GPipe's checkpointing): which cells recompute, and how.

:func:`kept_cells` is the one policy both executors follow: from a schedule and a
mode, the (model stage, microbatch) cells whose forward keeps its activations;
every other cell keeps only its inputs and runs again in the backward pass.

``recompute(fn, *tensors)`` runs ``fn`` without recording its intermediates and,
in the backward pass, runs it again to get them. Only the inputs are kept. It is a
plain autograd.Function, so it also works inside the XLA loop that
``torch_xla.experimental.scan`` traces with AOTAutograd (where
``torch.utils.checkpoint`` does not: it looks up ``torch.xla``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xpipe.schedule import FORWARD, Schedule

MODES = ("always", "except_last", "never")


def check_mode(checkpoint: str) -> str:
    """Return ``checkpoint`` if it is a known mode, else raise naming the options."""
    if checkpoint not in MODES:
        raise ValueError(f"checkpoint: {checkpoint!r} is not a mode; use one of {', '.join(MODES)}")
    return checkpoint


def check_lockstep(checkpoint: str) -> None:
    """The recomputation 1F1B under the spmd executor runs (:class:`xpipe.schedule.Lockstep`,
    :mod:`xpipe.spmd.one_f_one_b`): ``"always"`` or ``"never"``; ``"except_last"`` is
    refused, saying why."""
    if checkpoint == "except_last":
        raise ValueError(
            "checkpoint: schedule='1f1b' under the spmd executor runs what one stage runs on every stage, each "
            "clock. 'except_last' keeps the activations of the microbatches that enter last, but in every clock "
            "with a backward but the step's last, some stage's backward is of one it did not keep (the first "
            "stage's are kept from the last clock only): every clock would recompute, and keep activations too. "
            "Pass checkpoint='never' (no recomputation; each device keeps the activations of at most "
            "2 * stages - 1 microbatches) or 'always' (each stage recomputed from its stashed input)")


def kept_cells(schedule: Schedule, checkpoint: str) -> frozenset[tuple[int, int]]:
    """The (model stage, microbatch) cells of ``schedule`` that keep their activations.

    ``"never"`` recomputes nothing, so every cell keeps; ``"always"`` keeps none.
    ``"except_last"`` keeps the forwards that run from the clock at which the last
    microbatch enters the pipeline (its forward on model stage 0) on: the drain,
    whose backwards follow soon, so recomputing them would save little memory for
    a whole extra forward. Under GPipe that is microbatch ``chunks - 1 - s`` and
    later on stage ``s``: on one stage, only the last microbatch, as in GPipe.
    """
    cells = [(clock, action) for clock, row in enumerate(schedule.table) for action in row
             if action is not None and action.kind == FORWARD]
    if check_mode(checkpoint) == "never":
        return frozenset((a.stage, a.microbatch) for _, a in cells)
    if checkpoint == "always":
        return frozenset()
    entry = next(clock for clock, a in cells if a.stage == 0 and a.microbatch == schedule.chunks - 1)
    return frozenset((a.stage, a.microbatch) for clock, a in cells if clock >= entry)


def first_kept_clock(schedule: Schedule, checkpoint: str) -> int:
    """The forward clock of ``schedule`` from which every cell keeps its activations:
    the spmd executor's clock loop splits there, one loop that recomputes, one that
    keeps (:func:`kept_cells`'s kept cells form a suffix of the forward clocks). Every
    clock of a loop keeps what that loop keeps, on every stage, the idle cells of the
    fill and the drain too: they run real rows."""
    kept = kept_cells(schedule, checkpoint)
    rows = schedule.forward_clocks()
    return next((clock for clock, row in enumerate(rows)
                 if any(a is not None and (a.stage, a.microbatch) in kept for a in row)), len(rows))


Fence = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def recompute(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, fence: Fence | None = None) -> torch.Tensor:
    """``fn(*tensors)``, keeping only ``tensors`` for the backward pass.

    ``fence``, where given, takes the kept tensors and the gradient that arrives for
    ``fn``'s output, and returns them with the kept ones made to depend on that
    gradient (:func:`xpipe.spmd.ordering.after_gradient`): the recomputation then
    cannot start before the gradient exists. Several recomputed calls in a row,
    inside one XLA program, thus run one at a time in the backward, each freeing
    what it made before the next begins; without it XLA may recompute them all
    first and hold every one's activations.
    """
    return _Recompute.apply(fn, fence, *tensors)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], fence: Fence | None, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.fence = fn, fence
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept = list(ctx.saved_tensors)
        if ctx.fence is not None:
            *kept, grad = ctx.fence([*kept, grad])
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in kept]
        with torch.enable_grad():
            output = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(output, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if t.requires_grad else None for t in inputs))
