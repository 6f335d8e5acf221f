"""Schedules as data: literal tables for each schedule, bubble and memory promises, the validator."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xpipe.recompute import kept_cells
from xpipe.schedule import SCHEDULES, Action, Lockstep, Schedule, by_name, clocked, gpipe


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
    with pytest.raises(ValueError, match="schedule: 'zb' is not a schedule; use one of gpipe, 1f1b"):
        by_name("zb", 2, 2)
    with pytest.raises(ValueError, match="chunks: must be a positive integer, got 0"):
        gpipe(2, 0)


def test_one_f_one_b_two_stages_three_microbatches():
    assert by_name("1f1b", 2, 3).table == table(
        "0F0 .", "0F1 1F0", ". 1B0", "0B0 1F1", "0F2 1B1", "0B1 1F2", ". 1B2", "0B2 .",
    )


def test_interleaved_places_model_stages_round_robin():
    schedule = by_name("interleaved", 2, 2, virtual=2)
    assert schedule.table == table(
        "0F0 .", "0F1 1F0", "2F0 1F1", "2F1 3F0", ". 3B0", "2B0 3F1", ". 3B1", "2B1 1B0", "0B0 1B1", "0B1 .",
    )  # rank 0 warms up with all 4 forwards (2 * (S - 1) + (V - 1) * S), rank 1 with 2, then 1F1B
    assert [schedule.rank_of(stage) for stage in range(4)] == [0, 1, 0, 1]


def test_zero_bubble_splits_the_backward_and_bounds_memory_as_1f1b_does():
    """Rank 1 may hold one microbatch until its W: it runs 1W0 before 1F1."""
    assert by_name("zb-h1", 2, 2).table == table(
        "0F0 .", "0F1 1F0", ". 1I0", "0I0 1W0", "0W0 1F1", ". 1I1", "0I1 1W1", "0W1 .",
    )


def test_circular_goes_round_the_ring_then_drains_in_reverse():
    assert by_name("circular", 2, 2, virtual=2).table == table(
        "0F0 .", "0F1 1F0", "2F0 1F1", "2F1 3F0", ". 3F1", ". 3B1", "2B1 3B0", "2B0 1B1", "0B1 1B0", "0B0 .",
    )


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 8), chunks=st.integers(1, 32), virtual=st.integers(1, 4),
       name=st.sampled_from(sorted(SCHEDULES)))
def test_every_schedule_validates_and_keeps_its_promises(stages, chunks, virtual, name):
    virtual = virtual if name in ("interleaved", "circular") else 1
    if (name == "interleaved" and chunks % stages) or (name == "circular" and virtual > 1 and chunks < stages):
        with pytest.raises(ValueError, match="chunks: "):
            by_name(name, stages, chunks, virtual)
        return
    schedule = by_name(name, stages, chunks, virtual)
    schedule.validate()
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert simulated(schedule) == schedule, "the table is what running each rank's actions in order gives"
    if name in ("gpipe", "1f1b"):
        assert schedule.bubble_fraction == pytest.approx((stages - 1) / (chunks + stages - 1))
    if name in ("interleaved", "circular") and chunks % stages == 0:
        assert schedule.bubble_fraction <= (stages - 1) / (virtual * chunks + stages - 1) + 1e-9
    if name in ("1f1b", "zb-h1"):
        assert max(schedule.peak_in_flight) <= stages


def simulated(schedule: Schedule) -> Schedule:
    """Re-run each rank's actions, in the table's order, one per clock as soon as
    their dependencies are done: a microbatch-level simulation of the table."""
    orders = [[row[rank] for row in schedule.table if row[rank] is not None] for rank in range(schedule.stages)]
    return clocked(schedule.name, schedule.stages, schedule.chunks, orders, schedule.virtual)


def test_schedule_constraints_say_what_would_work():
    with pytest.raises(ValueError, match=r"chunks: interleaved 1F1B takes microbatches in groups of stages=4; "
                                         r"use chunks a multiple of 4"):
        by_name("interleaved", 4, 6, virtual=2)
    with pytest.raises(ValueError, match="virtual: '1f1b' runs one model stage per rank"):
        by_name("1f1b", 4, 8, virtual=2)
    with pytest.raises(ValueError, match="chunks: a circular pipeline needs at least stages=4 microbatches"):
        by_name("circular", 4, 2, virtual=2)


def test_validator_requires_input_gradient_before_weight_gradient():
    with pytest.raises(ValueError, match="0W0 runs before 0I0"):
        Schedule("early", 1, 1, table("0F0", "0W0", "0I0")).validate()


def test_one_checkpoint_policy_read_from_the_table():
    """``except_last`` keeps the cells from the last microbatch's entry on: under GPipe
    microbatch ``chunks - 1 - s`` and later on stage ``s`` (the spmd executor's clock
    split), on one stage only the last microbatch."""
    schedule = gpipe(3, 4)
    assert kept_cells(schedule, "except_last") == {(s, m) for s in range(3) for m in range(4) if s + m >= 3}
    assert kept_cells(gpipe(1, 4), "except_last") == {(0, 3)}
    assert kept_cells(schedule, "always") == frozenset()
    assert kept_cells(schedule, "never") == {(s, m) for s in range(3) for m in range(4)}
    one_f_one_b = by_name("1f1b", 2, 3)  # microbatch 2 enters at clock 4; 1F1 ran at clock 3
    assert kept_cells(one_f_one_b, "except_last") == {(0, 2), (1, 2)}
    with pytest.raises(ValueError, match="checkpoint: 'sometimes' is not a mode"):
        kept_cells(schedule, "sometimes")


def test_a_short_row_in_a_written_schedule_is_refused_at_once():
    text = by_name("gpipe", 2, 2).to_text().splitlines()
    text[2] = text[2].split()[0]  # clock 1 loses its second rank's cell
    with pytest.raises(ValueError, match=r"text: clock 1 has 1 cells, but stages=2 needs one per rank"):
        Schedule.from_text("\n".join(text))


def test_lockstep_1f1b_does_gpipes_work_and_keeps_stage_inputs_by_stage_not_chunks():
    """The spmd executor's 1F1B: every microbatch's forward and backward once on every
    stage, each backward after its forward and after the next stage's backward; the
    bubble GPipe's, and 2(S - 1 - s) + 1 stage inputs kept on stage s."""
    lockstep = Lockstep(4, 8)
    assert [(cells, end - start) for cells, start, end in lockstep.loops] == [("F", 3), ("F+B", 8), ("B", 3)]
    clocks = range(lockstep.clocks)
    forwards = [{lockstep.forward(c, s): c for c in clocks if lockstep.forward(c, s) is not None} for s in range(4)]
    backwards = [{lockstep.backward(c, s): c for c in clocks if lockstep.backward(c, s) is not None} for s in range(4)]
    for stage in range(4):
        assert sorted(forwards[stage]) == sorted(backwards[stage]) == list(range(8))
        assert all(backwards[stage][m] >= forwards[stage][m] for m in range(8))
        if stage:
            assert all(forwards[stage][m] == forwards[stage - 1][m] + 1 for m in range(8))
            assert all(backwards[stage - 1][m] == backwards[stage][m] + 1 for m in range(8))
    assert lockstep.bubble_fraction == gpipe(4, 8).bubble_fraction
    assert lockstep.peak_in_flight == (7, 5, 3, 1)
    assert Lockstep(4, 2).peak_in_flight == (2, 2, 2, 1)
    assert lockstep.ring == Lockstep(4, 2).ring == max(lockstep.peak_in_flight), "one ring for every stage, every M"
    # The exiting microbatch's rows on a device, cut for the layers after the body: as many
    # pieces as split evenly, one a stage at most.
    assert [lockstep.head_pieces(rows) for rows in (1, 2, 3, 4, 6, 8, 12)] == [1, 2, 3, 4, 3, 4, 4]
    assert Lockstep(1, 8).head_pieces(4) == 1
