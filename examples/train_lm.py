"""Train a byte-level transformer LM on Python's own source code with xpipe.Pipe.

    python examples/train_lm.py                         # 200 steps, 2 (data) x 4 (stage) mesh
    python examples/train_lm.py --steps 1000 --checkpoint-dir runs/lm
    python examples/train_lm.py --steps 2000 --checkpoint-dir runs/lm --resume
    python examples/train_lm.py --schedule circular --virtual 2   # 2 rounds of the stage ring, spmd
    python examples/train_lm.py --stages 2 --data 1 --fsdp 4       # every stage sharded over 4 devices
    python examples/train_lm.py --stages 2 --data 1 --fsdp 2 --tensor 2  # and each block split over 2
    python examples/train_lm.py --schedule 1f1b --stages 4   # the devices executor

The text is the standard library's ``.py`` files (on every machine, nothing to
download), read as bytes: the first 90% train, the rest validate. Batches come
through ``xpipe.data.MpDeviceLoader`` with the accumulation dimension: the host
stacks ``chunks`` microbatches into ``[chunks, micro_batch, seq + 1]`` before the
transfer, sharded over the mesh's "data" axis on arrival (not over "fsdp": see
docs/scaling.md on XLA's CPU runtime), and ``pipe.step`` runs the schedule with
the loss inside. Every ``--eval-every`` steps the validation loss is measured;
every ``--checkpoint-every`` steps (and at the end) the run is saved with
``xpipe.save``, in the background; ``--resume`` continues from the last one with
the same batches the uninterrupted run would have seen. At the end the loss
curve is written as a PNG. On a pod, run it on every host: each host loads its
own devices' rows, and the hosts write each checkpoint together (blocking, over
a gloo group), so ``--checkpoint-dir`` must be a path every host mounts.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")  # emulated devices unless told otherwise
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from tqdm import tqdm  # noqa: E402

import xpipe  # noqa: E402
import xpipe.data  # noqa: E402
from xpipe.hosts import Hosts, host_rows  # noqa: E402
from xpipe.models import transformer_lm  # noqa: E402

VOCAB = 256  # bytes
SPMD = ("gpipe", "circular")  # the schedules the spmd executor runs; the others run on one device per stage


def read_corpus(limit: int = 2_000_000) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's top-level ``.py`` files, in name order."""
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def split(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the first 90%, validate on the rest."""
    cut = len(corpus) * 9 // 10
    return corpus[:cut], corpus[cut:]


class Windows(torch.utils.data.IterableDataset):
    """Batches of ``[rows, seq + 1]`` random windows of ``text``; batch ``i`` depends
    only on ``(seed, i)``, so a resumed run sees what the uninterrupted one saw.
    ``kept`` picks the rows this host loads (on a pod, its share of each batch)."""

    def __init__(self, text: torch.Tensor, seq: int, rows: int, *, first: int = 0, count: int | None = None,
                 seed: int = 0, kept: slice = slice(None)) -> None:
        super().__init__()
        self.text, self.seq, self.rows, self.first, self.count, self.seed = text, seq, rows, first, count, seed
        self.kept = kept

    def batch(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, len(self.text) - self.seq - 1, (self.rows,), generator=generator)[self.kept]
        return torch.stack([self.text[s:s + self.seq + 1] for s in starts.tolist()])

    def __iter__(self) -> Iterator[torch.Tensor]:
        index = self.first
        while self.count is None or index < self.first + self.count:
            yield self.batch(index)
            index += 1


def build_model(options: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(options.seed)
    return transformer_lm(blocks=8, width=options.width, heads=4, seq=options.seq, vocab=VOCAB)


# How "tensor" splits the blocks of xpipe.models.transformer_lm (its norms are covered by the
# built-in rules): the MLP and the attention's output projection Megatron-style; the packed
# q/k/v projection stays whole on each device, as the built-in rules keep GPT-2's.
TENSOR_RULES = {"*.qkv.*": None, "*.proj.weight": 1, "*.proj.bias": None,
                "*.up.*": 0, "*.down.weight": 1, "*.down.bias": None}


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's next byte."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def run(options: argparse.Namespace) -> dict[str, list]:
    """Train as ``options`` say; returns the history (step losses, validation losses)."""
    train_text, valid_text = split(read_corpus())
    pipe = xpipe.Pipe(build_model(options), chunks=options.chunks, stages=options.stages,
                      schedule=options.schedule, virtual=options.virtual, loss_fn=next_byte_loss,
                      mesh=xpipe.make_mesh(options.stages, options.data, fsdp=options.fsdp, tensor=options.tensor)
                      if options.schedule in SPMD else None,
                      tensor_rules=TENSOR_RULES if options.tensor > 1 else None)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=options.lr)
    history: dict[str, list] = {"step": [], "loss": [], "valid_step": [], "valid_loss": []}
    first = 1
    checkpoint = Path(options.checkpoint_dir) / "latest" if options.checkpoint_dir else None
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
    several_hosts = xr.process_count() > 1
    if several_hosts and checkpoint is not None and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method="xla://")  # the hosts write one checkpoint
    if options.resume:
        if checkpoint is None or not checkpoint.exists():
            raise SystemExit(f"--resume: no checkpoint at {checkpoint}; pass the --checkpoint-dir of an earlier run")
        done, history = xpipe.load(checkpoint, pipe, optimizer)
        first = done + 1
    print(f"{pipe.executor} executor, {pipe.partition}\n")

    rows = options.micro_batch * (options.data * options.fsdp if pipe.executor == "spmd" else 1)  # per microbatch
    spmd = pipe.executor == "spmd"
    sharding = xpipe.data.batch_sharding(pipe.mesh, ndim=3, batch_dim=1) if spmd else None
    hosts = Hosts.of_runtime() if spmd else None  # on a pod, each host loads only its devices' rows
    batches = Windows(train_text, options.seq, rows, first=(first - 1) * options.chunks,
                      count=(options.steps - first + 1) * options.chunks, seed=options.seed,
                      kept=host_rows(sharding, rows, 1, hosts) if spmd else slice(None))
    host = torch.utils.data.DataLoader(batches, batch_size=None)
    loader = xpipe.data.MpDeviceLoader(host, pipe.devices[0], accumulation_dim=0, accumulation_size=options.chunks,
                                       batch_dim=1, input_sharding=sharding, hosts=hosts)
    tokens_per_step = options.chunks * rows * options.seq
    progress = tqdm(loader, total=options.steps, initial=first - 1, desc="train", unit="step", disable=options.quiet)
    started = time.perf_counter()
    saving = None  # the checkpoint being written while training goes on
    for step, tokens in enumerate(progress, start=first):
        loss = pipe.step(tokens[..., :-1], tokens[..., 1:], microbatch_dim=0)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        history["step"].append(step)
        history["loss"].append(loss.item())
        rate = tokens_per_step * (step - first + 1) / (time.perf_counter() - started)
        progress.set_postfix(loss=f"{history['loss'][-1]:.3f}", tok_s=f"{rate:,.0f}")
        if step % options.eval_every == 0 or step == options.steps:
            history["valid_step"].append(step)
            history["valid_loss"].append(validation_loss(pipe, valid_text, options, rows))
            progress.write(f"step {step}: validation loss {history['valid_loss'][-1]:.4f}")
        if checkpoint is not None and (step % options.checkpoint_every == 0 or step == options.steps):
            if saving is not None:
                saving.result()  # a failed earlier save stops the run here, with its error
            # In the background on one host; several hosts write theirs together, blocking.
            saving = xpipe.save(checkpoint, pipe, optimizer, step=step, extra=history, background=not several_hosts)
    if saving is not None:
        saving.result()
    if options.plot:
        plot(history, options.plot)
    return history


def validation_loss(pipe: xpipe.Pipe, text: torch.Tensor, options: argparse.Namespace, rows: int) -> float:
    """Mean loss over ``options.eval_batches`` fixed batches of ``text``, in eval mode."""
    windows = Windows(text, options.seq, rows * options.chunks, seed=options.seed + 1)
    pipe.eval()
    losses = []
    with torch.no_grad():
        for index in range(options.eval_batches):
            tokens = windows.batch(index)
            logits = pipe(tokens[:, :-1])
            losses.append(next_byte_loss(logits, tokens[:, 1:].to(logits.device)))
    pipe.train()
    return torch.stack([loss.cpu() for loss in losses]).mean().item()


def plot(history: dict[str, list], path: str) -> None:
    """The training and validation losses against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(history["step"], history["loss"], lw=1, alpha=0.6, label="train (per step)")
    axes.plot(history["valid_step"], history["valid_loss"], "o-", label="validation")
    axes.set(xlabel="step", ylabel="cross-entropy (nats per byte)", title="byte-level LM on the stdlib, xpipe.Pipe")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"loss curve: {path}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="last step to train (default 200)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--data", type=int, default=2, help="data-parallel replicas, spmd only (default 2)")
    parser.add_argument("--fsdp", type=int, default=1,
                        help="devices each stage's weights, gradients and AdamW state are sharded over (ZeRO-3), "
                             "spmd only (default 1)")
    parser.add_argument("--tensor", type=int, default=1,
                        help="devices each block's matrices are split over (tensor parallelism), spmd only "
                             "(default 1)")
    parser.add_argument("--chunks", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per microbatch and replica (default 4)")
    parser.add_argument("--schedule", default="gpipe",
                        help="gpipe, circular (spmd executor) or 1f1b, zb-h1, interleaved (devices executor); "
                             "default gpipe")
    parser.add_argument("--virtual", type=int, default=1,
                        help="model stages per stage group, for circular and interleaved (default 1)")
    parser.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--checkpoint-dir", default=None, help="save here (as DIR/latest) every --checkpoint-every")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's last checkpoint")
    parser.add_argument("--plot", default="train_lm_loss.png", help="the loss curve's PNG ('' for none)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse())
