"""Partitioner speed: the balancer on a long cost list, and a 48-block transformer end to end.

    python tools/bench_partition.py

Prints the median of several runs for each case. Goals (issue 2): 10,000 layers into
64 stages under 1 s; tracing and partitioning a 48-block transformer under 10 s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import xpipe
from xpipe._balance import balance_by_cost
from xpipe.models import transformer_lm


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    costs = np.random.default_rng(0).random(10_000)
    seconds = median_seconds(lambda: balance_by_cost(costs, 64), repeats=5)
    print(f"balance 10,000 layers into 64 stages: {seconds:.3f} s")

    model = transformer_lm(blocks=48, width=256, seq=128)
    tokens = torch.zeros(8, 128, dtype=torch.long)
    for cost in ("params", "flops", "memory", "time"):
        sample = None if cost == "params" else tokens
        seconds = median_seconds(lambda: xpipe.partition(model, 8, sample_input=sample, cost=cost), repeats=3)
        print(f"trace + partition 48-block transformer (width 256, batch 8x128) into 8 stages, "
              f"cost={cost}: {seconds:.2f} s")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
