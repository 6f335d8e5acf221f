"""Shared checks for the SPMD pipeline tests: a Pipe against the same model unpipelined."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from equivalence import ATOL, RTOL, assert_pipe_matches

import xpipe
from xpipe.models import mlp_stack, transformer_lm

__all__ = ["ATOL", "RTOL", "assert_matches_reference", "batch_for", "loss_of", "tiny_lm", "tiny_mlp"]


def tiny_lm(blocks: int = 8):
    return transformer_lm(blocks=blocks, width=16, heads=2, seq=8, vocab=32)


def tiny_mlp(blocks: int = 8):
    return mlp_stack(blocks=blocks, width=16, inputs=8, outputs=4)


def batch_for(model, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch and targets for ``model``; the LM gets token ids."""
    generator = torch.Generator().manual_seed(rows)
    if isinstance(model, torch.nn.Sequential):
        return torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)
    vocab, seq = model.config.vocab, model.config.seq
    return (torch.randint(0, vocab, (rows, seq), generator=generator),
            torch.randint(0, vocab, (rows, seq), generator=generator))


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if output.dim() == 3:
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())
    return F.mse_loss(output, targets)


def assert_matches_reference(model, *, stages: int, data: int, chunks: int, checkpoint: str = "except_last",
                             rows_per_replica: int = 1) -> xpipe.Pipe:
    """The spmd Pipe on a data x stages mesh equals the unpipelined model (``equivalence``)."""
    batch, targets = batch_for(model, chunks * data * rows_per_replica)
    return assert_pipe_matches(model, batch, targets, loss_of, chunks=chunks,
                               mesh=xpipe.make_mesh(stages, data), checkpoint=checkpoint)
