"""Exact contiguous balancing of a layer cost list into pipeline stages.

Pure algorithms (numpy only, no torch): given the cost of each layer, find the
balance (layers per stage) that minimises the largest stage cost. A stage that
covers layers ``[i, j)`` costs ``sum(costs[i:j]) + entry_costs[i]``, where the
optional ``entry_costs[i]`` prices what crosses the cut in front of layer ``i``
(the tensors a stage starting there must receive and hold).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from xpipe._checks import check_positive_int


def balance_by_cost(
    costs: Sequence[float], stages: int, *, entry_costs: Sequence[float] | None = None
) -> list[int]:
    """Return the balance that minimises the most expensive stage.

    Args:
        costs: non-negative cost of each layer, in execution order.
        stages: number of non-empty contiguous stages, ``1 <= stages <= len(costs)``.
        entry_costs: optional non-negative cost of starting a stage at each layer,
            ``len(entry_costs) == len(costs)``.

    Returns:
        Layers per stage; sums to ``len(costs)``.

    Raises:
        ValueError: for a stage count out of range or negative costs.
    """
    layer_costs = _checked_costs(costs, "costs")
    _check_stages(stages, len(layer_costs))
    prefix = np.concatenate([[0.0], np.cumsum(layer_costs)])
    if entry_costs is None:
        choices = _additive_choices(prefix, stages)
    else:
        entry = _checked_costs(entry_costs, "entry_costs")
        if len(entry) != len(layer_costs):
            raise ValueError(
                f"entry_costs: has {len(entry)} values but costs has {len(layer_costs)}; "
                "give one entry cost per layer"
            )
        choices = _general_choices(prefix, entry, stages)
    return _backtrack(choices, len(layer_costs), stages)


def stage_costs(
    costs: Sequence[float], balance: Sequence[int], *, entry_costs: Sequence[float] | None = None
) -> list[float]:
    """Return the cost of each stage of ``balance`` under the same cost model."""
    starts = np.concatenate([[0], np.cumsum(balance)[:-1]]).astype(int)
    totals = []
    for start, size in zip(starts, balance):
        total = float(sum(costs[start : start + size]))
        if entry_costs is not None:
            total += float(entry_costs[start])
        totals.append(total)
    return totals


def _checked_costs(costs: Sequence[float], name: str) -> np.ndarray:
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"{name}: expected a flat list of numbers, got shape {values.shape}")
    if values.size and (values.min() < 0 or not np.isfinite(values).all()):
        raise ValueError(f"{name}: every cost must be finite and >= 0, got {values.min()}")
    return values


def _check_stages(stages: int, layers: int) -> None:
    check_positive_int(stages, "stages")
    if stages > layers:
        raise ValueError(
            f"stages: {stages} stages need at least {stages} layers, but there are only "
            f"{layers}; use stages <= {layers}"
        )


def _additive_choices(prefix: np.ndarray, stages: int) -> list[np.ndarray]:
    """Dynamic programme over stages for purely additive costs, O(stages * L log L).

    ``best[j]``, the optimum for the first ``j`` layers, never decreases with ``j``,
    while the cost of a last stage ``[i, j)`` never increases with ``i``; so the
    optimal cut is where ``best[i] + prefix[i]`` first reaches ``prefix[j]``, or the
    cut just before it, and a binary search finds it for every ``j`` at once.
    """
    layers = len(prefix) - 1
    best = prefix.copy()
    choices = []
    for stage in range(2, stages + 1):
        low = stage - 1
        ends = np.arange(stage, layers + 1)
        rising = best[low:layers] + prefix[low:layers]
        crossing = np.searchsorted(rising, prefix[ends], side="left") + low
        upper = np.minimum(crossing, ends - 1)
        lower = np.maximum(upper - 1, low)
        cost_upper = np.maximum(best[upper], prefix[ends] - prefix[upper])
        cost_lower = np.maximum(best[lower], prefix[ends] - prefix[lower])
        chosen = np.where(cost_lower < cost_upper, lower, upper)
        new_best = np.full(layers + 1, np.inf)
        new_best[ends] = np.minimum(cost_lower, cost_upper)
        choice = np.zeros(layers + 1, dtype=np.int64)
        choice[ends] = chosen
        best = new_best
        choices.append(choice)
    return choices


def _general_choices(prefix: np.ndarray, entry: np.ndarray, stages: int) -> list[np.ndarray]:
    """Dynamic programme over stages when a stage also pays an entry cost, O(stages * L^2)."""
    layers = len(prefix) - 1
    starts = np.arange(layers + 1)[:, None]
    ends = np.arange(layers + 1)[None, :]
    entry_at = np.concatenate([entry, [0.0]])[:, None]
    last_stage = np.where(starts < ends, prefix[None, :] - prefix[:, None] + entry_at, np.inf)
    best = last_stage[0].copy()
    choices = []
    for stage in range(2, stages + 1):
        usable = np.where(starts >= stage - 1, np.maximum(best[:, None], last_stage), np.inf)
        choices.append(np.argmin(usable, axis=0))
        best = usable.min(axis=0)
    return choices


def _backtrack(choices: list[np.ndarray], layers: int, stages: int) -> list[int]:
    cuts = [layers]
    for choice in reversed(choices):
        cuts.append(int(choice[cuts[-1]]))
    cuts.append(0)
    cuts.reverse()
    return [end - start for start, end in zip(cuts, cuts[1:])]
