"""``xpipe-plan``: which layouts fit a model on a set of chips, best first.

    xpipe-plan llama3-70b --devices 256 --chip v5e --batch 32 --seq 2048
    xpipe-plan path/to/config.json --devices 64 --chip v5p --batch 256 --plot plan.png
    xpipe-plan xpipe.models:transformer_lm --input-shape 2,64 --devices 8 --memory 2GiB --batch 32
    xpipe-plan llama3-8b --devices 64 --chip v5e --batch 256 --timeline 1 --plot timeline.svg

The model is a built-in name (the public Llama 3 configs), a Hugging Face
``config.json`` (both built on the meta device: nothing is allocated), or
``PACKAGE.MODULE:FUNCTION`` returning an ``nn.Module`` (captured on a sample of
``--input-shape``). Bad arguments, and a model that fits nowhere, print one
line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from xpipe._checks import GATHERS
from xpipe.planner import GiB, KINDS, PRESETS, Moment, Plan, Prediction, plan, preset

# Meta's published configs (config.json of each model), the fields that shape the model.
LLAMA3 = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "llama3-405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128),
}
OPTIMIZER_STATES = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}
DTYPES = {"bfloat16": 2, "float32": 4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(|b|kb|mb|gb|tb|kib|mib|gib|tib)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    arguments = parser.parse_args(argv)
    try:
        result = _plan(arguments)
        if not result.fitting:
            raise ValueError(nowhere(result))
        if arguments.timeline is not None:
            chosen = _listed(result, arguments.timeline)
            print(timeline_report(chosen))
            if arguments.plot:
                draw_timeline(chosen, arguments.plot)
        else:
            print(report(result, arguments.top))
            if arguments.plot:
                draw(result, arguments.plot, arguments.top)
        if arguments.plot:
            print(f"wrote {arguments.plot}")
    except (ValueError, ImportError, OSError) as error:
        parser.exit(2, f"xpipe-plan: error: {str(error).splitlines()[0]}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpipe-plan", description="Which xpipe layouts fit a model, best first.")
    parser.add_argument("model", help=f"{', '.join(LLAMA3)}, a Hugging Face config.json, or "
                                      "PACKAGE.MODULE:FUNCTION returning the model")
    parser.add_argument("--devices", type=int, required=True, help="chips in all")
    parser.add_argument("--chip", default="v5e", help=f"a preset: {', '.join(PRESETS)} (default: v5e)")
    parser.add_argument("--memory", help="bytes a chip may hold, e.g. 16GiB (default: the chip's HBM; at most "
                                         "that, unless --over-chip-memory)")
    parser.add_argument("--over-chip-memory", action="store_true",
                        help="allow --memory above the chip's HBM (to plan for a chip with more memory)")
    parser.add_argument("--batch", type=int, required=True, help="rows (sequences) of the global batch")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length, for a config (default: 2048)")
    parser.add_argument("--padding-mask", action="store_true",
                        help="for a config: the batches give an attention_mask (default: packed sequences, none)")
    parser.add_argument("--input-shape", help="sample input shape for a factory's model, e.g. 2,64")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="of weights, gradients, optimizer state and activations (default: bfloat16)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    parser.add_argument("--checkpoint", nargs="+", default=["except_last", "always"],
                        help="recomputation policies to consider (default: except_last always)")
    parser.add_argument("--gather", nargs="+", default=list(GATHERS),
                        help="when the body's weights are gathered: step, block (Pipe's gather; default: both)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="layouts with tensor > 1 run Pipe's sequence_parallel=True")
    parser.add_argument("--slices", type=int, default=1, help="TPU slices; the stage axis crosses them")
    parser.add_argument("--top", type=int, default=10, help="layouts to list (default: 10)")
    parser.add_argument("--plot", help="FILE.png or FILE.svg: the listed layouts' memory per device by kind "
                                       "(with --timeline: that layout's bytes at each moment of the step)")
    parser.add_argument("--timeline", type=int, metavar="K",
                        help="instead of the list, the bytes per device at each clock of the step of the K-th "
                             "layout that fits (1: the best), by kind, its peak marked (the plan's figure)")
    return parser


def _plan(arguments: argparse.Namespace) -> Plan:
    chip = preset(arguments.chip)
    memory = None if arguments.memory is None else parse_size(arguments.memory)
    if arguments.top < 1:
        raise ValueError(f"--top: expected at least 1, got {arguments.top}")
    model, sample = _model(arguments)
    return plan(model, devices=arguments.devices, batch=arguments.batch, chip=chip, memory_per_device=memory,
                sample_input=sample, seq=arguments.seq, itemsize=DTYPES[arguments.dtype],
                optimizer_states=OPTIMIZER_STATES[arguments.optimizer], checkpoints=tuple(arguments.checkpoint),
                gathers=tuple(arguments.gather), slices=arguments.slices, padding_mask=arguments.padding_mask,
                sequence_parallel=arguments.sequence_parallel, over_chip_memory=arguments.over_chip_memory)


def _model(arguments: argparse.Namespace) -> tuple[Any, Any]:
    """The model or config named on the command line, and a sample input for a model."""
    name = arguments.model
    if name in LLAMA3:
        return llama3_config(name), None
    if name.endswith(".json"):
        return _config_file(Path(name)), None
    if ":" not in name:
        raise ValueError(f"model: {name!r} is not one of {', '.join(LLAMA3)}, a config.json or "
                         "PACKAGE.MODULE:FUNCTION")
    from xpipe.viz_cli import load_factory, sample_input_of

    model = load_factory(name)
    if arguments.input_shape is None:
        raise ValueError("--input-shape: a factory's model is profiled on a sample batch; pass its sizes, "
                         "e.g. --input-shape 2,64")
    return model, sample_input_of(model, arguments.input_shape, "auto")


def llama3_config(name: str) -> Any:
    """The transformers config of the Llama 3 model called ``name`` (a key of ``LLAMA3``)."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA3[name], num_key_value_heads=8, vocab_size=128256,
                                      tie_word_embeddings=False, max_position_embeddings=8192)
    config.name_or_path = name
    return config


def _config_file(path: Path) -> Any:
    import transformers

    try:
        fields = json.loads(path.read_text())
        return transformers.AutoConfig.for_model(**fields)
    except FileNotFoundError:
        raise ValueError(f"model: {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"model: {str(path)!r} is not a Hugging Face config.json with a model_type "
                         f"({type(error).__name__}: {error})") from error


def parse_size(text: str) -> int:
    """Bytes from ``16GiB``, ``16 GB``, ``17179869184``; at least one byte."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"--memory: {text!r} is not a size; write it as e.g. 16GiB, 16GB or 17179869184")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 1:
        raise ValueError(f"--memory: {text!r} is no memory at all; give what one chip may hold, e.g. 16GiB")
    return size


def report(result: Plan, top: int) -> str:
    """The plan as text: the model and chips, the best layouts, and pure pipeline parallelism's verdict."""
    profile, chip = result.profile, result.chip
    lines = [f"{profile.name}: {profile.parameters / 1e9:.2f}B parameters, {profile.blocks} blocks, on "
             f"{result.devices} x {chip.name} ({result.capacity / GiB:.2f} GiB each), batch {result.batch}",
             f"{len(result.fitting)} of {len(result.fitting) + len(result.refused)} layouts fit; fastest first "
             "(step time: a lower bound, at peak FLOP/s and link bandwidth, no overlap)"]
    if result.fitting:
        lines.append(f"{'#':>3}  {'stage':>5} {'data':>4} {'fsdp':>4} {'tensor':>6}  {'schedule':<12} "
                     f"{'chunks':>6}  {'checkpoint':<11} {'gather':<6} {'GiB/device':>10}  "
                     f"({' '.join(k[:5] for k in KINDS)})  {'bubble':>6}  {'step s':>8}  XLA's peak, by the band")
        for index, prediction in enumerate(result.fitting[:top], 1):
            lines.append(_row(index, prediction))
    pure = result.least_memory(lambda layout: layout.pure_pipeline)
    if pure is not None and not pure.fits:
        lines.append(f"pure pipeline parallelism (fsdp = tensor = 1) does not fit: its smallest layout, {pure.layout}, "
                     f"needs {pure.describe_memory()}, over {pure.capacity / GiB:.2f} GiB")
    return "\n".join(lines)


def _listed(result: Plan, index: int) -> Prediction:
    """The ``index``-th layout of those that fit, best first (1 is the best)."""
    if not 1 <= index <= len(result.fitting):
        raise ValueError(f"--timeline: {index} is not a layout that fits; give 1 to {len(result.fitting)} "
                         "(the layouts that fit, best first)")
    return result.fitting[index - 1]


def timeline_report(prediction: Prediction) -> str:
    """One layout's step, moment by moment (a run of clocks that hold the same bytes on
    one line): GiB per device by kind, the peak marked."""
    timeline = prediction.timeline
    peak = timeline.peak
    band = prediction.band
    if band is None:
        measured = "no cell of this layout kind was measured on the emulated devices"
    else:
        low, high = band.measured_range(prediction.bytes)
        measured = (f"on the emulated devices XLA's peak for this layout kind was {1 / band.high:.2f} to "
                    f"{1 / band.low:.2f} of the plan's ({band.cells} cells): {low / GiB:.2f} to {high / GiB:.2f} "
                    "GiB here")
    lines = [f"{prediction.layout}: bytes per device at each moment of the step (GiB; the peak, "
             f"{peak.bytes / GiB:.2f}, is the plan's; {measured})",
             f"  {'moment':<24} {'total':>7}  " + " ".join(f"{kind[:5]:>6}" for kind in KINDS)]
    for run in _runs(timeline.moments):
        first, last = run[0], run[-1]
        label = first.label if len(run) == 1 else f"{first.label.replace('clock', 'clocks')}-{last.label.split()[-1]}"
        parts = " ".join(f"{first.memory[kind] / GiB:6.2f}" for kind in KINDS)
        lines.append(f"  {label:<24} {first.bytes / GiB:7.2f}  {parts}{'  <- peak' if peak in run else ''}")
    return "\n".join(lines)


def _runs(moments: tuple[Moment, ...]) -> list[list[Moment]]:
    """Consecutive moments of one loop (forward or backward) that hold the same bytes, grouped."""
    runs: list[list[Moment]] = []
    for moment in moments:
        previous = runs[-1][-1] if runs else None
        same_loop = previous is not None and previous.label.split()[0] == moment.label.split()[0] != "loss"
        if same_loop and previous.memory == moment.memory:
            runs[-1].append(moment)
        else:
            runs.append([moment])
    return runs


def draw_timeline(prediction: Prediction, path: str, measured_peak: int | None = None) -> None:
    """One layout's bytes per device at each moment of the step, stacked by kind, the
    chip's capacity and (where given, from ``xpipe.inspect.audit``) XLA's peak beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moments = prediction.timeline.moments
    figure, axis = plt.subplots(figsize=(max(6.0, 0.28 * len(moments) + 3), 4.2))
    bottom = [0.0] * len(moments)
    for kind in KINDS:
        heights = [moment.memory[kind] / GiB for moment in moments]
        axis.bar(range(len(moments)), heights, bottom=bottom, label=kind, width=0.85)
        bottom = [a + b for a, b in zip(bottom, heights)]
    peak = moments.index(prediction.timeline.peak)
    axis.annotate(f"peak {bottom[peak]:.2f} GiB", (peak, bottom[peak]), ha="center", va="bottom", fontsize=8)
    axis.axhline(prediction.capacity / GiB, color="black", linestyle="--", linewidth=1, label="capacity")
    if measured_peak is not None:
        axis.axhline(measured_peak / GiB, color="red", linestyle=":", linewidth=1.2, label="XLA's peak")
    axis.set_xticks(range(len(moments)), [moment.label.replace(" clock ", " ") for moment in moments],
                    rotation=90, fontsize=7)
    axis.set_ylabel("GiB per device")
    axis.set_title(str(prediction.layout), fontsize=8)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def nowhere(result: Plan) -> str:
    """Why no layout fits: the smallest, and its largest part."""
    smallest = result.least_memory()
    if smallest is None:
        return (f"model: no layout of the spmd executor exists for batch {result.batch} on {result.devices} "
                "devices (each microbatch must split evenly over the data x fsdp groups); try a batch that is a "
                "multiple of the device count")
    largest = max(KINDS, key=lambda kind: smallest.memory[kind])
    return (f"model: {result.profile.name} fits nowhere on {result.devices} x {result.chip.name}: the smallest "
            f"layout, {smallest.layout}, needs {smallest.bytes / GiB:.2f} GiB per device, over "
            f"{smallest.capacity / GiB:.2f} GiB (largest part: {largest}, {smallest.memory[largest] / GiB:.2f} "
            "GiB); use more devices, or a smaller batch or sequence")


def _row(index: int, prediction: Prediction) -> str:
    layout = prediction.layout
    parts = " ".join(f"{prediction.memory[kind] / GiB:5.2f}" for kind in KINDS)
    return (f"{index:>3}  {layout.stages:>5} {layout.data:>4} {layout.fsdp:>4} {layout.tensor:>6}  "
            f"{layout.schedule_label:<12} {layout.chunks:>6}  {layout.checkpoint:<11} {layout.gather:<6} "
            f"{prediction.bytes / GiB:>10.2f}  ({parts})  "
            f"{prediction.bubble:>6.3f}  {prediction.step_seconds:>8.3f}  {_band_text(prediction)}")


def _band_text(prediction: Prediction) -> str:
    """The GiB XLA held for this layout's kind at the plan's figure, as far off as its
    measured cells were (:mod:`xpipe.planner.accuracy`)."""
    band = prediction.band
    if band is None:
        return "kind not measured"
    low, high = band.measured_range(prediction.bytes)
    return f"{low / GiB:.2f}-{high / GiB:.2f} ({band.cells} cells)"


def draw(result: Plan, path: str, top: int) -> None:
    """The listed layouts' bytes per device, stacked by kind, beside the chip's capacity
    (and pure pipeline parallelism's smallest layout, when it does not fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = result.fitting[:top]
    pure = result.least_memory(lambda layout: layout.pure_pipeline)
    if pure is not None and not pure.fits:
        shown = [*shown, pure]
    figure, axis = plt.subplots(figsize=(11, 0.45 * len(shown) + 1.6))
    labels = [f"{p.layout.stages}s {p.layout.data}d {p.layout.fsdp}f {p.layout.tensor}t, {p.layout.schedule_label}, "
              f"M={p.layout.chunks}, {p.layout.checkpoint}, gather {p.layout.gather}"
              f"{'' if p.fits else ' (does not fit)'}" for p in shown]
    left = [0.0] * len(shown)
    for kind in KINDS:
        widths = [p.memory[kind] / GiB for p in shown]
        axis.barh(range(len(shown)), widths, left=left, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    capacity = result.capacity / GiB
    axis.axvline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity {capacity:.1f} GiB")
    axis.set_yticks(range(len(shown)), labels, fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("GiB per device (the busiest), at the step's peak")
    axis.set_title(f"{result.profile.name} on {result.devices} x {result.chip.name}, batch {result.batch}")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
