"""The accumulation-dimension loaders on an emulated XLA device (non-SPMD)."""

import threading
import time

import pytest
import torch
import torch_xla

from xpipe.data import MpDeviceLoader, ParallelLoader, stack_batches



@pytest.fixture(scope="module")
def device():
    return torch_xla.device(0)  # not the process's current device, which an earlier test may have moved


def numbered(count, shape=(32, 8)):
    """Batches whose every element is the batch's index."""
    return [torch.full(shape, float(index)) for index in range(count)]


def settle(baseline):
    """Wait briefly for threads to finish, then return how many run beyond ``baseline``."""
    for _ in range(50):
        if threading.active_count() <= baseline:
            break
        time.sleep(0.05)
    return threading.active_count() - baseline


def test_accumulation_dim_0_puts_the_stack_first(device):
    (batch,) = list(MpDeviceLoader(numbered(16), device, accumulation_dim=0, accumulation_size=16, batch_dim=1))
    assert tuple(batch.shape) == (16, 32, 8) and batch.device.type == "xla"
    assert batch.cpu()[:, 0, 0].tolist() == list(range(16))  # element k is the k-th batch


def test_accumulation_dim_1_puts_the_stack_second(device):
    (batch,) = list(MpDeviceLoader(numbered(16), device, accumulation_dim=1, accumulation_size=16))
    assert tuple(batch.shape) == (32, 16, 8)
    assert batch.cpu()[0, :, 0].tolist() == list(range(16))


def test_without_accumulation_batches_pass_unchanged(device):
    batches = list(MpDeviceLoader(numbered(3), device))
    assert [tuple(b.shape) for b in batches] == [(32, 8)] * 3


def test_nested_batches_are_stacked_leaf_by_leaf(device):
    source = [{"tokens": torch.full((4, 3), float(i)), "pair": (torch.ones(4) * i, f"name{i}")} for i in range(4)]
    (batch,) = list(MpDeviceLoader(source, device, accumulation_dim=0, accumulation_size=4, batch_dim=1))
    assert tuple(batch["tokens"].shape) == (4, 4, 3) and tuple(batch["pair"][0].shape) == (4, 4)
    assert batch["pair"][1] == ["name0", "name1", "name2", "name3"]


def test_groups_follow_the_loader_and_len_counts_them(device):
    loader = MpDeviceLoader(numbered(8), device, accumulation_dim=0, accumulation_size=4, batch_dim=1)
    assert len(loader) == 2
    firsts = [batch.cpu()[:, 0, 0].tolist() for batch in loader]
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_short_final_group_is_dropped_with_a_warning(device):
    with pytest.warns(UserWarning, match="ended with 2 batches, fewer than accumulation_size=4"):
        batches = list(MpDeviceLoader(numbered(6), device, accumulation_dim=0, accumulation_size=4, batch_dim=1))
    assert len(batches) == 1


def test_short_final_group_raises_when_strict(device):
    loader = MpDeviceLoader(numbered(6), device, accumulation_dim=0, accumulation_size=4, batch_dim=1, strict=True)
    with pytest.raises(ValueError, match="accumulation_size: the loader ended with 2 batches"):
        list(loader)


def test_mismatched_shapes_name_the_batch_and_both_shapes():
    with pytest.raises(ValueError, match=r"batch 2 has shape \[31, 8\] but batch 0 has \[32, 8\]"):
        stack_batches([torch.zeros(32, 8), torch.zeros(32, 8), torch.zeros(31, 8)], 0)
    with pytest.raises(ValueError, match="batch 1 is structured as"):
        stack_batches([(torch.zeros(1),), [torch.zeros(1)]], 0)


def test_bad_options_name_themselves(device):
    with pytest.raises(ValueError, match="batch_dim: equals accumulation_dim"):
        MpDeviceLoader(numbered(2), device, accumulation_dim=0, accumulation_size=2, batch_dim=0)
    with pytest.raises(ValueError, match="accumulation_size: must be a whole number >= 0"):
        ParallelLoader(numbered(2), [device], accumulation_size=-1)


def exploding(count):
    for batch in numbered(count):
        yield batch
    raise RuntimeError("disk on fire")


def test_loader_error_reaches_the_loop_with_its_traceback_and_threads_stop(device):
    baseline = threading.active_count()
    received = []
    with pytest.raises(RuntimeError, match="disk on fire") as error:
        for batch in MpDeviceLoader(exploding(4), device, accumulation_dim=0, accumulation_size=2, batch_dim=1):
            received.append(batch)
    assert len(received) == 2
    assert any(entry.name == "exploding" for entry in error.traceback)
    assert settle(baseline) == 0


def test_break_stops_the_worker_threads(device):
    baseline = threading.active_count()
    for _ in MpDeviceLoader(numbered(200), device, loader_prefetch_size=2, device_prefetch_size=1):
        break
    assert settle(baseline) == 0


def test_parallel_loader_per_device_loader(device):
    loader = ParallelLoader(numbered(4), [device], accumulation_dim=0, accumulation_size=2, batch_dim=1,
                            batches_per_execution=2)
    batches = list(loader.per_device_loader(device))
    assert [tuple(b.shape) for b in batches] == [(2, 32, 8)] * 2
    assert len(loader.per_device_loader(device)) == 2
    with pytest.raises(ValueError, match=r"device: this loader feeds \['xla:0'\], not 'xla:3'"):
        loader.per_device_loader(torch.device("xla:3"))
    loader.close()


def test_input_sharding_outside_spmd_mode_is_refused(device):
    import numpy as np
    import torch_xla.distributed.spmd as xs

    spec = xs.ShardingSpec(xs.Mesh(np.arange(8), (8,), ("data",)), ("data", None))
    with pytest.raises(ValueError, match="input_sharding: shards batches over a mesh, which needs SPMD mode"):
        MpDeviceLoader([torch.zeros(8, 2)], device, input_sharding=spec)
