"""``xpipe.save``: a training run's state written to a checkpoint directory.

The model's state and the optimizer's per-parameter state are written by
``torch.distributed.checkpoint`` under the wrapped module's own names
(:mod:`xpipe.checkpoints.state`), as the pieces of the shards each host holds
(:mod:`xpipe.checkpoints.pieces`): no sharded tensor is put together on a host.
Every process of the run writes its own shards into one staging directory
(:mod:`xpipe.checkpoints.group`), which process 0 completes and puts in place
(:mod:`xpipe.checkpoints.files`).
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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from xpipe.checkpoints.files import (FORMAT, MANIFEST, TRAINING, check_replaceable, check_shared, checksum, fsync,
                                     put_in_place)
from xpipe.checkpoints.group import SaveGroup
from xpipe.checkpoints.pieces import Pieces, PieceSavePlanner, StreamingFileWriter
from xpipe.checkpoints.shards import host_shards
from xpipe.checkpoints.state import CheckpointState, named_slices, state_of, whole_pieces


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
    group.joined("xpipe.save", path)
    group.on_every_process(lambda: check_replaceable(path))
    _pickled(extra)  # refused before any device work
    run_pending(pipe)
    state, devices, recorded = state_of(pipe)
    tensors: dict[str, Any] = {"model": state.state_pieces()}
    training: dict[str, Any] = {"step": step, "extra": extra, "rng": _rng_states(devices)}
    if optimizer is not None:
        tensors["optimizer"], training["param_groups"] = _named_optimizer_state(state, optimizer)
    training_bytes = _pickled(training)  # now: a later change to `extra` is not saved
    layout = {"format": FORMAT, "xpipe": _version(), "layout": recorded, "optimizer": optimizer is not None,
              "optimizer_kind": None if optimizer is None else optimizer_kind(optimizer)}
    if background:
        _fetch(tensors)  # training may change the device values once this returns
        return _background_writer().submit(_write, path, tensors, training_bytes, layout, group)
    _write(path, tensors, training_bytes, layout, group)
    return None



def _fetch(tensors: dict[str, Any]) -> None:
    """Bring every shard of ``tensors`` that is still on the devices to the host."""
    for value in tensors.values():
        if isinstance(value, Pieces):
            value.fetch()
        elif isinstance(value, dict):
            _fetch(value)



def run_pending(module: nn.Module) -> None:
    """Run what is pending on the devices (an optimizer step not yet synced) before a
    save reads the state or a load writes it: otherwise a sync of part of the state
    donates buffers that the rest still reads. Nothing for a module on the CPU, where
    starting the XLA runtime would fix the process's mode before an spmd Pipe could."""
    if any(tensor.device.type == "xla" for tensor in itertools.chain(module.parameters(), module.buffers())):
        torch_xla.sync()



def _pickled(value: Any) -> bytes:
    """``value`` as ``torch.save`` writes it; a value it cannot write is refused by name."""
    stream = io.BytesIO()
    try:
        torch.save(value, stream)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise ValueError(f"extra: torch.save cannot write it ({error}); pass plain data (numbers, strings, "
                         "lists, dicts, tensors), e.g. a dict of the values you need to resume") from error
    return stream.getvalue()



def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class, as a checkpoint records it."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"



def _write(path: Path, tensors: dict[str, Any], training: bytes, layout: dict[str, Any], group: SaveGroup) -> None:
    """The checkpoint's files, from state already on the host, put in place at ``path``:
    every process of ``group`` writes its own chunks into one staging directory, and
    process 0 writes the rest and renames it into place."""
    group.on_every_process(lambda: check_replaceable(path))  # again: a background save runs later
    staging = Path(group.from_first(lambda: tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".saving",
                                                             dir=path.parent)))
    try:
        group.on_every_process(lambda: check_shared(staging))
        writer = StreamingFileWriter(staging)
        with dcp_call("xpipe.save", path):
            # Shards reach the host as their chunks are written, tensor after tensor.
            dcp.save(tensors, storage_writer=writer, planner=PieceSavePlanner(), no_dist=group.alone)
        hashes = group.on_every_process(lambda: {name: checksum(staging / name) for name in writer.files})
        files = {name: digest for written in hashes for name, digest in written.items()}
        # Process 0 finishes the checkpoint; every process hears whether it did.
        group.on_every_process(lambda: _finish(path, staging, tensors, training, layout, files)
                               if group.rank == 0 else None)
    finally:
        if group.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)



def _finish(path: Path, staging: Path, tensors: dict[str, Any], training: bytes, layout: dict[str, Any],
            files: dict[str, str]) -> None:
    """Process 0's part: ``training.pt`` and the manifest (``files``: the data files'
    hashes, from every process) beside DCP's files, then ``staging`` in place at ``path``."""
    (staging / TRAINING).write_bytes(training)
    files = {**files, **{name: checksum(staging / name) for name in os.listdir(staging) if name not in files}}
    manifest = {
        **layout,
        "dtypes": {f"{part}/{key}": str(value.dtype).removeprefix("torch.")
                   for part, key, value in _flat_tensors(tensors)},
        "shapes": {f"{part}/{key}": list(value.shape) for part, key, value in _flat_tensors(tensors)},
        "files": dict(sorted(files.items())),
    }
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for written in (staging / TRAINING, staging / MANIFEST, staging):  # DCP syncs its own files
        fsync(written)
    put_in_place(path, staging)



@functools.cache
def _background_writer() -> ThreadPoolExecutor:
    """The one thread that writes background saves, in the order they were asked for."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="xpipe-save")



def wait_for_background_saves() -> None:
    """Return once every background save asked for so far has finished."""
    if _background_writer.cache_info().currsize:
        _background_writer().submit(lambda: None).result()



@contextlib.contextmanager
def dcp_call(action: str, path: Path) -> Iterator[None]:
    """A call into DCP: without the warning it gives for every single-process save
    and load, and with its ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` lets through, listing ranks but no file) raised as a
    ``RuntimeError`` that names ``path`` and each process's first error; an interrupt
    (``KeyboardInterrupt``, ``SystemExit``) that DCP wrapped reaches the caller as itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # DCP's writer asks each shard's piece for its storage (to copy a view of a larger one).
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        try:
            yield
        except CheckpointException as error:
            for failure, _ in error.failures.values():
                if not isinstance(failure, Exception):  # an interrupt (KeyboardInterrupt, SystemExit) as itself
                    raise failure from None
            failures = "; ".join(f"process {rank}: {type(failure).__name__}: {failure}"
                                 for rank, (failure, _) in sorted(error.failures.items()))
            raise RuntimeError(f"{action}: DCP failed on the checkpoint {str(path)!r}: {failures}") from error



def _named_optimizer_state(model: CheckpointState, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The optimizer's per-parameter state under the wrapped module's names, and its
    param groups with parameters listed by name."""
    pending = []  # (parameter, state key, tensor on the device)
    groups = []
    for group in optimizer.param_groups:
        names = []
        for parameter in group["params"]:
            names += [name for name, _ in named_slices(model, parameter)]
            for key, value in optimizer.state.get(parameter, {}).items():
                if value is None:  # SGD without momentum keeps momentum_buffer=None
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"optimizer: state {key!r} is a {type(value).__name__}; xpipe.save writes "
                                     "optimizers whose per-parameter state is tensors (SGD, Adam, AdamW, ...)")
                pending.append((parameter, key, value))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    # States shaped like their parameter first: they set the order of the names, which the
    # model gives in the order a save reads them (a stacked tensor slot by slot).
    pending.sort(key=lambda entry: entry[2].shape != entry[0].shape)
    state: dict[str, dict[str, Pieces | torch.Tensor]] = {}
    shards = host_shards([value for _, _, value in pending])  # this host's, one replica each, read as written
    for (parameter, key, value), held in zip(pending, shards):
        shaped = value.shape == parameter.shape
        parts = model.named_pieces(parameter, value, held) if shaped else whole_pieces(model, parameter, value, held)
        for name, part in parts:
            state.setdefault(name, {})[key] = part
    return state, groups


def _rng_states(devices: list[torch.device]) -> dict[str, Any]:
    """torch's CPU generator (the spmd executor's dropout seeds) and each of ``devices``'."""
    return {"torch": torch.get_rng_state(), "xla": {str(d): xm.get_rng_state(torch.device(str(d))) for d in devices}}



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
