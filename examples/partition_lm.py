"""Partition a transformer language model into pipeline stages and print the split.

    python examples/partition_lm.py

Builds a 24-block transformer LM (tied embedding and head), traces it, and splits
it into 4 stages of balanced forward FLOPs, then into 4 stages of balanced memory.
"""

import argparse
import torch

import xpipe
from xpipe.models import transformer_lm


def main() -> None:
    model = transformer_lm(blocks=24, width=128, seq=128, vocab=1024)
    batch = torch.randint(0, 1024, (8, 128))  # [batch, seq] token ids
    for cost in ("flops", "memory"):
        split = xpipe.partition(model, 4, sample_input=batch, cost=cost)
        print(split, end="\n\n")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
