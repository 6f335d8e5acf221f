"""Input on a multi-host pod: each host loads only the rows of the global batch that
its own devices hold, and the global batch is assembled from those shares.

Under SPMD one program spans every host's devices, and a batch is one global
tensor, sharded by the loader's ``input_sharding``. A host cannot hand torch_xla
the whole batch (it has not loaded the other hosts' rows), so it hands over the
shards of its own devices, cut from its share, and torch_xla joins every host's
shards into the global tensor (``_global_tensor_from_cpu_shards``, what torch_xla's
own per-host input sharding rests on).

Hosts own equal runs of consecutive device ids, as TPU pods number them. Which
rows a host loads follows from the mesh: with xpipe's mesh (stage outermost) a
host that holds whole stages holds every data index, so it loads the whole batch;
hosts split the rows only where they split the axis the batch is sharded over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xpipe._checks import check_positive_int
from xpipe._xla import tensor_from_shards


@dataclass(frozen=True)
class Hosts:
    """This process's place on a pod: host ``index`` of ``count``, owning the
    ``1 / count`` run of consecutive device ids that starts at ``index / count``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        check_positive_int(self.count, "count")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or not 0 <= self.index < self.count:
            raise ValueError(f"index: must be a host number in [0, {self.count}), got {self.index!r}")

    @classmethod
    def of_runtime(cls) -> Hosts:
        """This process's host, as torch_xla's runtime reports it."""
        return cls(xr.process_index(), xr.process_count())

    def devices(self, total: int) -> range:
        """The device ids this host owns, of ``total``."""
        if total % self.count:
            raise ValueError(f"hosts: {total} devices do not split evenly over {self.count} hosts")
        each = total // self.count
        return range(self.index * each, (self.index + 1) * each)


def host_rows(sharding: xs.ShardingSpec, rows: int, batch_dim: int, hosts: Hosts) -> slice:
    """The rows (along ``batch_dim``) of a global batch of ``rows`` rows that the
    devices of ``hosts`` hold under ``sharding``: what this host's loader must yield.

    Raises:
        ValueError: the rows do not split evenly over the batch axis's shards, or the
            host's devices hold rows that are not one run (a mesh whose batch axis
            this host holds in pieces).
    """
    tiles = _tiles(sharding)[batch_dim]
    held = sorted({int(tiles.index[device]) for device in hosts.devices(tiles.index.size)})
    if held != list(range(held[0], held[-1] + 1)):
        raise ValueError(f"input_sharding: host {hosts.index} of {hosts.count} holds batch shards {held}, not one "
                         "run; lay the mesh so that each host's devices hold consecutive rows")
    if rows % tiles.count:
        raise ValueError(f"rows: a global batch of {rows} rows does not split evenly over the {tiles.count} shards "
                         f"of its batch dim; make it a multiple of {tiles.count}")
    each = rows // tiles.count
    return slice(held[0] * each, (held[-1] + 1) * each)


def global_rows(sharding: xs.ShardingSpec, share: int, batch_dim: int, hosts: Hosts) -> int:
    """The rows of the global batch, given the ``share`` rows that ``hosts`` loads."""
    tiles = _tiles(sharding)[batch_dim]
    held = len({int(tiles.index[device]) for device in hosts.devices(tiles.index.size)})
    if share % held:
        raise ValueError(f"loader: a host's share of {share} rows does not split over the {held} batch shards its "
                         f"devices hold; make each host's batch a multiple of {held}")
    return share // held * tiles.count


def device_shards(share: torch.Tensor, sharding: xs.ShardingSpec, batch_dim: int, hosts: Hosts) -> list[torch.Tensor]:
    """The shards of the global batch that the devices of ``hosts`` hold, in device
    order, cut from ``share`` (the host's rows, :func:`host_rows`)."""
    tiles = _tiles(sharding)
    shape = list(share.shape)
    shape[batch_dim] = global_rows(sharding, share.shape[batch_dim], batch_dim, hosts)
    start = host_rows(sharding, shape[batch_dim], batch_dim, hosts).start
    shards = []
    for device in hosts.devices(tiles[0].index.size):
        index = []
        for dim, (size, tile) in enumerate(zip(shape, tiles)):
            if size % tile.count:
                raise ValueError(f"input_sharding: dim {dim} of a batch of shape {shape} does not split evenly over "
                                 f"its {tile.count} shards")
            each = size // tile.count
            first = int(tile.index[device]) * each - (start if dim == batch_dim else 0)
            index.append(slice(first, first + each))
        shards.append(share[tuple(index)].contiguous())
    return shards


def check_addresses_its_devices(hosts: Hosts) -> None:
    """Raise unless this process addresses exactly the devices ``hosts`` owns."""
    total, local = xr.global_runtime_device_count(), xr.addressable_runtime_device_count()
    if len(hosts.devices(total)) != local:
        raise ValueError(f"hosts: host {hosts.index} of {hosts.count} would own {total // hosts.count} of the "
                         f"{total} devices, but this process addresses {local}; pass "
                         "hosts=xpipe.hosts.Hosts.of_runtime() (on the CPU emulation one process addresses every "
                         "device: Hosts(0, 1))")


def assembled(share: torch.Tensor, sharding: xs.ShardingSpec, batch_dim: int, hosts: Hosts) -> torch.Tensor:
    """The global batch on the mesh, sharded as ``sharding``, from this host's ``share``
    (every host calls it at once with its own)."""
    check_addresses_its_devices(hosts)
    shape = list(share.shape)
    shape[batch_dim] = global_rows(sharding, share.shape[batch_dim], batch_dim, hosts)
    op_sharding = sharding.mesh.get_op_sharding(sharding.partition_spec)
    return tensor_from_shards(device_shards(share, sharding, batch_dim, hosts), op_sharding, shape)


@dataclass(frozen=True)
class _Tiles:
    """How one dim is split: into ``count`` shards, device ``d`` holding shard ``index[d]``."""

    count: int
    index: np.ndarray  # by device id


def _tiles(sharding: xs.ShardingSpec) -> list[_Tiles]:
    """Each dim's split under ``sharding``: its mesh axes, outermost first, number the shards."""
    mesh = sharding.mesh
    ids = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
    coordinates = np.empty((ids.size, len(mesh.mesh_shape)), dtype=np.int64)
    for position in np.ndindex(*mesh.mesh_shape):
        coordinates[ids[position]] = position
    tiles = []
    for axes in sharding.partition_spec:
        named = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        positions = [axis if isinstance(axis, int) else mesh.axis_names.index(axis) for axis in named]
        sizes = [mesh.mesh_shape[axis] for axis in positions]
        index = np.zeros(ids.size, dtype=np.int64)
        for axis, size in zip(positions, sizes):
            index = index * size + coordinates[:, axis]
        tiles.append(_Tiles(math.prod(sizes), index))
    return tiles
