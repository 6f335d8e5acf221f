"""``xpipe.save`` / ``xpipe.load`` under spmd: AdamW state on stacked weights resumes
exactly, and loads into another mesh and into the plain model; the checkpoint is
written shard by shard, each chunk once."""

import copy
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch_xla

import xpipe
from xpipe._host_memory import PeakResident
from xpipe._xla import sharding_spec
import xpipe.checkpoints.shards
from xpipe.models import mlp_stack, transformer_lm
from xpipe.spmd.state_map import StateMap
from checkpoint_checks import (assert_chunks_tile_every_tensor, assert_each_device_loaded_its_shard, held_shards,
                               load_buffers_alive, loaded_from_shards, no_sharded_tensor_put_together)
from equivalence import assert_loads_exactly, compiled, step_losses
from fresh_process import call_in_fresh_process
from pipe_checks import batch_for, loss_of, tiny_lm

EXACT = dict(rtol=1e-6, atol=0)


def make(model, stages: int, data: int, chunks: int = 4):
    pipe = xpipe.Pipe(model, chunks=chunks, mesh=xpipe.make_mesh(stages, data), loss_fn=loss_of)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.full  # the quick tier loads into other layouts in test_shards_with_padding_...
def test_resume_on_2x4_then_load_into_4x2_1x8_and_the_plain_model(tmp_path):
    """6 AdamW steps and a save in one process; load and 6 more steps in this one."""
    model = tiny_lm()
    batch, targets = batch_for(model, 8)
    data = [(batch.roll(step, 0), targets.roll(step, 1)) for step in range(12)]
    torch.save({"model": model, "data": data}, tmp_path / "start.pt")
    uninterrupted, optimizer = make(copy.deepcopy(model), 4, 2)
    expected = step_losses(uninterrupted, optimizer, data)

    call_in_fresh_process(__file__, "train_six_steps_and_save", str(tmp_path))
    # Stacked weights sharded over "stage" and replicated over "data": each chunk once.
    assert_chunks_tile_every_tensor(tmp_path / "ckpt")
    # Read as written: at most two slots of stacked tensors at once (AdamW's two states of one
    # weight are written side by side), and what was written let go of (one file).
    peak, largest, total, records, written_alive = torch.load(tmp_path / "held.pt")
    assert 0 < largest <= peak <= 2 * largest < total / 4, (peak, largest, total)
    assert records > 100 and written_alive <= peak, (records, written_alive, peak)
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) == 1
    saved = torch.load(tmp_path / "weights.pt")
    resumed, optimizer = make(tiny_lm(), 4, 2)
    with loaded_from_shards() as loads:  # each device's weights and AdamW state from its own shard
        assert xpipe.load(tmp_path / "ckpt", resumed, optimizer) == (6, None)
    assert_each_device_loaded_its_shard(loads)
    losses = torch.load(tmp_path / "losses.pt") + step_losses(resumed, optimizer, data[6:])
    torch.testing.assert_close(losses, expected, **EXACT)
    for key, value in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key].cpu(), value.cpu(), **EXACT, msg=key)

    two_stages, two_stages_optimizer = make(tiny_lm(), 2, 4, chunks=2)  # 4 (data) x 2 (stage); 8 rows
    eight, eight_optimizer = make(tiny_lm(), 8, 1)
    plain = tiny_lm()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    assert_loads_exactly(tmp_path / "ckpt", saved, (two_stages, two_stages_optimizer), (eight, eight_optimizer),
                         (plain, plain_optimizer))
    # The next steps, each after an AdamW update from the loaded state: the same
    # losses. (Weights are not compared after them: Adam's update of a
    # numerically-zero gradient, m / sqrt(v), is decided by rounding.)
    for step in (6, 7):
        batch, targets = data[step]
        expected_loss = loss_of(plain(batch), targets)
        expected_loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        for pipe, optimizer in ((two_stages, two_stages_optimizer), (eight, eight_optimizer)):
            loss = pipe.step(batch, targets)
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            torch.testing.assert_close(loss.cpu(), expected_loss.detach(), rtol=1e-5, atol=0,
                                       msg=f"{pipe.mesh.mesh_shape} after step {step}")


def train_six_steps_and_save(folder: str) -> None:
    """The first half of the resumed run, called in its own process; the weights it
    saved are written beside the checkpoint for comparison."""
    start = torch.load(Path(folder) / "start.pt", weights_only=False)
    pipe, optimizer = make(start["model"], 4, 2)
    torch.save(step_losses(pipe, optimizer, start["data"][:6]), Path(folder) / "losses.pt")
    xpipe.checkpoints.shards.WHOLE_FETCH_BYTES = 0  # every stacked tensor slot by slot, as a large model's
    with no_sharded_tensor_put_together(), held_shards() as held:
        xpipe.save(Path(folder) / "ckpt", pipe, optimizer, step=6)
    total = 3 * sum(value.numel() * value.element_size() for value in pipe.state_dict().values())
    torch.save((held.peak, held.largest, total, len(held.written), held.written_alive), Path(folder) / "held.pt")
    torch.save(pipe.host_state_dict(), Path(folder) / "weights.pt")


def test_shards_with_padding_save_and_load_into_other_layouts(tmp_path, monkeypatch):
    """Blocks of width 7 on 2 stages x 4 fsdp: every block weight's 49 (or 7) elements
    split unevenly, its last shard padded. Saved after two AdamW steps and loaded, slot
    by slot as a large model's, back into the Pipe (after a third step) and into
    4 stages x 2 fsdp, and into the plain model: weights and AdamW state bit-equal,
    and the Pipe's next step compiles nothing."""
    monkeypatch.setattr(xpipe.checkpoints.shards, "WHOLE_FETCH_BYTES", 0)
    monkeypatch.setattr(xpipe.checkpoints.shards, "LOAD_PIECE_BYTES", 0)  # loaded slot by slot, too
    model = mlp_stack(blocks=4, width=7, inputs=8, outputs=4)
    plain = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, fsdp=4), loss_fn=loss_of)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    step_losses(pipe, optimizer, [batch_for(plain, 8)] * 2)
    with no_sharded_tensor_put_together():
        xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    saved = pipe.host_state_dict()
    step_losses(pipe, optimizer, [batch_for(plain, 8)])  # other values than the checkpoint's, in the same layout
    other = xpipe.Pipe(mlp_stack(blocks=4, width=7, inputs=8, outputs=4), chunks=4,
                       mesh=xpipe.make_mesh(4, fsdp=2), loss_fn=loss_of)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with loaded_from_shards() as loads:
        assert_loads_exactly(tmp_path / "ckpt", saved, (pipe, optimizer), (other, other_optimizer),
                             (plain, plain_optimizer))
    assert any(math.prod(shape) % len(places) for shape, tiled, places in loads if tiled), "no uneven shard loaded"
    moments = {name: plain_optimizer.state[p]["exp_avg"] for name, p in plain.named_parameters()}
    for loaded, loaded_optimizer in (pipe, optimizer), (other, other_optimizer):
        for name, parameter in loaded.runner.named_parameters():  # stacked: compare through the state's names
            exp_avg = loaded_optimizer.state[parameter]["exp_avg"].cpu()
            for named, value in loaded.checkpoint_state().named_slices(parameter, exp_avg):
                assert torch.equal(value, moments[named]), named
    # Put in place slot by slot, each tensor keeps its sharding: the step runs the program it ran before.
    before = compiled()
    step_losses(pipe, optimizer, [batch_for(plain, 8)])
    assert compiled() == before

    # Refused late (a checkpoint that does not record its optimizer's kind, loaded into SGD
    # with momentum): the shards already read are dropped, and nothing on the devices changed.
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    del manifest["optimizer_kind"]
    (tmp_path / "ckpt" / "manifest.json").write_text(json.dumps(manifest))
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    for parameter in other.parameters():
        sgd.state[parameter]["momentum_buffer"] = torch.zeros_like(parameter)
    other.runner.body.weights[0].data.mul_(2)  # other values than the checkpoint's
    before = other.host_state_dict()
    with pytest.raises(ValueError, match="holds optimizer state"):
        xpipe.load(tmp_path / "ckpt", other, sgd)
    assert all(torch.equal(value, before[key]) for key, value in other.host_state_dict().items())

    # A read that fails after two tensors were put in place: said so, and the Pipe refuses to
    # run or save until a load succeeds; that load holds a few tensors' buffers at a time.
    put_in_place, calls = StateMap._put_in_place, []

    def fail_on_the_third(self, tensor, buffers):
        calls.append(tensor)
        if len(calls) == 3:
            raise OSError("a disk error")
        return put_in_place(self, tensor, buffers)

    monkeypatch.setattr(StateMap, "_put_in_place", fail_on_the_third)
    with pytest.raises(RuntimeError, match=r"(?s)a disk error.*xpipe.load had already put 2 of the \d+ tensors"):
        xpipe.load(tmp_path / "ckpt", other, other_optimizer)
    with pytest.raises(RuntimeError, match="the last xpipe.load failed part-way"):
        other.step(*batch_for(plain, 8))
    with pytest.raises(RuntimeError, match="the last xpipe.load failed part-way"):
        xpipe.save(tmp_path / "mixed", other, other_optimizer)
    assert not (tmp_path / "mixed").exists()
    monkeypatch.setattr(StateMap, "_put_in_place", put_in_place)
    with load_buffers_alive() as alive:
        xpipe.load(tmp_path / "ckpt", other, other_optimizer)
    assert all(torch.equal(value, saved[key]) for key, value in other.host_state_dict().items())
    checkpoint_bytes = 3 * sum(value.numel() * value.element_size() for value in saved.values())
    assert 0 < alive[0] < checkpoint_bytes / 2, (alive[0], checkpoint_bytes)


def test_host_state_dict_is_put_together_from_the_shards():
    """Stacked weights sharded on "stage", replicated head and embedding: the same
    values as fetching each ``state_dict()`` tensor with ``.cpu()``."""
    pipe, optimizer = make(tiny_lm(blocks=6), 4, 2)  # 6 blocks on 4 stages: padded slots
    batch, targets = batch_for(tiny_lm(), 8)
    step_losses(pipe, optimizer, [(batch, targets)])
    host = pipe.host_state_dict()
    assert list(host) == list(pipe.state_dict())
    for key, value in pipe.state_dict().items():
        assert host[key].device.type == "cpu"
        assert torch.equal(host[key], value.cpu()), key


def test_a_load_puts_stacked_tensors_back_slot_by_slot_in_place(tmp_path, monkeypatch):
    """4 blocks on 2 stages x 4 fsdp, every tensor loaded a piece at a time (as one of
    more than ``LOAD_PIECE_BYTES``): each stacked weight and AdamW state slot by slot,
    copied into the tensor the Pipe holds. Loaded after a further step, every value is
    the checkpoint's again, each tensor keeps its sharding, and the next step runs the
    program it ran before."""
    monkeypatch.setattr(xpipe.checkpoints.shards, "LOAD_PIECE_BYTES", 0)
    pieces = []
    load_by_pieces = xpipe.checkpoints.shards._load_by_pieces

    def recorded(tensor, shards, dim, length):
        pieces.append((tuple(tensor.shape), dim, length))
        load_by_pieces(tensor, shards, dim, length)

    monkeypatch.setattr(xpipe.checkpoints.shards, "_load_by_pieces", recorded)
    pipe = xpipe.Pipe(tiny_lm(blocks=4), chunks=2, mesh=xpipe.make_mesh(2, fsdp=4), loss_fn=loss_of)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    data = [batch_for(tiny_lm(), 8)] * 2
    step_losses(pipe, optimizer, data[:1])
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    saved = pipe.host_state_dict()
    moments = {id(p): optimizer.state[p]["exp_avg"].cpu() for p in pipe.parameters()}
    shardings = [sharding_spec(tensor) for tensor in _tensors_of(pipe, optimizer)]
    step_losses(pipe, optimizer, data[1:])
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer) == (1, None)
    stacked = [tuple(weight.shape) for weight in pipe.runner.body.weights]
    by_slot = Counter(piece for piece in pieces if piece[0] in stacked)
    assert by_slot == Counter((shape, 1, 1) for shape in stacked for _ in range(3))  # a weight and its two states
    assert all(torch.equal(value, saved[key]) for key, value in pipe.host_state_dict().items())
    assert all(torch.equal(optimizer.state[p]["exp_avg"].cpu(), moments[id(p)]) for p in pipe.parameters())
    assert [sharding_spec(tensor) for tensor in _tensors_of(pipe, optimizer)] == shardings
    before = compiled()
    step_losses(pipe, optimizer, data[1:])
    assert compiled() == before


def _tensors_of(pipe: xpipe.Pipe, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The Pipe's parameters and their AdamW states, in order."""
    return [tensor for p in pipe.parameters() for tensor in (p, optimizer.state[p]["exp_avg"],
                                                             optimizer.state[p]["exp_avg_sq"])]


@pytest.mark.full
def test_a_load_grows_the_host_by_what_it_holds_not_by_what_it_has_read(tmp_path):
    """The 32-block LM of ``tools/bench_checkpoint.py`` (97 MiB of weights, 291 MiB with
    AdamW's state) on 4 stages x 2 data, loaded twice (the second into the optimizer's
    own state, in place): the process grows by less than half the checkpoint's tensor
    bytes (issue 37). It holds one tensor's host buffers at a time and, on the
    emulation, one slot of its device data beside it (measured 0.24x); a stacked
    tensor made whole on the devices beside the old grew it 0.56x, and before the
    freed memory was handed back (xpipe._host_memory) a load grew it 1.7x."""
    plain = transformer_lm(blocks=32, width=256, heads=4, seq=16, vocab=256)
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss_of(plain(tokens[:, :-1]), tokens[:, 1:]).backward()
    plain_optimizer.step()
    xpipe.save(tmp_path / "ckpt", plain, plain_optimizer, step=1)
    checkpoint_bytes = 3 * sum(value.numel() * value.element_size() for value in plain.state_dict().values())
    pipe, optimizer = make(transformer_lm(blocks=32, width=256, heads=4, seq=16, vocab=256), 4, 2)
    xpipe.load(tmp_path / "ckpt", pipe, optimizer)
    with PeakResident() as host:
        assert xpipe.load(tmp_path / "ckpt", pipe, optimizer) == (1, None)
    assert host.growth < checkpoint_bytes / 2, (host.growth / 2**20, checkpoint_bytes / 2**20)
    loaded = pipe.host_state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(loaded[key], value, **EXACT, msg=key)
