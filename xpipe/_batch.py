"""The batch contract both executors keep, checked before any device work.

Every input carries the batch on dim 0 (or, with ``microbatch_dim=d``, the
microbatches on dim ``d`` and their rows on the first other dim), every input has the
same batch size, and every tensor the model returns carries the batch on the
same dim. A pipeline splits and joins on that dim; a tensor that breaks the
contract would be split or joined along its features, in silence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def rows(value: Any) -> int:
    """Rows (dim 0) of the first tensor in ``value`` (a tensor, or a structure of them)."""
    return tree_flatten(value)[0][0].shape[0]


def batch_size(inputs: tuple[torch.Tensor, ...], chunks: int, microbatch_dim: int | None) -> int:
    """Rows in the batch that ``inputs`` carry (all of them the same).

    Raises:
        TypeError: if an input is not a tensor.
        ValueError: for a tensor without a batch dim, a ``microbatch_dim`` that is not
            of size ``chunks``, or inputs whose batch sizes differ.
    """
    sizes = []
    for index, x in enumerate(tree_flatten(inputs)[0]):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: input {index} is a {type(x).__name__}; pass tensors (batch first)")
        if microbatch_dim is None:
            if x.dim() == 0:
                raise ValueError(f"x: input {index} is a scalar; every input needs a batch dim (dim 0)")
            sizes.append(x.shape[0])
        else:
            if not -x.dim() <= microbatch_dim < x.dim() or x.shape[microbatch_dim] != chunks:
                raise ValueError(f"microbatch_dim: input of shape {list(x.shape)} has no dim {microbatch_dim} "
                                 f"of size chunks={chunks}; pass the dim that holds the microbatches")
            if x.dim() < 2:
                raise ValueError(f"microbatch_dim: input of shape {list(x.shape)} has no rows beside its "
                                 "microbatch dim; the loader's layout is [chunks, micro_batch, ...]")
            sizes.append(chunks * x.movedim(microbatch_dim, 0).shape[1])
    if len(set(sizes)) > 1:
        shapes = ", ".join(str(list(x.shape)) for x in tree_flatten(inputs)[0])
        raise ValueError(f"x: the inputs have different batch sizes {sizes} (shapes {shapes}); every input "
                         "must carry the same batch on the batch dim")
    return sizes[0]


def check_floating_inputs(inputs: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> None:
    """Refuse float64 inputs to a model whose weights are of another floating dtype.

    XLA would only say so in an HLO verifier message, long after the call.
    """
    for index, x in enumerate(tree_flatten(inputs)[0]):
        if x.dtype == torch.float64 and dtype not in (None, torch.float64):
            raise ValueError(f"x: input {index} is float64 but the model's weights are {dtype}; "
                             f"convert it first (x.to({dtype}))")


def check_outputs(output: Any, rows: int, *, where: str = "module") -> None:
    """Every tensor of ``output`` is a scalar (a loss: the pipeline averages it over
    the microbatches) or has ``rows`` rows on dim 0; no leaf is anything but a tensor.

    Raises:
        TypeError: for a leaf that is not a tensor.
        ValueError: for a tensor whose dim 0 is not the batch.
    """
    leaves, _ = tree_flatten(output)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where}: output {index} is a {type(leaf).__name__}; a pipelined model returns "
                            "tensors (or tuples, lists and dicts of them) whose dim 0 is the batch")
        if leaf.dim() > 0 and leaf.shape[0] != rows:
            raise ValueError(
                f"{where}: output {index} has shape {list(leaf.shape)}, but its dim 0 should be the "
                f"microbatch's {rows} rows; a pipelined model must return its outputs batch-first "
                "(reduce inside a loss after the Pipe, and move feature-first outputs with .transpose)")
