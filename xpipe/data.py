"""Device loaders that stack microbatches on the host: ``[chunks, batch, ...]`` on arrival.

Drop-in for torch_xla's ``ParallelLoader`` and ``MpDeviceLoader`` (same arguments,
same background threads and prefetching, ``input_sharding`` applied at transfer),
plus an accumulation dimension: with ``accumulation_size=k`` the loader's worker
takes ``k`` batches from the wrapped loader and stacks them on
``accumulation_dim`` before the transfer, so a pipeline (``pipe(x,
microbatch_dim=...)``) or an XLA-loop gradient accumulation gets its step's data
in one piece, already sharded, with no reshaping on the device.

    loader = xpipe.data.MpDeviceLoader(train_loader, device, accumulation_dim=0, accumulation_size=16,
                                       batch_dim=1, input_sharding=batch_sharding(mesh, ndim=3, batch_dim=1))
    for tokens in loader:                 # [16, 32, seq] from batches of [32, seq]
        logits = pipe(tokens, microbatch_dim=0)

On a pod, ``hosts=xpipe.hosts.Hosts.of_runtime()`` makes each host's loader yield
only its share of the global batch (:func:`xpipe.hosts.host_rows`), and the global
batch is assembled from the hosts' shares as it is transferred (:mod:`xpipe.hosts`).

Errors in the wrapped loader reach the training loop with their own traceback,
and the loader's threads stop when iteration ends, fails, or is abandoned.

Being subclasses, these loaders read state torch_xla 2.9's loaders keep under
private names, and nothing else of theirs: ``ParallelLoader._devices``,
``._input_sharding`` and ``._threads``; ``MpDeviceLoader._loader``, ``._device``,
``._parallel_loader`` and ``._parallel_loader_kwargs``; ``PerDeviceLoader._loader``.
A torch_xla that renames them breaks ``tests/test_data.py`` and
``tests/spmd/test_loader.py``. Calls into torch_xla's private API live in
:mod:`xpipe._xla`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch_xla.distributed.parallel_loader as torch_xla_loader
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from xpipe.hosts import Hosts, assembled, check_addresses_its_devices

_JOIN_SECONDS = 5.0


def batch_sharding(mesh: xs.Mesh, ndim: int, batch_dim: int, axis: str = "data") -> xs.ShardingSpec:
    """An ``input_sharding`` that shards dim ``batch_dim`` of ``ndim``-dim batches over ``axis``."""
    if not 0 <= batch_dim < ndim:
        raise ValueError(f"batch_dim: {batch_dim} is not a dim of {ndim}-dim batches")
    return xs.ShardingSpec(mesh, tuple(axis if dim == batch_dim else None for dim in range(ndim)))


class Accumulated(Iterable):
    """The batches of ``loader``, ``size`` at a time, stacked on ``dim``.

    Nested batches (tuples, lists, dicts) are stacked leaf by leaf; non-tensor
    leaves become lists of the group's values. A short final group is dropped with
    a warning, or raises if ``strict``.
    """

    def __init__(self, loader: Iterable, size: int, dim: int, *, strict: bool = False) -> None:
        self.loader, self.size, self.dim, self.strict = loader, size, dim, strict

    def __iter__(self) -> Iterator[Any]:
        group: list[Any] = []
        for index, batch in enumerate(self.loader):
            group.append(batch)
            if len(group) == self.size:
                yield stack_batches(group, self.dim, first=index + 1 - self.size)
                group = []
        if group:
            message = (f"accumulation_size: the loader ended with {len(group)} batches, fewer than "
                       f"accumulation_size={self.size}")
            if self.strict:
                raise ValueError(f"{message}; drop them in the loader or pass strict=False")
            warnings.warn(f"{message}; they were dropped", stacklevel=2)

    def __len__(self) -> int:
        return len(self.loader) // self.size  # type: ignore[arg-type]


def stack_batches(group: list[Any], dim: int, *, first: int = 0) -> Any:
    """Stack same-structured batches leaf by leaf on ``dim``; ``first`` numbers them in errors."""
    leaves, structure = tree_flatten(group[0])
    columns = [[leaf] for leaf in leaves]
    for offset, batch in enumerate(group[1:], start=1):
        more, other = tree_flatten(batch)
        if other != structure:
            raise ValueError(f"loader: batch {first + offset} is structured as {other}, batch {first} as "
                             f"{structure}; batches stacked together must have the same structure")
        for column, leaf in zip(columns, more):
            column.append(leaf)
    return tree_unflatten([_stack_leaf(column, dim, first) for column in columns], structure)


def _stack_leaf(values: list[Any], dim: int, first: int) -> Any:
    if not isinstance(values[0], torch.Tensor):
        return list(values)
    for offset, value in enumerate(values[1:], start=1):
        if value.shape != values[0].shape:
            raise ValueError(f"loader: batch {first + offset} has shape {list(value.shape)} but batch {first} has "
                             f"{list(values[0].shape)}; batches stacked together must match (a DataLoader's "
                             "drop_last=True keeps the last batch full)")
    if not 0 <= dim <= values[0].dim():
        raise ValueError(f"accumulation_dim: {dim} is out of range for batches of {values[0].dim()} dims")
    return torch.stack(values, dim=dim)


class _Guarded(Iterable):
    """Iterates ``source``, checking each batch; an exception ends the iteration and is
    kept for the consumer."""

    def __init__(self, source: Iterable, check: Callable[[Any], None]) -> None:
        self.source = source
        self.check = check
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[Any]:
        try:
            for batch in self.source:
                self.check(batch)
                yield batch
        except Exception as error:  # handed to the training loop by PerDeviceLoader
            self.error = error

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]


class ParallelLoader(torch_xla_loader.ParallelLoader):
    """torch_xla's ParallelLoader with an accumulation dimension.

    Args:
        loader: the host loader (e.g. a ``torch.utils.data.DataLoader``).
        devices: the XLA devices to feed.
        batch_dim: the batch axis of what this loader yields (after stacking).
        accumulation_dim: where the stacked batches' new axis goes.
        accumulation_size: batches per stack; 0 turns stacking off.
        strict: raise, instead of warning, when the last group is short.
        hosts: on a pod, this process's host (``xpipe.hosts.Hosts.of_runtime()``):
            ``loader`` then yields only this host's rows of each global batch
            (:func:`xpipe.hosts.host_rows`), and the global batch is assembled from
            every host's shards on transfer; needs ``input_sharding``.
        **kwargs: torch_xla's own options: ``batches_per_execution``,
            ``loader_prefetch_size``, ``device_prefetch_size``,
            ``host_to_device_transfer_threads``, ``input_sharding``.

    Raises:
        ValueError: if ``batch_dim == accumulation_dim`` or a size is negative.
    """

    def __init__(self, loader: Iterable, devices, *, batch_dim: int = 0, accumulation_dim: int = 1,
                 accumulation_size: int = 0, strict: bool = False, hosts: Hosts | None = None,
                 **kwargs: Any) -> None:
        _check_options(batch_dim, accumulation_dim, accumulation_size)
        sharding = _check_input_sharding(kwargs.get("input_sharding"))
        self._hosts = _check_hosts(hosts, sharding)
        self._batch_dim = batch_dim
        source = Accumulated(loader, accumulation_size, accumulation_dim, strict=strict) if accumulation_size \
            else loader
        self._guarded = _Guarded(source, partial(_check_sharding_fits, sharding))
        super().__init__(self._guarded, devices, batchdim=batch_dim, **kwargs)

    def per_device_loader(self, device) -> PerDeviceLoader:
        """The iterator of ``device``'s batches.

        Raises:
            ValueError: ``device`` is not one this loader feeds.
        """
        if torch.device(device) not in [torch.device(d) for d in self._devices]:
            raise ValueError(f"device: this loader feeds {[str(d) for d in self._devices]}, not {str(device)!r}; "
                             "ask for one of those, or build the loader with that device among its devices")
        return PerDeviceLoader(self, device)

    def per_device_samples(self) -> int:
        return len(self._guarded) // len(self._devices)

    def send_cpu_data_to_device(self, batches: list[Any], device) -> list[Any]:
        """The batches on the mesh; with ``hosts``, each tensor assembled from every
        host's share into the global batch."""
        if self._hosts is None:
            return super().send_cpu_data_to_device(batches, device)
        return [self._assembled(batch) for batch in batches]

    def _assembled(self, batch: Any) -> Any:
        sharding = self._input_sharding
        if isinstance(sharding, dict):
            missing = sorted(set(batch) - set(sharding))
            if missing:
                raise KeyError(f"input_sharding: has no spec for the batch keys {missing}; with hosts, every "
                               "tensor is a global batch assembled from the hosts' shares and needs one")
            return {key: self._assembled_leaf(value, sharding[key]) for key, value in batch.items()}
        return tree_map(lambda leaf: self._assembled_leaf(leaf, sharding), batch)

    def _assembled_leaf(self, leaf: Any, sharding: xs.ShardingSpec) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return assembled(leaf, sharding, self._batch_dim, self._hosts)

    def close(self) -> None:
        """Stop the worker threads and wait for them."""
        super().close()
        for thread in self._threads:
            thread.join(_JOIN_SECONDS)


class PerDeviceLoader(torch_xla_loader.PerDeviceLoader):
    """One device's batches; re-raises the wrapped loader's error at the point it happened."""

    def next(self) -> Any:
        try:
            return super().next()
        except StopIteration:
            self._loader.close()
            error = self._loader._guarded.error
            if error is not None:
                raise error.with_traceback(error.__traceback__) from None
            raise

    def close(self) -> None:
        self._loader.close()

    def __del__(self) -> None:
        self._loader.close()


class MpDeviceLoader(torch_xla_loader.MpDeviceLoader):
    """torch_xla's MpDeviceLoader with an accumulation dimension; options as :class:`ParallelLoader`.

    Each ``iter()`` starts a fresh :class:`ParallelLoader`; leaving the loop early
    (``break``) stops its threads as soon as the iterator is dropped.
    """

    def __init__(self, loader: Iterable, device, *, batch_dim: int = 0, accumulation_dim: int = 1,
                 accumulation_size: int = 0, strict: bool = False, hosts: Hosts | None = None,
                 **kwargs: Any) -> None:
        _check_options(batch_dim, accumulation_dim, accumulation_size)
        _check_hosts(hosts, _check_input_sharding(kwargs.get("input_sharding")))
        super().__init__(loader, device, batch_dim=batch_dim, accumulation_dim=accumulation_dim,
                         accumulation_size=accumulation_size, strict=strict, hosts=hosts, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        if self._parallel_loader is not None:
            self._parallel_loader.close()
        self._parallel_loader = ParallelLoader(self._loader, [self._device], **self._parallel_loader_kwargs)
        return _closing(self._parallel_loader.per_device_loader(self._device))

    def __len__(self) -> int:
        size = self._parallel_loader_kwargs["accumulation_size"]
        return len(self._loader) // size if size else len(self._loader)


def _closing(batches: PerDeviceLoader) -> Iterator[Any]:
    try:
        yield from batches
    finally:
        batches.close()


def _check_input_sharding(sharding: Any) -> Any:
    """``input_sharding`` if torch_xla will apply it; it drops what it cannot apply, in silence."""
    if sharding is None:
        return None
    specs = sharding.values() if isinstance(sharding, dict) else [sharding]
    if not all(isinstance(spec, xs.ShardingSpec) for spec in specs):
        raise TypeError(f"input_sharding: expected a torch_xla ShardingSpec (or a dict of them by batch key), "
                        f"got {type(sharding).__name__}; build one with xpipe.data.batch_sharding(mesh, ndim, "
                        "batch_dim)")
    if not xr.is_spmd():
        raise ValueError("input_sharding: shards batches over a mesh, which needs SPMD mode; leave it out for "
                         "the devices executor, or build the mesh (xpipe.make_mesh) first")
    return sharding


def _check_hosts(hosts: Hosts | None, sharding: Any) -> Hosts | None:
    """``hosts`` if the loader can assemble global batches from the hosts' shares."""
    if hosts is None:
        return None
    if not isinstance(hosts, Hosts):
        raise TypeError(f"hosts: expected an xpipe.hosts.Hosts, got {type(hosts).__name__}; pass "
                        "hosts=xpipe.hosts.Hosts.of_runtime()")
    if sharding is None:
        raise ValueError("hosts: each host's share is assembled into a global batch sharded over the mesh, which "
                         "needs input_sharding; pass input_sharding=xpipe.data.batch_sharding(mesh, ndim, batch_dim)")
    check_addresses_its_devices(hosts)
    return hosts


def _check_sharding_fits(sharding: Any, batch: Any) -> None:
    """Every tensor of ``batch`` has as many dims as its sharding names."""
    if sharding is None:
        return
    pairs = ([(sharding[key], value) for key, value in batch.items() if key in sharding]
             if isinstance(sharding, dict) else [(sharding, leaf) for leaf in tree_flatten(batch)[0]])
    for spec, tensor in pairs:
        if isinstance(tensor, torch.Tensor) and not spec.can_apply(tensor):
            raise ValueError(
                f"input_sharding: names {len(spec.partition_spec)} dims but a batch tensor has shape "
                f"{list(tensor.shape)}; torch_xla would leave it unsharded without a word. Build it for "
                f"{tensor.dim()} dims, e.g. xpipe.data.batch_sharding(mesh, ndim={tensor.dim()}, batch_dim=...)")


def _check_options(batch_dim: int, accumulation_dim: int, accumulation_size: int) -> None:
    if isinstance(accumulation_size, bool) or not isinstance(accumulation_size, int) or accumulation_size < 0:
        raise ValueError(f"accumulation_size: must be a whole number >= 0 (0 turns stacking off), "
                         f"got {accumulation_size!r}")
    if batch_dim == accumulation_dim:
        raise ValueError(f"batch_dim: equals accumulation_dim ({batch_dim}); the batch axis and the stacking "
                         "axis must differ, e.g. accumulation_dim=0 with batch_dim=1")
    if batch_dim < 0 or accumulation_dim < 0:
        raise ValueError(f"batch_dim, accumulation_dim: must be >= 0, got {batch_dim} and {accumulation_dim}")
