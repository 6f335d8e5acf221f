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
from torch import nn

from xpipe.capture import extract_module, trace_layers
from xpipe.partition import Partition

PRE, POST = "pre", "post"


@dataclass
class StackedModel:
    """A model cut for the SPMD executor.

    Attributes:
        pre: ``(*inputs) -> (stream, *skips)``: the layers before the body.
        blocks: one ``stream -> stream`` module per block of the body, in order.
        post: ``(stream, *skips) -> output``: the layers after the body.
    """

    pre: torch.fx.GraphModule
    blocks: list[torch.fx.GraphModule]
    post: torch.fx.GraphModule


def cut_for_stacking(module: nn.Module, partition: Partition, sample_input: Any = None) -> StackedModel:
    """Cut ``module`` around ``partition.repeated``.

    Raises:
        ValueError: if there is no repeated body, or a block takes or gives more
            than the one stream tensor (such models need the ``devices`` executor).
    """
    repeated = partition.repeated
    if repeated is None:
        raise ValueError("module: has no run of identical blocks to stack over the 'stage' axis; "
                         "the spmd executor needs one (e.g. the N blocks of a transformer)")
    traced, layer_of = trace_layers(module, sample_input)
    position = {name: index for index, name in enumerate(partition.graph.graph["layers"])}

    def segment(node: torch.fx.Node) -> str | int:
        if node.op == "placeholder":
            return PRE
        if node.op == "output":
            return POST
        index = position[layer_of[node]]
        if index < repeated.start:
            return PRE
        if index >= repeated.start + repeated.period * repeated.count:
            return POST
        return (index - repeated.start) // repeated.period

    nodes = [n for n in traced.graph.nodes if n.op in ("placeholder", "output") or n in layer_of]  # no unused reads
    segment_of = {node: segment(node) for node in nodes}
    streams = _block_streams(nodes, segment_of, repeated.count)
    skips = [n for n in nodes if segment_of[n] == PRE and any(segment_of[user] == POST for user in n.users)]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    pre_nodes = [n for n in nodes if segment_of[n] == PRE and n.op != "placeholder"]
    pre = extract_module(traced, placeholders, pre_nodes, [streams[0], *skips], "Pre")
    blocks = [
        extract_module(traced, [streams[j]], [n for n in nodes if segment_of[n] == j], [streams[j + 1]], "Block")
        for j in range(repeated.count)
    ]
    post_nodes = [n for n in nodes if segment_of[n] == POST and n.op != "output"]
    post = extract_module(traced, [streams[-1], *skips], post_nodes, None, "Post", output=nodes[-1])
    _check_alike(blocks)
    return StackedModel(pre, blocks, post)


def _block_streams(nodes: list[torch.fx.Node], segment_of: dict, count: int) -> list[torch.fx.Node]:
    """The value entering each block, then the value leaving the last: ``count + 1`` nodes."""
    streams: list[torch.fx.Node] = []
    for block in range(count):
        members = [n for n in nodes if segment_of[n] == block]
        inputs = {u for n in members for u in n.all_input_nodes if segment_of[u] != block}
        outputs = [n for n in members if any(segment_of[user] != block for user in n.users)]
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(
                f"module: block {block} of the repeated body takes {sorted(u.name for u in inputs)} and gives "
                f"{[n.name for n in outputs]}; the spmd executor stacks blocks that pass one tensor from "
                "block to block. Pass only the hidden state between blocks, or use another executor"
            )
        (entering,) = inputs
        if streams and entering is not streams[-1]:
            raise ValueError(f"module: block {block} reads {entering.name!r}, not the previous block's output "
                             f"{streams[-1].name!r}; blocks must form a chain to be stacked")
        streams = streams or [entering]
        streams.append(outputs[0])
        if any(segment_of[user] not in (block + 1, POST) for user in outputs[0].users):
            raise ValueError(f"module: the output of block {block} is used beyond the next block; "
                             "blocks must form a chain to be stacked")
    return streams


def _check_alike(blocks: list[torch.fx.GraphModule]) -> None:
    first = [(tuple(p.shape), p.dtype) for p in blocks[0].parameters()]
    for index, block in enumerate(blocks):
        if [(tuple(p.shape), p.dtype) for p in block.parameters()] != first:
            raise ValueError(f"module: block {index} has other parameter shapes than block 0; cannot stack them")
        if list(block.buffers()):
            raise ValueError(f"module: block {index} has buffers; the spmd executor stacks parameters only")
