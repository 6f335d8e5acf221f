"""Schedules as data: literal GPipe tables, bubble fraction, the validator."""

import pytest

from xpipe.schedule import Action, Schedule, by_name, gpipe


def table(*rows: str):
    """Rows of space-separated cells, '.' for idle."""
    return tuple(tuple(None if cell == "." else Action.parse(cell) for cell in row.split()) for row in rows)


def test_gpipe_two_stages_three_microbatches():
    assert gpipe(2, 3).table == table(
        "0F0 .", "0F1 1F0", "0F2 1F1", ". 1F2",
        ". 1B2", "0B2 1B1", "0B1 1B0", "0B0 .",
    )


@pytest.mark.parametrize("stages, chunks", [(1, 1), (2, 3), (4, 8), (8, 32), (3, 1)])
def test_gpipe_is_valid_and_its_bubble_is_the_known_fraction(stages, chunks):
    schedule = gpipe(stages, chunks)
    schedule.validate()
    assert schedule.clocks == 2 * (chunks + stages - 1)
    assert schedule.bubble_fraction == pytest.approx((stages - 1) / (chunks + stages - 1))
    assert len(schedule.forward_clocks()) == chunks + stages - 1


def test_action_round_trips_through_text():
    assert Action.parse("3B12") == Action(3, "B", 12)
    assert str(Action(1, "F", 0)) == "1F0"
    with pytest.raises(ValueError, match="text: '1X0' is not an action"):
        Action.parse("1X0")


def test_validator_marks_a_forward_that_runs_too_early():
    broken = Schedule("broken", 2, 1, table("0F0 1F0", ". 1B0", "0B0 ."))
    with pytest.raises(ValueError, match="at clock 0: 1F0 runs before 0F0") as error:
        broken.validate()
    assert "^^^" in str(error.value) and "s1     1F0" in str(error.value)


def test_validator_finds_missing_and_repeated_work():
    with pytest.raises(ValueError, match="never runs: 0B0"):
        Schedule("short", 1, 1, table("0F0")).validate()
    with pytest.raises(ValueError, match="0F0 runs twice"):
        Schedule("twice", 1, 1, table("0F0", "0F0", "0B0")).validate()


def test_backward_waits_for_the_next_stage():
    with pytest.raises(ValueError, match="0B0 runs before 1B0"):
        Schedule("early", 2, 1, table("0F0 .", ". 1F0", "0B0 1B0")).validate()


def test_unknown_schedule_and_bad_sizes_are_named():
    with pytest.raises(ValueError, match="schedule: 'zb' is not a schedule; use one of gpipe"):
        by_name("zb", 2, 2)
    with pytest.raises(ValueError, match="chunks: must be a positive integer, got 0"):
        gpipe(2, 0)
