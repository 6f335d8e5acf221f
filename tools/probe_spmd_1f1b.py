"""Could the SPMD clock loop run 1F1B? A probe of what it would need (issue 13).

    python tools/probe_spmd_1f1b.py

1F1B runs a microbatch's backward before the last microbatch's forward, so its
clock loop would run the backward itself: a manual VJP of the stage inside the
scan body, the loss on the last stage. Under SPMD every device runs one program:
in a clock where some stages run a forward and others a backward, every device
computes both and keeps one (GSPMD has no per-device branch). On the 2 (data) x
4 (stage) mesh, with the executor's own pieces (``torch.vmap`` over the devices
axis, ``collectives.shift``, ``torch_xla.experimental.scan``), this prints:

1. whether ``torch.func.vjp`` traces and runs inside the scan body under SPMD,
   and how far its weight gradient is from autograd's outside any loop;
2. the step time of GPipe's shape (``M + S - 1`` forward clocks, then scan's own
   backward) and of 1F1B's shape under SPMD (``2 (M + S - 1)`` clocks, each a
   forward and a VJP on every device), same blocks and rows, and their ratio;
   for each, the collectives of the compiled step and its peak device memory
   (XLA's buffer assignment, ``xpipe.inspect.audit``).

On the CPU emulation the 8 devices share this machine's cores, so times measure
total work, which is what a compute-bound TPU step would pay too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.scan import scan  # noqa: E402

import xpipe  # noqa: E402
from xpipe.collectives import shift  # noqa: E402
import xpipe.inspect  # noqa: E402
from xpipe.mesh import spmd_device  # noqa: E402

STAGES, DATA, BLOCKS, WIDTH, ROWS, CHUNKS = 4, 2, 2, 256, 32, 8
DEVICES = STAGES * DATA
CLOCKS = CHUNKS + STAGES - 1


def stage(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One stage's residual MLP blocks: ``[K, W, W]``, ``[rows, W] -> [rows, W]``."""
    for block in range(weights.shape[0]):
        x = x + torch.tanh(x @ weights[block])
    return x


def sharded(x: torch.Tensor, mesh) -> torch.Tensor:
    xs.mark_sharding(x, mesh, (("stage", "data"), *([None] * (x.dim() - 1))))
    return x


def first_stage_mask(like: torch.Tensor) -> torch.Tensor:
    device = torch.arange(DEVICES, device=like.device)
    return (device < DATA).view(-1, *[1] * (like.dim() - 1))


def gpipe_step(weights: torch.Tensor, inputs: torch.Tensor, mesh) -> torch.Tensor:
    """Forward clocks in scan, the backward by autograd through it (scan's own)."""

    def tick(carry, x):
        state, w = carry
        state = torch.vmap(stage)(w, torch.where(first_stage_mask(state), x, shift(state, DATA)))
        return (state, w), state

    start = sharded(torch.zeros(DEVICES, ROWS, WIDTH, device=inputs.device), mesh)
    _, outputs = scan(tick, (start, weights), inputs)
    loss = outputs.square().mean()
    loss.backward()
    return loss


def one_f_one_b_shaped_step(weights: torch.Tensor, inputs: torch.Tensor, mesh) -> torch.Tensor:
    """``2 (M + S - 1)`` clocks; in each, every device runs a forward and a VJP, as
    a 1F1B clock loop under SPMD must (the data flow is simplified: this measures
    the cost of the clocks, not the schedule's bookkeeping)."""

    def tick(carry, x):
        state, upstream, stash, gradient, w = carry
        entering = torch.where(first_stage_mask(state), x, shift(state, DATA))
        output = torch.vmap(stage)(w, entering)
        _, pullback = torch.func.vjp(lambda w_, s_: torch.vmap(stage)(w_, s_), w, stash)
        weight_grad, input_grad = pullback(upstream)
        return (output, shift(input_grad, -DATA), entering, gradient + weight_grad, w), None

    zeros = sharded(torch.zeros(DEVICES, ROWS, WIDTH, device=inputs.device), mesh)
    carry = (zeros, zeros + 1e-3, zeros.clone(), torch.zeros_like(weights), weights)
    with torch.no_grad():
        carry, _ = scan(tick, carry, torch.cat([inputs, inputs]))
    return carry[3].sum()


def vjp_in_scan_error(mesh, device) -> float:
    """Largest difference between the weight gradient a VJP in the scan body sums over
    clocks and autograd's of the same sum, outside any loop, relative to the largest
    gradient."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(DEVICES, BLOCKS, WIDTH, WIDTH, generator=generator) / WIDTH ** 0.5
    xs_, gs = (torch.randn(4, DEVICES, ROWS, WIDTH, generator=generator) for _ in range(2))

    def tick(carry, column):
        total, w = carry
        x, g = column
        _, pullback = torch.func.vjp(lambda w_: torch.vmap(stage)(w_, x), w)
        return (total + pullback(g)[0], w), None

    w = sharded(weights.to(device), mesh)
    with torch.no_grad():
        (total, _), _ = scan(tick, (torch.zeros_like(w), w), (xs_.to(device), gs.to(device)))
    expected = weights.clone().requires_grad_()
    sum((torch.vmap(stage)(expected, x) * g).sum() for x, g in zip(xs_, gs)).backward()
    return ((total.cpu() - expected.grad).abs().max() / expected.grad.abs().max()).item()


def timed(step, weights: torch.Tensor, inputs: torch.Tensor, mesh,
          repeats: int = 5) -> tuple[float, xpipe.inspect.CommunicationReport]:
    """The median step time after the first, and the audit of the first (which compiles)."""
    report = xpipe.inspect.audit(lambda: step(weights, inputs, mesh))
    times = []
    for _ in range(repeats):
        weights.grad = None
        start = time.perf_counter()
        result = step(weights, inputs, mesh)
        torch_xla.sync()
        result.item()
        times.append(time.perf_counter() - start)
    return statistics.median(times), report


def described(report: xpipe.inspect.CommunicationReport) -> str:
    kinds = {kind: report.count(kind) for kind in xpipe.inspect.KINDS if report.count(kind)}
    return f"collectives {kinds}, peak {report.peak_bytes / 2**20:.1f} MiB per device"


def main() -> None:
    xpipe.inspect.enable_hlo_dump()  # before the first XLA tensor
    mesh = xpipe.make_mesh(STAGES, DATA)
    device = spmd_device()
    print(f"1. vjp inside scan under SPMD: max |difference| from autograd {vjp_in_scan_error(mesh, device):.1e} "
          "of the largest gradient")
    generator = torch.Generator().manual_seed(1)
    weights = sharded((torch.randn(DEVICES, BLOCKS, WIDTH, WIDTH, generator=generator) / WIDTH ** 0.5)
                      .to(device).requires_grad_(), mesh)
    inputs = torch.randn(CLOCKS, DEVICES, ROWS, WIDTH, generator=generator).to(device)
    gpipe, gpipe_report = timed(gpipe_step, weights, inputs, mesh)
    one_f_one_b, one_f_one_b_report = timed(one_f_one_b_shaped_step, weights.detach(), inputs, mesh)
    print(f"2. S={STAGES}, M={CHUNKS}, {BLOCKS} blocks of width {WIDTH} per stage, {ROWS} rows per device:")
    print(f"   GPipe's shape ({CLOCKS} forward clocks + scan's backward): {gpipe * 1e3:.1f} ms; "
          f"{described(gpipe_report)}")
    print(f"   1F1B's shape under SPMD ({2 * CLOCKS} clocks of forward + VJP): {one_f_one_b * 1e3:.1f} ms; "
          f"{described(one_f_one_b_report)}")
    print(f"   time ratio {one_f_one_b / gpipe:.2f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
