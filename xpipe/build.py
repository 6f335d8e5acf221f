"""How ``xpipe.Pipe(...)`` decides and builds: once each, every refusal first.

A Pipe captures its model once (:class:`ModelCapture`), chooses its executor from
that capture (:func:`choose_executor`), then builds: one partition, one schedule
(the one the user named, for the stage count and microbatches the executor runs),
handed to the executor that interprets it. Every argument the executor needs is
checked before any device work: the SPMD mode is entered, and weights move onto
XLA devices, only once nothing can refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn

from xpipe._checks import check_positive_int
from xpipe._retired import retire
from xpipe._xla import can_enter_spmd, move_keeping_ties, rebind, warm_autograd
from xpipe.capture.stacking import StackedModel, block_inputs, cut_for_stacking, vmappable
from xpipe.capture.trace import Captured, as_operations, place_constants_on, trace_layers
from xpipe.devices.executor import DevicesPipeline
from xpipe.devices.stages import cut_into_stages
from xpipe.layout import spread
from xpipe.mesh import axes_of, make_mesh, mesh_axes, spmd_device
from xpipe.partition import Partition, partition_captured, rebalanced, spmd_balance, spmd_partition
from xpipe.recompute import check_lockstep
from xpipe.reduction import model_loss_items_each
from xpipe.schedule import Schedule, by_name, check_ring_chunks
from xpipe.spmd.clock import SpmdOptions
from xpipe.spmd.executor import AUTO_SCHEDULES
from xpipe.spmd.executor import SCHEDULES as SPMD_SCHEDULES
from xpipe.spmd.executor import SpmdPipeline, padded_chunks
from xpipe.spmd.sequence_parallel import check_sequence_dim
from xpipe.tensor.inference import CannotInfer, infer_tensor_dims
from xpipe.tensor.joined_projections import join_column_parallel
from xpipe.tensor.packed_projections import CannotSplitPacked, PackedLinear, split_packed
from xpipe.tensor.rules import (Packed, Rule, Rules, check_convolutions, check_head_counts, covered_by,
                                key_value_heads_of, split_dim)
from xpipe.tensor.splits import block_splits

EXECUTORS = ("auto", "spmd", "devices")


class Options(NamedTuple):
    """What a Pipe was asked for, checked: the arguments the builds read."""

    chunks: int
    stages: int | None
    balance: Sequence[int] | None
    mesh: xs.Mesh | None
    schedule: str
    virtual: int
    checkpoint: str
    deferred_batch_norm: bool
    tensor_rules: dict[str, int | None]
    gather: str = "step"
    sequence_parallel: bool = False


class Built(NamedTuple):
    """A Pipe's executor and what it runs."""

    runner: nn.Module
    partition: Partition
    schedule: Schedule
    mesh: xs.Mesh | None
    devices: list[torch.device]


class ModelCapture:
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


def choose_executor(executor: str, capture: ModelCapture, options: Options) -> str:
    """``executor``, with ``"auto"`` resolved: spmd for a mesh, an SPMD process or a
    model with a stackable run of at least one identical block per stage and a
    layer per model stage (and a stage count that divides the devices), when the
    schedule is one spmd runs and the process has not used XLA devices outside
    SPMD mode; devices otherwise. Touches no device."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor: {executor!r} is not an executor; use one of {', '.join(EXECUTORS)}")
    if executor != "auto":
        return executor
    if options.mesh is not None or xr.is_spmd():
        return "spmd"
    if options.schedule not in AUTO_SCHEDULES or not can_enter_spmd():
        return "devices"  # a schedule spmd does not run, or XLA devices already used without SPMD
    requested = requested_stages(options.stages, options.balance, options.virtual)
    devices = xr.global_runtime_device_count()
    stages = devices if requested is None else check_positive_int(requested, "stages")
    if devices % stages:
        return "devices"  # no data x stage mesh has this many stages
    try:
        whole, stacked = capture.whole(), capture.stacked()
    except ValueError:
        return "devices"
    blocks = len(stacked.blocks)  # what build_spmd accepts: a block per stage, a layer per model stage
    fits = blocks >= stages and min(spmd_balance(whole, spread(blocks, stages * options.virtual))) >= 1
    return "spmd" if fits else "devices"


class SpmdLayout(NamedTuple):
    """What the spmd executor runs for a Pipe's options, read and checked before any
    device work: the schedule, the partition, each block weight's split dim over
    "tensor", and the block templates (packed and joined projections rewritten)."""

    schedule: Schedule
    partition: Partition
    dims: list[int | None]
    templates: dict[bool, torch.fx.GraphModule]
    packed: list[PackedLinear]


def build_spmd(capture: ModelCapture, options: Options) -> Built:
    """The spmd executor over ``options.mesh`` (or ``make_mesh(stages)``), every
    argument checked before the process enters SPMD mode."""
    module = capture.module
    stages = spmd_stage_count(options.mesh, options.stages, options.balance, options.virtual)
    tensor = axes_of(options.mesh).tensor if options.mesh is not None else 1
    layout = checked_spmd_layout(capture, options, stages, tensor)
    stacked = capture.stacked()
    mesh = options.mesh if options.mesh is not None else make_mesh(stages)  # the process enters SPMD mode here
    device = spmd_device()
    rebind(module, move_keeping_ties([stacked.pre, stacked.post], device))
    for piece in {stacked.pre, *stacked.blocks, stacked.post, *layout.templates.values()}:  # templates' constants
        place_constants_on(piece, device)
    spmd_options = SpmdOptions(layout.schedule, options.chunks, options.checkpoint, layout.dims, options.gather,
                               layout.templates, layout.packed, options.sequence_parallel,
                               partial(model_loss_items_each, module))
    runner = SpmdPipeline(stacked, mesh, device, tie_groups(module), spmd_options)
    retire(module, [p for block in stacked.blocks for p in block.parameters()])
    return Built(runner, layout.partition, layout.schedule, mesh, [device])


def checked_spmd_layout(capture: ModelCapture, options: Options, stages: int, tensor: int) -> SpmdLayout:
    """Every check the spmd executor makes of ``options`` on ``stages`` stages and
    ``tensor`` tensor devices, and what they read: touches no device, so the planner's
    tests can ask it of every layout the planner lists."""
    module = capture.module
    if options.schedule not in SPMD_SCHEDULES:
        names = ", ".join(map(repr, SPMD_SCHEDULES[:-1])) + f" and {SPMD_SCHEDULES[-1]!r}"
        raise ValueError(f"schedule: the spmd executor runs {names} (its clock loops are GPipe's fill-drain, once "
                         f"or round the stage ring, and 1F1B's), not {options.schedule!r}; use one of those, or "
                         "executor='devices'")
    if options.schedule == "1f1b":
        check_lockstep(options.checkpoint)
    if options.schedule == "circular":  # what the ring cannot run is refused for the chunks asked for
        check_ring_chunks(stages, options.chunks, options.virtual)
    schedule = by_name(options.schedule, stages, padded_chunks(options.chunks, stages), options.virtual)
    if options.sequence_parallel and tensor == 1:
        raise ValueError("sequence_parallel: it splits the stream's sequence over the mesh's \"tensor\" axis, and "
                         "this mesh has none (or one of size 1); build it with xpipe.make_mesh(..., tensor=N), "
                         "N > 1, or leave sequence_parallel off")
    check_head_counts(module, tensor)
    whole, stacked = capture.whole(), capture.stacked()
    if len(stacked.blocks) < stages:
        raise ValueError(f"stages: the model's body (its longest run of identical blocks) has "
                         f"{len(stacked.blocks)} blocks, fewer than the {stages} stages; use at most "
                         f"{len(stacked.blocks)} stages, or executor='devices'")
    partition = spmd_partition(whole, spread(len(stacked.blocks), stages * options.virtual), options.balance)
    names = [name for name, _ in stacked.blocks[0].named_parameters()]
    splits = block_tensor_splits(capture, tensor, options.tensor_rules)
    templates, packed, dims = split_packed_weights(capture, splits, tensor, options.tensor_rules)
    dim_of = dict(zip(names, dims))
    if tensor > 1:  # the backward then reduces the input gradient of each group of them once
        templates = _each_once(templates, lambda template: join_column_parallel(template, dim_of, tensor)[0])
    check_convolutions(stacked.blocks[0], dim_of)
    if options.sequence_parallel and capture.sample_input is not None:  # without one, the first forward checks
        check_sequence_dim(tuple(block_inputs(stacked, capture.sample_input)[0].shape), "on the sample")
    return SpmdLayout(schedule, partition, dims, templates, packed)


def block_tensor_splits(capture: ModelCapture, tensor: int, rules: Rules | None) -> list[Rule]:
    """Each weight of the body's first block split over "tensor" as
    :func:`xpipe.tensor.splits.block_splits` says, the graph read on the sample input.
    Refused before any device work where no rule covers a weight and the graph
    cannot tell."""
    stacked = capture.stacked()
    names, shapes = zip(*[(name, tuple(p.shape)) for name, p in stacked.blocks[0].named_parameters()])

    def read_from_graph() -> Rules:
        if capture.sample_input is None:
            raise CannotInfer("xpipe reads it on a batch, and no sample_input= was given")
        return infer_tensor_dims(stacked.blocks[0], block_inputs(stacked, capture.sample_input))

    return block_splits(names, shapes, tensor, rules, key_value_heads_of(capture.module), read_from_graph)


def split_packed_weights(capture: ModelCapture, splits: list[Rule], tensor: int, rules: Rules | None
                         ) -> tuple[dict[bool, torch.fx.GraphModule], list[PackedLinear], list[int | None]]:
    """The block the clock loop runs in train and in eval mode, the packed linears it
    splits part by part (:mod:`xpipe.tensor.packed_projections`), and each block weight's
    split dim.

    A block torch.fx captured calls modules, whose packed weights' parts its graph
    does not show: it is captured again by torch.export, once per mode. Where the
    parts still cannot be read (or no ``sample_input`` lets xpipe read them), the
    built-in rules keep the packed weights whole, as exact as splitting them; a
    packed weight the user's own rules name is refused instead, naming ``tensor_rules``.
    """
    stacked = capture.stacked()
    block = stacked.blocks[0]
    names = [name for name, _ in block.named_parameters()]
    dims = [split_dim(rule) for rule in splits]
    packed = [name for name, rule in zip(names, splits) if isinstance(rule, Packed)]
    if not packed:
        return {True: block, False: block}, [], dims
    try:
        if capture.sample_input is None:
            raise CannotSplitPacked("xpipe reads the parts on a batch, and no sample_input= was given")
        inputs = block_inputs(stacked, capture.sample_input)
        split = _each_once(_block_in_each_mode(block, inputs), lambda each: split_packed(each, packed, inputs, tensor))
        linears, eval_linears = split[True][1], split[False][1]
        if linears != eval_linears:
            raise CannotSplitPacked("the block's graph reads its packed weights apart differently in train and "
                                    "eval mode")
    except CannotSplitPacked as reason:
        asked = [name for name in packed if covered_by(name, rules)]
        if asked:
            raise ValueError(f"tensor_rules: {asked} are packed by your rules, but {reason}; give them a rule of "
                             "None to keep them whole, or split the projections into separate linears") from None
        return {True: block, False: block}, [], [None if isinstance(rule, Packed) else dim
                                                 for rule, dim in zip(splits, dims)]
    read = {linear.weight: linear.dim for linear in linears} | {linear.bias: 0 for linear in linears if linear.bias}
    return ({mode: template for mode, (template, _) in split.items()}, linears,
            [read.get(name, dim) for name, dim in zip(names, dims)])


def _each_once(per_mode: dict[bool, Any], make: Callable[[Any], Any]) -> dict[bool, Any]:
    """``make`` of each mode's block, made once for a block both modes share."""
    made: dict[int, Any] = {}
    for block in per_mode.values():
        if id(block) not in made:
            made[id(block)] = make(block)
    return {mode: made[id(block)] for mode, block in per_mode.items()}


def _block_in_each_mode(block: torch.fx.GraphModule, inputs: tuple) -> dict[bool, torch.fx.GraphModule]:
    """``block`` as its operations, for :func:`split_packed`: itself, if torch.export
    captured it (the model's mode is fixed then); else captured again by torch.export,
    in train and in eval mode, its parameters and buffers as ``block``'s."""
    if not any(node.op == "call_module" for node in block.graph.nodes):
        return {True: block, False: block}
    try:
        captured = {mode: as_operations(block, inputs, mode) for mode in (True, False)}
    except ValueError as error:
        raise CannotSplitPacked(f"xpipe captured the block as modules (torch.fx), and torch.export cannot capture "
                                f"its operations ({str(error).splitlines()[0]})") from None
    for each in captured.values():
        vmappable(each)
        if (dict(each.named_parameters()).keys() != dict(block.named_parameters()).keys()
                or dict(each.named_buffers()).keys() != dict(block.named_buffers()).keys()):
            raise CannotSplitPacked("xpipe captured the block as modules (torch.fx), and torch.export's capture of "
                                    "its operations names its weights otherwise")
    return captured


def build_devices(capture: ModelCapture, options: Options) -> Built:
    """The devices executor, one stage (or ``virtual`` of them) per XLA device."""
    module = capture.module
    if options.tensor_rules:
        raise ValueError("tensor_rules: the devices executor has no 'tensor' axis to split weights over; use "
                         "executor='spmd' with a mesh from xpipe.make_mesh(..., tensor=N), or leave them out")
    if options.gather != "step":
        raise ValueError(f"gather: the devices executor holds each stage's weights whole on its device, so there is "
                         f"nothing to gather; gather={options.gather!r} is for executor='spmd' on a mesh with "
                         "\"fsdp\" (leave gather out here)")
    if options.sequence_parallel:
        raise ValueError("sequence_parallel: the devices executor has no 'tensor' axis to split the sequence "
                         "over; use executor='spmd' with a mesh from xpipe.make_mesh(..., tensor=N), or leave it off")
    if options.mesh is not None:
        raise ValueError("mesh: the devices executor puts one stage on each XLA device and takes no mesh; "
                         "leave mesh out, or use executor='spmd'")
    if xr.is_spmd():
        raise ValueError("executor: this process is in SPMD mode, where the 'devices' executor cannot run; "
                         "use executor='spmd', or run the devices executor in a process without SPMD")
    stages = _stage_count(options.stages, options.balance, xr.global_runtime_device_count(), options.virtual)
    schedule = by_name(options.schedule, stages, options.chunks, options.virtual)
    partition = rebalanced(capture.whole(), options.balance, stages=stages * options.virtual)
    staged = cut_into_stages(module, partition, capture.sample_input, capture.captured)
    devices = [torch_xla.device(index) for index in range(stages)]
    warm_autograd(devices[0])
    placed: set[int] = set()
    for stage, program in enumerate(staged.stages):
        device = devices[schedule.rank_of(stage)]
        # The model holds what trains; a weight tied across devices stays with its first stage.
        rebind(module, move_keeping_ties([program.module], device, keep=placed))
        placed.update(id(t) for t in [*program.module.parameters(), *program.module.buffers()])
        place_constants_on(program.module, device)
    runner = DevicesPipeline(staged, devices, schedule, options.checkpoint, module,
                             deferred_batch_norm=options.deferred_batch_norm)
    return Built(runner, partition, schedule, None, devices)


def tie_groups(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each ``state_dict`` key of ``module``, in order, with every key that names the
    same tensor (a weight tied between the embedding and the head has two)."""
    state = module.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for key, tensor in state.items():
        names.setdefault(id(tensor), []).append(key)
    return {key: tuple(names[id(tensor)]) for key, tensor in state.items()}


def requested_stages(stages: int | None, balance: Sequence[int] | None, virtual: int = 1) -> int | None:
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
    requested = requested_stages(stages, balance, virtual)
    stages = check_positive_int(devices if requested is None else requested, "stages")
    if stages > devices:
        raise ValueError(f"stages: {stages} stages need {stages} XLA devices, but there are {devices}; "
                         f"use at most {devices} stages")
    return stages


def spmd_stage_count(mesh: xs.Mesh | None, stages: int | None, balance: Sequence[int] | None,
                     virtual: int) -> int:
    """The stage count of an spmd Pipe, checked against the mesh or the device count
    before the process is switched into SPMD mode."""
    requested = requested_stages(stages, balance, virtual)
    if mesh is None:
        return mesh_axes(xr.global_runtime_device_count() if requested is None else requested).stage
    stages = axes_of(mesh).stage
    if requested is not None and stages != requested:
        raise ValueError(f"stages: {requested} does not match the mesh's 'stage' axis of {stages}")
    return stages
