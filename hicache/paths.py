"""Where hicache finds its files outside the code: the default policy file, the user cache.

Imports nothing from hicache (any layer may use it)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def default_policy() -> Path:
    """The example policy: ``hicache/policy.toml`` in an installed wheel (copied there from
    examples/policy.toml at build time), else examples/policy.toml of a source checkout."""
    shipped = PACKAGE / "policy.toml"
    return shipped if shipped.is_file() else PACKAGE.parent / "examples" / "policy.toml"


def cache_dir() -> Path:
    """hicache's user cache directory: ``$HICACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hicache``,
    else ``~/.cache/hicache``. Never a model directory (which may be read-only or shared)."""
    env = os.environ.get("HICACHE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) \
        else Path.home() / ".cache"
    return base / "hicache"
