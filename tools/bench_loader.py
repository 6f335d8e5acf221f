"""Loader throughput: xpipe's MpDeviceLoader (with and without stacking) against torch_xla's.

    python tools/bench_loader.py

Each loader moves the same 1,024 host batches of [32, 512] int64 tokens to an
emulated XLA device; throughput is host batches per second (median of 3 passes,
after one warm-up pass).
Goal (issue 4): stacking 16 batches per step costs nothing visible (ratio >= 1.0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.parallel_loader as torch_xla_loader  # noqa: E402

from xpipe.data import MpDeviceLoader  # noqa: E402

BATCHES, SHAPE = 1024, (32, 512)


def batches_per_second(make_loader) -> float:
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        count = 0
        for batch in make_loader():
            count += batch.shape[0] if batch.dim() == 3 else 1
        torch_xla._XLAC._xla_wait_device_ops([])
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    data = [torch.randint(0, 50_000, SHAPE) for _ in range(BATCHES)]
    device = torch_xla.device()
    batches_per_second(lambda: torch_xla_loader.MpDeviceLoader(data, device))  # warm-up: first transfers
    baseline = batches_per_second(lambda: torch_xla_loader.MpDeviceLoader(data, device))
    plain = batches_per_second(lambda: MpDeviceLoader(data, device))
    stacked = batches_per_second(lambda: MpDeviceLoader(data, device, accumulation_dim=0, accumulation_size=16,
                                                        batch_dim=1))
    print(f"torch_xla MpDeviceLoader:            {baseline:8.0f} batches/s")
    print(f"xpipe MpDeviceLoader, no stacking:   {plain:8.0f} batches/s ({plain / baseline:.2f}x)")
    print(f"xpipe MpDeviceLoader, 16 per stack:  {stacked:8.0f} batches/s ({stacked / baseline:.2f}x)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
