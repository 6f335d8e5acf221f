"""``pipe.step``'s loss under the devices executor, one microbatch at a time.

Each microbatch's loss is weighted so that their sum is ``loss_fn`` of the whole
batch (:mod:`xpipe.reduction`); a ``loss_fn`` that does not say how it reduces is
checked against the whole batch's loss, and a refused step puts every gradient
back as it was.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from xpipe.devices.microbatch import merged_on_host, moved, on_host
from xpipe.reduction import loss_fn_items, shares, weighted


class StepLoss:
    """``pipe.step``'s loss, one microbatch at a time: each microbatch's loss is weighted
    so that their sum is ``loss_fn`` of the whole batch: by its share of the items a
    mean-reducing ``loss_fn`` averages over (rows, or the targets it does not ignore:
    :mod:`xpipe.reduction`), by 1 for one whose ``reduction`` is ``"sum"``.

    A ``loss_fn`` that does not say how it reduces (a function of the user's) is taken
    to mean over rows, and checked on its first step and on every batch that tells the
    reductions apart (:func:`xpipe.reduction.tells_reductions_apart`): if ``loss_fn``
    of the whole batch differs from the weighted microbatch losses, the step raises.
    """

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], targets: list[Any], device: torch.device,
                 check: bool) -> None:
        items = [loss_fn_items(fn, on_host(target)) for target in targets]
        self.fn = fn
        self.targets = [moved(target, device) for target in targets]
        self.weights = [1.0] * len(items) if items[0] is None else [moved(w, device) for w in shares(items)]
        self.values: list[torch.Tensor | None] = [None] * len(items)  # each microbatch's share, detached
        self.outputs: list[Any] | None = [None] * len(items) if check else None  # kept for the check

    def share(self, microbatch: int, output: Any) -> torch.Tensor:
        """``microbatch``'s share of the loss, from its output."""
        loss = self.fn(output, self.targets[microbatch])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"loss_fn: must return a scalar tensor, got "
                             f"{list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if self.outputs is not None:
            self.outputs[microbatch] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)
        return weighted(loss, self.weights[microbatch])

    def total(self) -> torch.Tensor:
        """The step's loss: the shares summed."""
        return functools.reduce(operator.add, self.values)

    def check_reduction(self, microbatch_dim: int | None, scalar_shares: list[torch.Tensor | float]) -> bool:
        """Raise unless ``loss_fn`` of the whole batch is the weighted microbatch losses;
        False (nothing to compare: check another batch) where that loss is NaN or inf."""
        host_shares = on_host(scalar_shares)
        whole_output, whole_target = (merged_on_host(parts, microbatch_dim, host_shares)
                                      for parts in (self.outputs, self.targets))
        total = self.total()
        expected, got = self.fn(whole_output, whole_target).detach().float(), total.cpu().float()
        if not torch.isfinite(expected):
            return False
        if not torch.isfinite(got):
            raise ValueError(
                f"loss_fn: the step's loss is {got.item()} where the whole batch's is {expected.item():.6g}: a "
                "microbatch's loss is NaN or inf (a mean over no target, if all of a microbatch's targets are "
                "ignored). Say how it reduces: give the function `reduction` ('mean') and `ignore_index` "
                "attributes, or pass a torch loss such as nn.CrossEntropyLoss(ignore_index=-100)")
        tolerance = 1e-4 if total.dtype in (torch.float32, torch.float64) else 2e-2
        if not torch.allclose(got, expected, rtol=tolerance, atol=1e-6):
            raise ValueError(
                f"loss_fn: on the whole batch it gives {expected.item():.6g}, and its microbatches' losses weighted "
                f"by their rows give {got.item():.6g}: it does not mean over rows (it sums, or ignores some targets), "
                "and pipe.step would train on the wrong loss. Say how it reduces: give the function a "
                "`reduction` attribute ('sum', or 'mean' with `ignore_index` for ignored integer targets), or "
                "pass a torch loss such as nn.CrossEntropyLoss(ignore_index=-100)")
        return True



def saved_grads(tensors: list[torch.Tensor]) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Each tensor's ``.grad`` now, and a copy of its values (autograd adds into it in place)."""
    return {tensor: None if tensor.grad is None else (tensor.grad, tensor.grad.clone()) for tensor in tensors}



def restore_grads(saved: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Put back the ``.grad`` objects and values that :func:`saved_grads` saved."""
    with torch.no_grad():
        for tensor, before in saved.items():
            if before is not None:
                before[0].copy_(before[1])
            tensor.grad = None if before is None else before[0]
