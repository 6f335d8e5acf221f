"""Mesh layouts and the memory model, as plain data: no device is touched."""

import numpy as np
import pytest
import torch_xla.distributed.spmd as xs

from xpipe.layout import MeshAxes, outer_spec, shard_numel, stacked_spec
from xpipe.memory import per_device
from xpipe.mesh import axes_of, mesh_axes

FSDP = MeshAxes(stage=2, data=1, fsdp=4)


def test_outer_weights_are_sharded_over_stage_and_fsdp_on_their_largest_dim_that_divides():
    assert outer_spec((128, 32), FSDP) == (("stage", "fsdp"), None)
    assert outer_spec((12, 64), FSDP) == (None, ("stage", "fsdp"))  # 12 does not divide by 8
    assert outer_spec((12,), FSDP) == (("fsdp",),)  # by 4 only
    assert outer_spec((6, 3), FSDP) == (None, None)  # too small for either
    assert outer_spec((128, 32), MeshAxes(stage=2, data=4)) == (None, None)  # no fsdp: replicated, as before
    assert outer_spec((), FSDP) == ()


def test_stacked_weights_take_fsdp_on_the_flattened_weight():
    assert stacked_spec(FSDP) == ("stage", None, "fsdp")
    assert stacked_spec(MeshAxes(stage=4, data=2)) == ("stage", None, None)


def test_shard_sizes_round_up_as_xla_pads():
    assert shard_numel((2, 4, 1024), stacked_spec(FSDP), FSDP) == 4 * 256
    assert shard_numel((2, 3, 10), stacked_spec(FSDP), FSDP) == 3 * 3  # 10 / 4 -> 3, padded
    assert shard_numel((128, 32), (("stage", "fsdp"), None), FSDP) == 16 * 32


def test_the_memory_model_on_a_literal_example():
    """One stacked weight [2, 4, 1024] and an embedding [128, 32] on 2 stages x 4 fsdp,
    float32, AdamW: 1024 + 512 elements per device at rest."""
    memory = per_device(stacked=[(2, 4, 1024)], outer=[(128, 32)], axes=FSDP)
    assert (memory.parameters, memory.gradients, memory.optimizer) == (6144, 6144, 12288)
    assert memory.resting == 24576
    assert memory.gathered == 2 * (4 * 1024 + 128 * 32) * 4  # a stage's body and the embedding, with gradients
    replicated = per_device(stacked=[(2, 4, 1024)], outer=[(128, 32)], axes=MeshAxes(stage=2, data=4))
    assert replicated.parameters == (4 * 1024 + 128 * 32) * 4


def test_mesh_sizes_that_do_not_fill_the_devices_are_refused_with_the_sizes_that_do():
    assert mesh_axes(2, fsdp=4) == MeshAxes(stage=2, data=1, fsdp=4)
    assert mesh_axes(2, 2, fsdp=2).devices == 8
    with pytest.raises(ValueError, match=r"stages=2 x data=1 x fsdp=3 needs 6 devices but there are 8"):
        mesh_axes(2, 1, fsdp=3)
    with pytest.raises(ValueError, match=r"fsdp: must be a positive integer, got 0"):
        mesh_axes(2, fsdp=0)


def test_a_mesh_with_other_axes_is_refused_naming_the_axes_it_needs():
    assert axes_of(xs.Mesh(np.arange(8), (2, 4), ("stage", "fsdp"))) == MeshAxes(stage=2, fsdp=4)
    with pytest.raises(ValueError, match=r"mesh: expected a mesh with a 'stage' axis and optionally 'data' and "
                                         r"'fsdp', got \('data', 'model'\)"):
        axes_of(xs.Mesh(np.arange(8), (2, 4), ("data", "model")))
    with pytest.raises(ValueError, match=r"mesh: expected"):
        axes_of("2x4")
