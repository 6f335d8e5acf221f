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
