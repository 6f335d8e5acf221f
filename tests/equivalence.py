"""The numerical check every executor test uses: a Pipe against the same model unpipelined."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch_xla
import torch_xla.debug.metrics as metrics

import xpipe
from xpipe import checkpoints
from xpipe._xla import to_host

# fp32 on both sides; the pipeline sums microbatch gradients in another order.
RTOL, ATOL = 1e-4, 1e-5


def train_steps(loss_of_step: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                steps: int = 5, *, backward: bool = True) -> tuple[list[float], list[int]]:
    """Run ``steps`` training steps; the loss and the process's compile count after each.
    ``backward=False`` for a ``loss_of_step`` that runs the backward itself (``pipe.step``)."""
    losses, compiles = [], []
    for _ in range(steps):
        loss = loss_of_step()
        if backward:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
        compiles.append(compiled())
    return losses, compiles


def compiled() -> int:
    """Programs compiled so far in this process."""
    data = metrics.metric_data("CompileTime")
    return data[0] if data else 0


def assert_pipe_matches(model: torch.nn.Module, batch: torch.Tensor, targets: torch.Tensor,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], **pipe_options) -> xpipe.Pipe:
    """Output, loss, every gradient and the weights after one SGD step equal the unpipelined model's."""
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, **pipe_options)

    expected = reference(batch)
    expected_loss = loss_fn(expected, targets)
    expected_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    output = pipe(batch)
    loss = loss_fn(output, targets.to(pipe.devices[-1]))
    loss.backward()
    torch_xla.sync()
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.cpu(), expected_loss.detach(), rtol=RTOL, atol=ATOL)
    gradients = host_gradients(pipe)
    for name, parameter in reference.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(gradients[name], parameter.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    torch_xla.sync()
    for name, value in pipe.host_state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name} after one step: {m}")
    return pipe


def host_gradients(pipe: xpipe.Pipe) -> dict[str, torch.Tensor]:
    """``pipe.named_gradients()`` on the host, every name of a tied weight included, each
    gradient fetched whole once (a ``.cpu()`` of every stacked block's view would
    compile a program per view)."""
    parameters = [p for p in pipe.parameters() if p.grad is not None]
    hosts = to_host([p.grad for p in parameters])
    found = {name: part for parameter, host in zip(parameters, hosts)
             for name, part in pipe.checkpoint_state().named_slices(parameter, host)}
    by_gradient = {id(p.grad): host for p, host in zip(parameters, hosts)}
    for name, gradient in pipe.named_gradients().items():
        if name not in found and gradient is not None and id(gradient) in by_gradient:
            found[name] = by_gradient[id(gradient)]
    return found


def assert_step_matches(model: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor,
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], **pipe_options) -> xpipe.Pipe:
    """One ``pipe.step`` equals ``loss_fn(model(batch), target).backward()`` on the plain
    model: the loss, every gradient, and every buffer after the step."""
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, loss_fn=loss_fn, **pipe_options)
    expected = loss_fn(reference(batch), target)
    expected.backward()
    loss = pipe.step(batch, target)
    torch_xla.sync()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    gradients = host_gradients(pipe)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    state = pipe.host_state_dict()
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(state[name].cpu(), buffer, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"buffer {name}: {m}")
    return pipe


def step_losses(pipe: xpipe.Pipe, optimizer: torch.optim.Optimizer, data) -> list[float]:
    """Train with ``pipe.step`` on each ``(inputs, target)`` of ``data``; the losses."""
    losses = []
    for inputs, target in data:
        losses.append(pipe.step(inputs, target))
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
    return [loss.item() for loss in losses]


def assert_loads_exactly(folder, saved: dict[str, torch.Tensor],
                         *targets: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    """The checkpoint in ``folder`` loads into each (model, optimizer), Pipes of any
    layout and plain modules alike, with every tensor of ``saved`` bit-equal."""
    for model, optimizer in targets:
        (xpipe.load if isinstance(model, xpipe.Pipe) else checkpoints.load_plain)(folder, model, optimizer)
        state = model.host_state_dict() if isinstance(model, xpipe.Pipe) else model.state_dict()
        for key, value in saved.items():
            assert torch.equal(state[key].cpu(), value), f"{key} loaded into {type(model).__name__}"
