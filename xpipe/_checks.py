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
