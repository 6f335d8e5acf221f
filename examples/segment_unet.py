"""Train a small U-Net with xpipe.Pipe, one emulated XLA device per stage.

    python examples/segment_unet.py [--steps 60]

A U-Net's stages differ in width and resolution and its skip connections jump
across stages, so there are no identical blocks to stack: ``Pipe`` picks the
devices executor, puts each of 4 stages on its own XLA device and sends every
skip straight from the encoder's stage to its decoder's. The task: mark the
pixels inside a random bright square (two classes per pixel).
"""

import argparse
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")  # emulated devices unless told otherwise
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402

import xpipe  # noqa: E402
from xpipe.models import unet  # noqa: E402

BATCH, SIZE, CHUNKS, STAGES = 16, 32, 4, 4


def squares(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images ``[BATCH, 3, SIZE, SIZE]`` with one bright square each, and its mask."""
    corner = torch.randint(0, SIZE // 2, (BATCH, 2), generator=generator)
    rows = torch.arange(SIZE).view(1, SIZE, 1)
    cols = torch.arange(SIZE).view(1, 1, SIZE)
    top, left = corner[:, :1, None], corner[:, 1:, None]
    mask = (rows >= top) & (rows < top + SIZE // 2) & (cols >= left) & (cols < left + SIZE // 2)
    images = 0.5 * torch.randn(BATCH, 3, SIZE, SIZE, generator=generator) + mask.unsqueeze(1)
    return images, mask.long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    steps = parser.parse_args().steps

    pipe = xpipe.Pipe(unet(), chunks=CHUNKS, stages=STAGES)
    print(f"executor: {pipe.executor}, balance {list(pipe.partition.balance)}, devices {pipe.devices}")
    for cut, crossings in enumerate(pipe.partition.boundaries):
        print(f"  cut {cut}->{cut + 1}: " + ", ".join(f"{c.name} (to stage {c.last_stage})" for c in crossings))
    optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        images, masks = squares(generator)
        loss = F.cross_entropy(pipe(images), masks.to(pipe.devices[-1]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f} s")
    print(f"XLA compiles: {metrics.metric_data('CompileTime')[0]}")


if __name__ == "__main__":
    main()
