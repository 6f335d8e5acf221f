"""Argument checks shared by the public entry points."""


def check_positive_int(value: object, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= 1 (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
