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
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from xpipe._batch import check_outputs
from xpipe._batchnorm import RunningStatistics
from xpipe.devices.stages import StagedModel, StageProgram
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
    """Runs a model cut into stages on one XLA device per stage, as a schedule orders.

    Args:
        staged: the model cut into stage programs; each stage's parameters and
            buffers must already be on its device.
        devices: one XLA device per stage.
        schedule: the step's schedule; all its forward cells must come before its
            backward cells. A last batch with fewer rows than ``schedule.chunks``
            runs the same schedule for the microbatches it has.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``.
        module: the wrapped module, whose state the stages train in place.
        deferred_batch_norm: update BatchNorm running statistics once per step
            (:mod:`xpipe._batchnorm`) instead of once per microbatch.

    Attributes:
        timeline: an :class:`Event` for every cell of the last step, forward and
            backward, filled in as the devices finish; after
            ``torch_xla.core.xla_model.wait_device_ops()`` it is complete.
    """

    def __init__(self, staged: StagedModel, devices: list[torch.device], schedule: Schedule,
                 checkpoint: str, module: nn.Module, *, deferred_batch_norm: bool = False) -> None:
        super().__init__()
        self.staged = staged
        self.stage_modules = nn.ModuleList(program.module for program in staged.stages)
        self.devices = devices
        self.schedule = schedule
        self.chunks = schedule.chunks
        self.clocks = {schedule.chunks: _clocks(schedule)}  # microbatches -> (forward, backward) cells
        self.checkpoint = checkpoint
        self.batch_norm = RunningStatistics(list(self.stage_modules), deferred=deferred_batch_norm)
        self.timeline: list[Event] = []
        self._flush_pending = False
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
        captured = self.staged.captured_training
        if captured is not None and captured != self.training:
            mode = {True: "train", False: "eval"}
            raise RuntimeError(
                f"pipe: the model was captured by torch.export in {mode[captured]} mode, which fixes dropout "
                f"in its graph, and the Pipe is now in {mode[self.training]} mode. Build the Pipe with the model "
                f"in the mode you run it (model.{mode[self.training]}() before xpipe.Pipe(...))")
        self.flush()
        if not self._flush_pending:
            xm.add_step_closure(self.flush)
            self._flush_pending = True
        self.timeline = []
        split = [_split(x, self.chunks, microbatch_dim) for x in inputs]
        differentiating = torch.is_grad_enabled()
        wanted = [(key, x) for key, x in _keyed_leaves(names, inputs)
                  if differentiating and isinstance(x, torch.Tensor) and x.requires_grad]
        step = _Step(self, [dict(zip(names, values)) for values in zip(*split)], microbatch_dim,
                     differentiating=differentiating, input_grads=[key for key, _ in wanted])
        parameters = [p for stage in range(len(self.devices)) for p in self.stage_parameters(stage)]
        try:
            leaves = _PipelineFunction.apply(step, *[x for _, x in wanted], *parameters)
        except AssertionError as error:
            if "Guard failed" not in str(error):
                raise
            raise ValueError(
                f"x: the model was captured by torch.export on sample_input, and this microbatch does not fit "
                f"that graph ({error}); pass a sample_input shaped like your batches (only the batch dim may "
                "differ)") from error
        output = tree_unflatten(list(leaves), step.output_spec)
        if self.staged.output_spec is not None:  # torch.export's flat outputs, folded as the model returns them
            output = tree_unflatten(list(output), self.staged.output_spec)
        return output

    def clocks_for(self, chunks: int) -> tuple[list[list[Action]], list[list[Action]]]:
        """Forward and backward cells by clock, for a step of ``chunks`` microbatches."""
        if chunks not in self.clocks:
            self.clocks[chunks] = _clocks(by_name(self.schedule.name, len(self.devices), chunks))
        return self.clocks[chunks]

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
                 microbatch_dim: int | None, *, differentiating: bool, input_grads: list[tuple[str, int]]) -> None:
        self.pipeline = pipeline
        self.differentiating = differentiating  # False under torch.no_grad(): nothing to keep
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
        statistics = self.pipeline.batch_norm.updating()
        if self.keeps(microbatch):
            args = self._as_leaves(program, args)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_collect_into(saved), _itself), \
                    statistics:
                out = program.module(*args)
            self.kept[stage, microbatch] = (args, _Kept(out))
        else:
            if self.differentiating:
                self.kept[stage, microbatch] = (args, xm.get_rng_state(device))
            with torch.no_grad(), statistics:
                out = program.module(*args)
        if stage == len(self.pipeline.devices) - 1:
            check_outputs(out, self._rows(microbatch))
            leaves, self.output_spec = tree_flatten(out)
            self.outputs[microbatch] = leaves
        else:
            leaves = list(out)
            self.values[microbatch].update(zip(program.outputs, leaves))
        return _xla_tensors(leaves) + _xla_tensors(saved)

    def backward_cell(self, action: Action) -> list[torch.Tensor]:
        stage, microbatch = action.stage, action.microbatch
        program = self.pipeline.staged.stages[stage]
        args, kept = self.kept.pop((stage, microbatch))
        if isinstance(kept, _Kept):
            return self._gradients(stage, microbatch, args, kept.outputs)
        args = self._as_leaves(program, args)
        # Buffers come back only after the gradients: a backward may read a buffer that the
        # recomputation wrote (BatchNorm's counter), and would see it changed in place.
        with _buffers_restored(program.module):
            with torch.enable_grad(), _rng_replayed(self.pipeline.devices[stage], kept), \
                    self.pipeline.batch_norm.recomputing():
                out = program.module(*args)
            gradients = self._gradients(stage, microbatch, args, out)
        # Launched with the gradients: restored buffers left pending while the device runs
        # the gradients' graph read device data that run gives away (seen: the next
        # recomputed BatchNorm of the stage gave wrong outputs).
        return gradients + _xla_tensors(list(program.module.buffers()))

    def _gradients(self, stage: int, microbatch: int, args: list[Any], out: Any) -> list[torch.Tensor]:
        """Gradients of a stage's inputs (sent on to their makers) and weights (summed)."""
        program = self.pipeline.staged.stages[stage]
        device = self.pipeline.devices[stage]
        if stage == len(self.pipeline.devices) - 1:
            leaves, grads = tree_flatten(out)[0], self.output_grads[microbatch]
        else:
            keyed = _keyed_leaves(program.outputs, out)
            leaves = [leaf for _, leaf in keyed]
            grads = [self._received_grad(microbatch, key, device) for key, _ in keyed]
        pairs = [(o, g) for o, g in zip(leaves, grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            return []
        wrt = [(key, a) for key, a in _keyed_leaves(program.inputs, args)
               if isinstance(a, torch.Tensor) and a.requires_grad]
        parameters = self.pipeline.stage_parameters(stage)
        found = torch.autograd.grad([o for o, _ in pairs], [a for _, a in wrt] + parameters,
                                    [g for _, g in pairs], allow_unused=True)
        input_grads = found[:len(wrt)]
        for (key, _), grad in zip(wrt, input_grads):
            if grad is not None:
                self.received[microbatch][key].append(grad)
        totals = self.accumulated[stage]
        for index, grad in enumerate(found[len(wrt):]):
            if grad is not None:
                totals[index] = grad if totals[index] is None else totals[index] + grad
        return [g for g in input_grads if g is not None] + [t for t in totals if t is not None]

    def _as_leaves(self, program: StageProgram, args: list[Any]) -> list[Any]:
        """``args`` as fresh autograd leaves where their gradients go somewhere (back to the
        stage that made them, or out as the gradient of a model input)."""
        return [_differentiable(a) if n in self.differentiable else a for n, a in zip(program.inputs, args)]

    def _rows(self, microbatch: int) -> int:
        """Rows of ``microbatch``, read from the model's first input."""
        return tree_flatten(next(iter(self.inputs[microbatch].values())))[0][0].shape[0]

    def _received_grad(self, microbatch: int, key: tuple[str, int], device: torch.device) -> torch.Tensor | None:
        """The gradient of a value's leaf, summed over the stages that read it."""
        parts = [_moved(part, device) for part in self.received[microbatch].pop(key, [])]
        return functools.reduce(operator.add, parts) if parts else None

    def end_forward(self) -> list[torch.Tensor]:
        """The model's outputs, microbatches merged; the values that crossed between
        stages are let go (each reader keeps its own copy if it needs one)."""
        outputs, self.outputs, self.values = self.outputs, [], []
        return [_merge(list(parts), self.microbatch_dim) for parts in zip(*outputs)]

    def set_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        rows = [self._rows(microbatch) for microbatch in range(self.chunks)]
        split = [[None] * self.chunks if g is None else
                 [g / self.chunks] * self.chunks if g.dim() == 0 else  # a scalar output is the microbatches' mean
                 _split(g, rows, self.microbatch_dim) for g in grads]
        last = self.pipeline.devices[-1]
        self.output_grads = [[_moved(g, last) for g in per_leaf] for per_leaf in zip(*split)]

    def parameter_grads(self) -> list[torch.Tensor | None]:
        return [grad for totals in self.accumulated for grad in totals]

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
            grads.append(_merge(pieces, self.microbatch_dim))
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
        forward, _ = step.pipeline.clocks_for(step.chunks)
        step.pipeline.run_cells(forward, step.forward_cell)
        step.pipeline.batch_norm.commit()
        return tuple(step.end_forward())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        step: _Step = ctx.step
        step.set_output_grads(grads)
        _, backward = step.pipeline.clocks_for(step.chunks)
        step.pipeline.run_cells(backward, step.backward_cell)
        input_grads = step.model_input_grads(ctx.inputs)
        del ctx.step, ctx.inputs
        return (None, *input_grads, *step.parameter_grads())


def _clocks(schedule: Schedule) -> tuple[list[list[Action]], list[list[Action]]]:
    """The schedule's forward cells by clock, then its backward cells by clock."""
    return _cells_by_clock(schedule, FORWARD), _cells_by_clock(schedule, BACKWARD)


def _cells_by_clock(schedule: Schedule, kind: str) -> list[list[Action]]:
    kinds = {cell.kind for row in schedule.table for cell in row if cell is not None}
    forward_ends = max((t for t, row in enumerate(schedule.table) if any(c and c.kind == FORWARD for c in row)))
    backward_starts = min((t for t, row in enumerate(schedule.table) if any(c and c.kind != FORWARD for c in row)))
    if forward_ends >= backward_starts or kinds != {FORWARD, BACKWARD} or schedule.virtual != 1:
        raise ValueError(f"schedule: {schedule.name!r} interleaves forward and backward cells (or splits the "
                         "backward, or puts several model stages on a device); the devices executor runs all "
                         "forward cells before the backward pass, one stage per device (use 'gpipe')")
    rows = [[cell for cell in row if cell is not None and cell.kind == kind] for row in schedule.table]
    return [row for row in rows if row]


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


def _merge(parts: list[torch.Tensor], microbatch_dim: int | None) -> torch.Tensor:
    """One output from its microbatches' parts; a scalar (a loss) is their mean."""
    if parts[0].dim() == 0:
        return torch.stack(parts).mean()
    if microbatch_dim is not None:
        return torch.stack(parts, microbatch_dim)
    return torch.cat(parts, 0)


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or a structure of them) on ``device``."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, value)


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
