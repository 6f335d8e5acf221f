"""Checks that the stacked body's dim 0 is the batch, before any device work.

The spmd executor splits the stream and every per-row side input on dim 0 into
microbatches, and carries each microbatch's rows from stage to stage. That is right
only where dim 0 holds the batch's rows and a block computes each row on its own:
a sequence-first stream (``nn.TransformerEncoderLayer(batch_first=False)``, whose
attention runs along dim 0) or a side input with the rows folded into another dim
(BLOOM's ALiBi bias, ``[rows * heads, 1, seq]``) would be cut across what the block
mixes, silently. These checks refuse both, naming the tensor and the fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# A block's output on rows it computed alone, against the same rows computed with the
# others, relative to its largest value: the same arithmetic up to rounding where rows
# stay apart (a few of the dtype's ulps), and off by the values' own size where the
# block mixes them.
MIXED_ABOVE = {torch.float32: 1e-2, torch.float64: 1e-2}
MIXED_ABOVE_IN_16_BITS = 1e-1


def check_sides_hold_whole_rows(names: list[str], once: tuple, twice: tuple, rows: int) -> None:
    """Refuse a side input whose dim 0 grows with the batch but is not its rows.

    Args:
        names: the side inputs' names in the capture.
        once, twice: their values (fake) on the sample batch and on twice its rows.
        rows: the sample batch's rows.
    """
    for name, a, b in zip(names, once, twice):
        if b.shape[0] == 2 * a.shape[0] and a.shape[0] != rows:
            raise ValueError(
                f"module: every block reads {name!r}, computed before the body, whose dim 0 ({a.shape[0]} on a "
                f"sample of {rows} rows) grows with the batch but is not its rows: the rows are folded with "
                "another dim (as BLOOM's ALiBi bias folds rows and heads, [rows * heads, 1, seq]). The spmd "
                "executor carries a side input with its microbatch by dim 0 = rows, and would cut this one "
                "across its heads; use executor='devices', or build the tensor with the rows as a dim of their own")


def check_rows_stay_apart(block: torch.fx.GraphModule, stream: torch.Tensor, sides: list[torch.Tensor],
                          side_rows: tuple[bool, ...]) -> None:
    """Refuse a block that mixes the rows of its stream's dim 0 (a sequence-first
    stream): its output on the first row alone must equal its first row computed
    with the others (dropout off; on the host, one block, the sample's shapes).

    Args:
        block: the body's first block.
        stream, sides: its inputs on the sample batch (real tensors, as ``pre`` makes them).
        side_rows: per side, whether it has a row per batch row (cut with the stream)
            or is held whole.
    """
    if stream.shape[0] < 2 or not stream.is_floating_point() or stream.is_meta:
        return
    first = [side[:1] if rows else side for side, rows in zip(sides, side_rows)]
    with torch.no_grad(), _in_eval_mode(block), _WithoutDropout():
        together = block(stream, *sides)[:1]
        alone = block(stream[:1], *first)
    bound = MIXED_ABOVE.get(together.dtype, MIXED_ABOVE_IN_16_BITS) * together.float().abs().max().clamp_min(1e-6)
    if together.shape != alone.shape or (together.float() - alone.float()).abs().max() > bound:
        raise ValueError(
            f"module: the repeated blocks mix the rows of dim 0 of the tensor they pass on (shape "
            f"{tuple(stream.shape)} on the sample): a row computed alone differs from the same row computed "
            "with the others. The Pipe splits dim 0 into microbatches, so dim 0 must be the batch: a "
            "sequence-first model ([seq, batch, width], e.g. nn.TransformerEncoderLayer with "
            "batch_first=False) runs attention along it. Build the model batch-first (batch_first=True), or "
            "transpose to batch-first outside the repeated blocks")


@contextlib.contextmanager
def _in_eval_mode(block: torch.nn.Module) -> Iterator[None]:
    """``block``'s modules in eval mode (their dropout off), then as they were."""
    modes = {module: module.training for module in block.modules()}
    block.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


class _WithoutDropout(TorchFunctionMode):
    """Dropout as the identity (and attention without its dropout), so that a block's
    output on a row does not depend on how many rows drew masks with it: for the
    dropout a capture wrote into the graph (torch.export's, in train mode), which
    eval mode does not reach."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            return args[0]
        if func is F.scaled_dot_product_attention:
            kwargs = {**kwargs, **dict(zip(_ATTENTION_OPTIONS, args[3:])), "dropout_p": 0.0}
            args = args[:3]
        return func(*args, **kwargs)


_ATTENTION_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
