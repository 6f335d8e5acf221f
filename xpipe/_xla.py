"""Small XLA facts every executor relies on: autograd's device queues, SPMD mode, moving weights."""

from __future__ import annotations

import importlib.util
import re
import weakref
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from xpipe._retired import retire_parameters

_BROKEN_QUEUES = "device_ready_queues_"
_checked: set[str] = set()  # devices that have run a backward


def start_runtime_before_first_backward() -> None:
    """Have torch_xla's runtime running before the process's first ``backward()``.

    Autograd sizes its per-device queues once, at the first backward of the
    process, from the devices registered then; torch_xla reports none until its
    runtime has started. A CPU backward that comes first (a reference model, as
    users compute all the time) therefore breaks every later XLA backward. The
    runtime is started lazily, by the first backward, so that XLA flags set after
    ``import xpipe`` (``xpipe.inspect.enable_hlo_dump``) still count.
    """
    if importlib.util.find_spec("torch_xla") is None:
        return
    original = torch.autograd._engine_run_backward

    def first_backward(*args, **kwargs):
        torch.autograd._engine_run_backward = original
        import torch_xla.runtime as xr

        xr.global_runtime_device_count()  # starts the runtime; chooses no device and no mode
        return original(*args, **kwargs)

    torch.autograd._engine_run_backward = first_backward


def warm_autograd(device: torch.device) -> None:
    """Check that autograd can run a backward on ``device``, with one tiny backward.

    Raises:
        RuntimeError: if a backward ran before torch_xla's runtime started (in a
            process where xpipe was imported too late to prevent it); the
            process cannot run XLA backward passes any more.
    """
    if str(device) in _checked:
        return
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        (probe * 2).sum().backward()  # a bare probe.sum() does not reach the device's queue
        _checked.add(str(device))
    except RuntimeError as error:
        if _BROKEN_QUEUES not in str(error):
            raise
        raise RuntimeError(
            "module: this process ran a backward() before torch_xla's runtime started, and autograd "
            "now cannot run any XLA backward (it sized its device queues without the XLA devices). "
            "Import xpipe before the first backward() of the process (xpipe starts the runtime in time), "
            "or call torch_xla.runtime.global_runtime_device_count() first"
        ) from error


def can_enter_spmd() -> bool:
    """Whether the process is in SPMD mode or can still switch to it (no XLA device used yet)."""
    import torch_xla
    import torch_xla.runtime as xr

    return xr.is_spmd() or not torch_xla._XLAC._xla_get_spmd_config_is_locked()


def check_can_enter_spmd() -> None:
    """Raise unless the process can still switch to SPMD mode.

    torch_xla only warns when an XLA device was used before ``use_spmd()``, and the
    process then crashes later (a segfault at the first transfer to the host).
    """
    if not can_enter_spmd():
        raise RuntimeError(
            "executor: the spmd executor needs SPMD mode, which must start before any XLA device is "
            "used, and this process already used one (torch_xla.device() or an XLA tensor). Build the "
            "spmd Pipe (or call xpipe.make_mesh) before touching XLA devices, or use executor='devices'"
        )


def move_keeping_ties(modules: list[nn.Module], device: torch.device, *,
                      keep: Collection[int] = ()) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Move parameters and buffers to ``device``, keeping every Parameter object.

    Each Parameter's contents are swapped in place (``torch.utils.swap_tensors``),
    so an optimizer built on the model's parameters before wrapping, and the
    model itself, see the moved weights; and a Parameter held in several places
    (an LM's tied embedding and head) stays one. ``module.to(xla)`` would instead
    make a new Parameter for every place one is held.

    torch.export keeps a weak reference to each parameter it traced, and a
    Parameter with a weak reference cannot be swapped: such a one is replaced by
    a new Parameter everywhere the modules hold it, and the old one is retired
    (an optimizer that still holds it refuses to step).

    Tensors whose ``id`` is in ``keep`` stay where they are (a weight tied across
    stages stays with the first stage that placed it; the devices executor copies
    it to the others each step).

    Returns:
        What was replaced rather than moved in place, ``id(old) -> (old, new)``
        (buffers always are): :func:`rebind` puts the new ones into other modules
        that held the old ones.
    """
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new); old kept alive,
    for module in modules:                                     # so that no new tensor reuses its id
        for owner in module.modules():
            for slots, move in ((owner._parameters, _moved_in_place), (owner._buffers, _copied_to)):
                for name, tensor in slots.items():
                    if tensor is None or tensor.device == device or id(tensor) in keep:
                        continue
                    if id(tensor) not in moved:
                        moved[id(tensor)] = (tensor, move(tensor, device))
                    slots[name] = moved[id(tensor)][1]
    return {key: pair for key, pair in moved.items() if pair[0] is not pair[1]}


def rebind(module: nn.Module, replaced: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hold the new tensor wherever ``module`` held one that was replaced (ties stay ties)."""
    for owner in module.modules():
        for slots in (owner._parameters, owner._buffers):
            for name, tensor in slots.items():
                if tensor is not None and id(tensor) in replaced and replaced[id(tensor)][0] is tensor:
                    slots[name] = replaced[id(tensor)][1]


def _copied_to(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    return buffer.to(device)


def _moved_in_place(parameter: nn.Parameter, device: torch.device) -> nn.Parameter:
    """``parameter`` on ``device``: the same object if it can be swapped, else a new one."""
    if parameter.device == device:
        return parameter
    on_device = nn.Parameter(parameter.detach().to(device), requires_grad=parameter.requires_grad)
    if weakref.getweakrefcount(parameter):
        retire_parameters([parameter])
        return on_device
    torch.utils.swap_tensors(parameter, on_device)
    return parameter


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of ``tensors``, for state dicts, fetched together (checkpoints write
    the shards as they are: :func:`host_shards`).

    A tensor sharded under SPMD is put together from its shards on this host:
    torch_xla's ``.cpu()`` compiles a small gathering program for every call (about
    4 ms each on the CPU emulation, uncached), which made a checkpoint of a few
    dozen tensors five times slower than ``torch.save``. All the tensors are synced
    once and their shards fetched in one call. Where this host does not hold every
    shard of a tensor (a multi-host pod), ``.cpu()`` gathers it.
    """
    tensors = [tensor.detach() for tensor in tensors]
    sharded = _synced_sharded(tensors)
    shards = dict(zip(map(id, sharded), _local_shards(sharded)))
    return [_assembled(tensor, shards[id(tensor)]) if id(tensor) in shards else tensor.to("cpu", copy=True)
            for tensor in tensors]


WHOLE_FETCH_BYTES = 2**20  # a tensor this small reaches the host whole, not one slot at a time


class HostShards:
    """The shards of one tensor that this host holds, one replica of each, as their
    places in the whole (slices, padding cut off); an unsharded tensor is one shard,
    the whole of it. Their values reach the host when first read and are dropped
    once every read announced with :meth:`expect_read` is done, so a save that
    reads tensor after tensor holds one tensor's shards at a time, not the model's.
    Nothing is put together: a checkpoint writes the shards as they are
    (:mod:`xpipe.chunks`)."""

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
    (:meth:`load_into`) or as a new tensor (:meth:`to_device`). Nothing is put
    together whole on the host. ``places`` and :meth:`read` are those of
    :class:`HostShards`, so one geometry (:mod:`xpipe.chunks`) serves saves and loads."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype, places: list[tuple[slice, ...]],
                 of_device: list[int], shard_shape: tuple[int, ...], sharded: bool) -> None:
        self.places, self.dtype = places, dtype
        self._like, self._of_device, self._shard_shape, self._sharded = like, of_device, shard_shape, sharded
        self._buffers: dict[int, torch.Tensor] = {}

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
        """Write the buffers into ``tensor`` (the tensor they were made for) on its devices, in place."""
        import torch_xla

        if self._sharded:
            torch_xla._XLAC._load_local_shards(tensor, self._device_data(), torch_xla._XLAC._xla_get_runtime_devices())
            return
        kept = kept_shardings([tensor])  # a replicated tensor: torch_xla takes it whole
        with torch.no_grad():
            tensor.copy_(self._device_data()[0])
        restore_shardings(kept)
        if not kept:
            torch_xla._XLAC._xla_sync_multi([tensor], devices=[], wait=True)

    def to_device(self) -> torch.Tensor:
        """The buffers as a new tensor on the devices, sharded as the tensor they were made for."""
        import torch_xla

        if not self._sharded:
            return self._device_data()[0].to(self._like.device)
        return torch_xla._XLAC._global_tensor_from_cpu_shards(
            self._device_data(), torch_xla._XLAC._get_xla_op_sharding(self._like), list(self._like.shape))


def shard_buffers(tensors: list[torch.Tensor], dtypes: list[torch.dtype] | None = None) -> list[ShardBuffers]:
    """For each tensor, buffers for its shards on this host (:class:`ShardBuffers`), of
    ``dtypes`` (default: each tensor's own); nothing is fetched from the devices."""
    import torch_xla

    tensors = [tensor.detach() for tensor in tensors]
    dtypes = [tensor.dtype for tensor in tensors] if dtypes is None else dtypes
    sharded = _synced_sharded(tensors)
    placed = dict(zip(map(id, sharded), torch_xla._XLAC._get_local_shard_replica_and_indices(sharded)
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
    import torch_xla

    tiles = re.search(r"devices=\[([\d,]+)\]", torch_xla._XLAC._get_xla_sharding_spec(tensor))
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
    sharded = _synced_sharded(tensors)
    places = dict(zip(map(id, sharded), _local_places(sharded)))
    return [HostShards(tensor, places[id(tensor)], True) if id(tensor) in places
            else HostShards(tensor, [tuple(slice(0, size) for size in tensor.shape)], False) for tensor in tensors]


def _local_places(tensors: list[torch.Tensor]) -> list[list[tuple[slice, ...]]]:
    """Where each tensor's shards on this host (replica 0) lie in it, padding cut off."""
    import torch_xla

    if not tensors:
        return []
    return [[_cut_to(indices, tensor.shape) for replica, indices in places if replica == 0]
            for tensor, places in zip(tensors, torch_xla._XLAC._get_local_shard_replica_and_indices(tensors))]


def _cut_to(indices: Any, shape: torch.Size) -> tuple[slice, ...]:
    """A shard's indices (Ellipsis for the whole) as slices within ``shape``."""
    if indices is Ellipsis:
        return tuple(slice(0, size) for size in shape)
    return tuple(slice(part.start, min(part.stop, size)) for part, size in zip(indices, shape))


def _fetched(tensor: torch.Tensor, places: list[tuple[slice, ...]]) -> list[torch.Tensor]:
    """The values of ``tensor``'s shards at ``places``, on the CPU (the other replicas'
    copies, which torch_xla hands over with them, dropped at once)."""
    shards = _local_shards([tensor])[0]
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
    shards = _local_shards([tensor])[0]
    return [data.narrow(dim, index, 1)[tuple(slice(0, part.stop - part.start) for part in place)].clone()
            for (data, _), place in zip(shards, places)]


def _narrowed_on_devices(tensor: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """Index ``index`` of ``tensor``'s ``dim`` as a tensor on the devices, sharded as
    ``tensor`` is: one small program per shape (the index is an input, not a constant)."""
    import torch_xla

    part = torch.index_select(tensor, dim, torch.tensor([index], device=tensor.device))
    torch_xla._XLAC._xla_mark_sharding(part, torch_xla._XLAC._get_xla_op_sharding(tensor))
    torch_xla._XLAC._xla_sync_multi([part], devices=[], wait=True)
    return part


def _synced_sharded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The SPMD-sharded ones of ``tensors``, synced together so that their shards hold
    the current values."""
    import torch_xla

    sharded = [tensor for tensor in tensors if _is_sharded(tensor)]
    if sharded:
        torch_xla._XLAC._xla_sync_multi(sharded, devices=[], wait=True)
    return sharded


def _is_sharded(tensor: torch.Tensor) -> bool:
    import torch_xla.distributed.spmd as xs

    return tensor.device.type == "xla" and isinstance(xs.wrap_if_sharded(tensor), xs.XLAShardedTensor)


def _local_shards(tensors: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, Any]]]:
    """Each tensor's shards on this host as (data, index into the whole tensor);
    of shards that are copies of one another (replicas), the first only."""
    import torch_xla

    if not tensors:
        return []
    data = torch_xla._XLAC._get_local_shards(tensors)
    places = torch_xla._XLAC._get_local_shard_replica_and_indices(tensors)
    return [[(shard, indices) for (shard, _), (replica, indices) in zip(shard_data, shard_places) if replica == 0]
            for shard_data, shard_places in zip(data, places)]


def _assembled(tensor: torch.Tensor, shards: list[tuple[torch.Tensor, Any]]) -> torch.Tensor:
    """``tensor`` on the host from its shards (padding dropped), or gathered by
    ``.cpu()`` where the shards here do not cover it."""
    whole = torch.empty(tensor.shape, dtype=tensor.dtype)
    covered = torch.zeros(tensor.shape, dtype=torch.bool)
    for data, indices in shards:
        if indices is Ellipsis:
            return data.clone()
        index = tuple(indices)
        whole[index] = data[tuple(slice(0, part.stop - part.start) for part in indices)]
        covered[index] = True
    return whole if bool(covered.all()) else tensor.cpu()


def kept_shardings(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
    """Each sharded XLA tensor of ``tensors`` with its sharding, to put back with
    :func:`restore_shardings` after an in-place load (``copy_`` into a sharded
    tensor leaves it replicated: a whole copy on every device, and a new program)."""
    import torch_xla

    kept = []
    for tensor in tensors:
        if tensor.device.type == "xla":
            sharding = torch_xla._XLAC._get_xla_op_sharding(tensor)
            if sharding is not None:
                kept.append((tensor, sharding))
    return kept


def restore_shardings(kept: list[tuple[torch.Tensor, Any]]) -> None:
    """Shard each tensor as :func:`kept_shardings` found it, and materialize it: the
    next step then runs the program it ran before the load, not one with the load in it."""
    import torch_xla

    for tensor, sharding in kept:
        torch_xla._XLAC._xla_mark_sharding(tensor, sharding)
    if kept:
        torch_xla._XLAC._xla_sync_multi([tensor for tensor, _ in kept], devices=[], wait=True)


def shard_like(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Shard each ``tensor`` of ``(tensor, like)`` as ``like`` (an optimizer's state,
    loaded onto the device, as its parameter) where ``like`` is sharded, they have
    one shape and ``tensor`` is not sharded so already; all materialized together."""
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec
    restore_shardings([(tensor, sharding) for tensor, like in pairs
                       if tensor.device.type == "xla" and tensor.shape == like.shape and spec(tensor) != spec(like)
                       for _, sharding in kept_shardings([like])])


def shard_bytes(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of ``tensors`` (XLA tensors) that each device holds: under SPMD from its
    local shards; otherwise each tensor whole on its own device."""
    import torch_xla
    import torch_xla.runtime as xr

    held: dict[str, int] = {}
    if not xr.is_spmd():
        for tensor in tensors:
            held[str(tensor.device)] = held.get(str(tensor.device), 0) + tensor.numel() * tensor.element_size()
        return held
    if not tensors:
        return held
    torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=True)
    for shards in torch_xla._XLAC._get_local_shards(tensors):
        for data, device in shards:
            held[device] = held.get(device, 0) + data.numel() * data.element_size()
    return held
