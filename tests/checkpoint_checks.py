"""What a checkpoint written shard by shard must hold: every chunk of every tensor
exactly once, no empty file, no sharded tensor put together on the host, and the
shards on the host one tensor's at a time, not the model's; and a load that fills
each device's shard from a buffer of that shard, not from the whole tensor."""

import contextlib
import itertools
import math
import weakref
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import xpipe._xla
import xpipe.checkpoints
import xpipe.checkpoints.pieces
import xpipe.checkpoints.shards
import xpipe.checkpoints.state


def assert_chunks_tile_every_tensor(path: Path) -> dict[str, int]:
    """Each tensor's chunks in the DCP metadata lie inside it, overlap nowhere and
    cover it (their volumes sum to its size); every file holds bytes. Returns the
    number of chunks per tensor."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    counts = {}
    for key, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        boxes = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in stored.chunks]
        for offsets, sizes in boxes:
            assert all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, stored.size)), (key, offsets, sizes)
        for (a, a_sizes), (b, b_sizes) in itertools.combinations(boxes, 2):
            overlap = all(x < y + y_size and y < x + x_size for x, x_size, y, y_size in zip(a, a_sizes, b, b_sizes))
            assert not overlap, f"{key}: chunks at {a} and {b} overlap"
        assert sum(math.prod(sizes) for _, sizes in boxes) == math.prod(stored.size), f"{key}: chunks leave a gap"
        counts[key] = len(boxes)
    for file in Path(path).glob("*.distcp"):
        assert file.stat().st_size > 0, f"{file} is empty"
    return counts


def _is_sharded(tensor: torch.Tensor) -> bool:
    import torch_xla

    return tensor.device.type == "xla" and "devices=" in torch_xla._XLAC._get_xla_sharding_spec(tensor)


@contextlib.contextmanager
def no_sharded_tensor_put_together():
    """Fail if a save puts a sharded tensor together on the host: through ``to_host``,
    ``.cpu()`` or the assembling of shards."""
    original_to_host, original_cpu = xpipe.checkpoints.state.to_host, torch.Tensor.cpu

    def to_host(tensors):
        assert not any(_is_sharded(t) for t in tensors), "a sharded tensor reached the host whole (to_host)"
        return original_to_host(tensors)

    def cpu(tensor, *args, **kwargs):
        assert not _is_sharded(tensor), "a sharded tensor reached the host whole (.cpu())"
        return original_cpu(tensor, *args, **kwargs)

    def assembled(*_):
        raise AssertionError("a sharded tensor was put together from its shards")

    xpipe.checkpoints.state.to_host, torch.Tensor.cpu = to_host, cpu
    original_assembled, xpipe._xla._assembled = xpipe._xla._assembled, assembled
    try:
        yield
    finally:
        xpipe.checkpoints.state.to_host, torch.Tensor.cpu = original_to_host, original_cpu
        xpipe._xla._assembled = original_assembled


class HeldShards:
    """The bytes of fetched shards on the host while a save runs: the most held at
    once, and the most any one tensor's shards take; and of the records written
    before, the most bytes still alive when the next is written (a writer that kept
    what it wrote would hold the host's whole share)."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.peak = self.largest = 0
        self.written: list[tuple[weakref.ref, int]] = []
        self.written_alive = 0

    def record_written(self, tensor: torch.Tensor) -> None:
        alive = sum(size for ref, size in self.written if ref() is not None)
        self.written_alive = max(self.written_alive, alive)
        self.written.append((weakref.ref(tensor), tensor.numel() * tensor.element_size()))


@contextlib.contextmanager
def held_shards():
    """Record :class:`HeldShards` while the block saves."""
    record = HeldShards()
    original_fetch, original_read = xpipe.checkpoints.shards.HostShards.fetch, xpipe.checkpoints.shards.HostShards.read

    def fetch(self):
        original_fetch(self)
        size = sum(value.numel() * value.element_size() for value in self._values)
        record.held[id(self)] = size
        record.largest = max(record.largest, size)
        record.peak = max(record.peak, sum(record.held.values()))

    def read(self, shard):
        value = original_read(self, shard)
        if self._values is None:
            record.held.pop(id(self), None)
        return value

    def write_item(transforms, stream, data, *args):
        if isinstance(data, torch.Tensor):
            record.record_written(data)
        return original_write_item(transforms, stream, data, *args)

    original_write_item = xpipe.checkpoints.pieces._write_item
    xpipe.checkpoints.shards.HostShards.fetch, xpipe.checkpoints.shards.HostShards.read = fetch, read
    xpipe.checkpoints.pieces._write_item = write_item
    try:
        yield record
    finally:
        xpipe.checkpoints.shards.HostShards.fetch, xpipe.checkpoints.shards.HostShards.read = original_fetch, original_read
        xpipe.checkpoints.pieces._write_item = original_write_item


@contextlib.contextmanager
def load_buffers_alive():
    """Record, in the returned list's one element, the most bytes of load buffers
    (:class:`xpipe.checkpoints.shards.ShardBuffers`) alive at once while the block loads."""
    peak, alive = [0], {}
    buffers = xpipe.checkpoints.shards.ShardBuffers
    original_read, original_filled = buffers.read, buffers.filled

    def read(self, shard):
        value = original_read(self, shard)
        alive[id(self)] = sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())
        peak[0] = max(peak[0], sum(alive.values()))
        return value

    def filled(self):
        original_filled(self)
        if not self._buffers:
            alive.pop(id(self), None)

    buffers.read, buffers.filled = read, filled
    try:
        yield peak
    finally:
        buffers.read, buffers.filled = original_read, original_filled


@contextlib.contextmanager
def loaded_from_shards():
    """Fail if a load hands a Pipe whole tensors (``Pipe.load_state_dict``, which sends
    each to every device); yield the loads from shard buffers, as (the tensor's shape,
    whether it is tiled, the shapes of its places), in order."""
    loads = []
    original_load_into, original_to_device = xpipe.checkpoints.shards.ShardBuffers.load_into, xpipe.checkpoints.shards.ShardBuffers.to_device
    original_load_state_dict = xpipe.Pipe.load_state_dict

    def record(buffers, shape):
        places = [tuple(part.stop - part.start for part in place) for place in buffers.places]
        loads.append((tuple(shape), buffers._sharded, places))

    def load_into(self, tensor):
        record(self, tensor.shape)
        original_load_into(self, tensor)

    def to_device(self):
        tensor = original_to_device(self)
        record(self, tensor.shape)
        return tensor

    def load_state_dict(*_, **__):
        raise AssertionError("a load sent whole tensors to a Pipe's devices (Pipe.load_state_dict)")

    xpipe.checkpoints.shards.ShardBuffers.load_into, xpipe.checkpoints.shards.ShardBuffers.to_device = load_into, to_device
    xpipe.Pipe.load_state_dict = load_state_dict
    try:
        yield loads
    finally:
        xpipe.checkpoints.shards.ShardBuffers.load_into, xpipe.checkpoints.shards.ShardBuffers.to_device = original_load_into, original_to_device
        xpipe.Pipe.load_state_dict = original_load_state_dict


def assert_each_device_loaded_its_shard(loads) -> None:
    """Every tiled tensor of ``loads`` (:func:`loaded_from_shards`) came from buffers of
    its shards' places, which tile it once: none was put together whole on the host."""
    tiled = [(shape, places) for shape, is_tiled, places in loads if is_tiled]
    assert tiled, "no tensor was loaded from its shards"
    for shape, places in tiled:
        assert len(places) > 1 and all(math.prod(place) < math.prod(shape) for place in places), (shape, places)
        assert sum(math.prod(place) for place in places) == math.prod(shape), (shape, places)
