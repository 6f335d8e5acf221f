"""What a checkpoint reads from, and writes into, the model it saves or loads.

:class:`CheckpointState` is the one way from ``xpipe.save`` / ``xpipe.load`` into an
executor: the model's state as this host holds it, the names under which an
optimizer's per-parameter state is written, and where a load puts what it reads.
The spmd executor implements it over its stacked body
(:class:`xpipe.spmd.state_map.StateMap`: shard by shard, never a tensor put
together); :class:`WholeState` implements it for the devices executor and for a
plain ``nn.Module`` (whole CPU tensors, loaded with ``load_state_dict``).

A :class:`Checkpointable` model (an :class:`xpipe.Pipe`) gives its state, the
layout a manifest records and the devices whose random-number streams a
checkpoint keeps; any other module is its own :class:`WholeState`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from xpipe._xla import to_host
from xpipe.checkpoints.pieces import Pieces
from xpipe.checkpoints.shards import HostShards

Named = list[tuple[str, torch.Tensor]]
NamedPieces = list[tuple[str, Pieces | torch.Tensor]]

PLAIN_LAYOUT = {"executor": "plain", "stages": 1, "balance": None, "mesh": None}


class CheckpointState(Protocol):
    """A model's state as a checkpoint writes and reads it, under the wrapped module's
    own ``state_dict`` keys and parameter names, whatever the layout."""

    def state_pieces(self) -> dict[str, Pieces | torch.Tensor]:
        """Every ``state_dict`` key, as what this host holds of it: pieces of its shards
        (read only when written), or a CPU tensor."""

    def named_slices(self, parameter: torch.Tensor, tensor: torch.Tensor) -> Named:
        """The wrapped module's trainable parameters that ``parameter`` (one of the
        model's ``parameters()``) holds, by name, each with its part of ``tensor``
        (shaped like ``parameter``: its gradient, or an optimizer's state for it)."""

    def named_pieces(self, parameter: torch.Tensor, value: torch.Tensor, shards: HostShards) -> NamedPieces:
        """:meth:`named_slices` of ``value`` (an optimizer state shaped like
        ``parameter``), from ``shards``, the shards of ``value`` this host holds; a
        sharded one as the pieces those shards cover, nothing put together."""

    def model_destinations(self) -> tuple[dict[str, Pieces | torch.Tensor], Callable[[], None]]:
        """Where a load writes each ``state_dict`` key, and what is called once every
        key is read: it puts the written state in place, where the destinations did
        not as they were filled (:class:`xpipe.checkpoints.pieces.PieceLoadPlanner`)."""

    def state_destinations(self, parameter: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None
                           ) -> tuple[NamedPieces, Callable[[], torch.Tensor]]:
        """Where a load writes an optimizer state of ``parameter`` (shaped like it, of
        ``dtype``), by the names ``parameter`` holds; and what gives the loaded state as
        one tensor shaped (and, on devices, sharded) like ``parameter``: ``into`` (the
        optimizer's own state for it) loaded in place, where the executor can."""


@runtime_checkable
class Checkpointable(Protocol):
    """A model that tells checkpoints how it is laid out: :class:`xpipe.Pipe`."""

    devices: list[torch.device]

    def checkpoint_state(self) -> CheckpointState:
        """Its state, as checkpoints read and write it."""

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint's manifest records: executor, stages, balance, mesh."""


def state_of(module: nn.Module) -> tuple[CheckpointState, list[torch.device], dict[str, Any]]:
    """``module``'s checkpoint state, the XLA devices whose random-number streams a
    checkpoint keeps, and the layout its manifest records."""
    if isinstance(module, Checkpointable):
        return module.checkpoint_state(), list(module.devices), module.checkpoint_layout()
    return WholeState(module), [], dict(PLAIN_LAYOUT)


def named_slices(state: CheckpointState, parameter: torch.Tensor, tensor: torch.Tensor | None = None) -> Named:
    """:meth:`CheckpointState.named_slices`, with a state not shaped like ``parameter``
    (Adam's ``step``) every name's whole, and ``parameter`` itself by default.

    Raises:
        ValueError: naming ``optimizer`` if ``parameter`` is none of the model's.
    """
    tensor = parameter if tensor is None else tensor
    slices = state.named_slices(parameter, tensor if tensor.shape == parameter.shape else parameter)
    if not slices:
        raise ValueError("optimizer: it steps a tensor that is not one of pipe.parameters(); build it on "
                         "pipe.parameters() after wrapping the model")
    if tensor.shape != parameter.shape:
        return [(name, tensor) for name, _ in slices]
    return slices


def whole_pieces(state: CheckpointState, parameter: torch.Tensor, value: torch.Tensor, shards: HostShards) -> Named:
    """:func:`named_slices` of ``value`` (an optimizer state of ``parameter``) as CPU
    tensors: read from ``shards`` where this host holds it whole, else fetched. For a
    state not shaped like its parameter (Adam's ``step``) under any executor."""
    held_whole = len(shards.places) == 1 and tuple(part.stop for part in shards.places[0]) == tuple(value.shape)
    host = shards.read(0) if held_whole else to_host([value])[0]
    return [(name, part.clone()) for name, part in named_slices(state, parameter, host)]


class WholeState:
    """A model whose state a checkpoint reads and writes as whole CPU tensors: a plain
    ``module``, or the module a devices-executor Pipe wraps (whose stages hold its own
    tensors), loaded with its ``load_state_dict``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def state_pieces(self) -> dict[str, torch.Tensor]:
        state = self.module.state_dict()
        return dict(zip(state, to_host(list(state.values()))))

    def named_slices(self, parameter: torch.Tensor, tensor: torch.Tensor) -> Named:
        """The one name of ``parameter`` (its first, if tied), with ``tensor``."""
        return [(name, tensor) for name, p in self.module.named_parameters() if p is parameter][:1]

    def named_pieces(self, parameter: torch.Tensor, value: torch.Tensor, shards: HostShards) -> Named:
        return whole_pieces(self, parameter, value, shards)

    def model_destinations(self) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        state = {key: torch.empty(value.shape, dtype=value.dtype) for key, value in self.module.state_dict().items()}
        return state, lambda: self.module.load_state_dict(state)

    def state_destinations(self, parameter: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None
                           ) -> tuple[Named, Callable[[], torch.Tensor]]:
        """A whole CPU tensor (``into`` is left alone: ``load_state_dict`` puts it in place)."""
        whole = torch.zeros(parameter.shape, dtype=dtype)
        return named_slices(self, parameter, whole), lambda: whole
