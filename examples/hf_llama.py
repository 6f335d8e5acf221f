"""Pipeline a Hugging Face Llama, as the library ships it, over 4 XLA devices and train it.

    python examples/hf_llama.py

The model is built from its own config with random weights (nothing is
downloaded). torch.fx cannot trace Hugging Face models, so xpipe captures it with
torch.export on a sample batch; the padding attention mask and the rotary
embeddings travel between stages with the hidden state, and the embedding tied
to the head lives on the first stage. The task: copy the first half of each
sequence into its second half, so the loss falls fast.
"""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # 4 emulated devices; drop both lines on a TPU
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch  # noqa: E402
import torch_xla  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import xpipe  # noqa: E402

STEPS, BATCH, SEQ, VOCAB, CHUNKS, STAGES = 80, 16, 16, 32, 4, 4


def batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sequences whose second half repeats the first; the first two rows are left-padded."""
    half = torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=generator)
    ids = torch.cat([half, half], 1)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:2, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : SEQ // 2] = -100  # only the copied half is predicted
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=True, use_cache=False)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    sample = {key: value[: BATCH // CHUNKS] for key, value in batch(generator).items()}
    pipe = xpipe.Pipe(model, chunks=CHUNKS, stages=STAGES, sample_input=sample)
    print(pipe.partition)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = pipe(**batch(generator)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
