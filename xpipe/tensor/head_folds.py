"""Attention that folds its heads into the batch dim, rewritten to keep them a dim of their own.

``nn.MultiheadAttention`` takes q, k and v ``[L, b, E]`` to ``[L, b * heads, d]``,
then ``[b * heads, L, d]``, then ``[b, heads, L, d]`` for attention. With the heads
split over "tensor" and more than one row per microbatch, XLA's partitioner cannot
keep that split through the fold (the rows lie between the heads and the
features) and gathers q, k and v onto every device of a tensor group. The same
values come from one reshape of the features into ``[heads, d]`` and one permute,
which XLA keeps split. :func:`keep_heads_apart` finds such folds in a block's graph
and makes them so, where the two are checked to compute the same; the reading of
the tensor splits (:mod:`xpipe.tensor.inference`) and the block the clock loop runs
(:mod:`xpipe.tensor.packed_projections`) both see the rewritten form.

Pure: torch only, no torch_xla.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.fx

from xpipe.capture.stacking import reshaped_view

aten = torch.ops.aten

RESHAPES = {reshaped_view, aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_TRANSPOSES = {aten.transpose.int, aten.permute.default}

Shape = Callable[[torch.fx.Node], "tuple[int, ...] | None"]


def split_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[..., n] -> [..., n / size, size]``: the last dim's heads, each of ``size`` features."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def keep_heads_apart(graph: torch.fx.Graph, shape: Shape, rows: int) -> None:
    """Rewrite every fold of ``graph`` (see the module's docstring).

    Args:
        graph: a block's graph.
        shape: a node's shape on the sample, or None where it is not known.
        rows: the sample's rows, the one size that differs when the block runs.
    """
    for node in list(graph.nodes):
        _unfold(node, shape, rows)


def _unfold(start: torch.fx.Node, shape: Shape, rows: int) -> None:
    """Where ``start``'s value goes through reshapes and transposes that fold its last
    dim's heads into another dim and back out (a reshape after a transpose), make the
    chain's result as one :func:`split_last` and one permute, if they compute the same
    on the sample's shapes. Only the rows change from one run to the next, so the
    check holds for every run where no other dim is as long as the rows."""
    chain, node = [], start
    while len(node.users) == 1 and next(iter(node.users)).target in RESHAPES | _TRANSPOSES:
        node = next(iter(node.users))
        chain.append(node)
    kinds = [link.target in _TRANSPOSES for link in chain]
    if True not in kinds or False not in kinds[kinds.index(True):]:
        return
    shapes = [shape(link) for link in (start, *chain)]
    if None in shapes:
        return
    before, after = shapes[0], shapes[-1]
    size = after[-1]
    if len(after) != len(before) + 1 or before[-1] % size:
        return
    split = (*before[:-1], before[-1] // size, size)
    if split.count(rows) > 1 or 1 in split:
        return
    order = _order(before, split, chain, shapes[1:])
    if order is None:
        return
    graph = start.graph
    with graph.inserting_after(chain[-1]):
        heads = graph.call_function(split_last, (start, size))
    with graph.inserting_after(heads):
        unfolded = graph.call_function(aten.permute.default, (heads, list(order)))
    if "val" in start.meta:  # a traced graph's fake values, which the reading of splits reads shapes from
        heads.meta["val"] = split_last(start.meta["val"], size)
        unfolded.meta["val"] = heads.meta["val"].permute(order)
    chain[-1].replace_all_uses_with(unfolded)
    for link in reversed(chain):
        graph.erase_node(link)


def _order(before: tuple[int, ...], split: tuple[int, ...], chain: list[torch.fx.Node],
           shapes: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The permute of ``split`` that computes what ``chain`` computes from ``before``
    (each link's shape in ``shapes``), if one does."""
    values = torch.arange(torch.Size(before).numel()).reshape(before)
    folded = values
    for link, after in zip(chain, shapes):
        if link.target in RESHAPES:
            folded = folded.reshape(after)
        elif link.target is aten.transpose.int:
            folded = folded.transpose(*link.args[1:3])
        else:
            folded = folded.permute(*link.args[1])
    return next((order for order in itertools.permutations(range(len(split)))
                 if torch.equal(values.reshape(split).permute(order), folded)), None)
