"""Train a small transformer LM with xpipe.Pipe on 8 emulated XLA devices.

    python examples/train_lm.py [--steps 200]

The mesh is 2 (data) x 4 (stage): the model's 8 blocks are split 2 per stage,
the embedding and the (tied) head run data-parallel, and each step runs 8
microbatches through the GPipe schedule as one compiled XLA program. The task is
to continue counting sequences (each token is the previous one plus a per-
sequence stride, modulo the vocabulary), so the loss falls within a few hundred steps.
"""

import argparse
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")  # emulated devices unless told otherwise
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as metrics  # noqa: E402

import xpipe  # noqa: E402
from xpipe.models import transformer_lm  # noqa: E402

VOCAB, SEQ, BATCH, CHUNKS = 64, 32, 32, 8


def counting_batch(generator: torch.Generator) -> torch.Tensor:
    """``[BATCH, SEQ + 1]`` token ids: random start and stride per sequence."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    stride = torch.randint(1, 4, (BATCH, 1), generator=generator)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    steps = parser.parse_args().steps

    model = transformer_lm(blocks=8, width=64, heads=4, seq=SEQ, vocab=VOCAB)
    pipe = xpipe.Pipe(model, chunks=CHUNKS, mesh=xpipe.make_mesh(stages=4))
    print(pipe.partition, end="\n\n")
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    device = torch_xla.device()
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = counting_batch(generator)
        logits = pipe(tokens[:, :-1])  # [BATCH, SEQ, VOCAB]
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten().to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if step == 1 or step % 25 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"\nXLA compiles: {metrics.metric_data('CompileTime')[0]}")


if __name__ == "__main__":
    main()
