"""``xpipe.substitutes``: the operations that replace what XLA runs wrongly compute
what the originals compute (on the CPU, where the originals are right): exactly for
the counts, within float32 rounding for the matmuls."""

import pytest
import torch

from xpipe.substitutes import grouped_mm, histc, substitute_operators


@pytest.mark.parametrize("counts", [(3, 0, 5, 2), (0, 0, 10, 0), (1, 1, 1, 7)])
def test_grouped_mm_multiplies_each_run_of_rows_by_its_experts_matrix(counts):
    generator = torch.Generator().manual_seed(sum(counts))
    rows = torch.randn(sum(counts), 6, generator=generator, requires_grad=True)
    weight = torch.randn(len(counts), 6, 5, generator=generator, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0)
    expected = torch.cat([part @ weight[e] for e, part in enumerate(rows.split(list(counts)))])
    got = grouped_mm(rows, weight, offs)
    torch.testing.assert_close(got, expected)
    expected_grads = torch.autograd.grad(expected.square().sum(), [rows, weight])
    torch.testing.assert_close(torch.autograd.grad(got.square().sum(), [rows, weight]), expected_grads)


@pytest.mark.parametrize("bins, low, high", [(4, 0, 3), (5, -1.0, 2.0), (3, 0, 0)])
def test_histc_counts_as_torch_does(bins, low, high):
    values = torch.tensor([0.0, 3.0, 1.0, 1.0, 2.5, -1.0, 2.0, 7.0, -3.0])
    torch.testing.assert_close(histc(values, bins, low, high), torch.histc(values, bins, low, high))


def test_only_the_listed_operators_are_rewritten():
    class Counts(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, 4, 0, 3) + x.sum()

    traced = torch.export.export(Counts(), (torch.zeros(6),)).module()
    assert substitute_operators(traced) == ["aten.histc.default"]
    assert traced(torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 9.0])).tolist() == [17.0, 18.0, 17.0, 17.0]
