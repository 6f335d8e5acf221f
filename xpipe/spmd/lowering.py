"""Rewrites of ops whose XLA lowering the SPMD partitioner cannot shard.

torch_xla lowers ``layer_norm`` through XLA's batch-norm-training op on a
``[1, rows, features]`` reshape; GSPMD does not partition that op, so it gathers
the whole activation onto every device (seen in the optimized HLO: an all-gather
per LayerNorm, in every clock of the pipeline loop). Written as means and a
reciprocal square root, the same arithmetic stays local. The rewrite sits above
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


REWRITES = {F.layer_norm: layer_norm, torch.layer_norm: layer_norm,
            torch.ops.aten.layer_norm.default: aten_layer_norm}
