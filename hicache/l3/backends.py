"""``open_store``: one entry point to every L3 backend (LMDB embedded, Redis / Valkey remote)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from .base import L3Store
from .keys import Namespace
from ..errors import L3Error

BACKENDS = ("lmdb", "redis")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
DEFAULT_CAPACITY = 1 << 30


def open_store(where: Any, namespace: Namespace, rank: int, *, writer: bool = True,
               capacity_bytes: int | None = None, timeout_s: float | None = None,
               **options) -> L3Store:
    """Open this rank's L3 page store.

    ``where`` is one of:
      - an ``[l3]`` policy section (``HiCacheConfig.l3``): its ``backend`` picks LMDB (``path``,
        ``size_bytes``) or Redis (``url``, ``timeout_s``);
      - a Redis URL, ``redis://host:port/db``, ``rediss://...`` or ``unix:///path.sock``;
      - a list of ``redis://host:port`` URLs: Redis Cluster startup nodes;
      - a directory path: an LMDB environment (shared by every rank of the node).
    ``options`` go to the backend (:class:`PageStore` or :class:`RedisStore`).
    """
    backend = getattr(where, "backend", None)
    if backend is not None:  # a policy section
        if backend == "redis":
            return _redis(where.url, namespace, rank, writer,
                          timeout_s if timeout_s is not None else where.timeout_s, options)
        if backend == "lmdb":
            return _lmdb(where.path, namespace, rank, writer,
                         capacity_bytes or where.size_bytes, options)
        raise L3Error(f"unknown L3 backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if isinstance(where, (list, tuple)) or (isinstance(where, str)
                                            and where.startswith(REDIS_SCHEMES)):
        return _redis(where, namespace, rank, writer, timeout_s, options)
    if isinstance(where, (str, os.PathLike)):
        return _lmdb(where, namespace, rank, writer, capacity_bytes or DEFAULT_CAPACITY, options)
    raise L3Error(f"cannot open an L3 store on {where!r}: give a policy [l3] section, a Redis "
                  "URL, a list of cluster node URLs or an LMDB directory")


def _redis(url: str | Sequence[str], namespace, rank, writer, timeout_s, options) -> L3Store:
    from .redis_store import RedisStore
    if timeout_s is not None:
        options["timeout_s"] = timeout_s
    return RedisStore(url, namespace, rank, writer=writer, **options)


def _lmdb(path, namespace, rank, writer, capacity_bytes, options) -> L3Store:
    from .store import PageStore
    return PageStore(path, namespace, rank, capacity_bytes, writer=writer, **options)
