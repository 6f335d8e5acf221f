"""Column-parallel linears that read the same input, run as one linear.

Llama's q, k and v projections read the same normed stream, and so do its MLP's
gate and up projections. Split over "tensor" by their output features, each
one's input gradient is a partial sum on every device of a tensor group, and
XLA reduces each on its own: five all-reduces a block in the backward where
Megatron adds the input gradients up and reduces twice (once for attention's
input, once for the MLP's).

Joined, the block computes the same features with one matmul whose weight lays
the parts out tensor-major (each device's share of every part together, as
:mod:`xpipe.tensor.packed_projections` lays out a packed weight), and reads each part
back from its output; its backward then makes the input's gradient with one
matmul, reduced once. The weights stay separate parameters, at rest, in
checkpoints and for the optimizer: only the block's graph joins them, and the
join is local to each device (each weight's share is already where the joined
weight needs it).

Pure: torch only, no torch_xla.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx

from xpipe.tensor.linear_operands import linear_operands
from xpipe.tensor.packed_projections import copy_of, packed_part

aten = torch.ops.aten


def join_column_parallel(block: torch.fx.GraphModule, dims: Mapping[str, int | None],
                         tensor: int) -> tuple[torch.fx.GraphModule, list[tuple[str, ...]]]:
    """A copy of ``block`` in which the linears that read the same input and are
    split over ``tensor`` devices by their output features run as one; and the
    weights of each group it joined, in order (none joined: ``block`` itself).

    Args:
        block: the block the clock loop runs, captured as operations (torch.export).
        dims: each block parameter's split dim over "tensor", None where whole.
        tensor: the "tensor" axis size.
    """
    groups = [group for group in _linears_by_input(block, dims, tensor).values() if len(group) > 1]
    if not groups:
        return block, []
    module = copy_of(block)
    by_name = {node.name: node for node in module.graph.nodes}
    for group in groups:
        _join(module.graph, [by_name[linear.name] for linear in group], tensor)
    module.graph.lint()
    module.recompile()
    return module, [tuple(linear_operands(linear).weight.target for linear in group) for group in groups]


def joined(weights: Sequence[torch.Tensor], tensor: int) -> torch.Tensor:
    """``weights`` (``[out_i, ...]`` each) joined along dim 0 tensor-major: device
    ``t``'s contiguous share holds its share of each of them, in order."""
    shares = [weight.reshape(tensor, weight.shape[0] // tensor, *weight.shape[1:]) for weight in weights]
    return torch.cat(shares, dim=1).reshape(-1, *weights[0].shape[1:])


def _linears_by_input(block: torch.fx.GraphModule, dims: Mapping[str, int | None],
                      tensor: int) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """The column-parallel linears of ``block`` that can join, by the node they read."""
    parameters = dict(block.named_parameters())
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in block.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        operands = linear_operands(node)
        x, weight, bias = operands.x, operands.weight, operands.bias
        if not _split_by_outputs(weight, parameters, dims, tensor, ndim=2):
            continue
        if bias is not None and not _split_by_outputs(bias, parameters, dims, tensor, ndim=1):
            continue
        found.setdefault(x, []).append(node)
    # Joined, every linear of a group adds a bias or none does; each group by its weights' input width and dtype.
    return {key: group for key, group in found.items() if _alike(group, parameters)}


def _split_by_outputs(node: object, parameters: Mapping[str, torch.Tensor], dims: Mapping[str, int | None],
                      tensor: int, ndim: int) -> bool:
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr" and node.target in parameters):
        return False
    value = parameters[node.target]
    return dims.get(node.target) == 0 and value.dim() == ndim and value.shape[0] % tensor == 0


def _alike(group: list[torch.fx.Node], parameters: Mapping[str, torch.Tensor]) -> bool:
    operands = [linear_operands(linear) for linear in group]
    weights = [parameters[each.weight.target] for each in operands]
    biased = {each.bias is not None for each in operands}
    return (len(biased) == 1 and len({w.shape[1] for w in weights}) == 1
            and len({w.dtype for w in weights}) == 1)


def _join(graph: torch.fx.Graph, group: list[torch.fx.Node], tensor: int) -> None:
    """Replace the linears of ``group`` (one input) with one on their joined weights."""
    first = group[0]
    operands = [linear_operands(linear) for linear in group]
    x = operands[0].x
    weights = [each.weight for each in operands]
    biases = [each.bias for each in operands if each.bias is not None]
    sizes = [graph.owning_module.get_parameter(weight.target).shape[0] for weight in weights]
    for attribute in (*weights, *biases):  # read before the joined linear (get_attr nodes read nothing)
        first.prepend(attribute)
    with graph.inserting_before(first):
        weight = graph.call_function(joined, (weights, tensor))
        bias = graph.call_function(joined, (biases, tensor)) if biases else None
        linear = graph.call_function(aten.linear.default, (x, weight, bias))
        start = 0
        for old, size in zip(group, sizes):
            old.replace_all_uses_with(graph.call_function(packed_part, (linear, tensor, start, size)))
            start += size
    for old in group:
        graph.erase_node(old)

