"""Pipeline schedules as plain data.

A schedule is a table: one row per clock, one cell per rank (a device, or a
group of devices holding one pipeline stage), each cell an :class:`Action` or
``None`` (the rank is idle: a bubble). An action is the forward (``F``), the full
backward (``B``), or the backward split in two, for the stage's input (``I``)
and for its weights (``W``), of one microbatch on one model stage. With
``virtual`` model stages per rank, stage ``s`` lives on rank ``s % ranks``.
Executors interpret the table; the visualiser draws it; the validator checks the
dependencies between cells.

Every schedule here is written as what each rank runs, in order (as PyTorch's
pipelining writes it), and :func:`clocked` turns those orders into a table by
running each action at the first clock where the rank is free and what it needs
is done: the table is that simulation's result.

    >>> print(gpipe(stages=2, chunks=3))
    gpipe: 2 stages, 3 microbatches, 8 clocks, bubble 25.0%
    clock  0    1    2    3    4    5    6    7
    s0     0F0  0F1  0F2  .    .    0B2  0B1  0B0
    s1     .    1F0  1F1  1F2  1B2  1B1  1B0  .
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from xpipe._checks import check_positive_int

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"  # the backward for the stage's input only
WEIGHT_GRAD = "W"  # the backward for the stage's weights only
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


class Action(NamedTuple):
    """One cell of a schedule: model stage ``stage`` runs ``kind`` for ``microbatch``."""

    stage: int
    kind: str  # one of KINDS
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form, e.g. ``"1F0"`` (stage 1, forward, microbatch 0) or ``"2I3"``."""
        match = re.fullmatch(r"(\d+)([FBIW])(\d+)", text)
        if not match:
            raise ValueError(f"text: {text!r} is not an action; write STAGE F|B|I|W MICROBATCH, e.g. '1F0'")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """Which action each rank runs at each clock.

    Attributes:
        name: the schedule's name, e.g. ``"gpipe"``.
        stages: number of ranks (columns of the table).
        chunks: number of microbatches.
        table: ``table[clock][rank]`` is an :class:`Action` or ``None`` (idle).
        virtual: model stages per rank; model stage ``s`` runs on rank ``s % stages``.
    """

    name: str
    stages: int
    chunks: int
    table: tuple[tuple[Action | None, ...], ...]
    virtual: int = 1

    @property
    def model_stages(self) -> int:
        return self.stages * self.virtual

    @property
    def clocks(self) -> int:
        """Number of clock ticks in one step."""
        return len(self.table)

    def rank_of(self, stage: int) -> int:
        """The rank that runs model stage ``stage`` (placed round-robin)."""
        return stage % self.stages

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-clock cells that are idle."""
        cells = self.clocks * self.stages
        idle = sum(cell is None for row in self.table for cell in row)
        return idle / cells if cells else 0.0

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most microbatches whose forward has run there and whose
        ``B`` (or ``I``) has not: how many activations the rank holds at once."""
        peaks = []
        for rank in range(self.stages):
            held, peak = 0, 0
            for row in self.table:
                action = row[rank]
                if action is not None and action.kind == FORWARD:
                    held += 1
                elif action is not None and action.kind in (BACKWARD, INPUT_GRAD):
                    held -= 1
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def forward_clocks(self) -> list[tuple[Action | None, ...]]:
        """The rows that hold at least one forward action, in order."""
        return [row for row in self.table if any(c is not None and c.kind == FORWARD for c in row)]

    def validate(self) -> None:
        """Raise ``ValueError`` (with the grid, failing clock marked) if a dependency is broken.

        Every model stage runs each microbatch's forward once, and either one ``B``
        or one ``I`` and one ``W``; a forward comes after the previous stage's, a
        backward after the next stage's and after its own forward, ``W`` after ``I``.
        """
        done: dict[Action, int] = {}
        for clock, row in enumerate(self.table):
            if len(row) != self.stages:
                self._fail(clock, f"row has {len(row)} cells, expected {self.stages}")
            for rank, action in enumerate(row):
                if action is None:
                    continue
                if not 0 <= action.stage < self.model_stages or self.rank_of(action.stage) != rank:
                    self._fail(clock, f"{action} sits in the cell of rank {rank}")
                if action in done:
                    self._fail(clock, f"{action} runs twice (first at clock {done[action]})")
                for needed in self._dependencies(action):
                    if all(done.get(option, clock) >= clock for option in needed):
                        self._fail(clock, f"{action} runs before {' or '.join(map(str, needed))}")
                done[action] = clock
        missing = [a for a in self._expected(done) if a not in done]
        if missing:
            self._fail(self.clocks - 1, f"never runs: {', '.join(map(str, missing[:5]))}")

    def _expected(self, done: dict[Action, int]) -> list[Action]:
        expected = []
        for stage in range(self.model_stages):
            for microbatch in range(self.chunks):
                split = Action(stage, INPUT_GRAD, microbatch) in done or Action(stage, WEIGHT_GRAD, microbatch) in done
                kinds = (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if split else (FORWARD, BACKWARD)
                expected += [Action(stage, kind, microbatch) for kind in kinds]
        return expected

    def _dependencies(self, action: Action) -> list[tuple[Action, ...]]:
        """What must have run before ``action``: each entry is met by any one of its actions."""
        stage, kind, microbatch = action
        if kind == FORWARD:
            return [(Action(stage - 1, FORWARD, microbatch),)] if stage > 0 else []
        if kind == WEIGHT_GRAD:
            return [(Action(stage, INPUT_GRAD, microbatch),)]
        own = [(Action(stage, FORWARD, microbatch),)]
        if stage == self.model_stages - 1:
            return own
        # the next stage's gradient for its input: a full backward, or its I
        return own + [(Action(stage + 1, BACKWARD, microbatch), Action(stage + 1, INPUT_GRAD, microbatch))]

    def _fail(self, clock: int, reason: str) -> None:
        raise ValueError(f"table: invalid {self.name} schedule at clock {clock}: {reason}\n"
                         f"{self.grid(mark=clock)}")

    def grid(self, mark: int | None = None) -> str:
        """The table as text: one line per rank, one column per clock, ``.`` for idle."""
        width = max([len(str(c)) for row in self.table for c in row if c is not None] + [3]) + 2
        header = "clock  " + "".join(f"{clock:<{width}}" for clock in range(self.clocks))
        lines = [header]
        if mark is not None:
            lines.append("       " + " " * (width * mark) + "^" * (width - 2))
        for rank in range(self.stages):
            cells = (str(row[rank]) if rank < len(row) and row[rank] is not None else "." for row in self.table)
            lines.append(f"s{rank:<5} " + "".join(f"{cell:<{width}}" for cell in cells))
        return "\n".join(line.rstrip() for line in lines)

    def to_text(self) -> str:
        """The schedule as text that :meth:`from_text` reads back."""
        return (f"{self.name} stages={self.stages} chunks={self.chunks} virtual={self.virtual}\n"
                + "\n".join(" ".join(str(cell) if cell is not None else "." for cell in row) for row in self.table))

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        """Read a schedule written by :meth:`to_text`."""
        head, *rows = text.strip().splitlines()
        match = re.fullmatch(r"(\S+) stages=(\d+) chunks=(\d+) virtual=(\d+)", head.strip())
        if not match:
            raise ValueError(f"text: first line {head!r} is not 'NAME stages=S chunks=M virtual=V'")
        table = tuple(tuple(None if cell == "." else Action.parse(cell) for cell in row.split()) for row in rows)
        short = [clock for clock, row in enumerate(table) if len(row) != int(match[2])]
        if short:
            raise ValueError(f"text: clock {short[0]} has {len(table[short[0]])} cells, but stages={match[2]} needs "
                             "one per rank; write '.' for a rank that idles")
        return cls(match[1], int(match[2]), int(match[3]), table, int(match[4]))

    def __str__(self) -> str:
        virtual = f", {self.virtual} model stages per rank" if self.virtual > 1 else ""
        return (f"{self.name}: {self.stages} stages, {self.chunks} microbatches{virtual}, {self.clocks} clocks, "
                f"bubble {self.bubble_fraction:.1%}\n{self.grid()}")


def clocked(name: str, stages: int, chunks: int, orders: list[list[Action]], virtual: int = 1) -> Schedule:
    """The table that running each rank's ``orders`` gives: every action at the first
    clock where its rank is free and the actions it depends on finished before.

    Raises:
        ValueError: if the orders deadlock (no rank can run its next action).
    """
    shell = Schedule(name, stages, chunks, (), virtual)
    done: set[Action] = set()
    position = [0] * stages
    table: list[tuple[Action | None, ...]] = []
    while any(position[rank] < len(orders[rank]) for rank in range(stages)):
        row = [orders[rank][position[rank]] if position[rank] < len(orders[rank]) else None for rank in range(stages)]
        row = [a if a is not None and all(any(option in done for option in needed)
                                           for needed in shell._dependencies(a)) else None for a in row]
        if not any(row):
            stuck = [str(orders[r][position[r]]) for r in range(stages) if position[r] < len(orders[r])]
            raise ValueError(f"schedule: {name} deadlocks at clock {len(table)}: ranks wait on {stuck}")
        for rank, action in enumerate(row):
            if action is not None:
                position[rank] += 1
        done.update(a for a in row if a is not None)
        table.append(tuple(row))
    return Schedule(name, stages, chunks, tuple(table), virtual)


def gpipe(stages: int, chunks: int, virtual: int = 1) -> Schedule:
    """GPipe's fill-drain schedule: all forwards, then all backwards in reverse.

    Stage ``s`` runs the forward of microbatch ``t - s`` at clock ``t``; backward
    starts on the last stage with the last microbatch. The bubble fraction is
    ``(stages - 1) / (chunks + stages - 1)``.
    """
    stages, chunks = _sizes(stages, chunks)
    _single("gpipe", virtual)
    orders = [[Action(r, FORWARD, m) for m in range(chunks)] + [Action(r, BACKWARD, m) for m in reversed(range(chunks))]
              for r in range(stages)]
    return clocked("gpipe", stages, chunks, orders)


def one_f_one_b(stages: int, chunks: int, virtual: int = 1) -> Schedule:
    """1F1B: after a warm-up of ``stages - rank - 1`` forwards, each rank alternates
    one forward and one backward, so it holds at most ``stages`` microbatches'
    activations (GPipe holds ``chunks``); same bubble as GPipe."""
    stages, chunks = _sizes(stages, chunks)
    _single("1f1b", virtual)
    orders = [_one_f_one_b_order([Action(r, FORWARD, m) for m in range(chunks)],
                                 [Action(r, BACKWARD, m) for m in range(chunks)], stages - r - 1)
              for r in range(stages)]
    return clocked("1f1b", stages, chunks, orders)


def interleaved(stages: int, chunks: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's): ``virtual`` model stages per rank, placed
    round-robin; microbatches go through the rank's stages in groups of ``stages``,
    which shrinks the bubble to about ``(stages - 1) / (virtual * chunks + stages - 1)``.

    Raises:
        ValueError: if ``chunks`` is not a multiple of ``stages``.
    """
    stages, chunks = _sizes(stages, chunks)
    virtual = check_positive_int(virtual, "virtual")
    if chunks % stages:
        raise ValueError(f"chunks: interleaved 1F1B takes microbatches in groups of stages={stages}; use chunks "
                         f"a multiple of {stages} (e.g. {stages * max(1, round(chunks / stages))}), or '1f1b'")
    groups = range(chunks // stages)
    orders = []
    for r in range(stages):
        forwards = [Action(v * stages + r, FORWARD, m) for g in groups for v in range(virtual)
                    for m in range(g * stages, (g + 1) * stages)]
        backwards = [Action(v * stages + r, BACKWARD, m) for g in groups for v in reversed(range(virtual))
                     for m in range(g * stages, (g + 1) * stages)]
        warmup = min(len(forwards), (stages - r - 1) * 2 + (virtual - 1) * stages)
        orders.append(_one_f_one_b_order(forwards, backwards, warmup))
    return clocked("interleaved", stages, chunks, orders, virtual)


def zero_bubble_h1(stages: int, chunks: int, virtual: int = 1) -> Schedule:
    """ZB-H1 (zero bubble, Qi et al. 2023): each backward split into ``I`` (the
    input's gradient, which the previous stage waits for) and ``W`` (the weights'
    gradient, which nobody waits for). Each rank, every clock, runs its next ``I``
    if it is ready, else its next forward while fewer than ``stages - rank``
    microbatches have had their forward and not yet their ``W`` (1F1B's memory:
    a microbatch's activations live until its ``W``), else a pending ``W``: the
    ``W``s fill what would be bubbles."""
    stages, chunks = _sizes(stages, chunks)
    _single("zb-h1", virtual)
    shell = Schedule("zb-h1", stages, chunks, ())
    done: set[Action] = set()
    table: list[tuple[Action | None, ...]] = []
    while len(done) < 3 * stages * chunks:
        row = tuple(_zero_bubble_choice(shell, rank, done) for rank in range(stages))
        done.update(action for action in row if action is not None)
        table.append(row)
    return Schedule("zb-h1", stages, chunks, tuple(table))


def _zero_bubble_choice(shell: Schedule, rank: int, done: set[Action]) -> Action | None:
    """What ``rank`` runs next under ZB-H1's policy, given what finished before this clock."""
    forwards = sum(Action(rank, FORWARD, m) in done for m in range(shell.chunks))
    inputs = sum(Action(rank, INPUT_GRAD, m) in done for m in range(shell.chunks))
    weights = sum(Action(rank, WEIGHT_GRAD, m) in done for m in range(shell.chunks))
    candidates = (Action(rank, INPUT_GRAD, inputs), Action(rank, FORWARD, forwards))
    ready = [a for a in candidates if a.microbatch < shell.chunks
             and all(any(option in done for option in needed) for needed in shell._dependencies(a))]
    if ready and (ready[0].kind == INPUT_GRAD or forwards - weights < shell.stages - rank):
        return ready[0]
    return Action(rank, WEIGHT_GRAD, weights) if weights < inputs else None


def circular(stages: int, chunks: int, virtual: int = 2) -> Schedule:
    """GPipe over ``virtual`` rounds of the stage ring (MaxText's circular pipeline,
    the form an SPMD ring runs): rank ``r`` holds model stages ``r, r + stages, ...``;
    every microbatch goes round the ring ``virtual`` times, then all backwards run
    in reverse. The bubble is ``(stages - 1) / (virtual * chunks + stages - 1)``
    when ``chunks`` is a multiple of ``stages``.

    Raises:
        ValueError: if ``chunks`` is smaller than ``stages`` (a microbatch would
            come round before the ring is free).
    """
    stages, chunks = _sizes(stages, chunks)
    virtual = check_ring_chunks(stages, chunks, virtual)
    orders = [[Action(v * stages + r, FORWARD, m) for v in range(virtual) for m in range(chunks)]
              + [Action(v * stages + r, BACKWARD, m) for v in reversed(range(virtual)) for m in reversed(range(chunks))]
              for r in range(stages)]
    return clocked("circular", stages, chunks, orders, virtual)


def check_ring_chunks(stages: int, chunks: int, virtual: int) -> int:
    """Return ``virtual`` if ``chunks`` microbatches can go round a ring of ``stages``
    that many times (at least one per stage when they go round more than once), else
    raise naming ``chunks``."""
    virtual = check_positive_int(virtual, "virtual")
    if virtual > 1 and chunks < stages:
        raise ValueError(f"chunks: a circular pipeline needs at least stages={stages} microbatches to keep the "
                         f"ring busy; use chunks >= {stages}, or 'gpipe'")
    return virtual


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        order += [forward, backward]
    return order + backwards[len(forwards) - warmup:]


def _sizes(stages: int, chunks: int) -> tuple[int, int]:
    return check_positive_int(stages, "stages"), check_positive_int(chunks, "chunks")


def _single(name: str, virtual: int) -> None:
    if check_positive_int(virtual, "virtual") != 1:
        raise ValueError(f"virtual: {name!r} runs one model stage per rank; use virtual=1, or 'interleaved' / "
                         "'circular' for several")


ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1")  # the schedules that take only virtual=1
SPMD_SCHEDULES = ("gpipe", "circular", "1f1b")  # those the spmd executor runs (1F1B as Lockstep)


@dataclass(frozen=True)
class Lockstep:
    """1F1B as the spmd executor runs it: every stage in step, one program, so a
    clock can hold a forward and a backward on each stage.

    Stage ``s`` runs the forward of the ``i``-th microbatch to enter at clock
    ``i + s`` and its backward at clock ``i + 2S - 2 - s`` (the last stage its loss
    and backward in the clock its forward ends). The clocks fall into three loops
    (:attr:`loops`): ``S - 1`` of forwards, ``M`` of both, ``S - 1`` of backwards,
    ``(M + S - 1)(F + B)`` of work in all, as GPipe's table.

        >>> print(Lockstep(stages=2, chunks=3))
        1f1b under spmd: 2 stages, 3 microbatches, 5 clocks in 3 loops, bubble 25.0%
        loop   F      F+B    F+B    F+B    B
        clock  0      1      2      3      4
        s0     F0 .   F1 .   F2 B0  .  B1  .  B2
        s1     .  .   F0 B0  F1 B1  F2 B2  .  .
    """

    stages: int
    chunks: int
    name: str = "1f1b under spmd"

    @property
    def clocks(self) -> int:
        return self.chunks + 2 * self.stages - 2

    @property
    def loops(self) -> tuple[tuple[str, int, int], ...]:
        """Each loop's cells (``"F"``, ``"F+B"``, ``"B"``) and ``[start, end)`` clocks."""
        warm, steady = self.stages - 1, self.chunks + self.stages - 1
        return (("F", 0, warm), ("F+B", warm, steady), ("B", steady, self.clocks))

    def forward(self, clock: int, stage: int) -> int | None:
        """The microbatch whose forward ``stage`` runs at ``clock`` (None: none)."""
        microbatch = clock - stage
        return microbatch if 0 <= microbatch < self.chunks else None

    def backward(self, clock: int, stage: int) -> int | None:
        """The microbatch whose backward ``stage`` runs at ``clock`` (None: none)."""
        microbatch = clock - (2 * self.stages - 2 - stage)
        return microbatch if 0 <= microbatch < self.chunks else None

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step's work, with the forward and backward loops costing what
        their cells do: ``(S - 1) / (M + S - 1)``, GPipe's."""
        return (self.stages - 1) / (self.chunks + self.stages - 1)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Stage inputs each stage keeps at once: from a forward to its backward."""
        return tuple(min(self.chunks, 2 * (self.stages - 1 - stage) + 1) for stage in range(self.stages))

    @property
    def ring(self) -> int:
        """The slots of the ring every device stashes its stage inputs in, one program for
        all: stage 0 keeps one from its forward until its backward ``2S - 2`` clocks later."""
        return 2 * self.stages - 1

    def head_pieces(self, rows: int) -> int:
        """Into how many pieces the microbatch leaving the last stage is cut for the layers
        after the body, one to each of the last stages: the most, up to ``S``, that a
        device's ``rows`` of it split into evenly. Each device then runs those layers on
        ``rows / pieces`` rows a steady clock: ``S / pieces`` times their work in GPipe.
        """
        return max(pieces for pieces in range(1, self.stages + 1) if rows % pieces == 0)

    def __str__(self) -> str:
        head = (f"{self.name}: {self.stages} stages, {self.chunks} microbatches, {self.clocks} clocks in "
                f"{len(self.loops)} loops, bubble {self.bubble_fraction:.1%}")
        width = 7

        def cell(clock: int, stage: int) -> str:
            forward, backward = self.forward(clock, stage), self.backward(clock, stage)
            return f"{'.' if forward is None else f'F{forward}':<3}{'.' if backward is None else f'B{backward}':<3}"

        lines = [head, "loop   " + "".join(f"{name:<{width}}" * (end - start) for name, start, end in self.loops),
                 "clock  " + "".join(f"{clock:<{width}}" for clock in range(self.clocks))]
        lines += [f"s{stage:<5} " + "".join(f"{cell(clock, stage):<{width}}" for clock in range(self.clocks))
                  for stage in range(self.stages)]
        return "\n".join(line.rstrip() for line in lines)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zero_bubble_h1,
    "circular": circular,
}


def by_name(name: str, stages: int, chunks: int, virtual: int = 1) -> Schedule:
    """Build the schedule called ``name``; raises ``ValueError`` naming the options."""
    check_schedule(name, virtual)
    return SCHEDULES[name](stages, chunks, virtual)


def check_schedule(name: str, virtual: int = 1) -> str:
    """Return ``name`` if it is a schedule that runs ``virtual`` model stages per rank,
    else raise ``ValueError`` naming the options; builds nothing (a ``Pipe`` checks
    its arguments before it knows the stage count)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule: {name!r} is not a schedule; use one of {', '.join(SCHEDULES)}")
    if name in ONE_STAGE_PER_RANK:
        _single(name, virtual)
    else:
        check_positive_int(virtual, "virtual")
    return name
