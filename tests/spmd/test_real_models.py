"""Real models as their libraries ship them, under the spmd executor, against themselves unpipelined.

torchvision's ViT: its encoder blocks (found inside ``encoder.layers``) are
stacked over the stage axis, the patch embedding and the head run
data-parallel. One training step: output, loss, every gradient and the weights
after SGD within rtol 1e-4 (``equivalence``).
"""

import pytest
import torch
import torch.nn.functional as F
import torchvision
from equivalence import assert_pipe_matches

import xpipe


@pytest.mark.parametrize("stages, data", [(4, 2), (2, 4)])
def test_vit_stacks_its_encoder_blocks(stages, data):
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=4, num_heads=2,
                                                 hidden_dim=32, mlp_dim=64, num_classes=10)
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    pipe = assert_pipe_matches(model, images, targets, F.cross_entropy, chunks=4, mesh=xpipe.make_mesh(stages, data))
    assert pipe.executor == "spmd" and pipe.runner.block_count == 4
