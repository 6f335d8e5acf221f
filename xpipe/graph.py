"""The module graph: a model traced by torch.fx into a networkx graph of layers.

A *layer* is one call of a submodule in the model's forward. xpipe traces through
the root module and through containers (``nn.Sequential``, ``nn.ModuleList``,
``nn.ModuleDict``); every other submodule is a single layer, so a transformer
block stays one unit that a stage boundary never cuts. Plain tensor operations
written between layers (a residual add, a reshape) belong to the layer they follow.

Nodes of the returned ``networkx.DiGraph`` are layer names (the qualified module
name, e.g. ``"blocks.3"``) plus one node per forward input and one ``"output"``
node. Edges are data dependencies; each edge lists the tensors it carries.

Node attributes (layers):
    kind: ``"layer"``; index: position in execution order; module: qualified name;
    type: module class name; ops: tensor operations folded into the layer;
    params, param_bytes: parameters the layer uses;
    signature: structural fingerprint (type, parameter shapes, traced code);
    and, when a sample input was given, out_shape, out_dtype, out_bytes,
    flops (forward), activation_bytes (saved for backward), time_s (if timed).
Edge attributes: tensors (list of dicts with name, shape, dtype, bytes), bytes.
Graph attributes: layers (layer names in execution order), model (class name),
inputs (input node names), annotated (whether a sample input was run).
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
OUTPUT = "output"


def module_graph(
    module: nn.Module, sample_input: Any = None, *, measure_time: bool = False
) -> nx.DiGraph:
    """Trace ``module`` into a graph of layers, annotated with their costs.

    Args:
        module: the model. Its forward (and that of any container in it) must be
            traceable by torch.fx; other submodules are not traced into.
        sample_input: a tensor, or a tuple of tensors, for one forward call. With it,
            layers get output shapes, FLOPs, activation bytes and (optionally) time.
            The forward runs on the module's own device; buffers (BatchNorm running
            statistics) and the global RNG state are left as they were.
        measure_time: also time each layer's forward (needs ``sample_input``).

    Returns:
        A ``networkx.DiGraph`` as described in this module's docstring.

    Raises:
        ValueError: if fx cannot trace the model, or the model has no submodules.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if measure_time and sample_input is None:
        raise ValueError("measure_time: timing layers needs sample_input= as well")
    traced, layer_of = trace_layers(module)
    graph = _build_graph(module, traced, layer_of)
    if sample_input is not None:
        values = _profile(module, traced, _as_args(sample_input), measure_time)
        _annotate(graph, traced, layer_of, values, measure_time)
    return graph


def trace_layers(module: nn.Module) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, str]]:
    """Trace ``module`` and map each compute node of the trace to the layer that runs it.

    The executors use this to cut the traced forward into stages.
    """
    traced = _trace(module)
    return traced, _assign_layers(traced)


def extract_module(
    traced: torch.fx.GraphModule,
    inputs: list[torch.fx.Node],
    members: list[torch.fx.Node],
    outputs: list[torch.fx.Node] | None,
    name: str,
    *,
    output: torch.fx.Node | None = None,
) -> torch.fx.GraphModule:
    """A module that runs ``members`` of a trace, taking ``inputs`` as its arguments.

    It returns ``outputs`` (one value, or a tuple of several) or, when ``output``
    (the trace's output node) is given, what the model returns. Its submodules and
    parameters are the original objects, not copies: the executors cut a model
    into pieces this way and train the pieces in place.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
    for node in members:
        env[node] = graph.node_copy(node, lambda n: env[n])
    if output is not None:
        graph.output(torch.fx.map_arg(output.args[0], lambda n: env[n]))
    else:
        graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(traced, graph, class_name=name)


def layer_names(graph: nx.DiGraph) -> list[str]:
    """Names of the layers of ``graph``, in execution order."""
    return list(graph.graph["layers"])


class _LayerTracer(torch.fx.Tracer):
    """Traces through the root and containers; remembers where tracing failed."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_in: str | None = None

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return not isinstance(module, CONTAINERS)

    def call_module(self, module, forward, args, kwargs):  # type: ignore[override]
        try:
            return super().call_module(module, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(module)
            raise


def _trace(module: nn.Module) -> torch.fx.GraphModule:
    tracer = _LayerTracer()
    try:
        graph = tracer.trace(module)
    except Exception as error:
        where = tracer.failed_in or type(module).__name__
        raise ValueError(
            f"module: torch.fx cannot trace {where!r} ({type(error).__name__}: {error}). "
            "xpipe traces the model's forward and its nn.Sequential/ModuleList/ModuleDict "
            "containers; move data-dependent Python control flow into a submodule of its "
            "own (any other submodule is one layer and is not traced into), or wrap the "
            "model as an nn.Sequential of such submodules and pass balance=[...]"
        ) from error
    return torch.fx.GraphModule(module, graph)


def _assign_layers(traced: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Map every compute node to the layer that runs it."""
    layer_of: dict[torch.fx.Node, str] = {}
    pending: list[torch.fx.Node] = []
    current: str | None = None
    calls: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module":
            seen = calls.get(node.target, 0)
            calls[node.target] = seen + 1
            current = node.target if seen == 0 else f"{node.target}#{seen}"
            for waiting in pending:
                layer_of[waiting] = current
            pending.clear()
        if current is None:
            pending.append(node)
        else:
            layer_of[node] = current
    if current is None:
        raise ValueError(
            "module: its forward calls no submodule, so there are no layers to split; "
            "build the model from submodules (e.g. an nn.Sequential)"
        )
    return layer_of


def _build_graph(
    module: nn.Module, traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str]
) -> nx.DiGraph:
    graph = nx.DiGraph(model=type(module).__name__, annotated=False)
    inputs = [node.name for node in traced.graph.nodes if node.op == "placeholder"]
    graph.graph["inputs"] = inputs
    for name in inputs:
        graph.add_node(name, kind="input")
    layers: list[str] = []
    for node in traced.graph.nodes:
        if node.op == "call_module":
            name = layer_of[node]
            layers.append(name)
            graph.add_node(name, kind="layer", index=len(layers) - 1, module=node.target, ops=[])
    graph.graph["layers"] = layers
    graph.add_node(OUTPUT, kind="output")
    for node in traced.graph.nodes:
        if node.op in ("call_function", "call_method"):
            graph.nodes[layer_of[node]]["ops"].append(_op_name(node))
    _add_params(graph, traced, layer_of)
    _add_edges(graph, traced, layer_of)
    return graph


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _add_params(
    graph: nx.DiGraph, traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str]
) -> None:
    """Count the parameters each layer uses (a tied parameter counts in each user)."""
    used: dict[str, dict[int, torch.Tensor]] = {name: {} for name in graph.graph["layers"]}
    for node in traced.graph.nodes:
        if node.op == "call_module":
            submodule = traced.get_submodule(node.target)
            tensors = list(submodule.parameters())
            graph.nodes[layer_of[node]]["type"] = type(submodule).__name__
            graph.nodes[layer_of[node]]["signature"] = _signature(submodule)
        elif node.op == "get_attr":
            attribute = _get_attr(traced, node.target)
            tensors = [attribute] if isinstance(attribute, nn.Parameter) else []
        else:
            continue
        for tensor in tensors:
            used[layer_of[node]][id(tensor)] = tensor
    for name, tensors in used.items():
        graph.nodes[name]["params"] = sum(t.numel() for t in tensors.values())
        graph.nodes[name]["param_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())


def _get_attr(traced: torch.fx.GraphModule, target: str) -> Any:
    owner, _, attribute = target.rpartition(".")
    return getattr(traced.get_submodule(owner), attribute)


def _signature(submodule: nn.Module) -> str:
    """Fingerprint equal for blocks of the same type, parameter shapes and traced code."""
    shapes = [(name, tuple(t.shape), str(t.dtype)) for name, t in submodule.state_dict().items()]
    try:
        code = torch.fx.symbolic_trace(submodule).code
    except Exception:
        code = repr(submodule)
    text = f"{type(submodule).__qualname__}|{shapes}|{code}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _add_edges(
    graph: nx.DiGraph, traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str]
) -> None:
    """Add an edge wherever a value made in one layer (or input) is used in another."""
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            continue
        consumer = OUTPUT if node.op == "output" else layer_of[node]
        for source in node.all_input_nodes:
            producer = source.name if source.op == "placeholder" else layer_of[source]
            if producer == consumer:
                continue
            if not graph.has_edge(producer, consumer):
                graph.add_edge(producer, consumer, tensors=[], bytes=0)
            tensors = graph.edges[producer, consumer]["tensors"]
            if all(t["name"] != source.name for t in tensors):
                tensors.append({"name": source.name, "shape": None, "dtype": None, "bytes": 0})


def _as_args(sample_input: Any) -> tuple:
    return tuple(sample_input) if isinstance(sample_input, (tuple, list)) else (sample_input,)


class _Profiler(torch.fx.Interpreter):
    """Runs the traced model node by node, measuring each node."""

    def __init__(self, traced: torch.fx.GraphModule, weights: set[int]) -> None:
        super().__init__(traced)
        self.weights = weights
        self.records: dict[torch.fx.Node, dict[str, Any]] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        saved: dict[int, int] = {}
        with FlopCounterMode(display=False) as flops, _count_saved(saved, self.weights):
            start = time.perf_counter()
            value = super().run_node(node)
            elapsed = time.perf_counter() - start
        self.records[node] = {
            "value": value,
            "flops": flops.get_total_flops(),
            "activation_bytes": sum(saved.values()),
            "time_s": elapsed,
        }
        return value


@contextlib.contextmanager
def _count_saved(saved: dict[int, int], weights: set[int]) -> Iterator[None]:
    """Record the bytes of every activation autograd saves for backward, by storage.

    Storages in ``weights`` (the model's parameters) are not activations.
    """

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


@contextlib.contextmanager
def _state_preserved(module: nn.Module) -> Iterator[None]:
    """Leave buffers and the global RNG as they were after a profiling forward."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buffer in module.named_buffers():
                    buffer.copy_(buffers[name])


TIMING_REPEATS = 5  # timed runs after a warm-up; each layer's time is their median


def _profile(
    module: nn.Module, traced: torch.fx.GraphModule, args: tuple, measure_time: bool
) -> dict[torch.fx.Node, dict[str, Any]]:
    """One profiled run; with ``measure_time``, a warm-up and ``TIMING_REPEATS`` timed runs
    whose per-node median is kept, so that a partition by time is the same from run to run."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    with _state_preserved(module), torch.enable_grad():
        if measure_time:
            _Profiler(traced, weights).run(*args)  # warm-up: first calls are slow
        profiler = _Profiler(traced, weights)
        profiler.run(*args)
        if measure_time:
            times = {node: [record["time_s"]] for node, record in profiler.records.items()}
            for _ in range(TIMING_REPEATS - 1):
                again = _Profiler(traced, weights)
                again.run(*args)
                for node, record in again.records.items():
                    times[node].append(record["time_s"])
            for node, record in profiler.records.items():
                record["time_s"] = statistics.median(times[node])
    return profiler.records


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _describe(value: Any) -> dict[str, Any]:
    """Shape, dtype and bytes of a value: a tensor, or a structure of tensors."""
    leaves = _tensor_leaves(value)
    size = sum(t.numel() * t.element_size() for t in leaves)
    if isinstance(value, torch.Tensor):
        return {"shape": tuple(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "bytes": size}
    return {
        "shape": tuple(tuple(t.shape) for t in leaves),
        "dtype": ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in leaves})),
        "bytes": size,
    }


def _annotate(
    graph: nx.DiGraph,
    traced: torch.fx.GraphModule,
    layer_of: dict[torch.fx.Node, str],
    records: dict[torch.fx.Node, dict[str, Any]],
    timed: bool,
) -> None:
    graph.graph["annotated"] = True
    by_name = {node.name: node for node in traced.graph.nodes}
    measures = ("flops", "activation_bytes", "time_s") if timed else ("flops", "activation_bytes")
    for name in graph.graph["layers"]:
        graph.nodes[name].update(dict.fromkeys(measures, 0))
    for node, record in records.items():
        if node.op == "call_module":
            described = _describe(record["value"])
            graph.nodes[layer_of[node]].update(
                out_shape=described["shape"], out_dtype=described["dtype"], out_bytes=described["bytes"]
            )
        if node in layer_of:
            attributes = graph.nodes[layer_of[node]]
            for key in measures:
                attributes[key] += record[key]
    for _, _, edge in graph.edges(data=True):
        for tensor in edge["tensors"]:
            tensor.update(_describe(records[by_name[tensor["name"]]]["value"]))
        edge["bytes"] = sum(t["bytes"] for t in edge["tensors"])
