"""Microbatches for the devices executor: a batch split, moved between devices, merged.

A batch (a tensor, or a structure of them) splits on dim 0, or on the loader's
microbatch dim, into the microbatches the schedule's cells run; the last stage's
outputs merge back (a scalar, a loss, as its microbatches' weighted sum). Values
move between stage devices with ``.to(device)``; what crosses a cut may be a
structure, keyed by (name, leaf index).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from xpipe._xla import sync
from xpipe.reduction import weighted


def keyed_leaves(names: tuple[str, ...], values: Any) -> list[tuple[tuple[str, int], Any]]:
    """The leaves of each named value (a tensor, or a tuple or dict of them), keyed
    (name, leaf index): a value that crosses a cut may be a structure."""
    return [((name, index), leaf) for name, value in zip(names, values)
            for index, leaf in enumerate(tree_flatten(value)[0])]



def microbatches_of(x: Any, chunks: int | list[int], microbatch_dim: int | None) -> list[Any]:
    """``tensor_microbatches`` for each leaf of ``x`` (a tensor, or a tuple of them): a list of microbatches."""
    leaves, spec = tree_flatten(x)
    pieces = [tensor_microbatches(leaf, chunks, microbatch_dim) for leaf in leaves]
    return [tree_unflatten(list(parts), spec) for parts in zip(*pieces)]



def tensor_microbatches(x: torch.Tensor, chunks: int | list[int], microbatch_dim: int | None) -> list[torch.Tensor]:
    """The microbatches of ``x``: ``chunks`` of them (a batch that ``chunks`` does not
    divide gives a smaller last piece, or fewer pieces, as ``torch.chunk`` does), or
    pieces of the given row counts. On an XLA device they are computed together, so
    each is device data rather than a slice whose offset would make its own graph."""
    if microbatch_dim is not None:
        pieces = list(x.unbind(microbatch_dim))
    elif isinstance(chunks, int):
        pieces = list(x.chunk(chunks, 0))
    else:
        pieces = list(x.split(chunks, 0))
    launch(xla_tensors(pieces))
    return pieces



def merged(parts: list[torch.Tensor], microbatch_dim: int | None,
           scalar_shares: list[torch.Tensor | float]) -> torch.Tensor:
    """One output from its microbatches' parts; a scalar (a loss) is their sum weighted
    by ``scalar_shares``."""
    if parts[0].dim() == 0:
        return functools.reduce(operator.add, [weighted(part, share) for part, share in zip(parts, scalar_shares)])
    if microbatch_dim is not None:
        return torch.stack(parts, microbatch_dim)
    return torch.cat(parts, 0)



def merged_on_host(microbatches: list[Any], microbatch_dim: int | None,
                    scalar_shares: list[torch.Tensor | float]) -> Any:
    """The microbatches' values (each a tensor or a structure of them) as one batch on the host."""
    flat = [tree_flatten(on_host(value)) for value in microbatches]
    whole = [merged(list(parts), microbatch_dim, scalar_shares) for parts in zip(*[leaves for leaves, _ in flat])]
    return tree_unflatten(whole, flat[0][1])



def moved(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or a structure of them) on ``device``."""
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v, value)



def on_host(value: Any) -> Any:
    """``value`` with its XLA tensors copied to the host. What is counted from a batch
    (its items: :mod:`xpipe.reduction`) is counted there: counted lazily on the device
    from the microbatches, it made later graphs of the step compute wrong losses."""
    return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) and v.device.type == "xla" else v, value)



def differentiable(value: Any) -> Any:
    """``value`` with each floating tensor a fresh autograd leaf that collects its gradient."""
    return tree_map(lambda v: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point()
                    else v, value)



def xla_tensors(values: list[Any]) -> list[torch.Tensor]:
    """The XLA tensors among ``values`` and inside their structures."""
    return [v for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor) and v.device.type == "xla"]



def launch(tensors: list[torch.Tensor]) -> None:
    """Execute the graph of ``tensors`` (all on one device), without waiting."""
    if tensors:
        sync(tensors, wait=False)



def byte_count(values: list[Any]) -> int:
    """Bytes of the tensors among ``values`` and inside their structures."""
    return sum(v.numel() * v.element_size() for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))
