"""Pipe on 8 devices equals the unpipelined model: outputs, loss, gradients, one SGD step.

Every mesh (data x stage) runs a transformer LM with tied embedding and head at
two of chunks in {1, stages, 4 x stages} (one padded case, one of several
microbatches per stage), the checkpoint modes in turn; an MLP-block stack runs
two of them. The fsdp meshes are tested with Hugging Face models in
``test_fsdp.py``.
"""

import pytest

import xpipe
from equivalence import assert_pipe_matches
from pipe_checks import assert_matches_reference, batch_for, loss_of, tiny_lm, tiny_mlp
from tiers import in_full_tier

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]  # (data, stages)
MODES = ["except_last", "always", "never"]
CASES = [(data, stages, chunks, MODES[i % 3])
         for i, (data, stages, chunks) in enumerate(
             (d, s, c) for d, s in MESHES for c in ((1, 4 * s) if s % 4 else (s, 4 * s)))]
MLP_CASES = [(2, 4, 16, "except_last"), (4, 2, 1, "always")]  # the LM runs every mesh
# The quick tier: a padded case (chunks=1), several microbatches per stage, and every checkpoint mode.
QUICK_CASES = [(2, 4, 16, "except_last"), (4, 2, 8, "never"), (1, 8, 32, "always")]
CASES = [case if case in QUICK_CASES else in_full_tier(*case) for case in CASES]


@pytest.mark.parametrize("data, stages, chunks, checkpoint", MLP_CASES)
def test_mlp_stack(data, stages, chunks, checkpoint):
    assert_matches_reference(tiny_mlp(), stages=stages, data=data, chunks=chunks, checkpoint=checkpoint)


@pytest.mark.parametrize("data, stages, chunks, checkpoint", CASES)
def test_transformer_lm_with_tied_head(data, stages, chunks, checkpoint):
    pipe = assert_matches_reference(tiny_lm(), stages=stages, data=data, chunks=chunks, checkpoint=checkpoint)
    weights = pipe.state_dict(keep_vars=True)
    assert weights["embed.tokens.weight"] is weights["head.weight"]


@pytest.mark.parametrize("chunks, checkpoint", [(1, "always"), (16, "never")])
def test_seven_blocks_on_four_stages(chunks, checkpoint):
    pipe = assert_matches_reference(tiny_lm(blocks=7), stages=4, data=2, chunks=chunks, checkpoint=checkpoint)
    assert pipe.runner.per_stage == (2, 2, 2, 1)
    assert pipe.partition.balance == (3, 2, 2, 3)  # embed + 2 blocks, ..., 1 block + norm + head


def test_blocks_no_rule_covers_split_over_tensor_as_read_from_their_graph():
    """xpipe's own LM names its linears ``qkv``, ``proj``, ``up`` and ``down``, which no
    built-in rule covers: on 2 stages x 2 fsdp x 2 tensor, with no ``tensor_rules``, its
    block's graph says how to split them (``qkv`` packs q, k and v one after the
    other: split part by part, the block, which torch.fx captures as a module, captured
    again as operations), and it trains equal to the plain model."""
    model = tiny_lm(4)
    batch, targets = batch_for(model, 8)
    pipe = assert_pipe_matches(model, batch, targets, loss_of, chunks=4, mesh=xpipe.make_mesh(2, fsdp=2, tensor=2),
                               sample_input=batch[:2])
    body = pipe.runner.body
    assert {name.split(".", 2)[-1]: dim for name, dim in zip(body.names, body.dims)} == {
        "norm1.weight": None, "norm1.bias": None, "qkv.weight": 0, "qkv.bias": 0, "proj.weight": 1,
        "proj.bias": None, "norm2.weight": None, "norm2.bias": None, "up.weight": 0, "up.bias": 0,
        "down.weight": 1, "down.bias": None}
