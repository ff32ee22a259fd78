"""``GuardedStore``: an L3 store whose failures end L3 for this rank, never the run.

Backends answer an unavailable store as misses (``L3Store`` contract) and the LMDB backend drops a
write whose commit fails on a full disk (counted in ``stats.errors``; reads go on). Anything a
store still raises (a damaged LMDB store found at open or while reading, a crash of the optional
check in a child process, an unexpected backend error) disables L3 on this rank: it says so once
(a warning on the ``hicache`` logger), counts it (``failures``), and from then on finds nothing,
serves nothing and stores nothing. Ranks stay in agreement: whether a request waits on L3
depends only on replicated facts, and what a rank found is MIN-agreed, so a rank without L3
(reporting 0 pages) makes every rank recompute those pages. A path holding another application's
LMDB environment is refused (``L3ForeignError`` propagates).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import lmdb
import torch

from . import lmdb_check
from .base import L3Stats, L3Store, Out, PutResult
from ..errors import L3Error, L3ForeignError

log = logging.getLogger("hicache")


class GuardedStore:
    """Wraps the store ``open_store()`` returns; ``where`` is the policy's ``[l3]`` section
    (its ``check_on_open`` runs the LMDB walk in a child process first)."""

    def __init__(self, open_store: Callable[[], L3Store], where: Any, rank: int,
                 namespace) -> None:
        self.rank, self.namespace = rank, namespace
        lmdb_backend = getattr(where, "backend", "lmdb") == "lmdb"
        self.where = getattr(where, "path", where) if lmdb_backend else getattr(where, "url", "")
        self.page_bytes = namespace.shard_bytes
        # the bound on one store call (``[l3] timeout_s``): how long a cancelled read may take
        self.timeout_s: float | None = getattr(where, "timeout_s", None)
        self.failure: str | None = None   # why L3 is off on this rank
        self.failures = 0                 # store errors seen (the first one disables L3)
        self._lock = threading.Lock()
        self._store: L3Store | None = None
        self._dead: L3Store | None = None  # the store that failed, closed at close()
        self._last = L3Stats()
        if lmdb_backend and getattr(where, "check_on_open", False):
            report = lmdb_check.check_in_child(str(self.where))
            if report.get("foreign"):
                raise L3ForeignError(report["error"])
            if not report.get("ok"):
                self._fail(report.get("error") or f"{report.get('bad_values')} damaged values")
                return
        try:
            self._store = open_store()
        except L3ForeignError:
            raise
        except (L3Error, lmdb.Error, OSError) as e:
            self._fail(e)

    # ---- failure ---------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.failure is not None

    def _fail(self, e) -> None:
        with self._lock:
            self.failures += 1
            if self.failure is not None:
                return
            self.failure = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
            store, self._store = self._store, None
        log.warning("hicache: rank %d: L3 store %s failed (%s); continuing without L3 "
                    "(`hicache l3 check PATH` reports and quarantines an LMDB store)",
                    self.rank, self.where, self.failure)
        if store is not None:  # closed in close(): a prefetch thread may still be inside it
            self._last = store.stats
            self._dead = store

    def _call(self, name: str, default, *args):
        store = self._store
        if store is None:
            return default
        try:
            return getattr(store, name)(*args)
        except (L3Error, lmdb.Error, OSError) as e:
            if self._store is store:
                self._fail(e)
            else:  # failed meanwhile (another thread): one more error, same verdict
                with self._lock:
                    self.failures += 1
            return default

    # ---- the L3Store surface the service, the writer and the prefetcher use ------------------
    def check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        store = self._store
        return store.check_keys(keys) if store is not None else [bytes(k) for k in keys]

    def check_tensor(self, t: torch.Tensor, what: str) -> None:
        store = self._store
        if store is not None:
            store.check_tensor(t, what)

    _check_keys = check_keys
    _check_tensor = check_tensor

    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> PutResult:
        return self._call("put", PutResult((False,) * len(keys)), keys, shards)

    def get(self, keys: Sequence[bytes], out: Out) -> int:
        return self._call("get", 0, keys, out)

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        return self._call("exists_prefix", 0, keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._call("delete", 0, keys)

    @property
    def stats(self) -> L3Stats:
        store = self._store
        return store.stats if store is not None else self._last

    def close(self) -> None:
        """Close the store (after the writer and the prefetcher stopped using it)."""
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except (L3Error, lmdb.Error, OSError) as e:
                self._store = store
                self._fail(e)
        dead, self._dead = self._dead, None
        if dead is not None:
            try:  # a failed store: release it without flushing anything into it
                if hasattr(dead, "_pending_touch"):
                    dead._pending_touch, dead._pending_count = [], 0
                dead.close()
            except Exception:
                pass
