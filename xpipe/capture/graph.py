"""The module graph: a model, captured (:mod:`xpipe.capture.trace`), as a networkx graph of layers.

A *layer* is one call of one of the model's own submodules; a transformer block
stays one unit that a stage boundary never cuts, however deep the model nests
its blocks. Plain tensor operations written between layers (a residual add, a
reshape) belong to the layer they follow.

Nodes of the returned ``networkx.DiGraph`` are layer names (the qualified module
name, e.g. ``"blocks.3"``) plus one node per forward input and one ``"output"``
node. Edges are data dependencies; each edge lists the tensors it carries.

Node attributes (layers):
    kind: ``"layer"``; index: position in execution order; module: qualified name;
    type: module class name; ops: tensor operations folded into the layer;
    params, param_bytes: parameters the layer uses;
    signature: structural fingerprint (type, parameter shapes, traced code);
    and, when a sample input was given, out_shape, out_dtype, out_bytes,
    flops (forward), activation_bytes (saved for backward), time_s (if timed),
    activation_bytes_by_width ((last dim, bytes) pairs of what it saves for backward:
    the planner counts what is as wide as the stream whole over "tensor"),
    attention_bytes (of activation_bytes, the attention probabilities: the planner
    counts their gradient, as large, in the backward), kept_bytes (what it saves
    that no earlier layer saved, each tensor once and only those that carry a
    gradient, with the probabilities: what 1F1B under spmd keeps of it with
    ``checkpoint="never"``, where activation_bytes counts a tensor once per op of
    the layer that saves it).
Edge attributes: tensors (list of dicts with name, shape, dtype, bytes), bytes.
Graph attributes: layers (layer names in execution order), model (class name),
inputs (input node names), annotated (whether a sample input was run).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from xpipe.capture.trace import Captured, flat_inputs, is_batch_size, trace_layers

OUTPUT = "output"


def module_graph(
    module: nn.Module, sample_input: Any = None, *, measure_time: bool = False, captured: Captured | None = None
) -> nx.DiGraph:
    """Trace ``module`` into a graph of layers, annotated with their costs.

    Args:
        module: the model, captured as :mod:`xpipe.capture.trace` describes (torch.fx,
            or torch.export on ``sample_input`` for models fx cannot trace).
        sample_input: a tensor, a tuple of positional inputs or a dict of keyword
            inputs, for one forward call. With it, layers get output shapes, FLOPs,
            activation bytes and (optionally) time. The forward runs on the
            module's own device; buffers (BatchNorm running statistics) and the
            global RNG state are left as they were.
        measure_time: also time each layer's forward (needs ``sample_input``).
        captured: ``module`` as :func:`xpipe.capture.trace.trace_layers` already captured
            it (on ``sample_input``), so that it is not captured again.

    Returns:
        A ``networkx.DiGraph`` as described in this module's docstring.

    Raises:
        ValueError: if the model cannot be captured, or has no submodules.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if measure_time and sample_input is None:
        raise ValueError("measure_time: timing layers needs sample_input= as well")
    if sample_input is not None and not any(isinstance(leaf, torch.Tensor) for leaf in flat_inputs(sample_input)):
        raise TypeError(f"sample_input: holds no tensor ({type(sample_input).__name__} of "
                        f"{', '.join(sorted({type(v).__name__ for v in flat_inputs(sample_input)})) or 'nothing'}); "
                        "pass a batch as the model takes it: a tensor, a tuple of tensors, or a dict of keyword inputs")
    traced, layer_of = captured if captured is not None else trace_layers(module, sample_input)
    graph = _build_graph(module, traced, layer_of)
    if sample_input is not None:
        try:
            values = _profile(module, traced, flat_inputs(sample_input), measure_time)
        except (RuntimeError, TypeError, IndexError) as error:
            raise ValueError(f"sample_input: the model does not run on it ({str(error).splitlines()[0]}); pass a "
                             "batch shaped as the model's forward takes it (only the batch size may differ from "
                             "your real batches)") from error
        _annotate(graph, traced, layer_of, values, measure_time)
    return graph


def layer_names(graph: nx.DiGraph) -> list[str]:
    """Names of the layers of ``graph``, in execution order."""
    return list(graph.graph["layers"])


def _build_graph(
    module: nn.Module, traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str]
) -> nx.DiGraph:
    graph = nx.DiGraph(model=type(module).__name__, annotated=False)
    inputs = [node.name for node in traced.graph.nodes if node.op == "placeholder"]
    graph.graph["inputs"] = inputs
    for name in inputs:
        graph.add_node(name, kind="input")
    layers = list(dict.fromkeys(layer_of[node] for node in traced.graph.nodes
                                if node in layer_of and node.op != "get_attr"))  # in order of computing
    for index, name in enumerate(layers):
        graph.add_node(name, kind="layer", index=index, module=name.partition("#")[0], ops=[])
    graph.graph["layers"] = layers
    graph.add_node(OUTPUT, kind="output")
    for node in traced.graph.nodes:  # the batch size's arithmetic is not what a layer computes
        if node.op in ("call_function", "call_method") and not is_batch_size(node):
            graph.nodes[layer_of[node]]["ops"].append(_op_name(node))
    _add_params(graph, module, traced, layer_of)
    _add_edges(graph, traced, layer_of)
    return graph


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _add_params(
    graph: nx.DiGraph, module: nn.Module, traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str]
) -> None:
    """Count the parameters each layer uses: its module's, and any it reads itself
    (a tied parameter counts in each user)."""
    used: dict[str, dict[int, torch.Tensor]] = {}
    for name in graph.graph["layers"]:
        submodule = module.get_submodule(graph.nodes[name]["module"])
        graph.nodes[name]["type"] = type(submodule).__name__
        graph.nodes[name]["signature"] = _signature(submodule)
        used[name] = {id(t): t for t in submodule.parameters()}
    for node in traced.graph.nodes:
        if node.op == "get_attr" and node in layer_of:
            attribute = _get_attr(traced, node.target)
            if isinstance(attribute, nn.Parameter):
                used[layer_of[node]][id(attribute)] = attribute
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
        if node.op == "placeholder" or (node.op != "output" and node not in layer_of):  # an unused read
            continue
        consumer = OUTPUT if node.op == "output" else layer_of[node]
        for source in node.all_input_nodes:
            if source.op == "get_attr":
                continue  # a weight read where it is used, not a value passed between layers
            producer = source.name if source.op == "placeholder" else layer_of[source]
            if producer == consumer:
                continue
            if not graph.has_edge(producer, consumer):
                graph.add_edge(producer, consumer, tensors=[], bytes=0)
            tensors = graph.edges[producer, consumer]["tensors"]
            if all(t["name"] != source.name for t in tensors):
                tensors.append({"name": source.name, "shape": None, "dtype": None, "bytes": 0})


class _Profiler(torch.fx.Interpreter):
    """Runs the traced model node by node, measuring each node."""

    def __init__(self, traced: torch.fx.GraphModule, weights: set[int]) -> None:
        super().__init__(traced)
        self.weights = weights
        self.kept: set[int] = set()  # the storages of the saved activations that carry a gradient, counted so far
        self.records: dict[torch.fx.Node, dict[str, Any]] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        saved: dict[int, tuple[int, int, bool]] = {}
        with FlopCounterMode(display=False) as flops, _count_saved(saved, self.weights), \
                _AttentionProbabilities() as attention:
            start = time.perf_counter()
            value = super().run_node(node)
            elapsed = time.perf_counter() - start
        kept = {storage: size for storage, (size, _, carries_gradient) in saved.items()
                if carries_gradient and storage not in self.kept}
        self.kept.update(kept)
        self.records[node] = {
            "value": value,
            "flops": flops.get_total_flops(),
            "activation_bytes": sum(size for size, _, _ in saved.values()) + attention.bytes,
            "kept_bytes": sum(kept.values()) + attention.bytes,
            "attention_bytes": attention.bytes,
            "activation_bytes_by_width": _by_width((width, size) for size, width, _ in saved.values()),
            "time_s": elapsed,
        }
        return value


class _AttentionProbabilities(TorchDispatchMode):
    """Adds up the bytes of the probabilities each attention call's backward needs, which
    XLA's attention makes whole and keeps (``[..., queries, keys]``) where torch's fused
    CPU kernel keeps none: so that what a layer saves is counted as XLA runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "scaled_dot_product" in func.name() and torch.is_grad_enabled():
            query, key = (*args, None, None)[:2]
            query, key = kwargs.get("query", query), kwargs.get("key", key)
            if (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and min(query.dim(), key.dim()) >= 2
                    and (query.requires_grad or key.requires_grad)):
                self.bytes += math.prod(query.shape[:-1]) * key.shape[-2] * query.element_size()
        return func(*args, **kwargs)


def _by_width(pairs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``(last dim, bytes)`` pairs added up by last dim, sorted by it."""
    totals: dict[int, int] = {}
    for width, size in pairs:
        totals[width] = totals.get(width, 0) + size
    return tuple(sorted(totals.items()))


@contextlib.contextmanager
def _count_saved(saved: dict[int, tuple[int, int, bool]], weights: set[int]) -> Iterator[None]:
    """Record the bytes of every activation autograd saves for backward, the last dim
    of the tensor it was first saved as, and whether that carries a gradient (depends
    on the input or a weight), by storage.

    Storages in ``weights`` (the model's parameters) are not activations. What is
    kept is a detached alias: the saved tensor itself (a node's own output, say)
    would tie the graph into a cycle through C++ that Python's collector never
    frees, and the model's parameters would stay held by it (a later
    ``swap_tensors``, when a Pipe moves them, then fails).
    """

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            width = tensor.shape[-1] if tensor.dim() else 1
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), width, tensor.requires_grad))
        return tensor.detach()

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


TIMING_REPEATS = 5  # timed runs after a warm-up; each layer's time is the fastest of them


def _profile(
    module: nn.Module, traced: torch.fx.GraphModule, args: tuple, measure_time: bool
) -> dict[torch.fx.Node, dict[str, Any]]:
    """One profiled run; with ``measure_time``, a warm-up and ``TIMING_REPEATS`` timed runs
    of which each node keeps its fastest, so that a partition by time is the same from run
    to run: another process on the same cores only adds time to a run, and a layer of a
    fraction of a millisecond, stopped for a scheduler slice in most runs, had a median
    that outweighed layers a hundred times its work (a split moved in the test suite)."""
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
                record["time_s"] = min(times[node])
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
    measures = ("flops", "activation_bytes", "attention_bytes", "kept_bytes") + (("time_s",) if timed else ())
    for name in graph.graph["layers"]:
        graph.nodes[name].update(dict.fromkeys(measures, 0))
    last = {layer_of[node]: node for node in traced.graph.nodes if node in layer_of and node in records}
    for name, node in last.items():  # a layer's output: the last value it computes
        described = _describe(records[node]["value"])
        graph.nodes[name].update(out_shape=described["shape"], out_dtype=described["dtype"],
                                 out_bytes=described["bytes"])
    widths: dict[str, list[tuple[int, int]]] = {name: [] for name in graph.graph["layers"]}
    for node, record in records.items():
        if node in layer_of:
            attributes = graph.nodes[layer_of[node]]
            for key in measures:
                attributes[key] += record[key]
            widths[layer_of[node]] += record["activation_bytes_by_width"]
    for name, pairs in widths.items():
        graph.nodes[name]["activation_bytes_by_width"] = _by_width(pairs)
    for _, _, edge in graph.edges(data=True):
        for tensor in edge["tensors"]:
            tensor.update(_describe(records[by_name[tensor["name"]]]["value"]))
        edge["bytes"] = sum(t["bytes"] for t in edge["tensors"])
