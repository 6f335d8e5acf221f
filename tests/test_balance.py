"""The exact balancer against brute force, on random cost lists."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xpipe._balance import balance_by_cost, stage_costs


def brute_force_optimum(costs, stages, entry_costs=None):
    """Smallest largest-stage cost over every contiguous split."""
    layers = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        balance = [end - start for start, end in zip(bounds, bounds[1:])]
        worst = max(stage_costs(costs, balance, entry_costs=entry_costs))
        best = worst if best is None else min(best, worst)
    return best


@st.composite
def cost_lists(draw, with_entry=False):
    costs = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=10))
    stages = draw(st.integers(1, len(costs)))
    entry = draw(st.lists(st.integers(0, 1000), min_size=len(costs), max_size=len(costs))) if with_entry else None
    return costs, stages, entry


def check_optimal(costs, stages, entry):
    balance = balance_by_cost(costs, stages, entry_costs=entry)
    assert len(balance) == stages and sum(balance) == len(costs) and min(balance) >= 1
    assert max(stage_costs(costs, balance, entry_costs=entry)) == brute_force_optimum(costs, stages, entry)


@settings(max_examples=400, deadline=None)
@given(cost_lists())
def test_additive_split_equals_brute_force(case):
    check_optimal(*case)


@settings(max_examples=400, deadline=None)
@given(cost_lists(with_entry=True))
def test_split_with_entry_costs_equals_brute_force(case):
    check_optimal(*case)


def test_equal_costs_split_evenly():
    assert balance_by_cost([1.0] * 8, 4) == [2, 2, 2, 2]


def test_entry_cost_moves_the_cut_away_from_a_large_crossing():
    # Cutting before layer 2 would make stage 2 receive 100; before layer 1 or 3 costs nothing extra.
    assert balance_by_cost([1, 1, 1, 1], 2, entry_costs=[0, 0, 100, 0]) in ([1, 3], [3, 1])


@pytest.mark.parametrize(
    "costs, stages, message",
    [
        ([1, 2], 0, "stages: must be a positive integer"),
        ([1, 2], 3, "stages: 3 stages need at least 3 layers"),
        ([1, -2], 1, "costs: every cost must be finite and >= 0"),
    ],
)
def test_bad_input_names_the_argument(costs, stages, message):
    with pytest.raises(ValueError, match=message):
        balance_by_cost(costs, stages)


def test_entry_costs_must_match_layers():
    with pytest.raises(ValueError, match="entry_costs: has 1 values but costs has 2"):
        balance_by_cost([1, 2], 1, entry_costs=[0])
