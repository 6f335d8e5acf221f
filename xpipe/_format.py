"""Number formatting shared by the printed partition and the visualiser."""


def human(value: float) -> str:
    """``1234567`` -> ``"1.235M"``: four significant digits and an SI prefix."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(value) < 1000:
            return f"{value:.4g}{unit}"
        value /= 1000
    return f"{value:.4g}P"
