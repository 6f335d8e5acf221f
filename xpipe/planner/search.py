"""Which layout fits a model on a given set of chips, and how fast it should run.

``xpipe.plan`` enumerates the spmd executor's layouts (stages x data x fsdp x
tensor, chunks, schedule, rounds, checkpoint policy) and predicts for each, per
device: the bytes by kind at the peak of the step's timeline
(:mod:`xpipe.planner.timeline`, its terms from :mod:`xpipe.planner.step_memory`:
the memory model of :mod:`xpipe.planner.memory` for the weights, gradients,
optimizer state and the step's gathered copies; the activations from the
schedule's own table and the model's profile), the
bubble (the schedule's table), the bytes each mesh axis moves per step, and a
step time at the chip's stated peak figures. Nothing is built on a device:
the plan is arithmetic over a :class:`xpipe.planner.profile.ModelProfile`.

The prediction's terms, and where they are approximate, are in docs/planning.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from xpipe._checks import GATHERS, check_gather, check_optimizer_states, check_positive_int
from xpipe.layout import MeshAxes, microbatch_slots, outer_step_numel, spread
from xpipe.planner.accuracy import BANDS, Band, layout_kind
from xpipe.planner.memory import per_device
from xpipe.planner.profile import ModelProfile, profile_of_config, profile_of_model
from xpipe.planner.step_memory import lockstep_terms, step_terms
from xpipe.planner.timeline import KINDS, Timeline, lockstep_timeline, step_timeline
from xpipe.recompute import MODES, check_lockstep, first_kept_clock
from xpipe.schedule import SPMD_SCHEDULES, Lockstep, Schedule, circular, gpipe
from xpipe.tensor.rules import Rules

GiB = 1 << 30


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's public figures: what a step time is predicted from."""

    name: str
    flops: float  # peak bfloat16 FLOP/s
    memory: int  # HBM bytes
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s per chip to its slice neighbours, both directions
    dcn_bandwidth: float | None  # bytes/s per chip between slices, where published
    source: str


PRESETS = {
    "v4": Chip("TPU v4", 275e12, 32 * GiB, 1200e9, 300e9, None,
               "cloud.google.com/tpu/docs/v4 (its table gives no ICI figure: 300 GB/s assumed)"),
    "v5e": Chip("TPU v5e", 197e12, 16 * GiB, 819e9, 400e9, 200e9 / 8 / 8,
                "cloud.google.com/tpu/docs/v5e (DCN: 2 x 100 Gbps per host of 8 chips)"),
    "v5p": Chip("TPU v5p", 459e12, 95 * GiB, 2765e9, 1200e9, 50e9 / 8, "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("TPU v6e", 918e12, 32 * GiB, 1638e9, 800e9, None, "cloud.google.com/tpu/docs/v6e"),
}


@dataclass(frozen=True)
class Layout:
    """One way to run the model: the mesh, the microbatches and the schedule."""

    stages: int
    data: int
    fsdp: int
    tensor: int
    chunks: int
    schedule: str = "gpipe"  # or "circular", or "1f1b"
    virtual: int = 1  # rounds of the ring (circular)
    checkpoint: str = "except_last"
    gather: str = "step"  # or "block": the body's weights gathered per block slot inside the loop
    sequence_parallel: bool = False  # Pipe's: the stream between the blocks' tensor-parallel regions split by sequence

    @property
    def axes(self) -> MeshAxes:
        return MeshAxes(self.stages, self.data, self.fsdp, self.tensor)

    @property
    def pure_pipeline(self) -> bool:
        """Nothing sharded inside a stage: stages, and replicas of them."""
        return self.fsdp == 1 and self.tensor == 1

    @property
    def kind(self) -> str:
        """What sets its memory apart (:func:`xpipe.planner.accuracy.layout_kind`)."""
        return layout_kind(self.schedule, self.checkpoint, self.gather, self.tensor, self.sequence_parallel)

    @property
    def schedule_label(self) -> str:
        """The schedule with its rounds, e.g. ``"circular x2"``."""
        return self.schedule if self.virtual == 1 else f"{self.schedule} x{self.virtual}"

    def outer_rows(self, batch: int) -> int:
        """Rows of a ``batch`` that each device runs the layers around the body on (the
        batch split over stage, data and fsdp)."""
        return -(-batch // (self.stages * self.data * self.fsdp))

    def __str__(self) -> str:
        return (f"{self.stages} stage x {self.data} data x {self.fsdp} fsdp x {self.tensor} tensor, "
                f"{self.schedule_label}, chunks {self.chunks}, checkpoint {self.checkpoint}, gather {self.gather}"
                f"{', sequence parallel' if self.sequence_parallel else ''}")


@dataclass(frozen=True)
class Prediction:
    """What a layout should cost on one device (the busiest) and how long its step should take."""

    layout: Layout
    memory: dict[str, int]  # bytes by kind (KINDS)
    bubble: float  # idle share of the schedule's cells
    communication: dict[str, float]  # bytes one device sends per step, by mesh axis
    seconds: dict[str, float]  # the step's time by part, at the chip's peak figures
    capacity: int
    timeline: Timeline = field(repr=False)  # the step's moments; memory is its peak's

    @property
    def bytes(self) -> int:
        """Everything one device holds at the step's peak."""
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.bytes <= self.capacity

    @property
    def step_seconds(self) -> float:
        """A lower bound: peak FLOP/s and link bandwidth, no overlap of communication with compute."""
        return sum(self.seconds.values())

    @property
    def band(self) -> Band | None:
        """How close the plan came to XLA's peak on the emulated devices for this layout's
        kind (:mod:`xpipe.planner.accuracy`), or None where no cell measured it."""
        return BANDS.get(self.layout.kind)

    def describe_memory(self) -> str:
        parts = ", ".join(f"{kind} {self.memory[kind] / GiB:.2f}" for kind in KINDS)
        return f"{self.bytes / GiB:.2f} GiB per device ({parts})"


@dataclass(frozen=True)
class Plan:
    """The layouts that fit (fastest first) and those that do not (smallest first)."""

    profile: ModelProfile
    chip: Chip
    devices: int
    batch: int
    capacity: int  # bytes a device may hold
    fitting: list[Prediction] = field(repr=False)
    refused: list[Prediction] = field(repr=False)

    def least_memory(self, where: Callable[[Layout], bool] = lambda layout: True) -> Prediction | None:
        """Of the layouts ``where`` accepts, the one that needs the least memory."""
        chosen = [p for p in self.fitting + self.refused if where(p.layout)]
        return min(chosen, key=lambda p: p.bytes, default=None)


def preset(name: str) -> Chip:
    """The chip called ``name`` (``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"chip: {name!r} is not a preset; use one of {', '.join(PRESETS)}") from None


def plan(model: nn.Module | ModelProfile | Any, *, devices: int, batch: int, chip: str | Chip = "v5e",
         memory_per_device: int | None = None, sample_input: Any = None, seq: int = 2048,
         itemsize: int | None = None, optimizer_states: int = 2,
         checkpoints: tuple[str, ...] = ("except_last", "always"), max_tensor: int = 8,
         tensor_rules: Rules | None = None, slices: int = 1, gathers: tuple[str, ...] = GATHERS,
         padding_mask: bool = False, sequence_parallel: bool = False, over_chip_memory: bool = False) -> Plan:
    """Every layout of ``model`` on ``devices`` chips for a global batch of ``batch``
    rows, predicted; those within ``memory_per_device`` (the chip's HBM by default)
    best first.

    Args:
        model: an ``nn.Module`` (with ``sample_input``), a Hugging Face config (the
            model is built on the meta device, at sequence length ``seq``), or a
            :class:`xpipe.planner.profile.ModelProfile`.
        devices: chips in all.
        batch: rows of the global batch (sequences, for a language model).
        chip: a preset's name or a :class:`Chip`.
        memory_per_device: bytes a device may hold: at most the chip's HBM, unless
            ``over_chip_memory``.
        sample_input: a few rows of the batch, as ``Pipe``'s, for an ``nn.Module``.
        seq: the sequence length, for a config.
        itemsize: bytes per element of the weights, their gradients and activations;
            the model's own dtype by default (bfloat16, 2, for a config). The
            optimizer's state is kept in the same dtype, as torch's optimizers keep it.
        optimizer_states: tensors the optimizer keeps per weight (AdamW 2).
        checkpoints: the recomputation policies to consider.
        gathers: when the body's weights may be gathered (``Pipe``'s ``gather``): per
            ``"step"``, and per ``"block"`` (with fsdp, and ``checkpoint="always"``).
        max_tensor: the largest tensor size (tensor groups stay within a host's chips).
        tensor_rules: as ``Pipe``'s, for the block weights' split dims.
        slices: TPU slices; the stage axis crosses them (DCN), the others stay inside.
        padding_mask: for a config, whether the batches give an ``attention_mask``
            (then a ``[seq, seq]`` mask travels with every row); a module's sample
            input says it itself.
        sequence_parallel: whether the layouts with "tensor" run ``Pipe``'s
            ``sequence_parallel=True``.
        over_chip_memory: allow a ``memory_per_device`` above the chip's HBM (to
            plan for a chip with more memory than the preset's, say).

    Raises:
        ValueError: naming the argument, for a bad count, size, chip or policy.
    """
    chip, capacity = _chip_and_capacity(chip, memory_per_device, over_chip_memory, devices=devices, batch=batch,
                                        slices=slices, max_tensor=max_tensor)
    check_optimizer_states(optimizer_states)
    if not isinstance(padding_mask, bool):
        raise TypeError(f"padding_mask: expected True or False (whether the batches give an attention_mask), "
                        f"got {padding_mask!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel: expected True or False (Pipe's), got {sequence_parallel!r}")
    profile = _profile(model, sample_input, seq, padding_mask)
    itemsize = profile.itemsize if itemsize is None else itemsize
    _check_policies(profile, itemsize, checkpoints, gathers, sequence_parallel)
    if slices > 1 and chip.dcn_bandwidth is None:
        raise ValueError(f"slices: {chip.name} has no published DCN bandwidth; give a Chip with dcn_bandwidth")
    predictions = [predict(profile, layout, chip=chip, batch=batch, capacity=capacity, itemsize=itemsize,
                           optimizer_states=optimizer_states, tensor_rules=tensor_rules, slices=slices)
                   for layout in layouts(profile, devices, batch, checkpoints, max_tensor, tensor_rules, slices,
                                         sequence_parallel)
                   if layout.gather in gathers]
    fitting = sorted((p for p in predictions if p.fits), key=lambda p: (p.step_seconds, p.bytes))
    refused = sorted((p for p in predictions if not p.fits), key=lambda p: p.bytes)
    return Plan(profile, chip, devices, batch, capacity, fitting, refused)


def _chip_and_capacity(chip: str | Chip, memory_per_device: int | None, over_chip_memory: bool, *, devices: int,
                       batch: int, slices: int, max_tensor: int) -> tuple[Chip, int]:
    """:func:`plan`'s chip and the bytes a device may hold, checked with the counts."""
    if not isinstance(chip, (str, Chip)):
        raise TypeError(f"chip: expected a preset's name ({', '.join(PRESETS)}) or an xpipe.planner.Chip, got "
                        f"{type(chip).__name__}")
    chip = preset(chip) if isinstance(chip, str) else chip
    capacity = chip.memory if memory_per_device is None else memory_per_device
    _check(devices=devices, batch=batch, capacity=capacity, slices=slices, max_tensor=max_tensor)
    if capacity > chip.memory and not over_chip_memory:
        raise ValueError(f"memory_per_device: {capacity / GiB:.2f} GiB is more than a {chip.name} holds "
                         f"({chip.memory / GiB:.2f} GiB of HBM): layouts planned to it would not fit the chip. "
                         f"Give at most {chip.memory} bytes, or pass over_chip_memory=True (--over-chip-memory) "
                         "to plan for a chip with more memory")
    return chip, capacity


def _check_policies(profile: ModelProfile, itemsize: int, checkpoints: tuple[str, ...], gathers: tuple[str, ...],
                    sequence_parallel: bool) -> None:
    """:func:`plan`'s element size and the policies it may choose from, checked against the model."""
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"itemsize: {itemsize!r} is not a dtype's size in bytes; use 2 (bfloat16) or 4 (float32)")
    bad = [mode for mode in checkpoints if mode not in MODES]
    if bad or not checkpoints:
        raise ValueError(f"checkpoints: {bad or 'none'} given; use some of {', '.join(MODES)}")
    if not gathers or isinstance(gathers, str):
        raise ValueError(f"gathers: a tuple of some of {', '.join(map(repr, GATHERS))}, got {gathers!r}")
    for gather in gathers:
        check_gather(gather)
    if set(gathers) == {"block"} and "always" not in checkpoints:
        raise ValueError(f"gathers: gather 'block' gathers each block's weights as it runs, and recomputes every "
                         f"block (Pipe's checkpoint='always'); the checkpoints given are {list(checkpoints)}: add "
                         "'always' to them (--checkpoint always), or gather per 'step'")
    if sequence_parallel and profile.stream_rank < 3:
        raise ValueError(f"sequence_parallel: {profile.name}'s blocks pass a stream of {profile.stream_rank} dims "
                         "([batch, features]), with no sequence dim to split, and Pipe refuses "
                         "sequence_parallel=True for it; plan without it")


def _profile(model: nn.Module | ModelProfile | Any, sample_input: Any, seq: int,
             padding_mask: bool) -> ModelProfile:
    """The profile of whatever ``plan`` was given."""
    if isinstance(model, ModelProfile):
        return model
    if isinstance(model, nn.Module):
        if sample_input is None:
            raise ValueError("sample_input: plan needs a few rows of the batch to profile an nn.Module, "
                             "as Pipe's sample_input")
        return profile_of_model(model, sample_input)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a transformers PretrainedConfig
        return profile_of_config(model, seq, padding_mask=padding_mask)
    raise ValueError(f"model: expected an nn.Module, a Hugging Face config or a ModelProfile, got "
                     f"{type(model).__name__}")


def _check(*, devices: int, batch: int, capacity: int, slices: int, max_tensor: int) -> None:
    for name, value in (("devices", devices), ("batch", batch), ("memory_per_device", capacity),
                        ("slices", slices), ("max_tensor", max_tensor)):
        check_positive_int(value, name)
    if devices % slices:
        raise ValueError(f"slices: {slices} slices do not divide the {devices} devices")


def layouts(profile: ModelProfile, devices: int, batch: int, checkpoints: tuple[str, ...] = ("except_last",),
            max_tensor: int = 8, tensor_rules: Rules | None = None, slices: int = 1,
            sequence_parallel: bool = False) -> Iterator[Layout]:
    """The layouts the spmd executor can run: stages that hold a block each and that the
    slices divide, tensor sizes the heads and split weights allow, and chunk counts
    (see :func:`_chunk_counts`) whose microbatches split evenly over the row groups;
    those with "tensor" sequence parallel where ``sequence_parallel`` says so."""
    for stages in _divisors(devices):
        if stages > profile.blocks or stages % slices:
            continue
        for tensor in _divisors(devices // stages):
            if tensor > max_tensor or any(count % tensor for count in profile.heads):
                continue
            try:
                profile.tensor_dims(tensor, tensor_rules)
            except ValueError:
                continue
            split_sequence = sequence_parallel and tensor > 1
            for fsdp in _divisors(devices // (stages * tensor)):
                data = devices // (stages * tensor * fsdp)
                for chunks in _chunk_counts(stages):
                    if batch % (chunks * data * fsdp):
                        continue
                    for schedule, virtual in _schedules(profile.blocks, stages, chunks):
                        for checkpoint in _checkpoints(schedule, checkpoints):
                            yield Layout(stages, data, fsdp, tensor, chunks, schedule, virtual, checkpoint,
                                         sequence_parallel=split_sequence)
                            if fsdp > 1 and checkpoint == "always":  # per block recomputes every block
                                yield Layout(stages, data, fsdp, tensor, chunks, schedule, virtual, checkpoint,
                                             "block", split_sequence)


def _chunk_counts(stages: int) -> list[int]:
    """1 to 8 microbatches per stage, and fewer microbatches than stages (which the spmd
    executor pads with idle ones) for batches too small to give every stage one."""
    return sorted({*_divisors(stages), *(stages * k for k in (2, 4, 8))})


def _schedules(blocks: int, stages: int, chunks: int) -> list[tuple[str, int]]:
    """GPipe; 1F1B with more than one stage; and circular with 2 and 4 rounds where every
    model stage holds a block and the microbatches fill the ring (as
    :func:`xpipe.schedule.check_ring_chunks` asks)."""
    ring = stages > 1 and chunks >= stages
    one_f_one_b = [("1f1b", 1)] if stages > 1 else []
    return [("gpipe", 1), *one_f_one_b] + [("circular", v) for v in (2, 4) if ring and blocks >= stages * v]


def _checkpoints(schedule: str, checkpoints: tuple[str, ...]) -> tuple[str, ...]:
    """The policies of ``checkpoints`` the executor runs ``schedule`` with: 1F1B recomputes
    every stage or none (:func:`xpipe.recompute.check_lockstep`)."""
    return tuple(c for c in checkpoints if c != "except_last") if schedule == "1f1b" else checkpoints


def predict(profile: ModelProfile, layout: Layout, *, chip: Chip, batch: int, capacity: int | None = None,
            itemsize: int | None = None, optimizer_states: int = 2, tensor_rules: Rules | None = None,
            slices: int = 1) -> Prediction:
    """One layout's bytes per device, bubble, communication and step time (see :func:`plan`)."""
    check_optimizer_states(optimizer_states)
    itemsize = profile.itemsize if itemsize is None else itemsize
    profile = profile.scaled(itemsize)
    axes = layout.axes
    chunks = layout.stages * microbatch_slots(layout.chunks, layout.stages)  # as the executor runs them
    schedule = _schedule(layout.schedule, layout.stages, chunks, layout.virtual)
    depth = max(spread(profile.blocks, layout.stages * layout.virtual))  # block slots per model stage
    split = [dim is not None for dim in profile.tensor_dims(layout.tensor, tensor_rules)]
    stacked = [(layout.stages, layout.virtual * depth, math.prod(shape)) for _, shape in profile.block_weights]
    check_gather(layout.gather, layout.checkpoint)
    if layout.schedule not in SPMD_SCHEDULES:
        raise ValueError(f"layout: schedule {layout.schedule!r} is not one the spmd executor runs; use one of "
                         f"{', '.join(SPMD_SCHEDULES)}")
    if layout.schedule == "1f1b":
        check_lockstep(layout.checkpoint)
    if layout.sequence_parallel and layout.tensor == 1:
        raise ValueError("layout: sequence_parallel splits the sequence over \"tensor\", and this layout has "
                         "tensor=1; give it tensor > 1, or sequence_parallel=False")
    weights = per_device(stacked=stacked, outer=profile.outer_weights, axes=axes, split=split, itemsize=itemsize,
                         optimizer_states=optimizer_states, gather=layout.gather)
    rows = max(1, -(-batch // (layout.chunks * axes.row_groups)))  # of one microbatch, on one device
    if layout.schedule == "1f1b":
        timeline = lockstep_timeline(lockstep_terms(profile, layout, depth, rows, weights))
    else:
        loops = _loop_clocks(schedule, layout.checkpoint)
        timeline = step_timeline(step_terms(profile, layout, depth, rows, batch, weights, loops))
    memory = timeline.peak.memory
    communication = _communication(profile, layout, schedule, depth, rows, itemsize, split, stacked)
    seconds = _seconds(profile, layout, schedule, depth, rows, batch, chip, communication, weights.resting, slices)
    return Prediction(layout, memory, schedule.bubble_fraction, communication, seconds,
                      chip.memory if capacity is None else capacity, timeline)


def _communication(profile: ModelProfile, layout: Layout, schedule: Schedule, depth: int, rows: int,
                   itemsize: int, split: list[bool], stacked: list[tuple[int, int, int]]) -> dict[str, float]:
    """Bytes one device sends per step along each axis (ring collectives)."""
    axes = layout.axes
    stage_weights = sum(slots * n // (layout.tensor if cut else 1) for (_, slots, n), cut in zip(stacked, split))
    outer_weights = outer_step_numel(profile.outer_weights, axes)
    gathered = (stage_weights + outer_weights) * itemsize
    # Gathered once, the weights cross "fsdp" twice a step (their gather, their gradients' reduce-scatter);
    # per block, every clock gathers its round's slots twice (the forward, the recomputation) and reduces once.
    fsdp_bytes = 2 * gathered
    if layout.gather == "block":
        per_clock = 3 * len(schedule.forward_clocks()) * stage_weights / layout.virtual
        fsdp_bytes = (per_clock + 2 * outer_weights) * itemsize
    cells = schedule.chunks * layout.virtual
    tensor_reductions = cells * depth * (4 + 2 * _recomputes(schedule, layout.checkpoint))  # Megatron: 2 + 2 a block
    packed, hidden = rows * profile.stream_bytes_per_row, rows * profile.hidden_bytes_per_row
    # Each tensor device sends its share of the stream to the next stage, and gathers the whole
    # from its group once per clock it runs: forward, backward, and recomputed forward.
    conveyor_gathers = schedule.clocks + _loop_clocks(schedule, layout.checkpoint)[0]
    stage_sends = _lockstep_sends(layout, schedule, rows) if layout.schedule == "1f1b" else schedule.clocks
    return {
        "stage": stage_sends * packed / axes.tensor if axes.stage > 1 else 0.0,
        "fsdp": _ring(axes.fsdp) * fsdp_bytes,
        "data": 2 * _ring(axes.data) * gathered / axes.fsdp,  # all-reduce of the fsdp-sharded gradients
        "tensor": (tensor_reductions * 2 * hidden + conveyor_gathers * packed) * _ring(axes.tensor),
    }


def _seconds(profile: ModelProfile, layout: Layout, schedule: Schedule, depth: int, rows: int, batch: int,
             chip: Chip, communication: dict[str, float], resting: int, slices: int) -> dict[str, float]:
    """The step's time by part at the chip's peak: the body's cells stretched by the
    bubble, the layers around it, each axis's bytes at its link's bandwidth, and the
    optimizer's pass over the resting state at HBM bandwidth."""
    passes = 3 + _recomputes(schedule, layout.checkpoint)  # forward, backward (twice the forward), recomputation
    body_flops = passes * schedule.chunks * layout.virtual * depth * rows * profile.block_flops_per_row
    body = body_flops / layout.tensor / chip.flops / (1 - schedule.bubble_fraction)
    outer_rows = layout.outer_rows(batch) * _head_repeats(layout, schedule, rows)
    outer = 3 * outer_rows * profile.outer_flops_per_row / chip.flops
    stage_link = chip.dcn_bandwidth if slices > 1 else chip.ici_bandwidth
    return {"compute": body + outer,
            "stage": communication["stage"] / stage_link,
            **{axis: communication[axis] / chip.ici_bandwidth for axis in ("fsdp", "data", "tensor")},
            "optimizer": 2 * resting / chip.hbm_bandwidth}


def _lockstep_sends(layout: Layout, schedule: Schedule, rows: int) -> float:
    """Microbatch streams one device sends along "stage" in a 1F1B step
    (:mod:`xpipe.spmd.one_f_one_b`): each clock a stream and a slot's column both ways;
    each steady clock, where the microbatch leaving the last stage is cut into
    ``pieces`` over the stages for the layers after the body, all pieces but the last
    stage's down and their gradients back."""
    lockstep = Lockstep(layout.stages, schedule.chunks)
    pieces = lockstep.head_pieces(rows)
    return 4 * lockstep.clocks + 2 * (pieces - 1) / pieces * schedule.chunks


def _head_repeats(layout: Layout, schedule: Schedule, rows: int) -> float:
    """How many times a step runs the layers after the body on each row: once, or under
    1F1B ``S / pieces`` times, where a device's ``rows`` of the microbatch leaving the
    last stage are cut into ``pieces`` over the stages (every device runs a piece)."""
    if layout.schedule != "1f1b":
        return 1
    return layout.stages / Lockstep(layout.stages, schedule.chunks).head_pieces(rows)


def _ring(size: int) -> float:
    """The share of a ring collective's buffer that each of ``size`` devices sends."""
    return (size - 1) / size


def _loop_clocks(schedule: Schedule, checkpoint: str) -> tuple[int, int]:
    """The forward clocks of the clock loop that recomputes and of the one that keeps
    (:func:`xpipe.recompute.first_kept_clock`, where the executor splits them)."""
    return _loop_clock_counts(schedule.name, schedule.stages, schedule.chunks, schedule.virtual, checkpoint)


@functools.cache
def _loop_clock_counts(name: str, stages: int, chunks: int, virtual: int, checkpoint: str) -> tuple[int, int]:
    schedule = _schedule(name, stages, chunks, virtual)
    split = first_kept_clock(schedule, checkpoint)
    return split, len(schedule.forward_clocks()) - split


def _recomputes(schedule: Schedule, checkpoint: str) -> bool:
    """Whether some cell runs its forward again in the backward."""
    return _loop_clocks(schedule, checkpoint)[0] > 0


@functools.cache
def _schedule(name: str, stages: int, chunks: int, virtual: int) -> Schedule:
    """The table the planner reads clocks, bubble and recomputation from. 1F1B under the
    spmd executor runs GPipe's clocks of a forward and a backward and its bubble
    (:class:`xpipe.schedule.Lockstep`), and recomputes every cell: GPipe's table with
    ``checkpoint="always"`` counts the same."""
    return circular(stages, chunks, virtual) if name == "circular" else gpipe(stages, chunks)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
