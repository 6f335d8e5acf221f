"""The devices executor: one XLA device per stage, any partition (torchgpipe parity).

Each stage's program lives on its own XLA device (non-SPMD). The whole pipeline
is one autograd function: its forward runs the schedule's forward cells and its
backward the backward cells, clock by clock. Each cell ends by launching its
stage's lazy graph on that device alone, without waiting: every (stage,
direction) is one small XLA program, compiled once and reused for every
microbatch and step, and the devices of one clock compute at the same time while
the host traces the next cell. Values cross devices with ``.to(device)``, which
waits for the value to be ready; a skip connection goes straight from the stage
that makes it to each stage that reads it.

Checkpointing follows GPipe: a recomputed microbatch keeps only its stage inputs
(and the device's random-number state, so dropout repeats its mask) and runs the
stage again in the backward pass; a kept one has the activations autograd saves
materialised on the device together with its outputs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from xpipe.devices.stages import StagedModel, StageProgram
from xpipe.schedule import BACKWARD, FORWARD, Action, Schedule


class Event(NamedTuple):
    """One schedule cell as it ran, in ``time.perf_counter()`` seconds.

    ``launched``: the stage's program was handed to its device (inputs received,
    graph traced); ``ready``: the device finished it (its first output's buffer
    became ready).
    """

    stage: int
    kind: str
    microbatch: int
    launched: float
    ready: float


class DevicesPipeline(nn.Module):
    """Runs a model cut into stages on one XLA device per stage, as a schedule orders.

    Args:
        staged: the model cut into stage programs; each stage's parameters and
            buffers must already be on its device.
        devices: one XLA device per stage.
        schedule: all its forward cells must come before its backward cells.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.

    Attributes:
        timeline: an :class:`Event` for every cell of the last step, forward and
            backward, filled in as the devices finish; after
            ``torch_xla.core.xla_model.wait_device_ops()`` it is complete.
    """

    def __init__(self, staged: StagedModel, devices: list[torch.device], schedule: Schedule,
                 checkpoint: str) -> None:
        super().__init__()
        self.staged = staged
        self.stage_modules = nn.ModuleList(program.module for program in staged.stages)
        self.devices = devices
        self.chunks = schedule.chunks
        self.forward_clocks = _cells_by_clock(schedule, FORWARD)
        self.backward_clocks = _cells_by_clock(schedule, BACKWARD)
        self.checkpoint = checkpoint
        self.timeline: list[Event] = []
        self._flush_pending = False

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The trainable parameters of ``stage``."""
        return [p for p in self.stage_modules[stage].parameters() if p.requires_grad]

    def flush(self) -> None:
        """Launch whatever is pending on the stage devices (the last optimizer update).

        ``torch_xla.sync()`` executes the default device only; a forward installs this
        as a step closure, so the user's ``torch_xla.sync()`` updates every stage.
        """
        self._flush_pending = False
        for device in self.devices:
            torch_xla._XLAC._xla_step_marker(str(device), [], wait=False)

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None) -> Any:
        names = self.staged.inputs
        if len(inputs) != len(names):
            raise TypeError(f"x: the model takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
        if any(x.requires_grad for x in inputs):
            raise ValueError("x: the devices executor does not differentiate with respect to the model's "
                             "inputs; pass them detached (x.detach())")
        self.flush()
        if not self._flush_pending:
            xm.add_step_closure(self.flush)
            self._flush_pending = True
        self.timeline = []
        split = [_split(x, self.chunks, microbatch_dim) for x in inputs]
        step = _Step(self, [dict(zip(names, values)) for values in zip(*split)], microbatch_dim,
                     differentiating=torch.is_grad_enabled())
        parameters = [p for stage in range(len(self.devices)) for p in self.stage_parameters(stage)]
        leaves = _PipelineFunction.apply(step, *parameters)
        return tree_unflatten(list(leaves), step.output_spec)

    def run_cells(self, clocks: list[list[Action]], cell: Callable[[Action], list[torch.Tensor]]) -> None:
        """Run ``cell`` for each action, clock by clock, and launch what it computed."""
        for actions in clocks:
            for action in actions:
                tensors = cell(action)
                launched = time.perf_counter()
                _launch(tensors)
                if tensors:
                    self._on_ready(tensors[0], action, launched)

    def _on_ready(self, tensor: torch.Tensor, action: Action, launched: float) -> None:
        timeline = self.timeline  # this step's: the callback may come after the next step began

        def record() -> None:
            timeline.append(Event(action.stage, action.kind, action.microbatch, launched, time.perf_counter()))

        torch_xla._XLAC._on_ready_callback(tensor, record)


class _Step:
    """The state of one training step: values in flight, kept activations, gradients."""

    def __init__(self, pipeline: DevicesPipeline, microbatches: list[dict[str, torch.Tensor]],
                 microbatch_dim: int | None, *, differentiating: bool) -> None:
        self.pipeline = pipeline
        self.differentiating = differentiating  # False under torch.no_grad(): nothing to keep
        self.values = microbatches  # per microbatch: value name -> tensor, on the device that made it
        self.chunks = len(microbatches)
        self.microbatch_dim = microbatch_dim
        self.made_by_stages = {name for p in pipeline.staged.stages for name in p.outputs}
        # (stage, microbatch) -> (inputs, outputs) if kept, or (inputs, RNG seed) to recompute
        self.kept: dict[tuple[int, int], tuple[list[Any], Any]] = {}
        self.outputs: list[list[torch.Tensor]] = [[] for _ in microbatches]
        self.output_spec: TreeSpec | None = None
        self.output_grads: list[list[torch.Tensor | None]] = []
        self.received: list[dict[str, list[torch.Tensor]]] = [defaultdict(list) for _ in microbatches]
        self.accumulated: list[list[torch.Tensor | None]] = [
            [None] * len(pipeline.stage_parameters(stage)) for stage in range(len(pipeline.devices))]

    def keeps(self, microbatch: int) -> bool:
        """Whether ``microbatch`` keeps its activations instead of recomputing them."""
        mode = self.pipeline.checkpoint
        if not self.differentiating:
            return False
        return mode == "never" or (mode == "except_last" and microbatch == self.chunks - 1)

    def forward_cell(self, action: Action) -> list[torch.Tensor]:
        stage, microbatch = action.stage, action.microbatch
        program = self.pipeline.staged.stages[stage]
        device = self.pipeline.devices[stage]
        args = [_moved(self.values[microbatch][name], device) for name in program.inputs]
        saved: list[torch.Tensor] = []
        if self.keeps(microbatch):
            args = self._as_leaves(program, args)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_collect_into(saved), _itself):
                out = program.module(*args)
            self.kept[stage, microbatch] = (args, _Kept(out))
        else:
            if self.differentiating:
                self.kept[stage, microbatch] = (args, xm.get_rng_state(device))
            with torch.no_grad():
                out = program.module(*args)
        if stage == len(self.pipeline.devices) - 1:
            leaves, self.output_spec = tree_flatten(out)
            self.outputs[microbatch] = leaves
        else:
            leaves = list(out)
            self.values[microbatch].update(zip(program.outputs, leaves))
        return _xla_tensors(leaves) + _xla_tensors(saved)

    def backward_cell(self, action: Action) -> list[torch.Tensor]:
        stage, microbatch = action.stage, action.microbatch
        program = self.pipeline.staged.stages[stage]
        device = self.pipeline.devices[stage]
        args, kept = self.kept.pop((stage, microbatch))
        if isinstance(kept, _Kept):
            out = kept.outputs
        else:
            args = self._as_leaves(program, args)
            with torch.enable_grad(), _buffers_restored(program.module), _rng_replayed(device, kept):
                out = program.module(*args)
        if stage == len(self.pipeline.devices) - 1:
            leaves, grads = tree_flatten(out)[0], self.output_grads[microbatch]
        else:
            leaves = list(out)
            grads = [self._received_grad(microbatch, name, device) for name in program.outputs]
        pairs = [(o, g) for o, g in zip(leaves, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            return []
        wrt = [(n, a) for n, a in zip(program.inputs, args) if isinstance(a, torch.Tensor) and a.requires_grad]
        parameters = self.pipeline.stage_parameters(stage)
        found = torch.autograd.grad([o for o, _ in pairs], [a for _, a in wrt] + parameters,
                                    [g for _, g in pairs], allow_unused=True)
        input_grads = found[:len(wrt)]
        for (name, _), grad in zip(wrt, input_grads):
            if grad is not None:
                self.received[microbatch][name].append(grad)
        totals = self.accumulated[stage]
        for index, grad in enumerate(found[len(wrt):]):
            if grad is not None:
                totals[index] = grad if totals[index] is None else totals[index] + grad
        return [g for g in input_grads if g is not None] + [t for t in totals if t is not None]

    def _as_leaves(self, program: StageProgram, args: list[Any]) -> list[Any]:
        """``args`` as fresh autograd leaves where they are values another stage made
        (their gradients go back there); model inputs stay as they are."""
        return [_differentiable(a) if n in self.made_by_stages else a for n, a in zip(program.inputs, args)]

    def _received_grad(self, microbatch: int, name: str, device: torch.device) -> torch.Tensor | None:
        """The gradient of value ``name``, summed over the stages that read it."""
        parts = [_moved(part, device) for part in self.received[microbatch].pop(name, [])]
        return functools.reduce(operator.add, parts) if parts else None

    def end_forward(self) -> list[torch.Tensor]:
        """The model's outputs, microbatches merged; the values that crossed between
        stages are let go (each reader keeps its own copy if it needs one)."""
        outputs, self.outputs, self.values = self.outputs, [], []
        return [_merge(list(parts), self.microbatch_dim) for parts in zip(*outputs)]

    def set_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        split = [_split(g, self.chunks, self.microbatch_dim) if g is not None else [None] * self.chunks
                 for g in grads]
        last = self.pipeline.devices[-1]
        self.output_grads = [[_moved(g, last) for g in per_leaf] for per_leaf in zip(*split)]

    def parameter_grads(self) -> list[torch.Tensor | None]:
        return [grad for totals in self.accumulated for grad in totals]


class _Kept(NamedTuple):
    """The outputs of a microbatch that keeps its activations (with their autograd graph)."""

    outputs: Any


class _PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node, so its backward runs the schedule's
    backward cells in order instead of autograd's own traversal order."""

    @staticmethod
    def forward(ctx, step: _Step, *parameters: nn.Parameter) -> tuple[torch.Tensor, ...]:
        ctx.step = step
        step.pipeline.run_cells(step.pipeline.forward_clocks, step.forward_cell)
        return tuple(step.end_forward())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        step.set_output_grads(grads)
        step.pipeline.run_cells(step.pipeline.backward_clocks, step.backward_cell)
        del ctx.step
        return (None, *step.parameter_grads())


def _cells_by_clock(schedule: Schedule, kind: str) -> list[list[Action]]:
    rows = [[cell for cell in row if cell is not None and cell.kind == kind] for row in schedule.table]
    forward_ends = max((t for t, row in enumerate(schedule.table) if any(c and c.kind == FORWARD for c in row)))
    backward_starts = min((t for t, row in enumerate(schedule.table) if any(c and c.kind == BACKWARD for c in row)))
    if forward_ends >= backward_starts:
        raise ValueError(f"schedule: {schedule.name!r} interleaves forward and backward cells; the devices "
                         "executor runs all forward cells before the backward pass (use 'gpipe')")
    return [row for row in rows if row]


def _split(x: torch.Tensor, chunks: int, microbatch_dim: int | None) -> list[torch.Tensor]:
    """The microbatches of ``x``; on an XLA device they are computed together, so each
    is device data rather than a slice whose offset would make its own graph."""
    if microbatch_dim is not None:
        pieces = list(x.unbind(microbatch_dim))
    elif x.shape[0] % chunks:
        raise ValueError(f"chunks: a batch of {x.shape[0]} does not split into {chunks} equal microbatches; "
                         "use a batch size that chunks divides")
    else:
        pieces = list(x.chunk(chunks, 0))
    _launch(_xla_tensors(pieces))
    return pieces


def _merge(parts: list[torch.Tensor], microbatch_dim: int | None) -> torch.Tensor:
    if microbatch_dim is not None:
        return torch.stack(parts, microbatch_dim)
    return torch.cat(parts, 0)


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _differentiable(value: Any) -> Any:
    """A fresh leaf of ``value`` that collects its gradient (floating tensors only)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value


def _xla_tensors(values: list[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type == "xla"]


def _launch(tensors: list[torch.Tensor]) -> None:
    """Execute the graph of ``tensors`` (all on one device), without waiting."""
    if tensors:
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)


def _collect_into(saved: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that lists the activations autograd saves. Weights and views are
    left out: weights are already on the device, and a view (a transposed weight)
    is cheap to take again, while materialising it would make the next step's
    graph differ from this one's."""

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor._base is None and not tensor.is_leaf:
            saved.append(tensor)
        return tensor

    return pack


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _rng_replayed(device: torch.device, seed: int) -> Iterator[None]:
    """Run with ``device``'s random numbers as they were in the forward pass (dropout
    draws the same mask again), then carry on from where the generator was."""
    current = xm.get_rng_state(device)
    xm.set_rng_state(seed, device)
    try:
        yield
    finally:
        xm.set_rng_state(current, device)


@contextlib.contextmanager
def _buffers_restored(module: nn.Module) -> Iterator[None]:
    """Undo what a recomputation writes to buffers (BatchNorm running statistics):
    the forward pass already counted this microbatch."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
