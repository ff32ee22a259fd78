"""PageStore: one LMDB environment per node holding every rank's shard of widened pages.

Several processes (the ranks on one node) open the same path; LMDB serialises their write
transactions, so shared bookkeeping (bytes used, the LRU clock) lives in the environment itself.

Sub-databases of the environment:
    data   key -> raw shard bytes ([L, P, D] of this rank, C order)
    head   key -> msgpack header {v, ns, rank, shape, dtype, n, xxh}; xxh = XXH3-64 of the data
           seeded with a hash of the key (8 B), so a value copied under another key fails
    atime  key -> 8-byte stamp of the last access
    lru    stamp (8 B big endian) | key -> b""   (ordered: the oldest first)
    meta   b"used" -> bytes held (data + head), b"clock" -> last stamp issued,
           b"ns:" | namespace digest -> the namespace's record (``hicache l3 ls``)

A value whose header or checksum does not match is a counted miss: it is deleted (when this
process is a writer) and never served. The header of a valid value is byte-for-byte the one this
store would write, so a get checks it with one comparison and hashes the data once (XXH3-64 runs
well above memcpy speed), then copies it once from the LMDB map into the caller's tensor.
Capacity is in bytes for the whole environment; writes evict the least recently used pages
first (within one batch, deeper pages before their prefixes).
A full map is handled by evicting more, then growing the map, then dropping the write.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import lmdb
import numpy as np
import torch

from .base import checksum as _checksum  # noqa: F401 (tests reach it here)
from .base import (SUM_BYTES as _SUM, L3Stats, L3Store, Out, PutResult,
                   copy_into)
from . import lmdb_check
from .placement import replica_of, should_write, store_replica  # noqa: F401 (re-exported)
from .keys import Namespace
from ..errors import L3CorruptError, L3Error, L3ForeignError

__all__ = ["PageStore", "L3Stats", "Out", "PutResult", "should_write", "replica_of"]

_U64 = 8


_FULL = object()  # a write transaction that filled the map


class _Gate:
    """Shared/exclusive gate: transactions share it; a map resize takes it alone."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cv:
            while self._exclusive:
                self._cv.wait()
            self._exclusive = True
            while self._active:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive = False
                self._cv.notify_all()


def _write_failure(e: BaseException) -> bool:
    """A failed write transaction that leaves the environment readable: a full or failing
    disk (``mdb_txn_commit: Input/output error``, ENOSPC, EFBIG, EDQUOT)."""
    if isinstance(e, (lmdb.DiskError, lmdb.TxnFullError)):
        return True
    return type(e) is lmdb.Error and any(w in str(e) for w in (
        "Input/output error", "No space left", "File too large", "Disk quota"))


def _u64(b) -> int:
    return int.from_bytes(bytes(b), "big") if b is not None else 0


def _dedupe(keys: list[bytes]) -> list[bytes]:
    return list(dict.fromkeys(keys))


def _b64(v: int) -> bytes:
    return int(v).to_bytes(_U64, "big")


class _Env:
    """One LMDB environment per path in a process, shared by every PageStore opened on it
    (LMDB allows one open per path per process): its handle, sub-databases, resize gate and
    map size. The first opener's map settings win; the last close closes it."""

    def __init__(self, path: str, map_size: int, max_map_size: int, writer: bool,
                 sync: bool) -> None:
        self.path, self.writer = path, writer
        self.map_size, self.max_map_size = map_size, max_map_size
        try:  # before mapping: a file shorter than its last page would SIGBUS the reader
            lmdb_check.precheck(path)
        except L3CorruptError as e:
            raise L3CorruptError(f"L3 store {path!r} is damaged: {e}; see `hicache l3 check "
                                 f"{path}`") from None
        try:
            self.env = lmdb.open(path, map_size=map_size, max_dbs=8, subdir=True,
                                 readonly=not writer, sync=sync, metasync=sync,
                                 readahead=False, meminit=False, max_readers=512, lock=True)
        except lmdb.Error as e:
            raise L3Error(f"cannot open L3 store {path!r}: {e}") from e
        try:
            self.env.reader_check()  # clear reader slots of killed processes
        except lmdb.Error:
            pass
        try:  # never add hicache's sub-databases to another application's environment
            lmdb_check.check_owner(self.env, path)
        except (L3ForeignError, lmdb.Error) as e:
            self.env.close()
            if isinstance(e, L3ForeignError):
                raise L3ForeignError(str(e)) from None
            raise L3CorruptError(f"L3 store {path!r} is damaged: {e}") from None
        try:
            self.data, self.head, self.atime, self.lru, self.meta = (
                self.env.open_db(name, create=writer)
                for name in (b"data", b"head", b"atime", b"lru", b"meta"))
        except lmdb.Error as e:
            self.env.close()
            raise L3Error(f"L3 store {path!r} is not a hicache store: {e}") from e
        self.gate = _Gate()
        self.refs = 0


_ENVS: dict[str, _Env] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: str, map_size: int, max_map_size: int, writer: bool, sync: bool) -> _Env:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        shared = _ENVS.get(key)
        if shared is None:
            shared = _ENVS[key] = _Env(path, map_size, max_map_size, writer, sync)
        elif writer and not shared.writer:
            raise L3Error(f"L3 store {path!r} is open read-only in this process; open the "
                          "writer first (the environment is shared by every store on a path)")
        shared.refs += 1
        return shared


def _release_env(shared: _Env) -> None:
    with _ENVS_LOCK:
        shared.refs -= 1
        if shared.refs == 0:
            _ENVS.pop(os.path.realpath(shared.path), None)
            shared.env.close()


class PageStore(L3Store):
    """Persistent page store of this rank's shards (LMDB). Thread-safe; several ranks in one
    process and several processes may open one path."""

    backend_name = "lmdb"

    def __init__(self, path: str | os.PathLike, namespace: Namespace, rank: int,
                 capacity_bytes: int, map_size: int | None = None, writer: bool = True,
                 max_map_size: int | None = None, sync: bool = True,
                 batch_bytes: int = 256 << 20, secrets=None) -> None:
        self._init_common(namespace, rank, writer, secrets)
        page_bytes = self.page_bytes
        if not isinstance(capacity_bytes, int) or capacity_bytes < page_bytes:
            raise L3Error(f"capacity_bytes {capacity_bytes!r} is smaller than one page shard "
                          f"({page_bytes} bytes)")
        self._closed = True  # until the environment is open
        self.capacity_bytes = capacity_bytes
        self.batch_bytes = max(int(batch_bytes), page_bytes)
        map_size = int(map_size or 2 * capacity_bytes + (64 << 20))
        max_map_size = int(max_map_size or max(4 * capacity_bytes + (256 << 20), map_size))
        self.path = os.fspath(path)
        if not self.writer and not os.path.exists(os.path.join(self.path, "data.mdb")):
            raise L3Error(f"read-only L3 store {self.path!r} does not exist")
        os.makedirs(self.path, exist_ok=True)
        self._shared = _acquire_env(self.path, map_size, max_map_size, self.writer, sync)
        sh = self._shared
        self._env, self._gate = sh.env, sh.gate
        self._data, self._head, self._atime, self._lru, self._meta = (
            sh.data, sh.head, sh.atime, sh.lru, sh.meta)
        self._pending_touch: list[list[bytes]] = []  # served key batches, oldest batch first
        self._pending_count = 0
        self._soft_cap = capacity_bytes  # lowered when the map fills before the capacity
        self._record_key = b"ns:" + namespace.digest  # lmdb_backend.RECORD: the namespace record
        self.error_reasons: dict[str, int] = {}  # failed writes by registry.KINDS reason
        self._closed = False

    @property
    def map_size(self) -> int:
        return self._shared.map_size

    @property
    def max_map_size(self) -> int:
        return self._shared.max_map_size

    # ---- transactions ------------------------------------------------------------------------
    def _run(self, fn: Callable, write: bool):
        """Run ``fn(txn)`` in a transaction (adopting a map another process grew). A write
        that fills the map is aborted and returns ``_FULL``."""
        if self._closed:
            raise L3Error("L3 store is closed")
        for _ in range(4):
            with self._gate.shared():
                try:
                    with self._env.begin(write=write, buffers=True) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:
                    pass
                except lmdb.MapFullError:
                    if not write:
                        raise
                    return _FULL
            with self._gate.exclusive():
                self._env.set_mapsize(0)  # adopt the size another process set
        raise L3Error(f"L3 store {self.path!r} keeps being resized by other processes")

    def _grow(self) -> bool:
        """Double the map up to ``max_map_size``; False when it cannot grow."""
        sh = self._shared
        with self._gate.exclusive():
            if sh.map_size >= sh.max_map_size:
                return False
            sh.map_size = min(2 * sh.map_size, sh.max_map_size)
            self._env.set_mapsize(sh.map_size)
            self._soft_cap = self.capacity_bytes
            return True

    def _shrink(self, need: int, round_: int) -> int:
        """After a full map: commit an eviction of ``need`` bytes plus a growing share of what
        is held (freed LMDB pages are reusable only by later transactions). Returns evictions."""
        def fn(txn):
            used = self._meta_get(txn, b"used")
            target = max(used - need - (used // 4) * round_, 0)
            left, evicted = self._evict(txn, used, target)
            txn.put(b"used", _b64(left), db=self._meta)
            self._soft_cap = max(min(self._soft_cap, left), self.page_bytes)
            return evicted

        res = self._run(fn, write=True)
        return 0 if res is _FULL else res

    # ---- bookkeeping inside a write txn ------------------------------------------------------
    def _meta_get(self, txn, name: bytes) -> int:
        return _u64(txn.get(name, db=self._meta))

    def _remove(self, txn, key: bytes) -> int:
        """Delete a page everywhere; returns the bytes freed."""
        freed = 0
        d = txn.get(key, db=self._data)
        if d is not None:
            freed += len(d)
        h = txn.get(key, db=self._head)
        if h is not None:
            freed += len(h)
        stamp = txn.get(key, db=self._atime)
        if stamp is not None:
            txn.delete(bytes(stamp) + key, db=self._lru)
        for db in (self._data, self._head, self._atime):
            txn.delete(key, db=db)
        return freed

    def _touch(self, txn, keys: Sequence[bytes], clock: int) -> int:
        """Give ``keys`` fresh stamps, the first key the newest; returns the new clock."""
        base = max(clock, time.time_ns()) + 1
        n = len(keys)
        for i, key in enumerate(keys):
            old = txn.get(key, db=self._atime)
            if old is None:
                continue
            txn.delete(bytes(old) + key, db=self._lru)
            stamp = _b64(base + n - 1 - i)
            txn.put(key, stamp, db=self._atime)
            txn.put(stamp + key, b"", db=self._lru)
        return base + n

    def _evict(self, txn, used: int, target: int) -> tuple[int, int]:
        """Evict the oldest pages until ``used <= target``; returns (used, pages evicted)."""
        evicted = 0
        if used <= target:
            return used, 0
        cur = txn.cursor(db=self._lru)
        ok = cur.first()
        while ok and used > target:
            key = bytes(cur.key())[_U64:]
            cur.delete()  # moves to the next record
            txn.delete(key, db=self._atime)
            freed = 0
            for db in (self._data, self._head):
                v = txn.get(key, db=db)
                if v is not None:
                    freed += len(v)
                    txn.delete(key, db=db)
            used -= freed
            evicted += 1
            ok = cur.key() is not None and len(cur.key()) > 0
        return max(used, 0), evicted

    # ---- public API --------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> PutResult:
        """Store ``shards[i]`` ([L, P, D], this rank's rows) under ``keys[i]``.

        Keys already stored are refreshed, not rewritten. Batched into few transactions
        (``batch_bytes`` each). Returns which keys are stored and how many were newly written.
        """
        keys = self.check_keys(keys)
        payloads = self._payloads(keys, shards)
        t0 = time.perf_counter()
        items, seen = [], set()
        for k, payload in zip(keys, payloads):
            if k in seen:  # one key twice in a put (merged submissions): store it once
                continue
            seen.add(k)
            items.append((k, payload, self._head_prefix + self._seal(k, payload)))
        written, stored = 0, {}
        batch: list = []
        size = 0
        for n, item in enumerate(items):
            batch.append(item)
            size += item[1].nbytes
            if size >= self.batch_bytes or n == len(items) - 1:
                w, held = self._put_batch(batch)
                written += w
                stored.update(dict.fromkeys(held, True))
                batch, size = [], 0
        self._bump(write_s=time.perf_counter() - t0)
        return PutResult(tuple(k in stored for k in keys), written)

    def _put_batch(self, items: list) -> tuple[int, list[bytes]]:
        """One write transaction; returns (pages written, keys held afterwards)."""
        touch = self._take_touches()

        def fn(txn):
            return self._write_txn(txn, items, touch)

        need = sum(it[1].nbytes + len(it[2]) for it in items)
        extra = 0
        for round_ in range(1, 6):
            try:
                res = self._run(fn, write=True)
            except lmdb.Error as e:  # the commit failed: the disk is full or failing
                if not _write_failure(e):
                    raise
                self._bump(pages_dropped=len(items), errors=1)  # reads go on
                with self._lock:
                    self.error_reasons["full"] = self.error_reasons.get("full", 0) + 1
                return 0, []
            if res is not _FULL:
                break
            # The map is full before the capacity: grow it if allowed, else evict for room.
            if not self._grow():
                extra += self._shrink(need, round_)
        else:
            self._bump(pages_dropped=len(items), evictions=extra)
            return 0, []
        written, skipped, dropped, evicted, nbytes, held = res
        self._bump(pages_written=written, pages_skipped=skipped, pages_dropped=dropped,
                   evictions=evicted + extra, bytes_written=nbytes)
        return written, held

    def _write_txn(self, txn, items: list, touch: list):
        """The body of ``_put_batch``'s transaction: store the fresh items that fit (evicting
        for room), touch the existing ones and ``touch``; (written, skipped, dropped, evicted,
        bytes written, keys held afterwards)."""
        used = self._meta_get(txn, b"used")
        clock = self._meta_get(txn, b"clock")
        fresh, existing = [], []
        for k, payload, head in items:
            held = txn.get(k, db=self._head)
            if held is not None and not self._head_ok(held):  # another writer's value
                used -= self._remove(txn, k)  # replaced, never kept (no NX for it)
                held = None
            (existing if held is not None else fresh).append((k, payload, head))
        clock = self._touch(txn, _dedupe([k for k, _, _ in existing] + touch), clock)
        # Refuse what cannot fit at all: keep the leading pages (prefixes are worth more).
        need, keep = 0, []
        for item in fresh:
            sz = item[1].nbytes + len(item[2])
            if need + sz > self.capacity_bytes:
                break
            keep.append(item)
            need += sz
        dropped = len(fresh) - len(keep)
        target = min(self.capacity_bytes, self._soft_cap) - need
        used, evicted = self._evict(txn, used, max(target, 0))
        base = max(clock, time.time_ns()) + 1
        n = len(keep)
        for i, (k, payload, head) in enumerate(keep):
            stamp = _b64(base + n - 1 - i)
            txn.put(k, payload, db=self._data)
            txn.put(k, head, db=self._head)
            txn.put(k, stamp, db=self._atime)
            txn.put(stamp + k, b"", db=self._lru)
        txn.put(b"used", _b64(used + need), db=self._meta)
        txn.put(b"clock", _b64(base + n), db=self._meta)
        if keep and txn.get(self._record_key, db=self._meta) is None:  # `hicache l3 ls`
            txn.put(self._record_key, self.namespace.record(), db=self._meta)
        return (len(keep), len(existing), dropped, evicted,
                sum(it[1].nbytes for it in keep),
                [it[0] for it in keep] + [it[0] for it in existing])

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""
        keys = self.check_keys(keys)
        if not keys:
            return 0

        def fn(txn):
            n = 0
            for k in keys:
                if txn.get(k, db=self._head) is None:
                    break
                n += 1
            return n

        return self._run(fn, write=False)

    def get(self, keys: Sequence[bytes], out: Out) -> int:
        """Copy stored shards into ``out`` (a list of [L, P, D] tensors, or ``out(i)`` returning
        the destination of page i). Stops at the first missing or corrupt page; returns the
        number of pages served. A corrupt value is counted, deleted and never served."""
        keys = self.check_keys(keys)
        if not keys:
            return 0
        out = self._destinations(keys, out)
        t0 = time.perf_counter()

        def fn(txn):
            # Page by page: hash the mapped bytes, then copy them while they are still in cache.
            served, bad = 0, None
            for i, k in enumerate(keys):
                head = txn.get(k, db=self._head)
                if head is None:
                    break
                data = txn.get(k, db=self._data)  # a buffer into the map: no copy yet
                if not self._valid(k, head, data):
                    bad = k
                    break
                dst = out(i)
                self.check_tensor(dst, f"destination {i}")
                copy_into(dst, data, self.page_bytes)  # the one copy (releases the GIL)
                served += 1
            return served, bad

        served, bad = self._run(fn, write=False)
        missed = served < len(keys)
        self._bump(hits=served, misses=int(missed), corrupt=int(bad is not None),
                   bytes_read=served * self.page_bytes, read_s=time.perf_counter() - t0)
        if self.writer:
            with self._lock:
                if served:
                    self._pending_touch.append(keys[:served])
                    self._pending_count += served
                flush = self._pending_count >= 4096
            if bad is not None:
                self.delete([bad])
            elif flush:
                self.flush_touches()
        return served

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages; returns how many existed."""
        if not self.writer:
            raise L3Error("this L3 store was opened with writer=False; delete is not allowed")
        keys = self.check_keys(keys)

        def fn(txn):
            used = self._meta_get(txn, b"used")
            n = 0
            for k in keys:
                if txn.get(k, db=self._head) is not None or txn.get(k, db=self._data) is not None:
                    n += 1
                used -= self._remove(txn, k)
            txn.put(b"used", _b64(max(used, 0)), db=self._meta)
            return n

        res = self._run(fn, write=True)
        return 0 if res is _FULL else res

    def _take_touches(self) -> list[bytes]:
        """Pending served keys, the most recently served batch first (deduplicated)."""
        with self._lock:
            batches = self._pending_touch
            self._pending_touch = []
            self._pending_count = 0
        return _dedupe([k for batch in reversed(batches) for k in batch])

    def flush_touches(self) -> None:
        """Write pending last-access updates of served pages (done lazily to spare fsyncs)."""
        if not self.writer:
            return
        touch = self._take_touches()
        if not touch:
            return

        def fn(txn):
            clock = self._touch(txn, touch, self._meta_get(txn, b"clock"))
            txn.put(b"clock", _b64(clock), db=self._meta)

        self._run(fn, write=True)

    # ---- introspection -----------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes held by the whole environment (all ranks, all namespaces)."""
        return self._run(lambda txn: self._meta_get(txn, b"used"), write=False)

    def num_pages(self) -> int:
        """Pages held by the whole environment."""
        return self._run(lambda txn: txn.stat(self._head)["entries"], write=False)

    def lru_order(self) -> list[bytes]:
        """Keys from the least to the most recently used (whole environment)."""
        return self._run(lambda txn: [bytes(k)[_U64:] for k, _ in
                                         txn.cursor(db=self._lru)], write=False)

    def abandon(self) -> None:
        with self._lock:
            self._pending_touch, self._pending_count = [], 0
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush_touches()
        finally:
            self._closed = True
            _release_env(self._shared)
