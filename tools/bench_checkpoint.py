"""How long ``xpipe.save`` takes next to ``torch.save`` of the plain model's state dict.

    python tools/bench_checkpoint.py

The 8-block transformer LM (width 256, vocab 256, seq 128) as a Pipe on a
2 (data) x 4 (stage) mesh of 8 emulated devices, after one AdamW step (so the
optimizer has state). Timed, median of 9 after one warm-up each:

- ``torch.save`` of the plain model's state dict (weights only, CPU tensors);
- ``xpipe.save(path, pipe)``: weights only, fetched from the devices, unstacked,
  written with torch.distributed.checkpoint, hashed, renamed into place;
- ``xpipe.save(path, pipe, background=True)``: the time until training may go
  on (the state copied to the host; the files are written by a thread, waited
  for outside the timing);
- ``xpipe.save(path, pipe, optimizer)``: with AdamW's state (three times the
  bytes), for scale.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402

import xpipe  # noqa: E402
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
        if pending is not None:
            pending.result()
    return statistics.median(times)


def main() -> None:
    model = transformer_lm(blocks=8, width=256, heads=4, seq=128, vocab=256)
    plain = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=8, mesh=xpipe.make_mesh(4, 2),
                      loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    optimizer = torch.optim.AdamW(pipe.parameters())
    tokens = torch.randint(0, 256, (16, 129))
    pipe.step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    torch_xla.sync()
    megabytes = sum(v.numel() * v.element_size() for v in plain.state_dict().values()) / 2**20
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        baseline = median_seconds(lambda: torch.save(plain.state_dict(), directory / "plain.pt"))
        weights = median_seconds(lambda: xpipe.save(directory / "weights", pipe))
        background = median_seconds(lambda: xpipe.save(directory / "background", pipe, background=True))
        everything = median_seconds(lambda: xpipe.save(directory / "all", pipe, optimizer, step=1))
    print(f"model state: {megabytes:.1f} MiB")
    print("| what | seconds | / torch.save |")
    print("| --- | --- | --- |")
    for name, seconds in [("torch.save(plain.state_dict())", baseline), ("xpipe.save(path, pipe)", weights),
                          ("xpipe.save(path, pipe, background=True)", background),
                          ("xpipe.save(path, pipe, optimizer)", everything)]:
        print(f"| {name} | {seconds:.3f} | {seconds / baseline:.2f} |")


if __name__ == "__main__":
    main()
