"""Side inputs: tensors computed before the stacked body that every block reads.

An attention mask, position ids, rotary cos/sin: the model computes them once,
before its first block, and passes them to each. Under the spmd executor a side
input with a row per batch row must reach each stage with the microbatch that
stage is running, so it travels *inside* the stream: the stream and such sides
are packed into one ``[rows, features]`` tensor, which crosses stages in the
permutes the stream needs anyway (no extra collective). A side input that is the
same for every row (rotary tables built for one sequence) is held whole by every
stage and does not travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

# Floating dtypes that hold every value of another dtype exactly.
_EXACT_IN = {
    torch.float32: {torch.float16, torch.bfloat16},
    torch.float64: {torch.float16, torch.bfloat16, torch.float32},
}


@dataclass(frozen=True)
class Packing:
    """How the stream (piece 0) and the per-row side inputs share one ``[rows, F]``
    tensor of the stream's dtype: each piece's shape (without its row dim) and dtype;
    and the dtype of each side input held whole, which the clock loop carries as a
    floating tensor (a causal mask held once is bool) and its blocks read back in it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    held: tuple[torch.dtype, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(prod(shape) for shape in self.shapes)

    def pack(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """``[rows, *shape]`` per piece -> ``[rows, F]``."""
        flat = [piece.reshape(piece.shape[0], -1).to(self.dtypes[0]) for piece in pieces]
        return flat[0] if len(flat) == 1 else torch.cat(flat, 1)

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[rows, F]`` -> each piece as ``[rows, *shape]`` in its own dtype."""
        parts = torch.split(x, self.sizes, dim=1) if len(self.sizes) > 1 else (x,)
        return [part.reshape(x.shape[0], *shape).to(dtype)
                for part, shape, dtype in zip(parts, self.shapes, self.dtypes)]

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        """The stream of a packed ``[rows, F]`` tensor, as ``[rows, *shape]``."""
        return x[:, : self.sizes[0]].reshape(x.shape[0], *self.shapes[0])

    def with_stream(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """``x`` with its stream replaced, the side inputs' bits untouched."""
        flat = stream.reshape(stream.shape[0], -1)
        return flat if len(self.sizes) == 1 else torch.cat([flat, x[:, self.sizes[0]:]], 1)


def packing_for(stream: torch.Tensor, per_row: list[torch.Tensor], held: tuple[torch.Tensor, ...] = ()) -> Packing:
    """The packing of ``stream`` and the per-row side inputs ``per_row``, beside the
    side inputs ``held`` whole.

    Raises:
        ValueError: a side input whose values the stream's dtype cannot hold exactly
            (a float32 mask beside a bfloat16 stream; integers beside a bfloat16 one).
    """
    for index, side in enumerate(per_row):
        if not _holds_exactly(stream.dtype, side.dtype):
            raise ValueError(
                f"module: the blocks read a per-row {side.dtype} tensor (side input {index}, shape "
                f"{tuple(side.shape)}) that travels with the {stream.dtype} hidden state, which cannot hold its "
                f"values exactly; compute it in {stream.dtype} (or bool) before the body, or use "
                "executor='devices'")
    pieces = [stream, *per_row]
    return Packing(tuple(tuple(piece.shape[1:]) for piece in pieces), tuple(piece.dtype for piece in pieces),
                   tuple(side.dtype for side in held))


def _holds_exactly(stream: torch.dtype, side: torch.dtype) -> bool:
    if side == stream or side == torch.bool:
        return True
    if side.is_floating_point:
        return side in _EXACT_IN.get(stream, set())
    # Integers (position ids, token ids) below 2**24, as float32 holds them.
    return stream in (torch.float32, torch.float64)
