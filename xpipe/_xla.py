"""Small XLA facts every executor relies on: autograd's device queues, SPMD mode, moving weights."""

from __future__ import annotations

import atexit
import importlib.util
import threading
import time
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


class _PassGradient(torch.autograd.Function):
    """The identity, whose backward hands back the very gradient it was given."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


_settle_probes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def settle_autograd(devices: Collection[torch.device]) -> None:
    """Return once autograd's worker thread of each of ``devices`` has let go of the
    backward passes it ran.

    A backward of XLA tensors runs on its device's worker thread, which drops its
    hold on the graph only after the caller has resumed. A graph it still holds
    keeps what it saved, views of weights among them, and the optimizer's in-place
    update makes those views pending: the next sync then runs them too, in a
    program of its own (seen: a compile at the fourth of five devices-executor
    steps, in 1 run of 8 on two busy cores). The worker takes its tasks in order,
    so a tiny backward given to it after theirs returns only once it has dropped
    them; that backward hands back a gradient already on the device, so it leaves
    nothing pending itself.
    """
    for device in devices:
        if str(device) not in _settle_probes:
            probe, grad = torch.zeros(1, device=device, requires_grad=True), torch.zeros(1, device=device)
            sync([probe, grad])
            _settle_probes[str(device)] = probe, grad
        probe, grad = _settle_probes[str(device)]
        with torch.enable_grad():  # a backward (PipelineFunction's) runs without it
            torch.autograd.grad(_PassGradient.apply(probe), probe, grad)


def can_enter_spmd() -> bool:
    """Whether the process is in SPMD mode or can still switch to it (no XLA device used yet)."""
    import torch_xla.runtime as xr

    return xr.is_spmd() or not spmd_mode_locked()


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
    sharded = synced_sharded(tensors)
    shards = dict(zip(map(id, sharded), local_shards(sharded)))
    return [_assembled(tensor, shards[id(tensor)]) if id(tensor) in shards else tensor.to("cpu", copy=True)
            for tensor in tensors]


def synced_sharded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The SPMD-sharded ones of ``tensors``, synced together so that their shards hold
    the current values."""
    sharded = [tensor for tensor in tensors if is_sharded(tensor)]
    if sharded:
        sync(sharded)
    return sharded


def is_sharded(tensor: torch.Tensor) -> bool:
    import torch_xla.distributed.spmd as xs

    return tensor.device.type == "xla" and isinstance(xs.wrap_if_sharded(tensor), xs.XLAShardedTensor)


def local_shards(tensors: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, Any]]]:
    """Each tensor's shards on this host as (data, index into the whole tensor);
    of shards that are copies of one another (replicas), the first only."""
    if not tensors:
        return []
    data = local_shard_data(tensors)
    places = local_shard_places(tensors)
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
    kept = []
    for tensor in tensors:
        if tensor.device.type == "xla":
            sharding = op_sharding(tensor)
            if sharding is not None:
                kept.append((tensor, sharding))
    return kept


def restore_shardings(kept: list[tuple[torch.Tensor, Any]]) -> None:
    """Shard each tensor as :func:`kept_shardings` found it, and materialize it: the
    next step then runs the program it ran before the load, not one with the load in it."""
    for tensor, sharding in kept:
        mark_sharding(tensor, sharding)
    if kept:
        sync([tensor for tensor, _ in kept])


def shard_bytes(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of ``tensors`` (XLA tensors) that each device holds: under SPMD from its
    local shards; otherwise each tensor whole on its own device."""
    import torch_xla.runtime as xr

    held: dict[str, int] = {}
    if not xr.is_spmd():
        for tensor in tensors:
            held[str(tensor.device)] = held.get(str(tensor.device), 0) + tensor.numel() * tensor.element_size()
        return held
    if not tensors:
        return held
    sync(tensors)
    for shards in local_shard_data(tensors):
        for data, device in shards:
            held[device] = held.get(device, 0) + data.numel() * data.element_size()
    return held


# torch_xla's private calls, each behind a name that says what it does: this module
# is the one place xpipe reaches into torch_xla._XLAC.


def _xlac() -> Any:
    import torch_xla

    return torch_xla._XLAC


def sync(tensors: list[torch.Tensor], *, wait: bool = True) -> None:
    """Run the pending graphs behind ``tensors`` (one device's, or SPMD-sharded ones)."""
    _xlac()._xla_sync_multi(tensors, devices=[], wait=wait)


def launch_device(device: torch.device) -> None:
    """Launch whatever is pending on ``device`` without waiting (``torch_xla.sync()``
    runs the default device only)."""
    _xlac()._xla_step_marker(str(device), [], wait=False)


class _PendingCallbacks:
    """The ``on_ready`` callbacks registered and not yet run, waited for at exit.

    torch_xla's exit hook waits for the devices' pending work while holding the GIL;
    a callback still to run when that work finishes needs the GIL on an XLA worker
    thread, which then never finishes the work: the process hung at exit (about 1
    run in 10 of a script whose last step used the devices executor, every time with
    a long computation still running). Exit hooks run last-registered first, and
    this one is registered after torch_xla's (which ``import torch_xla`` makes), so
    the callbacks run, the GIL let go between polls, before torch_xla's hook waits.
    """

    WAIT_SECONDS = 120.0  # at most, then exit goes on (a device that never finishes)

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._registered = False

    def wrapped(self, callback: Any) -> Any:
        with self._lock:
            self.count += 1
            if not self._registered:
                atexit.register(self.wait)
                self._registered = True

        def run() -> None:
            try:
                callback()
            finally:
                with self._lock:
                    self.count -= 1

        return run

    def wait(self) -> None:
        deadline = time.monotonic() + self.WAIT_SECONDS
        while self.count and time.monotonic() < deadline:
            time.sleep(0.001)
        # The XLA thread takes the GIL once more after a callback returns, to drop its
        # reference to it (pybind11's function wrapper): give it that moment too.
        time.sleep(0.05)


_pending_callbacks = _PendingCallbacks()


def on_ready(tensor: torch.Tensor, callback: Any) -> None:
    """Call ``callback()`` once ``tensor``'s device buffer is ready (on an XLA thread);
    the process waits for it before it exits (:class:`_PendingCallbacks`)."""
    _xlac()._on_ready_callback(tensor, _pending_callbacks.wrapped(callback))


def runtime_started() -> bool:
    """Whether torch_xla's runtime has started (starting it fixes the process's mode)."""
    return _xlac()._xla_runtime_is_initialized()


def wait_device_ops() -> None:
    """Wait for every device's pending work."""
    _xlac()._xla_wait_device_ops([])


def spmd_mode_locked() -> bool:
    """Whether an XLA device was used, after which ``use_spmd()`` is no longer safe."""
    return _xlac()._xla_get_spmd_config_is_locked()


def op_sharding(tensor: torch.Tensor) -> Any:
    """``tensor``'s sharding as torch_xla's OpSharding object; None if it has none."""
    return _xlac()._get_xla_op_sharding(tensor)


def sharding_spec(tensor: torch.Tensor) -> str:
    """``tensor``'s sharding in HLO's text form (``{devices=[...]...}``), '' if none."""
    return _xlac()._get_xla_sharding_spec(tensor)


def mark_sharding(tensor: torch.Tensor, sharding: Any) -> None:
    """Shard ``tensor`` as ``sharding`` (an OpSharding from :func:`op_sharding`)."""
    _xlac()._xla_mark_sharding(tensor, sharding)


def local_shard_places(tensors: list[torch.Tensor]) -> list[list[tuple[int, Any]]]:
    """For each tensor, its shards on this host's devices as (replica, indices)."""
    return _xlac()._get_local_shard_replica_and_indices(tensors)


def local_shard_data(tensors: list[torch.Tensor]) -> list[list[tuple[torch.Tensor, str]]]:
    """For each tensor, its shards on this host's devices as (CPU data, device)."""
    return _xlac()._get_local_shards(tensors)


def load_local_shards(tensor: torch.Tensor, shards: list[torch.Tensor]) -> None:
    """Write ``shards`` (CPU data, one per local device in device order) into ``tensor`` in place."""
    xlac = _xlac()
    xlac._load_local_shards(tensor, shards, xlac._xla_get_runtime_devices())


def tensor_from_shards(shards: list[torch.Tensor], sharding: Any, shape: list[int]) -> torch.Tensor:
    """A new tensor on the devices of ``shape``, sharded as ``sharding``, from the CPU
    data of each local device's shard."""
    return _xlac()._global_tensor_from_cpu_shards(shards, sharding, shape)


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """Pass ``tensors`` (in place) through one XLA optimization barrier: every value
    they depend on is computed before any of them is used."""
    _xlac()._xla_optimization_barrier_(tensors)


def while_loop(fn: Any, init: Any, xs: Any) -> tuple[Any, Any]:
    """``fn(carry, x) -> (carry, y)`` over the first dim of ``xs`` (pytrees) as one XLA
    while loop, without autograd (torch_xla's ``scan`` minus the autograd it builds
    around the loop, which keeps every iteration's carry for the backward): for a
    loop whose backward is another loop of one's own. Returns the last carry and
    the ``y``s stacked."""
    from torch_xla.experimental.scan import _scan_impl_pytree

    return _scan_impl_pytree(fn, init, xs)
