"""Dropout inside the stacked body, from a counter-based hash instead of an RNG state.

The stacked blocks run under ``torch.vmap`` (which refuses random ops) inside an
XLA while loop traced once for every clock, and a checkpointed microbatch runs its
blocks a second time in the backward pass. A stateful generator gives none of
what dropout needs there; a hash of the cell's identity gives all of it:

- a different mask for every block, microbatch, replica and step (the key of
  a cell is mixed from the step's seed, the stage, the replica and the microbatch;
  the block's slot and the call's index in the block are mixed in after);
- the same mask again when a checkpointed microbatch is recomputed (same key);
- no state carried through the loop, and integer work only.

``F.dropout`` (``nn.Dropout``) and ``F.scaled_dot_product_attention`` with
``dropout_p > 0`` (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``) are
rewritten while the blocks run; the masks differ from torch's own generator, so a
training step with dropout equals the plain model in distribution, not in value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from xpipe.spmd.lowering import key_value_heads_repeated

_LOW24 = float(1 << 24)
_GOLDEN = 0x1E3779B9  # spreads slot numbers over the key space


def mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of an int32 tensor, elementwise."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975  # 0x846CA68B as a signed 32-bit integer
    return x ^ ((x >> 16) & 0xFFFF)


def cell_keys(seed: torch.Tensor, clocks: torch.Tensor, stages: int, data: int) -> torch.Tensor:
    """``[T, S * D]`` int32 keys: the cell that row ``s * D + d`` runs at each clock.

    Stage ``s`` runs cell ``clock - s`` (fill-drain: the microbatch, counted on
    through the rounds of a circular schedule), so the key names (seed, stage,
    replica, cell) and a recomputation of the cell finds it again.
    """
    row = torch.arange(stages * data, dtype=torch.int32, device=clocks.device)
    microbatch = clocks.to(torch.int32).view(-1, 1) - row.div(data, rounding_mode="floor").view(1, -1)
    return mix(mix(mix(seed.to(torch.int32) ^ row) + microbatch))


def uniform(key: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Numbers in [0, 1) of ``like``'s shape, one per element, fixed by ``key`` (int32, scalar)."""
    index = torch.arange(like.numel(), dtype=torch.int32, device=like.device).view(like.shape)
    return (mix(index ^ key) & 0xFFFFFF).to(like.dtype) / _LOW24


@contextlib.contextmanager
def hashed_dropout(key: torch.Tensor, slot: int) -> Iterator[None]:
    """While the block in ``slot`` runs, dropout takes its masks from ``key`` (an int32
    scalar per vmapped row).

    The two functions are swapped in ``torch.nn.functional`` itself rather than
    caught by a TorchFunctionMode, because ``F.multi_head_attention_forward`` calls
    them from inside (a mode sees only the outer call).
    """
    dropout = _HashedDropout(mix(key + slot * _GOLDEN))
    saved = F.dropout, F.scaled_dot_product_attention
    F.dropout, F.scaled_dot_product_attention = dropout.dropout, dropout.attention
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = saved


class _HashedDropout:
    """Dropout and attention dropout with masks from ``key``, a new mask per call."""

    def __init__(self, key: torch.Tensor) -> None:
        self.key = key
        self.calls = 0

    def dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0:
            return x
        if p == 1:
            return x * 0
        self.calls += 1
        keep = uniform(mix(self.key + self.calls), x) >= p
        return torch.where(keep, x / (1 - p), x.new_zeros(()))

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        if dropout_p == 0:
            return _ATTENTION(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa)
        if enable_gqa:
            key, value = key_value_heads_repeated(query, key, value)
        scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
        if is_causal:
            causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        # A query that may attend to nothing gets zeros, as torch's own attention gives
        # it, not NaN (whose gradient would poison every weight, times zero or not).
        nothing = scores.isneginf().all(-1, keepdim=True)
        weights = torch.where(nothing, 0.0, scores).softmax(-1).masked_fill(nothing, 0.0)
        return self.dropout(weights, dropout_p) @ value


_ATTENTION = F.scaled_dot_product_attention
