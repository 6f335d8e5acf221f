"""Small reference models that the examples, tests, benchmarks and ``xpipe-viz`` use.

They are ordinary PyTorch: nothing in them knows about pipelining.

    python -c "import xpipe.models as m; print(m.transformer_lm())"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    """Size of a decoder-only transformer language model."""

    vocab: int = 256  # tokens in the vocabulary
    seq: int = 64  # longest sequence (learned positions)
    width: int = 64  # model (embedding) width
    heads: int = 4  # attention heads; must divide width
    blocks: int = 8  # identical transformer blocks
    tie_weights: bool = True  # the head reuses the embedding matrix


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP. ``[b, t, w] -> [b, t, w]``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, t, w/heads]
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Embedding(nn.Module):
    """Token plus learned position embedding. ``[b, t] (int) -> [b, t, w]``."""

    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(seq, width))
        # Small, as in GPT-2: the tokens matrix doubles as the head, and unit-variance
        # rows would start the logits at a scale of sqrt(width).
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class TransformerLM(nn.Module):
    """Decoder-only LM: embedding, ``blocks`` identical blocks, norm, head. ``[b, t] -> [b, t, vocab]``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab, config.seq, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.blocks))
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        if config.tie_weights:
            self.head.weight = self.embed.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def transformer_lm(blocks: int = 8, width: int = 64, **config: int) -> TransformerLM:
    """A small tied-weight transformer LM; keyword arguments override :class:`LMConfig`."""
    torch.manual_seed(0)
    return TransformerLM(LMConfig(blocks=blocks, width=width, **config))


class MLPBlock(nn.Module):
    """Residual MLP block. ``[b, w] -> [b, w]``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def mlp_stack(blocks: int = 8, width: int = 32, *, inputs: int = 16, outputs: int = 10) -> nn.Sequential:
    """An ``nn.Sequential``: input projection, ``blocks`` MLP blocks, output projection."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(inputs, width),
        *(MLPBlock(width) for _ in range(blocks)),
        nn.Linear(width, outputs),
    )


def small_cnn(classes: int = 10) -> nn.Sequential:
    """A CNN whose layers all differ (widths, resolutions): nothing repeats. ``[b, 3, 32, 32] -> [b, classes]``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, classes),
    )


class ResidualBlock(nn.Module):
    """A ResNet basic block with GroupNorm; ``stride`` 2 halves the resolution and
    the shortcut is then a strided 1x1 convolution. ``[b, i, h, w] -> [b, o, h/s, w/s]``."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, outputs)
        reshape = stride != 1 or inputs != outputs
        self.shortcut = nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False) if reshape else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


def resnet_like(widths: tuple[int, ...] = (8, 16, 32, 64), classes: int = 10) -> nn.Sequential:
    """A small ResNet: a stem, two residual blocks per width (each width after the
    first starts at half the resolution), pooling and a linear head.
    GroupNorm instead of BatchNorm, so a microbatch computes what the whole batch
    would. ``[b, 3, h, w] -> [b, classes]``."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False)]
    for index, width in enumerate(widths):
        previous = widths[max(index - 1, 0)]
        layers += [ResidualBlock(previous, width, stride=1 if index == 0 else 2), ResidualBlock(width, width)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes)]
    return nn.Sequential(*layers)


def _conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(4, outputs), nn.ReLU())


class UNet(nn.Module):
    """A small U-Net: each encoder level's output is concatenated into the decoder
    level of the same resolution, so its skip connections jump over the middle of
    the model. ``[b, channels, h, w] -> [b, classes, h, w]``, ``h`` and ``w``
    divisible by ``2 ** levels``."""

    def __init__(self, channels: int = 3, classes: int = 2, width: int = 8, levels: int = 3) -> None:
        super().__init__()
        widths = [width * 2**level for level in range(levels + 1)]
        self.encoders = nn.ModuleList(
            _conv_block(channels if level == 0 else widths[level - 1], widths[level]) for level in range(levels))
        self.pool = nn.MaxPool2d(2)
        self.middle = _conv_block(widths[levels - 1], widths[levels])
        self.ups = nn.ModuleList(
            nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2) for level in reversed(range(levels)))
        self.decoders = nn.ModuleList(
            _conv_block(2 * widths[level], widths[level]) for level in reversed(range(levels)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = self.pool(x)
        x = self.middle(x)
        for up, decoder, skip in zip(self.ups, self.decoders, reversed(skips)):
            x = decoder(torch.cat([up(x), skip], 1))
        return self.head(x)


def unet(width: int = 8, levels: int = 3) -> UNet:
    """A :class:`UNet` with fixed initial weights."""
    torch.manual_seed(0)
    return UNet(width=width, levels=levels)
