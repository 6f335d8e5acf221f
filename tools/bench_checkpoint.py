"""How long ``xpipe.save`` and ``xpipe.load`` take next to ``torch.save`` and
``torch.load`` of the same state, and what they cost the host's memory.

    python tools/bench_checkpoint.py

The 8-block transformer LM (width 256, vocab 256, seq 128) as a Pipe on a
2 (data) x 4 (stage) mesh of 8 emulated devices, after one AdamW step (so the
optimizer has state). Timed, median of 9 after one warm-up each:

- ``torch.save`` of the plain model's state dict (CPU tensors), alone and with
  its AdamW's state dict (the same step taken on the plain model);
- ``torch.distributed.checkpoint.save`` of the same CPU state dicts with DCP's
  own writer (the previous one removed first): the floor of DCP's format (a
  ``torch.save`` record per tensor, the file fsynced), which ``xpipe.save`` writes;
- ``xpipe.save(path, pipe)``: weights only, fetched from the devices, unstacked,
  written with torch.distributed.checkpoint, hashed, renamed into place;
- ``xpipe.save(path, pipe, background=True)``: the time until training may go
  on (the state copied to the host; the files are written by a thread, waited
  for outside the timing);
- ``xpipe.save(path, pipe, optimizer)``: with AdamW's state (three times the
  bytes), beside ``torch.save`` of the plain model's and its AdamW's;
- ``xpipe.load(path, pipe, optimizer)``, beside ``torch.load`` of the same state
  and ``load_state_dict`` into the plain model and its AdamW.

Measured first, the growth of the process's resident memory during blocking
saves and a load (median of 3), beside the checkpoint's tensor bytes: what they
cost the host. On the emulation the devices' memory is the host's too, so a
load's growth includes the new device tensors made while the old ones still
exist, and a save after a load grows from the load's higher resident set. Give
``--blocks 16`` for a checkpoint whose state is large next to what a save reads
at once (one slot of a stacked weight: four blocks per stage), ``--width 1024``
for a large one (1158 MiB of weights and AdamW state).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402

import xpipe  # noqa: E402
from xpipe._host_memory import PeakResident  # noqa: E402
from xpipe.models import transformer_lm  # noqa: E402


def median_seconds(action, repeats: int = 9) -> float:
    """Median wall time of ``action()``; what it returns (a background save's
    future) is waited for after the clock stops."""
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pending = action()
        times.append(time.perf_counter() - start)
        if isinstance(pending, Future):
            pending.result()
    return statistics.median(times)


def growth_during(action, repeats: int = 3) -> int:
    """Median growth of resident memory over ``repeats`` runs of ``action()``."""
    growths = []
    for _ in range(repeats):
        with PeakResident() as peak:
            action()
        growths.append(peak.growth)
    return int(statistics.median(growths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="the LM's width (default 256: 24.7 MiB of weights)")
    parser.add_argument("--blocks", type=int, default=8)
    options = parser.parse_args()
    model = transformer_lm(blocks=options.blocks, width=options.width, heads=4, seq=128, vocab=256)
    plain = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=8, mesh=xpipe.make_mesh(4, 2),
                      loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    optimizer = torch.optim.AdamW(pipe.parameters())
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    tokens = torch.randint(0, 256, (16, 129))
    pipe.step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    torch_xla.sync()
    F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    plain_optimizer.step()
    weight_bytes = sum(v.numel() * v.element_size() for v in plain.state_dict().values())
    everything_bytes = 3 * weight_bytes  # the weights and AdamW's two states

    def plain_state():
        return {"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict()}

    def plain_load(file: Path) -> None:
        state = torch.load(file)
        plain.load_state_dict(state["model"])
        plain_optimizer.load_state_dict(state["optimizer"])

    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)

        def dcp_save(state) -> None:
            """DCP's save into a fresh directory, the previous one removed first (as
            ``xpipe.save`` removes the checkpoint it replaces)."""
            shutil.rmtree(directory / "dcp", ignore_errors=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP's warning for a save without a process group
                # No copy-ahead: it looks for an accelerator's streams, which torch_xla's module lacks.
                dcp.save(state, storage_writer=dcp.FileSystemWriter(directory / "dcp", per_thread_copy_ahead=0),
                         no_dist=True)

        xpipe.save(directory / "all", pipe, optimizer, step=1)  # compiles the slot programs of a first save
        growths = [
            ("xpipe.save(path, pipe)", growth_during(lambda: xpipe.save(directory / "weights", pipe)), weight_bytes),
            ("xpipe.save(path, pipe, optimizer)",
             growth_during(lambda: xpipe.save(directory / "all", pipe, optimizer, step=1)), everything_bytes),
            ("xpipe.load(path, pipe, optimizer)",
             growth_during(lambda: xpipe.load(directory / "all", pipe, optimizer)), everything_bytes),
        ]
        saves = [
            ("torch.save(plain.state_dict())", median_seconds(lambda: torch.save(plain.state_dict(),
                                                                                 directory / "plain.pt")), None),
            ("dcp.save(plain.state_dict())", median_seconds(lambda: dcp_save(plain.state_dict())), 0),
            ("xpipe.save(path, pipe)", median_seconds(lambda: xpipe.save(directory / "weights", pipe)), 0),
            ("xpipe.save(path, pipe, background=True)",
             median_seconds(lambda: xpipe.save(directory / "background", pipe, background=True)), 0),
            ("torch.save(plain model + AdamW state)",
             median_seconds(lambda: torch.save(plain_state(), directory / "all.pt")), None),
            ("dcp.save(plain model + AdamW state)", median_seconds(lambda: dcp_save(plain_state())), 4),
            ("xpipe.save(path, pipe, optimizer)",
             median_seconds(lambda: xpipe.save(directory / "all", pipe, optimizer, step=1)), 4),
            ("torch.load + load_state_dict (plain model + AdamW)",
             median_seconds(lambda: plain_load(directory / "all.pt")), None),
            ("xpipe.load(path, pipe, optimizer)",
             median_seconds(lambda: xpipe.load(directory / "all", pipe, optimizer)), 7),
        ]
    print(f"model state: {weight_bytes / 2**20:.1f} MiB (with AdamW's state: {everything_bytes / 2**20:.1f} MiB)")
    print("| what | seconds | / torch's of the same state |")
    print("| --- | --- | --- |")
    for name, seconds, against in saves:
        ratio = "" if against is None else f"{seconds / saves[against][1]:.2f}"
        print(f"| {name} | {seconds:.3f} | {ratio} |")
    print("| resident growth during | MiB (median of 3) | / the checkpoint's tensor bytes |")
    print("| --- | --- | --- |")
    for name, growth, size in growths:
        print(f"| {name} | {growth / 2**20:.1f} | {growth / size:.2f} |")


if __name__ == "__main__":
    main()
