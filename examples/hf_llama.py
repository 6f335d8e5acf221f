"""Pipeline a Hugging Face Llama, as the library ships it, over a 2 (data) x 4 (stage)
mesh of XLA devices, and train it.

    python examples/hf_llama.py                       # spmd: one program over 8 devices
    python examples/hf_llama.py --executor devices    # one stage per device, 4 devices

The model is built from its own config with random weights (nothing is
downloaded). torch.fx cannot trace Hugging Face models, so xpipe captures it with
torch.export on a sample batch. Under spmd its 8 decoder layers are stacked over
the mesh's "stage" axis, the padding attention mask travels with each
microbatch inside the hidden state's permutes, and the rotary tables are held
by every stage; the embedding tied to the head stays one weight. The task: copy
the first half of each sequence into its second half, so the loss falls fast.
"""

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # 8 emulated devices; drop both lines on a TPU
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402
import torch_xla  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import xpipe  # noqa: E402

BATCH, SEQ, VOCAB, CHUNKS, STAGES, DATA = 16, 16, 32, 4, 4, 2


def batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sequences whose second half repeats the first; the first two rows are left-padded."""
    half = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=generator)
    ids = torch.cat([half, half], 1)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:2, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : SEQ // 2] = -100  # only the copied half is predicted
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main(steps: int = 80, executor: str = "spmd") -> list[float]:
    """Train for ``steps`` steps; the losses."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True, use_cache=False)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    sample = {key: value[: BATCH // CHUNKS] for key, value in batch(generator).items()}
    layout = {"mesh": xpipe.make_mesh(STAGES, DATA)} if executor == "spmd" else {"stages": STAGES}
    pipe = xpipe.Pipe(model, chunks=CHUNKS, executor=executor, sample_input=sample, **layout)
    print(pipe.partition)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = pipe(**batch(generator)).loss  # the model's own loss, from labels=
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--executor", choices=["spmd", "devices"], default="spmd")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.executor)
