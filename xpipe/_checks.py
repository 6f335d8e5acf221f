"""Argument checks shared by the public entry points."""

import operator


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int if it is a whole number >= 1 (numpy integers included, bools
    not); otherwise raise ``ValueError`` naming ``name``."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or number < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return number


def check_optimizer_states(optimizer_states: object) -> int:
    """``optimizer_states`` (tensors an optimizer keeps per weight) if it is a whole
    number >= 0; otherwise raise ``ValueError`` naming it."""
    if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"optimizer_states: the tensors the optimizer keeps per weight, a whole number >= 0 "
                         f"(AdamW 2, SGD with momentum 1, plain SGD 0), got {optimizer_states!r}")
    return optimizer_states


GATHERS = ("step", "block")  # when the spmd executor gathers the body's weights: once per step, or per block slot


def check_gather(gather: object, checkpoint: str | None = None) -> str:
    """``gather`` if it is one of :data:`GATHERS` (and, given the Pipe's ``checkpoint``,
    one it allows); otherwise raise ``ValueError`` naming it and the way out."""
    if gather not in GATHERS:
        raise ValueError(f"gather: {gather!r} is not a choice; use one of {', '.join(map(repr, GATHERS))}")
    if gather == "block" and checkpoint not in (None, "always"):
        raise ValueError(f"gather: 'block' lets go of each block's gathered weights after the block runs, so its "
                         f"backward gathers them again and recomputes the block; pass checkpoint='always' with it "
                         f"(got checkpoint={checkpoint!r}), or gather='step'")
    return gather
