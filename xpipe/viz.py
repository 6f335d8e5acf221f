"""The partition visualiser: how a model was split, and how its schedule runs.

One figure, three panels:

1. the layer graph, coloured by stage, each cut marked with the shape and bytes
   of every tensor that crosses it (long chains are drawn compactly: runs of
   same-type layers on one stage become one box);
2. per-stage bars of parameters, FLOPs, activation bytes and estimated memory,
   with the partition's imbalance;
3. the schedule's timeline: a row per stage, a column per clock, forward and
   backward cells labelled by microbatch, idle cells shaded, the bubble in the title.

``render(partition, schedule, "partition.svg")`` writes SVG, PNG or a self-contained
HTML page (hover text on nodes, bars and cells); ``render_text`` is the same
for terminals. The ``xpipe-viz`` command (``xpipe/viz_cli.py``) wraps both.
"""

from __future__ import annotations

import io
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from xpipe._format import human  # noqa: E402
from xpipe.partition import Partition, layer_cost  # noqa: E402
from xpipe.schedule import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Lockstep, Schedule  # noqa: E402

_OPACITY = {FORWARD: 0.9, INPUT_GRAD: 0.6, BACKWARD: 0.45, WEIGHT_GRAD: 0.3}
_KIND_NAMES = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input gradient (I)",
               WEIGHT_GRAD: "weight gradient (W)"}

FORMATS = ("svg", "png", "html")
MAX_NODES = 40  # beyond this many layers the graph panel groups runs of layers
PANELS = ("panel-graph", "panel-costs", "panel-schedule")
METRICS = (("params", "parameters", ""), ("flops", "forward FLOPs", "FLOP"),
           ("activation_bytes", "activations", "B"), ("memory", "est. memory", "B"))
_SVG = "http://www.w3.org/2000/svg"


@dataclass(frozen=True)
class Box:
    """One node of the graph panel: a layer, or a run of same-type layers on one stage."""

    layers: tuple[str, ...]
    stage: int
    label: str


def stage_summary(partition: Partition) -> list[dict[str, float]]:
    """Per stage: parameters, forward FLOPs, saved activation bytes and estimated memory.

    Estimated memory is the ``"memory"`` cost model: weights and gradients, saved
    activations of one sample input, and the tensors received across the cut in front.
    FLOPs and activations are 0 for a partition made without a sample input.
    """
    received = [0] + [sum(c.bytes for c in cut) for cut in partition.boundaries]
    rows = []
    for stage, names in enumerate(partition.stages):
        nodes = [partition.graph.nodes[name] for name in names]
        row = {key: float(sum(node.get(key, 0) for node in nodes)) for key in ("params", "flops", "activation_bytes")}
        row["memory"] = sum(layer_cost(node, "memory") for node in nodes) + received[stage]
        rows.append(row)
    return rows


def render_text(partition: Partition, schedule: Schedule | Lockstep) -> str:
    """The three panels as plain text: the partition, the stage costs, the timeline."""
    lines = [str(partition), "", "per stage: " + ", ".join(title for _, title, _ in METRICS)]
    for stage, row in enumerate(stage_summary(partition)):
        values = "  ".join(f"{human(row[key]) + unit:>10}" for key, _, unit in METRICS)
        lines.append(f"  stage {stage}: {values}")
    return "\n".join([*lines, "", str(schedule)])


def render(partition: Partition, schedule: Schedule | Lockstep, out: str | Path) -> None:
    """Write the figure to ``out``; its suffix (.svg, .png, .html) picks the format."""
    path = Path(out)
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in FORMATS:
        raise ValueError(f"out: {str(out)!r} has no known suffix; use one of .svg, .png, .html (or '-' for text)")
    _check_matching(partition, schedule)
    figure, hover = draw(partition, schedule)
    if suffix == "png":
        figure.savefig(path, dpi=110)
    else:
        svg = io.StringIO()
        figure.savefig(svg, format="svg")
        text = svg.getvalue() if suffix == "svg" else _html(_with_hover(svg.getvalue(), hover), partition, schedule)
        path.write_text(text, encoding="utf-8")
    plt.close(figure)


def draw(partition: Partition, schedule: Schedule | Lockstep) -> tuple[plt.Figure, dict[str, str]]:
    """The figure, and hover text by SVG element id."""
    stages = len(partition.balance)
    figure = plt.figure(figsize=(max(12, min(30, schedule.clocks * 0.35)), 5 + 0.45 * stages + 3.5))
    grid = figure.add_gridspec(3, 1, height_ratios=[1.6, 2.2, 0.5 * stages + 1], hspace=0.5,
                               top=0.95, bottom=0.06, left=0.07, right=0.98)
    hover: dict[str, str] = {}
    colours = [plt.get_cmap("tab10")(stage % 10) for stage in range(stages)]
    _graph_panel(figure.add_subplot(grid[0]), partition, colours, hover)
    _cost_panel(figure.add_subplot(grid[1]), partition, colours, hover)
    panel = _lockstep_panel if isinstance(schedule, Lockstep) else _schedule_panel
    panel(figure.add_subplot(grid[2]), schedule, colours, hover)
    return figure, hover


def boxes(partition: Partition) -> list[Box]:
    """The graph panel's nodes, in layer order; runs are grouped past ``MAX_NODES`` layers."""
    graph = partition.graph
    names = list(graph.graph["layers"])
    if len(names) <= MAX_NODES:
        return [Box((name,), graph.nodes[name]["stage"], f"{name}\n{graph.nodes[name]['type']}") for name in names]
    runs: list[list[str]] = []
    for name in names:
        node = graph.nodes[name]
        last = graph.nodes[runs[-1][-1]] if runs else None
        if last is not None and (last["stage"], last["type"]) == (node["stage"], node["type"]):
            runs[-1].append(name)
        else:
            runs.append([name])
    return [Box(tuple(run), graph.nodes[run[0]]["stage"],
                run[0] if len(run) == 1 else f"{graph.nodes[run[0]]['type']} x{len(run)}") for run in runs]


def _graph_panel(axes, partition: Partition, colours, hover: dict[str, str]) -> None:
    axes.set_gid(PANELS[0])
    nodes = boxes(partition)
    where = {name: index for index, box in enumerate(nodes) for name in box.layers}
    graph = partition.graph
    for name in graph.graph["inputs"]:
        where[name] = -1
    where["output"] = len(nodes)
    for index, box in enumerate(nodes):
        rectangle = Rectangle((index - 0.4, -0.3), 0.8, 0.6, facecolor=colours[box.stage], alpha=0.8)
        rectangle.set_gid(f"layer-{index}")
        axes.add_patch(rectangle)
        axes.text(index, 0, box.label, ha="center", va="center", fontsize=7, rotation=90 if len(nodes) > 12 else 0)
        hover[f"layer-{index}"] = _layer_hover(partition, box)
    for end, label in ((-1, "input"), (len(nodes), "output")):
        axes.text(end, 0, label, ha="center", va="center", fontsize=7, style="italic")
    drawn = set()
    for producer, consumer in graph.edges():
        start, stop = where[producer], where[consumer]
        if start == stop or (start, stop) in drawn:
            continue
        drawn.add((start, stop))
        bend = 0.0 if stop - start == 1 else -0.35
        axes.add_patch(FancyArrowPatch((start + 0.4, 0.3 if bend else 0), (stop - 0.4, 0.3 if bend else 0),
                                       connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>", mutation_scale=8,
                                       color="0.3", linewidth=0.8))
    for cut, crossings in enumerate(partition.boundaries):
        x = max(where[name] for name in partition.stages[cut]) + 0.5
        axes.axvline(x, color="black", linestyle="--", linewidth=0.8)
        text = "\n".join(_crossing_label(c) for c in crossings[:4]) + ("\n..." if len(crossings) > 4 else "")
        axes.text(x, -0.42, text, ha="center", va="top", fontsize=6, bbox={"facecolor": "white", "linewidth": 0})
    axes.set_xlim(-1.6, len(nodes) + 0.6)
    axes.set_ylim(-1.3, 1.2)
    axes.axis("off")
    axes.set_title(f"{graph.graph['model']}: {sum(partition.balance)} layers on {len(partition.balance)} stages "
                   f"(cuts show what crosses)", fontsize=10)


def _cost_panel(axes, partition: Partition, colours, hover: dict[str, str]) -> None:
    axes.set_gid(PANELS[1])
    summary = stage_summary(partition)
    width = 0.8 / len(summary)
    for metric, (key, title, unit) in enumerate(METRICS):
        peak = max(row[key] for row in summary) or 1.0
        for stage, row in enumerate(summary):
            x = metric + (stage - (len(summary) - 1) / 2) * width
            bar = axes.bar(x, row[key] / peak, width * 0.9, color=colours[stage])[0]
            bar.set_gid(f"bar-{stage}-{key}")
            hover[f"bar-{stage}-{key}"] = f"stage {stage}: {title} {human(row[key])}{unit}"
    axes.set_xticks(range(len(METRICS)), [title for _, title, _ in METRICS], fontsize=8)
    axes.set_ylabel("share of largest stage", fontsize=8)
    axes.legend(handles=[Rectangle((0, 0), 1, 1, color=c) for c in colours],
                labels=[f"stage {s}" for s in range(len(colours))], fontsize=7, ncol=min(8, len(colours)),
                loc="upper center", bbox_to_anchor=(0.5, -0.12))
    axes.set_title(f"stage costs: imbalance {partition.imbalance:.3f} under cost={partition.cost!r}", fontsize=10)


def _schedule_panel(axes, schedule: Schedule, colours, hover: dict[str, str]) -> None:
    axes.set_gid(PANELS[2])
    for clock, row in enumerate(schedule.table):
        for stage, action in enumerate(row):
            gid = f"cell-{clock}-{stage}"
            if action is None:
                cell = Rectangle((clock, stage), 1, 1, facecolor="0.92", hatch="///", edgecolor="0.75", linewidth=0.3)
                hover[gid] = f"clock {clock}, stage {stage}: idle (bubble)"
            else:
                cell = Rectangle((clock, stage), 1, 1, facecolor=colours[stage], alpha=_OPACITY[action.kind],
                                 hatch="..." if action.kind == WEIGHT_GRAD else None, edgecolor="white",
                                 linewidth=0.5)
                label = str(action) if schedule.virtual > 1 else f"{action.kind}{action.microbatch}"
                axes.text(clock + 0.5, stage + 0.5, label, ha="center", va="center", fontsize=6)
                hover[gid] = f"clock {clock}, stage {stage}: {_KIND_NAMES[action.kind]} of model stage " \
                             f"{action.stage}, microbatch {action.microbatch}"
            cell.set_gid(gid)
            axes.add_patch(cell)
    axes.set_xlim(0, schedule.clocks)
    axes.set_ylim(schedule.stages, 0)
    axes.set_yticks([s + 0.5 for s in range(schedule.stages)], [f"stage {s}" for s in range(schedule.stages)],
                    fontsize=8)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("clock", fontsize=8)
    axes.set_title(f"{schedule.name}: {schedule.chunks} microbatches, bubble {schedule.bubble_fraction:.1%}, "
                   f"peak in flight {max(schedule.peak_in_flight)} microbatches (read from the table)", fontsize=10)


def _lockstep_panel(axes, lockstep: Lockstep, colours, hover: dict[str, str]) -> None:
    """The spmd executor's 1F1B: each clock a column, its forward in the cell's upper
    half and its backward in the lower, the three loops shaded and named above."""
    axes.set_gid(PANELS[2])
    for loop, (cells, start, end) in enumerate(lockstep.loops):
        if end > start:
            axes.axvspan(start, end, facecolor="0.96" if loop % 2 else "white", zorder=0)
            axes.text((start + end) / 2, -0.15, f"loop {loop + 1}: {end - start} x {cells}", ha="center",
                      va="bottom", fontsize=7)
    for clock in range(lockstep.clocks):
        for stage in range(lockstep.stages):
            for half, (kind, microbatch) in enumerate(((FORWARD, lockstep.forward(clock, stage)),
                                                       (BACKWARD, lockstep.backward(clock, stage)))):
                gid = f"cell-{clock}-{stage}-{kind}"
                corner = (clock, stage + half / 2)
                if microbatch is None:
                    cell = Rectangle(corner, 1, 0.5, facecolor="0.92", hatch="///", edgecolor="0.75", linewidth=0.3)
                    hover[gid] = f"clock {clock}, stage {stage}: no {_KIND_NAMES[kind]} (bubble)"
                else:
                    cell = Rectangle(corner, 1, 0.5, facecolor=colours[stage], alpha=_OPACITY[kind],
                                     edgecolor="white", linewidth=0.5)
                    axes.text(clock + 0.5, stage + half / 2 + 0.25, f"{kind}{microbatch}", ha="center",
                              va="center", fontsize=5)
                    hover[gid] = f"clock {clock}, stage {stage}: {_KIND_NAMES[kind]} of microbatch {microbatch}"
                cell.set_gid(gid)
                axes.add_patch(cell)
    axes.set_xlim(0, lockstep.clocks)
    axes.set_ylim(lockstep.stages, -0.5)
    axes.set_yticks([s + 0.5 for s in range(lockstep.stages)],
                    [f"stage {s}" for s in range(lockstep.stages)], fontsize=8)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("clock", fontsize=8)
    axes.set_title(f"{lockstep.name}: {lockstep.chunks} microbatches in three XLA loops, bubble "
                   f"{lockstep.bubble_fraction:.1%}, stage inputs kept {max(lockstep.peak_in_flight)} at most "
                   "(a forward above, a backward below, each clock)", fontsize=10)


def _layer_hover(partition: Partition, box: Box) -> str:
    nodes = [partition.graph.nodes[name] for name in box.layers]
    span = box.layers[0] if len(box.layers) == 1 else f"{box.layers[0]} .. {box.layers[-1]}"
    text = f"{span} (stage {box.stage}): {human(sum(n['params'] for n in nodes))} params"
    if "flops" in nodes[0]:
        text += f", {human(sum(n['flops'] for n in nodes))}FLOP"
    if "out_shape" in nodes[-1]:
        text += f", output {list(nodes[-1]['out_shape'])}"
    return text


def _crossing_label(crossing) -> str:
    if crossing.shape is None:
        return f"{crossing.name} (no sample input)"
    return f"{crossing.name} {list(crossing.shape)} {human(crossing.bytes)}B"


def _with_hover(svg: str, hover: dict[str, str]) -> str:
    """Give each element named in ``hover`` a ``<title>``: the browser's hover text."""
    ElementTree.register_namespace("", _SVG)
    ElementTree.register_namespace("xlink", "http://www.w3.org/1999/xlink")
    root = ElementTree.fromstring(svg.split("?>", 1)[-1].split("]>", 1)[-1].strip())
    for element in root.iter():
        text = hover.get(element.get("id", ""))
        if text is not None:
            title = ElementTree.Element(f"{{{_SVG}}}title")
            title.text = text
            element.insert(0, title)
    return ElementTree.tostring(root, encoding="unicode")


def _html(svg: str, partition: Partition, schedule: Schedule | Lockstep) -> str:
    title = f"xpipe: {partition.graph.graph['model']} on {len(partition.balance)} stages"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            "<style>body{font-family:sans-serif;margin:1em} svg{max-width:100%;height:auto}</style></head>"
            f"<body><h1>{title}</h1><p>{schedule.name}: {schedule.chunks} microbatches, bubble "
            f"{schedule.bubble_fraction:.1%}, peak in flight {max(schedule.peak_in_flight)} microbatches, "
            f"imbalance {partition.imbalance:.3f}. Hover over layers, bars and cells for details.</p>"
            f"{svg}</body></html>\n")


def _check_matching(partition: Partition, schedule: Schedule | Lockstep) -> None:
    if schedule.stages != len(partition.balance):
        raise ValueError(f"schedule: has {schedule.stages} stages but the partition has {len(partition.balance)}; "
                         "build both for the same stage count")
