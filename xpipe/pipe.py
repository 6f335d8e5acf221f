"""``xpipe.Pipe``: wrap a model, keep the training loop.

    mesh = xpipe.make_mesh(stages=4)                  # 8 devices: 2 (data) x 4 (stage)
    pipe = xpipe.Pipe(model, chunks=8, mesh=mesh)
    optimizer = torch.optim.AdamW(pipe.parameters())
    for tokens, targets in batches:
        loss = F.cross_entropy(pipe(tokens).flatten(0, 1), targets.flatten().to(device))
        loss.backward(); optimizer.step(); optimizer.zero_grad(); torch_xla.sync()
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

from xpipe._checks import check_positive_int
from xpipe.checkpoint import check_mode
from xpipe.mesh import make_mesh, spmd_device
from xpipe.partition import Partition, partition
from xpipe.schedule import Schedule, by_name
from xpipe.spmd.executor import SpmdPipeline, spread
from xpipe.spmd.stacking import StackedModel, cut_for_stacking

EXECUTORS = ("auto", "spmd", "devices")


class Pipe(nn.Module):
    """A model run as a GPipe pipeline on XLA devices.

    Args:
        module: the model. Pipe takes it over: its layers move to the XLA device.
        chunks: microbatches per step; the batch is split into this many.
        stages: pipeline stages; defaults to the mesh's "stage" size, or
            ``len(balance)``, or the device count.
        balance: layers per stage, as ``xpipe.partition`` takes it. The spmd
            executor spreads the repeated blocks evenly over the stages, so a
            balance other than that split is an error there.
        mesh: a ``("data", "stage")`` mesh; defaults to ``xpipe.make_mesh(stages)``.
        schedule: the schedule's name (``"gpipe"``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which
            microbatches recompute their stage activations in the backward pass.
        executor: ``"spmd"``, ``"devices"`` or ``"auto"`` (spmd where the model
            has a stackable run of identical blocks).

    Attributes:
        partition: the :class:`xpipe.Partition` in use.
        schedule: the :class:`xpipe.schedule.Schedule` of one step.

    Calling ``pipe(x)`` with ``x`` batch-first (a tensor, or a tuple of tensors)
    returns what ``module(x)`` returns, batch-first; ``pipe(x, microbatch_dim=d)``
    takes ``x`` with a dim ``d`` of size ``chunks`` and keeps that layout.
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        *,
        stages: int | None = None,
        balance: Sequence[int] | None = None,
        mesh: xs.Mesh | None = None,
        schedule: str = "gpipe",
        checkpoint: str = "except_last",
        executor: str = "auto",
    ) -> None:
        super().__init__()
        check_positive_int(chunks, "chunks")
        self.checkpoint = check_mode(checkpoint)
        if executor not in EXECUTORS:
            raise ValueError(f"executor: {executor!r} is not an executor; use one of {', '.join(EXECUTORS)}")
        if executor == "devices":
            raise ValueError("executor: the 'devices' executor (one XLA device per stage) is not built yet; "
                             "use executor='spmd' with a model that has a run of identical blocks")
        device = spmd_device()
        self.mesh = _resolve_mesh(mesh, stages, balance)
        stages = self.mesh.mesh_shape[1]
        self.chunks = chunks
        self.schedule: Schedule = by_name(schedule, stages, chunks)
        plan = partition(module, stages)
        stacked = cut_for_stacking(module, plan)
        self.partition: Partition = _spmd_partition(module, plan, spread(len(stacked.blocks), stages), balance)
        self.executor = "spmd"
        self._original_keys = list(module.state_dict(keep_vars=True))
        self._state_sources = _state_sources(stacked, self._original_keys)
        _move_keeping_ties([stacked.pre, stacked.post], device)
        self.runner = SpmdPipeline(stacked, self.mesh, chunks, checkpoint, device)

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None):
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
            raise TypeError(f"x: expected a tensor or a tuple of tensors, got {[type(x).__name__ for x in inputs]}")
        if microbatch_dim is not None:
            for x in inputs:
                if not -x.dim() <= microbatch_dim < x.dim() or x.shape[microbatch_dim] != self.chunks:
                    raise ValueError(f"microbatch_dim: input of shape {list(x.shape)} has no dim {microbatch_dim} "
                                     f"of size chunks={self.chunks}; pass the dim that holds the microbatches")
            microbatch_dim %= inputs[0].dim()
        return self.runner(*inputs, microbatch_dim=microbatch_dim)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state: exactly its keys and shapes, the body unstacked."""
        state = OrderedDict() if destination is None else destination
        for key in self._original_keys:
            tensor = self._state_tensor(key)
            state[prefix + key] = tensor if keep_vars else tensor.detach()
        return state

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load a state dict of the wrapped module (as ``module.state_dict()`` gives)."""
        missing = [k for k in self._original_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_sources]
        if strict and (missing or unexpected):
            raise RuntimeError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        with torch.no_grad():
            for key, value in state_dict.items():
                if key in self._state_sources:
                    target = self._state_tensor(key)
                    if target.shape != value.shape:
                        raise RuntimeError(f"state_dict: {key!r} has shape {list(value.shape)}, "
                                           f"expected {list(target.shape)}")
                    target.copy_(value.to(target.device))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names, the body unstacked."""
        grads: dict[str, torch.Tensor | None] = {}
        for key, source in self._state_sources.items():
            if isinstance(source, tuple):
                stacked = self.runner.body.weights[source[0]].grad
                grads[key] = None if stacked is None else self._unstacked(stacked, *source)
            elif isinstance(tensor := source.state_dict(keep_vars=True)[key], nn.Parameter):
                grads[key] = tensor.grad
        return grads

    def _state_tensor(self, key: str) -> torch.Tensor:
        source = self._state_sources[key]
        if isinstance(source, tuple):
            return self._unstacked(self.runner.body.weights[source[0]], *source)
        return source.state_dict(keep_vars=True)[key]

    def _unstacked(self, stacked: torch.Tensor, index: int, block: int) -> torch.Tensor:
        """Block ``block``'s part of a stacked ``[S, K, numel]`` tensor (weight ``index``, or its grad)."""
        stage, slot = self.runner.block_slot(block)
        return stacked[stage, slot].view(self.runner.body.shapes[index])


def _resolve_mesh(mesh: xs.Mesh | None, stages: int | None, balance: Sequence[int] | None) -> xs.Mesh:
    if balance is not None and stages is not None and len(balance) != stages:
        raise ValueError(f"balance: has {len(balance)} stages but stages={stages}; make them agree")
    stages = stages if stages is not None else (len(balance) if balance is not None else None)
    if mesh is None:
        return make_mesh(stages if stages is not None else xr.global_runtime_device_count())
    if tuple(mesh.axis_names) != ("data", "stage"):
        raise ValueError(f"mesh: axes are {mesh.axis_names}, expected ('data', 'stage'); build it with xpipe.make_mesh")
    if stages is not None and mesh.mesh_shape[1] != stages:
        raise ValueError(f"stages: {stages} does not match the mesh's 'stage' axis of {mesh.mesh_shape[1]}")
    return mesh


def _spmd_partition(module: nn.Module, plan: Partition, per_stage: tuple[int, ...],
                    balance: Sequence[int] | None) -> Partition:
    """The partition the spmd executor runs: the body spread evenly, pre on the first
    stage and post on the last (they run data-parallel over the whole mesh)."""
    repeated = plan.repeated
    blocks = [count * repeated.period for count in per_stage]
    post = sum(plan.balance) - repeated.start - repeated.period * repeated.count
    spmd_balance = [blocks[0] + repeated.start, *blocks[1:-1], blocks[-1] + post] if len(blocks) > 1 \
        else [sum(plan.balance)]
    if min(per_stage) < 1:
        raise ValueError(f"stages: the model's body has {repeated.count} blocks, fewer than the "
                         f"{len(per_stage)} stages; use at most {repeated.count} stages")
    if balance is not None and list(balance) != spmd_balance:
        raise ValueError(f"balance: the spmd executor spreads the {repeated.count} blocks evenly, which gives "
                         f"balance={spmd_balance}; pass that or leave balance out")
    return partition(module, balance=spmd_balance)


def _move_keeping_ties(modules: list[nn.Module], device: torch.device) -> None:
    """Move parameters and buffers to ``device``, one new Parameter per original.

    ``module.to(xla)`` makes a separate copy for every place a Parameter is held,
    which unties tied weights (an LM's embedding and head); this keeps them one.
    """
    moved: dict[int, nn.Parameter] = {}
    for module in modules:
        for owner in module.modules():
            for name, parameter in owner._parameters.items():
                if parameter is not None:
                    if id(parameter) not in moved:
                        moved[id(parameter)] = nn.Parameter(parameter.detach().to(device),
                                                            requires_grad=parameter.requires_grad)
                    owner._parameters[name] = moved[id(parameter)]
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = buffer.to(device)


def _state_sources(stacked: StackedModel, keys: list[str]) -> dict[str, nn.Module | tuple[int, int]]:
    """Where each state_dict key lives: in ``pre`` or ``post``, or (parameter index, block)."""
    sources: dict[str, nn.Module | tuple[int, int]] = {}
    for block, module in enumerate(stacked.blocks):
        for index, (name, _) in enumerate(module.named_parameters()):
            sources[name] = (index, block)
    for module in (stacked.pre, stacked.post):
        for name in module.state_dict(keep_vars=True):
            sources.setdefault(name, module)
    unused = [key for key in keys if key not in sources]
    if unused:
        raise ValueError(f"module: {unused} are never used by forward; remove them before pipelining")
    return sources
