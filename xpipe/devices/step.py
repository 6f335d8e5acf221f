"""One step of the devices executor: the cells of a schedule's table, run one by one.

A :class:`Step` holds what a step has in flight: each microbatch's values on the
device that made them, the activations a kept cell saved (or the inputs and the
random-number state a recomputed one runs again from), the gradients sent back
between stages and each stage's summed weight gradients. ``pipe.step`` runs its
cells straight from the table; ``pipe(x)`` runs them inside one autograd function
(:class:`PipelineFunction`), so that autograd's backward runs the table's backward
cells in order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch_xla.core.xla_model as xm
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten

from xpipe._batch import check_outputs, rows
from xpipe._batchnorm import RunningStatistics
from xpipe._xla import settle_autograd
from xpipe.devices.gradients import StepGradients
from xpipe.devices.loss import StepLoss
from xpipe.devices.microbatch import (byte_count, differentiable, keyed_leaves, launch, merged, microbatches_of, moved,
                                      on_host, xla_tensors)
from xpipe.devices.stages import StagedModel, StageProgram
from xpipe.devices.state import ModuleState
from xpipe.devices.ties import TiedCopies
from xpipe.reduction import model_loss_items, shares
from xpipe.schedule import BACKWARD, FORWARD, WEIGHT_GRAD, Action, Schedule


class StepCells(NamedTuple):
    """The cells a step of some number of microbatches runs, by clock.

    Attributes:
        schedule: the schedule for that many microbatches.
        forward: the table's forward cells, by clock.
        backward: its backward cells by clock, if every forward comes before every
            backward and each backward is whole (``B``); otherwise None, and only
            :meth:`xpipe.devices.executor.DevicesPipeline.step` can train with the schedule.
        kept: the (model stage, microbatch) cells that keep their activations.
    """

    schedule: Schedule
    forward: list[list[Action]]
    backward: list[list[Action]] | None
    kept: frozenset[tuple[int, int]]


class Stages(Protocol):
    """What a step asks of the pipeline it runs on: its stages (their programs, devices
    and weights), the running statistics and tied weights they share, and a runner of
    cells clock by clock. :class:`xpipe.devices.executor.DevicesPipeline` is one."""

    staged: StagedModel
    devices: list[torch.device]
    stage_devices: list[torch.device]
    last_stage: int
    batch_norm: RunningStatistics
    ties: TiedCopies
    state: ModuleState

    def stage_parameters(self, stage: int) -> list[torch.Tensor]: ...

    def run_stage(self, stage: int, *args: Any) -> Any: ...

    def hold(self, stage: int, size: int) -> None: ...

    def folded(self, output: Any) -> Any: ...

    def run_cells(self, clocks: Sequence[Sequence[Action | None]],
                  cell: Callable[[Action], list[torch.Tensor]]) -> None: ...


class Step:
    """The state of one training step: values in flight, kept activations, gradients."""

    def __init__(self, stages: Stages, cells: StepCells, split: list[list[Any]],
                 microbatch_dim: int | None, *, differentiating: bool, input_grads: list[tuple[str, int]]) -> None:
        self.stages = stages
        self.cells = cells
        self.differentiating = differentiating  # False under torch.no_grad(): nothing to keep
        microbatches = [dict(zip(stages.staged.inputs, values)) for values in zip(*split)]
        self.values = microbatches  # per microbatch: value name -> tensor, on the device that made it
        self.inputs = [dict(values) for values in microbatches]  # the model's inputs, per microbatch
        self.chunks = len(microbatches)
        self.microbatch_dim = microbatch_dim
        self.input_grads = input_grads  # (input name, leaf index) of the model inputs that require grad
        # values whose gradient goes somewhere: made by a stage, or a model input that requires grad
        self.differentiable = ({name for p in stages.staged.stages for name in p.outputs}
                               | {name for name, _ in input_grads})
        # (stage, microbatch) -> (inputs, outputs) if kept, or (inputs, RNG seed) to recompute
        self.kept: dict[tuple[int, int], tuple[list[Any], Any]] = {}
        self.outputs: list[list[torch.Tensor]] = [[] for _ in microbatches]
        self.output_spec: TreeSpec | None = None
        self.output_grads: list[list[torch.Tensor | None]] = []
        parameters = [stages.stage_parameters(stage) for stage in range(len(stages.staged.stages))]
        self.gradients = StepGradients(parameters, stages.ties.owner, self.inputs, microbatch_dim, input_grads)
        self.held: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> bytes kept for its backward
        # (stage, microbatch) -> (outputs, their gradients): what a W cell differentiates
        self.weight_work: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.loss: StepLoss | None = None  # set for pipe.step: the loss is computed on the last stage

    def keeps(self, stage: int, microbatch: int) -> bool:
        """Whether a cell keeps its activations instead of recomputing them."""
        return self.differentiating and (stage, microbatch) in self.cells.kept

    def cell(self, action: Action) -> list[torch.Tensor]:
        """Run one cell of the table; returns the XLA tensors to launch."""
        if action.kind == FORWARD:
            return self.forward_cell(action)
        if action.kind in (BACKWARD, WEIGHT_GRAD):  # what the cell's forward held is let go
            self.stages.hold(action.stage, -self.held.pop((action.stage, action.microbatch)))
        if action.kind == WEIGHT_GRAD:
            return self.weight_cell(action)
        return self.backward_cell(action, weights=action.kind == BACKWARD)

    def forward_cell(self, action: Action) -> list[torch.Tensor]:
        stage, microbatch = action.stage, action.microbatch
        program = self.stages.staged.stages[stage]
        device = self.stages.stage_devices[stage]
        args = [moved(self.values[microbatch][name], device) for name in program.inputs]
        saved: list[torch.Tensor] = []
        statistics = self.stages.batch_norm.updating()
        if self.keeps(stage, microbatch):
            args = self._as_leaves(program, args)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_collect_into(saved), _itself), \
                    statistics:
                out = self.stages.run_stage(stage, *args)
                result = self._result(stage, microbatch, out)
            self.kept[stage, microbatch] = (args, Kept(result))
        else:
            if self.differentiating:
                self.kept[stage, microbatch] = (args, xm.get_rng_state(device))
            with torch.no_grad(), statistics:
                out = self.stages.run_stage(stage, *args)
                result = self._result(stage, microbatch, out)
        if self.differentiating:
            self.held[stage, microbatch] = byte_count(args) + byte_count(saved)
            self.stages.hold(stage, self.held[stage, microbatch])
        if stage != self.stages.last_stage:
            leaves = list(out)
            self.values[microbatch].update(zip(program.outputs, leaves))
        elif self.loss is not None:
            leaves = [result]
            self.loss.values[microbatch] = result.detach()
        else:
            leaves, self.output_spec = tree_flatten(out)
            self.outputs[microbatch] = leaves
        return xla_tensors(leaves) + xla_tensors(saved)

    def _result(self, stage: int, microbatch: int, out: Any) -> Any:
        """What the backward differentiates: a stage's outputs, or on the last stage under
        ``pipe.step``, the microbatch's share of the loss."""
        if stage != self.stages.last_stage:
            return out
        check_outputs(out, self._rows(microbatch))
        if self.loss is None:
            return out
        return self.loss.share(microbatch, self.stages.folded(out))

    def backward_cell(self, action: Action, *, weights: bool) -> list[torch.Tensor]:
        """A full backward (``B``), or with ``weights=False`` the input's gradient only
        (``I``), whose graph is kept for the ``W`` cell."""
        stage, microbatch = action.stage, action.microbatch
        program = self.stages.staged.stages[stage]
        args, kept = self.kept.pop((stage, microbatch))
        if isinstance(kept, Kept):
            return self._gradients(stage, microbatch, args, kept.outputs, weights=weights)
        args = self._as_leaves(program, args)
        # Buffers come back only after the gradients: a backward may read a buffer that the
        # recomputation wrote (BatchNorm's counter), and would see it changed in place.
        with _buffers_restored(program.module):
            with torch.enable_grad(), _rng_replayed(self.stages.stage_devices[stage], kept), \
                    self.stages.batch_norm.recomputing():
                out = self._result(stage, microbatch, self.stages.run_stage(stage, *args))
            gradients = self._gradients(stage, microbatch, args, out, weights=weights)
        # Launched with the gradients: restored buffers left pending while the device runs
        # the gradients' graph read device data that run gives away (seen: the next
        # recomputed BatchNorm of the stage gave wrong outputs).
        return gradients + xla_tensors(list(program.module.buffers()))

    def weight_cell(self, action: Action) -> list[torch.Tensor]:
        """``W``: the weights' gradients from the graph the ``I`` cell kept."""
        outputs, grads = self.weight_work.pop((action.stage, action.microbatch))
        parameters = self.stages.stage_parameters(action.stage)
        if not outputs or not parameters:
            return []
        found = torch.autograd.grad(outputs, parameters, grads, allow_unused=True)
        return self.gradients.accumulate(action.stage, found)

    def _gradients(self, stage: int, microbatch: int, args: list[Any], out: Any, *,
                   weights: bool) -> list[torch.Tensor]:
        """Gradients of a stage's inputs (sent on to their makers) and, with ``weights``,
        of its weights (summed over microbatches); without, the graph waits for ``W``."""
        program = self.stages.staged.stages[stage]
        device = self.stages.stage_devices[stage]
        if stage != self.stages.last_stage:
            keyed = keyed_leaves(program.outputs, out)
            leaves = [leaf for _, leaf in keyed]
            grads = [self.gradients.received_grad(microbatch, key, device) for key, _ in keyed]
        elif self.loss is not None:
            leaves, grads = [out], [torch.ones_like(out)]
        else:
            leaves, grads = tree_flatten(out)[0], self.output_grads[microbatch]
        pairs = [(o, g) for o, g in zip(leaves, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        outputs, output_grads = [o for o, _ in pairs], [g for _, g in pairs]
        if not weights:
            self.weight_work[stage, microbatch] = (outputs, output_grads)
        if not pairs:
            return []
        wrt = [(key, a) for key, a in keyed_leaves(program.inputs, args)
               if isinstance(a, torch.Tensor) and a.requires_grad]
        parameters = self.stages.stage_parameters(stage) if weights else []
        if not wrt and not parameters:
            return []
        found = torch.autograd.grad(outputs, [a for _, a in wrt] + parameters, output_grads,
                                    retain_graph=not weights, allow_unused=True)
        input_grads = found[:len(wrt)]
        for (key, _), grad in zip(wrt, input_grads):
            if grad is not None:
                self.gradients.send(microbatch, key, grad)
        totals = self.gradients.accumulate(stage, found[len(wrt):]) if weights else []
        # The gradients fed in are launched too (the last stage's ones_like): autograd's
        # worker thread may hold them past the step, like the microbatch's gradients.
        return [g for g in input_grads if g is not None] + totals + output_grads

    def _as_leaves(self, program: StageProgram, args: list[Any]) -> list[Any]:
        """``args`` as fresh autograd leaves where their gradients go somewhere (back to the
        stage that made them, or out as the gradient of a model input)."""
        return [differentiable(a) if n in self.differentiable else a for n, a in zip(program.inputs, args)]

    def _rows(self, microbatch: int) -> int:
        """Rows of ``microbatch``, read from the model's first input."""
        return rows(next(iter(self.inputs[microbatch].values())))

    def end_forward(self) -> list[torch.Tensor]:
        """The model's outputs, microbatches merged; the values that crossed between
        stages are let go (each reader keeps its own copy if it needs one)."""
        outputs, self.outputs, self.values = self.outputs, [], []
        return [merged(list(parts), self.microbatch_dim, self.scalar_shares) for parts in zip(*outputs)]

    @functools.cached_property
    def scalar_shares(self) -> list[torch.Tensor | float]:
        """How much each microbatch's scalar output (the model's own loss) weighs in the
        batch's: its share of the items the loss averages over (:mod:`xpipe.reduction`)."""
        module = self.stages.state.module
        last = self.stages.stage_devices[-1]
        items = [model_loss_items(module, {name: on_host(value) if name == "labels" else value
                                           for name, value in inputs.items()}) for inputs in self.inputs]
        return [moved(share, last) for share in shares(items)]

    def set_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        sizes = [self._rows(microbatch) for microbatch in range(self.chunks)]
        split = [[None] * self.chunks if g is None else
                 [g * share for share in self.scalar_shares] if g.dim() == 0 else
                 microbatches_of(g, sizes, self.microbatch_dim) for g in grads]
        last = self.stages.stage_devices[-1]
        self.output_grads = [[moved(g, last) for g in per_leaf] for per_leaf in zip(*split)]


class Kept(NamedTuple):
    """The outputs of a microbatch that keeps its activations (with their autograd graph)."""

    outputs: Any


class PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node, so its backward runs the schedule's
    backward cells in order instead of autograd's own traversal order."""

    @staticmethod
    def forward(ctx, step: Step, *inputs_then_parameters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.step = step
        ctx.inputs = inputs_then_parameters[:len(step.input_grads)]
        step.stages.run_cells(step.cells.forward, step.forward_cell)
        step.stages.batch_norm.commit()
        return tuple(step.end_forward())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step: Step = ctx.step
        step.set_output_grads(grads)
        step.stages.run_cells(step.cells.backward, step.cell)
        settle_autograd(step.stages.devices)
        input_grads = step.gradients.model_input_grads(ctx.inputs)
        del ctx.step, ctx.inputs
        return (None, *input_grads, *step.gradients.parameter_grads())



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
    """Undo what a recomputation writes to buffers (BatchNorm's ``num_batches_tracked``,
    any module's own): the forward pass already counted this microbatch.

    The copies are computed at once: a pending copy would read device data that
    the recomputation's own run gives away when it updates the buffer in place.
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    launch(xla_tensors([before for _, before in buffers]))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
