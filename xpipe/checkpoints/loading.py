"""``xpipe.load``: a checkpoint read back into a model of any layout.

A load checks the files' hashes (:mod:`xpipe.checkpoints.files`), the keys, the
shapes and the optimizer's kind and state before it changes anything, then lets
DCP read into the model's own destinations (:mod:`xpipe.checkpoints.state`):
under spmd host buffers for each device's shards, filled from the saved pieces
that overlap them, whatever layout they were saved from; otherwise whole CPU
tensors. The model's state is put in place last, once nothing can refuse.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch_xla.core.xla_model as xm
from torch import nn

from xpipe.checkpoints.files import TRAINING, checked_manifest, readable_checkpoint
from xpipe.checkpoints.group import SaveGroup
from xpipe.checkpoints.pieces import PieceLoadPlanner, Pieces
from xpipe.checkpoints.saving import dcp_call, optimizer_kind, run_pending, wait_for_background_saves
from xpipe.checkpoints.shards import shard_like
from xpipe.checkpoints.state import CheckpointState, named_slices, state_of


PARTLY_LOADED = ("xpipe.load had already put {done} of the {of} tensors it reads from {path!r} in place (it hands "
                 "each to the devices as soon as it is read, so that the host holds one tensor at a time, not the "
                 "checkpoint): the model and optimizer now hold part of this checkpoint, and the Pipe refuses to "
                 "run until a load succeeds; load a checkpoint again")


def load(path: str | os.PathLike, pipe: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> tuple[int | None, Any]:
    """Load a checkpoint written by :func:`save` into ``pipe`` (and ``optimizer``),
    whatever layout it was saved from, and restore the random-number states.

    Returns:
        ``(step, extra)`` as they were given to :func:`save`.

    Everything that can refuse the checkpoint is checked before anything changes:
    its files' checksums, keys, shapes, and the optimizer's kind, groups and state.
    Then each tensor is put in place on its devices as soon as DCP has read it (under
    spmd; otherwise whole CPU tensors are loaded once all are read), so that a load
    holds about one tensor's buffers on the host, not the whole checkpoint.

    Raises:
        ValueError: a checkpoint that is incomplete, corrupted, from another model
            (missing or unexpected keys, other shapes) or without optimizer state
            when ``optimizer`` is given; nothing is changed then.
        RuntimeError: a read that failed after the checks (a file removed or changed
            during the load, a disk error). If tensors had been put in place by then,
            the message says so, and the Pipe refuses to run until a load succeeds.
    """
    path = Path(path)
    group = SaveGroup.of_process_group()
    group.joined("xpipe.load", path)
    wait_for_background_saves()
    path = readable_checkpoint(path)
    run_pending(pipe)
    manifest = checked_manifest(path)
    _check_matches(path, manifest, pipe.state_dict(), optimizer)
    training = torch.load(path / TRAINING, weights_only=False)
    model, devices, _ = state_of(pipe)
    tensors: dict[str, Any] = {}
    tensors["model"], every_key_read = model.model_destinations()
    if optimizer is not None:
        tensors["optimizer"], optimizer_state = _optimizer_destinations(model, optimizer, manifest,
                                                                         training["param_groups"], path)
    planner = PieceLoadPlanner()
    try:
        with dcp_call("xpipe.load", path):
            dcp.load(tensors, checkpoint_id=path, planner=planner, no_dist=group.alone)
        if optimizer is not None:
            _load_optimizer(optimizer, optimizer_state(), path)
    except Exception as error:
        if planner.put_in_place:
            partly = PARTLY_LOADED.format(path=str(path), done=planner.put_in_place, of=planner.destinations)
            raise RuntimeError(f"{error}\n{partly}") from error
        raise
    every_key_read()
    _restore_rng(devices, training["rng"])
    return training["step"], training["extra"]


def load_plain(path: str | os.PathLike, module: nn.Module,
               optimizer: torch.optim.Optimizer | None = None) -> tuple[int | None, Any]:
    """Load a checkpoint into the plain (unpipelined) ``module`` and its optimizer:
    :func:`load` for any ``nn.Module``, whose parameters are named as the Pipe's were."""
    return load(path, module, optimizer)


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
    if optimizer is not None and saved_kind is not None and saved_kind != optimizer_kind(optimizer):
        raise ValueError(f"optimizer: the checkpoint {str(path)!r} holds the state of a {saved_kind}, and this "
                         f"optimizer is a {optimizer_kind(optimizer)}; build the optimizer the checkpoint was saved "
                         "with, or load with optimizer=None (the weights only) and start the optimizer afresh")


def _optimizer_destinations(model: CheckpointState, optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                            named_groups: list[dict], path: Path
                            ) -> tuple[dict[str, dict[str, Pieces | torch.Tensor]], Callable[[], dict[str, Any]]]:
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
    destinations: dict[str, dict[str, Pieces | torch.Tensor]] = {}
    made: dict[int, dict[str, Callable[[], torch.Tensor]]] = {}
    groups = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, named_groups):
        positions = []
        for parameter in group["params"]:
            parts = dict(named_slices(model, parameter))
            absent = [name for name in parts if name not in saved_group["params"]]
            if absent:
                raise ValueError(f"optimizer: {absent[:3]} are not in the checkpoint's param group; build the "
                                 "optimizer with the same parameters in the same groups")
            present = {name: saved[name] for name in parts if name in saved}
            if present:
                kept = optimizer.state.get(parameter, {})
                made[index] = _state_destinations(model, parameter, parts, present, kept, destinations)
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": positions})
    _check_optimizer_takes(optimizer, groups, {position: list(keys) for position, keys in made.items()}, path)

    def state() -> dict[str, Any]:
        return {"state": {position: {key: make() for key, make in keys.items()} for position, keys in made.items()},
                "param_groups": groups}

    return destinations, state


def _state_destinations(model: CheckpointState, parameter: torch.Tensor, parts: dict[str, torch.Tensor],
                        saved: dict[str, dict[str, tuple[list[int], torch.dtype]]], kept: dict[str, Any],
                        destinations: dict[str, dict[str, Pieces | torch.Tensor]]
                        ) -> dict[str, Callable[[], torch.Tensor]]:
    """The destinations of one parameter's saved optimizer state (``saved``: by name, each
    state's shape and dtype), added to ``destinations``; returns, per state key, what
    gives the loaded tensor. A state shaped like each name's part of ``parameter`` goes
    into that part (into the optimizer's own state tensor ``kept[key]``, in place, where
    the executor can); any other (Adam's ``step``, a scalar) is the same for every name
    and read once."""
    first = next(iter(saved))
    made = {}
    for key, (shape, dtype) in saved[first].items():
        if all(key in states and states[key][0] == list(parts[name].shape) for name, states in saved.items()):
            own = kept.get(key)
            named, made[key] = model.state_destinations(parameter, dtype,
                                                        own if isinstance(own, torch.Tensor) else None)
            for name, destination in named:
                if name in saved:
                    destinations.setdefault(name, {})[key] = destination
        else:
            value = torch.empty(shape, dtype=dtype)
            destinations.setdefault(first, {})[key] = value
            made[key] = _returning(value)
    return made


def _returning(value: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: value


def _check_optimizer_takes(optimizer: torch.optim.Optimizer, groups: list[dict],
                           keys: dict[int, list[str]], path: Path) -> None:
    """Raise, changing nothing, unless ``optimizer`` takes the checkpoint's param
    ``groups`` and per-parameter state ``keys`` (by position): a state of another kind
    of optimizer, in a checkpoint that does not record its kind. The check is a load
    of that state made of scalars, undone."""
    kept = next((sorted(value) for value in optimizer.state.values()), None)  # one parameter's state keys
    loaded = next((sorted(value) for value in keys.values()), None)
    if kept and loaded and kept != loaded:
        raise ValueError(f"optimizer: the checkpoint {str(path)!r} holds optimizer state {loaded}, and this "
                         f"optimizer keeps {kept}; build the optimizer the checkpoint was saved with, or load with "
                         "optimizer=None")
    scalars = {position: {key: torch.zeros(()) for key in names} for position, names in keys.items()}
    before = optimizer.state, optimizer.param_groups
    _load_state_dict_or_restore(optimizer, {"state": scalars, "param_groups": groups}, path)
    optimizer.state, optimizer.param_groups = before


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: Path) -> None:
    """``optimizer.load_state_dict(state)`` (its groups and state keys checked before
    the read, by :func:`_check_optimizer_takes`), each state that was loaded whole onto
    the device then sharded as its parameter."""
    _load_state_dict_or_restore(optimizer, state, path)
    shard_like([(value, parameter) for group in optimizer.param_groups for parameter in group["params"]
                for value in optimizer.state.get(parameter, {}).values() if isinstance(value, torch.Tensor)])


def _load_state_dict_or_restore(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: Path) -> None:
    """``optimizer.load_state_dict(state)``; if torch refuses it, the optimizer as it was
    and a ``ValueError`` that says what to do."""
    before = optimizer.state, optimizer.param_groups  # load_state_dict puts new objects in their place
    try:
        optimizer.load_state_dict(state)
    except Exception as error:
        optimizer.state, optimizer.param_groups = before
        raise ValueError(f"optimizer: the state in {str(path)!r} does not load into this "
                         f"{type(optimizer).__name__} ({type(error).__name__}: {error}); build the optimizer the "
                         "checkpoint was saved with, or load with optimizer=None") from error


def _restore_rng(devices: list[torch.device], states: dict[str, Any]) -> None:
    """torch's CPU generator, and the streams of those of ``devices`` the checkpoint has."""
    torch.set_rng_state(states["torch"])
    devices = {str(d) for d in devices}
    for device, seed in states["xla"].items():
        if device in devices:  # another layout's devices: their streams do not carry over
            xm.set_rng_state(seed, torch.device(device))
