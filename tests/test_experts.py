"""``xpipe.capture.experts``: the dense form of Hugging Face's mixture-of-experts layers
computes what transformers' own forms compute (on the CPU, within float32 rounding),
and is chosen only while xpipe captures the model."""

import pytest
import torch
from hf_models import llama, mixtral, qwen2_moe

from xpipe.capture.experts import DENSE, captured_dense, dense_experts_forward


@pytest.mark.parametrize("family", [mixtral, qwen2_moe], ids=["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_the_dense_form_computes_what_transformers_computes(family, implementation):
    """Output and the gradients of the tokens, the routing weights and every expert
    weight; an expert no token is routed to gets a zero gradient either way."""
    experts = family(1).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(12, experts.gate_up_proj.shape[-1], generator=generator, requires_grad=True)
    chosen = torch.randint(0, experts.num_experts - 1, (12, 2), generator=generator)  # the last expert unused
    weights = torch.rand(12, 2, generator=generator, requires_grad=True)
    inputs = [tokens, weights, *experts.parameters()]
    experts.config._experts_implementation = implementation
    expected = experts(tokens, chosen, weights)
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
    got = dense_experts_forward(experts, tokens, chosen, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for got_grad, expected_grad in zip(torch.autograd.grad(got.square().sum(), inputs), expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_the_dense_form_is_chosen_while_capturing_and_the_config_put_back():
    model = mixtral(1)
    config = model.model.layers[0].mlp.experts.config
    before = config._experts_implementation
    with captured_dense(model):
        assert config._experts_implementation == DENSE
    assert config._experts_implementation == before
    plain = llama(1)
    own = plain.config._experts_implementation
    with captured_dense(plain):
        assert plain.config._experts_implementation == own  # no experts: untouched
