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
    the dtype of each side input held whole, which the clock loop carries as a
    floating tensor (a causal mask held once is bool) and its blocks read back in it;
    and ``ways``, the tensor devices that each hold a share of every row as it
    crosses stages (Megatron's scatter-gather).

    ``F`` is laid out ``[ways, share]``: each piece is cut into ``ways`` equal parts
    (padded to divide), and a way's share holds its part of every piece, so that
    each of ``ways`` contiguous slices of ``F`` is whole parts, never a piece's edge.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    held: tuple[torch.dtype, ...] = ()
    ways: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(prod(shape) for shape in self.shapes)

    @property
    def parts(self) -> tuple[int, ...]:
        """Each piece's part in one way's share (the piece padded to divide)."""
        return tuple(-(-size // self.ways) for size in self.sizes)

    def pack(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """``[rows, *shape]`` per piece -> ``[rows, F]``."""
        rows = pieces[0].shape[0]
        parts = [self._cut(piece.reshape(rows, -1).to(self.dtypes[0]), part)
                 for piece, part in zip(pieces, self.parts)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 2)).flatten(1)

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[rows, F]`` -> each piece as ``[rows, *shape]`` in its own dtype."""
        shares = self._shares(x)
        parts = torch.split(shares, self.parts, dim=2) if len(self.parts) > 1 else (shares,)
        return [self._uncut(part, index) for index, part in enumerate(parts)]

    def stream(self, x: torch.Tensor) -> torch.Tensor:
        """The stream of a packed ``[rows, F]`` tensor, as ``[rows, *shape]``."""
        return self._uncut(self._shares(x)[:, :, : self.parts[0]], 0)

    def with_stream(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        """``x`` with its stream replaced, the side inputs' bits untouched."""
        part = self._cut(stream.reshape(stream.shape[0], -1), self.parts[0])
        if len(self.sizes) == 1:
            return part.flatten(1)
        return torch.cat([part, self._shares(x)[:, :, self.parts[0]:]], 2).flatten(1)

    def _shares(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, F] -> [rows, ways, share]``."""
        return x.reshape(x.shape[0], self.ways, -1)

    def _cut(self, flat: torch.Tensor, part: int) -> torch.Tensor:
        """``[rows, size]`` -> ``[rows, ways, part]``, padded with zeros to divide."""
        missing = part * self.ways - flat.shape[1]
        if missing < 0:  # a piece with more values a row than its recorded shape: never cut it to fit
            raise ValueError(f"module: a tensor carried with the stream holds {flat.shape[1]} values a row where "
                             f"its shape a row says {part * self.ways}: its dim 0 is not the batch's rows alone; "
                             "use executor='devices'")
        if missing:
            flat = torch.nn.functional.pad(flat, (0, missing))
        return flat.reshape(flat.shape[0], self.ways, part)

    def _uncut(self, part: torch.Tensor, index: int) -> torch.Tensor:
        """Piece ``index`` from its ``[rows, ways, part]`` parts (:meth:`_cut`'s inverse), in its own
        shape and dtype."""
        whole = part.flatten(1)[:, : self.sizes[index]]
        return whole.reshape(part.shape[0], *self.shapes[index]).to(self.dtypes[index])


def packing_for(stream: torch.Tensor, per_row: list[torch.Tensor], held: tuple[torch.Tensor, ...] = (),
                ways: int = 1) -> Packing:
    """The packing of ``stream`` and the per-row side inputs ``per_row``, beside the
    side inputs ``held`` whole, for ``ways`` tensor devices that each carry a share.

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
                   tuple(side.dtype for side in held), ways)


def _holds_exactly(stream: torch.dtype, side: torch.dtype) -> bool:
    if side == stream or side == torch.bool:
        return True
    if side.is_floating_point:
        return side in _EXACT_IN.get(stream, set())
    # Integers (position ids, token ids) below 2**24, as float32 holds them.
    return stream in (torch.float32, torch.float64)
