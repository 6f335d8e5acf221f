"""Checkpoint tensors written shard by shard: a tensor as the pieces of it this host
holds, each written by ``torch.distributed.checkpoint`` as one chunk of the whole.

A sharded tensor reaches the host as its shards (one replica of each), never put
together: a checkpoint key that is a slice of a stacked body weight becomes the
boxes of the key's tensor that each shard covers (:func:`flat_boxes`), in the
key's own coordinates, so the checkpoint stays layout-free: a load (of any
layout, or of the plain model) reads the chunks that overlap each tensor it fills.
DCP's planner validates at save time that each tensor's chunks tile it with no
gap and no overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from xpipe._xla import Shard

Piece = tuple[tuple[int, ...], torch.Tensor]  # (its offsets into the whole, its values)


@dataclass
class Chunks:
    """A tensor of ``shape`` and ``dtype`` as the pieces of it this host holds."""

    shape: torch.Size
    dtype: torch.dtype
    pieces: list[Piece]

    def __create_write_items__(self, fqn: str, _: object) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), piece.shape),
                                                      properties=properties, size=self.shape))
                for offsets, piece in self.pieces]

    def piece_at(self, offsets: torch.Size) -> torch.Tensor:
        return next(piece for at, piece in self.pieces if torch.Size(at) == offsets)


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner, reading each chunk's data from its :class:`Chunks`."""

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunks):
            return value.piece_at(index.offset)
        return super().lookup_object(index)


def from_shards(shape: torch.Size, dtype: torch.dtype, shards: list[Shard]) -> Chunks:
    """A tensor from the shards of it this host holds (:func:`xpipe._xla.host_shards`)."""
    return Chunks(shape, dtype, [(tuple(part.start for part in index), values) for index, values in shards])


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The elements ``start`` to ``stop`` of a row-major tensor of ``shape``, as boxes
    (offsets, sizes, first flat element) that each lie contiguous in that order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # inside one slab of dim 0
        return [((first, *offsets), (1, *sizes), first * row + flat)
                for offsets, sizes, flat in flat_boxes(shape[1:], start - first * row, stop - first * row)]
    boxes = []
    if start % row:  # the partial first slab
        boxes += flat_boxes(shape, start, (first + 1) * row)
        first += 1
    whole_end = last + 1 if stop % row == 0 else last
    if whole_end > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (whole_end - first, *shape[1:]), first * row))
    if stop % row:
        boxes += flat_boxes(shape, last * row, stop)
    return boxes
