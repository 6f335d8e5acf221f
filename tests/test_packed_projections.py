"""``xpipe.tensor.packed_projections``: a block whose packed projections are split part by
part computes, from its weights laid out tensor-major, bit for bit what the plain
block computes from its own; the parts are read from where the block takes the
linear's output apart; what the graph does not show is refused, naming it."""

import pytest
import torch
from hf_models import EncoderStack, gpt2, phi3, tokens
from torch import nn
from torch.func import functional_call

from xpipe.build import ModelCapture
from xpipe.capture.stacking import block_inputs
from xpipe.capture.trace import flat_inputs
from xpipe.models import mlp_stack
from xpipe.tensor.packed_projections import CannotSplitPacked, packed_parts, split_packed, tensor_major
from xpipe.tensor.rules import Packed, tensor_splits


def lm_sample() -> dict:
    ids = tokens(2, 8)
    return {"input_ids": ids, "labels": ids}


FAMILIES = {  # the model, its sample, and the parts each packed linear holds
    "gpt2": (lambda: gpt2(2, dropout=0.0), lm_sample, {"c_attn": (32, 32, 32)}),
    "encoder": (EncoderStack, lambda: torch.randn(2, 8, 32), {"self_attn": (32, 32, 32)}),
    "phi3": (lambda: phi3(2), lm_sample, {"qkv_proj": (32, 16, 16), "gate_up_proj": (64, 64)}),  # 2 key/value heads
}


def packed_block(family: str, tensor: int):
    """``family``'s first block, split part by part for ``tensor`` devices, what was
    read, and the block's inputs on the sample (real tensors)."""
    make_model, make_sample, _ = FAMILIES[family]
    sample = make_sample()
    stacked = ModelCapture(make_model(), sample).stacked()
    block = stacked.blocks[0]
    names, shapes = zip(*[(name, p.shape) for name, p in block.named_parameters()])
    packed = [name for name, rule in zip(names, tensor_splits(names, shapes, tensor)) if isinstance(rule, Packed)]
    split, linears = split_packed(block, packed, block_inputs(stacked, sample), tensor)
    inputs = stacked.pre(*flat_inputs(sample))[:1 + len(stacked.side_rows)]
    return block, split, linears, inputs


def tensor_major_weights(block: nn.Module, linears, tensor: int) -> dict[str, torch.Tensor]:
    """``block``'s parameters, each packed one laid out tensor-major as the clock loop reads it."""
    weights = dict(block.named_parameters())
    dims = {linear.weight: linear.dim for linear in linears} | {linear.bias: 0 for linear in linears}
    for name, parts in packed_parts(linears).items():
        stored = weights[name].movedim(dims[name], 0)  # as the stacked body stores it: the split dim first
        weights[name] = tensor_major(stored.flatten(), parts, tensor).view(stored.shape).movedim(0, dims[name])
    return weights


@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_block_split_part_by_part_computes_what_the_plain_block_computes(family, tensor):
    block, split, linears, inputs = packed_block(family, tensor)
    assert {linear.weight.split(".")[-2]: linear.parts for linear in linears} == FAMILIES[family][2]
    with torch.no_grad():
        expected = block(*inputs)
        got = functional_call(split, tensor_major_weights(block, linears, tensor), inputs)
    # The split block multiplies by each part's weights apart: the same products, summed in another
    # blocking by the BLAS (4.8e-7 apart on outputs of 3.2 on an AVX-512 CPU), so to a stated tolerance.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_each_tensor_devices_share_of_a_packed_weight_holds_its_share_of_every_part():
    """q, k and v of 4, 2 and 2 features, over 2 devices: device 0 holds q's first
    half, then k's and v's; device 1 the second halves."""
    q, k, v = torch.arange(4), torch.arange(4, 6), torch.arange(6, 8)
    assert tensor_major(torch.cat([q, k, v]), (4, 2, 2), 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    stacked = torch.arange(2 * 8 * 3).view(2, 8 * 3)  # [slots, numel], each feature with 3 inputs
    moved = tensor_major(stacked, (4, 2, 2), 2).view(2, 2, 4, 3)  # [slots, device, features, inputs]
    assert moved[:, 1, :, 0].tolist() == [[6, 9, 15, 21], [30, 33, 39, 45]]


def test_heads_folded_into_the_batch_for_attention_are_unfolded():
    """``nn.MultiheadAttention`` folds q, k and v's heads into the batch dim: the split
    block makes them with one reshape and one permute instead, which XLA keeps split
    by heads with more than one row per microbatch."""
    _, split, _, _ = packed_block("encoder", 2)
    assert split.code.count("split_last(") == 3


def test_packed_weights_whose_parts_the_graph_does_not_show_are_refused_naming_them():
    sample = lm_sample()
    stacked = ModelCapture(gpt2(2, dropout=0.0), sample).stacked()
    block, inputs = stacked.blocks[0], block_inputs(stacked, sample)
    c_attn, c_fc = "transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"
    with pytest.raises(CannotSplitPacked, match=rf"{c_fc}.weight's packed output is used by aten.\w+.\w+ other "
                                                r"than to take it apart along its features"):
        split_packed(block, [f"{c_fc}.weight", f"{c_fc}.bias"], inputs, 2)
    with pytest.raises(CannotSplitPacked, match=rf"{c_attn}.bias adds to {c_attn}.weight's packed features; pack "
                                                r"it too"):
        split_packed(block, [f"{c_attn}.weight"], inputs, 2)
    with pytest.raises(CannotSplitPacked, match=rf"tensor: 64 does not divide the parts \[32, 32, 32\] packed in "
                                                rf"{c_attn}.weight"):
        split_packed(block, [f"{c_attn}.weight", f"{c_attn}.bias"], inputs, 64)
    traced = ModelCapture(mlp_stack(4, 16), torch.randn(2, 16)).stacked()  # torch.fx: each block a module
    with pytest.raises(CannotSplitPacked, match=r"captured the block as a module \(torch.fx\)"):
        split_packed(traced.blocks[0], ["1.up.weight", "1.up.bias"], block_inputs(traced, torch.randn(2, 16)), 2)
