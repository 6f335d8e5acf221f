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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch_xla.core.xla_model as xm
from torch import nn
from torch.utils._pytree import tree_map, tree_unflatten

from xpipe._batch import rows
from xpipe._batchnorm import RunningStatistics
from xpipe._xla import launch_device, on_ready, settle_autograd
from xpipe.devices.loss import StepLoss, restore_grads, saved_grads
from xpipe.devices.microbatch import keyed_leaves, launch, microbatches_of, on_host
from xpipe.devices.stages import StagedModel
from xpipe.devices.state import ModuleState
from xpipe.devices.step import PipelineFunction, Step, StepCells
from xpipe.devices.ties import TiedCopies
from xpipe.recompute import kept_cells
from xpipe.reduction import declares_reduction, tells_reductions_apart
from xpipe.schedule import BACKWARD, FORWARD, Action, Schedule, by_name


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
        self.step_cells: dict[int, StepCells] = {}  # by microbatch count
        self.batch_norm = RunningStatistics(list(self.stage_modules), deferred=deferred_batch_norm)
        self.ties = TiedCopies(list(self.stage_modules), self.stage_devices)
        self.ties.refresh()
        self.timeline: list[Event] = []
        self.peak_held_bytes = [0] * len(devices)
        self._held_bytes = [0] * len(devices)
        self._flush_pending = False
        self.checked_losses: list[Callable] = []  # undeclared loss_fns a step confirmed to mean over rows
        self.state = ModuleState(module)  # out of the module tree: its parameters are the stages' own

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model's positional inputs."""
        return self.staged.inputs

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
            launch_device(device)

    def cells_for(self, chunks: int) -> StepCells:
        """The cells of a step of ``chunks`` microbatches."""
        if chunks not in self.step_cells:
            schedule = self.schedule if chunks == self.chunks else _smaller(self.schedule, chunks)
            self.step_cells[chunks] = StepCells(schedule, _cells_by_clock(schedule, (FORWARD,)),
                                                _backward_phase(schedule), kept_cells(schedule, self.checkpoint))
        return self.step_cells[chunks]

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None) -> Any:
        self._begin(inputs, microbatch_dim)
        split = [microbatches_of(x, self.chunks, microbatch_dim) for x in inputs]
        cells = self.cells_for(len(split[0]))
        differentiating = torch.is_grad_enabled()
        if differentiating and cells.backward is None:
            raise RuntimeError(
                f"pipe: schedule {cells.schedule.name!r} interleaves forwards and backwards, so autograd cannot run "
                "its backward from pipe(x)'s output; train with Pipe(..., loss_fn=...) and pipe.step(inputs, "
                "target), or call pipe(x) under torch.no_grad() for inference")
        wanted = [(key, x) for key, x in keyed_leaves(self.staged.inputs, inputs)
                  if differentiating and isinstance(x, torch.Tensor) and x.requires_grad]
        step = Step(self, cells, split, microbatch_dim, differentiating=differentiating,
                     input_grads=[key for key, _ in wanted])
        parameters = [self.ties.owner(p) for stage in range(len(self.stage_modules))
                      for p in self.stage_parameters(stage)]
        with _guard_failures_explained():
            leaves = PipelineFunction.apply(step, *[x for _, x in wanted], *parameters)
        return self.folded(tree_unflatten(list(leaves), step.output_spec))

    def step(self, inputs: tuple[Any, ...], target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             microbatch_dim: int | None = None) -> torch.Tensor:
        """Run one training step as the schedule's table orders it: every forward, the
        loss of each microbatch on the last stage, and every backward, leaving in
        ``.grad`` the gradients of ``loss_fn(module(inputs), target)``; returns the loss."""
        self._begin(inputs, microbatch_dim)
        split = [microbatches_of(x, self.chunks, microbatch_dim) for x in inputs]
        cells = self.cells_for(len(split[0]))
        chunks = [rows(piece) for piece in split[0]] if microbatch_dim is None else self.chunks
        targets = microbatches_of(target, chunks, microbatch_dim)
        if len(targets) != len(split[0]):
            raise ValueError(f"target: splits into {len(targets)} microbatches, the inputs into {len(split[0])}; "
                             "give the target the inputs' batch size (and microbatch_dim)")
        wanted = [(key, x) for key, x in keyed_leaves(self.staged.inputs, inputs)
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        step = Step(self, cells, split, microbatch_dim, differentiating=True, input_grads=[key for key, _ in wanted])
        # A loss that does not say how it reduces is checked on its first step, and on every batch whose
        # targets would weigh the microbatches otherwise if it ignored some target value.
        undeclared = not declares_reduction(loss_fn)
        check = undeclared and (loss_fn not in self.checked_losses or tells_reductions_apart(on_host(targets)))
        step.loss = StepLoss(loss_fn, targets, self.stage_devices[-1], check)
        grads_before = saved_grads([*self.state.module.parameters(), *(x for _, x in wanted)]) if check else {}
        with _guard_failures_explained():
            self.run_cells(cells.schedule.table, step.cell)
        settle_autograd(self.devices)
        self.batch_norm.commit()
        step.gradients.accumulate_into_grads([x for _, x in wanted])
        if check:
            try:
                if step.loss.check_reduction(microbatch_dim, step.scalar_shares) and loss_fn not in self.checked_losses:
                    self.checked_losses.append(loss_fn)
            except ValueError:
                restore_grads(grads_before)  # a refused step leaves every gradient as it was
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

    def folded(self, output: Any) -> Any:
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
                launch(tensors)
                if tensors:
                    self._on_ready(tensors[0], action, launched)
                else:  # nothing for the device to do (an I with no input that needs a gradient)
                    self.timeline.append(Event(action.stage, action.kind, action.microbatch, launched, launched))

    def _on_ready(self, tensor: torch.Tensor, action: Action, launched: float) -> None:
        timeline = self.timeline  # this step's: the callback may come after the next step began

        def record() -> None:
            timeline.append(Event(action.stage, action.kind, action.microbatch, launched, time.perf_counter()))

        on_ready(tensor, record)


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


