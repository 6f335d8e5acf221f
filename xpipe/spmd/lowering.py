"""Rewrites of ops whose XLA lowering the SPMD partitioner cannot shard.

torch_xla lowers ``layer_norm`` through XLA's batch-norm-training op on a
``[1, rows, features]`` reshape; GSPMD does not partition that op, so it gathers
the whole activation onto every device (seen in the optimized HLO: an all-gather
per LayerNorm, in every clock of the pipeline loop). Written as means and a
reciprocal square root, the same arithmetic stays local. Attention runs with its
heads leading (:func:`heads_leading_attention`), so that the heads split over
"tensor" stay split through vmap's batched matmuls. The rewrites sit above
autograd, so the backward is made of the same plain ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def layer_norm(x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` from elementwise ops and reductions over the last dims."""
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(dims, keepdim=True)
    y = centered * torch.rsqrt(variance + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


class ShardableOps(TorchFunctionMode):
    """Inside this mode, ops listed in ``REWRITES`` run as their shardable forms."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rewrite = REWRITES.get(func)
        return (rewrite or func)(*args, **(kwargs or {}))


def aten_layer_norm(x: torch.Tensor, normalized_shape, weight=None, bias=None, eps: float = 1e-5,
                    cudnn_enable: bool = True) -> torch.Tensor:
    """``aten.layer_norm`` as torch.export records it (GPT-2's blocks), by :func:`layer_norm`."""
    return layer_norm(x, normalized_shape, weight, bias, eps)


_ATTENTION = torch._C._nn.scaled_dot_product_attention  # F.scaled_dot_product_attention, as torch defines it


def heads_leading_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                            scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``[rows, heads, seq, dim]`` run on
    ``[heads, rows, seq, dim]``.

    Under ``torch.vmap`` the batched matmuls fold the leading dims into one, the
    vmapped one first: ``[replicas, rows, heads]``. With the heads split over
    "tensor" and more than one row, the rows lie between the two split dims, and XLA
    cannot keep the split through the fold: it gathered q, k and v onto every device
    of a tensor group, every clock. Heads first, the split dims lead and stay split.
    """
    if query.dim() != 4:
        return _ATTENTION(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:  # the heads dim moves: repeat the key/value heads first
        key, value = key_value_heads_repeated(query, key, value)
    # A mask of fewer dims broadcasts from the right: given its leading 1s first, it lines up as before.
    swapped = [None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)).transpose(0, 1)
               for t in (query, key, value, attn_mask)]
    return _ATTENTION(*swapped[:3], attn_mask=swapped[3], dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale).transpose(0, 1)


def key_value_heads_repeated(query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention's key and value (heads at dim -3) with each head repeated
    for the query heads it serves, as ``enable_gqa=True`` reads them."""
    repeats = query.shape[-3] // key.shape[-3]
    if repeats == 1:
        return key, value
    return key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)


REWRITES = {F.layer_norm: layer_norm, torch.layer_norm: layer_norm,
            torch.ops.aten.layer_norm.default: aten_layer_norm, _ATTENTION: heads_leading_attention}
