"""Pipe's contract beyond the numbers: state dicts, loader-shaped input, compiles, bad input."""

import copy

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.runtime as xr

import xpipe
from xpipe.models import small_cnn
from equivalence import assert_step_matches, train_steps
from pipe_checks import ATOL, RTOL, batch_for, loss_of, tiny_lm, tiny_mlp


@pytest.fixture(scope="module")
def mesh():
    return xpipe.make_mesh(4, 2)


def test_state_dict_has_the_modules_keys_and_shapes(mesh):
    model = tiny_lm()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    assert {k: tuple(v.shape) for k, v in pipe.state_dict().items()} == expected
    assert list(pipe.state_dict()) == list(expected)


def test_load_state_dict_takes_another_models_weights(mesh):
    source = tiny_lm()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    pipe = xpipe.Pipe(tiny_lm(), chunks=4, mesh=mesh)
    pipe.load_state_dict(source.state_dict())
    batch, _ = batch_for(source, 8)
    torch.testing.assert_close(pipe(batch).cpu(), source(batch).detach(), rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match=r"state_dict: missing keys \['head.weight'\]"):
        pipe.load_state_dict({k: v for k, v in source.state_dict().items() if k != "head.weight"})


@pytest.mark.parametrize("microbatch_dim", [0, 1])
def test_loader_shaped_input_gives_the_same_rows(mesh, microbatch_dim):
    model = tiny_mlp()
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=8, mesh=mesh)
    batch, _ = batch_for(reference, 8 * 4)  # 8 microbatches of 4 rows
    stacked = batch.view(8, 4, -1).movedim(0, microbatch_dim)
    output = pipe(stacked, microbatch_dim=microbatch_dim)
    expected = reference(batch).view(8, 4, -1).movedim(0, microbatch_dim)
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)


def test_five_training_steps_compile_once(mesh):
    model = tiny_lm()
    pipe = xpipe.Pipe(model, chunks=8, mesh=mesh)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    batch, targets = batch_for(model, 16)
    targets = targets.to(torch_xla.device())
    _, compiles = train_steps(lambda: loss_of(pipe(batch), targets), optimizer)
    assert compiles[1:] == [compiles[0]] * 4


def test_bad_arguments_name_themselves(mesh):
    with pytest.raises(ValueError, match="chunks: must be a positive integer, got 0"):
        xpipe.Pipe(tiny_mlp(), chunks=0, mesh=mesh)
    with pytest.raises(ValueError, match="checkpoint: 'sometimes' is not a mode"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, checkpoint="sometimes")
    with pytest.raises(ValueError, match="executor: 'gpu' is not an executor"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, executor="gpu")
    with pytest.raises(ValueError, match="schedule: 'zb' is not a schedule"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, schedule="zb")
    with pytest.raises(ValueError, match="schedule: the spmd executor runs 'gpipe', 'circular' and '1f1b'"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, schedule="interleaved", virtual=2)
    with pytest.raises(ValueError, match=r"stages: the model's body \(its longest run of identical blocks\) "
                                         r"has 3 blocks, fewer than the 4 stages; use at most 3 stages, or "
                                         r"executor='devices'"):
        xpipe.Pipe(tiny_mlp(blocks=3), chunks=2, mesh=mesh)
    with pytest.raises(ValueError, match="stages: 2 does not match the mesh's 'stage' axis of 4"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, stages=2)
    with pytest.raises(ValueError, match="executor: this process is in SPMD mode, where the 'devices' executor"):
        xpipe.Pipe(small_cnn(), chunks=2, executor="devices")
    with pytest.raises(ValueError, match="module: has no run of identical blocks"):
        xpipe.Pipe(small_cnn(), chunks=2)  # auto: an SPMD process runs spmd
    with pytest.raises(ValueError, match=r"balance: the spmd executor spreads the 8 blocks evenly, which gives "
                                         r"balance=\[3, 2, 2, 3\]"):
        xpipe.Pipe(tiny_mlp(), chunks=2, mesh=mesh, balance=[1, 3, 3, 3])


def test_bad_batches_name_the_fix(mesh):
    pipe = xpipe.Pipe(tiny_mlp(), chunks=4, mesh=mesh)
    with pytest.raises(ValueError, match="microbatch_dim: input of shape \\[3, 8, 8\\] has no dim 0 of size chunks=4"):
        pipe(torch.zeros(3, 8, 8), microbatch_dim=0)


def test_make_mesh_says_which_stage_counts_fit():
    with pytest.raises(ValueError, match=r"use stages in \[1, 2, 4, 8\]"):
        xpipe.make_mesh(3)
    assert xpipe.make_mesh(2).mesh_shape == (4, 2)


def emulate_slices(monkeypatch, slice_of) -> None:
    """Give the 8 CPU devices a ``slice_index``, as a multislice TPU runtime reports it."""
    attributes = [{"name": f"CPU:{i}", "slice_index": slice_of(i)} for i in range(8)]
    monkeypatch.setattr(xr, "global_runtime_device_attributes", lambda: attributes)


@pytest.mark.parametrize("sizes", [dict(stages=2, fsdp=2, tensor=2), dict(stages=4, fsdp=2), dict(stages=2, data=4)])
def test_over_2_slices_of_4_devices_only_stage_neighbours_cross_a_slice(monkeypatch, sizes):
    emulate_slices(monkeypatch, lambda device: device % 2)  # interleaved: the attribute decides, not the ids
    mesh = xpipe.make_mesh(**sizes, slices=2)
    grid = np.array(mesh.device_ids).reshape(mesh.mesh_shape)  # (data, stage[, fsdp][, tensor])
    stages = sizes["stages"]
    slice_of_stage = [{device % 2 for device in grid[:, stage].flatten()} for stage in range(stages)]
    assert slice_of_stage == [{stage * 2 // stages} for stage in range(stages)], "a stage's groups share a slice"
    crossings = [(a, b) for a, b in zip(range(stages - 1), range(1, stages)) if slice_of_stage[a] != slice_of_stage[b]]
    assert len(crossings) == 1, "one stage boundary crosses the slices; the ring's wrap-around is the other"
    assert sorted(grid.flatten()) == list(range(8))


def test_a_pipe_on_two_slices_equals_the_plain_model(monkeypatch):
    emulate_slices(monkeypatch, lambda device: device % 2)
    model = tiny_mlp(4)
    batch, target = batch_for(model, 16)
    assert_step_matches(model, batch, target, loss_of, chunks=4, mesh=xpipe.make_mesh(2, fsdp=4, slices=2))


def test_slices_that_a_stage_would_straddle_or_the_devices_do_not_have_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="slices: slices=2 but these devices carry no slice_index"):
        xpipe.make_mesh(2, fsdp=4, slices=2)
    emulate_slices(monkeypatch, lambda device: device // 4)
    with pytest.raises(ValueError, match="slices: 2 slices do not divide stages=1: a stage would straddle"):
        xpipe.make_mesh(1, fsdp=8, slices=2)
    with pytest.raises(ValueError, match="slices: slices=4, but the devices form 2 slices of 4 devices"):
        xpipe.make_mesh(4, fsdp=2, slices=4)


@pytest.mark.parametrize("checkpoint", [pytest.param("always", marks=pytest.mark.full), "except_last",
                                        pytest.param("never", marks=pytest.mark.full)])
def test_step_with_the_loss_inside_equals_the_plain_model(mesh, checkpoint):
    """``pipe.step`` under spmd runs GPipe: the loss and every gradient as the plain
    model's; 7 blocks on 4 stages (the body padded)."""
    model = tiny_lm(blocks=7)
    batch, targets = batch_for(model, 8)
    assert_step_matches(model, batch, targets, loss_of, chunks=4, mesh=mesh, checkpoint=checkpoint)
