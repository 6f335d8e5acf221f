"""1F1B against GPipe under the spmd executor: step time, compute and XLA's peak.

    python tools/bench_spmd_1f1b.py                 # chunks 8 and 32
    python tools/bench_spmd_1f1b.py --chunks 16
    python tools/bench_spmd_1f1b.py --checkpoint never   # both schedules keep every activation

On the 4 (stage) x 2 (data) mesh of 8 emulated devices, xpipe's transformer LM of
16 blocks (width 64, 4 heads, 64 tokens, vocabulary 64; 4 blocks a stage), four rows
a device per microbatch (1F1B cuts the exiting microbatch into a row a stage for the
layers after the body), the batch sharded as a loader gives it, ``pipe.step`` with
``checkpoint="always"`` (or ``--checkpoint never``, both schedules). For each schedule and chunk count it prints
the median of 5 steps after the first, the matrix products' floating-point
operations on one device (``xpipe.inspect.matmul_flops``: the optimized program's
dots, each loop body's times its trip count), the kernels one device launches and
the bytes they write (``xpipe.inspect.kernels``, counted alike) and XLA's peak per
device, then each 1F1B figure over GPipe's. The emulated devices share this
machine's cores, so a step's time measures its total work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import xpipe  # noqa: E402
import xpipe.inspect  # noqa: E402

DUMP = xpipe.inspect.enable_hlo_dump()  # before the XLA runtime starts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

from xpipe._xla import wait_device_ops  # noqa: E402
from xpipe.models import transformer_lm  # noqa: E402

STAGES, DATA, ROWS, SEQ, VOCAB = 4, 2, 4, 64, 64  # the model of tests/spmd/test_one_f_one_b.py's audit


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


lm_loss.reduction, lm_loss.ignore_index = "mean", -100


def measure(schedule: str, chunks: int, steps: int, checkpoint: str) -> tuple[float, int, int, int, int]:
    """(median step seconds, matmul FLOPs, kernel launches and the bytes they write on
    one device, XLA's peak bytes per device)."""
    model = transformer_lm(blocks=16, width=64, heads=4, seq=SEQ, vocab=VOCAB)
    pipe = xpipe.Pipe(model, chunks=chunks, mesh=xpipe.make_mesh(STAGES, DATA), schedule=schedule,
                      checkpoint=checkpoint, loss_fn=lm_loss)
    ids = torch.randint(0, VOCAB, (chunks * DATA * ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    ids = ids.to(torch_xla.device())
    xs.mark_sharding(ids, pipe.mesh, (pipe.runner.placement.batch_axes, None))
    report = xpipe.inspect.audit(lambda: pipe.step(ids, ids), mesh=pipe.mesh)
    times = []
    for _ in range(steps):
        pipe.zero_grad(set_to_none=True)  # each step the audited program: no gradient added to the last one's
        start = time.perf_counter()
        pipe.step(ids, ids)
        torch_xla.sync()  # the loss and every gradient
        wait_device_ops()
        times.append(time.perf_counter() - start)
    launched = xpipe.inspect.kernels(Path(report.program).read_text())
    return statistics.median(times), report.matmul_flops, launched.launches, launched.bytes_written, report.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, action="append", help="microbatches a step (8 and 32 by default)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first (median)")
    parser.add_argument("--checkpoint", choices=("always", "never"), default="always",
                        help="both schedules' recomputation (default: always)")
    args = parser.parse_args()
    print("| schedule | chunks | step s | matmul GFLOP / device | kernels / device | GB written / device | "
          "peak MiB / device | 1f1b / gpipe: time | FLOPs | kernels | written | peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for chunks in args.chunks or (8, 32):
        figures = {schedule: measure(schedule, chunks, args.steps, args.checkpoint) for schedule in ("gpipe", "1f1b")}
        for schedule, (seconds, flops, launches, written, peak) in figures.items():
            ratios = " | | | | |" if schedule == "gpipe" else "".join(
                f" {mine / theirs:.2f} |" for mine, theirs in zip(figures["1f1b"], figures["gpipe"]))
            print(f"| {schedule} | {chunks} | {seconds:.3f} | {flops / 1e9:.2f} | {launches} | {written / 1e9:.3f} | "
                  f"{peak / 2**20:.2f} |{ratios}", flush=True)


if __name__ == "__main__":
    main()
