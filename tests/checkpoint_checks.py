"""What a checkpoint written shard by shard must hold: every chunk of every tensor
exactly once, no empty file, no sharded tensor put together on the host, and the
shards on the host one tensor's at a time, not the model's."""

import contextlib
import itertools
import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import xpipe.checkpoints
import xpipe._xla


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
    original_to_host, original_cpu = xpipe.checkpoints.to_host, torch.Tensor.cpu

    def to_host(tensors):
        assert not any(_is_sharded(t) for t in tensors), "a sharded tensor reached the host whole (to_host)"
        return original_to_host(tensors)

    def cpu(tensor, *args, **kwargs):
        assert not _is_sharded(tensor), "a sharded tensor reached the host whole (.cpu())"
        return original_cpu(tensor, *args, **kwargs)

    def assembled(*_):
        raise AssertionError("a sharded tensor was put together from its shards")

    xpipe.checkpoints.to_host, torch.Tensor.cpu = to_host, cpu
    original_assembled, xpipe._xla._assembled = xpipe._xla._assembled, assembled
    try:
        yield
    finally:
        xpipe.checkpoints.to_host, torch.Tensor.cpu = original_to_host, original_cpu
        xpipe._xla._assembled = original_assembled


class HeldShards:
    """The bytes of fetched shards on the host while a save runs: the most held at
    once, and the most any one tensor's shards take."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.peak = self.largest = 0


@contextlib.contextmanager
def held_shards():
    """Record :class:`HeldShards` while the block saves."""
    record = HeldShards()
    original_fetch, original_read = xpipe._xla.HostShards.fetch, xpipe._xla.HostShards.read

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

    xpipe._xla.HostShards.fetch, xpipe._xla.HostShards.read = fetch, read
    try:
        yield record
    finally:
        xpipe._xla.HostShards.fetch, xpipe._xla.HostShards.read = original_fetch, original_read
