"""``xpipe.capture.substitutes``: the operations that replace what XLA runs wrongly compute
what the originals compute (on the CPU, where the originals are right): exactly for
the counts, within float32 rounding for the matmuls."""

import pytest
import torch

from xpipe.capture.substitutes import grouped_mm, histc, substitute_operators


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


def test_histc_puts_values_on_bin_edges_where_torch_does():
    """Every edge of the bins, and the floats either side of it, in float32 and float64:
    the bin is torch's (a product by bins / (max - min) moved one count between bins 5
    and 7 of 10 on [-1, 2])."""
    generator = torch.Generator().manual_seed(0)
    for bins, low, high in [(10, -1.0, 2.0), (7, 0.1, 0.8), (13, -2.7, 3.3), (3, 1e-3, 1.001)]:
        edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
        values = torch.cat([edges, edges.nextafter(edges + 1), edges.nextafter(edges - 1),
                            torch.rand(200, generator=generator, dtype=torch.float64) * (high - low + 2) + low - 1])
        for dtype in (torch.float32, torch.float64):
            torch.testing.assert_close(histc(values.to(dtype), bins, low, high),
                                       torch.histc(values.to(dtype), bins, low, high), rtol=0, atol=0,
                                       msg=lambda m: f"bins={bins} [{low}, {high}] {dtype}: {m}")


def test_integer_expert_ids_are_counted_exactly():
    ids = torch.randint(0, 8, (1000,), generator=torch.Generator().manual_seed(0))
    assert histc(ids, 8, 0, 7).tolist() == torch.bincount(ids, minlength=8).tolist()


def test_only_the_listed_operators_are_rewritten():
    class Counts(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, 4, 0, 3) + x.sum()

    traced = torch.export.export(Counts(), (torch.zeros(6),)).module()
    assert substitute_operators(traced) == ["aten.histc.default"]
    assert traced(torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 9.0])).tolist() == [17.0, 18.0, 17.0, 17.0]
