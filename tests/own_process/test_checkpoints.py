"""``xpipe.save`` / ``xpipe.load``: resume exactly, load into another layout or the
plain model, and refuse damaged or foreign checkpoints before changing anything.

The devices executor in this (non-SPMD) process; a checkpoint written by the spmd
executor, and the first half of a resumed run, come from subprocesses. Exact: weights after load equal bit for bit;
resumed losses and weights within 1e-6 relative of the uninterrupted run.
"""

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_xla

import xpipe
from xpipe import checkpoints
from xpipe.checkpoints import loading, saving
import xpipe.checkpoints.group
from equivalence import assert_loads_exactly, step_losses
from fresh_process import call_in_fresh_process
from xpipe.models import mlp_stack, resnet_like, small_cnn

EXACT = dict(rtol=1e-6, atol=0)


def batches(count: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(count)
    return [(torch.randn(rows, 3, 16, 16, generator=generator), torch.randint(0, 10, (rows,), generator=generator))
            for _ in range(count)]


def make(model: torch.nn.Module, stages: int = 2, **options) -> tuple[xpipe.Pipe, torch.optim.Optimizer]:
    pipe = xpipe.Pipe(model, chunks=4, stages=stages, executor="devices", loss_fn=F.cross_entropy, **options)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.1)


def test_resume_in_a_fresh_process_equals_the_uninterrupted_run(tmp_path):
    """6 steps and a save in one process; load and 6 more steps in this one."""
    data = batches(12)
    model = resnet_like()
    torch.save({"model": model, "data": data}, tmp_path / "start.pt")
    uninterrupted, optimizer = make(copy.deepcopy(model))
    expected = step_losses(uninterrupted, optimizer, data)

    call_in_fresh_process(__file__, "train_six_steps_and_save", str(tmp_path))
    resumed, optimizer = make(resnet_like())  # fresh weights and optimizer
    assert xpipe.load(tmp_path / "ckpt", resumed, optimizer) == (6, {"data": "position 6"})
    losses = torch.load(tmp_path / "losses.pt") + step_losses(resumed, optimizer, data[6:])
    torch.testing.assert_close(losses, expected, **EXACT)
    for key, value in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key].cpu(), value.cpu(), **EXACT, msg=key)


def train_six_steps_and_save(folder: str) -> None:
    """The first half of the resumed run, called in its own process."""
    start = torch.load(Path(folder) / "start.pt", weights_only=False)
    pipe, optimizer = make(start["model"])
    torch.save(step_losses(pipe, optimizer, start["data"][:6]), Path(folder) / "losses.pt")
    xpipe.save(Path(folder) / "ckpt", pipe, optimizer, step=6, extra={"data": "position 6"})


def test_a_background_save_holds_the_state_it_was_asked_for(tmp_path, monkeypatch):
    pipe, optimizer = make(small_cnn())
    data = batches(2)
    step_losses(pipe, optimizer, data[:1])
    saved = {key: value.cpu().clone() for key, value in pipe.state_dict().items()}
    extra = {"note": "asked for"}
    pending = xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1, extra=extra, background=True)
    extra["note"] = "changed after"
    step_losses(pipe, optimizer, data[1:])  # the weights change while the files are written
    assert pending.result() is None
    fresh, fresh_optimizer = make(small_cnn())
    assert xpipe.load(tmp_path / "ckpt", fresh, fresh_optimizer) == (1, {"note": "asked for"})
    for key, value in saved.items():
        assert torch.equal(fresh.state_dict()[key].cpu(), value), key

    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2, background=True)
    assert xpipe.load(tmp_path / "ckpt", fresh, fresh_optimizer) == (2, None), "load waits for pending saves"

    def fails_midway(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saving.dcp, "save", fails_midway)
    pending = xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=3, background=True)
    with pytest.raises(OSError, match="disk full"):
        pending.result()
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "a failed save leaves no partial directory behind"
    assert xpipe.load(tmp_path / "ckpt", fresh, fresh_optimizer) == (2, None), "the previous checkpoint stays"


def test_another_stage_count_and_the_plain_model_load_it(tmp_path):
    data = batches(3)
    pipe, optimizer = make(resnet_like())
    step_losses(pipe, optimizer, data[:2])
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    saved = {key: value.cpu() for key, value in pipe.state_dict().items()}

    four, four_optimizer = make(resnet_like(), stages=4)
    plain = resnet_like()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    assert_loads_exactly(tmp_path / "ckpt", saved, (four, four_optimizer), (plain, plain_optimizer))
    batch, target = data[2]
    expected = F.cross_entropy(plain(batch), target)
    expected.backward()
    plain_optimizer.step()
    loss = four.step(batch, target)
    four_optimizer.step()
    torch_xla.sync()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=0)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(four.state_dict()[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=key)


def test_damaged_or_foreign_checkpoints_are_refused_and_change_nothing(tmp_path, monkeypatch):
    pipe, optimizer = make(small_cnn())
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    before = {key: value.cpu().clone() for key, value in pipe.state_dict().items()}
    data_file = next(f for f in (tmp_path / "ckpt").iterdir() if f.suffix == ".distcp")

    damaged = tmp_path / "truncated"
    _copy(tmp_path / "ckpt", damaged)
    content = (damaged / data_file.name).read_bytes()
    (damaged / data_file.name).write_bytes(content[: len(content) // 2])
    with pytest.raises(ValueError, match=rf"checkpoint: '.*truncated/{data_file.name}' is truncated or corrupted"):
        xpipe.load(damaged, pipe, optimizer)

    flipped = tmp_path / "flipped"
    _copy(tmp_path / "ckpt", flipped)
    content = bytearray((flipped / data_file.name).read_bytes())
    content[len(content) // 3] ^= 0x01
    (flipped / data_file.name).write_bytes(bytes(content))
    with pytest.raises(ValueError, match="is truncated or corrupted"):
        xpipe.load(flipped, pipe, optimizer)

    other, _ = make(resnet_like())
    xpipe.save(tmp_path / "other", other)
    foreign = r"checkpoint: '.*other' is from another model: missing keys \['0.bias'.*other shapes \['0.weight"
    with pytest.raises(ValueError, match=foreign):
        xpipe.load(tmp_path / "other", pipe)
    with pytest.raises(ValueError, match="was saved without an optimizer"):
        xpipe.load(tmp_path / "other", other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="manifest.json' does not exist"):
        xpipe.load(tmp_path / "nowhere", pipe)

    vanishing = tmp_path / "vanishing"  # a file gone after the checks (another job cleaning up): DCP's
    _copy(tmp_path / "ckpt", vanishing)  # BaseException becomes an Exception that names the file
    checked_manifest = loading.checked_manifest

    def checked_then_removed(path):
        manifest = checked_manifest(path)
        (path / data_file.name).unlink()
        return manifest

    monkeypatch.setattr(loading, "checked_manifest", checked_then_removed)
    with pytest.raises(RuntimeError, match=rf"xpipe.load: DCP failed on the checkpoint '.*vanishing': process 0: "
                                           rf"FileNotFoundError: .*vanishing/{data_file.name}"):
        xpipe.load(vanishing, pipe, optimizer)
    monkeypatch.undo()
    shutil.rmtree(vanishing)

    def fails_midway(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saving.dcp, "save", fails_midway)
    with pytest.raises(OSError, match="disk full"):
        xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "flipped", "other", "truncated"], \
        "a failed save leaves no partial directory behind"
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer) == (1, None), "the previous checkpoint still loads"
    for key, value in before.items():
        assert torch.equal(pipe.state_dict()[key].cpu(), value), key


def test_a_save_never_moves_or_deletes_a_users_files(tmp_path):
    """Only an empty directory or an xpipe checkpoint (and nothing else in it) is replaced."""
    pipe, optimizer = make(small_cnn())
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "train.log").write_text("step 1: loss 2.3\n")
    (outputs / "predictions").mkdir()
    with pytest.raises(FileExistsError, match=r"path: '.*outputs' holds files that are not an xpipe checkpoint "
                                              r"\(predictions, train.log\)"):
        xpipe.save(outputs, pipe, optimizer)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(FileExistsError, match=r"path: '.*notes.txt' is a file, not a checkpoint directory"):
        xpipe.save(notes, pipe)
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    (tmp_path / "ckpt" / "README").write_text("run 7")
    with pytest.raises(FileExistsError, match=r"also holds \['README'\], which xpipe.save did not write"):
        xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    with pytest.raises(ValueError, match="extra: torch.save cannot write it"):
        xpipe.save(tmp_path / "fresh", pipe, extra={"callback": lambda: None})
    assert (outputs / "train.log").read_text() == "step 1: loss 2.3\n" and (outputs / "predictions").is_dir()
    assert notes.read_text() == "mine" and (tmp_path / "ckpt" / "README").read_text() == "run 7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "notes.txt", "outputs"]
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 1
    (tmp_path / "ckpt" / "README").unlink()
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)  # a checkpoint alone is replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    xpipe.save(empty, pipe)
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 2 and xpipe.load(empty, pipe)[0] is None


def test_every_file_and_the_rename_are_made_durable_before_the_old_checkpoint_goes(tmp_path, monkeypatch):
    """After a power loss the new checkpoint is whole or the old one is still there."""
    pipe, optimizer = make(small_cnn())
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    synced, removed = [], []
    original_fsync, original_rmtree = saving.os.fsync, saving.shutil.rmtree
    monkeypatch.setattr(saving.os, "fsync", lambda fd: (synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))),
                                                             original_fsync(fd)))
    monkeypatch.setattr(saving.shutil, "rmtree", lambda path, **kw: (removed.append(len(synced)),
                                                                          original_rmtree(path, **kw)))
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    names = {path.name for path in synced}
    assert {"manifest.json", "training.pt", ".metadata.tmp"} <= names, names  # DCP renames it to .metadata
    assert any(name.endswith(".distcp") for name in names), names
    assert synced[removed[0] - 1] == tmp_path.resolve()  # the rename is durable before the old checkpoint is removed
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 2


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _interrupt_on_call(number: int, original):
    """``original``, except that its ``number``-th call is interrupted."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == number:
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    return wrapped


INTERRUPTIONS = {
    "while DCP writes": lambda mp: mp.setattr(checkpoints.pieces.StreamingFileWriter, "write_data", _interrupt),
    "while hashing the files": lambda mp: mp.setattr(saving, "checksum", _interrupt),
    "before the swap": lambda mp: mp.setattr(saving, "put_in_place", _interrupt),
    # where the filesystem cannot swap two directories: the old one is renamed aside first
    "between the renames": lambda mp: (mp.setattr(checkpoints.files, "_exchanged", lambda a, b: False),
                                       mp.setattr(checkpoints.files.os, "rename",
                                                  _interrupt_on_call(2, checkpoints.files.os.rename))),
}


@pytest.mark.parametrize("moment", INTERRUPTIONS)
def test_a_save_interrupted_at_any_step_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, moment):
    """At every instant the path holds a checkpoint, the old one until the new one is
    complete; the interrupt reaches the caller as itself (DCP wraps what its writer
    raises in a CheckpointException)."""
    pipe, optimizer = make(small_cnn())
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    with monkeypatch.context() as patched:
        INTERRUPTIONS[moment](patched)
        with pytest.raises(KeyboardInterrupt):
            xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 1
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=3)  # and a later save cleans up what was left aside
    assert xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_save_swaps_the_checkpoint_in_one_step(tmp_path, monkeypatch):
    """Replacing a checkpoint renames nothing aside: the directories swap."""
    pipe, optimizer = make(small_cnn())
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=1)
    renamed, rename = [], os.rename
    monkeypatch.setattr(checkpoints.files.os, "rename", lambda *args: (renamed.append(Path(args[0]).name), rename(*args)))
    xpipe.save(tmp_path / "ckpt", pipe, optimizer, step=2)
    assert "ckpt" not in renamed and xpipe.load(tmp_path / "ckpt", pipe, optimizer)[0] == 2


def test_a_save_on_several_hosts_without_a_process_group_is_refused_before_it_writes(tmp_path, monkeypatch):
    """Without a group over the hosts each would put its own shards in place of the
    others': refused, naming what to call, and nothing written."""
    pipe, optimizer = make(small_cnn())
    monkeypatch.setattr(xpipe.checkpoints.group.xr, "process_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"this run has 2 processes \(hosts\) and no torch.distributed process "
                                           r"group.*init_process_group\('gloo', init_method='xla://'\)"):
        xpipe.save(tmp_path / "ckpt", pipe, optimizer)
    assert list(tmp_path.iterdir()) == []


def test_a_load_into_another_kind_of_optimizer_changes_nothing(tmp_path):
    """SGD's state into AdamW: refused by the recorded kind, and (for a checkpoint that
    does not record it) by the state's keys, or rolled back when torch refuses it."""
    data = batches(2)
    pipe, adamw = make(small_cnn())
    sgd = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.step(*data[0])
    sgd.step()
    torch_xla.sync()
    xpipe.save(tmp_path / "sgd", pipe, sgd, step=1)
    sgd.zero_grad()
    pipe.step(*data[1])
    adamw.step()
    torch_xla.sync()

    def snapshot(optimizer):
        return ({key: value.cpu().clone() for key, value in pipe.state_dict().items()},
                {id(p): {k: v.cpu().clone() for k, v in s.items()} for p, s in optimizer.state.items()},
                [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])

    def assert_unchanged(optimizer, before):
        weights, state, groups = snapshot(optimizer)
        assert weights.keys() == before[0].keys() and all(torch.equal(weights[k], before[0][k]) for k in weights)
        assert state.keys() == before[1].keys()
        assert all(torch.equal(state[p][k], v) for p in state for k, v in before[1][p].items())
        assert groups == before[2]

    before = snapshot(adamw)
    with pytest.raises(ValueError, match=r"optimizer: the checkpoint '.*sgd' holds the state of a "
                                         r"torch.optim.sgd.SGD, and this optimizer is a torch.optim.adamw.AdamW"):
        xpipe.load(tmp_path / "sgd", pipe, adamw)
    assert_unchanged(adamw, before)

    manifest = tmp_path / "sgd" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"optimizer_kind"', '"not_recorded"'))
    with pytest.raises(ValueError, match=r"holds optimizer state \['momentum_buffer'\], and this optimizer "
                                         r"keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        xpipe.load(tmp_path / "sgd", pipe, adamw)
    assert_unchanged(adamw, before)
    fresh = torch.optim.AdamW(pipe.parameters())
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"does not load into this AdamW \(KeyError: 'step'\)"):
        xpipe.load(tmp_path / "sgd", pipe, fresh)
    assert_unchanged(fresh, before)


@pytest.mark.full  # a load into another layout is the quick tier's in test_another_stage_count_...
def test_a_checkpoint_from_the_spmd_executor_loads_here(tmp_path):
    """Saved by an spmd Pipe on a 2 (stage) x 2 (fsdp) x 2 (tensor) mesh, every weight
    and its AdamW state sharded over all three (the blocks split by rules given to
    the Pipe); loaded into the devices executor on 4 devices, whose next
    steps equal the plain model's loaded from the same checkpoint."""
    call_in_fresh_process(__file__, "save_from_spmd", str(tmp_path))
    weights = torch.load(tmp_path / "weights.pt")
    pipe = xpipe.Pipe(mlp_stack(blocks=8, width=16, inputs=8, outputs=4), chunks=4, stages=4, executor="devices",
                      loss_fn=F.mse_loss)
    pipe_optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    assert xpipe.load(tmp_path / "spmd", pipe, pipe_optimizer) == (1, None)
    for key, value in weights.items():
        assert torch.equal(pipe.state_dict()[key].cpu(), value), key
    plain = mlp_stack(blocks=8, width=16, inputs=8, outputs=4)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    checkpoints.load_plain(tmp_path / "spmd", plain, optimizer)
    for name in ("1.up.weight", "5.down.weight", "9.weight"):  # blocks on stages 0 and 2, then the head
        state = optimizer.state[plain.get_parameter(name)]
        assert state["exp_avg"].abs().sum() > 0 and state["step"] == 1, f"{name}'s AdamW state arrives unstacked"
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the next steps from the loaded AdamW state: the plain model's losses
        batch, target = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
        expected = F.mse_loss(plain(batch), target)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = pipe.step(batch, target)
        pipe_optimizer.step()
        pipe_optimizer.zero_grad()
        torch_xla.sync()
        torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=0)


def save_from_spmd(folder: str) -> None:
    """An spmd Pipe's checkpoint after one AdamW step, written in its own process
    (SPMD mode is process-global), with its weights beside it for comparison."""
    torch.manual_seed(0)
    pipe = xpipe.Pipe(mlp_stack(blocks=8, width=16, inputs=8, outputs=4), chunks=4,
                      mesh=xpipe.make_mesh(2, fsdp=2, tensor=2),
                      tensor_rules={"*.up.*": 0, "*.down.weight": 1, "*.down.bias": None})
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe(torch.randn(8, 8)).pow(2).mean().backward()
    optimizer.step()
    torch_xla.sync()
    xpipe.save(Path(folder) / "spmd", pipe, optimizer, step=1)
    torch.save(pipe.host_state_dict(), Path(folder) / "weights.pt")


def _copy(source: Path, destination: Path) -> None:
    destination.mkdir()
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
