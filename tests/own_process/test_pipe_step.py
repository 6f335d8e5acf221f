"""``pipe.step(inputs, target)``: every schedule, run by the devices executor as its
table says, equals the unpipelined model's ``loss_fn(model(inputs), target)``.

Runs in the main, non-SPMD process on its 8 emulated devices. Compared: the loss,
every gradient, and every buffer (BatchNorm's running statistics) after the step,
fp32 on both sides, rtol 1e-4 (the pipeline sums microbatch gradients in another
order than one batched backward).
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
from equivalence import ATOL, RTOL, assert_step_matches, train_steps
from tiers import in_full_tier

import xpipe
from xpipe.models import mlp_stack, resnet_like, small_cnn, unet

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("circular", 2)]


def images(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def labels(rows: int) -> torch.Tensor:
    return torch.randint(0, 10, (rows,), generator=torch.Generator().manual_seed(rows))


@pytest.mark.parametrize("schedule, virtual", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["except_last", pytest.param("always", marks=pytest.mark.full),
                                        pytest.param("never", marks=pytest.mark.full)])
def test_every_schedule_trains_the_resnet_like_cnn(schedule, virtual, checkpoint):
    pipe = assert_step_matches(resnet_like(), images(8), labels(8), torch.nn.CrossEntropyLoss(), chunks=4,
                               stages=2, schedule=schedule, virtual=virtual, checkpoint=checkpoint,
                               executor="devices")
    assert pipe.schedule.name == schedule and len(pipe.devices) == 2
    assert len(pipe.partition.balance) == 2 * virtual, "one model stage per device and virtual round"
    ran = {(e.stage, e.kind, e.microbatch) for e in _timeline(pipe)}
    in_table = {tuple(action) for row in pipe.schedule.table for action in row if action is not None}
    assert ran == in_table, "every cell of the table ran, and nothing else"


@pytest.mark.parametrize("schedule, virtual", [SCHEDULES[-1], *(in_full_tier(*each) for each in SCHEDULES[:-1])])
def test_every_schedule_trains_the_unet_with_long_skips(schedule, virtual):
    target = torch.randn(8, 2, 16, 16, generator=torch.Generator().manual_seed(1))
    assert_step_matches(unet(), images(8), target, F.mse_loss, chunks=4, stages=2, schedule=schedule,
                        virtual=virtual, executor="devices")


def test_cells_run_in_the_tables_order():
    """The host launches a cell only after the cells it depends on, on other devices
    (the value then crosses with ``.to(device)``, which waits for it to be ready).

    Launch times are compared, both taken on the host's one thread. A cell's ready time
    is taken on an XLA callback thread, which runs late on a busy machine (1.4 ms on a
    2-core CI run), so it is only checked to come after its own launch.
    """
    pipe = assert_step_matches(small_cnn(), torch.randn(8, 3, 32, 32), labels(8), torch.nn.CrossEntropyLoss(),
                               chunks=4, stages=4, schedule="zb-h1", executor="devices")
    events = {(e.stage, e.kind, e.microbatch): e for e in _timeline(pipe)}
    for (stage, kind, microbatch), event in events.items():
        assert event.launched <= event.ready
        needed = {"F": [(stage - 1, "F", microbatch)], "W": [(stage, "I", microbatch)],
                  "I": [(stage + 1, "I", microbatch)]}[kind]
        for before in needed:
            if before in events:
                assert events[before].launched < event.launched, f"{before} must be launched before {event}"


def test_a_sum_reducing_loss_and_a_ragged_last_batch():
    assert_step_matches(resnet_like(), images(14), labels(14), torch.nn.CrossEntropyLoss(reduction="sum"),
                        chunks=4, stages=2, schedule="1f1b", executor="devices")


def ignored_unevenly(rows: int, ignored: int = -100) -> torch.Tensor:
    """Class labels with the first microbatch's (of 4) first rows ignored (-100, or ``ignored``)."""
    target = labels(rows)
    target[:rows // 4 - 1] = ignored
    return target


def declared(reduction: str, **attributes):
    """A plain function that says how it reduces, as a loss module would."""
    def loss(output, target):
        return F.cross_entropy(output, target, reduction=reduction)
    loss.reduction = reduction
    for name, value in attributes.items():
        setattr(loss, name, value)
    return loss


@pytest.mark.parametrize("loss_fn", [
    torch.nn.CrossEntropyLoss(ignore_index=-100),
    torch.nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 10), ignore_index=-100),
    F.cross_entropy,
    declared("mean", ignore_index=-100),
    declared("sum"),
], ids=["module", "class-weights", "function", "declared-mean", "declared-sum"])
def test_losses_over_unevenly_ignored_targets_equal_the_plain_models(loss_fn):
    """A loss that means over the targets it does not ignore weighs each microbatch by
    its share of them (here 1, 4, 4 and 4 of 13)."""
    assert_step_matches(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), torch.randn(16, 8),
                        ignored_unevenly(16), loss_fn, chunks=4, stages=2, schedule="1f1b", executor="devices")


def test_a_microbatch_whose_targets_are_all_ignored_adds_nothing():
    """Its mean over no target is NaN; it weighs 0, so the loss, every gradient and the
    buffers are the plain model's (the step's loss was NaN)."""
    target = ignored_unevenly(16)
    target[:4] = -100  # the whole first microbatch
    assert_step_matches(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), torch.randn(16, 8), target,
                        torch.nn.CrossEntropyLoss(ignore_index=-100), chunks=4, stages=2, executor="devices")


def test_a_nan_from_a_microbatch_is_named_and_the_gradients_stay_as_they_were():
    """An undeclared function around a loss that ignores -100, on a batch whose first
    microbatch is all padding: that microbatch's mean is NaN, which the check names
    (not as a reduction that sums); the gradients of the step before are untouched."""
    ignoring = torch.nn.CrossEntropyLoss(ignore_index=-100)
    pipe = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), chunks=4, stages=2, executor="devices",
                      loss_fn=lambda output, t: ignoring(output, t))
    batch, target = torch.randn(16, 8), labels(16)
    target[:4] = -100
    earlier = {p: torch.ones_like(p) for p in pipe.parameters()}
    for parameter, grad in earlier.items():
        parameter.grad = grad
    with pytest.raises(ValueError, match=r"loss_fn: the step's loss is nan where the whole batch's is [0-9.]+: a "
                                         r"microbatch's loss is NaN or inf .* `ignore_index` attributes"):
        pipe.step(batch, target)
    assert all(parameter.grad is grad for parameter, grad in earlier.items())
    assert all(torch.equal(grad.cpu(), torch.ones(grad.shape)) for grad in earlier.values())


@pytest.mark.parametrize("device", [0, 1])
def test_ignored_targets_already_on_a_device_count_as_on_the_host(device):
    """Targets from a device loader (on the first or the last stage's device): their
    items are counted on the host (counted lazily on the device, the losses came out wrong)."""
    target = ignored_unevenly(16)
    model = mlp_stack(blocks=4, width=16, inputs=8, outputs=10)
    reference = copy.deepcopy(model)
    batch = torch.randn(16, 8)
    pipe = xpipe.Pipe(model, chunks=4, stages=2, executor="devices", loss_fn=torch.nn.CrossEntropyLoss())
    loss = pipe.step(batch, target.to(torch_xla.device(device)))
    torch_xla.sync()
    torch.testing.assert_close(loss.cpu(), F.cross_entropy(reference(batch), target), rtol=RTOL, atol=ATOL)


def test_a_loss_function_that_does_not_say_it_sums_is_caught_on_its_first_step():
    batch, target = torch.randn(16, 8), labels(16)
    summing = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), chunks=4, stages=2,
                         executor="devices", loss_fn=lambda output, t: F.cross_entropy(output, t, reduction="sum"))
    with pytest.raises(ValueError, match=r"loss_fn: on the whole batch it gives .* weighted by their rows give .*: "
                                         r"it does not mean over rows .* give the function a `reduction` attribute"):
        summing.step(batch, target)
    assert all(p.grad is None for p in summing.parameters()), "a refused step leaves every gradient as it was"
    meaning = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), chunks=4, stages=2,
                         executor="devices", loss_fn=lambda output, t: F.cross_entropy(output, t))
    for _ in range(2):  # checked once, then trusted
        meaning.step(batch, target)
    torch_xla.sync()
    assert len(meaning.runner.checked_losses) == 1


@pytest.mark.parametrize("ignored", [-100, -1])
def test_an_undeclared_loss_is_checked_again_on_a_batch_that_tells_it_apart(ignored):
    """A plain function around a loss that ignores -100 (or -1), first on batches
    without padding (where counting rows is right), then on an unevenly padded one:
    that step was weighted by rows (a gradient 18% off, no error; with -1, on every
    later batch, as only -100 was looked for); now it is checked and refused, every
    gradient left as it was."""
    ignoring = torch.nn.CrossEntropyLoss(ignore_index=ignored)
    pipe = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), chunks=4, stages=2, executor="devices",
                      loss_fn=lambda output, t: ignoring(output, t))
    batch = torch.randn(16, 8)
    for _ in range(2):
        pipe.step(batch, labels(16))
    before = {p: p.grad.clone() for p in pipe.parameters()}
    with pytest.raises(ValueError, match=r"loss_fn: on the whole batch it gives .* it does not mean over rows \(it "
                                         r"sums, or ignores some targets\)"):
        pipe.step(batch, ignored_unevenly(16, ignored))
    assert all(torch.equal(p.grad.cpu(), grad.cpu()) for p, grad in before.items())


def test_float_targets_settle_an_undeclared_loss_on_its_first_step(monkeypatch):
    """Float targets ignore nothing: the first step's check is the only one (each
    check computes the whole batch's loss on the host)."""
    from xpipe.devices.loss import StepLoss

    checks, check = [], StepLoss.check_reduction
    monkeypatch.setattr(StepLoss, "check_reduction", lambda self, *args: checks.append(args) or check(self, *args))
    batch = torch.randn(16, 8)
    rows_mean = xpipe.Pipe(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), chunks=4, stages=2,
                           executor="devices", loss_fn=lambda output, t: F.mse_loss(output, t))
    for _ in range(3):
        rows_mean.step(batch, torch.randn(16, 10))
    assert len(checks) == 1


@pytest.mark.parametrize("loss_fn, ignored", [
    (functools.partial(F.cross_entropy, ignore_index=-1), -1),
    (functools.partial(F.nll_loss, ignore_index=-1), -1),
    (torch.nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 10), ignore_index=255), 255),
], ids=["partial-cross-entropy", "partial-nll", "class-weights-ignoring-255"])
def test_losses_that_ignore_another_value_are_read_from_torchs_own_objects(loss_fn, ignored):
    """torch's loss objects and partials of its functions say what they ignore (with
    class weights, an ignore index past the classes raised an IndexError inside xpipe)."""
    assert_step_matches(mlp_stack(blocks=4, width=16, inputs=8, outputs=10), torch.randn(16, 8),
                        ignored_unevenly(16, ignored=ignored), loss_fn, chunks=4, stages=2, executor="devices")


def test_inputs_that_require_grad_get_their_gradient():
    model = small_cnn()
    batch = torch.randn(8, 3, 32, 32)
    reference = copy.deepcopy(model)
    expected_input = batch.clone().requires_grad_()
    F.cross_entropy(reference(expected_input), labels(8)).backward()
    pipe = xpipe.Pipe(model, chunks=4, stages=2, schedule="1f1b", loss_fn=F.cross_entropy)
    given = batch.to(pipe.devices[0]).requires_grad_()
    pipe.step(given, labels(8))
    torch.testing.assert_close(given.grad.cpu(), expected_input.grad, rtol=RTOL, atol=ATOL)


def test_five_steps_of_1f1b_compile_once_and_follow_the_plain_model():
    model, steps = resnet_like(), 5
    reference = copy.deepcopy(model)
    pipe = xpipe.Pipe(model, chunks=4, stages=4, schedule="1f1b", loss_fn=F.cross_entropy)
    assert pipe.executor == "devices", "auto picks the executor that runs 1F1B"
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    batches = [(images(8, seed), labels(8)) for seed in range(steps)]
    batch_of_step = iter(batches)
    losses, compiles = train_steps(lambda: pipe.step(*next(batch_of_step)), optimizer, steps, backward=False)
    expected = []
    for batch, target in batches:
        loss = F.cross_entropy(reference(batch), target)
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    assert compiles[1] == compiles[-1], f"compiles after each step: {compiles}"


def test_pipe_x_runs_what_autograd_can_and_refuses_the_rest():
    batch, target = torch.randn(8, 3, 32, 32), labels(8)
    model = small_cnn()
    reference = copy.deepcopy(model)
    circular = xpipe.Pipe(model, chunks=4, stages=2, schedule="circular", virtual=2)
    assert circular.executor == "devices"
    F.cross_entropy(circular(batch), target.to(circular.devices[-1])).backward()  # all forwards come first
    F.cross_entropy(reference(batch), target).backward()
    gradients = circular.named_gradients()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(gradients[name].cpu(), parameter.grad, rtol=RTOL, atol=ATOL)

    model = small_cnn()
    reference = copy.deepcopy(model)
    interleaving = xpipe.Pipe(model, chunks=4, stages=2, schedule="zb-h1")
    with pytest.raises(RuntimeError, match=r"schedule 'zb-h1' interleaves forwards and backwards.*pipe.step"):
        interleaving(batch)
    with torch.no_grad():
        torch.testing.assert_close(interleaving(batch).cpu(), reference(batch), rtol=RTOL, atol=ATOL)


def test_bad_step_arguments_name_themselves():
    batch, target = torch.randn(8, 3, 32, 32), labels(8)
    with pytest.raises(ValueError, match="loss_fn: pipe.step computes the loss inside the pipeline"):
        xpipe.Pipe(small_cnn(), chunks=4, stages=2).step(batch, target)
    with pytest.raises(TypeError, match="loss_fn: expected a callable"):
        xpipe.Pipe(small_cnn(), chunks=4, stages=2, loss_fn="cross_entropy")
    with pytest.raises(ValueError, match="virtual: 'gpipe' runs one model stage per rank"):
        xpipe.Pipe(small_cnn(), chunks=4, stages=2, virtual=2)
    with pytest.raises(ValueError, match="schedule: the spmd executor runs 'gpipe', 'circular' and '1f1b'"):
        xpipe.Pipe(small_cnn(), chunks=4, stages=2, schedule="interleaved", virtual=2, executor="spmd")
    with pytest.raises(ValueError, match="balance: has 3 entries, not a multiple of virtual=2"):
        xpipe.Pipe(small_cnn(), chunks=4, balance=[1, 2, 3], schedule="circular", virtual=2)
    pipe = xpipe.Pipe(small_cnn(), chunks=4, stages=2, schedule="1f1b", loss_fn=torch.nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="target: has 6 rows and the inputs 8"):
        pipe.step(batch, target[:6])
    unreduced = xpipe.Pipe(small_cnn(), chunks=4, stages=2, schedule="1f1b",
                           loss_fn=torch.nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(ValueError, match="loss_fn: its reduction is 'none'"):
        unreduced.step(batch, target)
    not_a_loss = xpipe.Pipe(small_cnn(), chunks=4, stages=2, schedule="1f1b", loss_fn=lambda output, _: output)
    with pytest.raises(ValueError, match=r"loss_fn: must return a scalar tensor, got \[2, 10\]"):
        not_a_loss.step(batch, target)
    assert "loss_fn" not in dict(pipe.named_modules()), "the loss is not part of the model"


def _timeline(pipe: xpipe.Pipe) -> list:
    """The last step's cells as they ran, once the devices are done."""
    xm.wait_device_ops()
    return pipe.runner.timeline


def test_1f1b_holds_what_its_table_says_gpipe_holds_every_microbatch():
    """Measured: bytes held for backward passes at the peak, per device, in proportion
    to the table's peak in flight (S - rank microbatches for 1F1B, all 16 for GPipe)."""
    held, in_flight = {}, {}
    for schedule in ("gpipe", "1f1b"):
        pipe = xpipe.Pipe(mlp_stack(blocks=8, width=64, inputs=16, outputs=4), chunks=16, stages=4,
                          schedule=schedule, loss_fn=F.mse_loss, checkpoint="never", executor="devices")
        pipe.step(torch.randn(64, 16), torch.randn(64, 4))
        held[schedule], in_flight[schedule] = pipe.runner.peak_held_bytes, pipe.schedule.peak_in_flight
    assert in_flight == {"gpipe": (16, 16, 16, 16), "1f1b": (4, 3, 2, 1)}
    for rank in range(4):
        assert held["1f1b"][rank] * 16 == held["gpipe"][rank] * in_flight["1f1b"][rank]
