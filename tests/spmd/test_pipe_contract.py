"""Ordinary user programs under the spmd executor: never a silently wrong result.

The spmd executor replaces the repeated blocks' weights by stacked tensors of its
own; everything that still points at the old ones (an optimizer, the model's
state dict) must fail loudly. Frozen blocks stay frozen, dropout runs in the
stacked blocks (a new mask per block, microbatch and replica; the same mask when
recomputed), BatchNorm outside the body sees exactly the rows given, and a last
batch that does not split runs. Numbers are compared with the unpipelined model.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import xpipe
from equivalence import assert_pipe_matches, train_steps
from pipe_checks import ATOL, RTOL, batch_for, loss_of, tiny_lm, tiny_mlp
from xpipe.models import MLPBlock, ResidualBlock, mlp_stack


@pytest.fixture(scope="module")
def mesh():
    return xpipe.make_mesh(4, 2)


def test_stale_handles_to_the_stacked_blocks_fail_loudly(mesh):
    model = tiny_mlp(blocks=4)
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # built before wrapping
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    late = torch.optim.SGD(model.parameters(), lr=0.1)  # built after, on the model instead of the pipe
    batch, targets = batch_for(model, 8)
    loss_of(pipe(batch), targets.to(pipe.devices[0])).backward()
    for optimizer in (early, late):
        with pytest.raises(RuntimeError, match=r"optimizer: this SGD holds parameters of a model that an "
                                               r"xpipe.Pipe took over and replaced by its own.*pipe.parameters\(\)"):
            optimizer.step()
    with pytest.raises(RuntimeError, match=r"module: Sequential.state_dict\(\) would return stale weights.*"
                                           r"Use pipe.state_dict\(\)"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"Use pipe.load_state_dict\(\)"):
        model.load_state_dict(pipe.state_dict())
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()  # the right handle trains


@pytest.mark.parametrize("frozen, fsdp", [((1, 2), 1), ((3,), 1), ((1, 2), 4)])
def test_frozen_blocks_stay_frozen_and_the_rest_train_as_unpipelined(mesh, frozen, fsdp):
    """AdamW with weight decay: a frozen block that received zero gradients would still
    decay. With fsdp the frozen blocks' weights (a buffer beside the trained ones) are
    sharded too."""
    model = tiny_mlp(blocks=4)
    for block in frozen:
        model[1 + block].requires_grad_(False)
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh if fsdp == 1 else xpipe.make_mesh(2, fsdp=fsdp))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.5)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.01,
                                            weight_decay=0.5)
    batch, targets = batch_for(model, 4 * pipe.runner.replicas)
    for _ in range(2):
        loss_of(pipe(batch), targets.to(pipe.devices[0])).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        loss_of(reference(batch), targets).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    initial = tiny_mlp(blocks=4).state_dict()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
        block = int(name.split(".")[0]) - 1
        if block in frozen:
            torch.testing.assert_close(value.cpu(), initial[name], rtol=0, atol=0)
    assert all(pipe.named_gradients()[f"{1 + block}.up.weight"] is None for block in frozen)
    if fsdp > 1:
        held = [b for name, b in pipe.runner.body.named_buffers() if name.endswith("__frozen")]
        assert held and all("devices=" in torch_xla._XLAC._get_xla_sharding_spec(b) for b in held)


def test_changing_requires_grad_after_wrapping_is_refused(mesh):
    model = tiny_mlp(blocks=4)
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    model[2].requires_grad_(False)
    with pytest.raises(ValueError, match="module: requires_grad of '2.norm.weight' changed after the Pipe was built"):
        pipe(batch_for(model, 8)[0])


def identity_linear(width: int) -> nn.Linear:
    linear = nn.Linear(width, width)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(width))
        linear.bias.zero_()
    return linear


class DropoutBlock(nn.Module):
    """``dropout(linear(x))``, the linear layer starting as the identity."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.linear = identity_linear(width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x))


def dropout_model(p: float, blocks: int = 4, width: int = 64) -> nn.Sequential:
    """Identity layers around ``blocks`` dropout blocks: at the start, the output of a
    row of ones is zero wherever some block dropped the element."""
    torch.manual_seed(0)
    return nn.Sequential(identity_linear(width), *(DropoutBlock(width, p) for _ in range(blocks)),
                         identity_linear(width))


@pytest.mark.parametrize("fsdp, tensor", [(1, 1), (4, 1), (2, 2)])
def test_dropout_in_the_body_drops_at_its_rate_with_a_new_mask_per_row(mesh, fsdp, tensor):
    """Four blocks of p = 0.1: an element survives with (1 - p)^4. Every row is the same
    input, in another microbatch, replica (or fsdp shard) or position, so equal masks
    would show as equal rows. With "tensor" the blocks' linear layers are split on
    their outputs, so each block drops from an activation split over the tensor group."""
    p, blocks, rows, width = 0.1, 4, 256, 64
    pipe = xpipe.Pipe(dropout_model(p, blocks, width), chunks=8,
                      mesh=mesh if fsdp == tensor == 1 else xpipe.make_mesh(2, fsdp=fsdp, tensor=tensor),
                      tensor_rules={"*.linear.*": 0})
    torch.manual_seed(1)
    with torch.no_grad():
        survived = pipe(torch.ones(rows, width)).cpu() != 0
    rate = 1 - survived.float().mean().item() ** (1 / blocks)
    assert abs(rate - p) < 0.01, f"measured dropout rate {rate:.4f}, expected {p} (over {rows * width} elements)"
    assert len({tuple(row.tolist()) for row in survived}) == rows, "every row has a mask of its own"


def test_convolution_weights_split_over_tensor_are_refused_before_they_abort_xla():
    """XLA's SPMD partitioner aborted the process (convolution_handler.cc, SIGABRT) on
    residual conv blocks split this way; kept whole, the same blocks build on the mesh."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *(ResidualBlock(16, 16) for _ in range(4)),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    mesh = xpipe.make_mesh(2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match=r"tensor_rules: the convolution weights \['1.conv1.weight', "
                                         r"'1.conv2.weight'\] would be split over 'tensor'"):
        xpipe.Pipe(copy.deepcopy(model), chunks=2, mesh=mesh, tensor_rules={"*conv*.weight": 1, "*norm*": None})
    pipe = xpipe.Pipe(model, chunks=2, mesh=mesh, tensor_rules={"*conv*.weight": None, "*norm*": None})
    assert pipe.executor == "spmd"


class ExpertsBlock(nn.Module):
    """A residual block whose weight stacks two experts, mixed by an einsum."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(2, width, width) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.einsum("bi,eij->bj", x, self.experts)


def test_block_weights_no_rule_covers_and_the_graph_cannot_split_are_refused_before_device_work():
    """No built-in rule names ``experts``, and the block's graph does not say how to
    split a weight an einsum uses: ``tensor_rules`` is asked for, the model untouched."""
    model = nn.Sequential(nn.Linear(8, 16), *(ExpertsBlock(16) for _ in range(4)), nn.Linear(16, 4))
    mesh = xpipe.make_mesh(2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match=r"tensor_rules: no rule says how tensor=2 splits the block weights "
                                         r"\['1.experts'\], and the block's graph does not tell: xpipe reads it on a "
                                         r"batch, and no sample_input= was given"):
        xpipe.Pipe(model, chunks=2, mesh=mesh)
    with pytest.raises(ValueError, match=r"\['1.experts'\], and the block's graph does not tell: the weight "
                                         r"1.experts is used by aten.einsum.default, not by a linear; give "
                                         r"Pipe\(..., tensor_rules="):
        xpipe.Pipe(model, chunks=2, mesh=mesh, sample_input=torch.randn(2, 8))
    assert all(p.device.type == "cpu" for p in model.parameters())
    pipe = xpipe.Pipe(model, chunks=2, mesh=mesh, tensor_rules={"*.experts": 0})
    assert pipe.runner.body.dims == [0]


def test_a_packed_rule_of_the_users_whose_parts_xpipe_cannot_read_is_refused_before_device_work():
    """``xpipe.Packed`` on a weight whose output the block does not take apart (an MLP's
    ``up``, which a ReLU reads whole; torch.fx captures the block as a module, and xpipe
    reads it again as operations): the rule is refused, naming ``tensor_rules``, the
    model untouched."""
    model = mlp_stack(4, 16)
    with pytest.raises(ValueError, match=r"tensor_rules: \['1.up.weight', '1.up.bias'\] are packed by your rules, "
                                         r"but 1.up.weight's packed output is used by aten.relu.default other than "
                                         r"to take it apart .*; give them a rule of None"):
        xpipe.Pipe(model, chunks=2, mesh=xpipe.make_mesh(2, fsdp=2, tensor=2), sample_input=torch.randn(2, 16),
                   tensor_rules={"*.up.*": xpipe.Packed(0)})
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_recomputed_and_kept_microbatches_get_the_same_masks(mesh):
    gradients = {}
    for checkpoint in ("always", "never"):
        model = dropout_model(0.3)
        pipe = xpipe.Pipe(model, chunks=8, mesh=mesh, checkpoint=checkpoint)
        batch = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(3)
        pipe(batch).square().mean().backward()
        torch_xla.sync()
        gradients[checkpoint] = {name: grad.cpu() for name, grad in pipe.named_gradients().items()}
    for name, kept in gradients["never"].items():
        torch.testing.assert_close(gradients["always"][name], kept, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_train_and_eval_reach_the_stacked_blocks(mesh):
    model = dropout_model(0.5)
    reference = copy.deepcopy(model).eval()
    model.eval()  # in eval mode before wrapping, as when a checkpoint is loaded for fine-tuning
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    batch = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(pipe(batch).detach().cpu(), reference(batch), rtol=RTOL, atol=ATOL)
    pipe.train()
    assert not torch.allclose(pipe(batch).detach().cpu(), reference(batch), rtol=RTOL, atol=ATOL), \
        "pipe.train() turns the blocks' dropout on"
    pipe.eval()
    torch.testing.assert_close(pipe(batch).detach().cpu(), reference(batch), rtol=RTOL, atol=ATOL)


def test_torchs_own_transformer_encoder_layers_train_with_dropout(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
                                              for _ in range(4)), nn.Linear(16, 8))
    reference = copy.deepcopy(model).eval()
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    batch = torch.randn(8, 5, 8, generator=torch.Generator().manual_seed(5))
    pipe(batch).square().mean().backward()  # train mode: dropout inside attention and the MLP
    torch_xla.sync()
    assert all(g is not None and torch.isfinite(g.cpu()).all() for g in pipe.named_gradients().values())
    pipe.eval()
    torch.testing.assert_close(pipe(batch).detach().cpu(), reference(batch), rtol=RTOL, atol=ATOL)


def test_batch_norm_before_the_body_sees_exactly_the_rows_given(mesh):
    """chunks=6 on 4 stages pads the body with two empty microbatches; BatchNorm in
    the layers before it must not count them (outputs, gradients, running statistics)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), *(MLPBlock(16) for _ in range(4)), nn.Linear(16, 4))
    batch = torch.randn(12, 8, generator=torch.Generator().manual_seed(6))
    targets = torch.randn(12, 4, generator=torch.Generator().manual_seed(7))
    assert_pipe_matches(model, batch, targets, F.mse_loss, chunks=6, mesh=mesh)


@pytest.mark.parametrize("rows", [6, 3])
def test_a_last_batch_that_does_not_split_still_runs(mesh, rows):
    model = tiny_mlp(blocks=4)
    batch, targets = batch_for(model, rows)
    assert_pipe_matches(model, batch, targets, loss_of, chunks=4, mesh=mesh)


def test_inputs_that_require_grad_get_their_gradients(mesh):
    model = tiny_mlp(blocks=4)
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    x = batch_for(model, 8)[0].requires_grad_()
    x_reference = x.detach().clone().requires_grad_()
    pipe(x).square().sum().backward()
    torch_xla.sync()
    reference(x_reference).square().sum().backward()
    torch.testing.assert_close(x.grad, x_reference.grad, rtol=RTOL, atol=ATOL)


def test_bfloat16_trains_compiles_once_and_stays_near_float32(mesh):
    """A bf16 model (weights and activations) runs through the clock loop, whose carry
    must keep its dtype; its loss stays within bf16's precision of the float32 run's."""
    model = tiny_lm()
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model.to(torch.bfloat16), chunks=4, mesh=mesh)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    batch, targets = batch_for(model, 8)
    losses, compiles = train_steps(lambda: loss_of(pipe(batch).float(), targets.to(pipe.devices[0])), optimizer)
    assert compiles[1:] == [compiles[0]] * 4, f"compiles after each step: {compiles}"
    assert pipe.runner.body.weights[0].dtype == torch.bfloat16
    expected = loss_of(reference(batch), targets).item()
    assert abs(losses[0] - expected) < 2e-2 * abs(expected), (losses[0], expected)  # bf16: 8 mantissa bits
    assert losses[-1] < losses[0]


def test_an_spmd_pipe_captures_its_model_once_and_runs_the_schedule_it_was_given(mesh, captures, schedule_builds):
    """The split, the stacked cut and the executor read one capture of the model; the
    schedule the user named is built once (for the padded microbatches) and handed to
    the executor, which runs that object."""
    pipe = xpipe.Pipe(tiny_lm(), chunks=4, mesh=mesh, schedule="circular", virtual=1)
    assert captures == ["fx"]
    assert schedule_builds == ["circular"]
    assert pipe.runner.schedule is pipe.schedule and pipe.schedule.name == "circular"


def test_a_hugging_face_spmd_pipe_is_exported_once(mesh, captures, schedule_builds):
    from hf_models import llama, tokens

    xpipe.Pipe(llama(layers=4), chunks=4, mesh=mesh, sample_input={"input_ids": tokens(4)})
    assert captures == ["fx", "export"]  # fx cannot open the model: export captures it, once
    assert schedule_builds == ["gpipe"]
