"""Pipeline schedules as plain data.

A schedule is a table: one row per clock, one cell per stage, each cell an
:class:`Action` (forward or backward of one microbatch) or ``None`` (the stage is
idle: a bubble). Executors interpret the table; the visualiser draws it; the
validator checks the dependencies between cells.

    >>> print(gpipe(stages=2, chunks=3))
    gpipe: 2 stages, 3 microbatches, 8 clocks, bubble 25.0%
    clock  0    1    2    3    4    5    6    7
    s0     0F0  0F1  0F2  .    .    0B2  0B1  0B0
    s1     .    1F0  1F1  1F2  1B2  1B1  1B0  .
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from xpipe._checks import check_positive_int

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    """One cell of a schedule: ``stage`` runs the forward or backward of ``microbatch``."""

    stage: int
    kind: str  # FORWARD or BACKWARD
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form, e.g. ``"1F0"`` (stage 1, forward, microbatch 0)."""
        match = re.fullmatch(r"(\d+)([FB])(\d+)", text)
        if not match:
            raise ValueError(f"text: {text!r} is not an action; write STAGE F|B MICROBATCH, e.g. '1F0'")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """Which action each stage runs at each clock.

    Attributes:
        name: the schedule's name, e.g. ``"gpipe"``.
        stages: number of pipeline stages.
        chunks: number of microbatches.
        table: ``table[clock][stage]`` is an :class:`Action` or ``None`` (idle).
    """

    name: str
    stages: int
    chunks: int
    table: tuple[tuple[Action | None, ...], ...]

    @property
    def clocks(self) -> int:
        """Number of clock ticks in one step."""
        return len(self.table)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-clock cells that are idle."""
        cells = self.clocks * self.stages
        idle = sum(cell is None for row in self.table for cell in row)
        return idle / cells

    def forward_clocks(self) -> list[tuple[Action | None, ...]]:
        """The rows that hold at least one forward action, in order."""
        return [row for row in self.table if any(c is not None and c.kind == FORWARD for c in row)]

    def validate(self) -> None:
        """Raise ``ValueError`` (with the grid, failing clock marked) if a dependency is broken.

        Every (stage, kind, microbatch) appears exactly once; a stage's forward of a
        microbatch comes after the previous stage's; backward runs in reverse, after
        the next stage's backward and, on the last stage, after its own forward.
        """
        done: dict[Action, int] = {}
        for clock, row in enumerate(self.table):
            if len(row) != self.stages:
                self._fail(clock, f"row has {len(row)} cells, expected {self.stages}")
            for stage, action in enumerate(row):
                if action is None:
                    continue
                if action.stage != stage:
                    self._fail(clock, f"{action} sits in the cell of stage {stage}")
                if action in done:
                    self._fail(clock, f"{action} runs twice (first at clock {done[action]})")
                for needed in self._dependencies(action):
                    if done.get(needed, clock) >= clock:
                        self._fail(clock, f"{action} runs before {needed}")
                done[action] = clock
        expected = {Action(s, k, m) for s in range(self.stages) for k in (FORWARD, BACKWARD) for m in range(self.chunks)}
        missing = sorted(expected - done.keys())
        if missing:
            self._fail(self.clocks - 1, f"never runs: {', '.join(map(str, missing[:5]))}")

    def _dependencies(self, action: Action) -> list[Action]:
        stage, kind, microbatch = action
        if kind == FORWARD:
            return [Action(stage - 1, FORWARD, microbatch)] if stage > 0 else []
        if stage == self.stages - 1:
            return [Action(stage, FORWARD, microbatch)]
        return [Action(stage + 1, BACKWARD, microbatch)]

    def _fail(self, clock: int, reason: str) -> None:
        raise ValueError(f"table: invalid {self.name} schedule at clock {clock}: {reason}\n"
                         f"{self.grid(mark=clock)}")

    def grid(self, mark: int | None = None) -> str:
        """The table as text: one line per stage, one column per clock, ``.`` for idle."""
        width = max([len(str(c)) for row in self.table for c in row if c is not None] + [3]) + 2
        header = "clock  " + "".join(f"{clock:<{width}}" for clock in range(self.clocks))
        lines = [header]
        if mark is not None:
            lines.append("       " + " " * (width * mark) + "^" * (width - 2))
        for stage in range(self.stages):
            cells = (str(row[stage]) if stage < len(row) and row[stage] is not None else "." for row in self.table)
            lines.append(f"s{stage:<5} " + "".join(f"{cell:<{width}}" for cell in cells))
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return (f"{self.name}: {self.stages} stages, {self.chunks} microbatches, {self.clocks} clocks, "
                f"bubble {self.bubble_fraction:.1%}\n{self.grid()}")


def gpipe(stages: int, chunks: int) -> Schedule:
    """GPipe's fill-drain schedule: all forwards, then all backwards in reverse.

    Stage ``s`` runs the forward of microbatch ``t - s`` at clock ``t``; backward
    starts on the last stage with the last microbatch. The bubble fraction is
    ``(stages - 1) / (chunks + stages - 1)``.
    """
    stages = check_positive_int(stages, "stages")
    chunks = check_positive_int(chunks, "chunks")
    span = chunks + stages - 1
    table = []
    for clock in range(span):
        table.append(tuple(_maybe(s, FORWARD, clock - s, chunks) for s in range(stages)))
    for clock in range(span):
        table.append(tuple(_maybe(s, BACKWARD, chunks - 1 - (clock - (stages - 1 - s)), chunks)
                           for s in range(stages)))
    return Schedule("gpipe", stages, chunks, tuple(table))


SCHEDULES = {"gpipe": gpipe}


def by_name(name: str, stages: int, chunks: int) -> Schedule:
    """Build the schedule called ``name``; raises ``ValueError`` naming the options."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule: {name!r} is not a schedule; use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, chunks)


def _maybe(stage: int, kind: str, microbatch: int, chunks: int) -> Action | None:
    return Action(stage, kind, microbatch) if 0 <= microbatch < chunks else None
