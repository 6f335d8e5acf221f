"""torchgpipe's own behaviours, as its test suite states them, on the devices executor.

Adapted from torchgpipe's tests (``test_gpipe.py``, ``test_bugs.py``) to ``xpipe.Pipe``
and XLA devices: dropout drawn in parallel stages and replayed in the recomputation,
the exception of a stage stopping the pipeline at once, deferred BatchNorm under every
checkpoint mode, checkpoint modes in eval, and moves refused with ``TypeError``.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import xpipe
from xpipe.models import mlp_stack

CHECKPOINTS = ["never", "always", "except_last"]


class Dropouts(nn.Module):
    def forward(self, x):
        for _ in range(10):  # torchgpipe's test: 100 of p=0.001 (here fewer, for compile time)
            x = F.dropout(x, p=0.01)
        return x


def test_parallel_randoms_are_replayed_in_the_recomputation():
    """An output zeroed by dropout gets no gradient, and only those: the recomputed
    stage draws the masks its forward drew (torchgpipe's ``test_parallel_randoms``)."""
    x = torch.rand(8, 10, requires_grad=True)
    pipe = xpipe.Pipe(nn.Sequential(Dropouts(), Dropouts()), chunks=4, balance=[1, 1], checkpoint="always",
                      executor="devices")
    y = pipe(x)
    y.norm().backward()
    torch_xla.sync()
    assert (y.cpu() == 0).any(), "20 dropouts of p=0.01 on 80 values drop some"
    assert y.cpu().to(torch.bool).tolist() == x.grad.to(torch.bool).tolist()


def test_an_exception_in_a_stage_stops_the_pipeline_at_once():
    """Microbatch 0 fails in the last stage before the stage before it runs a third
    microbatch (torchgpipe's ``test_exception_early_stop_asap``)."""
    class Failure(Exception):
        pass

    calls = []

    class Count(nn.Module):
        def forward(self, x):
            calls.append(x.shape[0])
            return x

    class Fail(nn.Module):
        def forward(self, x):
            raise Failure()

    pipe = xpipe.Pipe(nn.Sequential(nn.Identity(), nn.Identity(), Count(), Fail()), chunks=3, balance=[1, 1, 1, 1],
                      executor="devices")
    calls.clear()  # capturing the model called it once
    with pytest.raises(Failure):
        pipe(torch.rand(3, 1))
    assert len(calls) == 2


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_deferred_batch_norm_keeps_the_whole_batchs_statistics(checkpoint):
    bn = nn.BatchNorm2d(3)
    pipe = xpipe.Pipe(nn.Sequential(copy.deepcopy(bn)), chunks=2, balance=[1], checkpoint=checkpoint,
                      deferred_batch_norm=True, executor="devices")
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    torch_xla.sync()
    state = pipe.state_dict()
    torch.testing.assert_close(state["0.running_mean"].cpu(), bn.running_mean, rtol=0, atol=1e-4)
    torch.testing.assert_close(state["0.running_var"].cpu(), bn.running_var, rtol=0, atol=1e-4)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_every_checkpoint_mode_runs_in_eval(checkpoint):
    """In eval, dropout is off whatever the mode: the output and gradients are the plain
    model's in eval (rtol 1e-4)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    reference = copy.deepcopy(model).eval()
    pipe = xpipe.Pipe(model, chunks=2, stages=2, checkpoint=checkpoint, executor="devices").eval()
    x = torch.rand(4, 8)
    output = pipe(x)
    output.square().sum().backward()
    torch_xla.sync()
    expected = reference(x)
    expected.square().sum().backward()
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=1e-4, atol=1e-6)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(pipe.named_gradients()[name].cpu(), parameter.grad, rtol=1e-4, atol=1e-6)


def test_moving_is_a_type_error():
    pipe = xpipe.Pipe(mlp_stack(blocks=2, width=8, inputs=4, outputs=2), chunks=2, stages=2, executor="devices")
    for move in (pipe.cpu, lambda: pipe.to("cpu"), lambda: pipe.to(0), lambda: pipe.to(torch.rand(1))):
        with pytest.raises(TypeError, match="pipe: a Pipe's weights are placed on their XLA devices"):
            move()
