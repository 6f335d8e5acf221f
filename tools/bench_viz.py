"""Visualiser speed: a 48-block transformer on 8 stages with 32 chunks, every format.

    python tools/bench_viz.py

Goal (issue 5): under 5 s per rendering. Partitioning is timed separately.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import xpipe
from xpipe.models import transformer_lm
from xpipe.schedule import gpipe
from xpipe.viz import render, render_text


def main() -> None:
    start = time.perf_counter()
    split = xpipe.partition(transformer_lm(blocks=48), 8, sample_input=torch.zeros(8, 64, dtype=torch.long),
                           cost="flops")
    print(f"partition (cost=flops): {time.perf_counter() - start:.2f} s")
    schedule = gpipe(8, 32)
    with tempfile.TemporaryDirectory() as folder:
        for suffix in ("svg", "png", "html"):
            start = time.perf_counter()
            render(split, schedule, Path(folder) / f"partition.{suffix}")
            print(f"render {suffix}: {time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    render_text(split, schedule)
    print(f"render text: {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
