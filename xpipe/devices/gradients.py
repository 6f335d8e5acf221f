"""The gradients one step of the devices executor collects.

Gradients go back between stages, keyed by the value and leaf they belong to
(summed where several stages read one value), and out to the model's inputs that
require grad; each stage's weight gradients are summed over the microbatches and
added to ``.grad`` once per step, as ``loss.backward()`` of the unpipelined model
would leave them.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from xpipe.devices.microbatch import merged, moved


class StepGradients:
    """A step's gradients in flight and summed.

    Args:
        parameters: per model stage, the trainable weights it runs with (a tied
            weight's copy where it lives on another stage's device).
        owner: the Parameter a weight of ``parameters`` is (itself, or what it copies).
        inputs: per microbatch, the model's inputs by name.
        microbatch_dim: as the step's inputs were given.
        input_grads: (input name, leaf index) of the model inputs that require grad.
    """

    def __init__(self, parameters: list[list[torch.Tensor]], owner: Callable[[torch.Tensor], torch.Tensor],
                 inputs: list[dict[str, Any]], microbatch_dim: int | None, input_grads: list[tuple[str, int]]) -> None:
        self.parameters, self.owner = parameters, owner
        self.inputs, self.microbatch_dim, self.input_grads = inputs, microbatch_dim, input_grads
        self.chunks = len(inputs)
        # per microbatch: (value name, leaf index) -> gradients from the stages that read the value
        self.received: list[dict[tuple[str, int], list[torch.Tensor]]] = [defaultdict(list) for _ in inputs]
        self.accumulated: list[list[torch.Tensor | None]] = [[None] * len(stage) for stage in parameters]

    def send(self, microbatch: int, key: tuple[str, int], grad: torch.Tensor) -> None:
        """Send ``grad`` back to the maker of ``microbatch``'s value leaf ``key``."""
        self.received[microbatch][key].append(grad)

    def received_grad(self, microbatch: int, key: tuple[str, int], device: torch.device) -> torch.Tensor | None:
        """The gradient of a value's leaf, summed over the stages that read it."""
        parts = [moved(part, device) for part in self.received[microbatch].pop(key, [])]
        return functools.reduce(operator.add, parts) if parts else None

    def accumulate(self, stage: int, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """Add one microbatch's weight gradients to the stage's sums; returns the sums
        and the microbatch's own gradients, all to be launched together.

        The microbatch's gradients are launched too because autograd's worker thread
        can still hold them (in its finished graph task) after the step returns: left
        pending, they joined the next graph run on that device, which then compiled a
        program of its own (seen: a new compile at the fifth or sixth step, now and then).
        """
        totals = self.accumulated[stage]
        for index, grad in enumerate(grads):
            if grad is not None:
                totals[index] = grad if totals[index] is None else totals[index] + grad
        summed = [t for t in totals if t is not None]
        return summed + [g for g in grads if g is not None and not any(g is t for t in summed)]

    def parameter_grads(self) -> list[torch.Tensor | None]:
        """The step's gradient of each stage's weights, in ``stage_parameters`` order; a
        tied weight's copy's gradient moved to the device of the Parameter it copies."""
        used = [p for stage in self.parameters for p in stage]
        grads = [grad for totals in self.accumulated for grad in totals]
        return [g if g is None or self.owner(p) is p else g.to(self.owner(p).device) for p, g in zip(used, grads)]

    def accumulate_into_grads(self, model_inputs: list[torch.Tensor]) -> None:
        """Add the step's gradients to ``.grad`` of the weights and of ``model_inputs``
        (the model inputs that require grad), as ``loss.backward()`` would."""
        parameters = [self.owner(p) for stage in self.parameters for p in stage]
        grads = self.parameter_grads() + self.model_input_grads(tuple(model_inputs))
        with torch.no_grad():
            for tensor, grad in zip(parameters + model_inputs, grads):
                if grad is not None:
                    tensor.grad = grad if tensor.grad is None else tensor.grad + grad

    def model_input_grads(self, originals: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """The gradients of the model inputs that require grad, microbatches merged."""
        grads = []
        for (name, leaf), original in zip(self.input_grads, originals):
            parts = [self.received[m].pop((name, leaf), []) for m in range(self.chunks)]
            if not any(parts):
                grads.append(None)
                continue
            pieces = [functools.reduce(operator.add, [moved(g, original.device) for g in part]) if part
                      else torch.zeros_like(tree_flatten(piece[name])[0][leaf]).to(original.device)
                      for part, piece in zip(parts, self.inputs)]
            grads.append(merged(pieces, self.microbatch_dim, [1.0] * self.chunks))  # a scalar's gradients add
        return grads
