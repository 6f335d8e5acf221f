"""The devices executor (one XLA device per stage) equals the unpipelined model.

Runs in the main, non-SPMD test process on its 8 emulated devices. Three models
whose stages cannot be stacked: a ResNet-style CNN (every stage a different
width), a U-Net (skip connections over two and three cuts) and an MLP cut
unevenly; chunks in {1, 4, 8}, each checkpoint mode.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
from equivalence import ATOL, RTOL, assert_pipe_matches, train_steps
from tiers import in_full_tier

import xpipe
from xpipe.models import mlp_stack, resnet_like, small_cnn, transformer_lm, unet

CASES = [(1, "never"), (4, "always"), (8, "except_last")]
# The CNNs run one case each in the quick tier (the MLP, the cheapest, runs all three).
RESNET_CASES = [in_full_tier(*CASES[0]), CASES[1], in_full_tier(*CASES[2])]
UNET_CASES = [in_full_tier(*CASES[0]), in_full_tier(*CASES[1]), CASES[2]]


def images(rows: int, channels: int = 3, size: int = 16) -> torch.Tensor:
    return torch.randn(rows, channels, size, size, generator=torch.Generator().manual_seed(rows))


@pytest.mark.parametrize("chunks, checkpoint", RESNET_CASES)
def test_resnet_like_cnn_on_four_devices(chunks, checkpoint):
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))
    pipe = assert_pipe_matches(resnet_like(), images(8), targets, F.cross_entropy, chunks=chunks, stages=4,
                               executor="devices", checkpoint=checkpoint)
    widths = [{tuple(p.shape) for p in module.parameters()} for module in pipe.runner.stage_modules]
    assert len({frozenset(w) for w in widths}) == 4, "every stage holds differently shaped weights"
    assert [str(d) for d in pipe.devices] == ["xla:0", "xla:1", "xla:2", "xla:3"]


@pytest.mark.parametrize("chunks, checkpoint", UNET_CASES)
def test_unet_skips_travel_straight_to_their_reader(chunks, checkpoint):
    targets = torch.randn(8, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    pipe = assert_pipe_matches(unet(), images(8), targets, F.mse_loss, chunks=chunks, stages=4,
                               executor="devices", checkpoint=checkpoint)
    crossings = {c.name: c for cut in pipe.partition.boundaries for c in cut}
    long_skips = [c for c in crossings.values() if c.last_stage - c.source_stage >= 2]
    assert long_skips, "the partition should put some encoder and its decoder two or more stages apart"
    stages = pipe.runner.staged.stages
    for skip in long_skips:
        assert skip.name in stages[skip.source_stage].outputs
        assert skip.name in stages[skip.last_stage].inputs
        for between in stages[skip.source_stage + 1 : skip.last_stage]:
            assert skip.name not in between.inputs + between.outputs, "a skip is not relayed through other stages"
    received = {name for program in stages[1:] for name in program.inputs}
    assert received == set(crossings), "what the stages receive is what the partition says crosses a cut"


@pytest.mark.parametrize("chunks, checkpoint", CASES)
def test_mlp_with_uneven_balance(chunks, checkpoint):
    generator = torch.Generator().manual_seed(2)
    batch, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
    pipe = assert_pipe_matches(mlp_stack(blocks=6, width=16, inputs=8, outputs=4), batch, targets, F.mse_loss,
                               chunks=chunks, balance=[1, 3, 2, 2], executor="devices", checkpoint=checkpoint)
    assert pipe.partition.balance == (1, 3, 2, 2)
    assert [len(list(m.parameters())) for m in pipe.runner.stage_modules] == [2, 18, 12, 8]


def test_five_training_steps_compile_once():
    pipe = xpipe.Pipe(resnet_like(), chunks=4, stages=4)
    assert pipe.executor == "devices", "auto: the 2 identical blocks of the first width are fewer than 4 stages"
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0)).to(pipe.devices[-1])
    losses, compiles = train_steps(lambda: F.cross_entropy(pipe(images(8)), targets), optimizer)
    assert compiles[1:] == [compiles[0]] * 4, f"compiles after each step: {compiles}"
    assert losses[-1] < losses[0]


def test_recomputation_replays_dropout():
    """checkpoint="always" recomputes every stage in the backward pass; with the same
    seeds its gradients equal those of checkpoint="never", which keeps the masks."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16),
                                   torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))

    batch = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    gradients = {}
    for mode in ("never", "always"):
        pipe = xpipe.Pipe(model(), chunks=4, stages=2, executor="devices", checkpoint=mode)
        for device in pipe.devices:
            xm.set_rng_state(7, device)
        pipe(batch).square().sum().backward()
        torch_xla.sync()
        gradients[mode] = {name: grad.cpu() for name, grad in pipe.named_gradients().items()}
    for name, kept in gradients["never"].items():
        torch.testing.assert_close(gradients["always"][name], kept, msg=lambda m, name=name: f"{name}: {m}")


def test_state_dict_round_trip_and_output_layout():
    model = small_cnn()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    pipe = xpipe.Pipe(model, chunks=2, stages=4)
    assert pipe.executor == "devices", "auto picks devices for a model with no repeated blocks"
    assert {k: tuple(v.shape) for k, v in pipe.state_dict().items()} == expected
    source = small_cnn(classes=10)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.mul_(1.5)
    pipe.load_state_dict(source.state_dict())
    batch = torch.randn(8, 3, 32, 32)
    output = pipe(batch)
    assert output.device == pipe.devices[-1]
    torch.testing.assert_close(output.cpu(), source(batch).detach(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        inferred = pipe(batch)
    assert not inferred.requires_grad
    torch.testing.assert_close(inferred.cpu(), source(batch).detach(), rtol=1e-4, atol=1e-5)
    loader_shaped = batch.view(2, 4, 3, 32, 32).transpose(0, 1)  # microbatches on dim 1
    torch.testing.assert_close(pipe(loader_shaped, microbatch_dim=1).cpu(),
                               source(batch).detach().view(2, 4, 10).transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_timeline_has_every_cell_in_dependency_order():
    """Each cell is launched after the cell it depends on (host times, one thread); a
    cell's ready time, from an XLA callback thread that can run late, after its launch."""
    pipe = xpipe.Pipe(mlp_stack(blocks=6, width=16, inputs=8, outputs=4), chunks=4, balance=[1, 3, 2, 2],
                      executor="devices")
    pipe(torch.randn(8, 8)).sum().backward()
    torch_xla.sync()
    xm.wait_device_ops()
    events = {(e.stage, e.kind, e.microbatch): e for e in pipe.runner.timeline}
    assert len(events) == len(pipe.runner.timeline) == 2 * 4 * 4
    for (stage, kind, microbatch), event in events.items():
        assert event.launched <= event.ready
        before = (stage - 1, "F", microbatch) if kind == "F" else (stage + 1, "B", microbatch)
        if before in events:
            assert events[before].launched < event.launched, f"{before} must come before {stage}{kind}{microbatch}"


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="stages: 9 stages need 9 XLA devices, but there are 8"):
        xpipe.Pipe(small_cnn(), chunks=2, stages=9, executor="devices")
    with pytest.raises(ValueError, match="mesh: the devices executor .* takes no mesh"):
        xpipe.Pipe(small_cnn(), chunks=2, mesh=object(), executor="devices")
    interleaving = xpipe.Pipe(small_cnn(), chunks=4, stages=2, schedule="1f1b")
    with pytest.raises(RuntimeError, match=r"schedule '1f1b' interleaves forwards and backwards.*pipe.step"):
        interleaving(torch.zeros(8, 3, 32, 32))
    pipe = xpipe.Pipe(small_cnn(), chunks=4, stages=2)
    with pytest.raises(TypeError, match=r"x: the model takes 1 inputs \(input_1\), got 2"):
        pipe(torch.zeros(8, 3, 32, 32), torch.zeros(8))


def test_a_weight_tied_across_devices_trains_as_one():
    """The LM's embedding and head share one Parameter, used on devices 0 and 3:
    three AdamW steps through pipe(x) equal the plain model's (losses and the tied
    weight), and the model's tie stays a tie on the first stage's device."""
    model = transformer_lm(blocks=2, width=16, heads=2, seq=8, vocab=32)
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=2, stages=4, executor="devices")
    assert model.head.weight is model.embed.tokens.weight and model.head.weight.device == pipe.devices[0]
    assert sum(p is model.head.weight for p in pipe.parameters()) == 1, "the optimizer steps it once"
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(3))

    def next_token_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    for _ in range(3):
        loss = next_token_loss(pipe(ids[:, :-1]), ids[:, 1:].to(pipe.devices[-1]))
        loss.backward()
        torch.testing.assert_close(model.head.weight.grad.cpu(), _plain_grad(reference, ids, next_token_loss),
                                   rtol=RTOL, atol=ATOL)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch_xla.sync()
    torch.testing.assert_close(model.head.weight.cpu(), reference.head.weight, rtol=RTOL, atol=ATOL)


def _plain_grad(reference: torch.nn.Module, ids: torch.Tensor, loss_fn) -> torch.Tensor:
    loss_fn(reference(ids[:, :-1]), ids[:, 1:]).backward()
    return reference.head.weight.grad.clone()


EXITS_WHILE_A_CALLBACK_WAITS = """
import torch, torch.nn.functional as F, torch_xla, xpipe
from xpipe._xla import on_ready
from xpipe.models import mlp_stack
pipe = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=4), chunks=4, stages=4, executor="devices",
                  loss_fn=F.mse_loss)
pipe.step(torch.randn(16, 8), torch.randn(16, 4))
x = torch.randn(1024, 1024, device=torch_xla.device())
for _ in range(40):  # still running when the script ends, with a callback registered on it
    x = torch.tanh(x @ x)
torch_xla.sync()
on_ready(x, lambda: None)
print("last line", flush=True)
"""


def test_a_script_ends_while_a_ready_callback_is_pending():
    """torch_xla's exit hook waits for the devices holding the GIL, which a pending
    ready-callback (the executor's timeline registers one per cell) needs to run: the
    process hung at exit after its last line, every time in this script (3 of 3 runs
    before the fix) and about 1 run in 10 of a plain training script."""
    result = subprocess.run([sys.executable, "-c", EXITS_WHILE_A_CALLBACK_WAITS], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, CPU_NUM_DEVICES="4"))
    assert result.returncode == 0 and "last line" in result.stdout, result.stderr[-3000:]
