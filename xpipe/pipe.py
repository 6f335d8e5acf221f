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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from xpipe._batch import batch_size, check_floating_inputs
from xpipe._checks import check_positive_int
from xpipe._retired import retire
from xpipe._xla import can_enter_spmd, kept_shardings, move_keeping_ties, rebind, restore_shardings, warm_autograd
from xpipe.capture import Captured, place_constants_on, trace_layers
from xpipe.recompute import check_mode
from xpipe.chunks import Chunks
from xpipe.devices.executor import DevicesPipeline
from xpipe.devices.stages import cut_into_stages
from xpipe.layout import spread
from xpipe.mesh import axes_of, make_mesh, mesh_axes, spmd_device
from xpipe.partition import Partition, partition_captured, rebalanced
from xpipe.schedule import Schedule, by_name
from xpipe.spmd.executor import SCHEDULES as SPMD_SCHEDULES
from xpipe.spmd.executor import SpmdPipeline
from xpipe.spmd.stacking import StackedModel, cut_for_stacking
from xpipe.tensor_rules import check_head_counts, check_rules

EXECUTORS = ("auto", "spmd", "devices")


class Pipe(nn.Module):
    """A model run as a GPipe pipeline on XLA devices.

    Args:
        module: the model. Pipe takes it over: its layers move to the XLA
            device(s), keeping their Parameter objects (an optimizer built on
            them before wrapping still steps them), except the repeated blocks
            under spmd, which become stacked tensors of the Pipe's own: the
            blocks' old Parameters then refuse to be stepped or saved. Build the
            optimizer on ``pipe.parameters()``, after wrapping.
        chunks: microbatches per step; the batch is split into this many (a last
            batch that does not divide runs too, as in torchgpipe).
        stages: pipeline stages; defaults to the mesh's "stage" size, or
            ``len(balance)``, or the device count.
        balance: layers per stage, as ``xpipe.partition`` takes it. The spmd
            executor spreads the repeated blocks evenly over the stages, so a
            balance other than that split is an error there; the devices
            executor takes any balance.
        mesh: the spmd executor's mesh: axes "stage" and "data", "fsdp" to
            shard every stage's weights, gradients and optimizer state, and
            "tensor" to split each block's matrices over devices that share
            their rows (``xpipe.make_mesh(stages, data, fsdp=..., tensor=...)``);
            defaults to ``xpipe.make_mesh(stages)``.
        schedule: the schedule's name (``xpipe.schedule.SCHEDULES``). The spmd
            executor runs ``"gpipe"`` and ``"circular"`` (with ``pipe(x)`` or
            :meth:`step`); the devices executor runs every schedule with
            :meth:`step`, and with ``pipe(x)`` those whose forwards all come
            before their backwards (``"gpipe"``, ``"circular"``), or any under
            ``torch.no_grad()``. ``"auto"`` picks the devices executor for a
            schedule the spmd one does not run.
        virtual: model stages per device (or stage group, under spmd), for
            ``"interleaved"`` and ``"circular"`` (model stage ``s`` on device
            ``s % stages``); a ``balance`` then lists
            ``stages * virtual`` entries.
        loss_fn: ``loss_fn(output, target)`` for :meth:`step`, a scalar, e.g.
            ``torch.nn.CrossEntropyLoss()``. Its ``reduction`` (``"mean"`` or
            ``"sum"``) and ``ignore_index`` attributes say how the devices executor
            weighs the microbatches' losses (:mod:`xpipe.reduction`); a function
            without them is taken to mean over rows, checked on its first step
            (declare them for a loss that ignores targets: see docs/api.md).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which
            microbatches recompute their stage activations in the backward pass.
        deferred_batch_norm: devices executor: BatchNorm layers normalise each
            microbatch with its own statistics but update their running
            statistics once per step, over the whole mini-batch, as the
            unpipelined model does (torchgpipe's option). Under spmd the layers
            outside the stacked body already see the whole mini-batch at once.
        executor: ``"spmd"`` (one SPMD program over the mesh), ``"devices"`` (one
            XLA device per stage, any model) or ``"auto"``: spmd when a mesh is
            given, the process is already in SPMD mode, or the model has a
            stackable run of at least one identical block per stage; devices
            otherwise.
        sample_input: a batch as the model takes it (a tensor, a tuple, or a dict
            of keyword inputs), for models torch.fx cannot trace (Hugging Face
            transformers): xpipe captures them with torch.export on it, with the
            batch dim left free, in the mode the model is in.
        tensor_rules: on a mesh with a "tensor" axis, which dim of each block
            weight it splits: parameter-name patterns (``fnmatch``) to a dim, or
            to None to keep a weight whole; tried before the built-in rules of
            :mod:`xpipe.tensor_rules`, which cover Llama-like models, GPT-2, BERT,
            T5 and ``nn.TransformerEncoderLayer``.

    Attributes:
        partition: the :class:`xpipe.Partition` in use.
        schedule: the :class:`xpipe.schedule.Schedule` every step runs (under spmd,
            ``chunks`` rounded up to a multiple of the stages: the padding
            microbatches run too).
        executor: ``"spmd"`` or ``"devices"``, the one chosen.
        devices: the XLA devices in use, in stage order; the output is on ``devices[-1]``.

    Calling ``pipe(x)`` with ``x`` batch-first (a tensor, or a tuple of tensors)
    returns what ``module(x)`` returns, batch-first; ``pipe(x, microbatch_dim=d)``
    takes ``x`` with a dim ``d`` of size ``chunks`` and keeps that layout.
    Every argument is checked before the process's XLA runtime is touched.
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
        virtual: int = 1,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        executor: str = "auto",
        sample_input: Any = None,
        tensor_rules: Mapping[str, int | None] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        self.chunks = check_positive_int(chunks, "chunks")
        self.checkpoint = check_mode(checkpoint)
        if not isinstance(deferred_batch_norm, bool):
            raise ValueError(f"deferred_batch_norm: must be True or False, got {deferred_batch_norm!r}")
        self.virtual = check_positive_int(virtual, "virtual")
        by_name(schedule, 1, 1, virtual)  # an unknown name, or a virtual it cannot run, fails before device work
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable loss_fn(output, target), got {type(loss_fn).__name__}")
        self.__dict__["loss_fn"] = loss_fn  # not a submodule: the loss is not part of the model's state
        tensor_rules = check_rules(tensor_rules)
        capture = _Capture(module, sample_input)
        self.executor = _choose_executor(executor, capture, mesh, stages, balance, schedule, virtual)
        self._original_keys = list(module.state_dict(keep_vars=True))
        if self.executor == "spmd":
            self._build_spmd(capture, balance, mesh, stages, schedule, tensor_rules)
        elif tensor_rules:
            raise ValueError("tensor_rules: the devices executor has no 'tensor' axis to split weights over; use "
                             "executor='spmd' with a mesh from xpipe.make_mesh(..., tensor=N), or leave them out")
        else:
            self._build_devices(capture, balance, mesh, stages, schedule, deferred_batch_norm)
        if not module.training:
            self.eval()  # a model wrapped in eval mode stays in eval mode

    def _build_spmd(self, capture: _Capture, balance: Sequence[int] | None, mesh: xs.Mesh | None,
                    stages: int | None, schedule: str, tensor_rules: dict[str, int | None]) -> None:
        module = capture.module
        if schedule not in SPMD_SCHEDULES:
            raise ValueError(f"schedule: the spmd executor runs {' and '.join(map(repr, SPMD_SCHEDULES))} (its "
                             f"clock loop is GPipe's fill-drain, once or round the stage ring), not {schedule!r}; "
                             "use one of those, or executor='devices'")
        stages = _spmd_stage_count(mesh, stages, balance, self.virtual)
        by_name(schedule, stages, self.chunks, self.virtual)  # refuses what the ring cannot run, before device work
        if mesh is not None:
            check_head_counts(module, axes_of(mesh).tensor)
        plan, stacked = capture.whole(), capture.stacked()
        if len(stacked.blocks) < stages:
            raise ValueError(f"stages: the model's body (its longest run of identical blocks) has "
                             f"{len(stacked.blocks)} blocks, fewer than the {stages} stages; use at most "
                             f"{len(stacked.blocks)} stages, or executor='devices'")
        self.partition: Partition = _spmd_partition(plan, spread(len(stacked.blocks), stages * self.virtual), balance)
        self.mesh = mesh if mesh is not None else make_mesh(stages)  # the process enters SPMD mode here
        device = spmd_device()
        self.devices = [device]
        rebind(module, move_keeping_ties([stacked.pre, stacked.post], device))
        for piece in [stacked.pre, *stacked.blocks, stacked.post]:
            place_constants_on(piece, device)
        self.runner = SpmdPipeline(stacked, self.mesh, self.chunks, self.checkpoint, device, _tie_groups(module),
                                   self.virtual, tensor_rules)
        self.schedule: Schedule = self.runner.schedule  # chunks rounded up to a multiple of stages, as it runs
        retire(module, [p for block in stacked.blocks for p in block.parameters()])

    def _build_devices(self, capture: _Capture, balance: Sequence[int] | None, mesh: xs.Mesh | None,
                       stages: int | None, schedule: str, deferred_batch_norm: bool) -> None:
        module = capture.module
        if mesh is not None:
            raise ValueError("mesh: the devices executor puts one stage on each XLA device and takes no mesh; "
                             "leave mesh out, or use executor='spmd'")
        if xr.is_spmd():
            raise ValueError("executor: this process is in SPMD mode, where the 'devices' executor cannot run; "
                             "use executor='spmd', or run the devices executor in a process without SPMD")
        stages = _stage_count(stages, balance, xr.global_runtime_device_count(), self.virtual)
        self.mesh = None
        self.schedule = by_name(schedule, stages, self.chunks, self.virtual)
        self.partition = rebalanced(capture.whole(), balance, stages=stages * self.virtual)
        staged = cut_into_stages(module, self.partition, capture.sample_input, capture.captured)
        self.devices = [torch_xla.device(index) for index in range(stages)]
        warm_autograd(self.devices[0])
        placed: set[int] = set()
        for stage, program in enumerate(staged.stages):
            device = self.devices[self.schedule.rank_of(stage)]
            # The model holds what trains; a weight tied across devices stays with its first stage.
            rebind(module, move_keeping_ties([program.module], device, keep=placed))
            placed.update(id(t) for t in [*program.module.parameters(), *program.module.buffers()])
            place_constants_on(program.module, device)
        self.runner = DevicesPipeline(staged, self.devices, self.schedule, self.checkpoint, module,
                                      deferred_batch_norm=deferred_batch_norm)

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None, **keyword_inputs: torch.Tensor):
        inputs, microbatch_dim = self._prepared(inputs, keyword_inputs, microbatch_dim)
        return self.runner(*inputs, microbatch_dim=microbatch_dim)

    def step(self, inputs: Any, target: Any, *, microbatch_dim: int | None = None) -> torch.Tensor:
        """One training step with the loss inside the pipeline: runs the whole schedule
        (forwards, ``loss_fn`` of each microbatch on the last stage, backwards) and
        adds to ``.grad`` the gradients of ``loss_fn(module(inputs), target)``.

        Args:
            inputs: what ``pipe(...)`` takes: a tensor, a tuple of tensors, or a dict
                of keyword inputs.
            target: what ``loss_fn`` takes beside the output, batch-first (a tensor
                or a structure of them), split into microbatches as the inputs are.
            microbatch_dim: as for ``pipe(x, microbatch_dim=d)``, for inputs and target.

        Returns:
            The loss of the whole batch (detached), on the last stage's device.
        """
        if self.loss_fn is None:
            raise ValueError("loss_fn: pipe.step computes the loss inside the pipeline; build the Pipe with "
                             "loss_fn=... (e.g. torch.nn.CrossEntropyLoss()), or call pipe(x) and compute it yourself")
        if isinstance(inputs, Mapping):
            inputs, keyword_inputs = (), dict(inputs)
        else:
            inputs, keyword_inputs = (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}
        inputs, microbatch_dim = self._prepared(inputs, keyword_inputs, microbatch_dim)
        _check_target(target, batch_size(inputs, self.chunks, microbatch_dim), self.chunks, microbatch_dim)
        if self.executor == "devices":
            return self.runner.step(inputs, target, self.loss_fn, microbatch_dim)
        output = self.runner(*inputs, microbatch_dim=microbatch_dim)
        loss = self.loss_fn(output, tree_map(lambda t: t.to(self.devices[0]), target))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("loss_fn: must return a scalar tensor")
        loss.backward()
        return loss.detach()

    def _prepared(self, inputs: tuple, keyword_inputs: dict[str, Any],
                  microbatch_dim: int | None) -> tuple[tuple, int | None]:
        """The model's inputs in order, checked, and ``microbatch_dim`` made non-negative."""
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) and len(self.runner.input_names) > 1:
            inputs = tuple(inputs[0])  # pipe((x, y)) for forward(x, y); forward(pair) gets the tuple
        inputs = _in_order(inputs, keyword_inputs, self.runner.input_names)
        if not inputs:
            raise TypeError("x: pass the model's input (a tensor, or a tuple of tensors)")
        batch_size(inputs, self.chunks, microbatch_dim)
        check_floating_inputs(inputs, self._weight_dtype())
        if microbatch_dim is not None:
            microbatch_dim %= tree_flatten(inputs)[0][0].dim()
        return inputs, microbatch_dim

    def _weight_dtype(self) -> torch.dtype | None:
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), None)

    def _apply(self, fn, recurse: bool = True):
        raise TypeError(  # torchgpipe's type for a refused move
            "pipe: a Pipe's weights are placed on their XLA devices (and sharded, under spmd) when it is "
            "built; .to(), .cpu(), .cuda(), .half() and the like would move them out from under the "
            "pipeline. Convert the model before wrapping it (model.to(dtype)), or take pipe.state_dict() "
            "for a copy elsewhere")

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state: exactly its keys and shapes, the body unstacked."""
        state = OrderedDict() if destination is None else destination
        for key in self._original_keys:
            tensor = self.runner.state_tensor(key)
            state[prefix + key] = tensor if keep_vars else tensor.detach()
        return state

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` as CPU copies, fetched a whole tensor at a time: under spmd,
        moving each block's view of the stacked weights would compile a program per view."""
        return self.runner.host_state(self._original_keys)

    def host_state_chunks(self) -> dict[str, Chunks | torch.Tensor]:
        """``state_dict()`` as what this host holds of it, for checkpoints: under spmd each
        tensor as the pieces of its shards (:mod:`xpipe.chunks`), never put together;
        with the devices executor, CPU copies."""
        if isinstance(self.runner, SpmdPipeline):
            return self.runner.state_chunks(self._original_keys)
        return self.host_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load a state dict of the wrapped module (as ``module.state_dict()`` gives)."""
        missing = [k for k in self._original_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._original_keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        targets = {key: self.runner.state_tensor(key) for key in state_dict if key in self._original_keys}
        for key, target in targets.items():
            if target.shape != state_dict[key].shape:
                raise RuntimeError(f"state_dict: {key!r} has shape {list(state_dict[key].shape)}, "
                                   f"expected {list(target.shape)}")
        shardings = kept_shardings([*self.parameters(), *self.buffers()])
        with torch.no_grad():
            for key, target in targets.items():
                target.copy_(state_dict[key].to(target.device, target.dtype))
        restore_shardings(shardings)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names, the body unstacked."""
        return self.runner.named_gradients()


def _tie_groups(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each ``state_dict`` key of ``module``, in order, with every key that names the
    same tensor (a weight tied between the embedding and the head has two)."""
    state = module.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for key, tensor in state.items():
        names.setdefault(id(tensor), []).append(key)
    return {key: tuple(names[id(tensor)]) for key, tensor in state.items()}


def _in_order(inputs: tuple, keyword_inputs: dict[str, Any], names: tuple[str, ...]) -> tuple:
    """Positional and keyword inputs as one tuple in the order of the model's inputs."""
    if not keyword_inputs:
        return inputs
    unknown = [key for key in keyword_inputs if key not in names[len(inputs):]]
    missing = [name for name in names[len(inputs):] if name not in keyword_inputs]
    if unknown or missing:
        raise TypeError(f"x: the pipelined model takes the inputs {list(names)}; got {len(inputs)} positional and "
                        f"keywords {list(keyword_inputs)} (unknown: {unknown}, missing: {missing}). A model "
                        "captured with torch.export takes exactly the inputs of its sample_input")
    return inputs + tuple(keyword_inputs[name] for name in names[len(inputs):])


def _choose_executor(executor: str, capture: _Capture, mesh: xs.Mesh | None, stages: int | None,
                     balance: Sequence[int] | None, schedule: str, virtual: int) -> str:
    """``executor``, with ``"auto"`` resolved: spmd for a mesh, an SPMD process or a
    model with a stackable run of at least one identical block per stage and a
    layer per model stage (and a stage count that divides the devices), when the
    schedule is one spmd runs and the process has not used XLA devices outside
    SPMD mode; devices otherwise. Touches no device."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor: {executor!r} is not an executor; use one of {', '.join(EXECUTORS)}")
    if executor != "auto":
        return executor
    if mesh is not None or xr.is_spmd():
        return "spmd"
    if schedule not in SPMD_SCHEDULES or not can_enter_spmd():
        return "devices"  # a schedule spmd does not run, or XLA devices already used without SPMD
    requested = _requested_stages(stages, balance, virtual)
    devices = xr.global_runtime_device_count()
    stages = devices if requested is None else check_positive_int(requested, "stages")
    if devices % stages:
        return "devices"  # no data x stage mesh has this many stages
    try:
        plan, stacked = capture.whole(), capture.stacked()
    except ValueError:
        return "devices"
    blocks = len(stacked.blocks)  # what _build_spmd accepts: a block per stage, a layer per model stage
    fits = blocks >= stages and min(_spmd_balance(plan, spread(blocks, stages * virtual))) >= 1
    return "spmd" if fits else "devices"


class _Capture:
    """A Pipe's model, captured once (a trace is the longest part of building a Pipe),
    and what the executor choice and both builds read from it, each made once: the
    model's layer graph as one stage (the run of repeated blocks the spmd executor
    stacks, and the graph any split is made from) and the cut around that run."""

    def __init__(self, module: nn.Module, sample_input: Any) -> None:
        self.module, self.sample_input = module, sample_input
        self._captured: Captured | None = None
        self._whole: Partition | None = None
        self._stacked: StackedModel | None = None

    @property
    def captured(self) -> Captured:
        if self._captured is None:
            self._captured = trace_layers(self.module, self.sample_input)
        return self._captured

    def whole(self) -> Partition:
        """The model's layer graph as one stage."""
        if self._whole is None:
            self._whole = partition_captured(self.module, self.captured, 1, sample_input=self.sample_input)
        return self._whole

    def stacked(self) -> StackedModel:
        """The model cut around its repeated blocks (ValueError if it has none to stack)."""
        if self._stacked is None:
            self._stacked = cut_for_stacking(self.module, self.whole(), self.sample_input, self.captured)
        return self._stacked


def _requested_stages(stages: int | None, balance: Sequence[int] | None, virtual: int = 1) -> int | None:
    """The stage count (devices) that ``stages`` or ``balance`` asks for, if either
    does; ``balance`` lists ``virtual`` model stages per device."""
    if balance is not None and len(balance) % virtual:
        raise ValueError(f"balance: has {len(balance)} entries, not a multiple of virtual={virtual} (one per "
                         "model stage, virtual of them per device)")
    if balance is not None and stages is not None and len(balance) != stages * virtual:
        raise ValueError(f"balance: has {len(balance)} model stages but stages={stages} x virtual={virtual} "
                         f"needs {stages * virtual}; make them agree")
    return stages if stages is not None else (len(balance) // virtual if balance is not None else None)


def _stage_count(stages: int | None, balance: Sequence[int] | None, devices: int, virtual: int = 1) -> int:
    requested = _requested_stages(stages, balance, virtual)
    stages = check_positive_int(devices if requested is None else requested, "stages")
    if stages > devices:
        raise ValueError(f"stages: {stages} stages need {stages} XLA devices, but there are {devices}; "
                         f"use at most {devices} stages")
    return stages


def _check_target(target: Any, rows: int, chunks: int, microbatch_dim: int | None) -> None:
    """``pipe.step``'s target is split as the inputs are: it needs their batch size."""
    try:
        target_rows = batch_size((target,), chunks, microbatch_dim)
    except (TypeError, ValueError) as error:
        raise type(error)(f"target: {error}") from error
    if target_rows != rows:
        raise ValueError(f"target: has {target_rows} rows and the inputs {rows}; pass one target row per "
                         "input row (pipe.step splits both into the same microbatches)")


def _spmd_stage_count(mesh: xs.Mesh | None, stages: int | None, balance: Sequence[int] | None,
                      virtual: int) -> int:
    """The stage count of an spmd Pipe, checked against the mesh or the device count
    before the process is switched into SPMD mode."""
    requested = _requested_stages(stages, balance, virtual)
    if mesh is None:
        return mesh_axes(xr.global_runtime_device_count() if requested is None else requested).stage
    stages = axes_of(mesh).stage
    if requested is not None and stages != requested:
        raise ValueError(f"stages: {requested} does not match the mesh's 'stage' axis of {stages}")
    return stages


def _spmd_balance(plan: Partition, per_stage: tuple[int, ...]) -> list[int]:
    """Layers per model stage when ``per_stage`` blocks of the body go to each, the
    layers before the body to the first and those after it to the last."""
    repeated = plan.repeated
    blocks = [count * repeated.period for count in per_stage]
    post = sum(plan.balance) - repeated.start - repeated.period * repeated.count
    return [blocks[0] + repeated.start, *blocks[1:-1], blocks[-1] + post] if len(blocks) > 1 else [sum(plan.balance)]


def _spmd_partition(plan: Partition, per_stage: tuple[int, ...], balance: Sequence[int] | None) -> Partition:
    """The partition the spmd executor runs: the body spread evenly over the model
    stages, pre on the first and post on the last (they run data-parallel over the
    whole mesh)."""
    repeated = plan.repeated
    spmd_balance = _spmd_balance(plan, per_stage)
    if min(spmd_balance) < 1:
        raise ValueError(f"virtual: the model's body has {repeated.count} blocks, too few for "
                         f"{len(per_stage)} model stages (stages x virtual) to hold a layer each; use a smaller "
                         "virtual")
    if balance is not None and list(balance) != spmd_balance:
        raise ValueError(f"balance: the spmd executor spreads the {repeated.count} blocks evenly, which gives "
                         f"balance={spmd_balance}; pass that or leave balance out")
    return rebalanced(plan, spmd_balance)
