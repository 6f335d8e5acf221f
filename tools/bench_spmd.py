"""SPMD executor figures on 8 emulated devices (issue 3's benchmark).

    python tools/bench_spmd.py

Prints:
1. compile cost of the step at chunks=32 over chunks=4 (same microbatch size):
   XLA compile time, and the whole first step (tracing the clock loop included);
2. step time of the pipeline (2 data x 4 stages, chunks=8) over the same model
   trained data-parallel on the same 8 devices, beside the ratio the bubble
   predicts, (chunks + stages - 1) / chunks;
3. parameter bytes held by one device, pipeline vs data-parallel;
4. peak device memory of the step (XLA's buffer assignment) with
   checkpoint="always" vs "never".

On the CPU emulation the 8 "devices" share this machine's cores, so times
measure total work and overhead, not parallel speed-up.
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
import torch_xla.debug.metrics as metrics  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

import xpipe  # noqa: E402
import xpipe.inspect  # noqa: E402
from xpipe.models import transformer_lm  # noqa: E402

xpipe.inspect.enable_hlo_dump()
DATA, STAGES, ROWS_PER_MICROBATCH = 2, 4, 4
VOCAB, SEQ = 256, 64


def model() -> torch.nn.Module:
    return transformer_lm(blocks=8, width=128, heads=4, seq=SEQ, vocab=VOCAB)


def batch(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (chunks * ROWS_PER_MICROBATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def compile_seconds() -> float:
    data = metrics.metric_data("CompileTime")
    return 0.0 if data is None else data[1] / 1e9


def train_step(run, tokens, targets, optimizer) -> None:
    logits = run(tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten().to(torch_xla.device())).backward()
    optimizer.step()
    optimizer.zero_grad()
    torch_xla.sync()


def timed_steps(run, parameters, chunks: int, steps: int = 5) -> tuple[float, float, float]:
    """(first step wall time, its XLA compile time, median later step time)."""
    tokens, targets = batch(chunks)
    optimizer = torch.optim.SGD(parameters, lr=0.01)
    compiled, start = compile_seconds(), time.perf_counter()
    train_step(run, tokens, targets, optimizer)
    first, compile_time = time.perf_counter() - start, compile_seconds() - compiled
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(run, tokens, targets, optimizer)
        torch_xla._XLAC._xla_wait_device_ops([])
        times.append(time.perf_counter() - start)
    return first, compile_time, statistics.median(times) if times else float("nan")


def bytes_on_device_zero(parameters) -> int:
    total = 0
    for parameter in parameters:
        shard, _device = torch_xla._XLAC._get_local_shards([parameter])[0][0]
        total += shard.numel() * shard.element_size()
    return total


def data_parallel(mesh) -> tuple[torch.nn.Module, object]:
    replica = model().to(torch_xla.device())
    replica.head.weight = replica.embed.tokens.weight  # .to() unties them
    for parameter in replica.parameters():  # replicated from the start: no second compile
        xs.mark_sharding(parameter, mesh, (None,) * parameter.dim())

    def run(tokens):
        tokens = tokens.to(torch_xla.device())
        xs.mark_sharding(tokens, mesh, (("stage", "data"), None))  # rows over the whole mesh
        return replica(tokens)

    return replica, run


def main() -> None:
    mesh = xpipe.make_mesh(STAGES, DATA)
    results = {}
    for chunks in (4, 32):
        pipe = xpipe.Pipe(model(), chunks=chunks, mesh=mesh, checkpoint="never")
        results[chunks] = timed_steps(pipe, pipe.parameters(), chunks)
    print(f"1. chunks=32 / chunks=4: XLA compile {results[32][1]:.2f} s / {results[4][1]:.2f} s = "
          f"{results[32][1] / results[4][1]:.2f}; first step {results[32][0]:.1f} s / {results[4][0]:.1f} s = "
          f"{results[32][0] / results[4][0]:.2f}")

    chunks = 8
    pipe = xpipe.Pipe(model(), chunks=chunks, mesh=mesh, checkpoint="never")
    pipeline_step = timed_steps(pipe, pipe.parameters(), chunks)[2]
    replica, run = data_parallel(mesh)
    dp_step = timed_steps(run, replica.parameters(), chunks)[2]
    predicted = (chunks + STAGES - 1) / chunks
    print(f"2. step time, pipeline {pipeline_step * 1e3:.0f} ms / data-parallel {dp_step * 1e3:.0f} ms = "
          f"{pipeline_step / dp_step:.2f} (bubble predicts {predicted:.2f})")

    body = sum(w.numel() * w.element_size() for w in pipe.runner.body.weights)
    print(f"3. parameter bytes on one device: pipeline {bytes_on_device_zero(pipe.parameters()):,} "
          f"(body {body:,} / {STAGES} stages = {body // STAGES:,}), data-parallel "
          f"{bytes_on_device_zero(replica.parameters()):,}")

    peaks = {}
    chunks = 16  # a step not compiled above, so that both programs are new
    for checkpoint in ("always", "except_last", "never"):
        pipe = xpipe.Pipe(model(), chunks=chunks, mesh=mesh, checkpoint=checkpoint)
        first_step = xpipe.inspect.audit(lambda: timed_steps(pipe, pipe.parameters(), chunks, steps=0))
        peaks[checkpoint] = first_step.peak_bytes
    print(f"4. peak device memory of the step (chunks={chunks}): " + ", ".join(
        f"checkpoint={mode!r} {peak:,} B" for mode, peak in peaks.items())
        + f"; always / never = {peaks['always'] / peaks['never']:.2f}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
