"""Which side inputs have equal rows for every batch, proven from the graph.

A side input (a tensor computed before the stacked body and read by every block) that
has a row per batch row travels with its microbatch. One whose rows are equal for any
batch (Hugging Face's causal mask, built from the batch's size and expanded to it) can
be held as one row and broadcast in each block instead. Equal rows on a sample batch
prove nothing (rows equal in groups of four are equal on a two-row sample), so this
module proves it from the operations that build the side: it follows, node by node,
which dim of each tensor is the batch's and whether the values along it are constant.
What it cannot follow is not proven, and that side travels (the safe choice: it costs
bytes, never a wrong value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from xpipe.capture.trace import flat_inputs

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """What is known of a value along the batch.

    ``kind`` is one of:
        ``"none"``: a tensor with no dim that grows with the batch (or an int that is
            not the batch size);
        ``"equal"``: dim ``dim`` is the batch's and every slice along it is the same;
        ``"index"``: dim ``dim`` is the batch's and each slice holds its own position
            (``arange(batch)``, reshaped or broadcast);
        ``"batch"``: an int, the batch size itself;
        ``"unknown"``: anything else.
    """

    kind: str
    dim: int = 0

    def along(self) -> bool:
        return self.kind in ("equal", "index")


NONE, UNKNOWN, BATCH = Rows("none"), Rows("unknown"), Rows("batch")

# Ops that make a tensor of constant values, sized by their size argument (position 0
# of the arguments, or 1 for the new_* methods, which read their first argument's dtype).
_FILLED = {aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0, aten.full.default: 0,
           aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1,
           aten.new_full.default: 1}
_FILLED_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}
# Element by element, as the pointwise ones, though not tagged so.
_ELEMENTWISE = {aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.to.dtype_layout,
                aten.to.dtype, aten.to.device, aten._to_copy.default, aten.clone.default, aten.alias.default,
                aten.contiguous.default, aten.lift_fresh_copy.default}
# Ops along one dim (their argument 1), which keep whatever holds along the other dims.
_ALONG_ONE_DIM = {aten.cumsum.default, aten.cumprod.default, aten._softmax.default, aten.softmax.int,
                  aten._log_softmax.default, aten.log_softmax.int}


def rows_proven_equal(pre: torch.fx.GraphModule, sides: list[torch.fx.Node], sample_input: Any) -> list[bool]:
    """For each of ``sides``, outputs of ``pre`` with a row per batch row, whether all
    its rows are equal for any batch: built from the batch's size alone by operations
    that keep every row alike (never from an input's values, an index of the row, or
    anything random). One pass over ``pre`` answers for every side."""
    shapes = _shapes(pre, sample_input)
    known: dict[torch.fx.Node, Rows] = {}
    for node in pre.graph.nodes:
        if node.op != "output":
            known[node] = _rows_of(node, known, shapes)
    return [known.get(side) == Rows("equal", 0) for side in sides]


def _shapes(pre: torch.fx.GraphModule, sample_input: Any) -> dict[torch.fx.Node, tuple[int, ...]]:
    """Each tensor node's shape on the sample (fake tensors: nothing is computed)."""
    shapes: dict[torch.fx.Node, tuple[int, ...]] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                shapes[node] = tuple(value.shape)
            return value

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs(sample_input)]
        Recorder(pre).run(*inputs)
    return shapes


def _rows_of(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    if node.op == "get_attr":
        return NONE
    if node.op != "call_function":
        return UNKNOWN  # the model's inputs (values read), and calls the graph does not spell out
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        return UNKNOWN
    if target is aten.sym_size.int:
        return _size_rows(node, known)
    args = [known.get(a, UNKNOWN) if isinstance(a, torch.fx.Node) else _literal(a, known)
            for a in _flat(node.args, node.kwargs)]
    if all(a == NONE for a in args):
        return NONE  # computed from constants and sizes other than the batch's
    rule = _RULES.get(target)
    if rule is not None:
        return rule(node, known, shapes)
    if target in _ELEMENTWISE or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags):
        return _elementwise(node, known, shapes)
    if target in _ALONG_ONE_DIM:
        return _along_one_dim(node, known, shapes)
    return UNKNOWN


def _size_rows(node: torch.fx.Node, known: dict) -> Rows:
    """``sym_size(x, dim)``: the batch size where ``dim`` is ``x``'s batch dim (dim 0 of
    an input), a size of its own where ``x`` has no batch dim or is an input (whose
    other dims are fixed)."""
    source, dim = node.args
    if source.op == "placeholder":
        return BATCH if dim == 0 else NONE
    rows = known.get(source, UNKNOWN)
    if rows == NONE:
        return NONE
    return BATCH if rows.along() and rows.dim == dim else UNKNOWN


def _literal(value: Any, known: dict) -> Rows:
    """A non-node argument: a size list may hold the batch size's node."""
    if isinstance(value, (list, tuple)):
        parts = [known.get(v, UNKNOWN) if isinstance(v, torch.fx.Node) else _literal(v, known) for v in value]
        return NONE if all(p == NONE for p in parts) else UNKNOWN
    return NONE


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    return [*args, *kwargs.values()]


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _tensor_rows(value: Any, known: dict) -> Rows:
    return known.get(value, UNKNOWN) if isinstance(value, torch.fx.Node) else NONE


def _elementwise(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """Element by element over broadcast operands: equal rows if every operand with a
    batch dim has equal rows there, lined up, and the others are size 1 there."""
    if node not in shapes:
        return UNKNOWN
    rank = len(shapes[node])
    batch_dims = set()
    for arg in _flat(node.args, node.kwargs):
        rows = _tensor_rows(arg, known)
        if rows == BATCH:
            continue  # the batch size as a scalar: the same in every row
        if rows.kind == "unknown" or rows.kind == "index":
            return UNKNOWN
        if rows.kind == "equal":
            batch_dims.add(rows.dim + rank - len(shapes[arg]))
    if len(batch_dims) != 1:
        return UNKNOWN if batch_dims else NONE
    (dim,) = batch_dims
    for arg in _flat(node.args, node.kwargs):
        if _tensor_rows(arg, known) == NONE and isinstance(arg, torch.fx.Node) and arg in shapes:
            shape = shapes[arg]
            at = dim - (rank - len(shape))
            if at >= 0 and shape[at] != 1:
                return UNKNOWN
    return Rows("equal", dim)


def _along_one_dim(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    rows = _tensor_rows(node.args[0], known)
    if rows.kind != "equal":
        return UNKNOWN
    return rows if _dim(node.args[1], len(shapes[node.args[0]])) != rows.dim else UNKNOWN


def _diff(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """``diff(x, n, dim, prepend, append)``: along ``dim``, with ends that must line up."""
    x, rest = node.args[0], list(node.args[1:])
    dim = rest[1] if len(rest) > 1 else node.kwargs.get("dim", -1)
    rows = _tensor_rows(x, known)
    if rows.kind != "equal" or _dim(dim, len(shapes[x])) == rows.dim:
        return UNKNOWN
    ends = [*rest[2:], node.kwargs.get("prepend"), node.kwargs.get("append")]
    for end in ends:
        end_rows = _tensor_rows(end, known)
        if end is not None and end_rows != rows and not (end_rows == NONE and shapes.get(end, (1,))[rows.dim] == 1):
            return UNKNOWN
    return rows


def _arange(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """``arange(batch)``: each position holds its own index."""
    ends = [_tensor_rows(a, known) for a in node.args]
    if node.target is aten.arange.default and ends == [BATCH]:
        return Rows("index", 0)
    if node.target is aten.arange.start and ends == [NONE, BATCH] and node.args[0] == 0:
        return Rows("index", 0)
    return UNKNOWN


def _sizes_rows(sizes: Any, known: dict) -> tuple[list[int], bool]:
    """The positions of ``sizes`` that are the batch size, and whether every other is
    a size of its own (a literal, or an int not made from the batch size)."""
    batch, other = [], True
    for position, size in enumerate(sizes):
        rows = _tensor_rows(size, known)
        if rows == BATCH:
            batch.append(position)
        elif rows != NONE:
            other = False
    return batch, other


def _filled(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """A tensor of one value everywhere, sized by a list that holds the batch size once."""
    batch, other = _sizes_rows(node.args[_FILLED[node.target]], known)
    if node.target is aten.full.default or node.target is aten.new_full.default:
        fill = node.args[_FILLED[node.target] + 1]
        other = other and _tensor_rows(fill, known) in (NONE, BATCH)
    return Rows("equal", batch[0]) if len(batch) == 1 and other else UNKNOWN


def _filled_like(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    rows = _tensor_rows(node.args[0], known)
    return Rows("equal", rows.dim) if rows.along() else UNKNOWN


def _expand(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """``expand(x, sizes)``: a size-1 dim grown to the batch has equal rows; a batch
    dim already there keeps what it had."""
    x, sizes = node.args[0], node.args[1]
    rows = _tensor_rows(x, known)
    batch, other = _sizes_rows(sizes, known)
    if not other or len(batch) != 1 or x not in shapes:
        return UNKNOWN
    offset = len(sizes) - len(shapes[x])
    (position,) = batch
    if rows == NONE:
        at = position - offset
        return Rows("equal", position) if at < 0 or shapes[x][at] == 1 else UNKNOWN
    if rows.along() and rows.dim + offset == position:
        return Rows(rows.kind, position)
    return UNKNOWN


def _unsqueeze(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    rows = _tensor_rows(node.args[0], known)
    if not rows.along():
        return UNKNOWN
    dim = _dim(node.args[1], len(shapes[node]))
    return Rows(rows.kind, rows.dim + 1 if dim <= rows.dim else rows.dim)


def _slice(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """A slice along another dim keeps the rows; along the batch's, only the whole."""
    rows = _tensor_rows(node.args[0], known)
    if not rows.along():
        return UNKNOWN
    dim, start, end, step = [*node.args[1:], *[0, None, None, 1][len(node.args) - 1:]]
    if _dim(dim, len(shapes[node.args[0]])) != rows.dim:
        return rows
    whole = start in (0, None) and (end is None or (isinstance(end, int) and end >= 2**62)) and step == 1
    return rows if whole else UNKNOWN


def _index(node: torch.fx.Node, known: dict, shapes: dict) -> Rows:
    """``x[i0, i1, ...]`` with index tensors: equal rows where every index that holds
    its row's own position picks along ``x``'s dim of equal rows, and every other
    index is equal along the batch or size 1 there."""
    x, indices = node.args
    if any(index is None for index in indices) or node not in shapes:
        return UNKNOWN
    x_rows = _tensor_rows(x, known)
    if not (x_rows == NONE or (x_rows.kind == "equal" and x_rows.dim < len(indices))):
        return UNKNOWN
    picked = torch.broadcast_shapes(*[shapes[index] for index in indices])
    batch_dims = set()
    for position, index in enumerate(indices):
        rows = _tensor_rows(index, known)
        if rows.kind in ("unknown", "batch"):
            return UNKNOWN
        if rows.kind == "index" and not (x_rows.kind == "equal" and x_rows.dim == position):
            return UNKNOWN  # picks another element in each row
        if rows.along():
            batch_dims.add(rows.dim + len(picked) - len(shapes[index]))
    if len(batch_dims) > 1:
        return UNKNOWN
    if not batch_dims:
        return NONE  # the batch dim of x, if any, picked down to the index's shape
    (dim,) = batch_dims
    for index in indices:
        if _tensor_rows(index, known) == NONE:
            at = dim - (len(picked) - len(shapes[index]))
            if at >= 0 and shapes[index][at] != 1:
                return UNKNOWN
    return Rows("equal", dim)


_RULES = {
    aten.arange.default: _arange, aten.arange.start: _arange,
    aten.expand.default: _expand,
    aten.unsqueeze.default: _unsqueeze,
    aten.slice.Tensor: _slice,
    aten.index.Tensor: _index,
    aten.diff.default: _diff,
    **dict.fromkeys(_FILLED, _filled),
    **dict.fromkeys(_FILLED_LIKE, _filled_like),
}
