"""The partitioner: a contiguous, balanced split of a model's layers into stages.

``partition(module, stages)`` traces the model (``xpipe.capture.graph``), prices each layer
under a cost model, and picks the split that minimises the most expensive stage
(exactly, see ``xpipe._balance``). The result, :class:`Partition`, is plain data:
the executors, the visualiser and the tests read it; it never touches a device.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import networkx as nx
import numpy as np
from torch import nn

from xpipe._balance import balance_by_cost, stage_costs
from xpipe._checks import check_positive_int
from xpipe._format import human
from xpipe.capture.graph import OUTPUT, layer_names, module_graph
from xpipe.capture.trace import Captured

COSTS = ("params", "flops", "time", "memory")
_UNITS = {"params": "", "flops": "FLOP", "time": "s", "memory": "B"}
_TUPLE_KEYS = {"shape", "out_shape", "per_stage", "activation_bytes_by_width"}  # fields that JSON turns into lists


@dataclass(frozen=True)
class Crossing:
    """A tensor that crosses a cut: made in stage ``source_stage``, used up to ``last_stage``."""

    name: str  # the fx value's name
    producer: str  # layer (or input) that makes it
    source_stage: int
    last_stage: int  # the last stage that uses it
    shape: tuple | None  # None without a sample input
    dtype: str | None
    bytes: int


@dataclass(frozen=True)
class RepeatedBlocks:
    """The longest run of structurally identical consecutive blocks of layers.

    The SPMD executor stacks these blocks' weights ``[stages, blocks_per_stage, ...]``.
    """

    start: int  # index of the first layer of the run
    period: int  # layers per block
    count: int  # number of blocks
    per_stage: tuple[int, ...]  # blocks (whole or partial) that fall in each stage

    @property
    def layers(self) -> range:
        """Layer indices that the run covers."""
        return range(self.start, self.start + self.period * self.count)


@dataclass(frozen=True)
class Partition:
    """How a model is split into pipeline stages.

    Attributes:
        balance: layers per stage.
        stages: layer names per stage (qualified module names).
        costs: cost of each stage under ``cost``.
        cost: the cost model, one of ``"params"``, ``"flops"``, ``"time"``, ``"memory"``.
        boundaries: for each cut ``k`` (between stage ``k`` and ``k + 1``), the tensors
            that cross it, skip connections included.
        repeated: the longest run of identical blocks, or None.
        graph: the layer graph (``xpipe.capture.graph.module_graph``) with each layer's
            ``stage`` attribute set.
    """

    balance: tuple[int, ...]
    stages: tuple[tuple[str, ...], ...]
    costs: tuple[float, ...]
    cost: str
    boundaries: tuple[tuple[Crossing, ...], ...]
    repeated: RepeatedBlocks | None
    graph: nx.DiGraph = field(compare=False, repr=False)

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean stage cost (1.0 is perfect balance)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean else 1.0

    def stage_of(self, layer: str) -> int:
        """The stage that runs ``layer``."""
        return self.graph.nodes[layer]["stage"]

    def to_json(self) -> str:
        """Serialise the partition, graph included; :meth:`from_json` reads it back."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "graph"}
        data["boundaries"] = [[vars(c) for c in cut] for cut in self.boundaries]
        data["repeated"] = vars(self.repeated) if self.repeated else None
        data["graph"] = nx.node_link_data(self.graph, edges="edges")
        return json.dumps(data, default=_jsonable)

    @classmethod
    def from_json(cls, text: str) -> Partition:
        """Read a partition written by :meth:`to_json`.

        Raises:
            ValueError: ``text`` is not JSON, or JSON of another kind.
        """
        data = json.loads(text)
        missing = [key for key in ("graph", "balance", "stages", "costs", "cost", "boundaries", "repeated")
                   if not isinstance(data, dict) or key not in data]
        if missing:
            raise ValueError(f"text: this JSON is not a Partition written by Partition.to_json() (it has no "
                             f"{', '.join(map(repr, missing))}); write one with xpipe.partition(...).to_json()")
        graph = nx.node_link_graph(_tupled(data["graph"]), edges="edges")
        repeated = data["repeated"]
        return cls(
            balance=tuple(data["balance"]),
            stages=tuple(tuple(names) for names in data["stages"]),
            costs=tuple(data["costs"]),
            cost=data["cost"],
            boundaries=tuple(tuple(Crossing(**_tupled(c)) for c in cut) for cut in data["boundaries"]),
            repeated=RepeatedBlocks(**_tupled(repeated)) if repeated else None,
            graph=graph,
        )

    def __str__(self) -> str:
        rows = [f"Partition of {self.graph.graph['model']} into {len(self.balance)} stages "
                f"(cost: {self.cost}, imbalance {self.imbalance:.3f})",
                f"{'stage':>5}  {'layers':>6}  {'cost':>10}  first .. last layer"]
        for index, (names, cost) in enumerate(zip(self.stages, self.costs)):
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            rows.append(f"{index:>5}  {len(names):>6}  {human(cost) + _UNITS[self.cost]:>10}  {span}")
        for cut, crossings in enumerate(self.boundaries):
            for crossing in crossings:
                size = ("(size unknown: no sample_input)" if crossing.shape is None else
                        f"{list(crossing.shape)} {crossing.dtype} {human(crossing.bytes)}B")
                rows.append(f"  cut {cut}->{cut + 1}: {crossing.producer} ({crossing.name}) {size} "
                            f"-> stage {crossing.last_stage}")
        if self.repeated:
            r = self.repeated
            rows.append(f"repeated: {r.count} blocks of {r.period} layer(s) from layer {r.start}, "
                        f"per stage {list(r.per_stage)}")
        return "\n".join(rows)


def partition(
    module: nn.Module,
    stages: int | None = None,
    *,
    sample_input: Any = None,
    cost: str = "params",
    balance: Sequence[int] | None = None,
) -> Partition:
    """Split ``module`` into contiguous pipeline stages of balanced cost.

    Args:
        module: the model; see ``xpipe.capture.graph`` for what counts as a layer.
        stages: number of stages. May be omitted when ``balance`` is given.
        sample_input: a tensor or tuple of tensors for one forward call; needed by
            every cost model but ``"params"``, and for the shapes of crossing tensors.
        cost: what to balance: ``"params"`` (parameter count), ``"flops"`` (forward
            FLOPs), ``"time"`` (forward time, the fastest of several timed runs) or
            ``"memory"`` (bytes of weights and gradients, saved activations, and
            tensors received across the cut in front of the stage).
        balance: layers per stage, used as given instead of searching.

    Returns:
        The :class:`Partition`.

    Raises:
        ValueError: for a bad ``stages``, ``cost``, ``balance`` or ``sample_input``,
            or a model that torch.fx cannot trace.

    Example:
        >>> split = xpipe.partition(model, 4, sample_input=torch.zeros(8, 64, dtype=torch.long), cost="flops")
        >>> print(split)
    """
    return partition_captured(module, None, stages, sample_input=sample_input, cost=cost, balance=balance)


def partition_captured(
    module: nn.Module,
    captured: Captured | None,
    stages: int | None = None,
    *,
    sample_input: Any = None,
    cost: str = "params",
    balance: Sequence[int] | None = None,
) -> Partition:
    """:func:`partition` of a model that :func:`xpipe.capture.trace.trace_layers` has already
    captured (None: capture it here). ``Pipe`` splits this way, from its one capture."""
    _check_cost(cost, sample_input)
    stages = _stage_count(stages, balance)
    graph = module_graph(module, sample_input, measure_time=cost == "time", captured=captured)
    return _split(graph, stages, cost, balance)


def rebalanced(split: Partition, balance: Sequence[int] | None = None, *, stages: int | None = None) -> Partition:
    """``split``'s model split again, from the graph ``split`` already holds (the model
    is not captured again): by ``balance``, or into ``stages`` stages of balanced cost.

    Raises:
        ValueError: if ``balance`` does not fit the model's layers, or neither it nor
            ``stages`` is given.
    """
    return _split(split.graph.copy(), _stage_count(stages, balance), split.cost, balance)


def _split(graph: nx.DiGraph, stages: int, cost: str, balance: Sequence[int] | None) -> Partition:
    names = layer_names(graph)
    layer_costs = [float(layer_cost(graph.nodes[name], cost)) for name in names]
    entry = entry_bytes(graph) if cost == "memory" else None
    if balance is None:
        balance = balance_by_cost(layer_costs, stages, entry_costs=entry)
    else:
        balance = _check_balance(balance, len(names))
    return _build(graph, tuple(balance), cost, stage_costs(layer_costs, balance, entry_costs=entry))


def _check_cost(cost: str, sample_input: Any) -> None:
    if cost not in COSTS:
        raise ValueError(f"cost: {cost!r} is not a cost model; use one of {', '.join(COSTS)}")
    if cost != "params" and sample_input is None:
        raise ValueError(f"sample_input: cost={cost!r} runs the model once; pass sample_input=<a batch>")


def _stage_count(stages: int | None, balance: Sequence[int] | None) -> int:
    """The stages that ``stages`` or ``balance`` asks for, checked to agree."""
    if balance is not None:
        if stages is not None and stages != len(balance):
            raise ValueError(f"balance: has {len(balance)} stages but stages={stages}; make them agree")
        stages = len(balance)
    if stages is None:
        raise ValueError("stages: give the number of stages, or balance=[layers per stage]")
    return check_positive_int(stages, "stages")


def _check_balance(balance: Sequence[int], layers: int) -> tuple[int, ...]:
    """``balance`` as a tuple of ints (numpy integers accepted), if it fits ``layers``."""
    try:
        balance = tuple(check_positive_int(b, "balance") for b in balance)
    except ValueError:
        raise ValueError(f"balance: every stage needs a positive whole number of layers, got {list(balance)}") from None
    if sum(balance) != layers:
        raise ValueError(
            f"balance: {list(balance)} sums to {sum(balance)} but the model has {layers} layers; "
            f"make it sum to {layers}"
        )
    return balance


def layer_cost(node: dict[str, Any], cost: str) -> float:
    """One layer's cost under ``cost``, from its graph attributes; ``"memory"`` is weights
    and gradients plus saved activations (0 without a sample input; what crosses a cut is
    added per stage)."""
    if cost == "params":
        return node["params"]
    if cost == "flops":
        return node["flops"]
    if cost == "time":
        return node["time_s"]
    return 2 * node["param_bytes"] + node.get("activation_bytes", 0)


def _last_use(graph: nx.DiGraph, position: dict[str, int]) -> dict[str, dict[str, int]]:
    """For each producer, each tensor it sends to a later layer, and its last user's position."""
    last: dict[str, dict[str, int]] = {}
    for producer, consumer, edge in graph.edges(data=True):
        for tensor in edge["tensors"]:
            uses = last.setdefault(producer, {})
            uses[tensor["name"]] = max(uses.get(tensor["name"], -1), position[consumer])
    return last


def _positions(graph: nx.DiGraph) -> dict[str, int]:
    """Layer index of every node; inputs come before layer 0, the output after the last."""
    names = layer_names(graph)
    position = {name: index for index, name in enumerate(names)}
    position.update({name: -1 for name in graph.graph["inputs"]})
    position[OUTPUT] = len(names)
    return position


def _tensor_bytes(graph: nx.DiGraph) -> dict[str, int]:
    return {t["name"]: t["bytes"] for _, _, e in graph.edges(data=True) for t in e["tensors"]}


def entry_bytes(graph: nx.DiGraph) -> list[float]:
    """Bytes of the tensors that cross the cut in front of each layer (inputs at layer 0)."""
    position = _positions(graph)
    sizes = _tensor_bytes(graph)
    entry = np.zeros(len(layer_names(graph)) + 1)
    for producer, uses in _last_use(graph, position).items():
        for name, last in uses.items():
            entry[position[producer] + 1 : last + 1] += sizes[name]
    return entry[:-1].tolist()


def _build(graph: nx.DiGraph, balance: tuple[int, ...], cost: str, costs: list[float]) -> Partition:
    names = layer_names(graph)
    ends = np.cumsum(balance)
    stage_names = tuple(tuple(names[end - size : end]) for size, end in zip(balance, ends))
    for stage, members in enumerate(stage_names):
        for name in members:
            graph.nodes[name]["stage"] = stage
    return Partition(
        balance=balance,
        stages=stage_names,
        costs=tuple(costs),
        cost=cost,
        boundaries=_boundaries(graph, len(balance)),
        repeated=_repeated_blocks(graph, balance),
        graph=graph,
    )


def _stage_of_node(graph: nx.DiGraph, node: str, stages: int) -> int:
    kind = graph.nodes[node]["kind"]
    if kind == "input":
        return 0
    if kind == "output":
        return stages - 1
    return graph.nodes[node]["stage"]


def _boundaries(graph: nx.DiGraph, stages: int) -> tuple[tuple[Crossing, ...], ...]:
    """Every tensor that crosses each cut; a skip connection crosses several."""
    cuts: list[list[Crossing]] = [[] for _ in range(stages - 1)]
    last_stage: dict[tuple[str, str], int] = {}
    described: dict[str, dict[str, Any]] = {}
    for producer, consumer, edge in graph.edges(data=True):
        for tensor in edge["tensors"]:
            key = (producer, tensor["name"])
            stage = _stage_of_node(graph, consumer, stages)
            last_stage[key] = max(last_stage.get(key, -1), stage)
            described[tensor["name"]] = tensor
    for (producer, name), last in last_stage.items():
        source = _stage_of_node(graph, producer, stages)
        tensor = described[name]
        annotated = graph.graph["annotated"]
        for cut in range(source, last):
            cuts[cut].append(Crossing(
                name=name, producer=producer, source_stage=source, last_stage=last,
                shape=tensor["shape"] if annotated else None,
                dtype=tensor["dtype"] if annotated else None,
                bytes=tensor["bytes"],
            ))
    return tuple(tuple(cut) for cut in cuts)


def _repeated_blocks(graph: nx.DiGraph, balance: tuple[int, ...]) -> RepeatedBlocks | None:
    """Find the longest run of identical consecutive blocks (of one or more layers)
    that read the same tensors from before the run: layers alike in structure that
    alternate between inputs (Gemma 2's sliding-window and global masks) repeat as
    blocks of several layers, one of each kind."""
    names = layer_names(graph)
    signatures = [graph.nodes[name]["signature"] + "|" + ",".join(graph.nodes[name]["ops"]) for name in names]
    codes = np.unique(signatures, return_inverse=True)[1]
    params = np.array([graph.nodes[name]["params"] for name in names])
    best: tuple[int, int, int] | None = None  # (layers covered, -period, start)
    for period in range(1, len(names) // 2 + 1):
        same = np.concatenate([codes[:-period] == codes[period:], [False]])
        for start, length in _true_runs(same):
            count = _blocks_reading_alike(graph, names, start, period, (length + period) // period)
            if count < 2 or not params[start : start + period].any():
                continue
            candidate = (count * period, -period, start)
            if best is None or candidate > best:
                best = candidate
    if best is None:
        return None
    covered, negative_period, start = best
    period = -negative_period
    count = covered // period
    return RepeatedBlocks(start, period, count, _blocks_per_stage(start, period, count, balance))


def _blocks_reading_alike(graph: nx.DiGraph, names: list[str], start: int, period: int, count: int) -> int:
    """How many of the ``count`` blocks from layer ``start`` on read, from layers
    before the run, what the block after the first does (the first also reads the
    run's input): the stacked body runs every block with the same inputs."""
    def outside_reads(block: int) -> set[tuple[str, str]]:
        first = start + block * period
        inside = set(names[start:first + period])
        return {(producer, tensor["name"]) for layer in names[first:first + period]
                for producer, _, edge in graph.in_edges(layer, data=True) if producer not in inside
                for tensor in edge["tensors"]}

    if count < 2:
        return count
    second = outside_reads(1)
    if not second <= outside_reads(0):
        return 1
    return next((block for block in range(2, count) if outside_reads(block) != second), count)


def _true_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of True in ``flags``."""
    edges = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    return list(zip(starts.tolist(), (np.flatnonzero(edges == -1) - starts).tolist()))


def _blocks_per_stage(start: int, period: int, count: int, balance: tuple[int, ...]) -> tuple[int, ...]:
    ends = np.cumsum(balance)
    per_stage = [0] * len(balance)
    for block in range(count):
        first = start + block * period
        for stage in range(int(np.searchsorted(ends, first, side="right")),
                           int(np.searchsorted(ends, first + period - 1, side="right")) + 1):
            per_stage[stage] += 1
    return tuple(per_stage)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _tupled(value: Any) -> Any:
    """Turn the lists that JSON made of tuples (shapes) back into tuples."""
    if isinstance(value, dict):
        return {key: _as_tuple(item) if key in _TUPLE_KEYS else _tupled(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_tupled(item) for item in value]
    return value


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(item) for item in value) if isinstance(value, list) else value


def spmd_balance(whole: Partition, per_stage: tuple[int, ...]) -> list[int]:
    """Layers per model stage when ``per_stage`` blocks of the body go to each, the
    layers before the body to the first and those after it to the last (``whole``:
    the model's partition as one stage)."""
    repeated = whole.repeated
    blocks = [count * repeated.period for count in per_stage]
    post = sum(whole.balance) - repeated.start - repeated.period * repeated.count
    return [blocks[0] + repeated.start, *blocks[1:-1], blocks[-1] + post] if len(blocks) > 1 else [sum(whole.balance)]


def spmd_partition(whole: Partition, per_stage: tuple[int, ...], balance: Sequence[int] | None) -> Partition:
    """The partition the spmd executor runs: the body spread evenly over the model
    stages, pre on the first and post on the last (they run data-parallel over the
    whole mesh)."""
    repeated = whole.repeated
    layers = spmd_balance(whole, per_stage)
    if min(layers) < 1:
        raise ValueError(f"virtual: the model's body has {repeated.count} blocks, too few for "
                         f"{len(per_stage)} model stages (stages x virtual) to hold a layer each; use a smaller "
                         "virtual")
    if balance is not None and list(balance) != layers:
        raise ValueError(f"balance: the spmd executor spreads the {repeated.count} blocks evenly, which gives "
                         f"balance={layers}; pass that or leave balance out")
    return rebalanced(whole, layers)
