"""``xpipe.tensor.inference``: the split read from a block's graph is the built-in
rules' split on every family that has them, reads projections packed one after the
other as packed (split part by part), and refuses what it cannot read, naming it."""

import pytest
import torch
import torch.nn.functional as F
from hf_models import bert, gpt2, gpt_neox, llama, mixtral, opt, phi3, t5, tokens
from torch import nn

from xpipe.build import ModelCapture
from xpipe.capture.stacking import block_inputs
from xpipe.models import Block, MLPBlock
from xpipe.tensor.inference import CannotInfer, infer_tensor_dims
from xpipe.tensor.rules import Packed, tensor_dims, tensor_splits, unruled


class EncoderStack(nn.Module):
    """Two of torch's ``nn.TransformerEncoderLayer`` (q, k and v packed in ``in_proj_weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def first_block(model: nn.Module, sample) -> tuple[nn.Module, tuple]:
    stacked = ModelCapture(model, sample).stacked()
    return stacked.blocks[0], block_inputs(stacked, sample)


def lm_sample() -> dict:
    ids = tokens(2, 8)
    return {"input_ids": ids, "labels": ids}


FAMILIES = {"llama": lambda: (llama(2), lm_sample()), "gpt2": lambda: (gpt2(2), lm_sample()),
            "bert": lambda: (bert(2), lm_sample()), "t5": lambda: (t5(3), lm_sample()),
            "encoder": lambda: (EncoderStack(), torch.randn(2, 8, 32)),
            "opt": lambda: (opt(2), lm_sample()), "gpt_neox": lambda: (gpt_neox(2), lm_sample()),
            "phi3": lambda: (phi3(2), lm_sample())}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_split_read_from_the_graph_is_the_built_in_rules_split(family):
    """Column-parallel on outputs, row-parallel on inputs, norms whole, and the
    projections packed one after the other (GPT-2's ``c_attn``, the encoder's
    ``in_proj_weight``, its heads folded into the batch for attention, Phi-3's
    ``qkv_proj`` and ``gate_up_proj``) packed; GPT-NeoX's, packed per head, split
    as one linear."""
    block, inputs = first_block(*FAMILIES[family]())
    names, shapes = zip(*[(name, p.shape) for name, p in block.named_parameters()])
    built_in = dict(zip(names, tensor_splits(names, shapes, 2)))
    assert any(dim is not None for dim in built_in.values())
    assert infer_tensor_dims(block, inputs) == built_in


def test_xpipes_own_blocks_which_no_rule_names_are_read_as_megatron_splits_them():
    """``xpipe.models.Block``: q, k and v packed (``qkv``, split apart before the heads)
    packed; ``proj`` and ``down`` on their inputs, ``up`` on its outputs (its bias too)."""
    assert infer_tensor_dims(Block(32, 4), [torch.randn(2, 8, 32)]) == {
        "norm1.weight": None, "norm1.bias": None, "qkv.weight": Packed(0), "qkv.bias": Packed(0),
        "proj.weight": 1, "proj.bias": None, "norm2.weight": None, "norm2.bias": None,
        "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None}
    assert infer_tensor_dims(MLPBlock(16), [torch.randn(4, 16)]) == {
        "norm.weight": None, "norm.bias": None, "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None}


class TransposedWeights(nn.Module):
    """An MLP written ``x @ w.T`` (as Falcon's linears are), with a bias added apart."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in, self.w_out = nn.Parameter(torch.randn(32, 16)), nn.Parameter(torch.randn(16, 32))
        self.b_in = nn.Parameter(torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(x @ self.w_in.T + self.b_in) @ self.w_out.T


class Router(nn.Module):
    """Features softmaxed across the linear's outputs (a router's): they cannot be split."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(16, 4), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x).softmax(-1)
        return x + self.down(self.up(x)) * weights.amax(-1, keepdim=True)


def test_a_transposed_weight_is_read_as_a_linear_and_features_reduced_across_stay_whole():
    assert infer_tensor_dims(TransposedWeights(), [torch.randn(2, 16)]) == {"w_in": 0, "w_out": 1, "b_in": 0}
    assert infer_tensor_dims(Router(), [torch.randn(2, 16)]) == {
        "gate.weight": None, "gate.bias": None, "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None}


class Normalized(nn.Module):
    """A linear whose output is read whole: ``F.normalize`` divides by the norm over its
    features (``expand_as`` reads the split features for their shape only)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.proj = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(x)))
        return x + F.normalize(self.proj(x), dim=-1)


def test_a_linear_whose_output_is_normalized_over_its_features_stays_whole():
    """Refused before, naming tensor_rules, where the docs say such a linear stays whole."""
    assert infer_tensor_dims(Normalized(), [torch.randn(2, 4, 16)]) == {
        "up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None, "proj.weight": None, "proj.bias": None}


class Rolled(nn.Module):
    """Features moved by an operation the inference does not know (a roll along them)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.roll(self.up(x), 1, -1))


class Branching(Rolled):
    """A block whose path depends on its input's values: no graph without them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if x.sum() > 0 else x


def test_what_the_inference_cannot_read_is_refused_naming_it():
    with pytest.raises(CannotInfer, match=r"roll .*reads the split output features of up.weight, and the inference "
                                          r"does not know how it moves them"):
        infer_tensor_dims(Rolled(), [torch.randn(2, 16)])
    with pytest.raises(CannotInfer, match=r"the block cannot be traced to aten operations"):
        infer_tensor_dims(Branching(), [torch.randn(2, 16)])
    block, inputs = first_block(mixtral(2), lm_sample())
    with pytest.raises(CannotInfer, match=r"the weight model.layers.0.mlp.experts.gate_up_proj is used by "
                                          r"aten.einsum.default, not by a linear"):
        infer_tensor_dims(block, inputs)


def test_a_linear_named_as_gpt2_names_its_conv1d_is_split_as_its_graph_shows():
    """GPTBigCode's ``c_fc`` and ``c_proj`` are ``nn.Linear`` (``[out, in]``), named as
    GPT-2's ``Conv1D`` (``[in, out]``): the built-in rules would split each on the wrong
    dim; the graph's dims win where both split. A user's rule still wins over the graph."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    torch.manual_seed(0)
    model = GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=128, n_embd=32, n_layer=2, n_head=4, use_cache=False))
    block, inputs = first_block(model, lm_sample())
    read = infer_tensor_dims(block, inputs)
    names, shapes = zip(*[(name, p.shape) for name, p in block.named_parameters()])
    assert not unruled(names)
    assert {n.split(".", 3)[-1]: d for n, d in read.items() if n.endswith("weight")} == {
        "ln_1.weight": None, "attn.c_attn.weight": None, "attn.c_proj.weight": 1, "ln_2.weight": None,
        "mlp.c_fc.weight": 0, "mlp.c_proj.weight": 1}
    assert [dim for name, dim in zip(names, tensor_dims(names, shapes, 2)) if "c_fc.weight" in name] == [1]
    assert dict(zip(names, tensor_dims(names, shapes, 2, inferred=read))) == read
    users = {"*.mlp.c_fc.weight": None}
    assert [dim for name, dim in zip(names, tensor_dims(names, shapes, 2, users, read)) if "c_fc.weight" in name] == [None]
