"""The planner on the models Pipe runs: the families' configs and captured models
profiled as Pipe stacks and splits them, and every layout it lists one that Pipe's
build accepts (tests/test_plan.py holds the planner's arithmetic and its command)."""

import math

import pytest
import torch
from hf_models import EncoderStack, bert, gpt2, llama, tokens
from tiers import in_full_tier

import xpipe
from xpipe.planner.profile import profile_of_config, profile_of_model
from xpipe.tensor.rules import Packed


def test_configs_of_the_families_pipe_runs_are_planned():
    """GPT-2 names its MLP width n_inner (None: four times the hidden size), OPT ffn_dim."""
    from transformers import GPT2Config, OPTConfig

    planned = xpipe.plan(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1000), devices=8, batch=16, seq=128)
    assert planned.fitting and planned.profile.blocks == 4
    explicit = GPT2Config(n_layer=4, n_embd=64, n_head=4, n_inner=256, vocab_size=1000)
    assert profile_of_config(explicit, 128).block_saved_bytes_per_row == \
        profile_of_config(GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1000), 128).block_saved_bytes_per_row
    opt = OPTConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, ffn_dim=128, vocab_size=1000,
                    word_embed_proj_dim=64)
    assert xpipe.plan(opt, devices=8, batch=16, seq=128).fitting


def test_a_mixture_of_experts_block_saves_every_experts_activations():
    """xpipe runs every expert on every token (:mod:`xpipe.capture.experts`): a block of 4
    experts of width 128 saves, per token, what a dense MLP of width 512 would."""
    from transformers import LlamaConfig, MixtralConfig

    shape = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 1000}
    moe = profile_of_config(MixtralConfig(**shape, intermediate_size=128, num_local_experts=4), 64)
    dense = profile_of_config(LlamaConfig(**shape, intermediate_size=512), 64)
    assert moe.block_saved_bytes_per_row == dense.block_saved_bytes_per_row


def test_a_model_no_rule_names_is_planned_on_tensor_meshes_with_the_splits_its_graph_tells():
    """xpipe's own LM names its linears ``qkv``, ``proj``, ``up``, ``down``: its profile
    carries the splits read from its block's graph, so tensor layouts are planned,
    the packed ``qkv`` read as packed and planned split, as ``Pipe`` splits it part by
    part (``ModelProfile.tensor_dims``)."""
    from xpipe.models import transformer_lm

    model = transformer_lm(blocks=4, width=32, heads=4, seq=8, vocab=64)
    profile = profile_of_model(model, torch.zeros(2, 8, dtype=torch.long))
    assert dict(profile.read_tensor_dims)["blocks.0.qkv.weight"] == Packed(0)
    dims = dict(zip([name for name, _ in profile.block_weights], profile.tensor_dims(2)))
    assert dims["blocks.0.qkv.weight"] == 0
    assert dict(profile.read_tensor_dims)["blocks.0.up.weight"] == 0
    result = xpipe.plan(profile, devices=8, batch=16)
    assert any(p.layout.tensor > 1 for p in result.fitting)
    assert profile_of_model(llama(4), {"input_ids": tokens(2, 8)}).read_tensor_dims == ()  # the built-in rules name all


def test_key_value_heads_the_tensor_size_does_not_divide_are_planned_whole_as_pipe_keeps_them():
    """One key/value head for 4 query heads (multi-query attention): tensor layouts are
    planned, as ``Pipe`` runs them, with the key and value projections whole on every
    tensor device and the other matrices split."""
    profile = profile_of_config(llama(4, kv_heads=1).config, seq=8, itemsize=4)
    assert profile.heads == (4,) and profile.key_value_heads == 1
    dims = dict(zip([name for name, _ in profile.block_weights], profile.tensor_dims(2)))
    kept = [name.rsplit(".", 2)[-2] for name, dim in dims.items() if dim is None and "proj" in name]
    assert kept == ["k_proj", "v_proj"]
    assert any(p.layout.tensor == 2 for p in xpipe.plan(profile, devices=8, batch=16).fitting)


def test_sequence_parallelism_is_not_planned_for_a_stream_without_a_sequence_dim():
    """An MLP stack passes [batch, features]: Pipe refuses sequence_parallel=True for it."""
    from xpipe.models import mlp_stack

    with pytest.raises(ValueError, match=r"sequence_parallel: Sequential.s blocks pass a stream of 2 dims"):
        xpipe.plan(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), devices=8, batch=16,
                   sample_input=torch.randn(2, 8), sequence_parallel=True)


def test_gemma2_is_planned_as_pipe_stacks_it_a_sliding_and_a_global_layer_a_block():
    """Its layers alternate two masks: Pipe stacks them two at a time, and the plan
    counted twice as many blocks (so it listed stage counts Pipe refuses)."""
    from hf_models import gemma2

    from xpipe.build import ModelCapture

    model = gemma2(4)
    stacked = ModelCapture(model, {"input_ids": tokens(2, 8)}).stacked()
    profile = profile_of_config(model.config, seq=8, itemsize=4)
    assert profile.blocks == len(stacked.blocks) == 2
    assert sum(math.prod(shape) for _, shape in profile.block_weights) == \
        sum(p.numel() for p in stacked.blocks[0].parameters())
    assert all(p.layout.stages <= 2 for p in xpipe.plan(model.config, devices=8, batch=16, seq=8).refused)


PLANNED_MODELS = {
    "llama": lambda: (llama(4), {"input_ids": tokens(2, 8)}),
    "encoder": lambda: (EncoderStack(), torch.randn(2, 8, 32)),
}


@pytest.mark.parametrize("family", ["llama", in_full_tier("encoder")])
def test_every_layout_the_planner_lists_is_one_pipe_builds(family):
    """Each layout, fitting or not, passes every check the spmd executor makes before
    it touches a device (``xpipe.build.checked_spmd_layout``, which Pipe's build runs),
    with sequence parallelism and without."""
    from xpipe.build import ModelCapture, Options, checked_spmd_layout
    from xpipe._checks import check_gather
    from xpipe.tensor.rules import check_rules

    model, sample = PLANNED_MODELS[family]()
    capture = ModelCapture(model, sample)
    fewest_chunks = {}  # what the checks read of a layout; of its chunk counts, the fewest (the ring's bound)
    for sequence_parallel in (False, True):
        planned = xpipe.plan(model, devices=8, batch=16, sample_input=sample, sequence_parallel=sequence_parallel)
        for layout in (p.layout for p in planned.fitting + planned.refused):
            check_gather(layout.gather, layout.checkpoint)  # Pipe's own, before the build
            key = (layout.stages, layout.tensor, layout.schedule, layout.virtual, layout.sequence_parallel)
            fewest_chunks[key] = min(fewest_chunks.get(key, layout.chunks), layout.chunks)
    for (stages, tensor, schedule, virtual, sequence_parallel), chunks in fewest_chunks.items():
        options = Options(chunks, stages, None, None, schedule, virtual, "always", False, check_rules(None), "step",
                          sequence_parallel)
        checked_spmd_layout(capture, options, stages, tensor)
    assert len(fewest_chunks) > 8


SPLIT_FAMILIES = {
    "llama": lambda: (llama(4), {"input_ids": tokens(2, 8)}),
    "llama-one-kv-head": lambda: (llama(4, kv_heads=1), {"input_ids": tokens(2, 8)}),
    "gpt2": lambda: (gpt2(4), {"input_ids": tokens(2, 8)}),
    "bert": lambda: (bert(4), {"input_ids": tokens(2, 8)}),
    "encoder": lambda: (EncoderStack(), torch.randn(2, 8, 32)),
}


@pytest.mark.parametrize("family", ["llama", "encoder",
                                    *(in_full_tier(f) for f in ("llama-one-kv-head", "gpt2", "bert"))])
def test_the_plan_holds_each_block_weight_split_as_the_pipe_splits_it(family):
    """Both read xpipe.tensor.splits.block_splits: the profile with what it read of the
    block's graph, the build on the sample input."""
    from xpipe.build import ModelCapture, block_tensor_splits
    from xpipe.tensor.rules import split_dim

    model, sample = SPLIT_FAMILIES[family]()
    profile = profile_of_model(model, sample)
    capture = ModelCapture(model, sample)
    for tensor in (2, 4):
        assert profile.tensor_dims(tensor) == [split_dim(r) for r in block_tensor_splits(capture, tensor, None)]
