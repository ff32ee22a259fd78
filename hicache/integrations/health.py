"""L3 health as the engine adapters report it (pure bookkeeping; imports no engine).

Each adapter keeps one :class:`Health` over its stores. ``take()`` returns what happened since
the last call (a :class:`HealthDelta`): pages hit and missed, bytes and seconds read and written,
and failures by reason, which the adapter hands to its engine's own stats path (vLLM's offloading
stats, SGLang's storage-backend stats). The store counts failures in ``stats.errors`` /
``stats.corrupt`` and keeps the last exception in ``last_error`` (Redis); the reason of each new
failure is read from that exception (:func:`error_reason`).
"""

from __future__ import annotations

import errno
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

REASONS = ("timeout", "refused", "auth", "corrupt", "other")


def error_reason(err: BaseException | None) -> str:
    """One of :data:`REASONS` for a store failure: ``timeout`` (no answer in time), ``auth``
    (the server refused our credentials), ``refused`` (unreachable: connection refused, reset or
    closed, no such socket), else ``other``. (``corrupt`` is counted apart, from the store's
    checksum rejections.)"""
    if err is None:
        return "other"
    names = {c.__name__ for c in type(err).__mro__}
    text = str(err)
    if names & {"TimeoutError", "timeout"} or "timed out" in text.lower():
        return "timeout"
    if names & {"AuthenticationError", "AuthenticationWrongNumberOfArgsError",
                "AuthorizationError", "NoPermissionError"} or any(
                    w in text for w in ("NOAUTH", "WRONGPASS", "NOPERM")):
        return "auth"
    if names & {"ConnectionError", "OSError", "BusyLoadingError", "ClusterDownError",
                "ClusterError"} or getattr(err, "errno", None) in (errno.ECONNREFUSED,
                                                                    errno.ENOENT):
        return "refused"
    return "other"


@dataclass(frozen=True)
class HealthDelta:
    """What the stores did since the previous ``take()``."""

    hits: int = 0  # pages served
    misses: int = 0  # lookups / gets answered as a miss (pages)
    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    pages_written: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # reason -> count (nonzero only)

    @property
    def empty(self) -> bool:
        return not (self.hits or self.misses or self.bytes_read or self.bytes_written
                    or self.pages_written or self.errors)


class Health:
    """Accumulates per-page outcomes the adapter sees and the stores' own counters."""

    _FIELDS = ("bytes_read", "bytes_written", "read_s", "write_s", "pages_written")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._seen: dict[int, dict[str, Any]] = {}  # id(store) -> last counters read
        self._acc = {f: 0 for f in self._FIELDS}
        self._errors: dict[str, int] = {}

    def outcome(self, hits: int = 0, misses: int = 0) -> None:
        """Pages answered as hits / misses by a lookup or a load."""
        with self._lock:
            self._hits += int(hits)
            self._misses += int(misses)

    def error(self, reason: str, n: int = 1) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown L3 failure reason {reason!r}; one of {REASONS}")
        with self._lock:
            self._errors[reason] = self._errors.get(reason, 0) + int(n)

    def poll(self, stores: Iterable[Any]) -> None:
        """Fold the stores' counters since the last poll into the pending delta."""
        for s in stores:
            st = s.stats
            now = {f: getattr(st, f) for f in self._FIELDS}
            now["errors"], now["corrupt"] = st.errors, st.corrupt
            with self._lock:
                last = self._seen.get(id(s))
                self._seen[id(s)] = now
                if last is None:
                    last = {k: 0 for k in now}
                for f in self._FIELDS:
                    self._acc[f] += now[f] - last[f]
                new_err = now["errors"] - last["errors"]
                new_corrupt = now["corrupt"] - last["corrupt"]
                if new_err > 0:
                    r = error_reason(getattr(s, "last_error", None))
                    self._errors[r] = self._errors.get(r, 0) + new_err
                if new_corrupt > 0:
                    self._errors["corrupt"] = self._errors.get("corrupt", 0) + new_corrupt

    def take(self, stores: Iterable[Any] = ()) -> HealthDelta:
        """Poll ``stores`` and return (and reset) everything since the previous take."""
        self.poll(stores)
        with self._lock:
            d = HealthDelta(hits=self._hits, misses=self._misses,
                            errors={k: v for k, v in self._errors.items() if v},
                            **{f: self._acc[f] for f in self._FIELDS})
            self._hits = self._misses = 0
            self._acc = {f: 0 for f in self._FIELDS}
            self._errors = {}
        return d
