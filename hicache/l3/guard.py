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

import torch

from .backends import resolve
from .registry import scrub
from .base import L3Stats, L3Store, Out, PutResult
from ..errors import L3Error, L3ForeignError

log = logging.getLogger("hicache")


class GuardedStore:
    """Wraps the store ``open_store()`` returns; ``where`` is what it was opened on (the
    policy's ``[l3]`` section, a URL or a path): its backend (``hicache.l3.registry``) says which
    exceptions mean the store failed, what they mean, and what runs before opening (LMDB's
    ``check_on_open`` walk in a child process)."""

    def __init__(self, open_store: Callable[[], L3Store], where: Any, rank: int,
                 namespace) -> None:
        self.rank, self.namespace = rank, namespace
        self.backend, section = resolve(where)
        self.where = self.backend.describe(section)  # one line, no password
        self.page_bytes = namespace.shard_bytes
        # the bound on one store call (``[l3.<backend>] timeout_s``): how long a cancelled read
        # may take
        self.timeout_s: float | None = getattr(section, "timeout_s", None)
        self.failure: str | None = None   # why L3 is off on this rank
        self.failure_kind: str | None = None  # what it means (registry.KINDS)
        self.failures = 0                 # store errors seen (the first one disables L3)
        self._lock = threading.Lock()
        self._store: L3Store | None = None
        self._dead: L3Store | None = None  # the store that failed, closed at close()
        self._last = L3Stats()
        self._errors: tuple = (L3Error, OSError)
        try:
            self._errors = tuple(self.backend.errors())
            reason = self.backend.before_open(section) if self.backend.before_open else None
        except L3ForeignError:
            raise
        except (ImportError, L3Error, OSError) as e:  # the backend's package is missing
            self._fail(e)
            return
        if reason is not None:
            self._fail(reason)
            return
        try:
            self._store = open_store()
        except L3ForeignError:
            raise
        except self._errors as e:
            self._fail(e)

    # ---- failure ---------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def first_error(self) -> str | None:
        """The first thing that went wrong with L3 on this rank (what ended it, or the first
        call the store answered as a miss because it was unavailable); no password."""
        if self.failure is not None:
            return self.failure
        e = getattr(self._store, "first_error", None) if self._store is not None else None
        return scrub(f"{type(e).__name__}: {e}") if e is not None else None

    def _fail(self, e) -> None:
        with self._lock:
            self.failures += 1
            if self.failure is not None:
                return
            self.failure = scrub(f"{type(e).__name__}: {e}" if isinstance(e, BaseException)
                                 else str(e))
            self.failure_kind = (self.backend.classify(e) if isinstance(e, BaseException)
                                 else "corrupt")
            store, self._store = self._store, None
        log.warning("hicache: rank %d: L3 store %s failed (%s); continuing without L3 "
                    "(`hicache l3 check` reports on a store)",
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
        except self._errors as e:
            if self._store is store:
                self._fail(e)
            else:  # failed meanwhile (another thread): one more error, same verdict
                with self._lock:
                    self.failures += 1
            return default

    def failure_reasons(self) -> dict[str, int]:
        """This rank's L3 failures by reason (``registry.KINDS``), one count per event: values
        rejected (``auth`` when their MAC failed, else ``corrupt``), calls that found the store
        unavailable (by what the backend says each error meant; ``other`` where it does not
        say), and store errors raised here (the kind of the first, which turned L3 off)."""
        from .registry import KINDS
        out = dict.fromkeys(KINDS, 0)
        st = self.stats
        out["auth"] += st.auth_failures
        out["corrupt"] += max(st.corrupt - st.auth_failures, 0)
        store = self._store if self._store is not None else self._dead
        by = dict(getattr(store, "error_reasons", None) or {}) if store is not None else {}
        for k, v in by.items():
            out[k if k in out else "other"] += v
        out["other"] += max(st.errors - sum(by.values()), 0)
        if self.failures:
            out[self.failure_kind if self.failure_kind in out else "other"] += self.failures
        return out

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
            except self._errors as e:
                self._store = store
                self._fail(e)
        dead, self._dead = self._dead, None
        if dead is not None:
            try:  # a failed store: release it without flushing anything into it
                dead.abandon()
            except Exception:
                pass
