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

import math
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType


class ShardSource(Protocol):
    """The shards of one tensor on this host, at ``places`` (slices of the whole):
    :class:`xpipe._xla.HostShards` to save from, :class:`xpipe._xla.ShardBuffers` to
    load into."""

    places: list[tuple[slice, ...]]
    dtype: torch.dtype

    def expect_read(self) -> None: ...

    def read(self, shard: int) -> torch.Tensor: ...


def _whole(values: torch.Tensor) -> torch.Tensor:
    return values


@dataclass
class Piece:
    """One chunk of a tensor: where it lies (``offsets``, ``sizes``) and how to read
    its values: ``cut`` applied to shard ``shard`` of ``source`` (a view, which a
    load writes through)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: ShardSource
    shard: int
    cut: Callable[[torch.Tensor], torch.Tensor] = _whole

    def read(self) -> torch.Tensor:
        return self.cut(self.source.read(self.shard))


class Chunks:
    """A tensor of ``shape`` and ``dtype`` as the pieces of it this host holds: to save,
    read from its shards only when DCP writes them (:class:`xpipe._xla.HostShards`);
    to load, written into its shards' buffers (:class:`xpipe._xla.ShardBuffers`)."""

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

    def sources(self) -> list[ShardSource]:
        """The shards the pieces are read from."""
        return list({id(piece.source): piece.source for piece in self._pieces.values()}.values())

    def fetch(self) -> None:
        """Bring every piece's values to the host now (a save's pieces, read from
        :class:`xpipe._xla.HostShards`)."""
        for source in self.sources():
            source.fetch()


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default planner, reading each chunk's data from its :class:`Chunks`."""

    def lookup_object(self, index: MetadataIndex) -> object:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunks):
            return value.piece_at(index.offset)
        return super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, writing each chunk's data into its :class:`Chunks`' piece."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up puts None in place of every value it does not know (torch 2.9's
        # _init_state_dict), so the Chunks are put back where the flattened keys point.
        chunks = dict(_chunks_in(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, value in chunks.items():
            _put(state_dict, path, value)
        for fqn, path in self.mappings.items():
            if tuple(path) in chunks:
                self.state_dict[fqn] = chunks[tuple(path)]

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunks):
            return value.piece_at(index.offset)
        return super().lookup_tensor(index)


def _chunks_in(state: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Chunks]]:
    """Every :class:`Chunks` in the nested dict ``state``, with its path of keys."""
    for key, value in state.items():
        if isinstance(value, Chunks):
            yield (*path, key), value
        elif isinstance(value, dict):
            yield from _chunks_in(value, (*path, key))


def _put(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


MIN_FILE_BYTES = 2**20  # no checkpoint file is cut smaller than this


class BoundedFileWriter(FileSystemWriter):
    """DCP's file writer, one thread, starting a new file whenever one holds
    ``file_bytes``: torch 2.9's writer keeps every tensor it has written to a file
    until the file is closed, so the file's size, not the checkpoint's, bounds what
    a save holds on the host."""

    def __init__(self, path: str, file_bytes: int) -> None:
        # Copying ahead would look for an accelerator's streams, and torch_xla's SPMD mode
        # registers a device module that has none. One thread: chunks are written in the
        # state's order (two threads sort them by size), tensor after tensor.
        super().__init__(path, per_thread_copy_ahead=0, thread_count=1)
        self.file_bytes = max(file_bytes, MIN_FILE_BYTES)

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        files: queue.Queue = queue.Queue()
        for number, items in enumerate(_files_of(plan.items, self.file_bytes)):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


def _files_of(items: list[WriteItem], file_bytes: int) -> Iterator[list[WriteItem]]:
    """``items`` in order, cut into files of about ``file_bytes`` each."""
    file: list[WriteItem] = []
    size = 0
    for item in items:
        file.append(item)
        if item.tensor_data is not None:
            size += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        if size >= file_bytes:
            yield file
            file, size = [], 0
    if file:
        yield file


def largest_tensor_bytes(state: dict[str, Any]) -> int:
    """The bytes of the largest tensor (or set of one tensor's shards) a save of
    ``state`` holds on this host: files of this size add at most as much again."""
    largest = 0
    for value in state.values():
        if isinstance(value, dict):
            largest = max(largest, largest_tensor_bytes(value))
        elif isinstance(value, Chunks):
            largest = max([largest, *(source.nbytes for source in value.sources())])
        elif isinstance(value, torch.Tensor):
            largest = max(largest, value.numel() * value.element_size())
    return largest


def from_shards(shape: torch.Size, dtype: torch.dtype, shards: ShardSource) -> Chunks:
    """A tensor as the shards of it this host holds, each one piece."""
    return Chunks(shape, dtype, [Piece(tuple(part.start for part in index), tuple(part.stop - part.start
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
