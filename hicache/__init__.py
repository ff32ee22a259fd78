"""hicache: a hierarchical KV cache (device L1, host L2, LMDB L3) for MLA serving engines that
run decode context parallelism. ``HiCache`` is what one engine rank embeds.

The names below load on first use (PEP 562), so importing one part (``hicache.controller``,
``hicache.pages``, a tier) loads only what that part imports: ``tests/test_layering.py`` checks
the layering in a fresh interpreter.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"ConfigError": "errors", "HiCacheConfig": "config", "load_config": "config",
            "CACHE_MODES": "service", "HiCache": "service", "HiCacheError": "errors",
            "Prefix": "service"}

__all__ = sorted(_EXPORTS, key=str.lower)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
