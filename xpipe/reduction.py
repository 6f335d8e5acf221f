"""How much each microbatch's loss weighs in the whole batch's loss.

A loss that averages over the items of its batch (rows, or the tokens whose target
is not ignored) gives, for each microbatch, the mean over that microbatch's items.
The batch's loss is the microbatches' losses weighted by their share of the items,
not their plain mean: with padded targets the microbatches hold different numbers
of items, and a plain mean (or a weighting by rows) is silently wrong. This module
counts the items each kind of loss divides by: a loss module's or function's own
``reduction`` (and ``ignore_index`` and class ``weight``, as
``nn.CrossEntropyLoss`` keeps them), torch's own loss functions, and the loss a
Hugging Face model computes from ``labels=``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from xpipe._batch import rows

IGNORE_INDEX = -100  # torch's and Hugging Face's default for targets that do not count

# torch's functions that mean over targets that are not ignored (default ignore_index)
_IGNORING_FUNCTIONS = (F.cross_entropy, F.nll_loss)
# torch's functions that mean over every element: a microbatch weighs as its rows do
_ELEMENTWISE_FUNCTIONS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                          F.binary_cross_entropy_with_logits)

Items = torch.Tensor | int  # how many items a microbatch's loss averages over


@dataclass(frozen=True)
class Declared:
    """How a loss says it reduces: ``reduction`` ("mean" or "sum"), the target value it
    ignores (None: ignores none) and its class weights (None: none)."""

    reduction: str
    ignore_index: int | None = None
    weight: torch.Tensor | None = None


def declared(loss_fn: Callable[..., Any]) -> Declared | None:
    """How ``loss_fn`` reduces, where it says so: a ``reduction`` attribute (torch's loss
    modules have one, with ``ignore_index`` and ``weight`` where they take them; a
    function may be given them), one of torch's own loss functions, or a
    ``functools.partial`` of one with its options given by keyword. None otherwise."""
    if isinstance(loss_fn, functools.partial) and not loss_fn.args and _is_torch_loss(loss_fn.func):
        options = loss_fn.keywords
        default = IGNORE_INDEX if loss_fn.func in _IGNORING_FUNCTIONS else None
        return Declared(options.get("reduction", "mean"), options.get("ignore_index", default), options.get("weight"))
    if hasattr(loss_fn, "reduction"):
        weight = getattr(loss_fn, "weight", None)
        return Declared(loss_fn.reduction, getattr(loss_fn, "ignore_index", None),
                        weight if isinstance(weight, torch.Tensor) else None)
    if _is_torch_loss(loss_fn):
        return Declared("mean", IGNORE_INDEX if loss_fn in _IGNORING_FUNCTIONS else None)
    return None


def _is_torch_loss(fn: Any) -> bool:
    return any(fn is known for known in (*_IGNORING_FUNCTIONS, *_ELEMENTWISE_FUNCTIONS))


def declares_reduction(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` says how it reduces (:func:`declared`)."""
    return declared(loss_fn) is not None


def tells_reductions_apart(targets: list[Any]) -> bool:
    """Whether the microbatches' ``targets`` (on the host) weigh differently counted by
    rows and counted by the targets that are not some one value: the batches on which
    a loss that says nothing of how it reduces can be told apart from one that ignores
    a target value (-100, the default of torch's losses and of Hugging Face labels, or
    any other). Float targets ignore nothing: no batch of them tells anything that
    the first step's check did not."""
    firsts = [tree_flatten(target)[0][0] for target in targets]
    if firsts[0].is_floating_point():
        return False
    row_counts = [rows(target) for target in targets]
    counts = [dict(zip(*(part.tolist() for part in first.unique(return_counts=True)))) for first in firsts]
    sizes = [first.numel() for first in firsts]
    for value in set().union(*counts):
        counted = [size - count.get(value, 0) for size, count in zip(sizes, counts)]
        if any(kept * sum(row_counts) != sum(counted) * row_count for kept, row_count in zip(counted, row_counts)):
            return True
    return False


def loss_fn_items(loss_fn: Callable[..., Any], target: Any) -> Items | None:
    """The items ``loss_fn(output, target)`` averages over, or None for a loss that
    sums (each microbatch's loss then counts whole).

    Raises:
        ValueError: a ``reduction`` other than ``"mean"`` and ``"sum"``.
    """
    if _reduction(loss_fn) == "sum":
        return None
    first = tree_flatten(target)[0][0]
    return rows(target) if _counts_rows(loss_fn, first) else _counted_targets(loss_fn, first, 0)


def loss_fn_items_each(loss_fn: Callable[..., Any], target: torch.Tensor, pieces: int) -> torch.Tensor:
    """:func:`loss_fn_items` of each ``target[i, j, ...]`` at once, the first ``pieces``
    dims naming the pieces (float32, of those dims' shape); ones for a loss that sums."""
    shape = target.shape[:pieces]
    if _reduction(loss_fn) == "sum":
        return torch.ones(shape, device=target.device)
    if _counts_rows(loss_fn, target):
        return torch.full(shape, float(target.shape[pieces]), device=target.device)
    return _counted_targets(loss_fn, target, pieces).to(torch.float32)


def _reduction(loss_fn: Callable[..., Any]) -> str:
    """``"mean"`` or ``"sum"`` (a function that does not say is taken to mean).

    Raises:
        ValueError: another reduction.
    """
    how = (declared(loss_fn) or Declared("mean")).reduction
    if how not in ("mean", "sum"):
        raise ValueError(f"loss_fn: its reduction is {how!r}; pipe.step needs a loss that reduces to a "
                         "scalar ('mean' or 'sum')")
    return how


def _counts_rows(loss_fn: Callable[..., Any], target: torch.Tensor) -> bool:
    """Whether a mean-reducing ``loss_fn`` averages over rows (it ignores no target value)."""
    how = declared(loss_fn) or Declared("mean")
    return how.ignore_index is None or target.is_floating_point()


def _counted_targets(loss_fn: Callable[..., Any], target: torch.Tensor, pieces: int) -> torch.Tensor:
    """The targets ``loss_fn`` counts (not its ``ignore_index``; by class weight where it
    has them), summed over all but the first ``pieces`` dims."""
    how = declared(loss_fn)
    valid = target != how.ignore_index
    if how.weight is not None:  # nn.CrossEntropyLoss divides by the counted targets' class weights
        classes = torch.where(valid, target, torch.zeros_like(target))  # an ignore index may lie outside the classes
        counted = how.weight.to(target.device)[classes] * valid
    else:
        counted = valid
    return counted.flatten(pieces).sum(-1) if pieces else counted.sum()


def model_loss_items(module: torch.nn.Module, inputs: Mapping[str, Any]) -> Items:
    """The items the loss a model returns for ``inputs`` averages over: for a Hugging
    Face model given integer ``labels``, the labels that are not ignored (after the
    shift of a decoder-only language model, whose last position predicts nothing);
    otherwise the rows."""
    labels = _counted_labels(module, inputs.get("labels"))
    return rows(next(iter(inputs.values()))) if labels is None else (labels != IGNORE_INDEX).sum()


def model_loss_items_each(module: torch.nn.Module, labels: torch.Tensor | None, pieces: torch.Tensor) -> torch.Tensor:
    """:func:`model_loss_items` of each piece at once: ``pieces`` is any input of the
    model laid out ``[i, j, rows, ...]``, ``labels`` its labels so laid out (or None);
    float32 ``[i, j]``."""
    counted = _counted_labels(module, labels)
    if counted is None:
        return torch.full(pieces.shape[:2], float(pieces.shape[2]), device=pieces.device)
    return (counted != IGNORE_INDEX).flatten(2).sum(-1).to(torch.float32)


def _counted_labels(module: torch.nn.Module, labels: Any) -> torch.Tensor | None:
    """The labels whose count a Hugging Face model's loss divides by (shifted for a
    decoder-only language model), or None where it means over rows."""
    config = getattr(module, "config", None)
    if config is None or not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return None
    loss_type = getattr(module, "loss_type", None) or "ForCausalLM"  # transformers' own default
    if loss_type == "ForCausalLM" and not getattr(config, "is_encoder_decoder", False):
        return labels[..., 1:]
    return labels


def weighted(loss: torch.Tensor, share: torch.Tensor | float) -> torch.Tensor:
    """A microbatch's loss times its share of the batch's items; 0 for a microbatch
    with no item to count (all its targets ignored), whose own mean over nothing is
    NaN. Its gradient is 0 either way."""
    if not isinstance(share, torch.Tensor):
        return loss * share
    return torch.where(share > 0, loss * share, torch.zeros_like(loss))


def shares(items: list[Items]) -> list[torch.Tensor | float]:
    """Each microbatch's share of the batch's items (they sum to 1)."""
    total = sum(items)
    return [count / total for count in items]
