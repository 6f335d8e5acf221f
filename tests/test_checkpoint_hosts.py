"""One checkpoint written by two processes together, as a pod's hosts write one.

torch_xla 2.9's CPU client runs no SPMD program across processes, so each of the
two processes here runs the same Pipe (2 stages x 4 data) on 8 emulated devices
of its own, and they are joined by a gloo process group, as the hosts of a pod
are. What this runs is the hosts' coordination: one staging directory made by
process 0, one plan agreed by DCP (which gives each chunk that both hold to one
of them: each writes about half), every process's file hashes in the manifest,
the rename by process 0, and loads by both together; the save and a load each
follow an optimizer step not yet synced. What it cannot run: hosts holding
different shards of one program.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import torch_xla

import xpipe
import xpipe.checkpoints.group
from checkpoint_checks import assert_chunks_tile_every_tensor
from equivalence import assert_loads_exactly
from xpipe.models import mlp_stack

TESTS = Path(__file__).parent


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp_stack(blocks=4, width=16, inputs=8, outputs=4)


def save_as_one_of_two_processes(folder: str, rank: str, port: str) -> None:
    """One process's part: a step, then ``xpipe.save`` with the other process; run in a
    process of its own."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=2)
    xpipe.save(Path(folder) / "plain", model())  # a CPU module's save leaves the process free to enter SPMD
    pipe = xpipe.Pipe(model(), chunks=4, mesh=xpipe.make_mesh(2, 4), loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    pipe.step(inputs, torch.zeros(16, 4))
    optimizer.step()  # not synced: the save runs what is pending first (it once read donated buffers)
    with pytest.raises(ValueError, match="background: a save from 2 processes is written blocking"):
        xpipe.save(Path(folder) / "ckpt", pipe, optimizer, background=True)
    xpipe.save(Path(folder) / "ckpt", pipe, optimizer, step=1)
    saved = pipe.host_state_dict()
    if rank == "0":
        torch.save(saved, Path(folder) / "weights.pt")
    # Both processes load it together (DCP's load over the group): back over a step not yet
    # synced (the load runs it first), and into another layout.
    pipe.step(inputs, torch.zeros(16, 4))
    optimizer.step()
    resumed = xpipe.Pipe(model(), chunks=4, mesh=xpipe.make_mesh(4, 2), loss_fn=F.mse_loss)
    for target, its_optimizer in ((pipe, optimizer), (resumed, torch.optim.AdamW(resumed.parameters()))):
        assert xpipe.load(Path(folder) / "ckpt", target, its_optimizer) == (1, None)
        assert all(torch.equal(value, saved[key]) for key, value in target.host_state_dict().items())
    pipe.step(inputs, torch.zeros(16, 4))  # and training goes on from the loaded state
    optimizer.step()
    torch_xla.sync()
    dist.destroy_process_group()


def misuse_as_one_of_two_processes(folder: str, rank: str, port: str) -> None:
    """One process's part in two saves the processes do not agree on: a path per rank
    (as ``torch.save`` is often called under DDP), then a save only process 0 calls."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=2)
    try:
        xpipe.save(Path(folder) / f"ckpt-{rank}", model())
    except ValueError as error:
        print("refused:", error)
    xpipe.checkpoints.group.JOIN_SECONDS = 3.0
    if rank == "0":
        try:
            xpipe.save(Path(folder) / "alone", model())
        except RuntimeError as error:
            print("alone:", error)
    else:
        time.sleep(5.0)  # while process 0 waits for a save this process never calls


def run_two_processes(function: str, folder: Path) -> list[str]:
    """``function(folder, rank, port)`` of this module in two processes joined by gloo; their outputs."""
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}]; from test_checkpoint_hosts import "
            f"{function} as run; run(*sys.argv[1:])")
    environment = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    port = free_port()
    workers = [subprocess.Popen([sys.executable, "-c", code, str(folder), str(rank), str(port)], env=environment,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [worker.communicate(timeout=600)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    return outputs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_write_one_checkpoint_that_loads_into_the_plain_model(tmp_path):
    run_two_processes("save_as_one_of_two_processes", tmp_path)

    checkpoint = tmp_path / "ckpt"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "plain", "weights.pt"], "no staging left"
    assert_chunks_tile_every_tensor(checkpoint)
    storage = dcp.FileSystemReader(checkpoint).read_metadata().storage_data
    written = {info.relative_path for info in storage.values()}
    assert written == {"__0_0.distcp", "__1_0.distcp"}, written  # each process wrote chunks, into its own file
    manifest = (checkpoint / "manifest.json").read_text()
    assert all(f'"{name}"' in manifest for name in written), manifest  # both files' hashes checked on load

    plain = model()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    assert_loads_exactly(tmp_path / "plain", model().state_dict(), (plain, None))
    assert_loads_exactly(checkpoint, torch.load(tmp_path / "weights.pt"), (plain, plain_optimizer))
    assert all(plain_optimizer.state[p]["step"] == 1 and plain_optimizer.state[p]["exp_avg"].any()
               for p in plain.parameters()), "AdamW's state of every parameter"


def test_a_path_per_process_and_a_save_one_process_skips_are_refused_naming_them(tmp_path):
    """Each process once reported success for ``ckpt-{rank}`` while process 1's shards
    went into ``ckpt-0``; a save that process 1 never called waited for gloo's timeout
    and named no cause."""
    outputs = run_two_processes("misuse_as_one_of_two_processes", tmp_path)
    paths = f"process 0: '{tmp_path / 'ckpt-0'}', process 1: '{tmp_path / 'ckpt-1'}'"
    for output in outputs:
        assert (f"refused: path: the 2 processes of this run share one checkpoint, at one path, but xpipe.save was "
                f"given different ones ({paths})") in output, output[-3000:]
    assert list(tmp_path.iterdir()) == [], "nothing written, no staging left"
    assert "alone: xpipe.save: not every one of the 2 processes of this run called it within 3 s (" in outputs[0], \
        outputs[0][-3000:]
    assert "Ranks 1 failed to pass monitoredBarrier" in outputs[0], "gloo's reason names process 1"
