"""The SPMD executor: one XLA program per step over a ("data", "stage") mesh.

The repeated body's weights are stacked ``[S, K, ...]`` (``K`` blocks per stage)
and sharded on "stage"; the layers before and after the body run data-parallel
over the whole mesh. The GPipe clock loop is one ``torch_xla.experimental.scan``
(an XLA while loop), so the program does not grow with the number of microbatches.

Inside the loop every operation is local to a device except the two shifts of
:mod:`xpipe.spmd.conveyor`. The stage weights enter the loop already replicated
per data replica (``[S, D, K, ...]``, sharded on both axes), so their gradients
accumulate locally across clocks and are summed over "data" once, after the loop,
by the backward of that replication: one all-reduce per weight per step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torch_xla.experimental.scan import scan

from xpipe.checkpoint import recompute
from xpipe.schedule import gpipe
from xpipe.spmd.conveyor import Layout, column_tables, from_slots, make_layout, make_tick, to_slots
from xpipe.spmd.lowering import ShardableOps
from xpipe.spmd.stacking import StackedModel

BATCH_AXES = ("stage", "data")  # a batch dim sharded over the whole mesh, stage-major


class SpmdPipeline(nn.Module):
    """Runs a :class:`StackedModel` as a GPipe pipeline under SPMD.

    Args:
        stacked: the model cut around its repeated body.
        mesh: a ``("data", "stage")`` mesh (``xpipe.make_mesh``).
        chunks: microbatches per step.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        device: the SPMD XLA device.
    """

    def __init__(self, stacked: StackedModel, mesh: xs.Mesh, chunks: int, checkpoint: str,
                 device: torch.device) -> None:
        super().__init__()
        self.mesh = mesh
        self.stages = mesh.mesh_shape[1]
        self.data = mesh.mesh_shape[0]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.pre = stacked.pre
        self.post = stacked.post
        for tensor in [*self.pre.parameters(), *self.post.parameters()]:
            # Replicated from the start: an unannotated weight comes out of the first step
            # annotated "replicated", and the second step would compile anew.
            xs.mark_sharding(tensor, mesh, (None,) * tensor.dim())
        self.block_count = len(stacked.blocks)
        self.per_stage = spread(self.block_count, self.stages)
        self.depth = max(self.per_stage)  # K: block slots per stage
        self.block_names = [name for name, _ in stacked.blocks[0].named_parameters()]
        self._template = [stacked.blocks[0]]  # kept out of the module tree: its weights are not ours
        self.body = _stack_blocks(stacked.blocks, self.per_stage, self.depth, device, mesh)
        self._ticks: dict[tuple[bool, tuple[int, ...]], Callable] = {}

    def block_slot(self, block: int) -> tuple[int, int]:
        """The (stage, slot) that holds block ``block`` of the body."""
        for stage, count in enumerate(self.per_stage):
            if block < count:
                return stage, block
            block -= count
        raise IndexError(f"block: {block} is out of range")

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None):
        """Run one step's forward; see :class:`xpipe.Pipe` for the contract."""
        device = self.body.weights[0].device
        first = inputs[0] if microbatch_dim is None else inputs[0].movedim(microbatch_dim, 0).flatten(0, 1)
        layout = make_layout(first.shape[0], self.chunks, self.stages, self.data)
        flat = [self._shard_batch(to_slots(x.to(device), layout, microbatch_dim)) for x in inputs]
        with ShardableOps():
            stream, *skips = _as_tuple(self.pre(*flat))
        # Features flattened: torch_xla shards tensors of at most 5 dims.
        slots = self._shard_batch(stream.reshape(self.stages * self.data, layout.slots, layout.rows, -1))
        finished = self._run_clocks(slots, layout, tuple(stream.shape[1:]))
        with ShardableOps():
            output = self.post(finished.reshape(stream.shape), *skips)
        return tree_map(lambda y: from_slots(y, layout, microbatch_dim), output)

    def _run_clocks(self, slots: torch.Tensor, layout: Layout, features: tuple[int, ...]) -> torch.Tensor:
        inputs, outputs = (torch.tensor(t, device=slots.device) for t in column_tables(
            gpipe(self.stages, layout.padded_chunks), layout))
        state = self._shard_batch(slots.new_zeros(slots.shape[0], *slots.shape[2:]))
        finished = self._shard_batch(torch.zeros_like(slots))
        valid = self._shard_batch(self._valid_mask(slots))
        weights = tuple(self._shard_batch(self._per_replica(w)) for w in self.body.weights)
        carry = (state, slots, finished, valid, weights)
        # GPipe's "except_last": the clocks from the last microbatch's entry on keep their activations.
        plain_from = {"always": len(inputs), "never": 0, "except_last": layout.padded_chunks - 1}[self.checkpoint]
        for start, end, recomputed in ((0, plain_from, True), (plain_from, len(inputs), False)):
            if end > start:
                carry, _ = scan(self._tick(recomputed, features), carry, (inputs[start:end], outputs[start:end]),
                                is_fn_pure=True)
        return carry[2]

    def _tick(self, recomputed: bool, features: tuple[int, ...]) -> Callable:
        """The loop body for one feature shape; kept, so that scan's trace cache finds it again."""
        key = (recomputed, features)
        if key not in self._ticks:
            run = partial(self._run_stages, features)
            stages = partial(self._recomputed_stages, run) if recomputed else run
            self._ticks[key] = make_tick(self.stages, self.data, stages)
        return self._ticks[key]

    def _run_stages(self, features: tuple[int, ...], weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
        """All stages on all data replicas at once: ``[S * D, rows, F] -> same``."""
        return torch.vmap(partial(self._run_one_stage, features))(weights, valid, state)

    @staticmethod
    def _recomputed_stages(run: Callable, weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                           state: torch.Tensor) -> torch.Tensor:
        return recompute(lambda v, s, *w: run(w, v, s), valid, state, *weights)

    def _run_one_stage(self, features: tuple[int, ...], weights: tuple[torch.Tensor, ...], valid: torch.Tensor,
                       x: torch.Tensor) -> torch.Tensor:
        """One stage's ``K`` block slots on one replica; empty slots pass ``x`` through.

        ``x`` is ``[rows, F]`` (the features flattened), each weight ``[K, numel]``.
        """
        x = x.view(x.shape[0], *features)
        for slot in range(self.depth):
            params = {name: w[slot].view(shape)
                      for name, w, shape in zip(self.block_names, weights, self.body.shapes)}
            with ShardableOps():
                y = functional_call(self._template[0], params, (x,))
            x = torch.where(valid[slot] > 0, y, x)
        return x.flatten(1)

    def _valid_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[S * D, K]``: 1 where a stage's slot holds a block, 0 for padding slots."""
        mask = torch.tensor([[1.0 if k < n else 0.0 for k in range(self.depth)] for n in self.per_stage])
        return self._per_replica(mask.to(like.device, like.dtype))

    def _per_replica(self, per_stage: torch.Tensor) -> torch.Tensor:
        """``[S, ...] -> [S * D, ...]``: a copy for each data replica of each stage.

        Weights enter the clock loop this way so that their gradients add up on
        each device across clocks, and the sum over replicas (the backward of this
        copy) happens once, after the loop.
        """
        return per_stage.unsqueeze(1).expand(-1, self.data, *per_stage.shape[1:]).flatten(0, 1)

    def _shard_batch(self, x: torch.Tensor) -> torch.Tensor:
        """Shard dim 0 over the whole mesh, stage-major."""
        xs.mark_sharding(x, self.mesh, (BATCH_AXES, *([None] * (x.dim() - 1))))
        return x


class StackedWeights(nn.Module):
    """The body's parameters, one ``[S, K, numel]`` tensor per block parameter.

    Flattened because torch_xla shards tensors of at most 5 dims; ``shapes`` keeps
    each block parameter's own shape.
    """

    def __init__(self, names: list[str], shapes: list[torch.Size], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.names = names
        self.shapes = shapes
        for name, tensor in zip(names, tensors):
            self.register_parameter(_attribute(name), nn.Parameter(tensor))

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, _attribute(name)) for name in self.names]


def _attribute(name: str) -> str:
    return name.replace(".", "__")


def _stack_blocks(blocks: list[torch.fx.GraphModule], per_stage: tuple[int, ...], depth: int,
                  device: torch.device, mesh: xs.Mesh) -> StackedWeights:
    names = [name for name, _ in blocks[0].named_parameters()]
    per_block = [list(block.parameters()) for block in blocks]
    stacked = []
    for index in range(len(names)):
        like = per_block[0][index]
        grid = torch.zeros(len(per_stage), depth, like.numel(), dtype=like.dtype)
        block = 0
        for stage, count in enumerate(per_stage):
            for slot in range(count):
                grid[stage, slot] = per_block[block][index].detach().flatten()
                block += 1
        stacked.append(grid.to(device))
    module = StackedWeights(names, [p.shape for p in per_block[0]], stacked)
    for parameter, original in zip(module.weights, per_block[0]):
        parameter.requires_grad_(original.requires_grad)
        xs.mark_sharding(parameter, mesh, ("stage", None, None))
    return module


def spread(blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, as even as possible, extra blocks on the first stages."""
    return tuple(blocks // stages + (stage < blocks % stages) for stage in range(stages))


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)
