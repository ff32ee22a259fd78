"""Capacities for the replay: a token count, bytes with a unit (for a model and topology), or a
percentage of the trace's unique prompt pages."""

from __future__ import annotations

import re

from ..errors import ConfigError

UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40,
         "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*|%)\s*$")


def parse_size(text: str, flag: str, *, bytes_per_token: float | None,
               unique_tokens: int) -> int:
    """Tokens a capacity ``text`` names: ``N`` tokens, ``N<unit>`` bytes (KB..TB; needs
    ``bytes_per_token``, from ``--model``), or ``N%`` of ``unique_tokens``. 0 turns a tier off.
    ConfigError naming ``flag`` otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{flag} {text!r}: expected a token count, bytes with a unit "
                          f"(KB, MB, GB, TB) or a percentage of the trace's unique pages")
    value, unit = float(m.group(1)), m.group(2).upper()
    if unit == "%":
        if value > 100:
            raise ConfigError(f"{flag} {text!r}: a percentage is at most 100")
        return int(unique_tokens * value / 100)
    if not unit:
        if value != int(value):
            raise ConfigError(f"{flag} {text!r}: a token count is a whole number")
        return int(value)
    if unit not in UNITS:
        raise ConfigError(f"{flag} {text!r}: unknown unit {m.group(2)!r} (use KB, MB, GB, TB)")
    if bytes_per_token is None:
        raise ConfigError(f"{flag} {text!r}: a size in bytes needs --model (bytes per token)")
    return int(value * UNITS[unit] // bytes_per_token)


def parse_sizes(text: str, flag: str, **kw) -> list[int]:
    """A comma-separated list of ``parse_size`` capacities (at least one)."""
    parts = [t for t in str(text).split(",") if t.strip()]
    if not parts:
        raise ConfigError(f"{flag}: give at least one size")
    return [parse_size(t, flag, **kw) for t in parts]
