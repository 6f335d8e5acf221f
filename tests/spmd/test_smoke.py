"""SPMD smoke test: a real sharded XLA computation on 8 emulated devices."""

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xpipe.mesh import spmd_device


def test_eight_devices_in_spmd_mode():
    spmd_device()
    assert xr.is_spmd()
    assert xr.global_runtime_device_count() == 8


def test_sharded_matmul_matches_cpu():
    spmd_device()
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "stage"))
    x = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) / 100
    w = torch.linspace(-1, 1, 16 * 8).reshape(16, 8)
    x_xla = x.to(torch_xla.device())
    w_xla = w.to(torch_xla.device())
    xs.mark_sharding(x_xla, mesh, ("data", None))
    xs.mark_sharding(w_xla, mesh, (None, "stage"))
    result = (x_xla @ w_xla).sum(0)  # reduces over the sharded "data" axis
    torch.testing.assert_close(result.cpu(), (x @ w).sum(0), rtol=1e-5, atol=1e-4)
    spec = torch_xla._XLAC._get_xla_sharding_spec(x_xla)
    assert spec.startswith("{devices=[2,1,4]"), spec
