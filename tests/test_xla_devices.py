"""Non-SPMD smoke test: 8 emulated XLA devices in one process, data moved between them."""

import pytest
import torch
import torch_xla
import torch_xla.runtime as xr
from equivalence import compiled

from xpipe._xla import settle_autograd


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


def test_settling_autograds_worker_threads_leaves_nothing_pending_and_compiles_nothing():
    """The devices executor waits, after each step's backward, for the worker threads
    that ran it (``xpipe._xla.settle_autograd``); the wait itself adds no tensor for
    the next sync to run, so it cannot change a step's programs."""
    devices = [torch_xla.device(3), torch_xla.device(5)]
    weight = torch.ones(4, device=devices[0], requires_grad=True)
    (weight * 2).sum().backward()
    settle_autograd(devices)  # the first wait on a device makes its probe
    torch_xla.sync()
    before = compiled(), [torch_xla._XLAC._xla_tensors_report(0, str(device)) for device in devices]
    settle_autograd(devices)
    assert (compiled(), [torch_xla._XLAC._xla_tensors_report(0, str(device)) for device in devices]) == before
