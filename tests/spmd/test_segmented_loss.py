"""The loss over sequence segments (xpipe.spmd.segmented_loss) on 2 stages x 2 fsdp x 2
tensor: inside ``LossOverSegments`` a cross-entropy of a linear layer's logits, the
head split by vocabulary and the rows by row group, equals torch's over all logits,
value and gradients; the forms it would not compute exactly, and logits below the
bound (``xpipe.layout.LOSS_SEGMENTS_FROM``), run as written. (The loss's shapes and
collectives in a whole step: test_audit.py.)"""

import pytest
import torch
import torch.nn.functional as F

import xpipe
from xpipe.layout import LOSS_SEGMENT_TOKENS, sequence_segments
from xpipe.mesh import spmd_device
from xpipe.spmd.placement import Placement
from xpipe.spmd.segmented_loss import LossOverSegments


pytestmark = pytest.mark.usefixtures("segment_every_loss")  # tests/spmd/conftest.py


@pytest.fixture(scope="module")
def placement():
    return Placement(xpipe.make_mesh(2, fsdp=2, tensor=2))


def test_sequences_are_cut_into_at_least_two_segments_that_divide_them_and_none_longer_than_the_bound():
    assert [sequence_segments(seq) for seq in (1, 2, 7, 12)] == [1, 2, 7, 2]
    assert sequence_segments(2048) == 2048 // LOSS_SEGMENT_TOKENS
    for seq in (2, 5, 12, 255, 257, 1000, 4097):
        segments = sequence_segments(seq)
        assert seq % segments == 0 and seq // segments <= LOSS_SEGMENT_TOKENS and segments >= 2


def ran_over_segments(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph holds the segmented loss's backward."""
    seen, pending = set(), [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_SegmentedLossBackward":
            return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


def _data(bias: bool):
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(8, 12, 8, generator=generator), torch.randn(20, 8, generator=generator)
    offset = torch.randn(20, generator=generator) if bias else None
    labels = torch.randint(0, 20, (8, 12), generator=generator)
    labels[0, :5] = -100
    return [t for t in (hidden, weight, offset) if t is not None], labels


def _on_device(placement, tensors):
    """``tensors`` on the mesh as the layers after the body hold them: the rows over the
    batch axes, the head split by vocabulary over "tensor"."""
    device = spmd_device()
    on_device = [t.to(device).requires_grad_() for t in tensors]
    placement.place(on_device[0], (placement.batch_axes, None, None))
    for tensor in on_device[1:]:
        placement.place(tensor, placement.step_spec(on_device[1])[:tensor.dim()])
    return on_device


@pytest.mark.parametrize("loss_of, bias", [
    (lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=0.1), True),
    (lambda logits, labels: torch.nn.CrossEntropyLoss(reduction="sum")(logits.float().view(-1, 20),
                                                                       labels.view(-1)), False),
    (lambda logits, labels: F.cross_entropy(logits.unflatten(0, (2, -1)).flatten(0, 2), labels.flatten()), False)],
    ids=["mean, label smoothing, bias", "sum, float, view", "in microbatches"])
def test_the_segmented_loss_and_its_gradients_equal_torchs_over_all_logits(placement, loss_of, bias):
    """Equal to float32 rounding (rtol 1e-5): the same per-token terms, summed in
    another order; ignored labels (-100) count in neither the sum nor the mean."""
    tensors, labels = _data(bias)
    leaves = [t.clone().requires_grad_() for t in tensors]
    expected = loss_of(F.linear(*leaves), labels)
    expected.backward()
    on_device = _on_device(placement, tensors)
    with LossOverSegments(placement):
        loss = loss_of(F.linear(*on_device), labels.to(on_device[0].device))
    assert ran_over_segments(loss)
    loss.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("hidden", "weight", "bias"), on_device, leaves):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("loss_of", [
    lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").sum(),
    lambda logits, labels: F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=torch.ones(
        20, device=logits.device)),
    lambda logits, labels: F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()),
    lambda logits, labels: F.cross_entropy(logits.transpose(1, 2), labels)],
    ids=["per token", "class weights", "sliced logits", "classes in dim 1"])
def test_losses_the_segments_would_not_keep_exactly_run_as_written(placement, loss_of):
    tensors, labels = _data(bias=False)
    expected = loss_of(F.linear(*tensors), labels)
    on_device = _on_device(placement, tensors)
    with LossOverSegments(placement):
        loss = loss_of(F.linear(*on_device), labels.to(on_device[0].device))
    assert not ran_over_segments(loss)
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_logits_below_the_bound_are_made_whole(placement, monkeypatch):
    """At the default bound these logits (2 rows x 12 tokens x 10 words a device) are
    too small to be worth two loops: the loss runs as written."""
    monkeypatch.undo()
    tensors, labels = _data(bias=False)
    on_device = _on_device(placement, tensors)
    with LossOverSegments(placement):
        loss = F.cross_entropy(F.linear(*on_device).flatten(0, 1), labels.flatten().to(on_device[0].device))
    assert not ran_over_segments(loss)
