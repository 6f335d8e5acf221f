"""Devices executor figures (issue 6's benchmark): step time against torchgpipe and
against the unpipelined model, and how much the stages overlap.

    pip install -e '.[bench]'        # torchgpipe
    python tools/bench_devices.py

One model and batch for all three: a ResNet-style CNN (widths 16..128, every stage a
different width), 32 images of 32x32, 8 microbatches, 4 stages, the same balance
(xpipe's partition by parameters, handed to torchgpipe), checkpoint="except_last",
SGD, 3 warm-up steps then the median of 10 timed steps, each ending when every device
is done:
1. xpipe, executor="devices", on 4 emulated XLA CPU devices;
2. torchgpipe with devices=['cpu'] * 4;
3. the model unpipelined on one XLA device (one program per step);
4. the model unpipelined in eager PyTorch on the CPU: torchgpipe's own baseline, so
   that each pipeline's cost can be read against the kernels it runs on.
Overlap comes from the executor's timeline of one step: a cell's device is taken
as busy from its launch (or the end of the device's previous cell, if later) until
its output buffer was ready. Printed: the sum of busy time over the span in which
any device was busy (1.0 = no overlap, 4.0 = all four always busy), the share of
busy time during which at least two devices were busy, and how long any device
was busy (the rest of the step is the host tracing, launching and moving data).

On the CPU emulation the "devices" share this machine's cores, so overlap shows
that work was in flight at once, not that it ran faster.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

import xpipe  # noqa: E402
from xpipe.devices.executor import Event  # noqa: E402
from xpipe.models import resnet_like  # noqa: E402

ROWS, CHUNKS, STAGES, WARMUP, TIMED = 32, 8, 4, 3, 10
WIDTHS = (16, 32, 64, 128)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, 3, 32, 32, generator=generator), torch.randint(0, 10, (ROWS,), generator=generator)


def median_step(step) -> float:
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(TIMED):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def xla_step(model: torch.nn.Module, forward, device: torch.device):
    """One training step on XLA; the batch starts on xla:0, the labels where the output is."""
    images, labels = batch()
    images, labels = images.to(torch_xla.device(0)), labels.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        F.cross_entropy(forward(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        xm.wait_device_ops()

    return step


def torch_cpu_step(model: torch.nn.Module):
    images, labels = batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def overlap(events: list[Event]) -> tuple[float, float, float]:
    """(busy time summed over devices / time with any device busy, share of busy time
    with two or more devices busy, time with any device busy), from one step's timeline."""
    intervals = []
    for stage in {e.stage for e in events}:
        free = 0.0
        for event in sorted((e for e in events if e.stage == stage), key=lambda e: e.launched):
            start = max(event.launched, free)
            intervals.append((start, max(start, event.ready)))
            free = max(free, event.ready)
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    busy_any = busy_two = 0.0
    running, previous = 0, edges[0][0]
    for moment, change in edges:
        if running >= 1:
            busy_any += moment - previous
        if running >= 2:
            busy_two += (moment - previous) * running
        running, previous = running + change, moment
    total = sum(e - s for s, e in intervals)
    return total / busy_any, busy_two / total, busy_any


def main() -> None:
    from torchgpipe import GPipe

    model = resnet_like(WIDTHS)
    pipe = xpipe.Pipe(copy.deepcopy(model), chunks=CHUNKS, stages=STAGES, executor="devices")
    print(f"model: resnet_like{WIDTHS}, batch {ROWS}x3x32x32, chunks {CHUNKS}, balance {list(pipe.partition.balance)}")

    xpipe_time = median_step(xla_step(pipe, pipe, pipe.devices[-1]))
    xm.wait_device_ops()
    busy, shared, busy_any = overlap(pipe.runner.timeline)

    gpipe = GPipe(copy.deepcopy(model), balance=list(pipe.partition.balance), devices=["cpu"] * STAGES,
                  chunks=CHUNKS, checkpoint="except_last")
    gpipe_time = median_step(torch_cpu_step(gpipe))

    device = torch_xla.device(0)
    single = copy.deepcopy(model).to(device)
    single_time = median_step(xla_step(single, single, device))
    eager_time = median_step(torch_cpu_step(copy.deepcopy(model)))

    print(f"step time, median of {TIMED}:")
    print(f"  xpipe devices executor (4 XLA devices)  {xpipe_time * 1e3:8.1f} ms")
    print(f"  torchgpipe, devices=['cpu'] * 4          {gpipe_time * 1e3:8.1f} ms   "
          f"xpipe / torchgpipe = {xpipe_time / gpipe_time:.2f}")
    print(f"  unpipelined, one XLA device              {single_time * 1e3:8.1f} ms   "
          f"xpipe / unpipelined = {xpipe_time / single_time:.2f}")
    print(f"  unpipelined, eager on the CPU            {eager_time * 1e3:8.1f} ms   "
          f"torchgpipe / eager = {gpipe_time / eager_time:.2f}")
    print(f"overlap of one xpipe step ({len(pipe.runner.timeline)} cells): busy device-time / busy span = "
          f"{busy:.2f}; share of busy time with >= 2 devices busy = {shared:.0%}; some device busy for "
          f"{busy_any * 1e3:.1f} ms of the step")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
