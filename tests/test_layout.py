"""Mesh layouts and the memory model, as plain data: no device is touched."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch_xla.distributed.spmd as xs

from torch import nn

from xpipe.layout import MeshAxes, outer_spec, outer_step_spec, shard_numel, stacked_spec, stored_shape
from xpipe.mesh import axes_of, mesh_axes
from xpipe.planner.memory import per_device
from xpipe.tensor.rules import (Packed, check_head_counts, check_rules, key_value_heads_of, tensor_dims,
                                tensor_splits, with_shared_key_values)

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
    assert memory.kept_per_clock == 4 * 1024 * 4  # the clock loop keeps the stage's gathered body each clock
    replicated = per_device(stacked=[(2, 4, 1024)], outer=[(128, 32)], axes=MeshAxes(stage=2, data=4))
    assert replicated.parameters == (4 * 1024 + 128 * 32) * 4
    per_block = per_device(stacked=[(2, 4, 1024)], outer=[(128, 32)], axes=FSDP, gather="block")
    assert per_block.resting == memory.resting
    # one block slot's weight and the embedding, without gradients: the per-block peak is the forward loop's
    assert per_block.gathered == (1024 + 128 * 32) * 4
    assert per_block.kept_per_clock == 1024 * 4  # each device's resting shard of the stage's body


@pytest.mark.parametrize("arguments, refusal", [
    (dict(stacked=[(16, 24)]), r"stacked: each stacked body weight is \[stages, slots, numel\] = \[2, V \* K, "
                               r"numel\] on this mesh, got \[\[16, 24\]\]; pass each block parameter as"),
    (dict(stacked=[(4, 4, 1024)]), r"stacked: .* got \[\[4, 4, 1024\]\]"),
    (dict(outer=[(128, 0)]), r"outer: each shape is a sequence of positive ints, got \(128, 0\)"),
    (dict(axes=(2, 4)), r"axes: expected a xpipe.layout.MeshAxes, got tuple"),
    (dict(split=[True, False]), r"split: one True or False per stacked weight \(at most 1\)"),
    (dict(itemsize=0), r"itemsize: must be a positive integer, got 0"),
    (dict(optimizer_states=-1), r"optimizer_states: the tensors the optimizer keeps per weight, a whole number >= 0"),
    (dict(optimizer_itemsize=2.5), r"optimizer_itemsize: must be a positive integer, got 2.5"),
    (dict(gather="layer"), r"gather: 'layer' is not a choice; use one of 'step', 'block'"),
])
def test_the_memory_model_refuses_arguments_it_cannot_count(arguments, refusal):
    """A block's own shapes where stacked ones belong were counted (2256 bytes for 576)."""
    with pytest.raises(ValueError, match=refusal):
        per_device(**{**dict(stacked=[(2, 4, 1024)], outer=[(128, 32)], axes=FSDP), **arguments})


def test_mesh_sizes_that_do_not_fill_the_devices_are_refused_with_the_sizes_that_do():
    assert mesh_axes(2, fsdp=4) == MeshAxes(stage=2, data=1, fsdp=4)
    assert mesh_axes(2, 2, fsdp=2).devices == 8
    with pytest.raises(ValueError, match=r"stages=3 x data=1 x fsdp=2 x tensor=1 needs 6 devices but there are 8"):
        mesh_axes(3, 1, fsdp=2)
    with pytest.raises(ValueError, match=r"fsdp: fsdp=3 x tensor=1 does not divide the 8 devices"):
        mesh_axes(2, 1, fsdp=3)
    with pytest.raises(ValueError, match=r"fsdp: must be a positive integer, got 0"):
        mesh_axes(2, fsdp=0)


def test_a_mesh_with_other_axes_is_refused_naming_the_axes_it_needs():
    assert axes_of(xs.Mesh(np.arange(8), (2, 4), ("stage", "fsdp"))) == MeshAxes(stage=2, fsdp=4)
    assert axes_of(xs.Mesh(np.arange(8), (2, 2, 2), ("stage", "fsdp", "tensor"))) == MeshAxes(2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"mesh: expected a mesh with a 'stage' axis and optionally 'data', "
                                         r"'fsdp' and 'tensor', got \('data', 'model'\)"):
        axes_of(xs.Mesh(np.arange(8), (2, 4), ("data", "model")))
    with pytest.raises(ValueError, match=r"mesh: expected"):
        axes_of("2x4")


TENSOR = MeshAxes(stage=2, data=1, fsdp=2, tensor=2)


def test_with_a_tensor_axis_weights_rest_sharded_over_tensor_then_fsdp():
    assert stacked_spec(TENSOR) == ("stage", None, ("tensor", "fsdp"))
    assert stacked_spec(MeshAxes(stage=2, tensor=4)) == ("stage", None, "tensor")
    assert outer_spec((128, 32), TENSOR) == (("stage", "tensor", "fsdp"), None)
    assert stored_shape((64, 32), 1) == (32, 64)  # the split dim first, so that its slices are contiguous
    assert stored_shape((64, 32), 0) == stored_shape((64, 32), None) == (64, 32)
    assert mesh_axes(2, fsdp=2, tensor=2) == TENSOR and TENSOR.row_groups == 2 and TENSOR.per_stage == 4
    with pytest.raises(ValueError, match=r"stages=2 x data=4 x fsdp=1 x tensor=2 needs 16 devices but there are 8"):
        mesh_axes(2, 4, tensor=2)


def test_the_memory_model_counts_a_tensor_devices_share_of_the_split_weights_in_a_step():
    split = per_device(stacked=[(2, 4, 1024)], outer=[], axes=TENSOR, split=[True])
    whole = per_device(stacked=[(2, 4, 1024)], outer=[], axes=TENSOR)
    assert split.parameters == whole.parameters == 4 * 256 * 4  # at rest: a quarter of a stage's slice
    assert split.gathered == 2 * 4 * 512 * 4 and whole.gathered == 2 * 4 * 1024 * 4


def test_a_step_holds_the_vocabulary_tables_split_over_tensor_and_the_other_outer_weights_whole():
    """Megatron's vocabulary-parallel embedding and head: a table longer than it is wide
    stays split by rows over "tensor" for the step; the memory model counts that share."""
    assert outer_step_spec((128, 32), TENSOR) == ("tensor", None)
    assert outer_step_spec((32, 32), TENSOR) == (None, None)  # not a vocabulary: a square dense layer
    assert outer_step_spec((32,), TENSOR) == (None,)
    assert outer_step_spec((129, 32), TENSOR) == (None, None)  # 2 does not divide 129: whole
    assert outer_step_spec((128, 32), FSDP) == (None, None)  # no "tensor": whole
    memory = per_device(stacked=[(2, 4, 1024)], outer=[(128, 32), (32,)], axes=TENSOR)
    assert memory.gathered == 2 * (4 * 1024 + 64 * 32 + 32) * 4


LLAMA_BLOCK = {"model.layers.0.self_attn.q_proj.weight": (32, 32), "model.layers.0.self_attn.k_proj.weight": (16, 32),
               "model.layers.0.self_attn.o_proj.weight": (32, 32), "model.layers.0.mlp.down_proj.weight": (32, 64),
               "model.layers.0.input_layernorm.weight": (32,)}


def test_built_in_rules_split_column_parallel_weights_on_outputs_and_row_parallel_on_inputs():
    assert tensor_dims(LLAMA_BLOCK, LLAMA_BLOCK.values(), 2) == [0, 0, 1, 1, None]
    assert tensor_dims(LLAMA_BLOCK, LLAMA_BLOCK.values(), 1) == [None] * 5
    gpt2 = {"transformer.h.0.attn.c_attn.weight": (32, 96), "transformer.h.0.mlp.c_fc.weight": (32, 128),
            "transformer.h.0.mlp.c_proj.weight": (128, 32)}  # Conv1D: [in, out]; q, k, v one after the other
    assert tensor_splits(gpt2, gpt2.values(), 2) == [Packed(1), 1, 0]
    assert tensor_dims(gpt2, gpt2.values(), 2) == [1, 1, 0]
    encoder = {"layers.0.self_attn.in_proj_weight": (96, 32), "layers.0.linear1.weight": (64, 32),
               "layers.0.linear2.weight": (32, 64), "layers.0.norm1.weight": (32,)}
    assert tensor_splits(encoder, encoder.values(), 2) == [Packed(0), 0, 1, None]


def test_built_in_rules_cover_opt_gpt_neox_and_the_experts_of_mixtral_and_qwen2_moe():
    opt = {"model.decoder.layers.0.self_attn.q_proj.bias": (32,),
           "model.decoder.layers.0.self_attn.out_proj.weight": (32, 32), "model.decoder.layers.0.fc1.weight": (64, 32),
           "model.decoder.layers.0.fc2.weight": (32, 64), "model.decoder.layers.0.fc2.bias": (32,)}
    assert tensor_dims(opt, opt.values(), 2) == [0, 1, 0, 1, None]
    neox = {"gpt_neox.layers.0.attention.query_key_value.weight": (96, 32),  # packed per head: whole heads split
            "gpt_neox.layers.0.attention.dense.weight": (32, 32), "gpt_neox.layers.0.mlp.dense_h_to_4h.bias": (64,),
            "gpt_neox.layers.0.mlp.dense_4h_to_h.weight": (32, 64)}
    assert tensor_dims(neox, neox.values(), 2) == [0, 1, 0, 1]
    moe = {"model.layers.0.mlp.gate.weight": (4, 32), "model.layers.0.mlp.experts.gate_up_proj": (4, 128, 32),
           "model.layers.0.mlp.experts.down_proj": (4, 32, 64),
           "model.layers.0.mlp.shared_expert.up_proj.weight": (64, 32),
           "model.layers.0.mlp.shared_expert.down_proj.weight": (32, 64),
           "model.layers.0.mlp.shared_expert_gate.weight": (1, 32)}
    assert tensor_dims(moe, moe.values(), 2) == [None, 0, 0, 0, 1, None]  # whole experts per device


def test_a_users_rules_come_before_the_built_in_ones():
    rules = {"*.q_proj.weight": None, "*.extra": 1}
    assert tensor_dims([*LLAMA_BLOCK, "block.extra"], [*LLAMA_BLOCK.values(), (4, 8)], 2, rules) == \
        [None, 0, 1, 1, None, 1]


def test_weights_no_rule_covers_or_whose_split_dim_does_not_divide_are_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor_rules: no rule says how tensor=2 splits the block weights "
                                         r"\['block.gate.weight'\]; give Pipe\(..., tensor_rules="):
        tensor_dims(["block.gate.weight"], [(8, 8)], 2)
    with pytest.raises(ValueError, match=r"tensor: 4 does not divide the split dim of "
                                         r"\['model.layers.0.self_attn.k_proj.weight \[6, 32\] \(dim 0\)'\]"):
        tensor_dims(["model.layers.0.self_attn.k_proj.weight"], [(6, 32)], 4)
    with pytest.raises(TypeError, match=r"tensor_rules: expected a dict of parameter-name patterns"):
        check_rules({"*.q_proj.weight": "rows"})
    with pytest.raises(TypeError, match=r"Packed: dim must be an int >= 0"):
        Packed(-1)
    assert check_rules({"*.qkv.weight": Packed(0)}) == {"*.qkv.weight": Packed(0)}


def test_a_tensor_size_that_does_not_divide_the_heads_is_refused_naming_them():
    layer = nn.TransformerEncoderLayer(12, 3, 16, batch_first=True)
    with pytest.raises(ValueError, match=r"tensor: 2 does not divide the model's attention heads "
                                         r"\{'self_attn.num_heads': 3\}"):
        check_head_counts(layer, 2)
    check_head_counts(layer, 3)


def test_key_value_heads_the_tensor_size_does_not_divide_are_kept_whole_unless_the_user_says():
    """Grouped-query attention with fewer key/value heads than tensor devices (a
    Llama 3 70B's 8 on 16, Falcon's one): its query heads decide, and the key and
    value projections are kept whole, Megatron's way; a rule of the user's still wins."""
    model = nn.Module()
    model.config = SimpleNamespace(num_attention_heads=16, num_key_value_heads=8)
    check_head_counts(model, 16)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.o_proj.weight"]
    shapes = [(2048, 1024), (1024, 1024), (1024,), (1024, 2048)]
    heads = key_value_heads_of(model)
    assert tensor_dims(names, shapes, 16, with_shared_key_values(None, heads, 16)) == [0, None, None, 1]
    assert tensor_dims(names, shapes, 8, with_shared_key_values(None, heads, 8)) == [0, 0, 0, 1]
    users = with_shared_key_values({"*.k_proj.weight": 0}, heads, 16)
    assert tensor_dims(names, shapes, 16, users) == [0, 0, None, 1]
    packed = ["model.layers.0.self_attn.qkv_proj.weight"]  # Phi-3: its key/value heads packed with its queries
    assert tensor_splits(packed, [(4096, 1024)], 16, with_shared_key_values(None, heads, 16)) == [None]
    assert tensor_splits(packed, [(4096, 1024)], 8, with_shared_key_values(None, heads, 8)) == [Packed(0)]
    with pytest.raises(ValueError, match=r"tensor: 32 does not divide the model's attention heads "
                                         r"\{'config.num_attention_heads': 16\}"):
        check_head_counts(model, 32)
