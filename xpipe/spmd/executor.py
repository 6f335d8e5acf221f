"""The SPMD executor: one XLA program per step over a ("data", "stage", "fsdp") mesh.

The repeated body's weights are stacked ``[S, V * K, ...]`` (``K`` blocks per
model stage, ``V`` model stages per stage group for a circular schedule) and
sharded on "stage" (and "fsdp"); the layers before and after the body run
data-parallel over the whole mesh. Where each tensor lives, and when it is
gathered, is :mod:`xpipe.spmd.placement`'s. The clock loop (GPipe's, or
circular's ``V`` rounds of it) is one ``torch_xla.experimental.scan`` (an XLA
while loop), so the program does not grow with the number of microbatches.

Inside the loop every operation is local to a device except the two shifts of
:mod:`xpipe.spmd.conveyor`. The stage weights enter the loop already gathered,
one copy per device (``[S * P, K, ...]``, ``P`` devices per stage), so their
gradients accumulate locally across clocks and are reduced over the stage's
devices once, after the loop, by the backward of that gathering.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map
from torch_xla.experimental.scan import scan

from xpipe._batch import check_outputs
from xpipe._batchnorm import RunningStatistics
from xpipe._xla import HostShards, host_shards, shard_buffers, to_host
from xpipe.chunks import Chunks, Piece, ShardSource, flat_boxes, from_shards
from xpipe.recompute import kept_cells, recompute
from xpipe.layout import spread, stored_shape
from xpipe.schedule import Schedule, circular, gpipe
from xpipe.spmd.conveyor import Layout, column_tables, from_slots, make_layout, make_tick, to_slots
from xpipe.spmd.dropout import cell_keys, hashed_dropout
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.placement import Placement
from xpipe.spmd.sides import Packing, packing_for
from xpipe.spmd.stacking import StackedModel
from xpipe.tensor_rules import Rules, tensor_dims

SCHEDULES = ("gpipe", "circular")  # the schedules whose clock loop this executor runs


class SpmdPipeline(nn.Module):
    """Runs a :class:`StackedModel` as a GPipe (or circular) pipeline under SPMD.

    Args:
        stacked: the model cut around its repeated body.
        mesh: a mesh with a "stage" axis, and "data" and "fsdp" (``xpipe.make_mesh``).
        chunks: microbatches per step.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        device: the SPMD XLA device.
        keys: the wrapped module's ``state_dict`` keys, in order, each with the keys
            that name the same tensor (tied weights).
        rounds: model stages per stage group: 1 for GPipe, ``V`` for the circular
            schedule (model stage ``j`` on stage ``j % S``).
    """

    def __init__(self, stacked: StackedModel, mesh: xs.Mesh, chunks: int, checkpoint: str,
                 device: torch.device, keys: dict[str, tuple[str, ...]], rounds: int = 1,
                 tensor_rules: Rules | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.placement = Placement(mesh)
        self.stages = self.placement.axes.stage
        self.replicas = self.placement.replicas  # P: row groups per stage (data x fsdp)
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.pre = stacked.pre
        self.post = stacked.post
        self.batch_norm = RunningStatistics([self.pre, self.post])  # PyTorch's running statistics, not XLA's
        self.placement.place_outer([self.pre, self.post])
        self.side_rows = stacked.side_rows  # per side input: travels with its microbatch, or held whole
        self.exported = stacked.exported
        self.block_count = len(stacked.blocks)
        self.rounds = rounds  # V: model stages per stage group, run round the ring (circular)
        self.per_stage = spread(self.block_count, self.stages * rounds)  # per model stage
        self.depth = max(self.per_stage)  # K: block slots per model stage
        self._template = [stacked.blocks[0]]  # kept out of the module tree: its weights are not ours
        self._block_parameters = [list(block.named_parameters()) for block in stacked.blocks]
        self._frozen = [[not p.requires_grad for _, p in named] for named in self._block_parameters]
        named = list(stacked.blocks[0].named_parameters())
        dims = tensor_dims([n for n, _ in named], [p.shape for _, p in named], self.placement.axes.tensor, tensor_rules)
        self.body = StackedWeights.from_blocks(stacked.blocks, self._slots(), rounds * self.depth, device,
                                               self.placement, dims)
        # What every step runs: chunks rounded up to fill every stage's slots (see make_layout).
        padded = make_layout(chunks, chunks, self.stages, 1).padded_chunks
        self.schedule = gpipe(self.stages, padded) if rounds == 1 else circular(self.stages, padded, rounds)
        self._sources, self._traced_name = _state_sources(stacked, keys)
        self._holders: dict[int, list[tuple[str, tuple | None]]] | None = None  # see _places_in
        self._ticks: dict[tuple, Callable] = {}

    def train(self, mode: bool = True) -> SpmdPipeline:
        """Also sets the mode of the block that the stacked weights run through."""
        super().train(mode)
        self._template[0].train(mode)
        return self

    def _slots(self) -> list[tuple[int, int]]:
        """The (stage, slot) of each block of the body, in order: model stage ``j``
        runs on stage ``j % S`` in round ``j // S``, whose blocks fill slots
        ``round * K`` to ``round * K + K - 1``."""
        return [(model_stage % self.stages, model_stage // self.stages * self.depth + slot)
                for model_stage, count in enumerate(self.per_stage) for slot in range(count)]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's positional inputs."""
        return tuple(node.name for node in self.pre.graph.nodes if node.op == "placeholder")

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
        ``self.parameters()``) holds, by name, each with its part of ``tensor``: a
        tensor shaped like ``parameter`` (its gradient, an optimizer's state for it).
        A stacked weight holds one parameter per unfrozen block; a tied one is named
        by its first name, as ``named_parameters()`` does."""
        return [(name, tensor if place is None else self.body.unstored(place[0], tensor[place[1]]))
                for name, place in self._places_in(parameter)]

    def named_chunks(self, parameter: torch.Tensor, tensor: torch.Tensor,
                     shards: HostShards) -> list[tuple[str, Chunks]]:
        """:meth:`named_slices` of ``tensor`` (shaped like ``parameter``) from the shards
        of it this host holds (:func:`xpipe._xla.host_shards`): each name's part as the
        pieces those shards cover, nothing put together; a stacked tensor's names
        slot by slot (see :meth:`state_chunks`)."""
        slots: dict[int, HostShards] = {}
        named = []
        for name, place in sorted(self._places_in(parameter), key=lambda pair: _slot_order(pair[1])):
            if place is None:
                named.append((name, from_shards(tensor.shape, tensor.dtype, shards)))
                continue
            index, (stage, slot) = place
            if slot not in slots:
                slots[slot] = shards.narrowed(1, slot)
            named.append((name, self.body.block_chunks(index, (stage, slot), slots[slot])))
        return named

    def state_chunks(self, keys: list[str]) -> dict[str, Chunks]:
        """``state_dict`` keys ``keys`` as the pieces this host holds of them, never put
        together. A stacked tensor reaches the host one slot at a time (that slot of
        every stage), cut into its blocks' boxes; the keys come grouped by the tensor
        and slot that hold them, so that DCP, which writes in this order, holds one
        slot of one tensor at a time."""
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
            chunks[key] = self.body.block_chunks(index, (stage, slot), by_slot[id(holder), slot])
        return chunks

    def load_chunks(self, keys: list[str]) -> tuple[dict[str, Chunks], Callable[[], None]]:
        """Where a load writes ``state_dict`` keys ``keys``: each key as the pieces of
        host buffers for the shards of the tensor that holds it on this host's devices
        (a tied tensor under its first key), and what hands the buffers to the devices,
        in place, once they are filled. No tensor is put together whole on the host."""
        holders: dict[int, torch.Tensor] = {}
        wanted = {}
        for key in keys:
            source = self._sources[key]
            if isinstance(source, tuple):
                holder, at, index = self.body.block_place(*source)
            else:
                holder, at, index = self.state_tensor(key), None, None
                if id(holder) in holders:
                    continue  # tied to an earlier key: the same tensor, the same values
            holders[id(holder)] = holder
            wanted[key] = (holder, at, index)
        buffers = dict(zip(holders, shard_buffers(list(holders.values()))))
        chunks = {key: from_shards(holder.shape, holder.dtype, buffers[id(holder)]) if at is None
                  else self.body.block_chunks(index, at, buffers[id(holder)])
                  for key, (holder, at, index) in wanted.items()}

        def hand_over() -> None:
            for identity, holder in holders.items():
                buffers[identity].load_into(holder)

        return chunks, hand_over

    def state_load_chunks(self, parameter: torch.Tensor, dtype: torch.dtype
                          ) -> tuple[list[tuple[str, Chunks]], Callable[[], torch.Tensor]]:
        """Where a load writes an optimizer state of ``parameter`` (shaped like it, of
        ``dtype``), by the names ``parameter`` holds (:meth:`named_slices`): each name's
        part as the pieces of buffers for ``parameter``'s shards on this host; and what
        makes the filled buffers a tensor on the devices, sharded as ``parameter``."""
        buffers = shard_buffers([parameter], [dtype])[0]
        named = []
        for name, place in self._places_in(parameter):
            if place is None:
                named.append((name, from_shards(parameter.shape, dtype, buffers)))
            else:
                index, at = place
                named.append((name, self.body.block_chunks(index, at, buffers)))
        return named, buffers.to_device

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

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None):
        """Run one step's forward; see :class:`xpipe.Pipe` for the contract."""
        self._check_flags_unchanged()
        if self.exported is not None:
            self.exported.check_mode(self.training)
            self.exported.check_inputs(inputs, microbatch_dim)
        device = self.body.weights[0].device
        microbatched = microbatch_dim is not None
        natural = tree_map(lambda x: x.to(device) if not microbatched else
                           x.to(device).movedim(microbatch_dim, 0).flatten(0, 1), inputs)
        layout = make_layout(tree_flatten(natural)[0][0].shape[0], self.chunks, self.stages, self.replicas)
        outer = self.placement.gathered_outer([self.pre, self.post])
        with ShardableOps(), self.batch_norm.updating():
            stream, *rest = _as_tuple(functional_call(self.pre, outer[self.pre], natural))
        sides, skips = rest[:len(self.side_rows)], rest[len(self.side_rows):]
        per_row = [side for side, rows in zip(sides, self.side_rows) if rows]
        constants = tuple(side for side, rows in zip(sides, self.side_rows) if not rows)
        packing = packing_for(stream, per_row)
        slots = to_slots(packing.pack([stream, *per_row]), layout, microbatched)
        # Features flattened: torch_xla shards tensors of at most 5 dims.
        slots = self.placement.shard_batch(slots.reshape(self.stages * self.replicas, layout.slots, layout.rows, -1))
        finished = self._run_clocks(slots, layout, packing, constants)
        finished = from_slots(packing.stream(finished.reshape(layout.padded_batch, -1)), layout, microbatched)
        with ShardableOps(), self.batch_norm.updating():
            output = functional_call(self.post, outer[self.post], (finished, *skips))
        if self.exported is not None:
            output = self.exported.folded(output)
        check_outputs(output, layout.batch)
        if not microbatched:
            return output
        return tree_map(lambda y: y.unflatten(0, (self.chunks, -1)).movedim(0, microbatch_dim), output)

    def _check_flags_unchanged(self) -> None:
        """``requires_grad`` of a block weight is read once, when the body is stacked."""
        for named, frozen in zip(self._block_parameters, self._frozen):
            for (name, parameter), was_frozen in zip(named, frozen):
                if parameter.requires_grad == was_frozen:
                    raise ValueError(
                        f"module: requires_grad of {name!r} changed after the Pipe was built; the spmd "
                        "executor stacks the blocks' weights when it is built. Set requires_grad before "
                        "wrapping the model (or build a new Pipe)")

    def _run_clocks(self, slots: torch.Tensor, layout: Layout, packing: Packing,
                    constants: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tables = column_tables(self.schedule, layout)
        reads, writes, from_ring = (torch.tensor(t, device=slots.device, dtype=slots.dtype)
                                    for t in (tables.reads, tables.writes, tables.from_ring))
        rounds = torch.nn.functional.one_hot(torch.tensor(tables.rounds), self.rounds)  # [T, S, V]
        rounds = rounds.repeat_interleave(self.replicas, 1).to(slots.device, slots.dtype)  # [T, S * P, V]
        clocks = torch.arange(len(reads), dtype=torch.int32, device=slots.device)
        keys = cell_keys(self._step_seed(slots.device), clocks, self.stages, self.replicas)
        state = self.placement.shard_batch(slots[:, 0].clone())  # idle cells run real rows (see conveyor)
        valid = self._valid_mask(slots)
        weights = tuple(self.placement.gathered_body(w, split=dim is not None)
                        for w, dim in zip(self.body.effective_weights(), self.body.dims))
        weights += tuple(self.placement.per_device(c) for c in constants)  # they ride along
        carry = (state, slots, valid, weights)
        plain_from = _first_kept_clock(self.schedule, self.checkpoint)
        ring = bool(tables.from_ring.any())
        for start, end, recomputed in ((0, plain_from, True), (plain_from, len(reads), False)):
            if end > start:
                columns = (reads[start:end], writes[start:end], from_ring[start:end], rounds[start:end],
                           keys[start:end])
                carry, _ = scan(self._tick(recomputed, packing, ring), carry, columns, is_fn_pure=True)
        return carry[1]

    def _step_seed(self, device: torch.device) -> torch.Tensor:
        """A seed for this step's dropout masks, from torch's default generator
        (``torch.manual_seed`` makes a run repeatable); data, so no recompile."""
        if not self.training:
            return torch.zeros((), dtype=torch.int32, device=device)
        return torch.randint(0, 2**31 - 1, (), dtype=torch.int32).to(device)

    def _tick(self, recomputed: bool, packing: Packing, ring: bool) -> Callable:
        """The loop body for one stream packing; kept, so that scan's trace cache finds it again."""
        modes = tuple(module.training for module in self._template[0].modules())  # dropout on or off
        key = (recomputed, packing, modes, ring)
        if key not in self._ticks:
            run = partial(self._run_stages, packing)
            stages = partial(self._recomputed_stages, run) if recomputed else run
            self._ticks[key] = make_tick(self.stages, self.replicas, stages, ring)
        return self._ticks[key]

    def _run_stages(self, packing: Packing, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                    state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """All stages on all data replicas at once: ``[S * D, rows, F] -> same``."""
        return torch.vmap(partial(self._run_one_stage, packing))(weights, valid, state, rounds, keys)

    @staticmethod
    def _recomputed_stages(run: Callable, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                           state: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return recompute(lambda v, s, r, k, *w: run(w, v, s, r, k), valid, state, rounds, keys, *weights)

    def _run_one_stage(self, packing: Packing, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                       x: torch.Tensor, round_: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """One stage's ``K`` block slots of its current round on one replica; empty
        slots pass the stream through.

        ``x`` is ``[rows, F]``: the stream and the per-row side inputs, packed;
        ``weights`` each block weight ``[V * K, numel]``, then the constant side inputs;
        ``valid`` ``[V * K]``; ``round_`` the one-hot round ``[V]``; ``key`` the int32
        key of the cell (see :mod:`xpipe.spmd.dropout`).
        """
        stream, *per_row = packing.unpack(x)
        per_row, constants = iter(per_row), iter(weights[len(self.body.names):])
        sides = [next(per_row) if rows else next(constants) for rows in self.side_rows]
        valid, *blocks = (self._of_round(w, round_) for w in (valid, *weights[:len(self.body.names)]))
        for slot in range(self.depth):
            params = {name: self.body.unstored(index, w[slot]) for index, (name, w) in
                      enumerate(zip(self.body.names, blocks))}
            with ShardableOps(), hashed_dropout(key, slot):
                y = functional_call(self._template[0], params, (stream, *sides))
            stream = torch.where(valid[slot] > 0, y, stream)
        return packing.with_stream(x, stream)

    def _of_round(self, slots: torch.Tensor, round_: torch.Tensor) -> torch.Tensor:
        """``[V * K, ...] -> [K, ...]``: the slots of the round ``round_`` (one-hot ``[V]``)
        names; by a product, not an index, so that every device's pick stays local."""
        if self.rounds == 1:
            return slots
        per_round = slots.unflatten(0, (self.rounds, self.depth))
        return (per_round * round_.view(-1, *[1] * (per_round.dim() - 1))).sum(0)

    def _valid_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[S * P, V * K]``: 1 where a stage's slot holds a block, 0 for padding slots."""
        mask = torch.zeros(self.stages, self.rounds * self.depth)
        for stage, slot in self._slots():
            mask[stage, slot] = 1
        return self.placement.gathered_body(mask.to(like.device, like.dtype))


class StackedWeights(nn.Module):
    """The body's parameters, one ``[S, K, numel]`` tensor per block parameter.

    Flattened because torch_xla shards tensors of at most 5 dims; ``shapes`` keeps
    each block parameter's own shape, ``dims`` the dim "tensor" splits (None: none),
    which is stored first (:func:`xpipe.layout.stored_shape`). A block parameter that some blocks freeze
    (``requires_grad=False``) and others train is held twice: the trainable
    blocks' values in the Parameter (zero where a block is frozen, so weight decay
    has nothing to shrink there) and the frozen blocks' values in a buffer; the
    loop reads each slot from the right one, so frozen blocks never change.
    """

    def __init__(self, names: list[str], shapes: list[torch.Size], slots: list[tuple[int, int]],
                 dims: list[int | None]) -> None:
        super().__init__()
        self.names = names
        self.shapes = shapes
        self.dims = dims
        self.slots = slots  # (stage, slot) of each block
        self.trainable: dict[str, torch.Tensor] = {}  # name -> [S, K, 1] bool on the device, mixed ones only
        self.frozen_slots: dict[str, set[tuple[int, int]]] = {}  # name -> (stage, slot)s it freezes

    @classmethod
    def from_blocks(cls, blocks: list[torch.fx.GraphModule], slots: list[tuple[int, int]], depth: int,
                    device: torch.device, placement: Placement, dims: list[int | None]) -> StackedWeights:
        """Stack ``blocks`` into ``[S, depth, numel]`` tensors, block ``i`` at ``slots[i]``;
        ``dims``: per block parameter, the dim "tensor" splits, or None."""
        named = [list(block.named_parameters()) for block in blocks]
        names = [name for name, _ in named[0]]
        module = cls(names, [p.shape for _, p in named[0]], slots, dims)
        stages = max(s for s, _ in slots) + 1
        for index, name in enumerate(names):
            values = [parameters[index][1] for parameters in named]
            grid = torch.zeros(stages, depth, values[0].numel(), dtype=values[0].dtype)
            trains = torch.zeros(stages, depth, 1, dtype=torch.bool)
            for (stage, slot), value in zip(slots, values):
                grid[stage, slot] = module.stored(index, value.detach())
                trains[stage, slot] = value.requires_grad
            module._register(name, grid, trains, [v.requires_grad for v in values], device, placement)
            module.frozen_slots[name] = {place for place, v in zip(slots, values) if not v.requires_grad}
        return module

    def _register(self, name: str, grid: torch.Tensor, trains: torch.Tensor, flags: list[bool],
                  device: torch.device, placement: Placement) -> None:
        attribute = _attribute(name)
        mixed = any(flags) and not all(flags)
        parameter = nn.Parameter((grid * trains if mixed else grid).to(device), requires_grad=any(flags))
        self.register_parameter(attribute, placement.place(parameter, placement.stacked_spec()))
        if mixed:
            frozen = (grid * ~trains).to(device)
            self.register_buffer(attribute + "__frozen", placement.place(frozen, placement.stacked_spec()))
            self.trainable[name] = trains.to(device)

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, _attribute(name)) for name in self.names]

    def effective_weights(self) -> list[torch.Tensor]:
        """The weights the blocks run with: each slot from its Parameter or, if frozen, its buffer."""
        return [torch.where(self.trainable[name], weight, getattr(self, _attribute(name) + "__frozen"))
                if name in self.trainable else weight for name, weight in zip(self.names, self.weights)]

    def stored(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """A value of block parameter ``index`` as it is stored: flat, its split dim first."""
        dim = self.dims[index]
        return (value if dim is None else value.movedim(dim, 0)).flatten()

    def unstored(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """``[numel] -> shape`` of block parameter ``index``: a view, so that writing into it writes the store."""
        dim, shape = self.dims[index], self.shapes[index]
        if dim is None:
            return flat.view(shape)
        return flat.view(stored_shape(tuple(shape), dim)).movedim(0, dim)

    def block_tensor(self, index: int, block: int) -> torch.Tensor:
        """Block ``block``'s value of parameter ``index``, a view of the tensor that holds it."""
        holder, place, index = self.block_place(index, block)
        return self.unstored(index, holder[place])

    def block_place(self, index: int, block: int) -> tuple[torch.Tensor, tuple[int, int], int]:
        """Where block ``block``'s value of parameter ``index`` lives: the tensor that
        holds it (the Parameter, or the frozen buffer), its (stage, slot), and ``index``."""
        name = self.names[index]
        stage, slot = self.slots[block]
        holder = self.weights[index]
        if name in self.trainable and (stage, slot) in self.frozen_slots[name]:
            holder = getattr(self, _attribute(name) + "__frozen")
        return holder, (stage, slot), index

    def block_chunks(self, index: int, at: tuple[int, int], shards: ShardSource) -> Chunks:
        """Block parameter ``index`` of slot ``at`` (stage, slot), in its own shape, as the
        pieces that ``shards`` of its stacked tensor (or of a tensor shaped like it) cover:
        each shard's flat range of the slot, as boxes of the stored shape, moved back to
        the parameter's dims."""
        shape, dim = tuple(self.shapes[index]), self.dims[index]
        stored = stored_shape(shape, dim) or (1,)  # a 0-dim parameter is stored as one element
        axes = tuple(range(len(shape))) if dim is None else (dim, *(d for d in range(len(shape)) if d != dim))
        pieces = []
        for shard, (stages, slots, flat) in enumerate(shards.places):
            if not (stages.start <= at[0] < stages.stop and slots.start <= at[1] < slots.stop):
                continue
            row = (at[0] - stages.start, at[1] - slots.start)
            for offsets, sizes, first in flat_boxes(stored, flat.start, flat.stop):
                placed = [0] * len(shape)
                for axis, offset in zip(axes, offsets):
                    placed[axis] = offset
                moved = [sizes[axes.index(axis)] for axis in range(len(shape))]
                cut = partial(_block_piece, row=row, start=first - flat.start, sizes=sizes, shape=shape,
                                        dim=dim)
                pieces.append(Piece(tuple(placed), tuple(moved), shards, shard, cut))
        return Chunks(torch.Size(shape), shards.dtype, pieces)

    def block_grad(self, index: int, block: int) -> torch.Tensor | None:
        """The gradient of block ``block``'s parameter ``index``; ``None`` if frozen or not computed."""
        stage, slot = self.slots[block]
        weight = self.weights[index]
        if (stage, slot) in self.frozen_slots[self.names[index]] or weight.grad is None:
            return None
        return self.unstored(index, weight.grad[stage, slot])


def _attribute(name: str) -> str:
    return name.replace(".", "__")


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


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _first_kept_clock(schedule: Schedule, checkpoint: str) -> int:
    """The forward clock from which every cell keeps its activations (the clock loop
    splits there: one scan that recomputes, one that keeps); the policy is
    :func:`xpipe.recompute.kept_cells`, whose kept cells form a suffix of clocks."""
    kept = kept_cells(schedule, checkpoint)
    rows = schedule.forward_clocks()
    return next((clock for clock, row in enumerate(rows)
                 if any(a is not None and (a.stage, a.microbatch) in kept for a in row)), len(rows))


def _slot_order(place: tuple[int, tuple[int, int]] | None) -> tuple[int, int]:
    """Where a block's name goes in a save: slot by slot, then stage by stage (each
    slot of a stacked tensor reaches the host on its own)."""
    return (-1, -1) if place is None else (place[1][1], place[1][0])


def _block_piece(values: torch.Tensor, *, row: tuple[int, int], start: int, sizes: tuple[int, ...],
                 shape: tuple[int, ...], dim: int | None) -> torch.Tensor:
    """The box of ``sizes`` that starts ``start`` elements into slot ``row`` of a stacked
    shard's ``values``, in the parameter's own dims (``shape``; stored with ``dim`` first)."""
    piece = values[row][start:start + math.prod(sizes)].view(sizes)
    if not shape:
        return piece.view(())
    return piece.movedim(0, dim) if dim not in (None, 0) else piece
