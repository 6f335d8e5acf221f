"""Cut a traced model into what runs before, inside and after the stacked body.

The SPMD executor runs the partition's run of identical blocks (``Partition.repeated``)
as one stacked program over the "stage" axis, and everything before it (``pre``,
e.g. the embedding) and after it (``post``, e.g. the head) data-parallel. This
module does the cutting on the torch.fx trace; it touches no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from xpipe.capture.batch_rows import check_rows_stay_apart, check_sides_hold_whole_rows
from xpipe.capture.equal_rows import rows_proven_equal
from xpipe.capture.trace import Captured, ExportedForm, extract_module, flat_inputs, is_batch_size, trace_layers
from xpipe.partition import Partition

PRE, POST = "pre", "post"


@dataclass
class StackedModel:
    """A model cut for the SPMD executor.

    Attributes:
        pre: ``(*inputs) -> (stream, *sides, *skips)``: the layers before the body.
        blocks: one ``(stream, *sides) -> stream`` module per block of the body, in order.
        post: ``(stream, *skips) -> output``: the layers after the body.
        side_rows: for each side input (a tensor computed before the body and read
            by every block: an attention mask, rotary cos/sin), whether it has a
            row per batch row (so it travels with its microbatch) or is the same
            for every row (so every stage holds it whole). A side built for every
            row from shapes alone (Hugging Face's causal mask, where no padding
            mask is given) is the latter: ``pre`` returns its first row, and each
            block broadcasts that row to its microbatch's rows.
        exported: for a model captured by torch.export, how ``post``'s flat outputs
            fold back into what the model returns, and the mode it was captured in.
        skip_rows: for each skip (a tensor computed before the body and read only
            after it: labels, a tied embedding's weight), whether it has a row per batch
            row; None where no sample input told (the layers after the body then run on
            the whole batch, as GPipe runs them, and 1F1B refuses the model).
    """

    pre: torch.fx.GraphModule
    blocks: list[torch.fx.GraphModule]
    post: torch.fx.GraphModule
    side_rows: tuple[bool, ...] = ()
    exported: ExportedForm | None = None
    skip_rows: tuple[bool, ...] | None = ()


def cut_for_stacking(module: nn.Module, partition: Partition, sample_input: Any = None,
                     captured: Captured | None = None) -> StackedModel:
    """Cut ``module`` around ``partition.repeated`` (from ``captured``, its capture on
    ``sample_input``, when given; the cut works on a copy of it).

    Raises:
        ValueError: if there is no repeated body, or its blocks pass more than one
            tensor from block to block (such models need the ``devices`` executor),
            or they read tensors computed before the body and no ``sample_input``
            tells which of those have a row per batch row.
    """
    repeated = partition.repeated
    if repeated is None:
        raise ValueError("module: has no run of identical blocks to stack over the 'stage' axis; "
                         "the spmd executor needs one (e.g. the N blocks of a transformer)")
    traced, layer_of = captured.copy() if captured is not None else trace_layers(module, sample_input)
    position = {name: index for index, name in enumerate(partition.graph.graph["layers"])}

    def segment(node: torch.fx.Node) -> str | int:
        if node.op == "placeholder" or (is_batch_size(node) and not node.meta.get(BLOCK_SIZE)):
            return PRE  # sizes from the model's input: computed before the body, then read by every block
        if node.op == "output":
            return POST
        index = position[layer_of[node]]
        if index < repeated.start:
            return PRE
        if index >= repeated.start + repeated.period * repeated.count:
            return POST
        return (index - repeated.start) // repeated.period

    def cut() -> tuple[list[torch.fx.Node], dict[torch.fx.Node, str | int]]:
        nodes = [n for n in traced.graph.nodes if n.op in ("placeholder", "output") or n in layer_of]  # no unused
        return nodes, {node: segment(node) for node in nodes}

    nodes, segment_of = cut()
    streams, sides = _block_interface(nodes, segment_of, repeated.count)
    if _read_batch_size_from_streams(traced, layer_of, streams, sides, segment_of):
        nodes, segment_of = cut()
        streams, sides = _block_interface(nodes, segment_of, repeated.count)
    _check_sides_are_tensors(sides)
    skips = [n for n in nodes if segment_of[n] == PRE and any(segment_of[user] == POST for user in n.users)]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    pre_nodes = [n for n in nodes if segment_of[n] == PRE and n.op != "placeholder"]
    pre = extract_module(traced, placeholders, pre_nodes, [streams[0], *sides, *skips], "Pre")
    blocks = [
        extract_module(traced, [streams[j], *sides], [n for n in nodes if segment_of[n] == j], [streams[j + 1]],
                       "Block")
        for j in range(repeated.count)
    ]
    post_nodes = [n for n in nodes if segment_of[n] == POST and n.op != "output"]
    post = extract_module(traced, [streams[-1], *skips], post_nodes, None, "Post", output=nodes[-1])
    _check_alike(blocks, module)
    for block in blocks:
        vmappable(block)
    side_rows = _side_rows(pre, [side.name for side in sides], sample_input) if sides else ()
    side_rows = _hold_equal_rows_once(pre, blocks, side_rows, sample_input)
    if sample_input is not None:
        _check_rows_stay_apart(pre, blocks[0], side_rows, sample_input)
    skip_rows = _skip_rows(pre, 1 + len(sides), sample_input) if skips else ()
    return StackedModel(pre, blocks, post, side_rows, ExportedForm.of(traced, module), skip_rows)


def _block_interface(nodes: list[torch.fx.Node], segment_of: dict,
                     count: int) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The value entering each block, then the value leaving the last (``count + 1``
    nodes), and the side inputs: values computed before the body that every block reads."""
    inputs_of = []
    outputs_of = []
    for block in range(count):
        members = [n for n in nodes if segment_of[n] == block]
        inputs_of.append(list(dict.fromkeys(u for n in members for u in n.all_input_nodes
                                            if segment_of[u] != block)))
        outputs_of.append([n for n in members if any(segment_of[user] != block for user in n.users)])
    sides = [u for u in inputs_of[0] if segment_of[u] == PRE and all(u in later for later in inputs_of[1:])]
    sides = sides if count > 1 else []
    uneven = list(dict.fromkeys(u.name for inputs in inputs_of[1:] for u in inputs
                                if segment_of[u] == PRE and u not in sides))  # block 0's stream is PRE's too
    if uneven:
        raise ValueError(
            f"module: blocks of the repeated body read {uneven}, computed before the body, which not every "
            "block reads: the spmd executor runs every block alike, with the same inputs (layers that "
            "alternate between inputs with a period, as Gemma 2's masks do, are stacked a period at a time; "
            "these do not repeat so); use executor='devices'")
    streams: list[torch.fx.Node] = []
    for block, (inputs, outputs) in enumerate(zip(inputs_of, outputs_of)):
        entering = [u for u in inputs if u not in sides]
        if len(entering) != 1 or len(outputs) != 1:
            raise ValueError(
                f"module: block {block} of the repeated body takes {sorted(u.name for u in entering)} from the "
                f"block before it (besides what every block reads: {[u.name for u in sides]}) and gives "
                f"{[n.name for n in outputs]}; the spmd executor stacks blocks that pass one tensor from block "
                "to block. Pass only the hidden state between blocks, or use another executor"
            )
        if streams and entering[0] is not streams[-1]:
            raise ValueError(f"module: block {block} reads {entering[0].name!r}, not the previous block's output "
                             f"{streams[-1].name!r}; blocks must form a chain to be stacked")
        streams = streams or [entering[0]]
        streams.append(outputs[0])
        if any(segment_of[user] not in (block + 1, POST) for user in outputs[0].users):
            raise ValueError(f"module: the output of block {block} is used beyond the next block; "
                             "blocks must form a chain to be stacked")
    return streams, sides


def _batch_sizes(sides: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The side inputs computed from the batch size alone."""
    return [n for n in sides if is_batch_size(n)]


BLOCK_SIZE = "xpipe_block_size"  # node meta: a size a block computes from its own stream


def _read_batch_size_from_streams(traced: torch.fx.GraphModule, layer_of: dict[torch.fx.Node, str],
                                  streams: list[torch.fx.Node], sides: list[torch.fx.Node], segment_of: dict) -> bool:
    """Let each block compute the sizes it reads from its own stream's rows instead of
    from the model's input (torch.export's ``sym_size(input, 0)``, and arithmetic of
    it, which every block's reshapes read): inside the stacked loop a block sees a
    microbatch's rows. True if the trace changed."""
    sizes = _batch_sizes(sides)
    for block, stream in enumerate(streams[:-1] if sizes else []):
        layer = next(layer_of[n] for n in layer_of if segment_of.get(n) == block)
        with traced.graph.inserting_after(stream):
            rows = traced.graph.call_function(torch.ops.aten.sym_size.int, (stream, 0))
        rows.meta[BLOCK_SIZE] = True
        layer_of[rows] = layer
        rebuilt: dict[torch.fx.Node, torch.fx.Node] = {}
        last = rows
        for size in sizes:
            own, last = _rebuilt(traced.graph, size, rows, rebuilt, last)
            for user in [u for u in size.users if segment_of.get(u) == block]:
                user.replace_input_with(size, own)
        layer_of.update(dict.fromkeys(rebuilt.values(), layer))
    return bool(sizes)


def _rebuilt(graph: torch.fx.Graph, size: torch.fx.Node, rows: torch.fx.Node,
             rebuilt: dict[torch.fx.Node, torch.fx.Node], last: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``size``'s expression computed from ``rows`` instead of the model input's batch
    size, inserted after ``last``; returns it and the last node inserted."""
    if size.target is torch.ops.aten.sym_size.int:
        return rows, last
    if size in rebuilt:
        return rebuilt[size], last
    args = []
    for arg in size.args:
        if isinstance(arg, torch.fx.Node):
            arg, last = _rebuilt(graph, arg, rows, rebuilt, last)
        args.append(arg)
    with graph.inserting_after(last):
        rebuilt[size] = graph.call_function(size.target, tuple(args))
    rebuilt[size].meta[BLOCK_SIZE] = True
    return rebuilt[size], rebuilt[size]


def dim_size(x: torch.Tensor, dim: int) -> int:
    """``x.size(dim)``: what torch.export's ``aten.sym_size.int`` computes, in a form
    ``torch.vmap`` can run (the op itself has no batching rule)."""
    return x.size(dim)


def functional_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """torch.export's ``aten.dropout`` as ``F.dropout``, looked up when called, so
    that the stacked loop's hashed dropout (:mod:`xpipe.spmd.dropout`) runs it."""
    return F.dropout(x, p, train)


def functional_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """torch.export's ``aten.scaled_dot_product_attention`` as the functional one,
    looked up when called, for the same reason as :func:`functional_dropout`."""
    return F.scaled_dot_product_attention(*args, **kwargs)


def reshaped_view(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """torch.export's ``aten.view`` as ``reshape``: under ``torch.vmap`` a view of a
    permuted block activation (torch's attention merging its heads) is not always
    contiguous in the batched layout, and ``view`` refuses it where the plain model's
    succeeds. Only for views nothing writes into (a reshape may copy)."""
    return x.reshape(shape)


_VMAPPABLE = {
    torch.ops.aten.sym_size.int: dim_size,
    torch.ops.aten.dropout.default: functional_dropout,
    torch.ops.aten.scaled_dot_product_attention.default: functional_attention,
}


def vmappable(block: torch.fx.GraphModule) -> None:
    """Let ``block``, as torch.export recorded it, run inside the stacked loop: under
    ``torch.vmap``, with dropout from the loop's hashed masks (vmap refuses random ops)."""
    for node in block.graph.nodes:
        if node.op == "call_function" and node.target in _VMAPPABLE:
            node.target = _VMAPPABLE[node.target]
        elif node.op == "call_function" and node.target is torch.ops.aten.view.default and not _written(node):
            node.target = reshaped_view
    block.recompile()


def _written(node: torch.fx.Node) -> bool:
    """Whether an operation writes into ``node``'s value in place."""
    return any(getattr(getattr(user.target, "_schema", None), "is_mutable", False) for user in node.users)


def _check_sides_are_tensors(sides: list[torch.fx.Node]) -> None:
    for side in sides:
        if side.op == "call_function" and side.target is torch.ops.aten.sym_size.int:
            raise ValueError(f"module: every block reads {side.name!r}, the size of dim {side.args[1]} of "
                             f"{side.args[0]}; the spmd executor gives blocks the batch size (dim 0 of an input) "
                             "only. Build the model for a fixed sequence length, or use executor='devices'")


def _side_rows(pre: torch.fx.GraphModule, names: list[str], sample_input: Any) -> tuple[bool, ...]:
    """Which of ``pre``'s side outputs (``names``) have a row per batch row: those whose
    dim 0 doubles when the sample batch does (shapes only; nothing is computed).
    One whose dim 0 doubles but is not the rows (rows folded with heads) is refused."""
    if sample_input is None:
        raise ValueError("sample_input: the blocks of the repeated body read tensors computed before it (an "
                         "attention mask, position embeddings); pass sample_input=<a batch as the model takes it> "
                         "so that xpipe can tell which of them have a row per batch row")
    inputs = flat_inputs(sample_input)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        once, twice = _on_fakes(pre, inputs, mode), _on_fakes(pre, _doubled(inputs), mode)
    count = len(names)
    for a in once[1:count + 1]:
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            raise ValueError(f"module: the blocks read a value computed before the body that is not a tensor "
                             f"with a batch dim ({type(a).__name__}); use executor='devices'")
    check_sides_hold_whole_rows(names, once[1:count + 1], twice[1:count + 1], once[0].shape[0])
    return tuple(b.shape[0] == 2 * a.shape[0] for a, b in zip(once[1:count + 1], twice[1:count + 1]))


def _skip_rows(pre: torch.fx.GraphModule, first: int, sample_input: Any) -> tuple[bool, ...] | None:
    """Which of ``pre``'s outputs from ``first`` on (the skips) have a row per batch row:
    those whose dim 0 doubles when the sample batch does (shapes only); None without a
    sample."""
    if sample_input is None:
        return None
    inputs = flat_inputs(sample_input)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        once, twice = _on_fakes(pre, inputs, mode), _on_fakes(pre, _doubled(inputs), mode)
    return tuple(isinstance(a, torch.Tensor) and a.dim() > 0 and b.shape[0] == 2 * a.shape[0]
                 for a, b in zip(once[first:], twice[first:]))


def _check_rows_stay_apart(pre: torch.fx.GraphModule, block: torch.fx.GraphModule, side_rows: tuple[bool, ...],
                           sample_input: Any) -> None:
    """Refuse a first block that mixes its stream's rows (:mod:`xpipe.capture.batch_rows`),
    run on the host on what ``pre`` makes of the sample (not where a weight is on the
    meta device: the planner's models)."""
    if any(tensor.is_meta for module in (pre, block) for tensor in [*module.parameters(), *module.buffers()]):
        return
    inputs = [x.cpu() if isinstance(x, torch.Tensor) else x for x in flat_inputs(sample_input)]
    with torch.no_grad():
        stream, *sides = _as_tuple(pre(*inputs))[:1 + len(side_rows)]
    check_rows_stay_apart(block, stream, sides, side_rows)


def _doubled(inputs: list[Any]) -> list[Any]:
    """The sample batch with twice its rows (each input with a batch dim, repeated)."""
    return [torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs]


def _hold_equal_rows_once(pre: torch.fx.GraphModule, blocks: list[torch.fx.GraphModule],
                          side_rows: tuple[bool, ...], sample_input: Any) -> tuple[bool, ...]:
    """``side_rows`` with each per-row side whose rows are proven equal for any batch
    (:mod:`xpipe.capture.equal_rows`) turned into one held whole: ``pre`` returns its first row, each block broadcasts
    it back to the stream's rows. Such a side (a causal mask expanded to the batch)
    would otherwise travel with every row of every microbatch, in the stream's dtype:
    for Llama 3 70B at 2,048 tokens, a fifth of what crosses each stage boundary."""
    output = next(node for node in pre.graph.nodes if node.op == "output")
    returned = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    per_row = [index for index, rows in enumerate(side_rows) if rows]
    proven = rows_proven_equal(pre, [returned[1 + index] for index in per_row], sample_input) if per_row else []
    equal = [index for index, held in zip(per_row, proven) if held]
    if not equal:
        return side_rows
    for index in equal:
        with pre.graph.inserting_before(output):
            returned[1 + index] = pre.graph.call_function(torch.ops.aten.slice.Tensor, (returned[1 + index], 0, 0, 1))
    output.args = (tuple(returned),)
    pre.recompile()
    for block in blocks:
        stream, *sides = [node for node in block.graph.nodes if node.op == "placeholder"]
        for index in equal:
            with block.graph.inserting_after(sides[-1]):
                broadcast = block.graph.call_function(rows_of, (sides[index], stream))
            sides[index].replace_all_uses_with(broadcast, delete_user_cb=lambda user, own=broadcast: user is not own)
        block.recompile()
    return tuple(rows and index not in equal for index, rows in enumerate(side_rows))


def rows_of(side: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """``side``'s one row broadcast to ``stream``'s rows (a view: nothing is copied)."""
    return side.expand(stream.shape[0], *side.shape[1:])


def block_inputs(stacked: StackedModel, sample_input: Any) -> tuple[torch.Tensor, ...]:
    """What the body's first block is called with on ``sample_input``: the stream and
    the side inputs, as fake tensors (shapes and dtypes; nothing is computed)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return _on_fakes(stacked.pre, flat_inputs(sample_input), mode)[:1 + len(stacked.side_rows)]


def _on_fakes(pre: torch.fx.GraphModule, inputs: list[Any], mode: FakeTensorMode) -> tuple:
    """``pre``'s outputs on fake copies of ``inputs`` (shapes only; nothing is computed)."""
    return _as_tuple(pre(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]))


def _as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _check_alike(blocks: list[torch.fx.GraphModule], module: nn.Module) -> None:
    """The blocks stack: the same parameter shapes, and buffers only where block 0's
    can stand for every block's, as the stacked body runs them: constants the capture
    made (torch.export turns ``qkv[..., [-2]]`` into one per block) or buffers outside
    the model's state, equal in every block.

    Raises:
        ValueError: naming the parameters or buffers that keep the blocks apart.
    """
    first = [(tuple(p.shape), p.dtype) for p in blocks[0].parameters()]
    in_state = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
    constants = [buffer for _, buffer in blocks[0].named_buffers()]  # per block names differ (lifted_tensor_2, ...)
    large = [name for name, buffer in blocks[0].named_buffers()
             if not buffer.is_floating_point() and buffer.dtype != torch.bool and buffer.numel()
             and int(buffer.abs().max()) >= 2**24]
    if large:
        raise ValueError(f"module: block 0's integer constants {large} hold values of 2**24 or more, which the "
                         "stacked body cannot carry exactly: use executor='devices'")
    for index, block in enumerate(blocks):
        if [(tuple(p.shape), p.dtype) for p in block.parameters()] != first:
            raise ValueError(f"module: block {index} has other parameter shapes than block 0; cannot stack them")
        buffers = dict(block.named_buffers())
        saved = [name for name, buffer in buffers.items() if id(buffer) in in_state]
        if saved:
            raise ValueError(f"module: block {index} has buffers in the model's state ({saved}, saved by "
                             "state_dict); the spmd executor stacks a block's parameters, not its buffers: use "
                             "executor='devices'")
        differing = [name for position, (name, buffer) in enumerate(buffers.items())
                     if position >= len(constants) or not _equal(buffer, constants[position])]
        if differing or len(buffers) != len(constants):
            raise ValueError(f"module: block {index}'s constant tensors {differing} differ from block 0's; the "
                             "stacked body runs every block with block 0's constants: use executor='devices'")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
