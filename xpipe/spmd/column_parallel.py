"""Column-parallel linears whose input gradient is reduced over "tensor" once per
input, not once per linear: Megatron's ``f`` operator, in GSPMD's terms.

A block's column-parallel linears (q, k and v; gate and up) read one input each,
whole on every device of a tensor group, and each device computes its part of
their outputs. In the backward, each linear's input gradient is a partial sum over
"tensor"; Megatron adds the partial sums of all the linears that read the input and
reduces once. GSPMD gives every operation a sharding of its own and has none for
"partial": it all-reduced the gradient of each linear separately, five per Llama
block where Megatron has two (measured in the backward clock loop, Llama on 2
stages x 2 fsdp x 2 tensor: 10 activation all-reduces over "tensor" for a stage of
two blocks, 4 with this).

Here the input is spread along a new leading dim of "tensor"'s size, one copy per
tensor device, and each linear is an einsum over that dim against its weight viewed
as ``[T, out / T, in]``, whose leading dim is the one "tensor" splits: every
device's product is local, the gradients of every linear that reads the input add
up on the spread copies, locally, and the spread's backward (a sum over its new
dim) is the one reduction over "tensor". The output, ``[..., T, out / T]``
flattened, is split over "tensor" by its features as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LINEARS = (F.linear, torch.ops.aten.linear.default)  # an nn.Linear's call; what torch.export records of it


class ColumnParallelLinears(TorchFunctionMode):
    """Inside this mode (one block's call), the linears whose weight is one of
    ``column`` (by identity: the block's weights that "tensor" splits by their
    output features) run as described in the module's docstring, each input spread
    once over ``tensor`` devices and shared by every such linear that reads it."""

    def __init__(self, column: list[torch.Tensor], tensor: int) -> None:
        super().__init__()
        self._column = {id(weight): weight for weight in column}  # kept, so that no other tensor takes an id
        self._tensor = tensor
        self._spread: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in LINEARS:
            named = dict(zip(("input", "weight", "bias"), args)) | kwargs
            if id(named.get("weight")) in self._column:
                return self._linear(named["input"], named["weight"], named.get("bias"))
        return func(*args, **kwargs)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with ``x`` spread over a leading dim of "tensor"'s size."""
        parts = self._tensor
        y = torch.einsum("t...i,tpi->t...p", self._spread_of(x), weight.reshape(parts, -1, weight.shape[-1]))
        if bias is not None:
            y = y + bias.reshape(parts, *[1] * (x.dim() - 1), -1)
        return y.movedim(0, -2).flatten(-2)

    def _spread_of(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` repeated along a new leading dim of "tensor"'s size; one per input
        (kept with ``x``, so that its identity is not another tensor's)."""
        kept = self._spread.get(id(x))
        if kept is None:
            kept = (x, x.unsqueeze(0).expand(self._tensor, *x.shape))
            self._spread[id(x)] = kept
        return kept[1]
