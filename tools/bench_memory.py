"""Bytes per device of a pipelined model on several meshes: measured beside the memory model.

    python tools/bench_memory.py            # about 2 minutes on 2 cores

A Hugging Face Llama (8 layers, hidden 128, vocab 512, grouped-query attention,
tied embeddings) as an spmd Pipe on 8 emulated devices, on each mesh of
``MESHES``, after one AdamW step. For the busiest device it prints what it holds
of the weights, their gradients and AdamW's state, read from its shards
(``xpipe.inspect.bytes_per_device``), next to ``xpipe.planner.memory.per_device``'s
prediction, an even eighth of the whole, and the step's peak from XLA's buffer
assignment (``xpipe.inspect.audit``; the weights gathered for the step and the
activations come on top of the resting state there). docs/scaling.md quotes the table.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402

import xpipe  # noqa: E402
import xpipe.inspect  # noqa: E402

DUMP = xpipe.inspect.enable_hlo_dump()

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from xpipe.layout import MeshAxes  # noqa: E402
from xpipe.planner.memory import per_device  # noqa: E402

MESHES = [(8, 1, 1), (2, 4, 1), (2, 1, 4), (4, 1, 2), (2, 2, 2)]  # stages, data, fsdp
ROWS, SEQ, CHUNKS = 16, 32, 4


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, use_cache=False))


def held(tensors) -> int:
    return max(xpipe.inspect.bytes_per_device(tensors).values())


def measure(stages: int, data: int, fsdp: int) -> dict[str, float]:
    ids = torch.randint(0, 512, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    pipe = xpipe.Pipe(llama(), chunks=CHUNKS, mesh=xpipe.make_mesh(stages, data, fsdp=fsdp),
                      sample_input={name: value[:2] for name, value in inputs.items()})
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    report = xpipe.inspect.audit(lambda: pipe(**inputs).loss.backward(), mesh=pipe.mesh)
    parameters = list(pipe.parameters())
    gradients = held(p.grad for p in parameters)
    optimizer.step()
    states = [v for p in parameters for v in optimizer.state[p].values() if v.device.type == "xla"]
    outer = {id(p): tuple(p.shape) for module in (pipe.runner.pre, pipe.runner.post) for p in module.parameters()}
    model = per_device(stacked=[tuple(w.shape) for w in pipe.runner.body.weights], outer=outer.values(),
                       axes=MeshAxes(stages, data, fsdp))
    total = sum(p.numel() * p.element_size() for p in parameters)
    return {"parameters": held(parameters), "gradients": gradients, "optimizer": held(states),
            "predicted": model.resting, "gathered": model.gathered, "even": 4 * total / 8,
            "peak": report.peak_bytes or 0}


def main() -> None:
    print("| stage x data x fsdp | weights | gradients | AdamW state | resting, measured | resting, model "
          "| even share (x 4 kinds) | busiest / even | + gathered (model) | step peak (XLA) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for stages, data, fsdp in MESHES:
        row = measure(stages, data, fsdp)
        resting = row["parameters"] + row["gradients"] + row["optimizer"]
        kib = {key: f"{value / 1024:,.0f} KiB" for key, value in row.items()}
        print(f"| {stages} x {data} x {fsdp} | {kib['parameters']} | {kib['gradients']} | {kib['optimizer']} "
              f"| {resting / 1024:,.0f} KiB | {kib['predicted']} | {kib['even']} | {resting / row['even']:.2f} "
              f"| {kib['gathered']} | {kib['peak']} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
