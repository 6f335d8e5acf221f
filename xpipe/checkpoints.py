"""Checkpoints of a training run: ``xpipe.save`` and ``xpipe.load``.

A checkpoint is a directory. Its tensors (the model's state and the optimizer's
per-parameter state) are written by ``torch.distributed.checkpoint`` under the
wrapped module's own names: the spmd executor's stacked weights, and the
optimizer state that lives on them, are unstacked as ``pipe.state_dict()`` is,
and written and read shard by shard (:mod:`xpipe.chunks`): no sharded tensor is
put together on the host, and each device's shard is loaded from the chunks that
overlap it.
That is what lets a checkpoint load into any layout (other stage counts, meshes,
the other executor) and into the plain model (:func:`load_plain`). Beside them:
``training.pt`` (the step, the caller's ``extra``, the optimizer's param groups
by parameter name, the random-number states) and ``manifest.json`` (the layout
it was saved from, every key's shape, every file's CRC-32).

Writes are atomic: everything goes to a temporary directory beside ``path``,
which replaces ``path`` only when complete, so a save that fails leaves the
previous checkpoint as it was. Only a directory that holds an xpipe checkpoint
(or nothing) is ever replaced: a user's own files are never moved or deleted. A
load checks the files' hashes, the keys, the shapes and the optimizer's kind and
state before it changes any state.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import os
import pickle
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn

from xpipe._xla import HostShards, host_shards, shard_like, to_host
from xpipe.chunks import ChunkLoadPlanner, Chunks, ChunkSavePlanner, StreamingFileWriter
from xpipe.save_group import SaveGroup

FORMAT = 1
MANIFEST = "manifest.json"
TRAINING = "training.pt"


def save(path: str | os.PathLike, pipe: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         step: int | None = None, extra: Any = None, *, background: bool = False) -> Future | None:
    """Write ``pipe``'s model state (and ``optimizer``'s, the ``step``, ``extra`` and
    the random-number states) to the directory ``path``, replacing what is there
    only once the whole checkpoint is written.

    Args:
        path: the checkpoint's directory; its parent must exist.
        pipe: an :class:`xpipe.Pipe` (or a plain ``nn.Module``, whose state is saved
            the same way).
        optimizer: an optimizer over ``pipe.parameters()``.
        step: the training step, returned by :func:`load`.
        extra: anything ``torch.save`` can write, returned by :func:`load`.
        background: return as soon as the state is copied to the host, and write
            the files in a background thread, so training goes on while they are
            written. Saves are written one after another in the order they were
            asked for; :func:`load` waits for them.

    Returns:
        With ``background=True``, a ``concurrent.futures.Future`` whose ``result()``
        is ``None`` once the checkpoint is in place, or raises the error that
        stopped the write (``path`` then still holds the previous checkpoint).
    """
    path = Path(path)
    group = SaveGroup.of_run()
    if background and not group.alone:
        raise ValueError(f"background: a save from {group.size} processes is written blocking (a background "
                         "one, written by a thread on each host, is not built): pass background=False")
    group.on_every_process(lambda: _check_replaceable(path))
    _pickled(extra)  # refused before any device work
    _run_pending(pipe)
    tensors: dict[str, Any] = {"model": _host_state(pipe)}
    training: dict[str, Any] = {"step": step, "extra": extra, "rng": _rng_states(pipe)}
    if optimizer is not None:
        tensors["optimizer"], training["param_groups"] = _named_optimizer_state(pipe, optimizer)
    training_bytes = _pickled(training)  # now: a later change to `extra` is not saved
    layout = {"format": FORMAT, "xpipe": _version(), "layout": _layout(pipe), "optimizer": optimizer is not None,
              "optimizer_kind": None if optimizer is None else _kind(optimizer)}
    if background:
        _fetch(tensors)  # training may change the device values once this returns
        return _background_writer().submit(_write, path, tensors, training_bytes, layout, group)
    _write(path, tensors, training_bytes, layout, group)
    return None


def _fetch(tensors: dict[str, Any]) -> None:
    """Bring every shard of ``tensors`` that is still on the devices to the host."""
    for value in tensors.values():
        if isinstance(value, Chunks):
            value.fetch()
        elif isinstance(value, dict):
            _fetch(value)


def _run_pending(module: nn.Module) -> None:
    """Run what is pending on the devices (an optimizer step not yet synced) before a
    save reads the state or a load writes it: otherwise a sync of part of the state
    donates buffers that the rest still reads. Nothing for a module on the CPU, where
    starting the XLA runtime would fix the process's mode before an spmd Pipe could."""
    if any(tensor.device.type == "xla" for tensor in itertools.chain(module.parameters(), module.buffers())):
        torch_xla.sync()


def _check_replaceable(path: Path) -> None:
    """Raise unless ``path`` is free, an empty directory, or a directory holding an xpipe
    checkpoint and nothing else: a save replaces it whole, and must never take a
    user's own files with it."""
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: the directory {str(path.parent)!r} that should hold the checkpoint "
                                "does not exist; create it first")
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise FileExistsError(f"path: {str(path)!r} is a file, not a checkpoint directory; xpipe.save writes a "
                              "directory there and leaves your file alone: choose another path")
    entries = set(os.listdir(path))
    if not entries:
        return
    ours = _checkpoint_files(path)
    if ours is None:
        raise FileExistsError(f"path: {str(path)!r} holds files that are not an xpipe checkpoint "
                              f"({', '.join(sorted(entries)[:5])}); xpipe.save replaces the whole directory, so "
                              "it refuses: save to a new or empty directory (e.g. a 'checkpoint' folder inside it)")
    foreign = sorted(entries - ours)
    if foreign:
        raise FileExistsError(f"path: the checkpoint directory {str(path)!r} also holds {foreign[:5]}, which "
                              "xpipe.save did not write and would delete when it replaces the checkpoint; move "
                              "them elsewhere, or save to another directory")


def _checkpoint_files(path: Path) -> set[str] | None:
    """The names of the files an xpipe checkpoint at ``path`` consists of, read from its
    manifest; None if ``path`` holds no xpipe manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return {MANIFEST, *manifest["files"]} if "format" in manifest else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pickled(value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it; a value it cannot write is refused by name."""
    stream = io.BytesIO()
    try:
        torch.save(value, stream)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ValueError(f"extra: torch.save cannot write it ({error}); pass plain data (numbers, strings, "
                         "lists, dicts, tensors), e.g. a dict of the values you need to resume") from error
    return stream.getvalue()


def _kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class, as a checkpoint records it."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _write(path: Path, tensors: dict[str, Any], training: bytes, layout: dict[str, Any], group: SaveGroup) -> None:
    """The checkpoint's files, from state already on the host, put in place at ``path``:
    every process of ``group`` writes its own chunks into one staging directory, and
    process 0 writes the rest and renames it into place."""
    group.on_every_process(lambda: _check_replaceable(path))  # again: a background save runs later
    staging = Path(group.from_first(lambda: tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".saving",
                                                             dir=path.parent)))
    try:
        group.on_every_process(lambda: _check_shared(staging))
        writer = StreamingFileWriter(staging)
        with _quiet_single_process():
            # Shards reach the host as their chunks are written, tensor after tensor.
            dcp.save(tensors, storage_writer=writer, planner=ChunkSavePlanner(), no_dist=group.alone)
        hashes = group.on_every_process(lambda: {name: _checksum(staging / name) for name in writer.files})
        files = {name: digest for written in hashes for name, digest in written.items()}
        # Process 0 finishes the checkpoint; every process hears whether it did.
        group.on_every_process(lambda: _finish(path, staging, tensors, training, layout, files)
                               if group.rank == 0 else None)
    finally:
        if group.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)


def _check_shared(staging: Path) -> None:
    """Raise unless this process sees the staging directory process 0 made: the hosts
    must write into one directory."""
    if not staging.is_dir():
        raise FileNotFoundError(f"path: process 0 made the staging directory {str(staging)!r}, which this "
                                "process does not see; on several hosts the checkpoint's directory must lie on a "
                                "filesystem every host mounts at the same path")


def _finish(path: Path, staging: Path, tensors: dict[str, Any], training: bytes, layout: dict[str, Any],
            files: dict[str, str]) -> None:
    """Process 0's part: ``training.pt`` and the manifest (``files``: the data files'
    hashes, from every process) beside DCP's files, then ``staging`` in place at ``path``."""
    (staging / TRAINING).write_bytes(training)
    files = {**files, **{name: _checksum(staging / name) for name in os.listdir(staging) if name not in files}}
    manifest = {
        **layout,
        "dtypes": {f"{part}/{key}": str(value.dtype).removeprefix("torch.")
                   for part, key, value in _flat_tensors(tensors)},
        "shapes": {f"{part}/{key}": list(value.shape) for part, key, value in _flat_tensors(tensors)},
        "files": dict(sorted(files.items())),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for written in (staging / TRAINING, staging / MANIFEST, staging):  # DCP syncs its own files
        _fsync(written)
    _replace(path, staging)


@functools.cache
def _background_writer() -> ThreadPoolExecutor:
    """The one thread that writes background saves, in the order they were asked for."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="xpipe-save")


def _wait_for_background_saves() -> None:
    """Return once every background save asked for so far has finished."""
    if _background_writer.cache_info().currsize:
        _background_writer().submit(lambda: None).result()


def load(path: str | os.PathLike, pipe: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> tuple[int | None, Any]:
    """Load a checkpoint written by :func:`save` into ``pipe`` (and ``optimizer``),
    whatever layout it was saved from, and restore the random-number states.

    Returns:
        ``(step, extra)`` as they were given to :func:`save`.

    Raises:
        ValueError: a checkpoint that is incomplete, corrupted, from another model
            (missing or unexpected keys, other shapes) or without optimizer state
            when ``optimizer`` is given; nothing is changed then.
    """
    path = Path(path)
    _wait_for_background_saves()
    _run_pending(pipe)
    manifest = _checked_manifest(path)
    expected = pipe.state_dict()
    _check_matches(path, manifest, expected, optimizer)
    training = torch.load(path / TRAINING, weights_only=False)
    model, put_model_state = _model_destinations(pipe, expected)
    tensors: dict[str, Any] = {"model": model}
    if optimizer is not None:
        tensors["optimizer"], optimizer_state = _optimizer_destinations(pipe, optimizer, manifest,
                                                                         training["param_groups"], path)
    with _quiet_single_process():
        dcp.load(tensors, checkpoint_id=path, planner=ChunkLoadPlanner(), no_dist=_single_process())
    if optimizer is not None:  # first: it is the part that can still refuse, and then nothing has changed
        _load_optimizer_or_change_nothing(optimizer, optimizer_state(), path)
    put_model_state()
    _restore_rng(pipe, training["rng"])
    return training["step"], training["extra"]


def load_plain(path: str | os.PathLike, module: nn.Module,
               optimizer: torch.optim.Optimizer | None = None) -> tuple[int | None, Any]:
    """Load a checkpoint into the plain (unpipelined) ``module`` and its optimizer:
    :func:`load` for any ``nn.Module``, whose parameters are named as the Pipe's were."""
    return load(path, module, optimizer)


def _single_process() -> bool:
    """No process group: DCP writes and reads the whole state from this process."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without the warning DCP gives for every single-process save and load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # DCP's writer asks each shard's piece for its storage (to copy a view of a larger one).
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def _host_state(module: nn.Module) -> dict[str, Chunks | torch.Tensor]:
    """The model's state dict on the host: a Pipe's as what this host holds of each
    tensor (shards are not put together), a plain module's as CPU copies."""
    if hasattr(module, "host_state_chunks"):
        return module.host_state_chunks()
    state = module.state_dict()
    return dict(zip(state, to_host(list(state.values()))))


def _named_optimizer_state(pipe: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The optimizer's per-parameter state under the wrapped module's names, and its
    param groups with parameters listed by name."""
    pending = []  # (parameter, state key, tensor on the device)
    groups = []
    for group in optimizer.param_groups:
        names = []
        for parameter in group["params"]:
            names += [name for name, _ in _named_slices(pipe, parameter)]
            for key, value in optimizer.state.get(parameter, {}).items():
                if value is None:  # SGD without momentum keeps momentum_buffer=None
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer: state {key!r} is a {type(value).__name__}; xpipe.save writes "
                                     "optimizers whose per-parameter state is tensors (SGD, Adam, AdamW, ...)")
                pending.append((parameter, key, value))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    # States shaped like their parameter first: they set the order of the names, which the
    # runner gives in the order a save reads them (a stacked tensor slot by slot).
    pending.sort(key=lambda entry: entry[2].shape != entry[0].shape)
    state: dict[str, dict[str, Chunks | torch.Tensor]] = {}
    shards = host_shards([value for _, _, value in pending])  # this host's, one replica each, read as written
    for (parameter, key, value), held in zip(pending, shards):
        for name, part in _named_parts(pipe, parameter, value, held):
            state.setdefault(name, {})[key] = part
    return state, groups


def _named_parts(pipe: nn.Module, parameter: torch.Tensor, value: torch.Tensor,
                 shards: HostShards) -> list[tuple[str, Chunks | torch.Tensor]]:
    """The parts of ``value`` (an optimizer state of ``parameter``) by the wrapped
    module's names, from the shards of it this host holds: under spmd as their pieces;
    a state not shaped like its parameter (Adam's ``step``), or one held whole, whole."""
    runner = getattr(pipe, "runner", None)
    if value.shape == parameter.shape and hasattr(runner, "named_chunks"):
        return runner.named_chunks(parameter, value, shards)
    held_whole = len(shards.places) == 1 and tuple(part.stop for part in shards.places[0]) == tuple(value.shape)
    host = shards.read(0) if held_whole else to_host([value])[0]
    return [(name, part.clone()) for name, part in _named_slices(pipe, parameter, host)]


def _named_slices(pipe: nn.Module, parameter: torch.Tensor,
                  tensor: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
    """The wrapped module's parameters that ``parameter`` holds, by name, with their
    parts of ``tensor`` (a tensor shaped like ``parameter``, or ``parameter`` itself);
    a state that is not shaped like it (Adam's ``step``) is every name's."""
    tensor = parameter if tensor is None else tensor
    runner = getattr(pipe, "runner", None)
    if runner is not None:
        slices = runner.named_slices(parameter, tensor if tensor.shape == parameter.shape else parameter)
    else:
        slices = [(name, tensor) for name, p in pipe.named_parameters() if p is parameter][:1]
    if not slices:
        raise ValueError("optimizer: it steps a tensor that is not one of pipe.parameters(); build it on "
                         "pipe.parameters() after wrapping the model")
    if tensor.shape != parameter.shape:
        return [(name, tensor) for name, _ in slices]
    return slices


def _rng_states(pipe: nn.Module) -> dict[str, Any]:
    """torch's CPU generator (the spmd executor's dropout seeds) and each XLA device's."""
    devices = [str(d) for d in getattr(pipe, "devices", [])]
    return {"torch": torch.get_rng_state(), "xla": {d: xm.get_rng_state(torch.device(d)) for d in devices}}


def _restore_rng(pipe: nn.Module, states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    devices = {str(d) for d in getattr(pipe, "devices", [])}
    for device, seed in states["xla"].items():
        if device in devices:  # another layout's devices: their streams do not carry over
            xm.set_rng_state(seed, torch.device(device))


def _layout(pipe: nn.Module) -> dict[str, Any]:
    partition = getattr(pipe, "partition", None)
    mesh = getattr(pipe, "mesh", None)
    return {"executor": getattr(pipe, "executor", "plain"),
            "stages": len(partition.balance) if partition is not None else 1,
            "balance": list(partition.balance) if partition is not None else None,
            "mesh": dict(zip(mesh.axis_names, map(int, mesh.mesh_shape))) if mesh is not None else None}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xpipe")
    except PackageNotFoundError:
        return "unknown"


def _flat_tensors(tensors: dict[str, Any]) -> list[tuple[str, str, torch.Tensor]]:
    """(part, key, tensor) for the model's and the optimizer's tensors."""
    flat = [("model", key, value) for key, value in tensors["model"].items()]
    for name, state in tensors.get("optimizer", {}).items():
        flat += [("optimizer", f"{name}/{key}", value) for key, value in state.items()]
    return flat


def _checksum(file: Path) -> str:
    """The file's CRC-32 (as zip files keep one per member): it changes with any
    truncation or flipped byte, and costs less than half a SHA-256."""
    crc = 0
    with open(file, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _fsync(path: Path) -> None:
    """Make ``path`` (a file, or a directory's entries) durable: after a power loss the
    new checkpoint is whole, or the previous one is still in place."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _replace(path: Path, staging: Path) -> None:
    """Put the complete checkpoint ``staging`` at ``path``; the old one goes only after
    the rename is durable."""
    retired = None
    if path.exists():
        retired = path.with_name(f".{path.name}.{os.getpid()}.replaced")
        os.rename(path, retired)
    os.rename(staging, path)
    _fsync(path.parent)
    if retired is not None:
        shutil.rmtree(retired)


def _checked_manifest(path: Path) -> dict[str, Any]:
    """The manifest, once every file it lists is there with its hash."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"checkpoint: {str(manifest_file)!r} does not exist: {str(path)!r} is not an xpipe "
                         "checkpoint, or its save did not finish")
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"checkpoint: {str(manifest_file)!r} is damaged ({error})") from error
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint: {str(file)!r} is missing")
        if _checksum(file) != digest:
            raise ValueError(f"checkpoint: {str(file)!r} is truncated or corrupted (its CRC-32 differs from "
                             "the one written at save time)")
    return manifest


def _check_matches(path: Path, manifest: dict[str, Any], expected: dict[str, torch.Tensor],
                   optimizer: torch.optim.Optimizer | None) -> None:
    """The checkpoint holds exactly this model's keys and shapes, and the state of an
    optimizer of ``optimizer``'s kind."""
    saved = {key[len("model/"):]: shape for key, shape in manifest["shapes"].items() if key.startswith("model/")}
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    reshaped = [f"{key} {saved[key]} (model: {list(value.shape)})" for key, value in expected.items()
                if key in saved and saved[key] != list(value.shape)]
    if missing or unexpected or reshaped:
        raise ValueError(f"checkpoint: {str(path)!r} is from another model: missing keys {missing[:5]}, "
                         f"unexpected keys {unexpected[:5]}, other shapes {reshaped[:5]}")
    if optimizer is not None and not manifest.get("optimizer"):
        raise ValueError(f"checkpoint: {str(path)!r} was saved without an optimizer; load it with optimizer=None")
    saved_kind = manifest.get("optimizer_kind")  # absent from checkpoints of xpipe before it was recorded
    if optimizer is not None and saved_kind is not None and saved_kind != _kind(optimizer):
        raise ValueError(f"optimizer: the checkpoint {str(path)!r} holds the state of a {saved_kind}, and this "
                         f"optimizer is a {_kind(optimizer)}; build the optimizer the checkpoint was saved with, "
                         "or load with optimizer=None (the weights only) and start the optimizer afresh")


def _model_destinations(pipe: nn.Module, expected: dict[str, torch.Tensor]
                        ) -> tuple[dict[str, Chunks | torch.Tensor], Callable[[], None]]:
    """Where a load writes the model's state, and what puts it in place once written:
    under spmd, buffers for the shards of this host's devices, handed to them in place
    (:meth:`SpmdPipeline.load_chunks`); otherwise whole CPU tensors, loaded with
    ``load_state_dict``."""
    runner = getattr(pipe, "runner", None)
    if hasattr(runner, "load_chunks"):
        return runner.load_chunks(list(expected))
    state = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in expected.items()}
    return state, lambda: pipe.load_state_dict(state)


def _optimizer_destinations(pipe: nn.Module, optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                            named_groups: list[dict], path: Path
                            ) -> tuple[dict[str, dict[str, Chunks | torch.Tensor]], Callable[[], dict[str, Any]]]:
    """Where a load writes the optimizer state the checkpoint holds, by the wrapped
    module's names; and what then gives it as ``optimizer.load_state_dict`` takes it:
    per parameter of ``optimizer`` (in this layout), its names' states as one tensor.

    Raises:
        ValueError: naming ``optimizer`` if its param groups are not the checkpoint's.
    """
    if len(named_groups) != len(optimizer.param_groups):
        raise ValueError(f"optimizer: the checkpoint {str(path)!r} has {len(named_groups)} param groups and "
                         f"this optimizer {len(optimizer.param_groups)}; build it with the same groups")
    saved: dict[str, dict[str, tuple[list[int], torch.dtype]]] = {}
    for key, shape in manifest["shapes"].items():
        if key.startswith("optimizer/"):
            name, state_key = key[len("optimizer/"):].rsplit("/", 1)
            saved.setdefault(name, {})[state_key] = (shape, getattr(torch, manifest["dtypes"][key]))
    destinations: dict[str, dict[str, Chunks | torch.Tensor]] = {}
    made: dict[int, dict[str, Callable[[], torch.Tensor]]] = {}
    groups = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, named_groups):
        positions = []
        for parameter in group["params"]:
            parts = dict(_named_slices(pipe, parameter))
            absent = [name for name in parts if name not in saved_group["params"]]
            if absent:
                raise ValueError(f"optimizer: {absent[:3]} are not in the checkpoint's param group; build the "
                                 "optimizer with the same parameters in the same groups")
            present = {name: saved[name] for name in parts if name in saved}
            if present:
                made[index] = _state_destinations(pipe, parameter, parts, present, destinations)
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": positions})

    def state() -> dict[str, Any]:
        return {"state": {position: {key: make() for key, make in keys.items()} for position, keys in made.items()},
                "param_groups": groups}

    return destinations, state


def _state_destinations(pipe: nn.Module, parameter: torch.Tensor, parts: dict[str, torch.Tensor],
                        saved: dict[str, dict[str, tuple[list[int], torch.dtype]]],
                        destinations: dict[str, dict[str, Chunks | torch.Tensor]]
                        ) -> dict[str, Callable[[], torch.Tensor]]:
    """The destinations of one parameter's saved optimizer state (``saved``: by name, each
    state's shape and dtype), added to ``destinations``; returns, per state key, what
    gives the loaded tensor. A state shaped like each name's part of ``parameter`` goes
    into that part; any other (Adam's ``step``, a scalar) is the same for every name and
    read once."""
    first = next(iter(saved))
    made = {}
    for key, (shape, dtype) in saved[first].items():
        if all(key in states and states[key][0] == list(parts[name].shape) for name, states in saved.items()):
            named, made[key] = _shaped_destinations(pipe, parameter, dtype)
            for name, destination in named:
                if name in saved:
                    destinations.setdefault(name, {})[key] = destination
        else:
            value = torch.empty(shape, dtype=dtype)
            destinations.setdefault(first, {})[key] = value
            made[key] = _returning(value)
    return made


def _shaped_destinations(pipe: nn.Module, parameter: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[list[tuple[str, Chunks | torch.Tensor]], Callable[[], torch.Tensor]]:
    """A state tensor shaped like ``parameter``, as its names' parts to load into, and
    what gives the whole once loaded: under spmd sharded as ``parameter`` from buffers
    for this host's shards; otherwise a CPU tensor."""
    runner = getattr(pipe, "runner", None)
    if hasattr(runner, "state_load_chunks"):
        return runner.state_load_chunks(parameter, dtype)
    whole = torch.zeros(parameter.shape, dtype=dtype)
    return _named_slices(pipe, parameter, whole), _returning(whole)


def _returning(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: value


def _load_optimizer_or_change_nothing(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: Path) -> None:
    """``optimizer.load_state_dict(state)``, or, if it fails (state of another kind of
    optimizer, in a checkpoint that does not record its kind), the optimizer as it was."""
    kept = next((sorted(value) for value in optimizer.state.values()), None)  # one parameter's state keys
    loaded = next((sorted(value) for value in state["state"].values()), None)
    if kept and loaded and kept != loaded:
        raise ValueError(f"optimizer: the checkpoint {str(path)!r} holds optimizer state {loaded}, and this "
                         f"optimizer keeps {kept}; build the optimizer the checkpoint was saved with, or load with "
                         "optimizer=None")
    before = optimizer.state, optimizer.param_groups  # load_state_dict puts new objects in their place
    try:
        optimizer.load_state_dict(state)
    except Exception as error:
        optimizer.state, optimizer.param_groups = before
        raise ValueError(f"optimizer: the state in {str(path)!r} does not load into this "
                         f"{type(optimizer).__name__} ({type(error).__name__}: {error}); build the optimizer the "
                         "checkpoint was saved with, or load with optimizer=None") from error
    # A state loaded whole onto the device (not from shard buffers) is sharded as its parameter again.
    shard_like([(value, parameter) for group in optimizer.param_groups for parameter in group["params"]
                for value in optimizer.state.get(parameter, {}).values() if isinstance(value, torch.Tensor)])
