"""L3: a page store of rank shards behind one interface (:class:`L3Store`), opened with
:func:`open_store` on any backend in :mod:`hicache.l3.registry` (LMDB embedded, Redis / Valkey
shared, or one a module registers); async writer, prefetcher, cost model.

Names are imported on first use, so ``import hicache.l3`` (or any of its light modules) loads no
backend: neither ``lmdb`` nor ``redis`` is imported until a store of that backend is used."""

from __future__ import annotations

import importlib

_WHERE = {
    "open_store": "backends", "resolve": "backends",
    "L3Stats": "base", "L3Store": "base", "Out": "base", "PutResult": "base",
    "min_across_ranks": "agree", "restore_length": "agree", "restore_lengths": "agree",
    "CostModel": "cost",
    "FORMAT_VERSION": "keys", "Namespace": "keys", "chain_hashes": "keys",
    "keys_for_rank": "keys", "make_key": "keys", "page_keys": "keys",
    "PREFETCH_POLICIES": "prefetch", "AsyncWriter": "prefetch", "PrefetchHandle": "prefetch",
    "PrefetchPolicy": "prefetch", "Prefetcher": "prefetch", "agree_prefetch": "prefetch",
    "prefetch_signals": "prefetch",
    "RedisStore": "redis_store",
    "PageStore": "store", "replica_of": "placement", "should_write": "placement",
    "store_replica": "placement",
}

__all__ = ["BACKENDS", *_WHERE]


def __getattr__(name: str):
    if name == "BACKENDS":
        from .registry import names
        return names()
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'hicache.l3' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value
