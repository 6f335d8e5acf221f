"""``xpipe-viz``: draw how a model is split and how its schedule runs.

    xpipe-viz xpipe.models:transformer_lm --stages 4 --chunks 8 --cost flops \\
        --input-shape 8,64 --out partition.html
    xpipe-viz --partition partition.json --chunks 8 --out -          # text, from a saved partition

The factory is ``PACKAGE.MODULE:FUNCTION``, called with no arguments. Bad
arguments print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
from torch import nn

from xpipe.partition import COSTS, Partition, partition
from xpipe.layout import microbatch_slots
from xpipe.schedule import SCHEDULES, Lockstep, by_name


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    arguments = parser.parse_args(argv)
    try:
        split = _partition(arguments)
        schedule = by_name(arguments.schedule, len(split.balance), arguments.chunks, arguments.virtual)
        if arguments.executor == "spmd" and arguments.schedule == "1f1b":  # one program, every stage in step
            stages = len(split.balance)
            schedule = Lockstep(stages, stages * microbatch_slots(arguments.chunks, stages))
        from xpipe.viz import render, render_text

        if arguments.out == "-":
            print(render_text(split, schedule))
        else:
            render(split, schedule, arguments.out)
            print(f"wrote {arguments.out}")
    except (ValueError, ImportError, AttributeError, TypeError, RuntimeError, OSError) as error:
        parser.exit(2, f"xpipe-viz: error: {str(error).splitlines()[0]}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xpipe-viz", description="Draw a model's pipeline partition and schedule.")
    parser.add_argument("factory", nargs="?", help="PACKAGE.MODULE:FUNCTION that returns the model")
    parser.add_argument("--partition", help="draw a Partition saved with Partition.to_json() instead")
    parser.add_argument("--stages", type=int, help="pipeline stages (with a factory)")
    parser.add_argument("--chunks", type=int, required=True, help="microbatches per step")
    parser.add_argument("--cost", choices=COSTS, default="params", help="what to balance (default: params)")
    parser.add_argument("--input-shape", help="sample input shape, e.g. 8,128; needed by every cost but params")
    parser.add_argument("--input-dtype", choices=("auto", "float32", "int64"), default="auto",
                        help="sample input dtype; auto picks int64 when the first layer embeds tokens")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--executor", choices=("devices", "spmd"), default="devices",
                        help="how 1f1b runs: a cell a device (devices) or in lockstep, three XLA loops (spmd)")
    parser.add_argument("--virtual", type=int, default=1,
                        help="model stages per rank, for interleaved and circular (default: 1)")
    parser.add_argument("--out", required=True, help="FILE.svg, FILE.png, FILE.html, or - for text")
    return parser


def _partition(arguments: argparse.Namespace) -> Partition:
    if arguments.partition:
        if arguments.factory:
            raise ValueError("factory: give a factory or --partition, not both")
        return _read_partition(Path(arguments.partition))
    if not arguments.factory:
        raise ValueError("factory: give PACKAGE.MODULE:FUNCTION, or --partition partition.json")
    if arguments.stages is None:
        raise ValueError("--stages: how many stages to split the model into")
    model = load_factory(arguments.factory)
    sample = sample_input_of(model, arguments.input_shape, arguments.input_dtype)
    try:
        return partition(model, arguments.stages, sample_input=sample, cost=arguments.cost)
    except ValueError as error:  # said in the API's words (sample_input=): say it in the command's
        message = str(error).splitlines()[0]
        if "sample_input" not in message:
            raise
        if sample is not None:
            raise ValueError(f"--input-shape {arguments.input_shape} does not fit the model: {message}") from error
        raise ValueError(f"--input-shape: the model needs a sample batch here ({message}); pass --input-shape "
                         "with the batch's sizes, e.g. --input-shape 8,128 (and --input-dtype int64 for token "
                         "ids)") from error


def _read_partition(path: Path) -> Partition:
    text = path.read_text()
    try:
        return Partition.from_json(text)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--partition: {str(path)!r} is not a partition written by Partition.to_json() "
                         f"({type(error).__name__}: {error}); write one with xpipe.partition(...).to_json()") from error


def load_factory(spec: str) -> nn.Module:
    """The model that ``PACKAGE.MODULE:FUNCTION`` returns (also ``xpipe-plan``'s)."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"factory: {spec!r} is not PACKAGE.MODULE:FUNCTION")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a model file in the current directory, as ``python -m`` finds it
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module may fail in any way while it loads
        raise ValueError(f"factory: importing {module_name!r} failed ({type(error).__name__}: {error})") from error
    if not callable(factory := getattr(module, function, None)):
        raise ValueError(f"factory: {module_name!r} has no function {function!r}")
    try:
        model = factory()
    except Exception as error:
        raise ValueError(f"factory: {spec}() raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise ValueError(f"factory: {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def sample_input_of(model: nn.Module, shape: str | None, dtype: str) -> torch.Tensor | None:
    """A zero batch of ``shape`` ("8,128"), of token ids when the model starts with an embedding."""
    if shape is None:
        return None
    try:
        dims = [int(d) for d in shape.split(",")]
    except ValueError as error:
        raise ValueError(f"--input-shape: {shape!r} is not a comma-separated list of sizes, e.g. 8,128") from error
    if min(dims) < 1:
        raise ValueError(f"--input-shape: {shape!r} has a size below 1; every size must be positive, e.g. 8,128")
    if dtype == "auto":
        first = next((m for m in model.modules() if not list(m.children())), None)
        dtype = "int64" if isinstance(first, nn.Embedding) else "float32"
    return torch.zeros(dims, dtype=getattr(torch, dtype))


if __name__ == "__main__":
    sys.exit(main())
