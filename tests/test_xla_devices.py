"""Non-SPMD smoke test: 8 emulated XLA devices in one process, data moved between them."""

import torch
import torch_xla
import torch_xla.runtime as xr


def test_eight_emulated_devices():
    assert not xr.is_spmd()
    assert xr.global_runtime_device_count() == 8


def test_tensor_moves_between_devices_and_keeps_its_gradient():
    weight = torch.tensor([1.0, 2.0, 3.0])
    first = weight.to(torch_xla.device(0)).requires_grad_()
    moved = (first * 2).to(torch_xla.device(7))
    loss = (moved**2).sum()
    loss.backward()
    assert str(moved.device) == "xla:7"
    torch.testing.assert_close(first.grad.cpu(), 8 * weight)
