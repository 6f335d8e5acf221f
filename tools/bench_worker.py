"""One row of ``tools/bench.py`` in a process of its own (or one rank of it): builds the
row's model and step, then answers the controller's commands on stdin, one reply
line each (``REPLY``). The controller runs it as ``python tools/bench_worker.py ROW``,
the row as JSON; the rows and the constants both sides read are defined here."""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from dataclasses import dataclass

STAGES = 4
SCHEDULES_SPMD = ("gpipe", "circular")
SCHEDULES_DEVICES = ("gpipe", "1f1b", "zb-h1", "interleaved", "circular")
VIRTUAL = {"interleaved": 2, "circular": 2}  # model stages per device (pippy: per rank)
SCHEDULES_PIPPY = ("gpipe", "1f1b", "interleaved")
# --smoke keeps the rows the peer ratios need: every engine runs, each schedule's own
# equivalence is the test suite's business, not the benchmark's.
SMOKE_SCHEDULES = {"xpipe-spmd": ("gpipe",), "xpipe-devices": ("1f1b",), "pippy": ("1f1b",)}
BASELINE_OF = {"xpipe-spmd": "spmd-dp", "xpipe-devices": "xla", "pippy": "eager", "torchgpipe": "eager"}
DEVICES_OF = {"xpipe-spmd": 8, "spmd-dp": 8, "xpipe-devices": STAGES, "xla": 1}
LOSS_RTOL = 1e-3  # XLA's CPU kernels and eager PyTorch's round differently; N steps of SGD amplify it


@dataclass(frozen=True)
class Row:
    """One configuration to measure."""

    engine: str  # xpipe-spmd, xpipe-devices, pippy, torchgpipe, eager, xla, spmd-dp
    schedule: str  # gpipe, 1f1b, zb-h1, interleaved, circular; "-" for the unpipelined rows
    model: str  # lm or cnn
    chunks: int
    size: str  # full or smoke

    @property
    def name(self) -> str:
        engine = {"pippy": "torch.distributed.pipelining", "eager": "unpipelined eager CPU",
                  "xla": "unpipelined 1 XLA device", "spmd-dp": "unpipelined SPMD data-parallel x8"}.get(
            self.engine, self.engine)
        return engine if self.schedule == "-" else f"{engine} {self.schedule}"


REPLY = "xpipe-bench-reply "  # marks the worker's answers among whatever else it prints


# ---------------------------------------------------------------------------------------------
# Models and batches: built the same way in every worker (seeded), on the CPU.


def build_model(row: Row):
    """The model (untied weights, seeded) and, for the engines that split by layer, its layers in order."""
    from torch import nn

    from xpipe.models import resnet_like, transformer_lm

    if row.model == "lm":
        width, seq = (256, 128) if row.size == "full" else (32, 16)
        model = transformer_lm(blocks=8, width=width, heads=4, seq=seq, vocab=256, tie_weights=False)
        layers = [model.embed, *model.blocks, model.norm, model.head]
    else:
        model = resnet_like((16, 32, 64, 128) if row.size == "full" else (8, 8, 16, 16))
        layers = list(model)
    return model, nn.Sequential(*layers)


def batch(row: Row):
    """Two rows per microbatch: ``(inputs, targets)``."""
    import torch

    generator = torch.Generator().manual_seed(2)
    rows = 2 * row.chunks
    if row.model == "lm":
        seq = 128 if row.size == "full" else 16
        tokens = torch.randint(0, 256, (rows, seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    side = 32 if row.size == "full" else 16
    return torch.randn(rows, 3, side, side, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def loss_fn(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def balance(row: Row, parts: int) -> list[int]:
    """xpipe's partition of the model into ``parts`` (by parameters), used by every engine."""
    import xpipe

    model, _ = build_model(row)
    return list(xpipe.partition(model, parts).balance)


# ---------------------------------------------------------------------------------------------
# Workers: build the row's step, then answer the controller's commands.


def worker(row: Row) -> None:
    """Serve one row (or one rank of it): ``step`` (one training step; replies its loss,
    or None on a rank without the loss), ``report`` (its counters), ``quit``."""
    if row.engine in ("xpipe-spmd", "spmd-dp"):
        import xpipe.inspect

        xpipe.inspect.enable_hlo_dump()  # before the XLA runtime starts
    step, report = make_step(row)
    reply({"ready": True})
    audited: dict = {}
    for command in sys.stdin:
        command = command.strip()
        if command == "step":
            if row.engine == "xpipe-spmd" and not audited:
                audited = audit(step)  # the first step, which compiles the program audited
                loss = audited.pop("loss")
            else:
                loss = step()
            reply({"loss": loss})
        elif command == "report":
            reply({**report(), **audited})
        else:
            break


def reply(message: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()


def audit(step) -> dict:
    """Run ``step`` (a first, compiling one) under xpipe.inspect.audit: its loss and the
    collectives of the program it compiled, counted per kind."""
    import xpipe.inspect

    outcome = {}
    report = xpipe.inspect.audit(lambda: outcome.setdefault("loss", step()))
    kinds = ("collective-permute", "all-reduce", "all-gather", "all-to-all", "reduce-scatter")
    return {**outcome, "collectives": {kind: report.count(kind) for kind in kinds if report.count(kind)}}


def make_step(row: Row):
    """``(step, report)``: one training step returning its loss, and the row's counters."""
    if row.engine == "pippy":
        return pippy_step(row)
    import torch

    model, layers = build_model(row)
    inputs, targets = batch(row)
    if row.engine in ("eager", "torchgpipe"):
        if row.engine == "torchgpipe":
            from torchgpipe import GPipe

            model = GPipe(layers, balance=balance(row, STAGES), devices=["cpu"] * STAGES, chunks=row.chunks,
                          checkpoint="never")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def eager_step() -> float:
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        return eager_step, host_report
    return xla_step(row, model, inputs, targets)


def xla_step(row: Row, model, inputs, targets):
    import torch
    import torch_xla
    import torch_xla.debug.metrics as metrics

    import xpipe

    if row.engine == "xpipe-spmd":
        pipe = xpipe.Pipe(model, chunks=row.chunks, mesh=xpipe.make_mesh(STAGES, 2), loss_fn=loss_fn,
                          checkpoint="never", schedule=row.schedule, virtual=VIRTUAL.get(row.schedule, 1))
    elif row.engine == "xpipe-devices":
        pipe = xpipe.Pipe(model, chunks=row.chunks, stages=STAGES, executor="devices", schedule=row.schedule,
                          virtual=VIRTUAL.get(row.schedule, 1), loss_fn=loss_fn, checkpoint="never")
    else:
        pipe = None
    if pipe is not None:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

        def run() -> torch.Tensor:
            return pipe.step(inputs, targets)
    else:
        if row.engine == "spmd-dp":
            import torch_xla.runtime as xr

            xr.use_spmd()
        device = torch_xla.device()
        model.to(device)
        placed_inputs, placed_targets = inputs.to(device), targets.to(device)
        if row.engine == "spmd-dp":
            mark_data_parallel(model, placed_inputs, placed_targets)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> torch.Tensor:
            loss = loss_fn(model(placed_inputs), placed_targets)
            loss.backward()
            return loss

    def step() -> float:
        loss = run()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        return loss.item()

    def report() -> dict:
        return {**host_report(), "compiles": metrics.metric_data("CompileTime")[0],
                "device_peak_mb": device_peak_mb(pipe.devices if pipe is not None else [torch_xla.device()])}

    return step, report


def mark_data_parallel(model, inputs, targets) -> None:
    """The unpipelined model data-parallel over all 8 devices: weights replicated, the batch sharded."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    for tensor in model.parameters():
        xs.mark_sharding(tensor, mesh, (None,) * tensor.dim())
    for tensor in (inputs, targets):
        xs.mark_sharding(tensor, mesh, ("data",) + (None,) * (tensor.dim() - 1))


def device_peak_mb(devices) -> float | None:
    """The largest peak memory XLA reports over ``devices``; None where it reports none (CPU)."""
    import torch_xla.core.xla_model as xm

    peaks = []
    for device in devices:
        try:
            info = xm.get_memory_info(device)
        except (RuntimeError, NotImplementedError):
            return None
        peak = info.get("peak_bytes_used") or info.get("bytes_used")
        if peak is None:
            return None
        peaks.append(peak / 2**20)
    return max(peaks)


def host_report() -> dict:
    return {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def pippy_step(row: Row):
    """torch.distributed.pipelining, this process's rank of it; every rank gets the
    controller's commands, and the last one reports the loss."""
    import atexit

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from torch.distributed.pipelining.stage import _PipelineStageBase

    # PyTorch 2.9 warms up each stage's links by sending an int64 and receiving a float32;
    # gloo requires matching sizes and aborts the process. gloo needs no warm-up.
    _PipelineStageBase._get_init_p2p_neighbors_ops = lambda self: []
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=os.environ["XPIPE_BENCH_INIT"])
    atexit.register(dist.destroy_process_group)
    _, layers = build_model(row)
    inputs, targets = batch(row)
    virtual = VIRTUAL.get(row.schedule, 1)
    parts = split(layers, balance(row, world * virtual))
    mine = [rank + world * v for v in range(virtual)]
    stages = [PipelineStage(parts[index], index, world * virtual, torch.device("cpu")) for index in mine]
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[row.schedule]
    schedule = kind(stages if virtual > 1 else stages[0], n_microbatches=row.chunks, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for index in mine for p in parts[index].parameters()], lr=0.01)

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().item() if losses else None

    return step, host_report


def split(layers, balance: list[int]) -> list:
    """``layers`` (an ``nn.Sequential``) cut into consecutive pieces of ``balance`` layers."""
    from torch import nn

    pieces, start = [], 0
    for count in balance:
        pieces.append(nn.Sequential(*list(layers)[start:start + count]))
        start += count
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description="serve one row of tools/bench.py (the controller starts it)")
    parser.add_argument("row", help="the row as JSON: engine, schedule, model, chunks, size")
    worker(Row(**json.loads(parser.parse_args().row)))


if __name__ == "__main__":
    main()
