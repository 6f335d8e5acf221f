"""Schedules side by side (issue 13's benchmark): step time relative to GPipe beside
what the table predicts, and activation memory held.

    python tools/bench_schedules.py                    # 8 stages, chunks 16 and 32, V = 2 and 4
    python tools/bench_schedules.py --quick            # chunks 16, V = 2 only
    python tools/bench_schedules.py --executor spmd    # gpipe and circular on a 1 x 8 mesh

One model for every row: an MLP of 32 blocks (width 256, 64 rows per batch), on 8
emulated XLA CPU devices, ``pipe.step`` with mean-squared error, SGD,
checkpoint="never" (so held memory is the schedule's, not recomputation's), 2
warm-up steps then the median of 5 timed steps, each ending when every device is
done. Per row:

- ``measured``: step time / GPipe's step time at the same chunks;
- ``table``: the same ratio as the table predicts on parallel hardware: clocks
  times the length of one cell (1/V of a stage's layers with V model stages per
  device), over GPipe's clocks;
- ``held``: the most bytes one device held at once for backward passes still to
  run (``pipe.runner.peak_held_bytes``), over GPipe's; beside it the table's peak
  in flight over GPipe's, and 1F1B's goal S/M. Under spmd (one program, one
  process of its own) it is the step program's peak device memory from XLA's
  buffer assignment (``xpipe.inspect.audit``), weights included.

On the CPU emulation all 8 "devices" share this machine's cores, so the measured
ratio shows the executor's cost per cell (more, smaller cells cost more host
work), not a real device's idle time; the table ratio is what a TPU would see.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

import xpipe  # noqa: E402
import xpipe.inspect  # noqa: E402
from xpipe.models import mlp_stack  # noqa: E402

STAGES, ROWS, WIDTH = 8, 64, 256


def measure(schedule: str, chunks: int, virtual: int, executor: str, steps: int = 5) -> dict:
    """Median step time and peak held bytes of one schedule."""
    torch.manual_seed(0)
    model = mlp_stack(blocks=32, width=WIDTH, inputs=WIDTH, outputs=WIDTH)
    placement = {"mesh": xpipe.make_mesh(STAGES, 1)} if executor == "spmd" else {"stages": STAGES}
    pipe = xpipe.Pipe(model, chunks=chunks, schedule=schedule, virtual=virtual, loss_fn=F.mse_loss,
                      checkpoint="never", executor=executor, **placement)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    batch, target = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)

    def step() -> None:
        pipe.step(batch, target)
        optimizer.step()
        optimizer.zero_grad()

    first = xpipe.inspect.audit(step) if executor == "spmd" else step()
    times = []
    for index in range(1 + steps):
        start = time.perf_counter()
        step()
        torch_xla.sync()
        xm.wait_device_ops()
        if index >= 1:
            times.append(time.perf_counter() - start)
    table = pipe.schedule
    held = first.peak_bytes if executor == "spmd" else max(pipe.runner.peak_held_bytes)
    return {"schedule": schedule, "chunks": chunks, "virtual": virtual, "seconds": statistics.median(times),
            "cell_clocks": table.clocks / virtual, "held": held, "in_flight": max(table.peak_in_flight) / virtual}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="chunks 16 and V=2 only")
    parser.add_argument("--executor", choices=("devices", "spmd"), default="devices",
                        help="devices (every schedule) or spmd (gpipe and circular); default devices")
    args = parser.parse_args()
    if args.executor == "spmd":
        xpipe.inspect.enable_hlo_dump()  # before the first XLA tensor, for the programs' peak memory
    rounds = (2,) if args.quick else (2, 4)
    rows = []
    for chunks in (16,) if args.quick else (16, 32):
        if args.executor == "spmd":
            configs = [("gpipe", 1)] + [("circular", v) for v in rounds]
        else:
            configs = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
            configs += [(name, v) for v in rounds for name in ("interleaved", "circular")]
        results = [measure(name, chunks, virtual, args.executor) for name, virtual in configs]
        base = results[0]
        for result in results:
            rows.append((result, base))
    print(f"{args.executor} executor, {STAGES} stages on {STAGES} emulated devices, MLP 32 x {WIDTH}, {ROWS} rows, "
          "checkpoint='never'")
    print("| schedule | V | chunks | step s | measured / gpipe | table / gpipe | held / gpipe | "
          "in flight / gpipe | S/M |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for result, base in rows:
        print(f"| {result['schedule']} | {result['virtual']} | {result['chunks']} | {result['seconds']:.3f} | "
              f"{result['seconds'] / base['seconds']:.2f} | {result['cell_clocks'] / base['cell_clocks']:.2f} | "
              f"{result['held'] / base['held']:.3f} | {result['in_flight'] / base['in_flight']:.3f} | "
              f"{STAGES / result['chunks']:.3f} |")


if __name__ == "__main__":
    main()
