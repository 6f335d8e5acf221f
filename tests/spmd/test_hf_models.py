"""Hugging Face models as the library ships them, under the spmd executor.

Captured with torch.export on a sample batch; their decoder layers are stacked
over the "stage" axis. The attention mask (one row per batch row) travels with
its microbatch inside the stream; the rotary tables (the same for every row) are
held whole by every stage. One training step against the model unpipelined on
the CPU: output or loss, and every gradient, rtol 1e-4 in float32. Last,
``examples/hf_llama.py`` as written.
"""

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics
from equivalence import train_steps
from hf_models import (assert_llama_step_matches, assert_loss_step_matches, bert, falcon, gemma2, gpt2, llama,
                       mixtral, opt, padding_mask, qwen2_moe, t5, tokens)

import xpipe

MESHES = [(4, 2, 4)]  # stages, data, decoder layers (8 stages of one block: test_pipe_equivalence's LM)


@pytest.mark.parametrize("stages, data, layers", MESHES)
@pytest.mark.parametrize("padded", [True, False], ids=["padding-mask", "causal-only"])
def test_llama_with_and_without_a_padding_mask(stages, data, layers, padded):
    """With a padding mask the attention mask differs by row and travels with its rows;
    without one its rows are equal, and every stage holds one row (cos and sin: always)."""
    model = llama(layers)
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8) if padded else None
    sample = {"input_ids": ids[:2]} | ({"attention_mask": mask[:2]} if padded else {})
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(stages, data), sample_input=sample)
    assert pipe.executor == "spmd" and pipe.runner.block_count == layers
    assert pipe.runner.side_rows == (False, False, padded)
    assert_llama_step_matches(pipe, reference, ids, mask)
    state = pipe.state_dict(keep_vars=True)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"], "the tie stays a tie"


@pytest.mark.parametrize("stages, data, layers", MESHES)
def test_gpt2_with_labels_returns_the_models_own_loss(stages, data, layers):
    model = gpt2(layers, dropout=0.0)
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(stages, data),
                      sample_input={"input_ids": ids[:2], "labels": ids[:2]})
    assert pipe.executor == "spmd" and pipe.runner.block_count == layers
    assert_loss_step_matches(pipe, reference, input_ids=ids, labels=ids)


def test_mixtral_stacks_its_mixture_of_experts_blocks():
    """Every block reads the token count (16 x the batch size), which each stacked block
    computes from its own microbatch; routing, experts and router as the plain model."""
    model = mixtral()
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, 4), sample_input={"input_ids": ids[:2],
                                                                              "labels": ids[:2]})
    assert pipe.executor == "spmd" and pipe.runner.block_count == 4
    assert_loss_step_matches(pipe, reference, input_ids=ids, labels=ids)


@pytest.mark.full  # the quick tier runs Llama, GPT-2's loss and Mixtral under spmd, every family on devices
@pytest.mark.parametrize("family, blocks, period", [(falcon, 4, 1), (gemma2, 2, 2)], ids=["falcon", "gemma2"])
def test_families_once_refused_train_on_2_x_4_fsdp(family, blocks, period):
    """Both were refused by the spmd executor. Each Falcon block holds two constants
    torch.export lifted from its attention's index lists, equal in every block: every
    block now runs with block 0's (carried through the clock loop, as scan takes no
    captured tensor). Gemma 2's layers alternate a sliding-window mask (4 tokens of 8)
    and a global one, each built before the body: the body is now stacked two layers a
    block (one of each), and every block reads both masks, which travel with their
    microbatch."""
    model = family()
    reference = copy.deepcopy(model)
    ids = tokens(16)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, fsdp=4), sample_input={"input_ids": ids[:2],
                                                                                     "labels": ids[:2]})
    assert pipe.executor == "spmd" and pipe.runner.block_count == blocks
    assert (pipe.partition.repeated.period, pipe.partition.repeated.count) == (period, blocks)
    assert_loss_step_matches(pipe, reference, input_ids=ids, labels=ids)


ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight")  # [experts, width] and [1, width]: whole


@pytest.mark.full  # the quick tier splits Llama and GPT-2 over "tensor"; these are the built-in rules of other families
# GPT-NeoX and Phi-3 run on the same mesh, with no rules of the user's, equal to the plain model (loss and
# every gradient), in spmd/test_audit.py's per-clock test, which also reads their packed weights split.
@pytest.mark.parametrize("family, whole", [(opt, ()), (mixtral, ROUTERS), (qwen2_moe, ROUTERS),
                                           (lambda: falcon(multi_query=False), ()),
                                           (falcon, ("query_key_value.weight",))],
                         ids=["opt", "mixtral", "qwen2_moe", "falcon", "falcon_multi_query"])
def test_families_train_split_over_tensor_with_no_rules_of_the_users(family, whole):
    """On 2 stages x 2 fsdp x 2 tensor, with no ``tensor_rules``: every matrix of the
    blocks but ``whole`` (the routers) is split over "tensor" (OPT's fc1/fc2, GPT-NeoX's
    ``query_key_value``, packed per head, and its MLP; Phi-3's ``qkv_proj`` and
    ``gate_up_proj``, packed one part after the other, part by part; the experts whole
    per device, by their first dim), and one step equals the plain model. No built-in rule names Falcon's weights: their split is read from
    its block's graph (its ``query_key_value``, packed head by head, split as
    GPT-NeoX's; with multi-query attention, as Falcon is configured by default, q and
    its one key/value head packed one after the other, kept whole)."""
    model = family()
    reference = copy.deepcopy(model)
    ids = tokens(8, 8)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, fsdp=2, tensor=2),
                      sample_input={"input_ids": ids[:2], "labels": ids[:2]})
    body = pipe.runner.body
    assert pipe.executor == "spmd" and body.names
    kept = [name for name, shape, dim in zip(body.names, body.shapes, body.dims) if len(shape) > 1 and dim is None]
    assert all(name.endswith(whole) for name in kept), kept
    assert_loss_step_matches(pipe, reference, input_ids=ids, labels=ids)


@pytest.mark.full  # the quick tier runs Llama, GPT-2's loss and Mixtral under spmd, every family on devices
def test_bert_with_a_padding_mask_and_labels_split_over_fsdp_and_tensor():
    """An encoder: every block reads the extended attention mask, which travels
    with its microbatch; the MLM head is tied to the word embeddings. On 2 stages x
    2 fsdp x 2 tensor: BERT's built-in tensor rules (query/key/value and intermediate
    split on their outputs, the output denses on their inputs)."""
    model = bert()
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, fsdp=2, tensor=2),
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert pipe.executor == "spmd" and pipe.runner.block_count == 4
    assert_loss_step_matches(pipe, reference, **inputs)


@pytest.mark.full  # the quick tier runs Llama, GPT-2's loss and Mixtral under spmd, every family on devices
def test_t5_stacks_its_longest_run_of_alike_blocks_split_over_tensor():
    """Each of T5's stacks starts with a block that holds the relative position bias;
    the other three of a 4-layer stack are alike and are stacked over 2 stages, each
    split over 4 tensor devices by T5's built-in rules (q/k/v and wi on their outputs,
    o and wo on their inputs)."""
    model = t5(4)
    reference = copy.deepcopy(model)
    ids, mask = tokens(8, 8), padding_mask(8)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.roll(1, 1)}
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(2, fsdp=1, tensor=4),
                      sample_input={name: value[:2] for name, value in inputs.items()})
    assert pipe.executor == "spmd" and pipe.runner.block_count == 3
    assert_loss_step_matches(pipe, reference, **inputs)


@pytest.mark.full  # dropout in the stacked body is the quick tier's in spmd/test_pipe_contract.py
def test_gpt2_trains_with_its_dropout():
    """Dropout inside the exported blocks draws the loop's hashed masks (see
    xpipe.spmd.dropout): the loss differs from the plain model's by the masks, not
    by more, and it falls."""
    model = gpt2(4)  # GPT-2's default dropout, 0.1 everywhere
    ids = tokens(8, 8)
    pipe = xpipe.Pipe(model, chunks=4, mesh=xpipe.make_mesh(4, 2),
                      sample_input={"input_ids": ids[:2], "labels": ids[:2]})
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, compiles = train_steps(lambda: pipe(input_ids=ids, labels=ids).loss, optimizer)
    # AdamW's first step also creates its state (another graph); after that, nothing new.
    assert compiles[2:] == [compiles[1]] * 3, f"compiles after each step: {compiles}"
    with torch.no_grad():
        plain = gpt2(4).eval()(input_ids=ids, labels=ids).loss.item()
    assert abs(losses[0] - plain) < 0.05 * plain, (losses[0], plain)
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.full  # bf16 near float32 is the quick tier's in spmd/test_pipe_contract.py
def test_llama_in_bfloat16_with_float32_master_weights_tracks_float32_training():
    """Mixed precision as a user sets it up: the pipelined model in bf16 (weights and
    activations through the clock loop), AdamW on float32 copies of its weights
    (gradients cast up, updated weights cast down). 5 steps: each loss within 1% of
    the float32 model's trained the same way (measured: at most 0.2%). AdamW's first
    step builds its state inside the step's graph; after that, nothing compiles."""
    ids, mask = tokens(8, 8), padding_mask(8)
    targets = tokens(8, 8).roll(1, 1)
    reference = llama()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for _ in range(5):
        logits = reference(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())

    pipe = xpipe.Pipe(llama().to(torch.bfloat16), chunks=4, mesh=xpipe.make_mesh(4, 2),
                      sample_input={"input_ids": ids[:2], "attention_mask": mask[:2]})
    weights = list(pipe.parameters())
    master = [weight.detach().float() for weight in weights]
    optimizer = torch.optim.AdamW(master, lr=1e-2)
    device_targets = targets.to(pipe.devices[0])
    losses, compiles = [], []
    for _ in range(5):
        logits = pipe(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), device_targets.flatten())
        loss.backward()
        for copy_, weight in zip(master, weights):
            copy_.grad, weight.grad = weight.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for copy_, weight in zip(master, weights):
                weight.copy_(copy_)
        torch_xla.sync()
        losses.append(loss.item())
        compiles.append(torch_xla.debug.metrics.metric_data("CompileTime")[0])
    assert all(weight.dtype == torch.bfloat16 for weight in weights)
    assert all(copy_.dtype == torch.float32 for copy_ in master)
    torch.testing.assert_close(losses, expected, rtol=1e-2, atol=0)
    assert compiles[2:] == [compiles[1]] * 3, f"compiles after each step: {compiles}"


@pytest.mark.full  # bf16 compiling once is the quick tier's in spmd/test_pipe_contract.py
def test_llama_in_bfloat16_compiles_once_in_five_steps():
    """Pure bf16 (weights, activations, gradients, SGD on the bf16 weights): the step
    compiles once. Llama's rotary ``inv_freq`` buffer is an input of every step; had it
    entered unannotated, it would leave the first step annotated "replicated" and the
    second step would compile anew."""
    ids, mask = tokens(8, 8), padding_mask(8)
    pipe = xpipe.Pipe(llama().to(torch.bfloat16), chunks=4, mesh=xpipe.make_mesh(4, 2),
                      sample_input={"input_ids": ids[:2], "attention_mask": mask[:2]})
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    targets = tokens(8, 8).roll(1, 1).to(pipe.devices[0])
    torch_xla.sync()
    before = torch_xla.debug.metrics.metric_data("CompileTime")[0]

    def loss_of_step():
        logits = pipe(input_ids=ids, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    losses, compiles = train_steps(loss_of_step, optimizer)
    assert compiles == [before + 1] * 5, f"compiles after each step: {compiles}, before the first: {before}"
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in pipe.parameters())
    assert losses[-1] < losses[0], losses


def test_a_mask_in_another_dtype_than_the_stream_is_refused_with_what_to_do():
    """A per-row float32 side input cannot travel exactly inside a bf16 stream."""
    from xpipe.spmd.sides import packing_for

    with pytest.raises(ValueError, match=r"per-row torch.float32 tensor .* compute it in torch.bfloat16"):
        packing_for(torch.zeros(2, 8, 32, dtype=torch.bfloat16), [torch.zeros(2, 1, 8, 8)])
    assert packing_for(torch.zeros(2, 8, 32, dtype=torch.bfloat16), [torch.zeros(2, 1, 8, 8, dtype=torch.bool)])


def test_token_ids_of_another_shape_are_refused_naming_the_input():
    pipe = xpipe.Pipe(gpt2(2), chunks=2, mesh=xpipe.make_mesh(2, 4), sample_input={"input_ids": tokens(2, 8)})
    for ids, shape in [(tokens(1, 8)[0], r"\[8\]"), (torch.randint(0, 128, (4, 40)), r"\[4, 40\]")]:
        with pytest.raises(ValueError, match=rf"x: input 'input_ids' has shape {shape}, and the model was captured "
                                             r"by torch.export on sample_input with shape \[':', 8\]"):
            pipe(input_ids=ids)


LLAMA_EXAMPLE = Path(__file__).parents[2] / "examples" / "hf_llama.py"


@pytest.mark.full
def test_the_llama_example_learns_on_a_2x4_mesh():
    """``examples/hf_llama.py`` runs as written: a Hugging Face Llama on a 2 x 4 mesh,
    its padding mask travelling with the microbatches; the copy task's loss falls
    (measured when written: 3.49 at the first step, 1.22 at step 60, 0.51 at step 80)."""
    spec = importlib.util.spec_from_file_location("hf_llama", LLAMA_EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=60)
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[0] > math.log(example.VOCAB) - 0.5, losses  # random init: about ln(32) = 3.47
    assert min(losses[-5:]) < losses[0] - 1.5, losses  # 3.49 -> 1.22 at step 60 when written
