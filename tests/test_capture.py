"""Capturing models as they come: layers are the user's own submodules, however deep.

Hugging Face models (which torch.fx cannot trace) are captured with torch.export
on a sample batch; torchvision's ViT and torch's nn.TransformerEncoder nest their
blocks a level or two down. Each is built from its library's own classes and
configs, with random weights (nothing is downloaded).
"""

import pytest
import torch
import torchvision
from torch import nn

import xpipe
from xpipe.capture.trace import opened_modules, trace_layers
from xpipe.schedule import gpipe
from xpipe.viz import render, render_text
from hf_models import gpt2, llama, t5, tokens


def test_a_hugging_face_llama_is_captured_with_its_own_layer_names():
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # a padded row
    split = xpipe.partition(llama(), 2, sample_input={"input_ids": tokens(), "attention_mask": mask}, cost="flops")
    names = [name for stage in split.stages for name in stage]
    assert names == ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(4)),
                     "model.norm", "lm_head"]
    assert split.repeated.count == 4 and split.repeated.period == 1
    model = llama()
    counted = {name: split.graph.nodes[name]["params"] for name in names}
    assert counted["model.layers.2"] == sum(p.numel() for p in model.model.layers[2].parameters())
    assert counted["lm_head"] == model.lm_head.weight.numel(), "the tied head counts its weight"
    crossing = {c.name for c in split.boundaries[0]}
    assert len(crossing) >= 3, f"hidden state, the mask and the rotary cos/sin cross the cut: {crossing}"


def test_gpt2_with_labels_keeps_its_loss_in_the_last_layer():
    split = xpipe.partition(gpt2(), 4, sample_input={"input_ids": tokens(), "labels": tokens()})
    assert split.stages[0][0] == "transformer.wte" and split.stages[-1][-1] == "lm_head"
    blocks = [name for stage in split.stages for name in stage if ".h." in name]
    assert blocks == [f"transformer.h.{i}" for i in range(4)]
    assert split.repeated.per_stage == (1, 1, 1, 1)


def test_without_a_sample_an_untraceable_model_says_how_to_capture_it():
    with pytest.raises(ValueError, match=r"module: torch.fx cannot trace 'LlamaForCausalLM'.*pass sample_input="):
        xpipe.partition(llama(), 2)


def test_torchvisions_vit_exposes_its_encoder_blocks_without_a_sample():
    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=4, num_heads=2,
                                               hidden_dim=32, mlp_dim=64)
    assert opened_modules(vit) == {"", "encoder", "encoder.layers"}
    split = xpipe.partition(vit, 2)
    blocks = [name for stage in split.stages for name in stage if name.startswith("encoder.layers.")]
    assert blocks == [f"encoder.layers.encoder_layer_{i}" for i in range(4)]
    assert split.repeated.count == 4


def test_an_encoder_decoder_opens_both_runs_of_blocks():
    assert opened_modules(t5()) == {"", "encoder", "encoder.block", "decoder", "decoder.block"}


def test_a_container_inside_the_blocks_stays_inside_them():
    """Experts of a mixture-of-experts block are alike too; the blocks stay the layers."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            return sum(expert(x) for expert in self.experts)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Module()
            self.body.layers = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for block in self.body.layers:
                x = block(x)
            return self.head(x)

    assert opened_modules(Model()) == {"", "body", "body.layers"}
    assert xpipe.partition(Model(), 2).stages == (("body.layers.0", "body.layers.1"), ("body.layers.2", "head"))


def test_a_transformer_encoder_is_opened_by_export_and_kept_whole_by_fx():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoder(layer, 4), nn.Linear(16, 8))
    _, whole = trace_layers(model)  # fx cannot trace TransformerEncoder.forward: it stays one layer
    assert sorted(set(whole.values())) == ["0", "1", "2"]
    split = xpipe.partition(model, 2, sample_input=torch.randn(2, 5, 8))
    assert [name for stage in split.stages for name in stage] == ["0", *(f"1.layers.{i}" for i in range(4)), "2"]


def test_the_visualiser_draws_a_llama_with_its_layer_names(tmp_path):
    split = xpipe.partition(llama(), 2, sample_input={"input_ids": tokens()})
    assert "model.embed_tokens .. model.layers.1" in render_text(split, gpipe(2, 4))
    render(split, gpipe(2, 4), tmp_path / "llama.svg")
    svg = (tmp_path / "llama.svg").read_text()
    assert all(name in svg for name in ("model.rotary_emb", "model.layers.3", "lm_head"))


def test_an_encoder_decoder_without_its_decoder_input_is_told_what_to_add():
    with pytest.raises(ValueError, match=r"an encoder-decoder model also needs its decoder's input: put labels= or "
                                         r"decoder_input_ids= in sample_input"):
        trace_layers(t5(), {"input_ids": tokens(2, 8)})


class ScaledBlock(nn.Module):
    """A linear layer times a buffer: persistent (part of the model's state) or not."""

    def __init__(self, scale: float, persistent: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.tensor([scale]), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


@pytest.mark.parametrize("scales, persistent, refusal", [
    ((2.0, 2.0, 2.0, 2.0), True, r"module: block 0 has buffers in the model's state \(\['1.scale'\], saved by "
                                 r"state_dict\); .* use executor='devices'"),
    ((2.0, 2.0, 3.0, 2.0), False, r"module: block 2's constant tensors \['3.scale'\] differ from block 0's; the "
                                  r"stacked body runs every block with block 0's constants"),
])
def test_blocks_stack_with_buffers_only_where_block_0s_stand_for_every_blocks(scales, persistent, refusal):
    """Falcon's blocks hold constants of their own (equal in every block) and now stack;
    a buffer in the model's state, or one that differs between blocks, is refused by name."""
    from xpipe.build import ModelCapture

    def model(scales):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), *(ScaledBlock(s, persistent) for s in scales), nn.Linear(8, 2))

    with pytest.raises(ValueError, match=refusal):
        ModelCapture(model(scales), None).stacked()
    if not persistent:
        stacked = ModelCapture(model((2.0,) * 4), None).stacked()
        assert [float(b) for block in stacked.blocks for b in block.buffers()] == [2.0] * 4


class AlternatingBlock(nn.Module):
    """A linear layer plus one of two tensors the model computes before its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + bias


class TwoMasks(nn.Module):
    """Two tensors from the input, as Gemma 2 builds its two masks before its layers."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.tanh(), x.sigmoid()


class Alternating(nn.Module):
    """Blocks that alternate between two inputs, as Gemma 2's alternate between a
    sliding-window and a global mask."""

    def __init__(self) -> None:
        super().__init__()
        self.masks = TwoMasks()
        self.blocks = nn.ModuleList(AlternatingBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        near, far = self.masks(x)
        for index, block in enumerate(self.blocks):
            x = block(x, near if index % 2 == 0 else far)
        return x


class ScaleAndOffset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * scale + offset


class BuiltFromTheBatchSize(nn.Module):
    """Blocks that read two tensors built from the batch's size alone: ``scale``'s rows
    are equal (as Hugging Face's causal mask, expanded to the batch), ``offset``'s
    rows are each row's index."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScaleAndOffset() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.size(0)
        scale = torch.linspace(-1, 1, 8).expand(rows, 8)
        offset = self.row_values(torch.arange(rows, dtype=x.dtype)).unsqueeze(1).expand(rows, 8)
        for block in self.blocks:
            x = block(x, scale, offset)
        return x

    def row_values(self, index: torch.Tensor) -> torch.Tensor:
        return index


class EqualInGroupsOfFour(BuiltFromTheBatchSize):
    """``offset``'s rows are equal in groups of four: equal on a sample of two rows,
    and of four, not on eight."""

    def row_values(self, index: torch.Tensor) -> torch.Tensor:
        return index.div(4, rounding_mode="floor")


def through_stacked(stacked, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``x`` through a cut model's pre, blocks and post, on the host; and the side
    inputs the blocks read (a side held once is one row, which each block broadcasts)."""
    hidden, *rest = stacked.pre(x)
    sides, skips = rest[:len(stacked.side_rows)], rest[len(stacked.side_rows):]
    for block in stacked.blocks:
        hidden = block(hidden, *sides)
    (output,) = stacked.post(hidden, *skips)  # torch.export's flat outputs
    return output, sides


@pytest.mark.parametrize("model", [BuiltFromTheBatchSize(), EqualInGroupsOfFour()], ids=type)
def test_a_side_input_is_held_as_one_row_only_where_the_graph_proves_its_rows_equal(model):
    """``scale`` (linspace expanded to the batch) is held once and broadcast in each
    block. ``offset`` travels with its rows: each row's index in one model, the index
    in groups of four in the other, whose rows are equal on a sample of two or four
    rows and were broadcast from the first (a loss off by nearly 3x at 8 rows)."""
    from xpipe.build import ModelCapture

    stacked = ModelCapture(model, torch.randn(2, 8)).stacked()
    assert stacked.side_rows == (False, True)
    x = torch.randn(8, 8)
    output, (scale, offset) = through_stacked(stacked, x)
    assert scale.shape == (1, 8) and offset.shape == (8, 8)
    torch.testing.assert_close(output, model(x), rtol=1e-5, atol=1e-6)


def test_blocks_that_alternate_between_inputs_stack_as_units_of_one_of_each():
    """Gemma 2's layers alternate between a sliding-window and a global mask: alike in
    structure, they were once stacked one layer a block and refused, as every stacked
    block runs with the same inputs. Blocks of two layers, one of each, all read both."""
    from xpipe.build import ModelCapture
    from xpipe.partition import RepeatedBlocks

    model = Alternating()
    capture = ModelCapture(model, torch.randn(2, 8))
    assert capture.whole().repeated == RepeatedBlocks(start=1, period=2, count=2, per_stage=(2,))
    stacked = capture.stacked()
    assert len(stacked.blocks) == 2 and stacked.side_rows == (True, True)
    x = torch.randn(3, 8)
    near, far = x.tanh(), x.sigmoid()
    hidden = x
    for block in stacked.blocks:
        hidden = block(hidden, near, far)
    torch.testing.assert_close(hidden, model(x), rtol=1e-5, atol=1e-6)


def test_a_sequence_first_stream_is_refused_before_any_device_work():
    """nn.TransformerEncoderLayer in its default layout passes [seq, batch, width]
    between blocks: cut on dim 0, its attention would see a microbatch's positions
    only (a silently wrong result); the cut refuses, naming the fix."""
    from xpipe.build import ModelCapture

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1)  # batch_first=False
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    with pytest.raises(ValueError, match="mix the rows of dim 0.*batch_first=True"):
        ModelCapture(model, torch.randn(8, 4, 16)).stacked()
    batch_first = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True), 4,
                                        enable_nested_tensor=False)
    assert len(ModelCapture(batch_first, torch.randn(4, 8, 16)).stacked().blocks) == 4


def test_a_side_input_with_rows_folded_into_another_dim_is_refused_by_name():
    """BLOOM builds its ALiBi bias as [rows * heads, 1, seq]: dim 0 grows with the
    batch but is not its rows. Carried by rows it was cut across its heads (a crash
    inside torch, or, where shapes still broadcast, a silent truncation)."""
    from transformers import BloomConfig, BloomForCausalLM

    from xpipe.build import ModelCapture

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=4, n_head=4, use_cache=False))
    with pytest.raises(ValueError, match=r"dim 0 \(8 on a sample of 2 rows\) grows with the batch but is not its "
                                         r"rows.*executor='devices'"):
        ModelCapture(model, torch.randint(0, 128, (2, 8))).stacked()


class MaskedBlock(nn.Module):
    """A block with a boolean constant (a buffer outside the model's state)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("keep", torch.tensor([True, False] * 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.keep, self.linear(x), x)


def test_a_boolean_constant_in_the_blocks_stacks():
    """It failed inside the check of integer constants ("abs_cpu not implemented for 'Bool'")."""
    from xpipe.build import ModelCapture

    model = nn.Sequential(*[MaskedBlock() for _ in range(4)])
    stacked = ModelCapture(model, torch.randn(2, 8)).stacked()
    x = torch.randn(3, 8)
    hidden = stacked.pre(x)  # no side input: the stream alone
    for block in stacked.blocks:
        hidden = block(hidden)
    torch.testing.assert_close(stacked.post(hidden), model(x), rtol=1e-5, atol=1e-6)
