"""The shards of a tensor as a checkpoint reads and writes them on this host.

A save reads each tensor as the shards this host's devices hold
(:class:`HostShards`, one replica of each, fetched when DCP first reads them and
dropped once read); a load fills host buffers for those shards
(:class:`ShardBuffers`) and hands each device its own. Both describe a shard by its
place in the whole tensor, so one geometry (:mod:`xpipe.checkpoints.pieces`) serves
saves and loads, and neither puts a tensor together whole on the host.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from xpipe._host_memory import give_back_freed_memory
from xpipe._xla import (kept_shardings, load_local_shards, local_shard_places, local_shards, mark_sharding,
                        op_sharding, restore_shardings, sharding_spec, sync, synced_sharded, tensor_from_shards)


WHOLE_FETCH_BYTES = 2**20  # a tensor this small reaches the host whole, not one slot at a time
TRIM_AFTER_BYTES = 2**20  # a load hands freed memory back to the system after buffers this large
LOAD_PIECE_BYTES = 4 * 2**20  # a load writes a larger sharded tensor into its devices a piece at a time



class HostShards:
    """The shards of one tensor that this host holds, one replica of each, as their
    places in the whole (slices, padding cut off); an unsharded tensor is one shard,
    the whole of it. Their values reach the host when first read and are dropped
    once every read announced with :meth:`expect_read` is done, so a save that
    reads tensor after tensor holds one tensor's shards at a time, not the model's.
    Nothing is put together: a checkpoint writes the shards as they are
    (:mod:`xpipe.checkpoints.pieces`)."""

    def __init__(self, tensor: torch.Tensor, places: list[tuple[slice, ...]], sharded: bool,
                 narrowed: tuple[int, int] | None = None) -> None:
        self.places = places
        self._tensor, self._sharded, self._narrowed = tensor, sharded, narrowed
        self._values: list[torch.Tensor] | None = None
        self._reads = 0

    def narrowed(self, dim: int, index: int) -> HostShards:
        """The shards that hold ``index`` along ``dim`` (a dim no shard splits), as
        places in the whole tensor: fetched through a slice on the devices, so that
        only that part reaches the host (a stacked weight, one block slot at a time).
        A tensor of at most ``WHOLE_FETCH_BYTES``, or one not sharded, is these shards
        itself, fetched once for every index: a program run per slot costs more than
        holding a small tensor (a stacked LayerNorm weight or bias)."""
        if not self._sharded or self._tensor.numel() * self._tensor.element_size() <= WHOLE_FETCH_BYTES:
            return self
        places = [tuple(slice(index, index + 1) if axis == dim else part for axis, part in enumerate(place))
                  for place in self.places]
        return HostShards(self._tensor, places, True, (dim, index))

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    def expect_read(self) -> None:
        """Announce one more :meth:`read` before the values may be dropped."""
        self._reads += 1

    def fetch(self) -> None:
        """Bring the values to the host now (a background save copies before it returns)."""
        if self._values is None and not self._sharded:
            self._values = [self._tensor.to("cpu", copy=True)]
        elif self._values is None and self._narrowed is None:
            self._values = _fetched(self._tensor, self.places)
        elif self._values is None:
            self._values = _fetched_part(self._tensor, self.places, *self._narrowed)

    def read(self, shard: int) -> torch.Tensor:
        """Shard ``shard``'s values, on the CPU."""
        self.fetch()
        value = self._values[shard]
        self._reads -= 1
        if self._reads <= 0:
            self._values = None
        return value



class ShardBuffers:
    """Host buffers for the shards of one tensor that this host's devices hold, one per
    place (replicas share it), zero until written: a checkpoint load fills them where
    the saved chunks overlap them, then hands every device its own, in place
    (:meth:`load_into`) or as a new tensor (:meth:`to_device`): as soon as they are
    filled, where an action is given (:meth:`when_filled`), so that a load holds
    the buffers of the tensors it is reading, not the model's. Nothing is put
    together whole on the host. ``places`` and :meth:`read` are those of
    :class:`HostShards`, so one geometry (:mod:`xpipe.checkpoints.pieces`) serves saves and loads."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype, places: list[tuple[slice, ...]],
                 of_device: list[int], shard_shape: tuple[int, ...], sharded: bool) -> None:
        self.places, self.dtype = places, dtype
        self._like, self._of_device, self._shard_shape, self._sharded = like, of_device, shard_shape, sharded
        self._buffers: dict[int, torch.Tensor] = {}
        self._when_filled: Callable[[ShardBuffers], bool] | None = None

    def when_filled(self, action: Callable[[ShardBuffers], bool]) -> None:
        """Run ``action(self)`` (hand the buffers to the devices; it returns whether it
        wrote into a tensor the model or optimizer holds) once a load has written every
        saved piece that overlaps them, then let the buffers go."""
        self._when_filled = action

    def filled(self) -> bool:
        """Every saved piece that overlaps the buffers is written (see
        :class:`xpipe.checkpoints.pieces.PieceLoadPlanner`): run the action given to
        :meth:`when_filled`, if any, free the buffers, and return what the action did."""
        action, self._when_filled = self._when_filled, None
        if action is None:
            return False
        large = sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values()) >= TRIM_AFTER_BYTES
        changed = action(self)
        self._buffers = {}
        if large:
            give_back_freed_memory()  # else the next tensor's buffers grow the process (xpipe._host_memory)
        return changed

    def expect_read(self) -> None:
        """Nothing to count: buffers are kept until the load hands them over."""

    def read(self, shard: int) -> torch.Tensor:
        """Place ``shard``'s buffer (a writable view, padding cut off)."""
        if shard not in self._buffers:
            self._buffers[shard] = torch.zeros(self._shard_shape, dtype=self.dtype)
        return self._buffers[shard][tuple(slice(0, part.stop - part.start) for part in self.places[shard])]

    def _device_data(self) -> list[torch.Tensor]:
        for shard in range(len(self.places)):
            self.read(shard)
        return [self._buffers[shard] for shard in self._of_device]

    def load_into(self, tensor: torch.Tensor) -> None:
        """Write the buffers into ``tensor`` (the tensor they were made for) on its devices,
        in place: a sharded tensor of more than ``LOAD_PIECE_BYTES`` a piece at a time
        (:func:`_load_by_pieces`), so that the devices hold one piece beside it, not a
        second copy of it."""
        if self._sharded:
            cut = _piece_cut(tensor)
            if cut is None:
                load_local_shards(tensor, self._device_data())
            else:
                _load_by_pieces(tensor, self._device_data(), *cut)
            return
        kept = kept_shardings([tensor])  # a replicated tensor: torch_xla takes it whole
        with torch.no_grad():
            tensor.copy_(self._device_data()[0])
        restore_shardings(kept)
        if not kept:
            sync([tensor])

    def to_device(self) -> torch.Tensor:
        """The buffers as a new tensor on the devices, sharded as the tensor they were made for."""
        if not self._sharded:
            return self._device_data()[0].to(self._like.device)
        return tensor_from_shards(self._device_data(), op_sharding(self._like), list(self._like.shape))


def _piece_cut(tensor: torch.Tensor) -> tuple[int, int] | None:
    """How a load writes the sharded ``tensor`` a piece at a time: along which dim (the
    first that no shard splits: a stacked weight's slots), and how many of its indices
    per piece (the fewest equal pieces of at most ``LOAD_PIECE_BYTES``, else one index
    each). None to write it whole: a tensor of at most ``LOAD_PIECE_BYTES``; one whose
    shards are uneven (a copy into it comes back whole on every device: measured, the
    tensor left replicated); or one whose every dim of more than one index is split."""
    size = tensor.numel() * tensor.element_size()
    counts = _tile_counts(tensor)
    if size <= LOAD_PIECE_BYTES or counts is None or not _evenly_tiled(tensor):
        return None
    dim = next((dim for dim, (count, length) in enumerate(zip(counts, tensor.shape)) if count == 1 and length > 1),
               None)
    if dim is None:
        return None
    length = tensor.shape[dim]
    pieces = next((pieces for pieces in range(2, length + 1)
                   if length % pieces == 0 and size <= pieces * LOAD_PIECE_BYTES), length)
    return dim, length // pieces


def _load_by_pieces(tensor: torch.Tensor, shards: list[torch.Tensor], dim: int, length: int) -> None:
    """Write ``shards`` (CPU data, one per local device in device order) into ``tensor``
    ``length`` indices of ``dim`` at a time: each piece made a tensor on the devices,
    sharded as ``tensor``, and copied into it in place, which XLA does in the tensor's
    own buffers. On the emulation the devices' memory is the host's: a load of the
    32-block AdamW state of ``tools/bench_checkpoint.py`` grew the process 0.24x its
    tensors this way, 0.56x with each tensor's new data made whole beside the old.
    One program per piece shape: where a piece goes is an input, not a constant."""
    sharding = op_sharding(tensor)
    shape = list(tensor.shape)
    shape[dim] = length
    for start in range(0, tensor.shape[dim], length):
        piece = tensor_from_shards([shard.narrow(dim, start, length).contiguous() for shard in shards], sharding, shape)
        indices = torch.arange(start, start + length).to(tensor.device)
        with torch.no_grad():
            tensor.index_copy_(dim, indices, piece)
        mark_sharding(tensor, sharding)  # as it was: the step's program takes it so, whatever XLA propagates
        sync([tensor])


def shard_buffers(tensors: list[torch.Tensor], dtypes: list[torch.dtype] | None = None) -> list[ShardBuffers]:
    """For each tensor, buffers for its shards on this host (:class:`ShardBuffers`), of
    ``dtypes`` (default: each tensor's own); nothing is fetched from the devices."""
    tensors = [tensor.detach() for tensor in tensors]
    dtypes = [tensor.dtype for tensor in tensors] if dtypes is None else dtypes
    sharded = synced_sharded(tensors)
    placed = dict(zip(map(id, sharded), local_shard_places(sharded)
                      if sharded else []))
    buffers = []
    for tensor, dtype in zip(tensors, dtypes):
        whole = tuple(slice(0, size) for size in tensor.shape)
        shard_shape = _shard_shape(tensor) if id(tensor) in placed else None
        if shard_shape is None:  # whole on every device
            buffers.append(ShardBuffers(tensor, dtype, [whole], [0], tuple(tensor.shape), False))
            continue
        boxes = [_cut_to(indices, tensor.shape) for _, indices in placed[id(tensor)]]
        numbered: dict[tuple, int] = {}  # each box once, in device order: replicas share a buffer
        of_device = [numbered.setdefault(tuple((part.start, part.stop) for part in box), len(numbered))
                     for box in boxes]
        places = [tuple(slice(*bounds) for bounds in key) for key in numbered]
        buffers.append(ShardBuffers(tensor, dtype, places, of_device, shard_shape, True))
    return buffers



def _tile_counts(tensor: torch.Tensor) -> list[int] | None:
    """Into how many tiles ``tensor``'s sharding splits each of its dims (HLO's
    ``devices=[...]``); None if it is not tiled (replicated: whole on every device)."""
    tiles = re.search(r"devices=\[([\d,]+)\]", sharding_spec(tensor))
    return None if tiles is None else [int(count) for count in tiles.group(1).split(",")][:tensor.dim()]



def _shard_shape(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The shape of each of ``tensor``'s shards on the devices, padding included; None
    if it is not tiled."""
    counts = _tile_counts(tensor)
    return None if counts is None else tuple(-(-size // count) for size, count in zip(tensor.shape, counts))



def _evenly_tiled(tensor: torch.Tensor) -> bool:
    """No shard of ``tensor`` holds padding."""
    counts = _tile_counts(tensor) or []
    return all(size % count == 0 for size, count in zip(tensor.shape, counts))



def host_shards(tensors: list[torch.Tensor]) -> list[HostShards]:
    """Each tensor as the shards this host holds of it (:class:`HostShards`), synced
    together first so that their values are the current ones; none is fetched yet."""
    tensors = [tensor.detach() for tensor in tensors]
    sharded = synced_sharded(tensors)
    places = dict(zip(map(id, sharded), _local_places(sharded)))
    return [HostShards(tensor, places[id(tensor)], True) if id(tensor) in places
            else HostShards(tensor, [tuple(slice(0, size) for size in tensor.shape)], False) for tensor in tensors]



def _local_places(tensors: list[torch.Tensor]) -> list[list[tuple[slice, ...]]]:
    """Where each tensor's shards on this host (replica 0) lie in it, padding cut off."""
    if not tensors:
        return []
    return [[_cut_to(indices, tensor.shape) for replica, indices in places if replica == 0]
            for tensor, places in zip(tensors, local_shard_places(tensors))]



def _cut_to(indices: Any, shape: torch.Size) -> tuple[slice, ...]:
    """A shard's indices (Ellipsis for the whole) as slices within ``shape``."""
    if indices is Ellipsis:
        return tuple(slice(0, size) for size in shape)
    return tuple(slice(part.start, min(part.stop, size)) for part, size in zip(indices, shape))



def _fetched(tensor: torch.Tensor, places: list[tuple[slice, ...]]) -> list[torch.Tensor]:
    """The values of ``tensor``'s shards at ``places``, on the CPU (the other replicas'
    copies, which torch_xla hands over with them, dropped at once)."""
    shards = local_shards([tensor])[0]
    if len(shards) != len(places):
        raise RuntimeError(f"a tensor came to the host as {len(shards)} shards, not the {len(places)} its sharding "
                           "gave; its sharding changed during the save")
    return [data[tuple(slice(0, part.stop - part.start) for part in index)]
            for (data, _), index in zip(shards, places)]



def _fetched_part(tensor: torch.Tensor, places: list[tuple[slice, ...]], dim: int, index: int) -> list[torch.Tensor]:
    """The values at ``places`` (shards of index ``index`` of ``tensor``'s ``dim``, a dim
    no shard splits), on the CPU: sliced on the devices, so that only that part
    reaches the host; or, where the tensor's shards are uneven (XLA then gives the
    slice back whole on every device), sliced out of the tensor's own shards here."""
    if _evenly_tiled(tensor):
        return _fetched(_narrowed_on_devices(tensor, dim, index), places)
    shards = local_shards([tensor])[0]
    return [data.narrow(dim, index, 1)[tuple(slice(0, part.stop - part.start) for part in place)].clone()
            for (data, _), place in zip(shards, places)]



def _narrowed_on_devices(tensor: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """Index ``index`` of ``tensor``'s ``dim`` as a tensor on the devices, sharded as
    ``tensor`` is: one small program per shape (the index is an input, not a constant)."""
    part = torch.index_select(tensor, dim, torch.tensor([index], device=tensor.device))
    mark_sharding(part, op_sharding(tensor))
    sync([part])
    return part



def shard_like(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Shard each ``tensor`` of ``(tensor, like)`` as ``like`` (an optimizer's state,
    loaded onto the device, as its parameter) where ``like`` is sharded, they have
    one shape and ``tensor`` is not sharded so already; all materialized together."""
    spec = sharding_spec
    restore_shardings([(tensor, sharding) for tensor, like in pairs
                       if tensor.device.type == "xla" and tensor.shape == like.shape and spec(tensor) != spec(like)
                       for _, sharding in kept_shardings([like])])
