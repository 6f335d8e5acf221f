"""Real models as their libraries ship them, under the spmd executor, against themselves unpipelined.

torchvision's ViT: its encoder blocks (found inside ``encoder.layers``) are
stacked over the stage axis, as are those of torch's own ``nn.TransformerEncoder``; the patch embedding and the head run
data-parallel. One training step: output, loss, every gradient and the weights
after SGD within rtol 1e-4 (``equivalence``).
"""

import pytest
import torch
import torch.nn.functional as F
import torchvision
from equivalence import assert_pipe_matches
from tiers import in_full_tier

import xpipe


@pytest.mark.parametrize("stages, data", [(4, 2), in_full_tier(2, 4)])
def test_vit_stacks_its_encoder_blocks(stages, data):
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=4, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    pipe = assert_pipe_matches(model, images, targets, F.cross_entropy, chunks=4, mesh=xpipe.make_mesh(stages, data))
    assert pipe.executor == "spmd" and pipe.runner.block_count == 4


def test_torchs_transformer_encoder_stacks_its_layers():
    """Every layer reads ints computed from the batch size before the body (torch.export
    records ``batch * heads``); each stacked layer computes them from its microbatch."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    batch = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(2))
    pipe = assert_pipe_matches(model, batch, targets, F.mse_loss, chunks=4, mesh=xpipe.make_mesh(4, 2),
                               sample_input=batch[:2])
    assert pipe.executor == "spmd" and pipe.runner.block_count == 4
