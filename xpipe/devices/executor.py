"""The devices executor: one XLA device per stage, any partition (torchgpipe parity).

Each stage's program lives on its own XLA device (non-SPMD); with ``virtual``
model stages per device, model stage ``s`` lives on device ``s % devices``. The
executor interprets the schedule's table, clock by clock:

- ``pipe.step(inputs, target)`` runs every cell as the table orders it: forwards
  (the loss of each microbatch computed on the last stage), full backwards, or a
  backward split into the input's gradient (``I``, which the previous stage waits
  for) and the weights' (``W``, which fills a bubble). Any schedule runs this way.
- ``pipe(x)`` is one autograd function: its forward runs the table's forward cells
  and its backward the backward cells, so autograd can continue from the output.
  Under gradients this needs a schedule whose forwards all come before its
  backwards (GPipe, circular); without gradients any schedule's forwards run.

Each cell ends by launching its
stage's lazy graph on that device alone, without waiting: every (stage,
direction) is one small XLA program, compiled once and reused for every
microbatch and step, and the devices of one clock compute at the same time while
the host traces the next cell. Values cross devices with ``.to(device)``, which
waits for the value to be ready; a skip connection goes straight from the stage
that makes it to each stage that reads it.

Checkpointing follows :func:`xpipe.recompute.kept_cells`: a recomputed cell keeps only its stage inputs
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
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from xpipe._batch import check_outputs, rows
from xpipe._batchnorm import RunningStatistics
from xpipe._xla import to_host
from xpipe.recompute import kept_cells
from xpipe.devices.stages import StagedModel, StageProgram
from xpipe.devices.ties import TiedCopies
from xpipe.reduction import declares_reduction, loss_fn_items, model_loss_items, shares, weighted
from xpipe.schedule import BACKWARD, FORWARD, WEIGHT_GRAD, Action, Schedule, by_name


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


class Plan(NamedTuple):
    """How a step of some number of microbatches runs.

    Attributes:
        schedule: the schedule for that many microbatches.
        forward: the table's forward cells, by clock.
        backward: its backward cells by clock, if every forward comes before every
            backward and each backward is whole (``B``); otherwise None, and only
            :meth:`DevicesPipeline.step` can train with the schedule.
        kept: the (model stage, microbatch) cells that keep their activations.
    """

    schedule: Schedule
    forward: list[list[Action]]
    backward: list[list[Action]] | None
    kept: frozenset[tuple[int, int]]


class DevicesPipeline(nn.Module):
    """Runs a model cut into stages on XLA devices, as a schedule's table orders.

    Args:
        staged: the model cut into stage programs, ``schedule.model_stages`` of
            them; each one's parameters and buffers must already be on its device.
        devices: one XLA device per rank of the schedule; model stage ``s`` runs
            on ``devices[schedule.rank_of(s)]``.
        schedule: the step's schedule. A last batch with fewer rows than
            ``schedule.chunks`` runs the same schedule for the microbatches it has.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        module: the wrapped module, whose state the stages train in place.
        deferred_batch_norm: update BatchNorm running statistics once per step
            (:mod:`xpipe._batchnorm`) instead of once per microbatch.

    Attributes:
        timeline: an :class:`Event` for every cell of the last step, forward and
            backward, filled in as the devices finish; after
            ``torch_xla.core.xla_model.wait_device_ops()`` it is complete.
        peak_held_bytes: per device, the most bytes the last step held at once for
            backward passes still to run: the activations autograd saved in kept
            cells, and the stage inputs of every cell, counted from a cell's
            forward until the backward that frees them (its ``B``, or its ``W``).
    """

    def __init__(self, staged: StagedModel, devices: list[torch.device], schedule: Schedule,
                 checkpoint: str, module: nn.Module, *, deferred_batch_norm: bool = False) -> None:
        super().__init__()
        if len(staged.stages) != schedule.model_stages or len(devices) != schedule.stages:
            raise ValueError(f"staged: {len(staged.stages)} stage programs on {len(devices)} devices do not fit "
                             f"{schedule.name!r} with {schedule.stages} ranks x {schedule.virtual} model stages")
        self.staged = staged
        self.stage_modules = nn.ModuleList(program.module for program in staged.stages)
        self.devices = devices
        self.stage_devices = [devices[schedule.rank_of(stage)] for stage in range(schedule.model_stages)]
        self.last_stage = schedule.model_stages - 1
        self.schedule = schedule
        self.chunks = schedule.chunks
        self.checkpoint = checkpoint
        self.plans: dict[int, Plan] = {}  # microbatches -> plan
        self.batch_norm = RunningStatistics(list(self.stage_modules), deferred=deferred_batch_norm)
        self.ties = TiedCopies(list(self.stage_modules), self.stage_devices)
        self.ties.refresh()
        self.timeline: list[Event] = []
        self.peak_held_bytes = [0] * len(devices)
        self._held_bytes = [0] * len(devices)
        self._flush_pending = False
        self.checked_losses: list[Callable] = []  # loss_fns whose reduction a first step confirmed
        self._module = [module]  # out of the module tree: its parameters are the stages' own

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's positional inputs."""
        return self.staged.inputs

    def state_tensor(self, key: str) -> torch.Tensor:
        """The parameter or buffer behind ``state_dict`` key ``key``."""
        owner, _, name = key.rpartition(".")
        return getattr(self._module[0].get_submodule(owner), name)

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names."""
        return {name: p.grad for name, p in self._module[0].named_parameters(remove_duplicate=False)}

    def host_state(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``state_dict`` keys ``keys`` as CPU copies."""
        return dict(zip(keys, to_host([self.state_tensor(key) for key in keys])))

    def named_slices(self, parameter: torch.Tensor, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The wrapped module's parameter that ``parameter`` is, by name (its first, if
        tied), with ``tensor`` (shaped like it: its gradient, an optimizer's state)."""
        names = self._module[0].named_parameters()
        return [(name, tensor) for name, p in names if p is parameter][:1]

    def stage_parameters(self, stage: int) -> list[torch.Tensor]:
        """The trainable weights model stage ``stage`` runs with: its parameters, or
        this step's copy of those that live on another device (:mod:`.ties`)."""
        substitutes = self.ties.substitutes(stage)
        return [substitutes.get(name, p) for name, p in self.stage_modules[stage].named_parameters()
                if p.requires_grad]

    def run_stage(self, stage: int, *args: Any) -> Any:
        """Model stage ``stage``'s program on ``args``. The autograd leaves among them
        (that collect a stage input's gradient) go in as copies: a stage whose first
        layer works in place (MobileNet's ``Hardswish(inplace=True)``) may not write into
        a leaf, as it may into the activation it gets in the unpipelined model."""
        args = tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a,
                        args)
        return self.ties.run(stage, self.stage_modules[stage], *args)

    def flush(self) -> None:
        """Launch whatever is pending on the stage devices (the last optimizer update).

        ``torch_xla.sync()`` executes the default device only; a forward installs this
        as a step closure, so the user's ``torch_xla.sync()`` updates every stage.
        """
        self._flush_pending = False
        for device in self.devices:
            torch_xla._XLAC._xla_step_marker(str(device), [], wait=False)

    def plan_for(self, chunks: int) -> Plan:
        """The plan of a step of ``chunks`` microbatches."""
        if chunks not in self.plans:
            schedule = self.schedule if chunks == self.chunks else _smaller(self.schedule, chunks)
            self.plans[chunks] = Plan(schedule, _cells_by_clock(schedule, (FORWARD,)), _backward_phase(schedule),
                                      kept_cells(schedule, self.checkpoint))
        return self.plans[chunks]

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None) -> Any:
        self._begin(inputs, microbatch_dim)
        split = [_split(x, self.chunks, microbatch_dim) for x in inputs]
        plan = self.plan_for(len(split[0]))
        differentiating = torch.is_grad_enabled()
        if differentiating and plan.backward is None:
            raise RuntimeError(
                f"pipe: schedule {plan.schedule.name!r} interleaves forwards and backwards, so autograd cannot run "
                "its backward from pipe(x)'s output; train with Pipe(..., loss_fn=...) and pipe.step(inputs, "
                "target), or call pipe(x) under torch.no_grad() for inference")
        wanted = [(key, x) for key, x in _keyed_leaves(self.staged.inputs, inputs)
                  if differentiating and isinstance(x, torch.Tensor) and x.requires_grad]
        step = _Step(self, plan, split, microbatch_dim, differentiating=differentiating,
                     input_grads=[key for key, _ in wanted])
        parameters = [self.ties.owner(p) for stage in range(len(self.stage_modules))
                      for p in self.stage_parameters(stage)]
        with _guard_failures_explained():
            leaves = _PipelineFunction.apply(step, *[x for _, x in wanted], *parameters)
        return self._folded(tree_unflatten(list(leaves), step.output_spec))

    def step(self, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             microbatch_dim: int | None = None) -> torch.Tensor:
        """Run one training step as the schedule's table orders it: every forward, the
        loss of each microbatch on the last stage, and every backward, leaving in
        ``.grad`` the gradients of ``loss_fn(module(inputs), target)``; returns the loss."""
        self._begin(inputs, microbatch_dim)
        split = [_split(x, self.chunks, microbatch_dim) for x in inputs]
        plan = self.plan_for(len(split[0]))
        targets = _split(target, [rows(piece) for piece in split[0]] if microbatch_dim is None else self.chunks,
                         microbatch_dim)
        if len(targets) != len(split[0]):
            raise ValueError(f"target: splits into {len(targets)} microbatches, the inputs into {len(split[0])}; "
                             "give the target the inputs' batch size (and microbatch_dim)")
        wanted = [(key, x) for key, x in _keyed_leaves(self.staged.inputs, inputs)
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        step = _Step(self, plan, split, microbatch_dim, differentiating=True, input_grads=[key for key, _ in wanted])
        check = loss_fn not in self.checked_losses and not declares_reduction(loss_fn)
        step.loss = _Loss(loss_fn, targets, self.stage_devices[-1], check)
        grads_before = _grads([*self._module[0].parameters(), *(x for _, x in wanted)]) if check else {}
        with _guard_failures_explained():
            self.run_cells(plan.schedule.table, step.cell)
        self.batch_norm.commit()
        step.accumulate_into_grads([x for _, x in wanted])
        if check:
            try:
                if step.loss.check_reduction(microbatch_dim, step.scalar_shares):
                    self.checked_losses.append(loss_fn)
            except ValueError:
                _restore_grads(grads_before)  # a refused step leaves every gradient as it was
                raise
        return step.loss.total()

    def _begin(self, inputs: tuple[Any, ...], microbatch_dim: int | None) -> None:
        """Checks and bookkeeping shared by ``forward`` and ``step``."""
        names = self.staged.inputs
        if len(inputs) != len(names):
            raise TypeError(f"x: the model takes {len(names)} inputs ({', '.join(names)}), got {len(inputs)}")
        if self.staged.exported is not None:
            self.staged.exported.check_mode(self.training)
            self.staged.exported.check_inputs(inputs, microbatch_dim)
        self.flush()
        if not self._flush_pending:
            xm.add_step_closure(self.flush)
            self._flush_pending = True
        self.ties.refresh()  # the tied weights as the last optimizer step left them
        self.timeline = []
        self.peak_held_bytes = [0] * len(self.devices)
        self._held_bytes = [0] * len(self.devices)

    def hold(self, stage: int, size: int) -> None:
        """Count ``size`` more bytes (fewer, if negative) held for ``stage``'s backward."""
        rank = self.schedule.rank_of(stage)
        self._held_bytes[rank] += size
        self.peak_held_bytes[rank] = max(self.peak_held_bytes[rank], self._held_bytes[rank])

    def _folded(self, output: Any) -> Any:
        """The last stage's output as the model returns it (torch.export's flat outputs folded)."""
        if self.staged.exported is not None:
            return self.staged.exported.folded(output)
        return output

    def run_cells(self, clocks: Sequence[Sequence[Action | None]],
                  cell: Callable[[Action], list[torch.Tensor]]) -> None:
        """Run ``cell`` for each action, clock by clock, and launch what it computed."""
        for actions in clocks:
            for action in actions:
                if action is None:
                    continue
                tensors = cell(action)
                launched = time.perf_counter()
                _launch(tensors)
                if tensors:
                    self._on_ready(tensors[0], action, launched)
                else:  # nothing for the device to do (an I with no input that needs a gradient)
                    self.timeline.append(Event(action.stage, action.kind, action.microbatch, launched, launched))

    def _on_ready(self, tensor: torch.Tensor, action: Action, launched: float) -> None:
        timeline = self.timeline  # this step's: the callback may come after the next step began

        def record() -> None:
            timeline.append(Event(action.stage, action.kind, action.microbatch, launched, time.perf_counter()))

        torch_xla._XLAC._on_ready_callback(tensor, record)


class _Step:
    """The state of one training step: values in flight, kept activations, gradients."""

    def __init__(self, pipeline: DevicesPipeline, plan: Plan, split: list[list[Any]], microbatch_dim: int | None, *,
                 differentiating: bool, input_grads: list[tuple[str, int]]) -> None:
        self.pipeline = pipeline
        self.plan = plan
        self.differentiating = differentiating  # False under torch.no_grad(): nothing to keep
        microbatches = [dict(zip(pipeline.staged.inputs, values)) for values in zip(*split)]
        self.values = microbatches  # per microbatch: value name -> tensor, on the device that made it
        self.inputs = [dict(values) for values in microbatches]  # the model's inputs, per microbatch
        self.chunks = len(microbatches)
        self.microbatch_dim = microbatch_dim
        self.input_grads = input_grads  # (input name, leaf index) of the model inputs that require grad
        # values whose gradient goes somewhere: made by a stage, or a model input that requires grad
        self.differentiable = ({name for p in pipeline.staged.stages for name in p.outputs}
                               | {name for name, _ in input_grads})
        # (stage, microbatch) -> (inputs, outputs) if kept, or (inputs, RNG seed) to recompute
        self.kept: dict[tuple[int, int], tuple[list[Any], Any]] = {}
        self.outputs: list[list[torch.Tensor]] = [[] for _ in microbatches]
        self.output_spec: TreeSpec | None = None
        self.output_grads: list[list[torch.Tensor | None]] = []
        # per microbatch: (value name, leaf index) -> gradients from the stages that read the value
        self.received: list[dict[tuple[str, int], list[torch.Tensor]]] = [defaultdict(list) for _ in microbatches]
        self.accumulated: list[list[torch.Tensor | None]] = [
            [None] * len(pipeline.stage_parameters(stage)) for stage in range(len(pipeline.stage_modules))]
        self.held: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> bytes kept for its backward
        # (stage, microbatch) -> (outputs, their gradients): what a W cell differentiates
        self.weight_work: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.loss: _Loss | None = None  # set for pipe.step: the loss is computed on the last stage

    def keeps(self, stage: int, microbatch: int) -> bool:
        """Whether a cell keeps its activations instead of recomputing them."""
        return self.differentiating and (stage, microbatch) in self.plan.kept

    def cell(self, action: Action) -> list[torch.Tensor]:
        """Run one cell of the table; returns the XLA tensors to launch."""
        if action.kind == FORWARD:
            return self.forward_cell(action)
        if action.kind in (BACKWARD, WEIGHT_GRAD):  # what the cell's forward held is let go
            self.pipeline.hold(action.stage, -self.held.pop((action.stage, action.microbatch)))
        if action.kind == WEIGHT_GRAD:
            return self.weight_cell(action)
        return self.backward_cell(action, weights=action.kind == BACKWARD)

    def forward_cell(self, action: Action) -> list[torch.Tensor]:
        stage, microbatch = action.stage, action.microbatch
        program = self.pipeline.staged.stages[stage]
        device = self.pipeline.stage_devices[stage]
        args = [_moved(self.values[microbatch][name], device) for name in program.inputs]
        saved: list[torch.Tensor] = []
        statistics = self.pipeline.batch_norm.updating()
        if self.keeps(stage, microbatch):
            args = self._as_leaves(program, args)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_collect_into(saved), _itself), \
                    statistics:
                out = self.pipeline.run_stage(stage, *args)
                result = self._result(stage, microbatch, out)
            self.kept[stage, microbatch] = (args, _Kept(result))
        else:
            if self.differentiating:
                self.kept[stage, microbatch] = (args, xm.get_rng_state(device))
            with torch.no_grad(), statistics:
                out = self.pipeline.run_stage(stage, *args)
                result = self._result(stage, microbatch, out)
        if self.differentiating:
            self.held[stage, microbatch] = _bytes(args) + _bytes(saved)
            self.pipeline.hold(stage, self.held[stage, microbatch])
        if stage != self.pipeline.last_stage:
            leaves = list(out)
            self.values[microbatch].update(zip(program.outputs, leaves))
        elif self.loss is not None:
            leaves = [result]
            self.loss.values[microbatch] = result.detach()
        else:
            leaves, self.output_spec = tree_flatten(out)
            self.outputs[microbatch] = leaves
        return _xla_tensors(leaves) + _xla_tensors(saved)

    def _result(self, stage: int, microbatch: int, out: Any) -> Any:
        """What the backward differentiates: a stage's outputs, or on the last stage under
        ``pipe.step``, the microbatch's share of the loss."""
        if stage != self.pipeline.last_stage:
            return out
        check_outputs(out, self._rows(microbatch))
        if self.loss is None:
            return out
        return self.loss.share(microbatch, self.pipeline._folded(out))

    def backward_cell(self, action: Action, *, weights: bool) -> list[torch.Tensor]:
        """A full backward (``B``), or with ``weights=False`` the input's gradient only
        (``I``), whose graph is kept for the ``W`` cell."""
        stage, microbatch = action.stage, action.microbatch
        program = self.pipeline.staged.stages[stage]
        args, kept = self.kept.pop((stage, microbatch))
        if isinstance(kept, _Kept):
            return self._gradients(stage, microbatch, args, kept.outputs, weights=weights)
        args = self._as_leaves(program, args)
        # Buffers come back only after the gradients: a backward may read a buffer that the
        # recomputation wrote (BatchNorm's counter), and would see it changed in place.
        with _buffers_restored(program.module):
            with torch.enable_grad(), _rng_replayed(self.pipeline.stage_devices[stage], kept), \
                    self.pipeline.batch_norm.recomputing():
                out = self._result(stage, microbatch, self.pipeline.run_stage(stage, *args))
            gradients = self._gradients(stage, microbatch, args, out, weights=weights)
        # Launched with the gradients: restored buffers left pending while the device runs
        # the gradients' graph read device data that run gives away (seen: the next
        # recomputed BatchNorm of the stage gave wrong outputs).
        return gradients + _xla_tensors(list(program.module.buffers()))

    def weight_cell(self, action: Action) -> list[torch.Tensor]:
        """``W``: the weights' gradients from the graph the ``I`` cell kept."""
        outputs, grads = self.weight_work.pop((action.stage, action.microbatch))
        parameters = self.pipeline.stage_parameters(action.stage)
        if not outputs or not parameters:
            return []
        found = torch.autograd.grad(outputs, parameters, grads, allow_unused=True)
        return self._accumulate(action.stage, found)

    def _gradients(self, stage: int, microbatch: int, args: list[Any], out: Any, *,
                   weights: bool) -> list[torch.Tensor]:
        """Gradients of a stage's inputs (sent on to their makers) and, with ``weights``,
        of its weights (summed over microbatches); without, the graph waits for ``W``."""
        program = self.pipeline.staged.stages[stage]
        device = self.pipeline.stage_devices[stage]
        if stage != self.pipeline.last_stage:
            keyed = _keyed_leaves(program.outputs, out)
            leaves = [leaf for _, leaf in keyed]
            grads = [self._received_grad(microbatch, key, device) for key, _ in keyed]
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
        wrt = [(key, a) for key, a in _keyed_leaves(program.inputs, args)
               if isinstance(a, torch.Tensor) and a.requires_grad]
        parameters = self.pipeline.stage_parameters(stage) if weights else []
        if not wrt and not parameters:
            return []
        found = torch.autograd.grad(outputs, [a for _, a in wrt] + parameters, output_grads,
                                    retain_graph=not weights, allow_unused=True)
        input_grads = found[:len(wrt)]
        for (key, _), grad in zip(wrt, input_grads):
            if grad is not None:
                self.received[microbatch][key].append(grad)
        totals = self._accumulate(stage, found[len(wrt):]) if weights else []
        # The gradients fed in are launched too (the last stage's ones_like): autograd's
        # worker thread may hold them past the step, like the microbatch's gradients.
        return [g for g in input_grads if g is not None] + totals + output_grads

    def _accumulate(self, stage: int, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """Add one microbatch's weight gradients to the stage's sums; returns the sums
        and the microbatch's own gradients, all to be launched together.

        The microbatch's gradients are launched too because autograd's worker thread
        can still hold them (in its finished graph task) after the step returns: left
        pending, they joined the next graph run on that device, which then compiled a
        program of its own (seen: a new compile at the fifth or sixth step, now and then).
        """
        totals = self.accumulated[stage]
        for index, grad in enumerate(grads):
            if grad is not None:
                totals[index] = grad if totals[index] is None else totals[index] + grad
        summed = [t for t in totals if t is not None]
        return summed + [g for g in grads if g is not None and not any(g is t for t in summed)]

    def _as_leaves(self, program: StageProgram, args: list[Any]) -> list[Any]:
        """``args`` as fresh autograd leaves where their gradients go somewhere (back to the
        stage that made them, or out as the gradient of a model input)."""
        return [_differentiable(a) if n in self.differentiable else a for n, a in zip(program.inputs, args)]

    def _rows(self, microbatch: int) -> int:
        """Rows of ``microbatch``, read from the model's first input."""
        return rows(next(iter(self.inputs[microbatch].values())))

    def _received_grad(self, microbatch: int, key: tuple[str, int], device: torch.device) -> torch.Tensor | None:
        """The gradient of a value's leaf, summed over the stages that read it."""
        parts = [_moved(part, device) for part in self.received[microbatch].pop(key, [])]
        return functools.reduce(operator.add, parts) if parts else None

    def end_forward(self) -> list[torch.Tensor]:
        """The model's outputs, microbatches merged; the values that crossed between
        stages are let go (each reader keeps its own copy if it needs one)."""
        outputs, self.outputs, self.values = self.outputs, [], []
        return [_merge(list(parts), self.microbatch_dim, self.scalar_shares) for parts in zip(*outputs)]

    @functools.cached_property
    def scalar_shares(self) -> list[torch.Tensor | float]:
        """How much each microbatch's scalar output (the model's own loss) weighs in the
        batch's: its share of the items the loss averages over (:mod:`xpipe.reduction`)."""
        module = self.pipeline._module[0]
        last = self.pipeline.stage_devices[-1]
        items = [model_loss_items(module, {name: _on_host(value) if name == "labels" else value
                                           for name, value in inputs.items()}) for inputs in self.inputs]
        return [_moved(share, last) for share in shares(items)]

    def set_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        sizes = [self._rows(microbatch) for microbatch in range(self.chunks)]
        split = [[None] * self.chunks if g is None else
                 [g * share for share in self.scalar_shares] if g.dim() == 0 else
                 _split(g, sizes, self.microbatch_dim) for g in grads]
        last = self.pipeline.stage_devices[-1]
        self.output_grads = [[_moved(g, last) for g in per_leaf] for per_leaf in zip(*split)]

    def parameter_grads(self) -> list[torch.Tensor | None]:
        """The step's gradient of each stage's weights, in ``stage_parameters`` order; a
        tied weight's copy's gradient moved to the device of the Parameter it copies."""
        ties = self.pipeline.ties
        used = [p for stage in range(len(self.accumulated)) for p in self.pipeline.stage_parameters(stage)]
        grads = [grad for totals in self.accumulated for grad in totals]
        return [g if g is None or ties.owner(p) is p else g.to(ties.owner(p).device) for p, g in zip(used, grads)]

    def accumulate_into_grads(self, model_inputs: list[torch.Tensor]) -> None:
        """Add the step's gradients to ``.grad`` of the weights and of ``model_inputs``
        (the model inputs that require grad), as ``loss.backward()`` would."""
        parameters = [self.pipeline.ties.owner(p) for stage in range(len(self.accumulated))
                      for p in self.pipeline.stage_parameters(stage)]
        grads = self.parameter_grads() + self.model_input_grads(tuple(model_inputs))
        with torch.no_grad():
            for tensor, grad in zip(parameters + model_inputs, grads):
                if grad is not None:
                    tensor.grad = grad if tensor.grad is None else tensor.grad + grad

    def model_input_grads(self, originals: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """The gradients of the model inputs that require grad, microbatches merged."""
        grads = []
        for (name, leaf), original in zip(self.input_grads, originals):
            parts = [self.received[m].pop((name, leaf), []) for m in range(self.chunks)]
            if not any(parts):
                grads.append(None)
                continue
            pieces = [functools.reduce(operator.add, [_moved(g, original.device) for g in part]) if part
                      else torch.zeros_like(tree_flatten(piece[name])[0][leaf]).to(original.device)
                      for part, piece in zip(parts, self.inputs)]
            grads.append(_merge(pieces, self.microbatch_dim, [1.0] * self.chunks))  # a scalar's gradients add
        return grads


class _Kept(NamedTuple):
    """The outputs of a microbatch that keeps its activations (with their autograd graph)."""

    outputs: Any


class _PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node, so its backward runs the schedule's
    backward cells in order instead of autograd's own traversal order."""

    @staticmethod
    def forward(ctx, step: _Step, *inputs_then_parameters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.step = step
        ctx.inputs = inputs_then_parameters[:len(step.input_grads)]
        step.pipeline.run_cells(step.plan.forward, step.forward_cell)
        step.pipeline.batch_norm.commit()
        return tuple(step.end_forward())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        step.set_output_grads(grads)
        step.pipeline.run_cells(step.plan.backward, step.cell)
        input_grads = step.model_input_grads(ctx.inputs)
        del ctx.step, ctx.inputs
        return (None, *input_grads, *step.parameter_grads())


class _Loss:
    """``pipe.step``'s loss, one microbatch at a time: each microbatch's loss is weighted
    so that their sum is ``loss_fn`` of the whole batch: by its share of the items a
    mean-reducing ``loss_fn`` averages over (rows, or the targets it does not ignore:
    :mod:`xpipe.reduction`), by 1 for one whose ``reduction`` is ``"sum"``.

    A ``loss_fn`` that does not say how it reduces (a function of the user's) is taken
    to mean over rows, and checked once, on its first step: if ``loss_fn`` of the whole
    batch differs from the weighted microbatch losses, the step raises.
    """

    def __init__(self, fn: Callable[[Any, Any], torch.Tensor], targets: list[Any], device: torch.device,
                 check: bool) -> None:
        items = [loss_fn_items(fn, _on_host(target)) for target in targets]
        self.fn = fn
        self.targets = [_moved(target, device) for target in targets]
        self.weights = [1.0] * len(items) if items[0] is None else [_moved(w, device) for w in shares(items)]
        self.values: list[torch.Tensor | None] = [None] * len(items)  # each microbatch's share, detached
        self.outputs: list[Any] | None = [None] * len(items) if check else None  # kept for the check

    def share(self, microbatch: int, output: Any) -> torch.Tensor:
        """``microbatch``'s share of the loss, from its output."""
        loss = self.fn(output, self.targets[microbatch])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(f"loss_fn: must return a scalar tensor, got "
                             f"{list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if self.outputs is not None:
            self.outputs[microbatch] = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)
        return weighted(loss, self.weights[microbatch])

    def total(self) -> torch.Tensor:
        """The step's loss: the shares summed."""
        return functools.reduce(operator.add, self.values)

    def check_reduction(self, microbatch_dim: int | None, scalar_shares: list[torch.Tensor | float]) -> bool:
        """Raise unless ``loss_fn`` of the whole batch is the weighted microbatch losses;
        False (nothing to compare: check another batch) where that loss is NaN or inf."""
        host_shares = _on_host(scalar_shares)
        whole_output, whole_target = (_merged_on_host(parts, microbatch_dim, host_shares)
                                      for parts in (self.outputs, self.targets))
        total = self.total()
        expected, got = self.fn(whole_output, whole_target).detach().float(), total.cpu().float()
        if not torch.isfinite(expected):
            return False
        if not torch.isfinite(got):
            raise ValueError(
                f"loss_fn: the step's loss is {got.item()} where the whole batch's is {expected.item():.6g}: a "
                "microbatch's loss is NaN or inf (a mean over no target, if all of a microbatch's targets are "
                "ignored). Say how it reduces: give the function `reduction` ('mean') and `ignore_index` "
                "attributes, or pass a torch loss such as nn.CrossEntropyLoss(ignore_index=-100)")
        tolerance = 1e-4 if total.dtype in (torch.float32, torch.float64) else 2e-2
        if not torch.allclose(got, expected, rtol=tolerance, atol=1e-6):
            raise ValueError(
                f"loss_fn: on the whole batch it gives {expected.item():.6g}, and its microbatches' losses weighted "
                f"by their rows give {got.item():.6g}: it does not mean over rows (it sums, or ignores some targets), "
                "and pipe.step would train on the wrong loss. Say how it reduces: give the function a "
                "`reduction` attribute ('sum', or 'mean' with `ignore_index` for ignored integer targets), or "
                "pass a torch loss such as nn.CrossEntropyLoss(ignore_index=-100)")
        return True


def _grads(tensors: list[torch.Tensor]) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Each tensor's ``.grad`` now, and a copy of its values (autograd adds into it in place)."""
    return {tensor: None if tensor.grad is None else (tensor.grad, tensor.grad.clone()) for tensor in tensors}


def _restore_grads(saved: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Put back the ``.grad`` objects and values that :func:`_grads` saved."""
    with torch.no_grad():
        for tensor, before in saved.items():
            if before is not None:
                before[0].copy_(before[1])
            tensor.grad = None if before is None else before[0]


def _merged_on_host(microbatches: list[Any], microbatch_dim: int | None,
                    scalar_shares: list[torch.Tensor | float]) -> Any:
    """The microbatches' values (each a tensor or a structure of them) as one batch on the host."""
    flat = [tree_flatten(_on_host(value)) for value in microbatches]
    merged = [_merge(list(parts), microbatch_dim, scalar_shares) for parts in zip(*[leaves for leaves, _ in flat])]
    return tree_unflatten(merged, flat[0][1])


def _smaller(schedule: Schedule, chunks: int) -> Schedule:
    """``schedule`` for a last batch that splits into fewer microbatches."""
    try:
        return by_name(schedule.name, schedule.stages, chunks, schedule.virtual)
    except ValueError as error:
        raise ValueError(f"x: this batch splits into {chunks} microbatches, which {schedule.name!r} cannot run "
                         f"({error}); give batches that split into chunks={schedule.chunks}") from error


def _backward_phase(schedule: Schedule) -> list[list[Action]] | None:
    """The backward cells by clock, if all forwards come first and every backward is
    whole: then autograd can run them as the backward of ``pipe(x)``. None otherwise."""
    kinds = {cell.kind for row in schedule.table for cell in row if cell is not None}
    forward_ends = max(t for t, row in enumerate(schedule.table) if any(c and c.kind == FORWARD for c in row))
    backward_starts = min(t for t, row in enumerate(schedule.table) if any(c and c.kind != FORWARD for c in row))
    if forward_ends >= backward_starts or kinds != {FORWARD, BACKWARD}:
        return None
    return _cells_by_clock(schedule, (BACKWARD,))


def _cells_by_clock(schedule: Schedule, kinds: tuple[str, ...]) -> list[list[Action]]:
    """The table's cells of ``kinds``, by clock, idle cells and empty clocks left out."""
    clocks = [[cell for cell in row if cell is not None and cell.kind in kinds] for row in schedule.table]
    return [cells for cells in clocks if cells]


@contextlib.contextmanager
def _guard_failures_explained() -> Iterator[None]:
    """A batch that does not fit the graph torch.export captured fails a shape guard
    deep inside a stage; say what to do instead."""
    try:
        yield
    except AssertionError as error:
        if "Guard failed" not in str(error):
            raise
        raise ValueError(
            f"x: the model was captured by torch.export on sample_input, and this microbatch does not fit "
            f"that graph ({error}); pass a sample_input shaped like your batches (only the batch dim may "
            "differ)") from error


def _bytes(values: list[Any]) -> int:
    """Bytes of the tensors among ``values`` and inside their structures."""
    return sum(v.numel() * v.element_size() for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))


def _keyed_leaves(names: tuple[str, ...], values: Any) -> list[tuple[tuple[str, int], Any]]:
    """The leaves of each named value (a tensor, or a tuple or dict of them), keyed
    (name, leaf index): a value that crosses a cut may be a structure."""
    return [((name, index), leaf) for name, value in zip(names, values)
            for index, leaf in enumerate(tree_flatten(value)[0])]


def _split(x: Any, chunks: int | list[int], microbatch_dim: int | None) -> list[Any]:
    """``_split_tensor`` for each leaf of ``x`` (a tensor, or a tuple of them): a list of microbatches."""
    leaves, spec = tree_flatten(x)
    pieces = [_split_tensor(leaf, chunks, microbatch_dim) for leaf in leaves]
    return [tree_unflatten(list(parts), spec) for parts in zip(*pieces)]


def _split_tensor(x: torch.Tensor, chunks: int | list[int], microbatch_dim: int | None) -> list[torch.Tensor]:
    """The microbatches of ``x``: ``chunks`` of them (a batch that ``chunks`` does not
    divide gives a smaller last piece, or fewer pieces, as ``torch.chunk`` does), or
    pieces of the given row counts. On an XLA device they are computed together, so
    each is device data rather than a slice whose offset would make its own graph."""
    if microbatch_dim is not None:
        pieces = list(x.unbind(microbatch_dim))
    elif isinstance(chunks, int):
        pieces = list(x.chunk(chunks, 0))
    else:
        pieces = list(x.split(chunks, 0))
    _launch(_xla_tensors(pieces))
    return pieces


def _merge(parts: list[torch.Tensor], microbatch_dim: int | None,
           scalar_shares: list[torch.Tensor | float]) -> torch.Tensor:
    """One output from its microbatches' parts; a scalar (a loss) is their sum weighted
    by ``scalar_shares``."""
    if parts[0].dim() == 0:
        return functools.reduce(operator.add, [weighted(part, share) for part, share in zip(parts, scalar_shares)])
    if microbatch_dim is not None:
        return torch.stack(parts, microbatch_dim)
    return torch.cat(parts, 0)


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or a structure of them) on ``device``."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, value)


def _on_host(value: Any) -> Any:
    """``value`` with its XLA tensors copied to the host. What is counted from a batch
    (its items: :mod:`xpipe.reduction`) is counted there: counted lazily on the device
    from the microbatches, it made later graphs of the step compute wrong losses."""
    return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) and v.device.type == "xla" else v, value)


def _differentiable(value: Any) -> Any:
    """``value`` with each floating tensor a fresh autograd leaf that collects its gradient."""
    return tree_map(lambda v: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v, value)


def _xla_tensors(values: list[Any]) -> list[torch.Tensor]:
    """The XLA tensors among ``values`` and inside their structures."""
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor) and v.device.type == "xla"]


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
    """Undo what a recomputation writes to buffers (BatchNorm's ``num_batches_tracked``,
    any module's own): the forward pass already counted this microbatch.

    The copies are computed at once: a pending copy would read device data that
    the recomputation's own run gives away when it updates the buffer in place.
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    _launch(_xla_tensors([before for _, before in buffers]))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
