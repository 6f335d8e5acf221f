"""Counting what a ``Pipe`` does while it is built: captures of the model and
schedules built, each recorded by name in the order made.

Used by the ``captures`` and ``schedule_builds`` fixtures (through pytest's
``monkeypatch.setattr``) and by tests that build a ``Pipe`` in a fresh process
(through plain ``setattr``), so every count reads the same wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Setter = Callable[[Any, str, Any], None]


def counted(made: list[str], label: str, function: Callable) -> Callable:
    """``function``, appending ``label`` to ``made`` at every call."""

    def counting(*args):
        made.append(label)
        return function(*args)

    return counting


def count_captures(set_attribute: Setter = setattr) -> list[str]:
    """Record every capture from here on: ``"fx"`` for a torch.fx trace, ``"export"``
    for a torch.export run."""
    from xpipe.capture import trace as capture

    made: list[str] = []
    set_attribute(capture, "_trace_fx", counted(made, "fx", capture._trace_fx))
    set_attribute(capture, "_export", counted(made, "export", capture._export))
    return made


def count_schedule_builds(set_attribute: Setter = setattr) -> list[str]:
    """Record every schedule built by name (through ``xpipe.schedule.by_name``) from here on."""
    from xpipe import schedule

    built: list[str] = []
    counting = {name: counted(built, name, build) for name, build in schedule.SCHEDULES.items()}
    set_attribute(schedule, "SCHEDULES", counting)
    return built
