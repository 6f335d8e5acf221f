"""Where each ``state_dict`` key of the wrapped module lives in the spmd executor.

A block's weight is a slot of the stacked body (:class:`StackedWeights`): a view
of one ``[S, K, numel]`` tensor, sharded over "stage" (and "fsdp", "tensor"); the
layers before and after the body keep their own tensors. :class:`StateMap` turns
keys and parameter names into those places, for ``pipe.state_dict()``, its
gradients, and checkpoints: it is the spmd executor's
:class:`xpipe.checkpoints.state.CheckpointState`, reading and writing shard by
shard, never a sharded tensor put together on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from xpipe._xla import sharding_spec, to_host
from xpipe.capture.stacking import StackedModel
from xpipe.checkpoints.pieces import Pieces, from_shards
from xpipe.checkpoints.shards import HostShards, ShardBuffers, host_shards, shard_buffers
from xpipe.spmd.stacked_weights import StackedWeights


class StateMap:
    """The wrapped module's state keys and parameter names, in the stacked body and
    in the outer layers.

    Args:
        body: the stacked weights of the repeated blocks.
        stacked: the model cut around its body (the outer layers hold the other keys).
        keys: the wrapped module's ``state_dict`` keys, in order, each with the keys
            that name the same tensor (tied weights).
    """

    def __init__(self, body: StackedWeights, stacked: StackedModel, keys: dict[str, tuple[str, ...]]) -> None:
        self.body = body
        self._sources, self._traced_name = _state_sources(stacked, keys)
        self._holders: dict[int, list[tuple[str, tuple | None]]] | None = None  # see _places_in
        self.partly_loaded = False  # a load failed after it began to put tensors in place (model_destinations)

    def check_whole(self) -> None:
        """Raise if a load failed part-way (:attr:`partly_loaded`): the weights are a mix
        of two states, which no step or save may use."""
        if self.partly_loaded:
            raise RuntimeError("pipe: the last xpipe.load failed part-way, after it had put some of the "
                               "checkpoint's tensors in place, so the weights (and optimizer state) are a mix of "
                               "two states; load a checkpoint again (xpipe.load) before you run or save the Pipe")

    def state_tensor(self, key: str) -> torch.Tensor:
        """The tensor behind ``state_dict`` key ``key`` (a view into the stacked body for a block's weight)."""
        source = self._sources[key]
        if isinstance(source, tuple):
            return self.body.block_tensor(*source)
        owner, _, name = self._traced_name.get(key, key).rpartition(".")
        return getattr(source.get_submodule(owner), name)

    def host_state(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``state_dict`` keys ``keys`` as CPU copies; each stacked tensor is fetched
        once, from its shards, and cut on the host (see :func:`xpipe._xla.to_host`)."""
        places = {}
        for key in keys:
            source = self._sources[key]
            places[key] = self.body.block_place(*source) if isinstance(source, tuple) else None
        holders = {id(place[0]): place[0] for place in places.values() if place is not None}
        singles = [key for key, place in places.items() if place is None]
        fetched = iter(to_host(list(holders.values()) + [self.state_tensor(key) for key in singles]))
        stacked = {holder: next(fetched) for holder in holders}  # by id of the stacked tensor
        single = {key: next(fetched) for key in singles}
        return {key: single[key] if place is None else self.body.unstored(place[2], stacked[id(place[0])][place[1]])
                .clone() for key, place in places.items()}

    def named_slices(self, parameter: torch.Tensor, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The wrapped module's trainable parameters that ``parameter`` (one of
        the Pipe's ``parameters()``) holds, by name, each with its part of ``tensor``: a
        tensor shaped like ``parameter`` (its gradient, an optimizer's state for it).
        A stacked weight holds one parameter per unfrozen block; a tied one is named
        by its first name, as ``named_parameters()`` does."""
        return [(name, tensor if place is None else self.body.unstored(place[0], tensor[place[1]]))
                for name, place in self._places_in(parameter)]

    def named_pieces(self, parameter: torch.Tensor, tensor: torch.Tensor,
                     shards: HostShards) -> list[tuple[str, Pieces]]:
        """:meth:`named_slices` of ``tensor`` (shaped like ``parameter``) from the shards
        of it this host holds (:func:`xpipe.checkpoints.shards.host_shards`): each name's part as the
        pieces those shards cover, nothing put together; a stacked tensor's names
        slot by slot (see :meth:`state_pieces`)."""
        slots: dict[int, HostShards] = {}
        named = []
        for name, place in sorted(self._places_in(parameter), key=lambda pair: _slot_order(pair[1])):
            if place is None:
                named.append((name, from_shards(tensor.shape, tensor.dtype, shards)))
                continue
            index, (stage, slot) = place
            if slot not in slots:
                slots[slot] = shards.narrowed(1, slot)
            named.append((name, self.body.block_pieces(index, (stage, slot), slots[slot])))
        return named

    def state_pieces(self) -> dict[str, Pieces]:
        """Every ``state_dict`` key as the pieces this host holds of them, never put
        together. A stacked tensor reaches the host one slot at a time (that slot of
        every stage), cut into its blocks' boxes; the keys come grouped by the tensor
        and slot that hold them, so that DCP, which writes in this order, holds one
        slot of one tensor at a time."""
        self.check_whole()
        keys = list(self._sources)
        places = {key: self.body.block_place(*self._sources[key]) if isinstance(self._sources[key], tuple) else None
                  for key in keys}
        holders = {id(place[0]): place[0] for place in places.values() if place is not None}
        singles = {key: self.state_tensor(key) for key, place in places.items() if place is None}
        held = iter(host_shards([*holders.values(), *singles.values()]))
        stacked = {holder: next(held) for holder in holders}
        single = {key: from_shards(value.shape, value.dtype, next(held)) for key, value in singles.items()}
        by_slot = {(holder, slot): shards.narrowed(1, slot) for holder, shards in stacked.items()
                   for slot in {place[1][1] for place in places.values() if place is not None}}
        rank = {holder: position for position, holder in enumerate(holders)}

        def order(key: str) -> tuple[int, ...]:
            place = places[key]
            return (-1,) if place is None else (rank[id(place[0])], *_slot_order((place[2], place[1])))

        chunks = {}
        for key in sorted(keys, key=order):
            if places[key] is None:
                chunks[key] = single[key]
                continue
            holder, (stage, slot), index = places[key]
            chunks[key] = self.body.block_pieces(index, (stage, slot), by_slot[id(holder), slot])
        return chunks

    def model_destinations(self) -> tuple[dict[str, Pieces], Callable[[], None]]:
        """Where a load writes every ``state_dict`` key: each key as the pieces of
        host buffers for the shards of the tensor that holds it on this host's devices
        (a tied tensor under its first key), grouped by that tensor, so that DCP, which
        reads in this order, fills one tensor's buffers at a time. Each tensor is put
        in place, on its devices, as soon as its buffers are filled, and the buffers
        let go; the model is :attr:`partly_loaded` from then until what this returns
        last is called, once every key is read. No tensor is put together whole on
        the host."""
        holders: dict[int, torch.Tensor] = {}
        wanted: dict[int, list[tuple[str, tuple[int, int] | None, int | None]]] = {}
        for key in self._sources:
            source = self._sources[key]
            if isinstance(source, tuple):
                holder, at, index = self.body.block_place(*source)
            else:
                holder, at, index = self.state_tensor(key), None, None
                if id(holder) in holders:
                    continue  # tied to an earlier key: the same tensor, the same values
            holders[id(holder)] = holder
            wanted.setdefault(id(holder), []).append((key, at, index))
        chunks = {}
        for (identity, holder), buffers in zip(holders.items(), shard_buffers(list(holders.values()))):
            buffers.when_filled(partial(self._put_in_place, holder))
            for key, at, index in wanted[identity]:
                chunks[key] = (from_shards(holder.shape, holder.dtype, buffers) if at is None
                               else self.body.block_pieces(index, at, buffers))

        def every_key_read() -> None:
            self.partly_loaded = False

        return chunks, every_key_read

    def state_destinations(self, parameter: torch.Tensor, dtype: torch.dtype, into: torch.Tensor | None = None
                           ) -> tuple[list[tuple[str, Pieces]], Callable[[], torch.Tensor]]:
        """Where a load writes an optimizer state of ``parameter`` (shaped like it, of
        ``dtype``), by the names ``parameter`` holds (:meth:`named_slices`): each name's
        part as the pieces of buffers for ``parameter``'s shards on this host; and what
        gives the loaded state on the devices, sharded as ``parameter``. As soon as the
        buffers are filled they are written into ``into`` (the optimizer's own state,
        in place, where it is of that shape, dtype and sharding) or made a new tensor,
        and let go."""
        buffers = shard_buffers([parameter], [dtype])[0]
        named = []
        for name, place in self._places_in(parameter):
            if place is None:
                named.append((name, from_shards(parameter.shape, dtype, buffers)))
            else:
                index, at = place
                named.append((name, self.body.block_pieces(index, at, buffers)))
        if (into is not None and into.shape == parameter.shape and into.dtype == dtype
                and sharding_spec(into) == sharding_spec(parameter)):
            buffers.when_filled(partial(self._put_in_place, into))
            return named, lambda: into
        made = []

        def make_tensor(filled: ShardBuffers) -> bool:
            made.append(filled.to_device())
            return False  # a new tensor: nothing the Pipe holds has changed yet

        buffers.when_filled(make_tensor)
        return named, lambda: made[0]

    def _put_in_place(self, tensor: torch.Tensor, buffers: ShardBuffers) -> bool:
        """Write a load's filled ``buffers`` into ``tensor``, which they were made for."""
        self.partly_loaded = True
        buffers.load_into(tensor)
        return True

    def _places_in(self, parameter: torch.Tensor) -> list[tuple[str, tuple[int, tuple[int, int]] | None]]:
        """The names ``parameter`` holds, each with where: (block parameter index,
        (stage, slot)) in a stacked weight, or None for the whole of it."""
        if self._holders is None:
            self._holders = {}
            for key, source in self._sources.items():
                if isinstance(source, tuple):
                    index, block = source
                    stage, slot = self.body.slots[block]
                    if (stage, slot) not in self.body.frozen_slots[self.body.names[index]]:
                        self._holders.setdefault(id(self.body.weights[index]), []).append((key, (index, (stage, slot))))
                elif isinstance(holder := self.state_tensor(key), nn.Parameter) and id(holder) not in self._holders:
                    self._holders[id(holder)] = [(key, None)]  # a tied weight by its first name
        return self._holders.get(id(parameter), [])

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names; ``None`` for frozen weights."""
        grads: dict[str, torch.Tensor | None] = {}
        for key, source in self._sources.items():
            if isinstance(source, tuple):
                grads[key] = self.body.block_grad(*source)
            elif isinstance(tensor := self.state_tensor(key), nn.Parameter):
                grads[key] = tensor.grad
        return grads


def _state_sources(stacked: StackedModel, keys: dict[str, tuple[str, ...]]
                   ) -> tuple[dict[str, nn.Module | tuple[int, int]], dict[str, str]]:
    """Where each state_dict key lives: in ``pre`` or ``post``, or (parameter index,
    block); and, for a key tied to another that the trace reads instead, that name."""
    found: dict[str, nn.Module | tuple[int, int]] = {}
    for block, module in enumerate(stacked.blocks):
        for index, (name, _) in enumerate(module.named_parameters()):
            found[name] = (index, block)
    for module in (stacked.pre, stacked.post):
        for name in module.state_dict(keep_vars=True):
            found.setdefault(name, module)
    sources: dict[str, nn.Module | tuple[int, int]] = {}
    traced_name: dict[str, str] = {}
    for key, tied in keys.items():
        name = next((name for name in (key, *tied) if name in found), None)
        if name is not None:
            sources[key] = found[name]
            if name != key:
                traced_name[key] = name
    unused = [key for key in keys if key not in sources]
    if unused:
        raise ValueError(f"module: {unused} are never used by forward; remove them before pipelining")
    return sources, traced_name



def _slot_order(place: tuple[int, tuple[int, int]] | None) -> tuple[int, int]:
    """Where a block's name goes in a save: slot by slot, then stage by stage (each
    slot of a stacked tensor reaches the host on its own)."""
    return (-1, -1) if place is None else (place[1][1], place[1][0])
