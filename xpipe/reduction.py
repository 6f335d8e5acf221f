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

from collections.abc import Callable, Mapping
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


def declares_reduction(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` says how it reduces: a ``reduction`` attribute (torch's loss
    modules have one; a function may be given one), or one of torch's own functions."""
    return hasattr(loss_fn, "reduction") or loss_fn in _IGNORING_FUNCTIONS or loss_fn in _ELEMENTWISE_FUNCTIONS


def tells_reductions_apart(targets: list[Any]) -> bool:
    """Whether the microbatches' ``targets`` (on the host) weigh differently counted by
    rows and counted by the targets that are not ``IGNORE_INDEX``: the batches on which
    a loss that says nothing of how it reduces can be told apart from one that ignores
    -100 (the default of torch's losses and of Hugging Face labels). Float targets
    ignore nothing, so any batch of them tells it."""
    firsts = [tree_flatten(target)[0][0] for target in targets]
    if firsts[0].is_floating_point():
        return True
    counted = [int((first != IGNORE_INDEX).sum()) for first in firsts]
    row_counts = [rows(target) for target in targets]
    return any(count * sum(row_counts) != sum(counted) * row_count for count, row_count in zip(counted, row_counts))


def loss_fn_items(loss_fn: Callable[..., Any], target: Any) -> Items | None:
    """The items ``loss_fn(output, target)`` averages over, or None for a loss that
    sums (each microbatch's loss then counts whole).

    Raises:
        ValueError: a ``reduction`` other than ``"mean"`` and ``"sum"``.
    """
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction == "sum":
        return None
    if reduction != "mean":
        raise ValueError(f"loss_fn: its reduction is {reduction!r}; pipe.step needs a loss that reduces to a "
                         "scalar ('mean' or 'sum')")
    ignore_index = IGNORE_INDEX if loss_fn in _IGNORING_FUNCTIONS else getattr(loss_fn, "ignore_index", None)
    first = tree_flatten(target)[0][0]
    if ignore_index is None or first.is_floating_point():
        return rows(target)
    valid = first != ignore_index
    weight = getattr(loss_fn, "weight", None)  # nn.CrossEntropyLoss divides by the targets' class weights
    if isinstance(weight, torch.Tensor):
        return (weight.to(first.device)[first.clamp(min=0)] * valid).sum()
    return valid.sum()


def model_loss_items(module: torch.nn.Module, inputs: Mapping[str, Any]) -> Items:
    """The items the loss a model returns for ``inputs`` averages over: for a Hugging
    Face model given integer ``labels``, the labels that are not ignored (after the
    shift of a decoder-only language model, whose last position predicts nothing);
    otherwise the rows."""
    labels = inputs.get("labels")
    config = getattr(module, "config", None)
    if config is None or not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return rows(next(iter(inputs.values())))
    loss_type = getattr(module, "loss_type", None) or "ForCausalLM"  # transformers' own default
    if loss_type == "ForCausalLM" and not getattr(config, "is_encoder_decoder", False):
        labels = labels[..., 1:]
    return (labels != IGNORE_INDEX).sum()


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
