"""Real models as their libraries ship them, through the devices executor, against themselves unpipelined.

Hugging Face Llama (tied embeddings across the first and last stage, grouped-
query attention, a padding attention mask, keyword inputs, a ``ModelOutput``)
and GPT-2 (``labels=`` given: the loss comes from the model) are captured with
torch.export on a sample batch; torchvision's ResNet-18 (BatchNorm, train and
eval) and ViT go through torch.fx. One training step each: outputs, loss and
every gradient, rtol 1e-4 in float32, against the model on the CPU (ResNet-18 in
train mode: on an XLA device, see its test).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torchvision
from equivalence import ATOL, RTOL, assert_pipe_matches
from hf_models import (assert_gradients_match, assert_llama_step_matches, assert_loss_step_matches, bert, gpt2, llama,
                       mixtral, padding_mask, t5, tokens)

import xpipe


@pytest.mark.parametrize("checkpoint", ["except_last", pytest.param("never", marks=pytest.mark.full)])
def test_llama_with_a_padding_mask_on_four_devices(checkpoint):
    model = llama()
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8)
    pipe = xpipe.Pipe(model, chunks=4, stages=4, checkpoint=checkpoint, executor="devices",
                      sample_input={"input_ids": ids[:2], "attention_mask": mask[:2]})
    assert pipe.executor == "devices"
    assert pipe.partition.stages[0][0] == "model.embed_tokens" and pipe.partition.stages[-1][-1] == "lm_head"
    assert_llama_step_matches(pipe, reference, ids, mask)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the model's tie stays a tie"
    assert model.lm_head.weight.device == pipe.devices[0], "the model holds the weights that train"


def test_gpt2_with_labels_returns_the_models_own_loss():
    model = gpt2(dropout=0.0)  # so both runs draw nothing
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    pipe = xpipe.Pipe(model, chunks=4, stages=4, executor="devices",
                      sample_input={"input_ids": ids[:2], "labels": ids[:2]})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the model's own, after wrapping
    output = pipe(input_ids=ids, labels=ids)
    output.loss.backward()
    optimizer.step()
    torch_xla.sync()
    expected = reference(input_ids=ids, labels=ids)
    expected.loss.backward()
    torch.testing.assert_close(output.loss.cpu(), expected.loss.detach(), rtol=RTOL, atol=ATOL)
    assert_gradients_match(pipe, reference)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference.state_dict()[name], rtol=RTOL, atol=ATOL)


def padded_labels(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with -100 (ignored) at the end of each row, a different length per row:
    the microbatches hold unequal numbers of labels that count."""
    labels = ids.clone()
    for row in range(len(labels)):
        labels[row, len(labels[row]) - (3 * row) % 7:] = -100
    return labels


@pytest.mark.parametrize("family, chunks", [("gpt2", 2), ("llama", 4)])
def test_padded_labels_give_the_plain_models_loss(family, chunks):
    """A causal LM's loss means over the labels that count in the whole batch, not per
    microbatch: the microbatches' losses weigh by their share of those labels."""
    model = gpt2(dropout=0.0) if family == "gpt2" else llama()
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    inputs = {"input_ids": ids, "labels": padded_labels(ids)}
    pipe = xpipe.Pipe(model, chunks=chunks, stages=2, executor="devices",
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert_loss_step_matches(pipe, reference, **inputs)


def test_a_microbatch_of_padding_only_adds_nothing_to_the_models_own_loss():
    """Sorting by length puts the padding-only rows together: a microbatch whose labels
    are all ignored means over nothing (NaN) and weighs 0; the step's loss and every
    gradient are the plain model's (the loss was NaN)."""
    model = gpt2(dropout=0.0)
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    labels = padded_labels(ids)
    labels[:4] = -100  # the first of two microbatches
    inputs = {"input_ids": ids, "labels": labels}
    pipe = xpipe.Pipe(model, chunks=2, stages=2, executor="devices",
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert_loss_step_matches(pipe, reference, **inputs)


def test_mixtral_experts_and_router_train_as_the_plain_model():
    """Data-dependent routing: each microbatch sends its tokens to other experts. The
    experts are captured in the dense form (:mod:`xpipe.capture.experts`); transformers' own
    grouped matmul computes zeros on XLA (:mod:`xpipe.capture.substitutes`)."""
    model = mixtral()
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    inputs = {"input_ids": ids, "labels": padded_labels(ids)}
    pipe = xpipe.Pipe(model, chunks=2, stages=2, executor="devices",
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert_loss_step_matches(pipe, reference, **inputs)


def test_bert_with_a_padding_mask_and_labels_on_four_devices():
    model = bert()
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    pipe = xpipe.Pipe(model, chunks=4, stages=4, executor="devices",
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert pipe.partition.stages[0][0] == "bert.embeddings" and pipe.partition.stages[-1][-1] == "cls"
    assert_loss_step_matches(pipe, reference, **inputs)


def test_t5_encoder_decoder_with_labels_on_four_devices():
    """The decoder's blocks read the encoder's output: a value that crosses stages."""
    model = t5()
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.roll(1, 1)}
    pipe = xpipe.Pipe(model, chunks=4, stages=4, executor="devices",
                      sample_input={name: value[:2] for name, value in inputs.items()})
    names = [name for stage in pipe.partition.stages for name in stage]
    assert {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"} <= set(names), names
    assert_loss_step_matches(pipe, reference, **inputs)


def test_a_captured_model_refuses_the_mode_it_was_not_captured_in():
    pipe = xpipe.Pipe(gpt2(), chunks=2, stages=2, executor="devices", sample_input={"input_ids": tokens(2, 8)})
    pipe.eval()
    with pytest.raises(RuntimeError, match="pipe: the model was captured by torch.export in train mode"):
        pipe(input_ids=tokens(4, 8))


def test_an_optimizer_built_before_capture_refuses_to_step():
    """torch.export holds weak references to the parameters it traced, so they move as new
    objects; an optimizer built on the old ones must not step them in silence."""
    model = llama(layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = xpipe.Pipe(model, chunks=2, stages=2, executor="devices", sample_input={"input_ids": tokens(2, 8)})
    pipe(input_ids=tokens(4, 8)).logits.sum().backward()
    with pytest.raises(RuntimeError, match=r"optimizer: this SGD holds parameters .*pipe.parameters\(\)"):
        optimizer.step()


@pytest.mark.full  # frozen statistics; BatchNorm in train mode is the quick tier's
def test_resnet18_in_eval_mode():
    """BatchNorm with frozen statistics through backward (fine-tuning)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    assert_pipe_matches(model, images, targets, F.cross_entropy, chunks=2, stages=4, executor="devices")


def test_resnet18_in_train_mode():
    """Each microbatch is normalised on its own, so the reference is the model fed the
    microbatches in turn. It runs on an XLA device too: BatchNorm over 4 images makes
    the convolutions' gradients sensitive enough that XLA's CPU kernels and torch's
    differ by up to 3e-3 (measured with one stage, no pipeline), while the pipeline
    and the unpipelined model on XLA agree within 1e-6."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    initial = copy.deepcopy(model.state_dict())
    device = torch_xla.device(7)  # not one of the pipeline's
    reference = copy.deepcopy(model).to(device)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    pipe = xpipe.Pipe(model, chunks=2, stages=4, executor="devices")
    loss = F.cross_entropy(pipe(images), targets.to(pipe.devices[-1]))
    loss.backward()
    expected = F.cross_entropy(torch.cat([reference(piece.to(device)) for piece in images.chunk(2)]),
                               targets.to(device))
    expected.backward()
    torch_xla.sync()
    # torch_xla.sync() runs the default device only: the reference's step on device 7
    # runs here, once, not once per gradient read below.
    xm.unlazy([expected, *(parameter.grad for parameter in reference.parameters())])
    torch.testing.assert_close(loss.cpu(), expected.cpu(), rtol=RTOL, atol=ATOL)
    gradients = pipe.named_gradients()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(gradients[name].cpu(), parameter.grad.cpu(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")
    on_cpu = torchvision.models.resnet18(num_classes=10)
    on_cpu.load_state_dict(initial)
    for piece in images.chunk(2):
        on_cpu(piece)  # PyTorch's running statistics (torch_xla's own use the biased variance)
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value.cpu(), on_cpu.state_dict()[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.full  # ViT at full width; a small one runs in the quick tier (spmd/test_real_models.py)
def test_vit_b_16_on_four_devices():
    """torchvision's ViT-B/16 as built by its factory (12 blocks of width 768) on 32 x 32
    images (4 patches), partitioned first as docs/models.md shows: the partition, kept
    alive, holds none of the weights the Pipe then moves."""
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(image_size=32, num_classes=10)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    split = xpipe.partition(model, 4, sample_input=images[:2], cost="flops")
    pipe = assert_pipe_matches(model, images, targets, F.cross_entropy, chunks=4, stages=4, executor="devices")
    assert split.graph.graph["annotated"], "the partition is still there, with its measured costs"
    holding_blocks = [any(name.startswith("encoder.layers.") for name in stage) for stage in pipe.partition.stages]
    assert all(holding_blocks), f"the encoder's blocks are layers of their own: {pipe.partition.stages}"


def test_a_one_row_sample_still_fits_every_microbatch_size_and_other_shapes_are_named():
    pipe = xpipe.Pipe(llama(layers=2), chunks=4, stages=2, executor="devices",
                      sample_input={"input_ids": tokens(1, 8)})
    assert pipe(input_ids=tokens(8, 8)).logits.shape == (8, 8, 128)  # microbatches of 2 rows
    with pytest.raises(ValueError, match=r"x: input 'input_ids' has shape \[8, 5\], and the model was captured by "
                                         r"torch.export on sample_input with shape \[':', 8\]"):
        pipe(input_ids=tokens(8, 5))  # another sequence length


def test_mobilenet_v3_with_an_in_place_activation_first_in_a_stage():
    """``Hardswish(inplace=True)`` opens the last stage: it writes into its input, which
    a stage receives as an autograd leaf. Train mode, 2 microbatches: the reference is the
    plain model stepped on each microbatch (BatchNorm normalises each by its own
    statistics in both), losses weighted by rows; loss, every gradient and the running
    statistics, rtol 1e-4."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=10, dropout=0.0)  # no masks to compare
    reference = copy.deepcopy(model)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    pipe = xpipe.Pipe(model, chunks=2, stages=4, executor="devices", loss_fn=torch.nn.CrossEntropyLoss())
    assert pipe.partition.stages[-1][0] == "classifier.1", pipe.partition.stages
    loss = pipe.step(images, targets)
    torch_xla.sync()
    expected = sum(F.cross_entropy(reference(x), t) / 2 for x, t in zip(images.chunk(2), targets.chunk(2)))
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    assert_gradients_match(pipe, reference)
    state = pipe.state_dict()
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(state[name].cpu(), buffer, rtol=RTOL, atol=ATOL, msg=name)
