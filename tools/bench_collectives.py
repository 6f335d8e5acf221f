"""Peak device memory of xpipe.collectives' all_gather and reduce_scatter (issue 7),
beside the plain XLA forms of the same operation.

    python tools/bench_collectives.py

A float32 tensor stacked over an 8-position axis (8 emulated devices, one per
position), each device holding 16 MiB. Peak memory per device comes from the
buffer assignment XLA writes for the compiled program (``xpipe.inspect.audit``):
- all-gather (output 128 MiB, input 16 MiB): ``collectives.all_gather``; the plain
  XLA all-gather (resharding the tensor to replicated); and the emulation by
  padding plus all-reduce (each device writes its shard into zeros, then sums);
- reduce-scatter (input 16 MiB, output 2 MiB): ``collectives.reduce_scatter`` (a
  ring of collective-permutes) and sum-then-slice (what the partitioner makes an
  all-reduce plus a slice).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import xpipe.inspect  # noqa: E402

xpipe.inspect.enable_hlo_dump()

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

from xpipe import collectives  # noqa: E402
from xpipe.mesh import make_mesh, spmd_device  # noqa: E402

MiB = 2**20
POSITIONS, SHARD = 8, 4 * MiB  # float32 elements per device: 16 MiB


def on_mesh(tensor: torch.Tensor, mesh, spec: tuple) -> torch.Tensor:
    tensor = tensor.to(spmd_device())
    xs.mark_sharding(tensor, mesh, spec)
    torch_xla.sync()
    return tensor


def report(name: str, step, bound: int) -> None:
    audited = xpipe.inspect.audit(step)
    kinds = ", ".join(f"{kind} x{audited.count(kind)}" for kind in xpipe.inspect.KINDS if audited.count(kind))
    print(f"  {name:<34} peak {audited.peak_bytes / MiB:7.1f} MiB = {audited.peak_bytes / bound:.3f} x "
          f"(output + input)   [{kinds}]")


def main() -> None:
    mesh = make_mesh(POSITIONS)
    shards = on_mesh(torch.ones(POSITIONS, SHARD), mesh, ("stage", None))

    def plain_all_gather():
        whole = shards * 1
        xs.mark_sharding(whole, mesh, (None, None))
        return whole

    def padded_all_reduce():
        mine = torch.arange(POSITIONS, device=shards.device).view(-1, 1, 1) == torch.arange(
            POSITIONS, device=shards.device).view(1, -1, 1)
        placed = torch.where(mine, shards.unsqueeze(1), 0.0)  # [position, where in the whole, shard]
        summed = placed.sum(0, keepdim=True).expand(POSITIONS, POSITIONS, SHARD)
        xs.mark_sharding(summed, mesh, ("stage", None, None))
        return summed

    print("all-gather, output 128 MiB + input 16 MiB per device:")
    bound = (POSITIONS + 1) * SHARD * 4
    report("collectives.all_gather", lambda: collectives.all_gather(shards, 1, mesh=mesh), bound)
    report("plain XLA all-gather (replicate)", plain_all_gather, bound)
    report("padding + all-reduce", padded_all_reduce, bound)

    def sum_then_slice():
        piece = shards.sum(0).view(POSITIONS, SHARD // POSITIONS)
        xs.mark_sharding(piece, mesh, ("stage", None))
        return piece

    print("reduce-scatter, input 16 MiB + output 2 MiB per device:")
    bound = SHARD * 4 + SHARD * 4 // POSITIONS
    report("collectives.reduce_scatter", lambda: collectives.reduce_scatter(shards, 1, mesh=mesh), bound)
    report("sum then slice", sum_then_slice, bound)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
