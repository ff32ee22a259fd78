"""Background L3 traffic: an asynchronous writer (L2 -> L3) and a prefetcher (L3 -> host pages).

AsyncWriter: ``submit(keys, shards)`` queues pages; one thread merges queued submissions into
batched ``put`` calls of any :class:`L3Store` (few transactions). The caller keeps the shard tensors alive and
unchanged until the returned future is done (e.g. keeps the host pages locked). ``close`` flushes.

Prefetcher: ``start(request_id, keys, out)`` reads, in a thread, the stored prefix of ``keys``
into the reserved host buffers ``out``. What the engine may use is decided by the policy:
    best_effort    use whatever is loaded when the request is scheduled
    wait_complete  wait until the read finished
    timeout        wait until it finished or ``timeout_s + timeout_per_1k_s * tokens/1000`` passed
A prefix shorter than ``min_tokens`` is not prefetched at all. Ranks agree on what to use with
:func:`agree_prefetch` (MIN of loaded pages, all ranks ready) before any rank uses a page.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from .. import minvec
from ..config import PREFETCH_POLICIES, PolicySection
from .agree import min_across_ranks
from .base import L3Store, Out
from ..errors import L3Error

_POLICY = PolicySection()  # the policy file's defaults: the only ones
_STORE_CALL_S = 2.0  # the bound on one call of a store that has none of its own (LMDB)


@dataclass(frozen=True)
class PrefetchPolicy:
    """The ``[policy]`` prefetch keys (``prefetch``, ``prefetch_timeout_s``, ...), same defaults."""

    mode: str = _POLICY.prefetch
    timeout_s: float = _POLICY.prefetch_timeout_s
    timeout_per_1k_s: float = _POLICY.prefetch_timeout_per_1k_s
    min_tokens: int = _POLICY.prefetch_min_tokens

    def __post_init__(self) -> None:
        if self.mode not in PREFETCH_POLICIES:
            raise L3Error(f"prefetch policy {self.mode!r} is not one of {PREFETCH_POLICIES}")
        if self.timeout_s < 0 or self.timeout_per_1k_s < 0 or self.min_tokens < 0:
            raise L3Error("prefetch timeout_s, timeout_per_1k_s and min_tokens must be >= 0")

    def deadline_s(self, tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``tokens`` may take."""
        return self.timeout_s + self.timeout_per_1k_s * tokens / 1000.0


# ---- writer ----------------------------------------------------------------------------------
class AsyncWriter:
    """One background thread writing queued pages to a store in batched ``put`` calls."""

    def __init__(self, store: L3Store, batch_pages: int = 64,
                 max_pending_pages: int = 4096) -> None:
        if batch_pages < 1 or max_pending_pages < 1:
            raise L3Error("batch_pages and max_pending_pages must be >= 1")
        self.store = store
        self.batch_pages = batch_pages
        self._room = threading.BoundedSemaphore(max_pending_pages)
        self._max_pending = max_pending_pages
        self._q: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hicache-l3-writer", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The background write error not yet raised by ``flush`` (a non-blocking look)."""
        return self._error

    @property
    def pending_pages(self) -> int:
        with self._cv:
            return self._pending

    def submit(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> Future:
        """Queue pages. The future resolves once the store handled them, with a tuple of bools
        (stored or not: dropped for capacity, or the store was unavailable); then the shards
        may be reused. Blocks while ``max_pending_pages`` pages wait."""
        if self._closed:
            raise L3Error("AsyncWriter is closed")
        if len(keys) != len(shards):
            raise L3Error(f"submit got {len(keys)} keys but {len(shards)} shards")
        if len(keys) > self._max_pending:
            raise L3Error(f"a submission of {len(keys)} pages exceeds max_pending_pages "
                          f"{self._max_pending}")
        keys = self.store.check_keys(keys)  # bad input fails here, not in a merged batch
        for i, t in enumerate(shards):
            self.store.check_tensor(t, f"shard {i}")
        fut: Future = Future()
        for _ in keys:
            self._room.acquire()
        with self._cv:
            self._pending += len(keys)
        self._q.put((list(keys), list(shards), fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            jobs = [item]
            n = len(item[0])
            stop = False
            while n < self.batch_pages:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
                n += len(nxt[0])
            keys = [k for j in jobs for k in j[0]]
            shards = [s for j in jobs for s in j[1]]
            try:
                stored = self.store.put(keys, shards).stored
                at = 0
                for j in jobs:  # each future: which of its pages are stored
                    j[2].set_result(stored[at:at + len(j[0])])
                    at += len(j[0])
            except BaseException as e:  # surfaced on flush/close and on each future
                self._error = e
                for j in jobs:
                    if not j[2].done():
                        j[2].set_exception(e)
            finally:
                for _ in keys:
                    self._room.release()
                with self._cv:
                    self._pending -= len(keys)
                    self._cv.notify_all()
            if stop:
                return

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted page is written; re-raise a writer error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"L3 writer still has {self._pending} pages pending")
                self._cv.wait(left)
        if self._error is not None:
            err, self._error = self._error, None
            raise L3Error(f"L3 background write failed: {err!r}") from err

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._q.put(None)
            self._thread.join()


# ---- prefetcher ------------------------------------------------------------------------------
class PrefetchHandle:
    """Progress of one request's prefetch. ``pages_done`` only grows; pages below it are valid."""

    def __init__(self, request_id, keys: list[bytes], page_tokens: int,
                 policy: PrefetchPolicy, stop_timeout_s: float = _STORE_CALL_S) -> None:
        self.request_id = request_id
        self.stop_timeout_s = stop_timeout_s  # how long ``cancel(wait=True)`` waits at most
        self.keys = keys
        self.page_tokens = page_tokens
        self.policy = policy
        self.started = time.monotonic()
        self.deadline = self.started + policy.deadline_s(len(keys) * page_tokens)
        self.pages_done = 0
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def tokens_done(self) -> int:
        return self.pages_done * self.page_tokens

    def usable_pages(self) -> int:
        """Loaded pages, or 0 while they are fewer than the policy's ``min_tokens``."""
        pages = self.pages_done
        return pages if pages * self.page_tokens >= self.policy.min_tokens else 0

    def is_ready(self, now: float | None = None) -> bool:
        """Local readiness under the policy (agree across ranks before acting on it)."""
        if self.policy.mode == "best_effort" or self.finished:
            return True
        if self.policy.mode == "wait_complete":
            return False
        return (time.monotonic() if now is None else now) >= self.deadline

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the read finished (or ``timeout``); True when finished."""
        return self._finished.wait(timeout)

    def cancel(self, wait: bool = True, timeout: float | None = None) -> int:
        """Stop reading; returns the pages loaded (valid prefix). With ``wait`` the buffers are
        no longer written on return: the reader stops at its next chunk, one store call away,
        which is waited for at most ``timeout`` s (default ``stop_timeout_s``); a read still in
        the store then raises ``L3Error`` (its buffers may still be written: drop them)."""
        self._cancel.set()
        if wait:
            limit = self.stop_timeout_s if timeout is None else timeout
            if not self._finished.wait(limit):
                raise L3Error(f"the L3 prefetch of request {self.request_id!r} did not stop "
                              f"within {limit:g} s of its cancel: a store read is stuck (its "
                              "buffers may still be written; drop them)")
        return self.pages_done


class Prefetcher:
    """Reads stored prefixes into reserved host buffers on worker threads."""

    def __init__(self, store: L3Store, policy: PrefetchPolicy | None = None,
                 chunk_pages: int = 8, num_threads: int = 1,
                 stop_timeout_s: float | None = None) -> None:
        if chunk_pages < 1 or num_threads < 1:
            raise L3Error("chunk_pages and num_threads must be >= 1")
        if stop_timeout_s is not None and not 0 <= stop_timeout_s < float("inf"):
            raise L3Error(f"stop_timeout_s must be finite and >= 0, got {stop_timeout_s}")
        self.store = store
        self.policy = policy or PrefetchPolicy()
        self.chunk_pages = chunk_pages
        self.page_tokens = store.namespace.page_tokens
        # a cancelled read stops after the chunk in the store: one call, which the store bounds
        # (its ``timeout_s``: redis), given what the timeout policy allows a chunk on top
        if stop_timeout_s is None:
            call = getattr(store, "timeout_s", None) or _STORE_CALL_S
            stop_timeout_s = call + self.policy.deadline_s(chunk_pages * self.page_tokens)
        self.stop_timeout_s = float(stop_timeout_s)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="hicache-l3-prefetch")
        self._live: set[PrefetchHandle] = set()
        self._lock = threading.Lock()

    def start(self, request_id, keys: Sequence[bytes], out: Out) -> PrefetchHandle:
        """Begin reading ``keys`` (this rank's keys of the pages after the L1/L2 hit) into
        ``out``: a list of reserved [L, P, D] host tensors or ``out(i)`` giving page i's."""
        keys = self.store.check_keys(keys)
        if not callable(out) and len(out) < len(keys):
            raise L3Error(f"prefetch of {len(keys)} pages got only {len(out)} buffers")
        h = PrefetchHandle(request_id, keys, self.page_tokens, self.policy, self.stop_timeout_s)
        if len(keys) * self.page_tokens < self.policy.min_tokens or not keys:
            h._finished.set()  # too short to be worth a read: nothing prefetched
            return h
        with self._lock:
            self._live.add(h)
        self._pool.submit(self._read, h, out)
        return h

    def _read(self, h: PrefetchHandle, out: Out) -> None:
        try:
            total = len(h.keys)
            i = 0
            while i < total and not h._cancel.is_set():
                j = min(i + self.chunk_pages, total)
                dst = (lambda k, i=i: out(i + k)) if callable(out) else list(out[i:j])
                got = self.store.get(h.keys[i:j], dst)
                h.pages_done = i + got
                if got < j - i:
                    break
                i = j
        except BaseException as e:  # a failed read is a shorter hit, never a crash
            h.error = e
        finally:
            h._finished.set()
            with self._lock:
                self._live.discard(h)

    def close(self) -> None:
        with self._lock:
            live = list(self._live)
        for h in live:
            h.cancel(wait=False)
        self._pool.shutdown(wait=True)


def agree_prefetch(handles: Sequence[PrefetchHandle], group=None,
                   agreed: Sequence[int] | None = None) -> list[tuple[bool, int]]:
    """Per handle ``(ready, pages)``: ready when every rank is ready under the policy; pages =
    MIN over ranks of loaded pages (usable only once ready). One all-reduce for all handles;
    ``agreed`` = the MIN-reduced output of :func:`prefetch_signals` from a shared collective."""
    if agreed is None:
        agreed = min_across_ranks(prefetch_signals(handles), group, kind=minvec.PREFETCH)
    if len(agreed) != 2 * len(handles):
        raise L3Error(f"{len(agreed)} agreed values for {len(handles)} prefetches (need 2 each)")
    return [(bool(agreed[2 * i]), int(agreed[2 * i + 1])) for i in range(len(handles))]


def prefetch_signals(handles: Sequence[PrefetchHandle]) -> list[int]:
    """The ints each rank contributes (MIN-reduced): ``[ready, pages_done]`` per handle."""
    out: list[int] = []
    for h in handles:
        ready = h.is_ready()  # before sampling pages: a finished read reports its final count
        out += [int(ready), h.usable_pages()]
    return out
