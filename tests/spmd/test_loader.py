"""The loader under SPMD: batches arrive sharded on the batch axis, and Pipe consumes them as they are."""

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import xpipe
import xpipe.inspect

DUMP = xpipe.inspect.enable_hlo_dump()  # before any XLA tensor: XLA reads its flags once

from pipe_checks import ATOL, RTOL, tiny_mlp  # noqa: E402
from xpipe.data import MpDeviceLoader, batch_sharding, stack_batches  # noqa: E402
from xpipe.hosts import Hosts, device_shards, host_rows  # noqa: E402


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


def hosts_rows(mesh, hosts, rows=16):
    sharding = batch_sharding(mesh, ndim=3, batch_dim=1)
    return [host_rows(sharding, rows, 1, Hosts(index, hosts)) for index in range(hosts)]


def test_a_host_loads_the_rows_its_devices_hold():
    # Stage outermost: hosts that hold whole stages hold every data index, so each loads every row.
    assert hosts_rows(xpipe.make_mesh(4, 2), 2) == [slice(0, 16)] * 2
    # Four hosts of two devices on 2 stages x 4 data: each holds half of one stage's data axis.
    assert hosts_rows(xpipe.make_mesh(2, 4), 4) == [slice(0, 8), slice(8, 16)] * 2
    assert hosts_rows(xpipe.make_mesh(1, 8), 4) == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 16)]


def test_a_host_whose_rows_are_not_one_run_or_an_uneven_batch_is_refused():
    scattered = xs.Mesh(np.array([0, 2, 4, 6, 1, 3, 5, 7]), (1, 8), ("stage", "data"))
    with pytest.raises(ValueError, match=r"host 0 of 2 holds batch shards \[0, 1, 4, 5\], not one run"):
        hosts_rows(scattered, 2)
    with pytest.raises(ValueError, match="rows: a global batch of 12 rows does not split evenly over the 8 shards"):
        hosts_rows(xpipe.make_mesh(1, 8), 2, rows=12)
    with pytest.raises(ValueError, match="index: must be a host number in \\[0, 2\\), got 2"):
        Hosts(2, 2)


def test_the_hosts_shares_assemble_into_the_global_batch_a_pipe_steps_on():
    """Four hosts played by one process (the CPU client runs no SPMD program across
    processes): each host's loader yields only its rows, stacked on the host; the
    shards cut from the four shares make the global batch, sharded as the loader
    shards a whole one, and the Pipe's output on it equals the batch-first call."""
    mesh = xpipe.make_mesh(2, 4)
    sharding = batch_sharding(mesh, ndim=3, batch_dim=1)
    source = batches(4, rows=16)
    shards = []
    for index in range(4):
        hosts = Hosts(index, 4)
        mine = host_rows(sharding, 16, 1, hosts)
        share = stack_batches([batch[mine] for batch in source], 0)  # [4, 8, 8]: this host's rows only
        shards += device_shards(share, sharding, 1, hosts)
    whole = torch_xla._XLAC._global_tensor_from_cpu_shards(shards, mesh.get_op_sharding(sharding.partition_spec),
                                                           [4, 16, 8])
    (loaded,) = list(MpDeviceLoader(source, torch_xla.device(), accumulation_dim=0, accumulation_size=4, batch_dim=1,
                                    input_sharding=sharding))
    assert torch.equal(whole.cpu(), torch.stack(source))
    assert torch_xla._XLAC._get_xla_sharding_spec(whole) == torch_xla._XLAC._get_xla_sharding_spec(loaded)
    pipe = xpipe.Pipe(tiny_mlp(), chunks=4, mesh=mesh)
    torch.testing.assert_close(pipe(whole, microbatch_dim=0).cpu(), pipe(torch.cat(source)).cpu().view(4, 16, -1),
                               rtol=RTOL, atol=ATOL)


def test_the_loader_assembles_this_hosts_share_and_refuses_hosts_it_does_not_address():
    mesh = xpipe.make_mesh(4, 2)
    sharding = batch_sharding(mesh, ndim=3, batch_dim=1)
    options = dict(accumulation_dim=0, accumulation_size=4, batch_dim=1, input_sharding=sharding)
    (plain,) = list(MpDeviceLoader(batches(4), torch_xla.device(), **options))
    (hosted,) = list(MpDeviceLoader(batches(4), torch_xla.device(), hosts=Hosts(0, 1), **options))
    assert torch.equal(hosted.cpu(), plain.cpu())
    assert torch_xla._XLAC._get_xla_sharding_spec(hosted) == torch_xla._XLAC._get_xla_sharding_spec(plain)
    with pytest.raises(ValueError, match="hosts: host 1 of 2 would own 4 of the 8 devices, but this process addresses 8"):
        MpDeviceLoader(batches(4), torch_xla.device(), hosts=Hosts(1, 2), **options)
    with pytest.raises(ValueError, match="hosts: each host's share is assembled .* needs input_sharding"):
        MpDeviceLoader(batches(4), torch_xla.device(), hosts=Hosts(0, 1))
