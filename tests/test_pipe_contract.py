"""Ordinary user programs under the devices executor: never a silently wrong result.

Each test is a program a PyTorch/XLA user writes without thinking of xpipe (an
optimizer built before wrapping, BatchNorm with recomputation, a ragged last
batch, inputs that need gradients, a model that breaks the batch contract) and
checks it against the same model run unpipelined, or checks that it fails
loudly, naming the argument and the fix. Processes that need a runtime of their
own (a backward before xpipe, XLA used before SPMD) run in a subprocess.
"""

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.runtime as xr
from torch import nn

import xpipe
from equivalence import ATOL, RTOL, assert_pipe_matches
from xpipe.models import mlp_stack, small_cnn, transformer_lm


def batch(rows: int, features: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(seed))


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                         nn.ReLU(), nn.Linear(16, 4))


def test_an_optimizer_built_before_wrapping_trains_the_pipe():
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # before wrapping, on the model's own parameters
    pipe = xpipe.Pipe(model, chunks=2, stages=4, executor="devices")
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    x, y = batch(8), batch(8, 4, seed=1)
    F.mse_loss(pipe(x), y.to(pipe.devices[-1])).backward()
    optimizer.step()
    torch_xla.sync()
    F.mse_loss(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for name, value in model.state_dict().items():  # the user's model holds the trained weights
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(pipe.state_dict()[name].cpu(), value.cpu())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_batch_norm_equals_the_model_run_microbatch_by_microbatch(checkpoint):
    """Each microbatch is normalised with its own statistics and moves the running
    statistics once, as the plain model does when it is fed the microbatches in turn;
    recomputed microbatches neither crash nor count twice."""
    model = bn_model()
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, stages=3, executor="devices", checkpoint=checkpoint)
    x = batch(16)
    output = pipe(x)
    output.square().mean().backward()
    torch_xla.sync()
    expected = torch.cat([reference(piece) for piece in x.chunk(4)])
    expected.square().mean().backward()
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    for name, grad in pipe.named_gradients().items():
        torch.testing.assert_close(grad.cpu(), reference.get_parameter(name).grad, rtol=RTOL, atol=ATOL)
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_moves_running_statistics_once_per_step(checkpoint):
    """The first BatchNorm's running statistics equal the unpipelined model's (its input
    does not depend on how the batch was split); the second's are those of everything
    it saw in the step, taken as one batch: its inputs, captured from the model fed the
    microbatches in turn."""
    model = bn_model()
    whole_batch, by_microbatch = copy.deepcopy(model), copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, stages=3, executor="devices", checkpoint=checkpoint,
                      deferred_batch_norm=True)
    seen = []
    by_microbatch[4].register_forward_hook(lambda module, args, output: seen.append(args[0].detach()))
    x = batch(16)
    expected_mean, expected_var = torch.zeros(16), torch.ones(16)
    for _ in range(2):  # two steps: the second starts from the first's statistics
        pipe(x).square().mean().backward()
        torch_xla.sync()
        whole_batch(x)
        seen.clear()
        for piece in x.chunk(4):
            by_microbatch(piece)
        inputs = torch.cat(seen)
        expected_mean = 0.9 * expected_mean + 0.1 * inputs.mean(0)
        expected_var = 0.9 * expected_var + 0.1 * inputs.var(0)
    state = pipe.state_dict()
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked", "4.num_batches_tracked"):
        torch.testing.assert_close(state[key].cpu(), whole_batch.state_dict()[key], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(state["4.running_mean"].cpu(), expected_mean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state["4.running_var"].cpu(), expected_var, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("rows", [6, 3])
def test_a_last_batch_that_chunks_does_not_divide_still_runs(rows):
    """torchgpipe's behaviour: torch.chunk's split (a smaller last microbatch, or fewer)."""
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
    assert_pipe_matches(model, batch(rows), batch(rows, 4, seed=1), F.mse_loss, chunks=4, stages=4,
                        executor="devices")


def test_inputs_that_require_grad_get_their_gradients():
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, stages=4, executor="devices")
    x = batch(8).requires_grad_()
    x_reference = x.detach().clone().requires_grad_()
    pipe(x).square().sum().backward()
    reference(x_reference).square().sum().backward()
    torch_xla.sync()
    torch.testing.assert_close(x.grad, x_reference.grad, rtol=RTOL, atol=ATOL)


def test_outputs_that_break_the_batch_contract_are_refused():
    class FeatureFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(self.a(x)).t()  # [3 features, rows]

    pipe = xpipe.Pipe(FeatureFirst(), chunks=2, stages=2, executor="devices")
    with pytest.raises(ValueError, match=r"module: output 0 has shape \[3, 4\], but its dim 0 should be the "
                                         r"microbatch's 4 rows"):
        pipe(batch(8))


def test_outputs_that_are_not_tensors_are_refused():
    class CountsToo(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(self.a(x)), "rows"

    pipe = xpipe.Pipe(CountsToo(), chunks=2, stages=2, executor="devices")
    with pytest.raises(TypeError, match="module: output 1 is a str; a pipelined model returns tensors"):
        pipe(batch(8))


def test_inputs_with_different_batch_sizes_are_refused():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x, y):
            return self.b(self.a(x) + y)

    pipe = xpipe.Pipe(TwoInputs(), chunks=2, stages=2, executor="devices")
    with pytest.raises(ValueError, match=r"x: the inputs have different batch sizes \[8, 4\]"):
        pipe(batch(8), batch(4))


def test_moving_a_pipe_is_refused():
    pipe = xpipe.Pipe(small_cnn(), chunks=2, stages=2)
    for move in (lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(torch.float64), lambda: pipe.half()):
        with pytest.raises(TypeError, match="pipe: a Pipe's weights are placed on their XLA devices"):
            move()
    pipe(torch.zeros(4, 3, 32, 32))  # and the pipeline still runs


def test_numpy_integers_are_whole_numbers():
    pipe = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=4), chunks=np.int64(2),
                      balance=np.array([2, 1, 1, 2]), executor="devices")
    assert pipe.chunks == 2 and type(pipe.chunks) is int
    assert pipe.partition.balance == (2, 1, 1, 2)


def test_float64_inputs_name_the_fix():
    pipe = xpipe.Pipe(small_cnn(), chunks=2, stages=2)
    with pytest.raises(ValueError, match=r"x: input 0 is float64 but the model's weights are torch.float32; "
                                         r"convert it first \(x.to\(torch.float32\)\)"):
        pipe(torch.zeros(4, 3, 32, 32, dtype=torch.float64))


def test_a_bad_stage_count_under_auto_leaves_the_process_as_it_was():
    with pytest.raises(ValueError, match="stages: 9 stages need 9 XLA devices, but there are 8"):
        xpipe.Pipe(mlp_stack(blocks=9, width=16, inputs=8, outputs=4), chunks=2, stages=9)
    assert not xr.is_spmd()
    pipe = xpipe.Pipe(small_cnn(), chunks=2, stages=2, executor="devices")  # a valid one still runs
    assert pipe(torch.zeros(4, 3, 32, 32)).shape == (4, 10)


def test_auto_picks_devices_where_xla_devices_were_used_outside_spmd():
    """This process already ran XLA work without SPMD, so it can no longer switch: an
    LM, which a fresh process would run under spmd, gets the devices executor."""
    assert xpipe.Pipe(transformer_lm(blocks=4, width=16), chunks=2, stages=4).executor == "devices"
    assert not xr.is_spmd()


def run_fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python process with 8 emulated devices and no XLA use yet."""
    tests_first = filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])  # for counting.py
    environment = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", PYTHONPATH=os.pathsep.join(tests_first))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment, capture_output=True,
                          text=True, timeout=300)


def test_a_cpu_backward_before_the_pipe_does_not_break_xla_backward():
    result = run_fresh("""
        import torch, torch_xla, xpipe
        from xpipe.models import mlp_stack
        model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
        model(torch.randn(8, 8)).sum().backward()   # a CPU reference first, as users do
        model.zero_grad()
        pipe = xpipe.Pipe(model, chunks=2, stages=4, executor="devices")
        pipe(torch.randn(8, 8)).sum().backward()
        torch_xla.sync()
        print("grad", model[0].weight.grad.abs().sum().item() > 0)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grad True" in result.stdout


def test_auto_picks_spmd_wherever_spmd_accepts_the_model():
    """7 blocks on 4 stages x 2 virtual: the last model stage holds no block but the
    norm and head, which the spmd executor runs; auto picks it in a fresh process."""
    result = run_fresh("""
        import xpipe
        from counting import count_captures, count_schedule_builds
        from xpipe.models import transformer_lm
        captures, schedules = count_captures(), count_schedule_builds()
        pipe = xpipe.Pipe(transformer_lm(blocks=7, width=16), chunks=8, stages=4, schedule="circular", virtual=2)
        print("executor", pipe.executor, pipe.partition.balance, "captures", captures, "schedules", schedules,
              "runs the one built", pipe.runner.schedule is pipe.schedule)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "executor spmd" in result.stdout, result.stdout
    # the choice and the build read one capture; the schedule named is built once and run
    assert "captures ['fx'] schedules ['circular'] runs the one built True" in result.stdout, result.stdout


def test_spmd_after_xla_devices_were_used_is_refused_not_crashed():
    result = run_fresh("""
        import torch, torch_xla, xpipe
        from xpipe.models import mlp_stack
        torch.ones(2, device=torch_xla.device())      # non-SPMD XLA work first
        try:
            xpipe.Pipe(mlp_stack(blocks=8, width=16, inputs=8, outputs=4), chunks=2, executor="spmd")
        except RuntimeError as error:
            print("refused:", error)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: executor: the spmd executor needs SPMD mode, which must start before any XLA device " \
           "is used" in result.stdout


class TakesAPair(nn.Module):
    """A first layer whose forward takes one tuple, as in torchgpipe's tests."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, pair):
        x, y = pair
        return self.a(x) * self.b(y)


class ReturnsAPair(nn.Module):
    """A layer that returns a tuple, read whole by the next layer (in another stage)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), x


class ReadsAPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, pair):
        return self.a(pair[0] + pair[1])


def test_tuples_into_the_model_and_across_a_cut_carry_their_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(TakesAPair(), ReturnsAPair(), ReadsAPair())
    pair = (batch(8), batch(8, seed=1))
    assert_pipe_matches(model, pair, batch(8, 4, seed=2), F.mse_loss, chunks=4, stages=3, executor="devices",
                        checkpoint="except_last")


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_batch_norm_in_eval_mode_differentiates(checkpoint):
    """Fine-tuning with frozen statistics: eval-mode BatchNorm through backward, as the
    unpipelined model computes it (torch_xla's own eval-mode backward fails)."""
    model = bn_model()
    model[1].eval()
    model[4].eval()
    assert_pipe_matches(model, batch(16), batch(16, 4, seed=1), F.mse_loss, chunks=4, stages=3,
                        executor="devices", checkpoint=checkpoint)


@pytest.mark.parametrize("executor", ["devices", "auto"])
def test_a_pipe_captures_its_model_once_and_builds_its_schedule_once(captures, schedule_builds, monkeypatch,
                                                                     executor):
    """A capture is most of a Pipe's construction time: one per Pipe, whatever the executor.
    "auto" in a process that could still enter SPMD reads the split from the same capture
    (this model has no run of identical blocks to stack, so it falls back to devices).
    The schedule the user named is built once, and is the one the executor runs."""
    import xpipe.build

    monkeypatch.setattr(xpipe.build, "can_enter_spmd", lambda: True)
    pipe = xpipe.Pipe(small_cnn(), chunks=2, stages=2, executor=executor, schedule="1f1b")
    assert pipe.executor == "devices"
    assert captures == ["fx"]
    assert schedule_builds == ["1f1b"]
    assert pipe.runner.schedule is pipe.schedule


def test_a_hugging_face_pipe_is_exported_once(captures, schedule_builds):
    from hf_models import gpt2, tokens

    xpipe.Pipe(gpt2(layers=2), chunks=2, stages=2, executor="devices", sample_input={"input_ids": tokens(4)})
    assert captures == ["fx", "export"]  # fx cannot open the model: export captures it, once
    assert schedule_builds == ["gpipe"]


def test_sequence_parallelism_without_a_tensor_axis_is_refused_by_name_before_spmd_mode():
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
    with pytest.raises(ValueError, match=r"sequence_parallel: must be True or False, got 'yes'"):
        xpipe.Pipe(model, chunks=2, stages=4, sequence_parallel="yes")
    with pytest.raises(ValueError, match=r"sequence_parallel: the devices executor has no 'tensor' axis"):
        xpipe.Pipe(model, chunks=2, stages=4, executor="devices", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel: it splits the stream's sequence over the mesh's "
                                         r"\"tensor\" axis, and this mesh has none .* tensor=N"):
        xpipe.Pipe(model, chunks=2, stages=4, executor="spmd", sequence_parallel=True)
    assert not xr.is_spmd()


def test_gather_choices_the_executor_cannot_honour_are_refused_by_name():
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=4)
    with pytest.raises(ValueError, match=r"gather: 'layer' is not a choice; use one of 'step', 'block'"):
        xpipe.Pipe(model, chunks=2, stages=4, gather="layer")
    with pytest.raises(ValueError, match=r"gather: 'block' .* pass checkpoint='always' with it "
                                         r"\(got checkpoint='except_last'\)"):
        xpipe.Pipe(model, chunks=2, stages=4, gather="block")
    with pytest.raises(ValueError, match=r"gather: the devices executor holds each stage's weights whole"):
        xpipe.Pipe(model, chunks=2, stages=4, executor="devices", gather="block", checkpoint="always")
