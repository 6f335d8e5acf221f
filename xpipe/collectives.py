"""Named moves of tensors along a mesh axis, and the XLA collective each lowers to.

Under SPMD, a tensor whose dim 0 is sharded over the "stage" axis holds one slice
per stage. These helpers move slices between stages with expressions that XLA's
SPMD partitioner turns into a single ``collective-permute`` (see XLA_FACTS.md:
``torch.roll`` or ``index_select`` would become all-gathers or all-to-alls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def shift(x: torch.Tensor, offset: int) -> torch.Tensor:
    """Move slice ``i`` of dim 0 to ``i + offset``; slices shifted in from outside are zeros.

    With dim 0 sharded one slice per device, ``shift(x, k)`` hands every device's
    slice to the device ``k`` places on (the first ``k`` receive zeros), and
    ``shift(x, -k)`` to the one ``k`` places back. It lowers to one
    collective-permute, and so does its gradient (the opposite shift).

    Args:
        x: ``[n, ...]``.
        offset: a non-zero whole number of places, ``|offset| < n``.
    """
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 < abs(offset) < x.shape[0]:
        raise ValueError(f"offset: must be a non-zero int smaller in size than dim 0 ({x.shape[0]}), got {offset!r}")
    return _Shift.apply(x, offset)


def _shift_with_zeros(x: torch.Tensor, offset: int) -> torch.Tensor:
    unpadded = [0, 0] * (x.dim() - 1)
    if offset > 0:
        return F.pad(x, unpadded + [offset, 0])[:-offset]
    return F.pad(x, unpadded + [0, -offset])[-offset:]


class _Shift(torch.autograd.Function):
    """A shift whose backward is written as the opposite shift.

    Left to autograd, the backward of pad-then-slice reaches the partitioner in a
    form it lowers to several permutes (by 1, 2 and 3 stages); written as the
    mirror shift it stays one.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, offset: int) -> torch.Tensor:
        ctx.offset = offset
        return _shift_with_zeros(x, offset)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift_with_zeros(grad, -ctx.offset), None
