"""``xpipe.spmd.column_parallel``: the column-parallel linears, run against their
input spread over a dim of "tensor"'s size, compute what ``F.linear`` computes (on
the CPU, rtol 1e-4 as every exactness check: the same products, summed in another
order), under ``torch.vmap`` as the executor runs them, and
leave every other call alone. Their collectives are ``tests/spmd/test_audit.py``'s."""

import torch
import torch.nn.functional as F

from xpipe.spmd.column_parallel import ColumnParallelLinears


def test_column_linears_compute_what_f_linear_computes_and_others_run_as_called():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, 16, generator=generator, requires_grad=True)  # [stages, rows, seq, features]
    q, k = ((torch.randn(3, out, 16, generator=generator) / 4).requires_grad_() for out in (12, 4))
    q_bias = torch.randn(3, 12, generator=generator, requires_grad=True)
    down = (torch.randn(3, 16, 12, generator=generator) / 4).requires_grad_()  # row-parallel: not in the mode's list

    def block(x, q, k, q_bias, down, parallel):
        def run():
            hidden = F.linear(x, weight=q, bias=q_bias) + F.linear(x, k).repeat(1, 1, 3)  # by keyword too
            return F.linear(torch.tanh(hidden), down)
        if not parallel:
            return run()
        with ColumnParallelLinears([q, k], tensor=4):
            return run()

    inputs = (x, q, k, q_bias, down)
    expected = torch.vmap(lambda *a: block(*a, parallel=False))(*inputs)
    got = torch.vmap(lambda *a: block(*a, parallel=True))(*inputs)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for got_grad, expected_grad in zip(torch.autograd.grad(got.square().sum(), inputs),
                                       torch.autograd.grad(expected.square().sum(), inputs)):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-5)
