"""The linear operations of a block's captured graph, read in one place.

A linear layer reaches a graph as one of four ATen operations, depending on the
layer and on who captured it: ``linear(x, weight, bias)`` (``nn.Linear``, its
weight ``[out, in]``), ``addmm(bias, x, weight)`` (GPT-2's ``Conv1D``, its weight
``[in, out]``), ``mm(x, weight)`` and ``matmul(x, weight)``. Tensor parallelism's
rules read from the graph, the packed projections' split and the joined
column-parallel linears all ask the same question of a node: is it a linear,
and what are its input, weight and bias, and which dims of the weight hold its
output and its input features.

Pure: torch only, no torch_xla.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx
from torch import ops

aten = ops.aten


@dataclass(frozen=True)
class LinearOperands:
    """What a linear operation reads: its input, weight and bias (graph nodes, or None
    for a bias it does not add), and the weight's output- and input-feature dims."""

    x: Any
    weight: Any
    bias: Any
    out_dim: int
    in_dim: int


def linear_operands(node: torch.fx.Node) -> LinearOperands | None:
    """``node``'s operands if it is one of the linear operations, by position or by
    name; None for any other node."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    if packet is aten.linear:
        given = _by_name(node, ("input", "weight", "bias"))
        return LinearOperands(given.get("input"), given.get("weight"), given.get("bias"), 0, 1)
    if packet is aten.addmm:  # bias + x @ weight
        given = _by_name(node, ("self", "mat1", "mat2"))
        return LinearOperands(given.get("mat1"), given.get("mat2"), given.get("self"), 1, 0)
    if packet is aten.mm:
        given = _by_name(node, ("self", "mat2"))
        return LinearOperands(given.get("self"), given.get("mat2"), None, 1, 0)
    if packet is aten.matmul:
        given = _by_name(node, ("self", "other"))
        return LinearOperands(given.get("self"), given.get("other"), None, 1, 0)
    return None


def _by_name(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    """``node``'s arguments by their schema names, given by position or by name."""
    return dict(zip(names, node.args)) | {name: node.kwargs[name] for name in names if name in node.kwargs}
