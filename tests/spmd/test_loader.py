"""The loader under SPMD: batches arrive sharded on the batch axis, and Pipe consumes them as they are."""

import pytest
import torch
import torch_xla

import xpipe
import xpipe.inspect

DUMP = xpipe.inspect.enable_hlo_dump()  # before any XLA tensor: XLA reads its flags once

from pipe_checks import ATOL, RTOL, tiny_mlp  # noqa: E402
from xpipe.data import MpDeviceLoader, batch_sharding  # noqa: E402


def batches(count, rows=8, features=8):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(rows, features, generator=generator) for _ in range(count)]


def test_stacked_batches_arrive_sharded_on_the_batch_axis_over_data():
    mesh = xpipe.make_mesh(4, 2)
    loader = MpDeviceLoader(batches(4), torch_xla.device(), accumulation_dim=0, accumulation_size=4,
                            batch_dim=1, input_sharding=batch_sharding(mesh, ndim=3, batch_dim=1))
    (stacked,) = list(loader)
    assert tuple(stacked.shape) == (4, 8, 8)
    spec = torch_xla._XLAC._get_xla_sharding_spec(stacked)
    assert spec.startswith("{devices=[1,2,1,4]") and "last_tile_dim_replicate" in spec, spec
    report = xpipe.inspect.audit(lambda: stacked * 2 + 1)
    assert report.ops == (), report  # elementwise on the loader's layout: nothing moves


def test_pipe_consumes_the_loader_output_as_it_is():
    mesh = xpipe.make_mesh(4, 2)
    model = tiny_mlp()
    reference = [p.detach().clone() for p in model.parameters()]
    pipe = xpipe.Pipe(model, chunks=4, mesh=mesh)
    source = batches(4)
    loader = MpDeviceLoader(source, torch_xla.device(), accumulation_dim=0, accumulation_size=4,
                            batch_dim=1, input_sharding=batch_sharding(mesh, ndim=3, batch_dim=1))
    (stacked,) = list(loader)
    from_loader = pipe(stacked, microbatch_dim=0)
    batch_first = pipe(torch.cat(source))
    torch.testing.assert_close(from_loader.cpu(), batch_first.cpu().view(4, 8, -1), rtol=RTOL, atol=ATOL)
    report = xpipe.inspect.audit(lambda: pipe(stacked, microbatch_dim=0).sum())
    assert report.count("all-gather") == 0 and report.count("all-to-all") == 0, report
    assert len(reference) == len(list(model.parameters()))


def test_a_sharding_that_does_not_fit_the_batch_is_refused_not_dropped():
    mesh = xpipe.make_mesh(4, 2)
    loader = MpDeviceLoader(batches(4), torch_xla.device(), accumulation_dim=0, accumulation_size=4,
                            batch_dim=1, input_sharding=batch_sharding(mesh, ndim=2, batch_dim=1))
    with pytest.raises(ValueError, match=r"input_sharding: names 2 dims but a batch tensor has shape \[4, 8, 8\]"):
        list(loader)
    with pytest.raises(TypeError, match="input_sharding: expected a torch_xla ShardingSpec"):
        MpDeviceLoader(batches(4), torch_xla.device(), input_sharding=("data", None))
