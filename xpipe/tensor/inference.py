"""How "tensor" splits the weights of a block no rule covers, read from the block's graph.

Megatron's pattern, found in the block's aten graph (traced once, on fake tensors,
nothing computed): a linear that reads the block's hidden stream *opens* a region
and is split on its output features (column-parallel: q/k/v, gate/up, fc1); every
value computed from an opening linear's output belongs to its region (heads,
scores, the activation); a linear that reads a region value *closes* it and is
split on its input features (row-parallel: o, down, fc2), its output back on the
stream after one reduction over "tensor". Biases follow their linear's output
features; 1-D weights applied to the stream (norms) stay whole.

An opening linear whose output features are taken apart along their outermost
factor (q, k and v packed one after the other, as in GPT-2's ``c_attn``) is
*packed*: it is split part by part (:class:`xpipe.tensor.rules.Packed`, built by
:mod:`xpipe.tensor.packed_projections`), and each part reads on as split. Packed per
head (GPT-NeoX's ``query_key_value``: the features are reshaped to heads first,
then each head's are taken apart) is split as any opening linear, whole heads per
device. To tell the two apart, the reading follows, through every reshape and
transpose, the dim that holds the outermost factor of the opening features (the
one a contiguous split divides). Heads folded into the batch dim for attention
(``nn.MultiheadAttention``) are read unfolded (:mod:`xpipe.tensor.head_folds`), as the
clock loop runs them.

Features reduced across that dim (a router's softmax over experts), merged into a
dim before it, or joined with others split along another dim stay whole too, and
so does the linear that made them. What the reading cannot follow it refuses
rather than guesses: a weight used other than by a linear (an expert's stacked
matrices), an operation it does not know on split features, a block torch cannot
trace. A wrong split would still compute the right numbers (XLA's partitioner
inserts what any split needs), but with collectives Megatron does not pay; a
refusal asks the user for ``tensor_rules=`` instead.

Pure: torch only, no torch_xla.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from xpipe.tensor.head_folds import keep_heads_apart, split_last
from xpipe.tensor.linear_operands import linear_operands
from xpipe.tensor.rules import Packed


class CannotInfer(ValueError):
    """The block's graph holds something the inference cannot read; the message says what."""


@dataclass(frozen=True)
class Region:
    """A value computed from opening linears' outputs.

    Attributes:
        openers: the opening linear nodes it is computed from.
        dim: where the outermost factor of their output features lies in this
            value (what a split of those features divides), or None where they
            stay whole (packed) or the value no longer has them.
    """

    openers: frozenset[torch.fx.Node]
    dim: int | None


State = Region | None  # None: on the stream (whole on every device of a tensor group)

_ELEMENTWISE = {
    "abs", "add", "addcmul", "alias", "clamp", "clone", "contiguous", "detach", "div", "dropout", "eq", "erf",
    "exp", "expm1", "fill", "full_like", "ge", "gelu", "gt", "le", "lerp", "log", "log1p", "logical_not", "lt",
    "masked_fill", "maximum", "minimum", "mul", "ne", "neg", "ones_like", "pow", "reciprocal", "relu", "rsqrt",
    "rsub", "sigmoid", "silu", "sin", "cos", "sqrt", "square", "sub", "tanh", "to", "_to_copy", "type_as",
    "where", "zeros_like", "lift_fresh_copy", "native_dropout", "gelu_", "relu_", "silu_", "softplus", "mish",
    "hardtanh", "leaky_relu", "elu", "triu", "tril",
}
_RESHAPES = {"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze", "view_as",
             "reshape_as", "expand", "expand_as"}
# Reductions: where each takes its dims, and the dims when none is given (None: all).
_REDUCTIONS = {**dict.fromkeys(("mean", "sum", "amax", "amin", "var", "std", "var_mean", "argmax", "argmin",
                                "logsumexp", "prod", "any", "all", "max", "min"), (1, None)),
               **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "sort"), (1, -1)),
               "topk": (2, -1), "linalg_vector_norm": (2, None), "norm": (2, None)}
_TAKE_APART = {"split": 2, "split_with_sizes": 2, "chunk": 2, "unbind": 1, "tensor_split": 2}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}
_LAYER_NORMS = {"layer_norm", "native_layer_norm", "rms_norm"}
_SHAPED_LIKE = {"expand_as", "view_as", "reshape_as"}  # read their second tensor's shape, not its values
_IGNORED = {"_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "_assert_scalar"}


def infer_tensor_dims(block: nn.Module, inputs: Sequence[Any]) -> dict[str, int | Packed | None]:
    """Each parameter of ``block`` (by its name in ``block.named_parameters()``) with
    the dim "tensor" splits, :class:`xpipe.tensor.rules.Packed` where it packs
    projections one after the other, or None where every device of a tensor group
    holds it whole.

    Args:
        block: one block of the model's repeated body.
        inputs: what the block is called with: tensors, real or fake (only their
            shapes and dtypes are read).

    Raises:
        CannotInfer: naming what in the block's graph the inference cannot read.
    """
    graph, params = _aten_graph(block, inputs)
    keep_heads_apart(graph, _shape, next(x for x in inputs if isinstance(x, torch.Tensor)).shape[0])
    whole: set[torch.fx.Node] = set()
    while True:
        reading = _Reading(params, whole)
        for node in graph.nodes:
            reading.read(node)
        if reading.kept_whole <= whole:
            return reading.dims()
        whole |= reading.kept_whole


def _aten_graph(block: nn.Module, inputs: Sequence[Any]) -> tuple[torch.fx.Graph, dict[torch.fx.Node, str]]:
    """The block traced to aten operations above autograd (``aten.linear`` kept whole),
    with the placeholder of each parameter and its name."""
    params = dict(block.named_parameters())

    def run(weights: dict[str, torch.Tensor], *args: Any) -> Any:
        return functional_call(block, weights, args)

    mode = detect_fake_mode(inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = [mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                for x in inputs]
        try:
            traced = make_fx(run, pre_dispatch=True)(params, *fake)
        except Exception as error:  # the user's block, traced by torch: any of its errors means "cannot read"
            raise CannotInfer(f"the block cannot be traced to aten operations ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return traced.graph, dict(zip(placeholders, params))


def _op(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if target is split_last:
        return "reshape"
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(target)


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _reshaped_dim(before: tuple[int, ...], after: tuple[int, ...], dim: int) -> int | None:
    """Where the outermost factor of ``before[dim]`` lies after a reshape to ``after``:
    the first dim of size above 1 that starts at the same flat offset; None if
    it is merged into a dim before it."""
    prefix = math.prod(before[:dim])
    for index, size in enumerate(after):
        if math.prod(after[:index]) == prefix and size > 1:
            return index if size % before[dim] == 0 or before[dim] % size == 0 else None
    return None


class _Regions:
    """What a reading of a block's graph keeps: each value's region, each weight's
    uses, the opening linears kept whole or packed; and each weight's split from them."""

    def __init__(self, params: dict[torch.fx.Node, str], whole: set[torch.fx.Node]) -> None:
        self.params, self.whole = params, whole
        self.state: dict[torch.fx.Node, Any] = {}
        self.uses: dict[str, set[int | None]] = {}
        self.kept_whole: set[torch.fx.Node] = set()  # opening linears found to need their features whole
        self.packed: set[torch.fx.Node] = set()  # opening linears whose features are taken apart into parts
        self.opened: dict[torch.fx.Node, tuple[Any, Any, int]] = {}  # opening linear -> weight, bias, out dim
        self.transposed: dict[torch.fx.Node, torch.fx.Node] = {}  # ``weight.T`` and the weight

    def dims(self) -> dict[str, int | Packed | None]:
        """Each weight's split (its uses agree: each weight is used once in a block)."""
        dims: dict[str, int | Packed | None] = {}
        for name in self.params.values():
            uses = self.uses.get(name, {None})
            if len(uses) > 1:
                raise CannotInfer(f"the weight {name} is used both split and whole")
            dims[name] = next(iter(uses))
        for opener in self.packed - self.whole:
            weight, bias, out_dim = self.opened[opener]
            dims[self.params[weight]] = Packed(out_dim)
            if bias in self.params:
                dims[self.params[bias]] = Packed(0)
        return dims

    def _use(self, node: Any, dim: int | None) -> None:
        if node in self.params:
            self.uses.setdefault(self.params[node], set()).add(dim)

    def _region(self, node: Any) -> Region | None:
        return self.state.get(node) if isinstance(node, torch.fx.Node) else None

    def _keep_whole(self, region: Region) -> Region:
        """Features that cannot stay split (taken apart, reduced, merged or joined along
        their split dim): the linears that made them stay whole."""
        self.kept_whole |= region.openers
        return Region(region.openers, None)

    def _unknown(self, node: torch.fx.Node) -> CannotInfer:
        weights = sorted(self.params[self._opener_weight(o)] for r in map(self._region, node.all_input_nodes)
                         if r is not None for o in r.openers)
        return CannotInfer(f"{node.name} ({node.target}) reads the split output features of {', '.join(weights)}, "
                           "and the inference does not know how it moves them")

    def _opener_weight(self, opener: torch.fx.Node) -> torch.fx.Node:
        linear = _linear(opener, self.params, self.transposed)
        return linear[1] if linear is not None else opener.args[0]

    def _joined(self, node: torch.fx.Node, values: Sequence[Any]) -> Region:
        """The region of a value computed elementwise from ``values`` (broadcast to its shape)."""
        rank = len(_shape(node))
        regions = [(value, r) for value, r in ((v, self._region(v)) for v in values) if r is not None]
        joined = Region(frozenset().union(*(r.openers for _, r in regions)), None)
        dims = {r.dim + rank - len(_shape(value)) for value, r in regions if r.dim is not None}
        return Region(joined.openers, dims.pop()) if len(dims) == 1 else self._keep_whole(joined)

class _Reading(_Regions):
    """One pass over a block's graph: how each operation moves the split features."""

    def read(self, node: torch.fx.Node) -> None:
        if node.op == "output":
            for value in node.all_input_nodes:  # the block's output is whole on every device
                if self._region(value) is not None and self._region(value).dim is not None:
                    self._keep_whole(self._region(value))
        elif node.op == "call_function" and _op(node) not in _IGNORED:
            self.state[node] = self._call(node)

    def _call(self, node: torch.fx.Node) -> Any:
        op, inputs = _op(node), node.all_input_nodes
        if op in _SHAPED_LIKE:  # the second tensor gives a shape only
            inputs = inputs[:1]
        if op in ("t", "numpy_T", "transpose", "permute") and inputs[0] in self.params and len(_shape(node)) == 2:
            self.transposed[node] = inputs[0]
            return None
        linear = _linear(node, self.params, self.transposed)
        if linear is not None:
            return self._linear(node, *linear)
        if op == "embedding" and node.args[0] in self.params:
            return self._open(node, node.args[0], None, 1)
        for value in inputs:
            if value in self.transposed or (value in self.params and len(_shape(value)) > 1):
                weight = self.params[self.transposed.get(value, value)]
                raise CannotInfer(f"the weight {weight} is used by {node.target}, not by a linear")
        if op == "getitem":
            parts = self.state.get(node.args[0])
            return parts[node.args[1]] if isinstance(parts, list) else parts
        regions = [r for r in map(self._region, inputs) if r is not None]
        if not regions or all(r.dim is None for r in regions):
            for value in inputs:
                self._use(value, None)
            joined = Region(frozenset().union(*(r.openers for r in regions)), None) if regions else None
            return [joined] * len(node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else joined
        return self._through(node, op)

    def _linear(self, node: torch.fx.Node, x: torch.fx.Node, weight: torch.fx.Node, bias: Any,
                out_dim: int, in_dim: int) -> State:
        region = self._region(x)
        if region is None:
            return self._open(node, weight, bias, out_dim)
        self._use(bias, None)
        if region.dim is not None and region.dim != len(_shape(x)) - 1:  # per head, say: the split stays
            self._use(weight, None)
            return region
        self._use(weight, in_dim)
        return None  # back on the stream, after one reduction over "tensor"

    def _open(self, node: torch.fx.Node, weight: torch.fx.Node, bias: Any, out_dim: int) -> Region:
        self.opened[node] = (weight, bias, out_dim)
        whole = node in self.whole
        self._use(weight, None if whole else out_dim)
        self._use(bias, None if whole else 0)
        return Region(frozenset({node}), None if whole else len(_shape(node)) - 1)

    def _through(self, node: torch.fx.Node, op: str) -> Any:
        """The state of an operation that reads features split along a dim."""
        if op in _ELEMENTWISE:
            return self._elementwise(node)
        if op == "cat":
            return self._cat(node)
        if op == "stack":
            return self._stack(node)
        if op in ("matmul", "bmm", "mm"):
            return self._matmul(node)
        if op in _ATTENTION:
            return self._attention(node)
        source = self._region(node.args[0]) if node.args else None
        if source is None or source.dim is None:  # the split features come in another way
            raise self._unknown(node)
        if op in _RESHAPES:
            return self._reshape(node)
        if op in ("transpose", "t", "numpy_T", "permute", "swapaxes"):
            return self._permute(node, op)
        if op in ("slice", "select", "narrow"):
            return self._take(node, op)
        if op in _TAKE_APART:
            return self._take_apart(node, op)
        if op in _REDUCTIONS:
            return self._reduce(node)
        if op in _LAYER_NORMS:
            return self._layer_norm(node)
        raise self._unknown(node)

    def _elementwise(self, node: torch.fx.Node) -> Any:
        values = [a for a in node.all_input_nodes if _shape(a) is not None]
        joined = self._joined(node, values)
        rank = len(_shape(node))
        for value in values:
            if value in self.params:
                aligned = None if joined.dim is None else joined.dim - (rank - len(_shape(value)))
                split = aligned is not None and aligned >= 0 and _shape(value)[aligned] > 1
                self._use(value, aligned if split else None)
        return [joined, None] if _op(node) == "native_dropout" else joined

    def _reshape(self, node: torch.fx.Node) -> Region:
        source = node.args[0]
        region, before, after = self._region(source), _shape(source), _shape(node)
        if _op(node) in ("expand", "expand_as"):
            return Region(region.openers, region.dim + len(after) - len(before))
        dim = _reshaped_dim(before, after, region.dim)
        return self._keep_whole(region) if dim is None else Region(region.openers, dim)

    def _permute(self, node: torch.fx.Node, op: str) -> Region:
        region = self._region(node.args[0])
        rank = len(_shape(node))
        if op in ("t", "numpy_T"):
            order = list(range(rank))[::-1]
        elif op == "permute":
            order = [d % rank for d in node.args[1]]
        else:
            a, b = (d % rank for d in node.args[1:3])
            order = list(range(rank))
            order[a], order[b] = b, a
        return Region(region.openers, order.index(region.dim))

    def _take(self, node: torch.fx.Node, op: str) -> Region:
        source = node.args[0]
        region = self._region(source)
        dim = node.args[1] % len(_shape(source)) if len(node.args) > 1 else 0
        if dim != region.dim:
            return Region(region.openers, region.dim - (op == "select" and dim < region.dim))
        if op != "select" and _shape(node) == _shape(source):
            return region  # the whole dim: x[:, :]
        return self._part(region, node, _shape(source)[dim], op == "select")

    def _take_apart(self, node: torch.fx.Node, op: str) -> list[Region]:
        source = node.args[0]
        region = self._region(source)
        position = _TAKE_APART[op]
        dim = (node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)) % len(_shape(source))
        pieces = len(node.meta["val"])
        if dim == region.dim:
            return [self._part(region, node, pieces, op == "unbind")] * pieces
        return [Region(region.openers, region.dim - (op == "unbind" and dim < region.dim))] * pieces

    def _part(self, region: Region, node: torch.fx.Node, parts: int, selected: bool) -> Region:
        """One of the parts ``node`` takes the features of ``region`` apart into, along
        their outermost factor: the linears that made them are packed, and the part
        is split as they were. A part picked from a dim of parts (a select, an
        unbind) holds its features in its last dim, which must then be their
        ``1 / parts``; otherwise they stay whole."""
        if selected:
            features = {_shape(opener)[-1] for opener in region.openers}
            value = node.meta.get("val")
            value = value[0] if isinstance(value, (tuple, list)) else value
            part = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            if part is None or features != {part[-1] * parts}:
                return self._keep_whole(region)
            region = Region(region.openers, len(part) - 1)
        self.packed |= region.openers
        return region

    def _reduce(self, node: torch.fx.Node) -> Any:
        source = node.args[0]
        region = self._region(source)
        rank = len(_shape(source))
        position, default = _REDUCTIONS[_op(node)]
        dims = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
        if isinstance(dims, torch.fx.Node):  # max(a, b): elementwise
            return self._elementwise(node)
        dims = list(range(rank)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
        dims = {d % rank for d in dims}
        result = node.meta["val"]
        pieces = len(result) if isinstance(result, (tuple, list)) else 0
        if region.dim in dims:
            reduced = self._keep_whole(region)
        else:
            out_rank = len((result[0] if pieces else result).shape)
            reduced = Region(region.openers, region.dim - (sum(d < region.dim for d in dims) if out_rank < rank else 0))
        return [reduced] * pieces if pieces else reduced

    def _layer_norm(self, node: torch.fx.Node) -> Any:
        source = node.args[0]
        region = self._region(source)
        if region.dim >= len(_shape(source)) - len(node.args[1]):
            region = self._keep_whole(region)
        for weight in node.all_input_nodes[1:]:
            self._use(weight, None)
        return [region] * 3 if _op(node) == "native_layer_norm" else region

    def _cat(self, node: torch.fx.Node) -> Region:
        joined = self._joined(node, list(node.args[0]))
        dim = node.args[1] if len(node.args) > 1 else 0
        if joined.dim is not None and dim % len(_shape(node)) == joined.dim:
            return self._keep_whole(joined)
        return joined

    def _stack(self, node: torch.fx.Node) -> Region:
        new = (node.args[1] if len(node.args) > 1 else 0) % len(_shape(node))  # the dim stacking makes
        regions = [r for r in map(self._region, node.args[0]) if r is not None]
        joined = Region(frozenset().union(*(r.openers for r in regions)), None)
        dims = {r.dim + (r.dim >= new) for r in regions if r.dim is not None}
        return Region(joined.openers, dims.pop()) if len(dims) == 1 else self._keep_whole(joined)

    def _matmul(self, node: torch.fx.Node) -> Region:
        rank = len(_shape(node))
        openers: set[torch.fx.Node] = set()
        dims = set()
        for value, contracted, kept in ((node.args[0], -1, -2), (node.args[1], -2, -1)):
            region = self._region(value)
            if region is None:
                continue
            openers |= region.openers
            own = len(_shape(value))
            if region.dim is not None:
                dims.add(None if region.dim == own + contracted else
                         rank + kept if region.dim == own + kept else region.dim + rank - own)
        joined = Region(frozenset(openers), None)
        return Region(joined.openers, dims.pop()) if len(dims) == 1 and None not in dims else self._keep_whole(joined)

    def _attention(self, node: torch.fx.Node) -> Any:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        joined = self._joined(node, [*node.args[:3], *([mask] if mask is not None else [])])
        if joined.dim is not None and joined.dim >= len(_shape(node.args[0])) - 2:  # split other than by a batch
            joined = self._keep_whole(joined)  # dim (the heads, wherever they are): by positions or features
        result = node.meta["val"]
        return [joined] * len(result) if isinstance(result, (tuple, list)) else joined


def _linear(node: torch.fx.Node, params: dict[torch.fx.Node, str],
            transposed: dict[torch.fx.Node, torch.fx.Node]) -> tuple | None:
    """``(input, weight, bias, output features dim, input features dim)`` of a linear
    whose weight is a 2-D parameter of the block (or its transpose: ``x @ w.T``), or None."""
    operands = linear_operands(node)
    if operands is None:
        return None
    x, weight, bias, out_dim, in_dim = operands.x, operands.weight, operands.bias, operands.out_dim, operands.in_dim
    if _op(node) in ("mm", "matmul") and weight in transposed:  # x @ w.T
        weight, out_dim, in_dim = transposed[weight], 0, 1
    if weight not in params or len(_shape(weight)) != 2:
        return None
    return x, weight, bias, out_dim, in_dim
