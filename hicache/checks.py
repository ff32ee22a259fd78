"""The one argument check the boundaries share (policy file, public constructors, trace files).

``check_int(value, name, lo=1, hi=None, error=ValueError)``: ``value`` when it is an int (never a
bool, which Python counts as one) in ``[lo, hi]``; otherwise ``error`` with one line naming
``name``, the range and what was given. Internal code trusts what a boundary checked.
"""

from __future__ import annotations

from typing import Any


def int_range(lo: int = 1, hi: int | None = None) -> str:
    """How an int range reads in an error: "a positive int", "a non-negative int", "an int >= 2",
    "an int in [a, b]"."""
    if hi is not None:
        return f"an int in [{lo}, {hi}]"
    return {0: "a non-negative int", 1: "a positive int"}.get(lo, f"an int >= {lo}")


def check_int(value: Any, name: str, lo: int = 1, hi: int | None = None,
              error: type[Exception] = ValueError) -> int:
    """``value`` if it is an int (not a bool) with ``lo <= value <= hi``; else raise ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo \
            or (hi is not None and value > hi):
        raise error(f"{name} must be {int_range(lo, hi)}, got {value!r:.40}")
    return value
