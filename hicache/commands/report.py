"""Readable tables for the command line (the same rows go out as JSON for machines)."""

from __future__ import annotations

from typing import Any, Sequence


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e6 or abs(value) < 1e-3:
            return f"{value:.3g}"
        return f"{value:,.3f}".rstrip("0").rstrip(".")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]

    def line(r):
        return "  ".join((c.rjust(w) if num else c.ljust(w)) for c, w, num in
                         zip(r, widths, numeric)).rstrip()
    lines = [line(r) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def safe_cell(text: Any, limit: int = 200) -> str:
    """A value someone else wrote (a store's namespace record), fit for a terminal: every
    non-printable character escaped (``\\x1b``, ``\\u202e``: no escape sequence reaches the
    screen), cut to ``limit`` characters with a note of the full length."""
    text = str(text)
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in text[:limit * 4])
    if len(out) > limit or len(text) > limit * 4:
        out = f"{out[:limit - 1]}… ({len(text)} chars)"
    return out
