"""Cut a traced model into one program per pipeline stage, for the devices executor.

Each stage program reads the values it needs by name (model inputs, or values
made by earlier stages) and gives the values that later stages read. A value
used several stages downstream (a skip connection) is read straight from the
stage that made it, so nothing is relayed through the stages in between. This
module touches no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx
from torch import nn

from xpipe.capture.trace import Captured, ExportedForm, extract_module, trace_layers
from xpipe.partition import Partition


@dataclass
class StageProgram:
    """One stage of a model cut by :func:`cut_into_stages`.

    Attributes:
        module: runs the stage; called with the values named by ``inputs``. It
            returns a tuple of the values named by ``outputs``, except the last
            stage, which returns what the model returns.
        inputs: names (fx value names) of the values the stage reads.
        outputs: names of the values it makes that later stages read.
    """

    module: torch.fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class StagedModel:
    """A model cut into stages.

    Attributes:
        stages: the stage programs, in order.
        inputs: the names of the model's inputs.
        exported: for a model captured by torch.export, how the last stage's flat
            outputs fold back into what the model returns (a ``ModelOutput``, say)
            and the mode it was captured in; None for torch.fx.
    """

    stages: list[StageProgram]
    inputs: tuple[str, ...]
    exported: ExportedForm | None = None


def cut_into_stages(module: nn.Module, partition: Partition, sample_input: Any = None,
                    captured: Captured | None = None) -> StagedModel:
    """Cut ``module`` into one :class:`StageProgram` per stage of ``partition``
    (``sample_input`` for models only torch.export can capture; ``captured``, the
    model's capture on it, to cut without capturing again)."""
    traced, layer_of = captured if captured is not None else trace_layers(module, sample_input)
    stages = len(partition.balance)
    nodes = list(traced.graph.nodes)
    output = nodes[-1]
    stage_of = {node: partition.stage_of(layer) for node, layer in layer_of.items()}
    stage_of[output] = stages - 1
    programs = []
    for stage in range(stages):
        members = [n for n in nodes if n.op not in ("placeholder", "output") and stage_of.get(n) == stage]
        readers = [*members, output] if stage == stages - 1 else members
        inputs = list(dict.fromkeys(u for n in readers for u in n.all_input_nodes if stage_of.get(u) != stage))
        if stage == stages - 1:
            outputs: list[torch.fx.Node] = []
            piece = extract_module(traced, inputs, members, None, f"Stage{stage}", output=output)
        else:
            outputs = [n for n in members if any(stage_of[user] > stage for user in n.users)]
            piece = extract_module(traced, inputs, members, outputs, f"Stage{stage}")
            if len(outputs) == 1:
                piece = _returning_tuple(piece)
        programs.append(StageProgram(piece, tuple(n.name for n in inputs), tuple(n.name for n in outputs)))
    return StagedModel(programs, tuple(n.name for n in nodes if n.op == "placeholder"),
                       ExportedForm.of(traced, module))


def _returning_tuple(piece: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make a program with one output return it as a 1-tuple, like one with several."""
    (result,) = [node for node in piece.graph.nodes if node.op == "output"]
    result.args = ((result.args[0],),)
    piece.recompile()
    return piece
