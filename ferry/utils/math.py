"""Integer arithmetic."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers."""
    return -(-a // b)
