"""Weights tied across devices (an LM's embedding and head), for the devices executor.

A tied weight stays one Parameter, on the device of the first stage that uses it;
that Parameter is what the optimizer steps and what the model holds. Every other
device that runs a stage using it gets a copy, taken afresh at the start of each
step (so the copies equal the weight after every ``optimizer.step()``), and the
copy's gradient is added to the Parameter's once per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


class TiedCopies:
    """Copies of the weights that stages on other devices share.

    Args:
        modules: the stage programs, in model-stage order.
        devices: each model stage's device.
    """

    def __init__(self, modules: list[nn.Module], devices: list[torch.device]) -> None:
        self.devices = devices
        # per stage: the name the stage uses -> the Parameter it stands for, when that lives elsewhere
        self.borrowed: list[dict[str, nn.Parameter]] = [
            {name: p for name, p in module.named_parameters() if p.device != device}
            for module, device in zip(modules, devices)]
        self.copies: dict[tuple[int, str], torch.Tensor] = {}  # (id(parameter), device) -> its copy there
        self.owners: dict[int, nn.Parameter] = {}  # id(copy) -> the Parameter it copies

    def __bool__(self) -> bool:
        return any(self.borrowed)

    def refresh(self) -> None:
        """Copy each shared weight to the devices that borrow it, as it is now."""
        self.copies.clear()
        self.owners.clear()
        for borrowed, device in zip(self.borrowed, self.devices):
            for parameter in borrowed.values():
                key = (id(parameter), str(device))
                if key not in self.copies:
                    copy = parameter.detach().to(device).requires_grad_(parameter.requires_grad)
                    self.copies[key] = copy
                    self.owners[id(copy)] = parameter

    def substitutes(self, stage: int) -> dict[str, torch.Tensor]:
        """What ``stage`` runs with in place of the weights it borrows, by name."""
        device = str(self.devices[stage])
        return {name: self.copies[id(p), device] for name, p in self.borrowed[stage].items()}

    def run(self, stage: int, module: nn.Module, *args):
        """``module(*args)``, with the borrowed weights replaced by this step's copies."""
        substitutes = self.substitutes(stage)
        return functional_call(module, substitutes, args) if substitutes else module(*args)

    def owner(self, tensor: torch.Tensor) -> torch.Tensor:
        """The Parameter that ``tensor`` copies, or ``tensor`` itself."""
        return self.owners.get(id(tensor), tensor)
