"""The language-model loss over sequence segments, so that no device holds the logits
of a whole sequence.

A language model's loss (Hugging Face's ``labels=``, or a ``loss_fn`` of
``pipe.step``: an LM head, then cross-entropy over every token) makes logits of
``rows x seq x vocabulary``; at Llama 3's vocabulary that, not the blocks, fills a
device. Inside :class:`LossOverSegments` (the spmd executor runs the layers after
the body, and ``pipe.step`` its ``loss_fn``, in it) a cross-entropy of a linear
layer's output over every token, whose logits on a device would be large
(:func:`xpipe.layout.loss_segments`), is computed instead as a loop over segments
of the sequence: each segment's logits are made, reduced to its
part of the loss, and let go; the backward makes them again, segment by segment, and
each row group adds up the head's gradient on its own devices. Both loops are
XLA while loops, so what is live at once is one segment's logits whatever XLA's
scheduler does. The logits themselves are still what the model returns: a caller
that reads them gets them whole, one that drops them (as ``pipe(**batch).loss``
does) never computes them.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xpipe._xla import while_loop
from xpipe.layout import loss_segments
from xpipe.spmd.ordering import fenced
from xpipe.spmd.placement import Placement

_LINEARS = {F.linear, torch.ops.aten.linear.default}
# What passes a tensor on with its elements in the same order, reshaped or cast.
_ORDER_KEEPING = {
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten, torch.Tensor.unflatten, torch.reshape, torch.flatten,
    torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as,
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.flatten.using_ints,
    torch.ops.aten.unflatten.int,
    torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
}
_REDUCTIONS = {1: "mean", 2: "sum"}  # aten's enum; "none" (0) gives a loss per token and is left alone


class _Logits(NamedTuple):
    """How a tensor was made from a linear layer: its input, weight and bias, and the
    dtypes it was cast to since, in order; only reshaped otherwise."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    casts: tuple[torch.dtype, ...]


class LossOverSegments(TorchFunctionMode):
    """Inside this mode, a cross-entropy (mean or sum, no class weights) whose input is
    the output of a linear layer on ``[rows, seq, features]``, reshaped to a row per
    token or cast but otherwise unchanged, runs over segments of the sequence, its rows
    split over ``placement``'s row groups; any other loss runs as written.

    One mode serves one pipeline for its life: it remembers which tensors a linear
    layer made (only while they live), so that the loss can be taken in a later
    ``with`` than the logits were made in.
    """

    def __init__(self, placement: Placement) -> None:
        super().__init__()
        self.placement = placement
        self._made: dict[int, tuple[weakref.ref, _Logits]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy or func is torch.ops.aten.cross_entropy_loss.default:
            loss = self._segmented_loss(func, args, kwargs)
            if loss is not None:
                return loss
        result = func(*args, **kwargs)
        if func in _LINEARS:
            self._remember(result, _Logits(*_linear_arguments(args, kwargs), casts=()))
        elif func in _ORDER_KEEPING and args and isinstance(result, torch.Tensor):
            made = self._logits_of(args[0])
            if made is not None and result.device == args[0].device:
                cast = (result.dtype,) if result.dtype != args[0].dtype else ()
                self._remember(result, made._replace(casts=made.casts + cast))
        return result

    def _remember(self, tensor: torch.Tensor, made: _Logits) -> None:
        key = id(tensor)
        self._made[key] = (weakref.ref(tensor, lambda _: self._made.pop(key, None)), made)

    def _logits_of(self, tensor: Any) -> _Logits | None:
        entry = self._made.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _segmented_loss(self, func, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The loss over segments of the sequence, or None where it would not be exact."""
        logits, labels, options = _cross_entropy_arguments(func, args, kwargs)
        made = self._logits_of(logits)
        if made is None or options is None or labels.is_floating_point():
            return None  # not a linear layer's output, class weights, a loss per token, or label probabilities
        hidden = made.hidden
        tokens = math.prod(hidden.shape[:-1])
        groups = self.placement.axes.stage * self.placement.replicas
        if (hidden.dim() != 3 or logits.shape != (tokens, made.weight.shape[0]) or labels.numel() != tokens
                or hidden.shape[0] % groups):
            return None  # not a row per token of [rows, seq] logits, or rows that do not split into the row groups
        spec = self.placement.step_spec(made.weight)
        vocabulary_share = made.weight.shape[0] // (self.placement.axes.tensor if spec[0] == "tensor" else 1)
        segments = loss_segments(hidden.shape[1], tokens // groups * vocabulary_share)
        if segments == 1:
            return None  # logits small enough to make whole
        reduction, ignore_index, label_smoothing = options
        labels = labels.reshape(hidden.shape[:-1]).long()
        per_group = partial(_per_group, self.placement, spec)
        counted = (labels != ignore_index).sum()  # for the mean, reduced over the row groups
        # The loops start when all else they could run beside has run (see xpipe.spmd.ordering).
        segmented_hidden, (segmented_labels, counted) = fenced(self._segmented(hidden, groups, segments),
                                                               (self._segmented(labels, groups, segments), counted))
        options = (made.casts, ignore_index, label_smoothing)
        total = _SegmentedLoss.apply(options, per_group, segmented_hidden, segmented_labels, made.weight, made.bias)
        if reduction == "sum":
            return total.to(logits.dtype)
        return (total / counted).to(logits.dtype)

    def _segmented(self, x: torch.Tensor, groups: int, segments: int) -> torch.Tensor:
        """``[rows, seq, *f] -> [segments, groups, rows / groups, seq / segments, *f]``, the
        groups over the batch axes."""
        x = x.unflatten(1, (segments, -1)).unflatten(0, (groups, -1)).movedim(2, 0)
        return self.placement.annotated(x, (None, self.placement.batch_axes, *[None] * (x.dim() - 2)))


def _per_group(placement: Placement, spec: tuple, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` (the head's weight or bias, held by ``spec``) seen by every row group:
    ``[groups, ...]``, each device holding its own group's (a view, not a copy)."""
    return None if tensor is None else placement.per_device(tensor, spec[:tensor.dim()])


def _linear_arguments(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(input, weight, bias)`` of a call of ``F.linear`` or ``aten.linear``."""
    values = dict(zip(("input", "weight", "bias"), args)) | kwargs
    return values["input"], values["weight"], values.get("bias")


def _cross_entropy_arguments(func, args: tuple, kwargs: dict) -> tuple[Any, Any, tuple | None]:
    """``(input, target, (reduction, ignore_index, label_smoothing))`` of a call of
    ``F.cross_entropy`` or ``aten.cross_entropy_loss``; the options None for a form
    the segmented loss does not compute (class weights, reduction "none", torch's
    deprecated ``size_average`` / ``reduce``)."""
    if func is F.cross_entropy:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        values = dict(zip(names, (None, None, None, None, -100, None, "mean", 0.0))) | dict(zip(names, args)) | kwargs
        legacy = values["size_average"] is not None or values["reduce"] is not None
        reduction = None if legacy else values["reduction"]
    else:
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        values = dict(zip(names, (None, None, None, 1, -100, 0.0))) | dict(zip(names, args)) | kwargs
        reduction = _REDUCTIONS.get(values["reduction"])
    if values["weight"] is not None or reduction not in ("mean", "sum"):
        return values["input"], values["target"], None
    return values["input"], values["target"], (reduction, values["ignore_index"], values["label_smoothing"])


def _segment_losses(options: tuple, hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Each row group's summed loss over one segment's tokens: ``[groups]`` from
    ``hidden`` ``[groups, r, L, H]``, ``labels`` ``[groups, r, L]`` and the group's copy
    of the head, ``weight`` ``[groups, V, H]`` and ``bias`` ``[groups, V]``."""
    casts, ignore_index, label_smoothing = options
    logits = torch.bmm(hidden.flatten(1, 2), weight.transpose(1, 2))  # [groups, r * L, V]
    if bias is not None:
        logits = logits + bias.unsqueeze(1)
    for dtype in casts:
        logits = logits.to(dtype)
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none", ignore_index=ignore_index,
                             label_smoothing=label_smoothing)
    return losses.view(hidden.shape[0], -1).float().sum(1)


class _SegmentedLoss(torch.autograd.Function):
    """The loss summed over the segments and the row groups, forward and backward each
    one XLA while loop over the segments; the backward makes each segment's logits
    again and keeps none. Inside the loops each row group reads the head through its
    own view of it (``per_group``), so that it adds up the head's gradient on its own
    devices, in float32, as one matmul over all tokens would; the groups' sums are
    reduced once, after the loop.

    The backward starts after the forward's sum and lets what follows it start after
    the head's gradient is reduced: the forward's loop is not needed by the backward's
    (it makes the logits again), and on XLA's CPU runtime two loops, or a loop and a
    reduction, that neither waits for may run in another order on each device and
    deadlock, as the clock loops did (:mod:`xpipe.spmd.ordering`). These fences did
    not cure the one deadlock seen with segments (T5 on 2 stages x 4 tensor, see
    docs/scaling.md), which does not involve the loss's loops.
    """

    @staticmethod
    def forward(ctx, options: tuple, per_group: Callable, hidden: torch.Tensor, labels: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        def add_segment(carry, segment):
            sums, head = carry
            return (sums + _segment_losses(options, *segment, *map(per_group, head)), head), ()

        zero = torch.zeros(hidden.shape[1], dtype=torch.float32, device=hidden.device)
        (sums, _), _ = while_loop(add_segment, (zero, (weight, bias)), (hidden, labels))
        total = sums.sum()
        ctx.options, ctx.per_group = options, per_group
        ctx.save_for_backward(hidden, labels, weight, bias, total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        hidden, labels, weight, bias, total = ctx.saved_tensors
        options, per_group = ctx.options, ctx.per_group
        head = [t for t in (weight, bias) if t is not None]
        grad, _ = fenced(grad, total)

        def segment_gradients(carry, segment):
            sums, head_, grad_ = carry
            segment_hidden, segment_labels = segment
            leaves = [segment_hidden.detach().requires_grad_()]
            leaves += [per_group(t.detach()).requires_grad_() for t in head_]
            with torch.enable_grad():
                losses = _segment_losses(options, leaves[0], segment_labels, *_with_none(leaves[1:], (weight, bias)))
                found = torch.autograd.grad(losses, leaves, grad_.expand_as(losses))
            return (tuple(s + g.float() for s, g in zip(sums, found[1:])), head_, grad_), found[0]

        sums = tuple(per_group(torch.zeros_like(t, dtype=torch.float32)) for t in head)
        (sums, _, _), grad_hidden = while_loop(segment_gradients, (sums, tuple(head), grad), (hidden, labels))
        grad_hidden, grad_head = fenced(grad_hidden, [s.sum(0).to(t.dtype) for s, t in zip(sums, head)])
        grad_weight, grad_bias = _with_none(grad_head, (weight, bias))
        return None, None, grad_hidden, None, grad_weight, grad_bias


def _with_none(present: list[torch.Tensor], like: tuple) -> list[torch.Tensor | None]:
    """``present`` spread back over ``like``'s places, None where ``like`` has None."""
    values = iter(present)
    return [None if t is None else next(values) for t in like]
