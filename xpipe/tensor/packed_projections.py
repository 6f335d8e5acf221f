"""Weights that pack projections one after the other along their output features,
split over "tensor" part by part.

GPT-2's ``c_attn`` and ``nn.MultiheadAttention``'s ``in_proj_weight`` hold q, k
and v one after the other; Phi-3's ``qkv_proj`` too, and its ``gate_up_proj``
gate and up. A contiguous split of such features would put q on one device and v
on another. Each part is split instead, Megatron's way:

- for the step, the weight is laid out *tensor-major* (:func:`tensor_major`):
  device ``t``'s contiguous share holds its share of every part (its own q heads,
  with their k and v), so that its linear computes exactly those features;
- in the block's graph, where the plain block took the linear's whole output
  apart, each part is read from that tensor-major output (:func:`split_packed`);
- where the block then folds the heads into the batch dim before attention
  (``nn.MultiheadAttention``), it unfolds them (:mod:`xpipe.tensor.head_folds`).

What the parts are is read from the block, not given: where its graph takes the
linear's output apart along the features (a split, a chunk, slices, an unflatten
into parts), the boundaries are the parts'. The weights rest, and are saved, in
their own order; only the step sees the tensor-major one.

Pure: torch only, no torch_xla.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from xpipe.tensor.head_folds import RESHAPES, keep_heads_apart
from xpipe.tensor.linear_operands import linear_operands

aten = torch.ops.aten


class CannotSplitPacked(ValueError):
    """The block's graph does not show how a packed weight's output is taken apart."""


@dataclass(frozen=True)
class PackedLinear:
    """A linear whose weight packs projections along its output features.

    Attributes:
        weight: the packed weight's name in the block.
        bias: its bias's name, if the linear adds one.
        dim: the weight's output-feature dim (1 for GPT-2's ``Conv1D`` ``[in, out]``).
        parts: the sizes of the parts along it, in order (q, k, v: ``(q, k, v)``).
    """

    weight: str
    bias: str | None
    dim: int
    parts: tuple[int, ...]


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def packed_parts(linears: Iterable[PackedLinear]) -> dict[str, tuple[int, ...]]:
    """Each packed weight and bias of ``linears``, by name, with its parts' sizes."""
    return {name: linear.parts for linear in linears for name in (linear.weight, linear.bias) if name is not None}


def tensor_major(flat: torch.Tensor, parts: Sequence[int], tensor: int) -> torch.Tensor:
    """``[..., numel]``, a packed weight stored with its packed dim first
    (:func:`xpipe.layout.stored_shape`), reordered so that each of ``tensor``
    contiguous shares holds that device's share of every part, in the parts' order."""
    rest = flat.shape[-1] // sum(parts)
    lead = flat.shape[:-1]
    shares, start = [], 0
    for size in parts:
        part = flat[..., start * rest:(start + size) * rest]
        shares.append(part.reshape(*lead, tensor, size // tensor * rest))
        start += size
    return torch.cat(shares, dim=-1).reshape(*lead, flat.shape[-1])


def packed_part(x: torch.Tensor, tensor: int, start: int, size: int) -> torch.Tensor:
    """Part ``[start, start + size)`` of a packed linear's output ``x``, whose last dim
    is tensor-major (:func:`tensor_major`): each device's share of it, then joined."""
    lead = x.shape[:-1]
    shares = x.reshape(*lead, tensor, x.shape[-1] // tensor)
    return shares[..., start // tensor:(start + size) // tensor].reshape(*lead, size)


def copy_of(block: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``block``'s graph, on ``block``'s own parameters, to rewrite."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(block.graph, {}))
    return torch.fx.GraphModule(block, graph)


def split_packed(block: torch.fx.GraphModule, names: Iterable[str], inputs: Sequence[Any],
                 tensor: int) -> tuple[torch.fx.GraphModule, list[PackedLinear]]:
    """A copy of ``block`` that runs with the packed weights ``names`` (and their
    biases) laid out tensor-major for ``tensor`` devices, and what it read of each.

    Args:
        block: one block of the stacked body, as the clock loop runs it.
        names: the parameters the rules say are packed (weights or biases).
        inputs: what the block is called with (only shapes are read, on fakes).
        tensor: the "tensor" axis size; every part must divide by it.

    Raises:
        CannotSplitPacked: naming the weight whose output the graph does not take
            apart by parts "tensor" divides.
    """
    module = copy_of(block)
    graph = module.graph
    mode = detect_fake_mode(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    ShapeProp(module, fake_mode=mode).propagate(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) and not
                                                  isinstance(x, FakeTensor) else x for x in inputs])
    names = set(names)
    weights = {node.target: node for node in graph.nodes if node.op == "get_attr" and node.target in names}
    if not weights and any(node.op == "call_module" for node in graph.nodes):
        raise CannotSplitPacked("xpipe captured the block as a module (torch.fx), and reads the parts of packed "
                                "weights only from a block captured as operations (torch.export)")
    linears = []
    for name, node in weights.items():
        linear = _packed_linear(node, name, weights, tensor)
        if linear is not None:
            linears.append(linear)
    unread = names - {n for linear in linears for n in (linear.weight, linear.bias)}
    if unread:
        raise CannotSplitPacked(f"{sorted(unread)} are packed by the rules, but no linear's weight that is packed "
                                "feeds them")
    keep_heads_apart(graph, _shape_or_none, _rows(inputs))
    module.recompile()
    return module, linears


def _packed_linear(node: torch.fx.Node, name: str, weights: dict[str, torch.fx.Node],
                   tensor: int) -> PackedLinear | None:
    """Read and split the linear that ``node`` (a packed parameter) is the weight of;
    None where it is that linear's bias (read with its weight)."""
    users = list(node.users)
    linear = users[0] if len(users) == 1 else None
    operands = linear_operands(linear) if linear is not None else None
    if operands is None:
        raise CannotSplitPacked(f"{name} is packed by the rules, but is not used by exactly one linear")
    if operands.weight is not node:
        if operands.bias is node:
            return None
        raise CannotSplitPacked(f"{name} is packed by the rules, but is not a linear's weight")
    bias, dim = operands.bias, operands.out_dim
    if isinstance(bias, torch.fx.Node) and bias.target not in weights:
        raise CannotSplitPacked(f"{bias.target} adds to {name}'s packed features; pack it too "
                                f"(tensor_rules={{{bias.target!r}: xpipe.Packed(0)}})")
    features = _shape(linear)[-1]
    out = linear
    while len(out.users) == 1 and next(iter(out.users)).target in RESHAPES \
            and _shape(next(iter(out.users)))[-1] == features:
        out = next(iter(out.users))
    parts = _take_apart(out, name, features, tensor)
    return PackedLinear(name, bias.target if isinstance(bias, torch.fx.Node) else None, dim, parts)


def _take_apart(out: torch.fx.Node, name: str, features: int, tensor: int) -> tuple[int, ...]:
    """Replace each use of the packed output ``out`` that takes it apart along its
    last dim with the parts read from the tensor-major output; the parts' sizes."""
    last = len(_shape(out)) - 1
    spans: dict[torch.fx.Node, list[tuple[int, int]]] = {}
    for user in out.users:
        spans[user] = _spans(user, last, features)
        if spans[user] is None:
            raise CannotSplitPacked(f"{name}'s packed output is used by {user.target} other than to take it "
                                    "apart along its features (a split, a chunk, slices, an unflatten)")
    edges = sorted({span for found in spans.values() for span in found})
    if len(edges) < 2 or edges[0][0] != 0 or edges[-1][1] != features or any(
            a[1] != b[0] for a, b in zip(edges, edges[1:])):
        raise CannotSplitPacked(f"{name}'s packed output is taken apart in {edges}, not in parts that cover it")
    parts = tuple(end - start for start, end in edges)
    if any(size % tensor for size in parts):
        raise CannotSplitPacked(f"tensor: {tensor} does not divide the parts {list(parts)} packed in {name}")
    graph = out.graph
    with graph.inserting_after(out):
        made = {}
        for start, end in reversed(edges):
            made[(start, end)] = graph.call_function(packed_part, (out, tensor, start, end - start))
    for user, found in spans.items():
        _replace(user, [made[span] for span in found])
    return parts


def _spans(user: torch.fx.Node, last: int, features: int) -> list[tuple[int, int]] | None:
    """The feature spans ``user`` takes ``out`` apart into, in its outputs' order;
    None if it does something else with it."""
    args = list(user.args) + [None] * 4
    if user.target in _SPLITS:
        along = user.kwargs.get("dim", args[2] if args[2] is not None else 0)
        if along not in (last, -1):
            return None
        if user.target is aten.chunk.default:
            sizes = [-(-features // args[1])] * args[1]
        elif user.target is aten.split.Tensor:
            sizes = [args[1]] * -(-features // args[1])
        else:
            sizes = list(args[1])
        if any(not (u.target is operator.getitem) for u in user.users):
            return None
        edges, start = [], 0
        for size in sizes:
            edges.append((start, min(start + size, features)))
            start += size
        return edges
    if user.target is aten.slice.Tensor:
        along, start, end = args[1] if args[1] is not None else 0, args[2] or 0, args[3]
        step = args[4] if args[4] is not None else 1
        if along not in (last, -1) or step != 1:
            return None
        end = features if end is None else min(end, features)
        return [(start, end)]
    if user.target is aten.unflatten.int and args[1] in (last, -1) and len(args[2]) == 2:
        count, size = args[2]
        return [(i * size, (i + 1) * size) for i in range(count)]
    return None


def _replace(user: torch.fx.Node, parts: list[torch.fx.Node]) -> None:
    graph = user.graph
    if user.target in _SPLITS:
        for item in list(user.users):
            item.replace_all_uses_with(parts[item.args[1]])
            graph.erase_node(item)
    elif user.target is aten.slice.Tensor:
        user.replace_all_uses_with(parts[0])
    else:  # an unflatten into [parts, size]: the parts stacked there
        with graph.inserting_before(user):
            stacked = graph.call_function(torch.stack, (parts, -2))
        user.replace_all_uses_with(stacked)
    graph.erase_node(user)


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    shape = _shape_or_none(node)
    if shape is None:
        raise CannotSplitPacked(f"the block's graph gives no shape for {node.name}")
    return shape


def _shape_or_none(node: torch.fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _rows(inputs: Sequence[Any]) -> int:
    """The sample's rows: dim 0 of the stream, the block's first input."""
    return inputs[0].shape[0]
