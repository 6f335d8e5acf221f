"""Non-SPMD smoke test: 8 emulated XLA devices in one process, data moved between them."""

import pytest
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


def test_torchax_is_the_one_xla_loops_need():
    fix = ("torch_xla's wheel overwrote torchax with its older copy (which imports flax); "
           "run: pip install --force-reinstall --no-deps torchax==0.0.7")
    try:
        import torchax
    except ImportError as error:
        pytest.fail(f"{fix} ({error})")
    assert torchax.__version__ == "0.0.7", fix
