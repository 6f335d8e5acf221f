"""Small XLA facts both executors rely on: autograd's first backward, moving weights."""

from __future__ import annotations

import torch
from torch import nn

_warmed = False


def warm_autograd(device: torch.device) -> None:
    """Run one tiny XLA backward, once per process.

    A CPU ``backward()`` that runs before the process's first XLA one breaks every
    later XLA backward (an internal assert in autograd's device queues), and users
    compute CPU references all the time.
    """
    global _warmed
    if not _warmed:
        probe = torch.zeros(1, device=device, requires_grad=True)
        (probe * 2).sum().backward()  # a bare probe.sum() does not set the queues up
        _warmed = True


def move_keeping_ties(modules: list[nn.Module], device: torch.device) -> None:
    """Move parameters and buffers to ``device``, one new Parameter per original.

    ``module.to(xla)`` makes a separate copy for every place a Parameter is held,
    which unties tied weights (an LM's embedding and head); this keeps them one.
    """
    moved: dict[int, nn.Parameter] = {}
    for module in modules:
        for owner in module.modules():
            for name, parameter in owner._parameters.items():
                if parameter is not None:
                    if id(parameter) not in moved:
                        moved[id(parameter)] = nn.Parameter(parameter.detach().to(device),
                                                            requires_grad=parameter.requires_grad)
                    owner._parameters[name] = moved[id(parameter)]
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = buffer.to(device)
