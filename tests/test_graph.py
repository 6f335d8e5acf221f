"""The module graph: layers, their costs, and the tensors between them."""

import pytest
import torch
from torch import nn

from hf_models import llama, tokens
from xpipe.capture.graph import layer_names, module_graph
from xpipe.models import transformer_lm

TOKENS = torch.zeros(2, 16, dtype=torch.long)


def test_transformer_layers_are_embedding_blocks_norm_head():
    graph = module_graph(transformer_lm(blocks=3))
    assert layer_names(graph) == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert graph.nodes["blocks.1"]["type"] == "Block"
    assert list(graph.predecessors("embed")) == ["ids"]
    assert list(graph.predecessors("output")) == ["head"]


def test_tied_weight_counts_in_each_layer_that_uses_it():
    model = transformer_lm(blocks=1, vocab=100, width=32, seq=16)
    graph = module_graph(model)
    assert graph.nodes["embed"]["params"] == 100 * 32 + 16 * 32
    assert graph.nodes["head"]["params"] == 100 * 32
    assert graph.nodes["head"]["param_bytes"] == 100 * 32 * 4


def test_sample_input_gives_shapes_flops_and_activations():
    model = transformer_lm(blocks=2, width=32, vocab=50)
    graph = module_graph(model, TOKENS)
    block = graph.nodes["blocks.0"]
    assert block["out_shape"] == (2, 16, 32) and block["out_dtype"] == "float32"
    assert block["out_bytes"] == 2 * 16 * 32 * 4
    # qkv, proj, up, down matmuls: 2 * tokens * (3w*w + w*w + 4w*w + 4w*w) plus attention.
    assert block["flops"] >= 2 * 32 * (12 * 32 * 32)
    assert block["activation_bytes"] > block["out_bytes"]
    widths = dict(block["activation_bytes_by_width"])  # the saved bytes by their last dim
    assert widths[32] >= block["out_bytes"] and widths[4 * 32] > 0  # the stream's width, the MLP's
    assert sum(widths.values()) <= block["activation_bytes"]  # and attention's probabilities
    edge = graph.edges["blocks.0", "blocks.1"]
    assert edge["tensors"] == [{"name": "blocks_0", "shape": (2, 16, 32), "dtype": "float32", "bytes": 4096}]
    assert edge["bytes"] == 4096


def test_what_a_layer_keeps_counts_each_tensor_autograd_saves_for_it_once():
    """``kept_bytes``: each tensor a layer saves that carries a gradient, once, and the
    attention probabilities XLA's attention keeps (what 1F1B's ring holds with
    ``checkpoint="never"``); ``activation_bytes`` counts a Llama block's some twice (the
    norm's output, once for each projection that reads it)."""
    model, sample = llama(2), {"input_ids": tokens(2, 16)}
    block = module_graph(model, sample).nodes["model.layers.0"]
    saved: dict[int, int] = {}  # the block's, by storage
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    in_block = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if in_block and tensor.requires_grad and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.model.layers[0].register_forward_pre_hook(lambda *_: in_block.append(True))
    model.model.layers[0].register_forward_hook(lambda *_: in_block.clear())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**sample)
    # Within 10%: the capture runs the layer op by op where eager PyTorch runs attention's fused
    # kernel, and the two save a little differently (82,176 and 78,080 bytes when written).
    assert block["kept_bytes"] == pytest.approx(sum(saved.values()) + block["attention_bytes"], rel=0.1)
    assert block["kept_bytes"] < block["activation_bytes"]


def test_identical_blocks_share_a_signature_and_others_do_not():
    graph = module_graph(transformer_lm(blocks=2))
    assert graph.nodes["blocks.0"]["signature"] == graph.nodes["blocks.1"]["signature"]
    assert graph.nodes["blocks.0"]["signature"] != graph.nodes["norm"]["signature"]


def test_measured_time_is_recorded_per_layer():
    graph = module_graph(transformer_lm(blocks=2), TOKENS, measure_time=True)
    assert all(graph.nodes[name]["time_s"] > 0 for name in layer_names(graph))


def test_profiling_leaves_buffers_and_rng_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = model[1].running_mean.clone()
    batch = torch.randn(8, 4) + 5
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    module_graph(model, batch)
    torch.testing.assert_close(torch.rand(3), expected)
    torch.testing.assert_close(model[1].running_mean, before)
    assert model[1].num_batches_tracked.item() == 0


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x):
        x = self.first(x)
        if x.sum() > 0:
            return self.second(x)
        return x


def test_untraceable_model_names_module_and_fix():
    with pytest.raises(ValueError, match=r"module: torch.fx cannot trace 'DataDependent'.*balance="):
        module_graph(DataDependent())


class NoSubmodules(nn.Module):
    def forward(self, x):
        return x * 2


def test_model_without_submodules_is_rejected():
    with pytest.raises(ValueError, match="module: its forward calls no submodule"):
        module_graph(NoSubmodules())


def test_timing_needs_a_sample_input():
    with pytest.raises(ValueError, match="measure_time: timing layers needs sample_input"):
        module_graph(transformer_lm(blocks=1), measure_time=True)
