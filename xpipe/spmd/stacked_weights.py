"""The repeated body's weights, stacked: one ``[S, K, numel]`` tensor per block parameter.

Block ``b`` of the body sits at a (stage, slot) of every stacked tensor: sharded
on "stage" (and "fsdp"), the slots of one stage run one after another inside the
clock loop. How each is placed on the mesh is :mod:`xpipe.spmd.placement`'s.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from xpipe.checkpoints.pieces import Piece, Pieces, ShardSource, flat_boxes
from xpipe.layout import stored_shape
from xpipe.spmd.placement import Placement
from xpipe.tensor.packed_projections import tensor_major


class StackedWeights(nn.Module):
    """The body's parameters, one ``[S, K, numel]`` tensor per block parameter.

    Flattened because torch_xla shards tensors of at most 5 dims; ``shapes`` keeps
    each block parameter's own shape, ``dims`` the dim "tensor" splits (None: none),
    which is stored first (:func:`xpipe.layout.stored_shape`), ``parts`` the sizes
    of the projections a packed one holds along that dim (the step reads it
    tensor-major: :meth:`step_weights`). A block parameter that some blocks freeze
    (``requires_grad=False``) and others train is held twice: the trainable
    blocks' values in the Parameter (zero where a block is frozen, so weight decay
    has nothing to shrink there) and the frozen blocks' values in a buffer; the
    loop reads each slot from the right one, so frozen blocks never change.
    """

    def __init__(self, names: list[str], shapes: list[torch.Size], slots: list[tuple[int, int]],
                 dims: list[int | None], parts: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__()
        self.names = names
        self.shapes = shapes
        self.dims = dims
        self.parts = parts or {}  # name -> the sizes of the projections a packed weight holds
        self.slots = slots  # (stage, slot) of each block
        self.trainable: dict[str, torch.Tensor] = {}  # name -> [S, K, 1] bool on the device, mixed ones only
        self.frozen_slots: dict[str, set[tuple[int, int]]] = {}  # name -> (stage, slot)s it freezes

    @classmethod
    def from_blocks(cls, blocks: list[torch.fx.GraphModule], slots: list[tuple[int, int]], depth: int,
                    device: torch.device, placement: Placement, dims: list[int | None],
                    parts: dict[str, tuple[int, ...]] | None = None) -> StackedWeights:
        """Stack ``blocks`` into ``[S, depth, numel]`` tensors, block ``i`` at ``slots[i]``;
        ``dims``: per block parameter, the dim "tensor" splits, or None; ``parts``: the
        packed ones' projections, by name."""
        named = [list(block.named_parameters()) for block in blocks]
        names = [name for name, _ in named[0]]
        module = cls(names, [p.shape for _, p in named[0]], slots, dims, parts)
        stages = max(s for s, _ in slots) + 1
        for index, name in enumerate(names):
            values = [parameters[index][1] for parameters in named]
            grid = torch.zeros(stages, depth, values[0].numel(), dtype=values[0].dtype)
            trains = torch.zeros(stages, depth, 1, dtype=torch.bool)
            for (stage, slot), value in zip(slots, values):
                grid[stage, slot] = module.stored(index, value.detach())
                trains[stage, slot] = value.requires_grad
            module._register(name, grid, trains, [v.requires_grad for v in values], device, placement)
            module.frozen_slots[name] = {place for place, v in zip(slots, values) if not v.requires_grad}
        return module

    def _register(self, name: str, grid: torch.Tensor, trains: torch.Tensor, flags: list[bool],
                  device: torch.device, placement: Placement) -> None:
        attribute = _attribute(name)
        mixed = any(flags) and not all(flags)
        parameter = nn.Parameter((grid * trains if mixed else grid).to(device), requires_grad=any(flags))
        self.register_parameter(attribute, placement.place(parameter, placement.stacked_spec()))
        if mixed:
            frozen = (grid * ~trains).to(device)
            self.register_buffer(attribute + "__frozen", placement.place(frozen, placement.stacked_spec()))
            self.trainable[name] = trains.to(device)

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, _attribute(name)) for name in self.names]

    def effective_weights(self) -> list[torch.Tensor]:
        """The weights the blocks run with: each slot from its Parameter or, if frozen, its buffer."""
        return [torch.where(self.trainable[name], weight, getattr(self, _attribute(name) + "__frozen"))
                if name in self.trainable else weight for name, weight in zip(self.names, self.weights)]

    def step_weights(self, tensor: int) -> list[torch.Tensor]:
        """The weights as the clock loop reads them over ``tensor`` devices: those
        :meth:`effective_weights`, each packed one tensor-major, so that a device's
        contiguous share holds its share of every projection packed in it."""
        return [tensor_major(weight, self.parts[name], tensor) if name in self.parts else weight
                for name, weight in zip(self.names, self.effective_weights())]

    def stored(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """A value of block parameter ``index`` as it is stored: flat, its split dim first."""
        dim = self.dims[index]
        return (value if dim is None else value.movedim(dim, 0)).flatten()

    def unstored(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """``[numel] -> shape`` of block parameter ``index``: a view, so that writing into it writes the store."""
        dim, shape = self.dims[index], self.shapes[index]
        if dim is None:
            return flat.view(shape)
        return flat.view(stored_shape(tuple(shape), dim)).movedim(0, dim)

    def block_tensor(self, index: int, block: int) -> torch.Tensor:
        """Block ``block``'s value of parameter ``index``, a view of the tensor that holds it."""
        holder, place, index = self.block_place(index, block)
        return self.unstored(index, holder[place])

    def block_place(self, index: int, block: int) -> tuple[torch.Tensor, tuple[int, int], int]:
        """Where block ``block``'s value of parameter ``index`` lives: the tensor that
        holds it (the Parameter, or the frozen buffer), its (stage, slot), and ``index``."""
        name = self.names[index]
        stage, slot = self.slots[block]
        holder = self.weights[index]
        if name in self.trainable and (stage, slot) in self.frozen_slots[name]:
            holder = getattr(self, _attribute(name) + "__frozen")
        return holder, (stage, slot), index

    def block_pieces(self, index: int, at: tuple[int, int], shards: ShardSource) -> Pieces:
        """Block parameter ``index`` of slot ``at`` (stage, slot), in its own shape, as the
        pieces that ``shards`` of its stacked tensor (or of a tensor shaped like it) cover:
        each shard's flat range of the slot, as boxes of the stored shape, moved back to
        the parameter's dims."""
        shape, dim = tuple(self.shapes[index]), self.dims[index]
        stored = stored_shape(shape, dim) or (1,)  # a 0-dim parameter is stored as one element
        axes = tuple(range(len(shape))) if dim is None else (dim, *(d for d in range(len(shape)) if d != dim))
        pieces = []
        for shard, (stages, slots, flat) in enumerate(shards.places):
            if not (stages.start <= at[0] < stages.stop and slots.start <= at[1] < slots.stop):
                continue
            row = (at[0] - stages.start, at[1] - slots.start)
            for offsets, sizes, first in flat_boxes(stored, flat.start, flat.stop):
                placed = [0] * len(shape)
                for axis, offset in zip(axes, offsets):
                    placed[axis] = offset
                moved = [sizes[axes.index(axis)] for axis in range(len(shape))]
                cut = partial(_block_piece, row=row, start=first - flat.start, sizes=sizes, shape=shape,
                                        dim=dim)
                pieces.append(Piece(tuple(placed), tuple(moved), shards, shard, cut))
        return Pieces(torch.Size(shape), shards.dtype, pieces)

    def block_grad(self, index: int, block: int) -> torch.Tensor | None:
        """The gradient of block ``block``'s parameter ``index``; ``None`` if frozen or not computed."""
        stage, slot = self.slots[block]
        weight = self.weights[index]
        if (stage, slot) in self.frozen_slots[self.names[index]] or weight.grad is None:
            return None
        return self.unstored(index, weight.grad[stage, slot])



def _attribute(name: str) -> str:
    return name.replace(".", "__")



def _block_piece(values: torch.Tensor, *, row: tuple[int, int], start: int, sizes: tuple[int, ...],
                 shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    """The box of ``sizes`` that starts ``start`` elements into slot ``row`` of a stacked
    shard's ``values``, in the parameter's own dims (``shape``; stored with ``dim`` first)."""
    piece = values[row][start:start + math.prod(sizes)].view(sizes)
    if not shape:
        return piece.view(())
    return piece.movedim(0, dim) if dim not in (None, 0) else piece
