"""Shared checks for the SPMD pipeline tests: a Pipe against the same model unpipelined."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import torch_xla

import xpipe
from xpipe.models import mlp_stack, transformer_lm

# fp32 on both sides; the pipeline sums microbatch gradients in another order.
RTOL, ATOL = 1e-4, 1e-5


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
    """Output, loss, every gradient and the weights after one SGD step equal the unpipelined model's."""
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=chunks, mesh=xpipe.make_mesh(stages, data), checkpoint=checkpoint)
    batch, targets = batch_for(reference, chunks * data * rows_per_replica)

    expected = reference(batch)
    expected_loss = loss_of(expected, targets)
    expected_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    device = torch_xla.device()
    output = pipe(batch)
    loss = loss_of(output, targets.to(device))
    loss.backward()
    torch_xla.sync()
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.cpu(), expected_loss.detach(), rtol=RTOL, atol=ATOL)
    gradients = pipe.named_gradients()
    for name, parameter in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(gradients[name].cpu(), parameter.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    torch_xla.sync()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name} after one step: {m}")
    return pipe
