"""``xpipe.Pipe``: wrap a model, keep the training loop.

    mesh = xpipe.make_mesh(stages=4)                  # 8 devices: 2 (data) x 4 (stage)
    pipe = xpipe.Pipe(model, chunks=8, mesh=mesh)
    optimizer = torch.optim.AdamW(pipe.parameters())
    for tokens, targets in batches:
        loss = F.cross_entropy(pipe(tokens).flatten(0, 1), targets.flatten().to(pipe.devices[-1]))
        loss.backward(); optimizer.step(); optimizer.zero_grad(); torch_xla.sync()

The spmd executor (``xpipe.spmd``) runs models with a run of identical blocks as one
SPMD program; the devices executor (``xpipe.devices``) runs any model, one XLA
device per stage.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

from xpipe._checks import check_positive_int
from xpipe._xla import move_keeping_ties, warm_autograd
from xpipe.checkpoint import check_mode
from xpipe.devices.executor import DevicesPipeline
from xpipe.devices.stages import StagedModel, cut_into_stages
from xpipe.mesh import make_mesh, spmd_device
from xpipe.partition import Partition, partition
from xpipe.schedule import Schedule, by_name
from xpipe.spmd.executor import SpmdPipeline, spread
from xpipe.spmd.stacking import StackedModel, cut_for_stacking

EXECUTORS = ("auto", "spmd", "devices")


class Pipe(nn.Module):
    """A model run as a GPipe pipeline on XLA devices.

    Args:
        module: the model. Pipe takes it over: its layers move to the XLA device(s).
        chunks: microbatches per step; the batch is split into this many.
        stages: pipeline stages; defaults to the mesh's "stage" size, or
            ``len(balance)``, or the device count.
        balance: layers per stage, as ``xpipe.partition`` takes it. The spmd
            executor spreads the repeated blocks evenly over the stages, so a
            balance other than that split is an error there; the devices
            executor takes any balance.
        mesh: a ``("data", "stage")`` mesh for the spmd executor; defaults to
            ``xpipe.make_mesh(stages)``.
        schedule: the schedule's name (``"gpipe"``).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which
            microbatches recompute their stage activations in the backward pass.
        executor: ``"spmd"`` (one SPMD program over the mesh), ``"devices"`` (one
            XLA device per stage, any model) or ``"auto"``: spmd when a mesh is
            given, the process is already in SPMD mode, or the model has a
            stackable run of at least one identical block per stage; devices
            otherwise.

    Attributes:
        partition: the :class:`xpipe.Partition` in use.
        schedule: the :class:`xpipe.schedule.Schedule` of one step.
        executor: ``"spmd"`` or ``"devices"``, the one chosen.
        devices: the XLA devices in use, in stage order; the output is on ``devices[-1]``.

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
        self.chunks = chunks
        self.executor = _choose_executor(executor, module, mesh, stages, balance)
        self._original_keys = list(module.state_dict(keep_vars=True))
        if self.executor == "spmd":
            self._build_spmd(module, balance, mesh, stages, schedule)
        else:
            self._build_devices(module, balance, mesh, stages, schedule)

    def _build_spmd(self, module: nn.Module, balance: Sequence[int] | None, mesh: xs.Mesh | None,
                    stages: int | None, schedule: str) -> None:
        device = spmd_device()
        self.mesh = _resolve_mesh(mesh, stages, balance)
        stages = self.mesh.mesh_shape[1]
        self.schedule: Schedule = by_name(schedule, stages, self.chunks)
        plan = partition(module, stages)
        stacked = cut_for_stacking(module, plan)
        self.partition: Partition = _spmd_partition(module, plan, spread(len(stacked.blocks), stages), balance)
        self.devices = [device]
        self._state_sources = _state_sources(stacked, self._original_keys)
        move_keeping_ties([stacked.pre, stacked.post], device)
        self.runner = SpmdPipeline(stacked, self.mesh, self.chunks, self.checkpoint, device)

    def _build_devices(self, module: nn.Module, balance: Sequence[int] | None, mesh: xs.Mesh | None,
                       stages: int | None, schedule: str) -> None:
        if mesh is not None:
            raise ValueError("mesh: the devices executor puts one stage on each XLA device and takes no mesh; "
                             "leave mesh out, or use executor='spmd'")
        if xr.is_spmd():
            raise ValueError("executor: this process is in SPMD mode, where the 'devices' executor cannot run; "
                             "use executor='spmd', or run the devices executor in a process without SPMD")
        stages = _stage_count(stages, balance, xr.global_runtime_device_count())
        self.mesh = None
        self.schedule = by_name(schedule, stages, self.chunks)
        self.partition = partition(module, stages, balance=balance)
        staged = cut_into_stages(module, self.partition)
        _check_no_ties_across_stages(staged)
        self.devices = [torch_xla.device(index) for index in range(stages)]
        warm_autograd(self.devices[0])
        for program, device in zip(staged.stages, self.devices):
            move_keeping_ties([program.module], device)
        self._state_sources = dict.fromkeys(self._original_keys, module)
        self.runner = DevicesPipeline(staged, self.devices, self.schedule, self.checkpoint)

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
            elif isinstance(tensor := self._state_tensor(key), nn.Parameter):
                grads[key] = tensor.grad
        return grads

    def _state_tensor(self, key: str) -> torch.Tensor:
        source = self._state_sources[key]
        if isinstance(source, tuple):
            return self._unstacked(self.runner.body.weights[source[0]], *source)
        owner, _, name = key.rpartition(".")
        return getattr(source.get_submodule(owner), name)

    def _unstacked(self, stacked: torch.Tensor, index: int, block: int) -> torch.Tensor:
        """Block ``block``'s part of a stacked ``[S, K, numel]`` tensor (weight ``index``, or its grad)."""
        stage, slot = self.runner.block_slot(block)
        return stacked[stage, slot].view(self.runner.body.shapes[index])


def _choose_executor(executor: str, module: nn.Module, mesh: xs.Mesh | None, stages: int | None,
                     balance: Sequence[int] | None) -> str:
    """``executor``, with ``"auto"`` resolved: spmd for a mesh, an SPMD process or a
    model with a stackable run of at least one identical block per stage; devices
    otherwise."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor: {executor!r} is not an executor; use one of {', '.join(EXECUTORS)}")
    if executor != "auto":
        return executor
    if mesh is not None or xr.is_spmd():
        return "spmd"
    requested = _requested_stages(stages, balance)
    stages = xr.global_runtime_device_count() if requested is None else requested
    try:
        stacked = cut_for_stacking(module, partition(module, 1))
    except ValueError:
        return "devices"
    return "spmd" if len(stacked.blocks) >= stages else "devices"


def _requested_stages(stages: int | None, balance: Sequence[int] | None) -> int | None:
    """The stage count that ``stages`` or ``balance`` asks for, if either does."""
    if balance is not None and stages is not None and len(balance) != stages:
        raise ValueError(f"balance: has {len(balance)} stages but stages={stages}; make them agree")
    return stages if stages is not None else (len(balance) if balance is not None else None)


def _stage_count(stages: int | None, balance: Sequence[int] | None, devices: int) -> int:
    requested = _requested_stages(stages, balance)
    stages = devices if requested is None else requested
    check_positive_int(stages, "stages")
    if stages > devices:
        raise ValueError(f"stages: {stages} stages need {stages} XLA devices, but there are {devices}; "
                         f"use at most {devices} stages")
    return stages


def _check_no_ties_across_stages(staged: StagedModel) -> None:
    """The devices executor keeps one copy of each weight, on its stage's device."""
    first_use: dict[int, tuple[int, str]] = {}  # parameter id -> (stage, name there)
    for stage, program in enumerate(staged.stages):
        for name, parameter in program.module.named_parameters():
            owner, owner_name = first_use.setdefault(id(parameter), (stage, name))
            if owner != stage:
                raise ValueError(
                    f"module: parameter {name!r} is used in stage {stage} and also in stage {owner} "
                    f"(as {owner_name!r}); the devices executor keeps each weight on one device. "
                    "Pass a balance that puts its users in one stage, or use executor='spmd'")


def _resolve_mesh(mesh: xs.Mesh | None, stages: int | None, balance: Sequence[int] | None) -> xs.Mesh:
    stages = _requested_stages(stages, balance)
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
