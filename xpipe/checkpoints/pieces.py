"""Checkpoint tensors written and read shard by shard: a tensor as the pieces of it
this host holds, each one chunk of the whole for ``torch.distributed.checkpoint``.

A save reads a sharded tensor's shards (one replica of each) only when DCP writes
their chunks, tensor after tensor, so that a blocking save holds about one
tensor's shards at a time; a load fills buffers for the shards this host's devices
hold, DCP reading the saved chunks that overlap each (any layout into any other).
Neither puts a tensor together on the host. A checkpoint key that is a slice of a
stacked body weight becomes the boxes of the key's tensor that each shard covers
(:func:`flat_boxes`), in the key's own coordinates, so the checkpoint stays
layout-free. DCP's planner validates at save time that each tensor's chunks tile it
with no gap and no overlap.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan, SavePlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


class ShardSource(Protocol):
    """The shards of one tensor on this host, at ``places`` (slices of the whole):
    :class:`xpipe.checkpoints.shards.HostShards` to save from, :class:`xpipe.checkpoints.shards.ShardBuffers` to
    load into."""

    places: list[tuple[slice, ...]]
    dtype: torch.dtype

    def expect_read(self) -> None: ...

    def read(self, shard: int) -> torch.Tensor: ...


class ShardDestination(ShardSource, Protocol):
    """Shards a load writes into (:class:`xpipe.checkpoints.shards.ShardBuffers`),
    told when every saved piece that overlaps them has been written; they say whether
    that changed, in place, a tensor the model or optimizer holds."""

    def filled(self) -> bool: ...


def _whole(values: torch.Tensor) -> torch.Tensor:
    return values


@dataclass
class Piece:
    """One piece of a tensor (DCP's chunk): where it lies (``offsets``, ``sizes``) and
    how to read its values: ``cut`` applied to shard ``shard`` of ``source`` (a view,
    which a load writes through)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: ShardSource
    shard: int
    cut: Callable[[torch.Tensor], torch.Tensor] = _whole

    def read(self) -> torch.Tensor:
        return self.cut(self.source.read(self.shard))


class Pieces:
    """A tensor of ``shape`` and ``dtype`` as the pieces of it this host holds: to save,
    read from its shards only when DCP writes them (:class:`xpipe.checkpoints.shards.HostShards`);
    to load, written into its shards' buffers (:class:`xpipe.checkpoints.shards.ShardBuffers`)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, pieces: list[Piece]) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self._pieces = {torch.Size(piece.offsets): piece for piece in pieces}
        for piece in pieces:
            piece.source.expect_read()

    def __create_write_items__(self, fqn: str, _: object) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(piece.sizes)),
                                                      properties=properties, size=self.shape))
                for offsets, piece in self._pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, torch.Size(piece.sizes)) for offsets, piece in self._pieces.items()]

    def size(self) -> torch.Size:
        """The whole tensor's shape (DCP checks it against the checkpoint's)."""
        return self.shape

    def piece_at(self, offsets: torch.Size) -> torch.Tensor:
        """The values of the piece at ``offsets``."""
        return self._pieces[offsets].read()

    def source_at(self, offsets: torch.Size) -> ShardSource:
        """The shards the piece at ``offsets`` is read from, or written into."""
        return self._pieces[offsets].source

    def sources(self) -> list[ShardSource]:
        """The shards the pieces are read from."""
        return list({id(piece.source): piece.source for piece in self._pieces.values()}.values())

    def fetch(self) -> None:
        """Bring every piece's values to the host now (a save's pieces, read from
        :class:`xpipe.checkpoints.shards.HostShards`)."""
        for source in self.sources():
            source.fetch()


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default planner, reading each chunk's data from its :class:`Pieces`."""

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return value.piece_at(index.offset)
        return super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, writing each chunk's data into its :class:`Pieces`' piece,
    and telling each destination's shards when the last saved piece that overlaps
    them is written (:meth:`ShardDestination.filled`): a load then hands tensor
    after tensor to the devices as DCP reads them, in the state dict's order.
    ``put_in_place`` counts the destinations that changed a tensor in place so far,
    of ``destinations``."""

    def __init__(self) -> None:
        super().__init__()
        self._unread: Counter[int] = Counter()
        self._destinations: dict[int, ShardDestination] = {}
        self.put_in_place = 0

    @property
    def destinations(self) -> int:
        return len(self._destinations)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up puts None in place of every value it does not know (torch 2.9's
        # _init_state_dict), so the Pieces are put back where the flattened keys point.
        pieces = dict(_pieces_in(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, value in pieces.items():
            _put(state_dict, path, value)
        for fqn, path in self.mappings.items():
            if tuple(path) in pieces:
                self.state_dict[fqn] = pieces[tuple(path)]

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """DCP's plan, its reads grouped by the destination they fill, in the order
        each destination is first read: DCP reads in the plan's order, and the state
        dict names a weight's AdamW states side by side, so without the grouping both
        states' buffers would fill, and be held, together."""
        plan = super().finish_plan(new_plan)
        first_read: dict[int, int] = {}
        read_order = []  # per item: where its destination is first read (its own place if it has none)
        for position, item in enumerate(plan.items):
            destination = self._destination_of(item)
            if destination is None:
                read_order.append(position)
                continue
            self._unread[id(destination)] += 1
            self._destinations[id(destination)] = destination
            read_order.append(first_read.setdefault(id(destination), position))
        grouped = sorted(range(len(plan.items)), key=read_order.__getitem__)
        return dataclasses.replace(plan, items=[plan.items[position] for position in grouped])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Pieces):
            return value.piece_at(index.offset)
        return super().lookup_tensor(index)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        destination = self._destination_of(read_item)
        if destination is None:
            return
        self._unread[id(destination)] -= 1
        if self._unread[id(destination)] == 0 and destination.filled():
            self.put_in_place += 1

    def _destination_of(self, item: ReadItem) -> ShardDestination | None:
        """The shards ``item`` writes into, if its key is a :class:`Pieces`."""
        value = self.state_dict.get(item.dest_index.fqn)
        return value.source_at(item.dest_index.offset) if isinstance(value, Pieces) else None


def _pieces_in(state: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Pieces]]:
    """Every :class:`Pieces` in the nested dict ``state``, with its path of keys."""
    for key, value in state.items():
        if isinstance(value, Pieces):
            yield (*path, key), value
        elif isinstance(value, dict):
            yield from _pieces_in(value, (*path, key))


def _put(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


class StreamingFileWriter(FileSystemWriter):
    """DCP's file writer, writing this process's chunks in the plan's order into one
    file and letting each go once it is written. torch 2.9's own writer keeps every
    tensor it wrote to a file until the file is closed (for its safetensors format),
    so a file would hold the host's whole share; here what a save holds is what its
    sources hold (:class:`xpipe.checkpoints.shards.HostShards`: one tensor's shards at a time). The
    records are DCP's own (``_write_item``), so DCP's reader reads them."""

    def __init__(self, path: str) -> None:
        super().__init__(path, thread_count=1)
        self.files: list[str] = []  # the data files this process wrote

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        self.files.append(name)
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                results.append(_write_item(self.transforms, stream, _record(planner.resolve_data(item), item),
                                           item, name, self.serialization_format))
            if self.sync_files:
                os.fsync(stream.fileno())
        written: Future[list[WriteResult]] = Future()
        written.set_result(results)
        return written


def _record(data: torch.Tensor | io.BytesIO, item: WriteItem) -> torch.Tensor | io.BytesIO:
    """What DCP's record of ``item`` holds: a CPU tensor with storage of its own size
    (``torch.save`` of a view writes its whole storage), or the bytes as given."""
    if item.type == WriteItemType.BYTE_IO:
        return data
    tensor = data.detach().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size() else tensor.clone()


def from_shards(shape: torch.Size, dtype: torch.dtype, shards: ShardSource) -> Pieces:
    """A tensor as the shards of it this host holds, each one piece."""
    return Pieces(shape, dtype, [Piece(tuple(part.start for part in index), tuple(part.stop - part.start
                                                                                  for part in index), shards, shard)
                                 for shard, index in enumerate(shards.places)])


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
