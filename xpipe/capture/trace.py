"""Capture a model as a graph whose every node knows the layer that runs it.

A *layer* is one call of one of the user's own submodules, named as in
``model.named_modules()`` (``"model.layers.3"``). Which submodules are layers:
every submodule is one, except the ones xpipe looks inside: containers
(``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), the root, and the
modules on the way down to each run of repeated blocks (the outermost
containers holding two or more alike children), so that the blocks are layers
however deep the model nests them (``model.model.layers`` in a Hugging Face
model, ``encoder.layers`` in torchvision's ViT, both ``encoder.block`` and
``decoder.block`` in T5).

Two ways to capture, the fast one first:

- ``torch.fx`` symbolic tracing, which needs no sample input. Tensor operations
  written between layers (a residual add, a reshape) belong to the layer they follow.
- ``torch.export`` (non-strict), on a sample input, for models fx cannot trace
  (Hugging Face transformers wrap every forward in a decorator fx cannot read).
  The graph is flat (aten operations); each operation's layer is read from the
  module stack export records for it, with the same rule for what is a layer.

Both give a ``torch.fx.GraphModule`` whose parameters are the model's own objects.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from xpipe.capture.experts import captured_dense
from xpipe.capture.substitutes import substitute_operators

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class Captured(NamedTuple):
    """A model captured once: the trace, and the layer that runs each compute node.

    A ``Pipe`` captures its model once and reads this for the split, the executor
    choice and the cut into pieces; a reader that changes the trace works on
    :meth:`copy`.
    """

    traced: torch.fx.GraphModule
    layer_of: dict[torch.fx.Node, str]

    def copy(self) -> Captured:
        """The same capture with a graph of its own (the parameters are still the model's)."""
        traced = torch.fx.GraphModule(self.traced, copy.deepcopy(self.traced.graph),
                                      class_name=type(self.traced).__name__)
        traced.meta.update(self.traced.meta)
        for spec in ("_in_spec", "_out_spec"):  # torch.export's input and output structure
            if hasattr(self.traced, spec):
                setattr(traced, spec, getattr(self.traced, spec))
        by_name = {node.name: node for node in traced.graph.nodes}  # a graph's copy keeps its node names
        return Captured(traced, {by_name[node.name]: layer for node, layer in self.layer_of.items()})


def trace_layers(module: nn.Module, sample_input: Any = None) -> Captured:
    """Capture ``module`` and map each compute node to the layer that runs it.

    Args:
        module: the model.
        sample_input: a tensor, a tuple of positional inputs, or a dict of keyword
            inputs; needed only for models torch.fx cannot trace.

    Raises:
        ValueError: if fx cannot trace the model and no sample input was given, or
            neither fx nor torch.export can capture it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    opened = opened_modules(module)
    try:
        traced, traced_opened = _trace_fx(module, opened)
    except _UntraceableError as error:
        if sample_input is None:
            raise ValueError(f"{error} Or pass sample_input=<a batch, as the model takes it> so that xpipe "
                             "can capture it with torch.export instead") from error.__cause__
    else:
        if traced_opened == opened or sample_input is None:
            return Captured(traced, _assign_by_calls(traced))
        # fx kept a module on the way to the blocks whole; export can look inside it
    traced = _export(module, sample_input)
    return Captured(traced, _assign_by_stack(traced, module, opened))


def input_values(sample_input: Any) -> tuple[tuple, dict[str, Any]]:
    """``sample_input`` as (positional, keyword) arguments."""
    if isinstance(sample_input, dict):
        return (), dict(sample_input)
    if isinstance(sample_input, (tuple, list)):
        return tuple(sample_input), {}
    return (sample_input,), {}


def flat_inputs(sample_input: Any) -> list[Any]:
    """The values a captured graph's placeholders take, in order."""
    return tree_flatten(input_values(sample_input))[0]


def opened_modules(module: nn.Module) -> set[str]:
    """Names of the modules xpipe looks inside rather than treating as one layer:
    the root and the modules on the way to each run of repeated blocks (containers
    are looked inside wherever they are reached)."""
    opened = {""}
    for repeated in _repeated_containers(module):
        parts = repeated.split(".")
        opened.update(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return opened


def is_layer(module: nn.Module, name: str, opened: set[str]) -> bool:
    """Whether the submodule ``name`` is one layer (not looked inside)."""
    return name not in opened and not isinstance(module, CONTAINERS)


def _repeated_containers(module: nn.Module) -> list[str]:
    """The outermost containers with two or more alike children: one for a decoder
    stack (``model.layers``), two for an encoder-decoder (``encoder.block`` and
    ``decoder.block``). A container inside another one's blocks (the experts of a
    mixture-of-experts layer) is part of its block, not a run of its own."""
    found: list[str] = []
    for name, container in module.named_modules():  # parents before their children
        if not isinstance(container, CONTAINERS) or any(_is_within(name, outer) for outer in found):
            continue
        kinds = Counter(_kind(child) for child in container.children())
        if kinds and max(kinds.values()) >= 2:
            found.append(name)
    return found


def _is_within(name: str, outer: str) -> bool:
    """Whether module ``name`` lies inside module ``outer`` (everything lies inside the root)."""
    return outer == "" or name.startswith(outer + ".")


def _kind(module: nn.Module) -> tuple:
    """Type and parameter shapes: alike blocks share it."""
    return type(module), tuple((name, tuple(t.shape)) for name, t in module.state_dict().items())


class _UntraceableError(Exception):
    """torch.fx could not trace the model."""


class _LayerTracer(torch.fx.Tracer):
    """Traces through the opened modules and containers; remembers where tracing failed."""

    def __init__(self, opened: set[str]) -> None:
        super().__init__()
        self.opened = opened
        self.failed_in: str | None = None

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return is_layer(module, qualified_name, self.opened)

    def call_module(self, module, forward, args, kwargs):  # type: ignore[override]
        try:
            return super().call_module(module, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(module)
            raise


def _trace_fx(module: nn.Module, opened: set[str]) -> tuple[torch.fx.GraphModule, set[str]]:
    """fx trace, and the modules it looked inside: a module on the way to the blocks
    that fx cannot trace is kept whole."""
    while True:
        tracer = _LayerTracer(opened)
        try:
            return torch.fx.GraphModule(module, tracer.trace(module)), opened
        except Exception as error:
            where = tracer.failed_in or ""
            if where and where in opened:
                opened = opened - {where}
                continue
            raise _UntraceableError(
                f"module: torch.fx cannot trace {where or type(module).__name__!r} ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}). xpipe traces the model's forward and its "
                "nn.Sequential/ModuleList/ModuleDict containers; move data-dependent Python control flow into "
                "a submodule of its own (any other submodule is one layer and is not traced into), or wrap the "
                "model as an nn.Sequential of such submodules and pass balance=[...]."
            ) from error


def _export(module: nn.Module, sample_input: Any) -> torch.fx.GraphModule:
    """torch.export's graph of ``module``, its batch dims left free (a microbatch is
    smaller than the sample)."""
    args, kwargs = _at_least_two_rows(*input_values(sample_input))
    named = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments  # as export names them
    batch_free = {name: tree_map(lambda x: {0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim()
                                 else None, value) for name, value in named.items()}
    try:
        with captured_dense(module):
            exported = torch.export.export(module, args, kwargs, dynamic_shapes=batch_free, strict=False)
    except Exception as error:
        raise ValueError(f"module: neither torch.fx nor torch.export can capture {type(module).__name__} "
                         f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                         f"{_export_advice(module, kwargs)}") from error
    traced = exported.module()
    traced.meta[INPUT_SHAPES] = _placeholder_shapes(traced)
    for node in traced.graph.nodes:  # the fake tensors of tracing hold weak references to the parameters
        for key in ("val", "tensor_meta", "example_value", "unbacked_bindings"):
            node.meta.pop(key, None)
    substitute_operators(traced)
    return traced


def as_operations(piece: torch.fx.GraphModule, inputs: Sequence[Any], training: bool) -> torch.fx.GraphModule:
    """``piece`` (captured by torch.fx, so calling modules) captured again by
    torch.export as the operations those modules run, in train or eval mode (such a
    graph fixes dropout), its batch dim left free; its parameters keep their names.
    ``inputs`` (real or fake tensors) are read for their shapes and dtypes only.

    Raises:
        ValueError: if torch.export cannot capture it.
    """
    modes = {module: module.training for module in piece.modules()}
    piece.train(training)
    try:
        captured = _export(piece, tuple(torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x
                                        for x in inputs))
    finally:
        for module, mode in modes.items():
            module.training = mode
    # Called as ``piece`` is, with its inputs, returning its one output: not through torch.export's pytrees.
    captured.graph._codegen = torch.fx.graph.CodeGen()
    output = next(node for node in captured.graph.nodes if node.op == "output")
    (value,) = output.args[0]
    output.args = (value,)
    captured.recompile()
    return captured


INPUT_SHAPES = "xpipe_input_shapes"  # GraphModule meta: the sample's shape of each input (None: a free dim)


def _placeholder_shapes(traced: torch.fx.GraphModule) -> list[tuple[str, tuple[int | None, ...] | None]]:
    """Each input's name and the shape torch.export fixed for it (None for a dim it
    left free, and for an input that is not a tensor)."""
    shapes = []
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val")
            shape = (tuple(d if isinstance(d, int) else None for d in value.shape)
                     if isinstance(value, torch.Tensor) else None)
            shapes.append((node.name, shape))
    return shapes


def _export_advice(module: nn.Module, kwargs: dict[str, Any]) -> str:
    """What to change when torch.export cannot capture ``module`` on the sample."""
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False) and not {"labels", "decoder_input_ids"} & set(kwargs):
        return ("an encoder-decoder model also needs its decoder's input: put labels= or decoder_input_ids= in "
                "sample_input (and pass the same to the Pipe)")
    if config is not None and getattr(config, "use_cache", False):
        return "for a Hugging Face model, set use_cache=False in its config (a cache is not a tensor output)"
    return "pass a sample_input that the model's forward accepts as it is, or fix what the error above names"


def _at_least_two_rows(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A sample of one row, given twice: torch.export fixes a dim of size 1 and the
    graph would then refuse every other microbatch size."""
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor) and x.dim()]
    if not tensors or any(x.shape[0] != 1 for x in tensors):
        return args, kwargs
    return tree_map(lambda x: torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() else x, (args, kwargs))


def _assign_by_calls(traced: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """fx: every ``call_module`` node starts a layer; other nodes join the layer
    before them (those before the first layer join the first)."""
    layer_of: dict[torch.fx.Node, str] = {}
    pending: list[torch.fx.Node] = []
    current: str | None = None
    calls: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_module":
            current = _call_name(node.target, calls)
            layer_of.update(dict.fromkeys(pending, current))
            pending.clear()
        if current is None:
            pending.append(node)
        else:
            layer_of[node] = current
    return _checked(layer_of, current)


def _assign_by_stack(traced: torch.fx.GraphModule, module: nn.Module, opened: set[str]) -> dict[torch.fx.Node, str]:
    """export: a node's layer is the outermost layer module in its module stack;
    nodes of an opened module's own code join the layer before them. A parameter
    read (``get_attr``) joins the layer of its first user."""
    layer_of: dict[torch.fx.Node, str] = {}
    pending: list[torch.fx.Node] = []
    current: str | None = None
    previous_module: str | None = None
    calls: dict[str, int] = {}
    names = dict(module.named_modules())
    for node in traced.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        owner = _stack_layer(node, names, opened)
        if owner is not None and owner != previous_module:
            current = _call_name(owner, calls)
            layer_of.update(dict.fromkeys(pending, current))
            pending.clear()
        previous_module = owner if owner is not None else previous_module
        if current is None:
            pending.append(node)
        else:
            layer_of[node] = current
    for node in traced.graph.nodes:
        if node.op == "get_attr" and node.users:
            layer_of[node] = layer_of.get(next(iter(node.users)), current)
    return _checked(layer_of, current)


def _stack_layer(node: torch.fx.Node, names: dict[str, nn.Module], opened: set[str]) -> str | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in names and is_layer(names[path], path, opened):  # export also records hooks of its own
            return path
    return None


def _call_name(target: str, calls: dict[str, int]) -> str:
    """``target`` for its first call, ``target#k`` for call ``k`` after that."""
    seen = calls.get(target, 0)
    calls[target] = seen + 1
    return target if seen == 0 else f"{target}#{seen}"


def _checked(layer_of: dict[torch.fx.Node, str], current: str | None) -> dict[torch.fx.Node, str]:
    if current is None:
        raise ValueError(
            "module: its forward calls no submodule, so there are no layers to split; "
            "build the model from submodules (e.g. an nn.Sequential)"
        )
    return layer_of


# the Python arithmetic torch.export records on sizes (``16 * batch``)
_SIZE_ARITHMETIC = (operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.neg)


def is_batch_size(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the batch size (torch.export's ``sym_size(input, 0)``) or
    arithmetic of it with constants (a Mixtral block's ``16 * batch`` token count).
    torch.export computes such a size once, in the first layer that needs it, and
    every later layer reads it from there."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten.sym_size.int:
        return node.args[0].op == "placeholder" and node.args[1] == 0
    operands = [a for a in node.args if isinstance(a, torch.fx.Node)]
    return node.target in _SIZE_ARITHMETIC and bool(operands) and all(is_batch_size(a) for a in operands)


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


@dataclass(frozen=True)
class ExportedForm:
    """What a model captured by torch.export keeps beside its graph.

    Attributes:
        output_spec: how the graph's flat outputs fold back into what the model
            returns (a ``ModelOutput``, say).
        training: the mode the graph was captured in; its dropout is fixed in it.
    """

    output_spec: TreeSpec
    training: bool
    input_shapes: list[tuple[str, tuple[int | None, ...] | None]]

    @classmethod
    def of(cls, traced: torch.fx.GraphModule, module: nn.Module) -> ExportedForm | None:
        """For a trace by torch.export; None for one by torch.fx (which keeps modes)."""
        if not hasattr(traced, "_out_spec"):
            return None
        return cls(traced._out_spec, module.training, traced.meta.get(INPUT_SHAPES, []))

    def check_inputs(self, inputs: tuple, microbatch_dim: int | None) -> None:
        """Refuse, naming the input, a batch whose shapes the graph cannot take: only the
        batch dim may differ from the sample's (torch.export fixed every other)."""
        leaves = tree_flatten(inputs)[0]
        for (name, expected), value in zip(self.input_shapes, leaves):
            if expected is None or not isinstance(value, torch.Tensor):
                continue
            shape = list(value.shape)
            if microbatch_dim is not None and len(shape) > microbatch_dim:
                del shape[microbatch_dim]
            fits = len(shape) == len(expected) and all(e is None or e == d for e, d in zip(expected, shape))
            if not fits:
                sample = [":" if e is None else e for e in expected]
                raise ValueError(f"x: input {name!r} has shape {shape}, and the model was captured by torch.export "
                                 f"on sample_input with shape {sample} (':' the batch dim, the only one that may "
                                 "differ); pass batches of that shape, or build the Pipe with a sample_input shaped "
                                 "like your batches")

    def folded(self, output: Any) -> Any:
        """The graph's flat outputs as the model returns them."""
        return tree_unflatten(list(output), self.output_spec)

    def check_mode(self, training: bool) -> None:
        """Refuse to run in the mode the graph was not captured in."""
        if training != self.training:
            mode = {True: "train", False: "eval"}
            raise RuntimeError(
                f"pipe: the model was captured by torch.export in {mode[self.training]} mode, which fixes "
                f"dropout in its graph, and the Pipe is now in {mode[training]} mode. Build the Pipe with the "
                f"model in the mode you run it (model.{mode[training]}() before xpipe.Pipe(...))")


def place_constants_on(piece: torch.fx.GraphModule, device: torch.device) -> None:
    """Make the tensors ``piece`` creates or moves with a fixed device (``arange``,
    ``ones``, ``.to(device)``, as torch.export records them from the sample's
    device) come out on ``device``."""

    def placed(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    for node in piece.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, placed)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, placed)
    piece.recompile()
