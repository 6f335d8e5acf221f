"""Activation recomputation (GPipe's checkpointing) for a function of tensors.

``recompute(fn, *tensors)`` runs ``fn`` without recording its intermediates and,
in the backward pass, runs it again to get them. Only the inputs are kept. It is a
plain autograd.Function, so it also works inside the XLA loop that
``torch_xla.experimental.scan`` traces with AOTAutograd (where
``torch.utils.checkpoint`` does not: it looks up ``torch.xla``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MODES = ("always", "except_last", "never")


def check_mode(checkpoint: str) -> str:
    """Return ``checkpoint`` if it is a known mode, else raise naming the options."""
    if checkpoint not in MODES:
        raise ValueError(f"checkpoint: {checkpoint!r} is not a mode; use one of {', '.join(MODES)}")
    return checkpoint


def recompute(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)``, keeping only ``tensors`` for the backward pass."""
    return _Recompute.apply(fn, *tensors)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
        with torch.enable_grad():
            output = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(output, wanted, grad, allow_unused=True))
        return (None, *(next(grads) if t.requires_grad else None for t in inputs))
