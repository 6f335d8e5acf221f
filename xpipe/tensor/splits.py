"""Each block weight's split over "tensor", as ``Pipe`` splits it: the one answer that
the build (:mod:`xpipe.build`) and the planner's profile
(:mod:`xpipe.planner.profile`) both read, so that a plan holds what the Pipe holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xpipe.tensor.inference import CannotInfer
from xpipe.tensor.rules import Rule, Rules, tensor_splits, unruled, unruled_message, with_shared_key_values


def block_splits(names: Sequence[str], shapes: Sequence[tuple[int, ...]], tensor: int, rules: Rules | None,
                 key_value_heads: int | None, read_from_graph: Callable[[], Rules]) -> list[Rule]:
    """Each block weight's split over ``tensor`` devices (a dim, :class:`xpipe.Packed`,
    or None): by the user's ``rules``, the key/value projections whole where ``tensor``
    does not divide the model's ``key_value_heads``
    (:func:`xpipe.tensor.rules.with_shared_key_values`), then the built-in rules, and
    as ``read_from_graph()`` reads the block (:mod:`xpipe.tensor.inference`) for the
    weights no rule covers and those a built-in rule splits on the wrong dim
    (:func:`xpipe.tensor.rules.tensor_splits`).

    Raises:
        ValueError: naming ``tensor_rules`` where no rule covers a weight and the
            graph cannot tell (``read_from_graph`` raised :class:`CannotInfer`), or
            ``tensor`` where it does not divide a split dim.
    """
    rules = with_shared_key_values(rules, key_value_heads, tensor)
    if tensor == 1:
        return tensor_splits(names, shapes, tensor, rules)
    try:
        inferred = read_from_graph()
    except CannotInfer as reason:
        missing = unruled(names, rules)
        if missing:
            raise ValueError(unruled_message(tensor, missing, f", and the block's graph does not tell: {reason}")
                             ) from None
        inferred = {}
    return tensor_splits(names, shapes, tensor, rules, inferred)
