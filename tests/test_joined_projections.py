"""``xpipe.tensor.joined_projections``: the column-parallel linears of a block that read the
same input run as one linear on their joined weights, and the block computes, and
differentiates, what the plain block does; linears split otherwise, or kept whole,
are left as they are."""

import pytest
import torch
from hf_models import bert, gpt2, llama, tokens
from torch.func import functional_call

from xpipe.build import ModelCapture
from xpipe.capture.trace import flat_inputs
from xpipe.tensor.joined_projections import join_column_parallel, joined
from xpipe.tensor.rules import split_dim, tensor_splits


def block_of(model):
    """``model``'s first block, its split dims for 2 tensor devices by the built-in
    rules, and its inputs on a sample (real tensors)."""
    sample = {"input_ids": tokens(2, 8)}
    stacked = ModelCapture(model, sample).stacked()
    block = stacked.blocks[0]
    names, shapes = zip(*[(name, p.shape) for name, p in block.named_parameters()])
    dims = dict(zip(names, map(split_dim, tensor_splits(names, shapes, 2))))
    return block, dims, stacked.pre(*flat_inputs(sample))[:1 + len(stacked.side_rows)]


def short(groups) -> list[tuple[str, ...]]:
    return [tuple(name.split(".")[-2] for name in group) for group in groups]


@pytest.mark.parametrize("tensor", [2, 4])
def test_llamas_q_k_v_and_gate_up_run_as_two_linears_equal_to_the_plain_block(tensor):
    """Llama's q, k and v projections read the same normed stream, its gate and up
    the same: each group runs as one linear, and the block's output and every
    weight's gradient equal the plain block's (the joined matmul adds the same products,
    in the blocking the BLAS picks for the wider matrix: to a stated tolerance)."""
    block, dims, inputs = block_of(llama(2, heads=4, kv_heads=4))
    joined_block, groups = join_column_parallel(block, dims, tensor)
    assert short(groups) == [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]
    linears = [node for node in joined_block.graph.nodes if node.target is torch.ops.aten.linear.default]
    assert len(linears) == 4  # the joined two, o_proj and down_proj
    weights = {name: p.detach().clone().requires_grad_() for name, p in block.named_parameters()}
    expected, got = (functional_call(module, weights, inputs) for module in (block, joined_block))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(weights.values()))
    got_grads = torch.autograd.grad(got.square().sum(), list(weights.values()))
    for name, want, have in zip(weights, expected_grads, got_grads):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-7, msg=name)


def test_biases_join_with_their_weights():
    """BERT's q, k and v add biases: the joined linear adds them, joined the same way."""
    block, dims, inputs = block_of(bert(2))
    joined_block, groups = join_column_parallel(block, dims, 2)
    assert short(groups) == [("query", "key", "value")]
    with torch.no_grad():
        torch.testing.assert_close(joined_block(*inputs), block(*inputs), rtol=1e-5, atol=1e-6)


def test_only_linears_split_by_their_output_features_join():
    """Key and value projections kept whole (a key/value head count "tensor" does not
    divide) leave q on its own; GPT-2's linears each read their own input; with
    nothing to join, the block is returned as it is."""
    block, dims, _ = block_of(llama(2, heads=4, kv_heads=1))
    dims = {name: None if "k_proj" in name or "v_proj" in name else dim for name, dim in dims.items()}
    _, groups = join_column_parallel(block, dims, 2)
    assert short(groups) == [("gate_proj", "up_proj")]
    block, dims, _ = block_of(gpt2(2))
    assert join_column_parallel(block, dims, 2) == (block, [])


def test_joined_weights_hold_each_devices_share_of_every_weight_in_turn():
    """q of 4 features and k of 2, over 2 devices: device 0's half holds q's first
    half then k's; device 1's the second halves."""
    q, k = torch.arange(4).view(4, 1), torch.arange(4, 6).view(2, 1)
    assert joined([q, k], 2).flatten().tolist() == [0, 1, 4, 2, 3, 5]


def test_a_bias_given_by_name_is_joined_not_dropped():
    """``aten.linear`` with its bias as a keyword: the joined linear adds it too (to
    float32 rounding: the joined matmul's sums run in another order here; a dropped
    bias would be off by the bias, about 0.1)."""
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)

        def forward(self, x):
            return torch.ops.aten.linear.default(x, self.q.weight, bias=self.q.bias) * \
                torch.ops.aten.linear.default(x, self.k.weight, bias=self.k.bias)

    block = torch.fx.symbolic_trace(TwoHeads())
    dims = {name: 0 for name, _ in block.named_parameters()}
    joined_block, groups = join_column_parallel(block, dims, 2)
    assert groups == [("q.weight", "k.weight")]
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(joined_block(x), block(x), rtol=1e-5, atol=1e-6)
