"""PageStore: one LMDB environment per node holding every rank's shard of widened pages.

Several processes (the ranks on one node) open the same path; LMDB serialises their write
transactions, so shared bookkeeping (bytes used, the LRU clock) lives in the environment itself.

Sub-databases of the environment:
    data   key -> raw shard bytes ([L, P, D] of this rank, C order)
    head   key -> msgpack header {v, ns, rank, shape, dtype, n, xxh}; xxh = XXH3-64 of the data
           seeded with a hash of the key (8 B), so a value copied under another key fails
    atime  key -> 8-byte stamp of the last access
    lru    stamp (8 B big endian) | key -> b""   (ordered: the oldest first)
    meta   b"used" -> bytes held (data + head), b"clock" -> last stamp issued

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
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

import lmdb
import msgpack
import numpy as np
import torch
import xxhash

from .keys import FORMAT_VERSION, KEY_BYTES, L3Error, Namespace

Out = Union[Sequence[torch.Tensor], Callable[[int], torch.Tensor]]

_U64 = 8
_FULL = object()  # a write transaction that filled the map


def should_write(page_index: int, replica_id: int, num_replicas: int) -> bool:
    """One writer per page among ``num_replicas`` TP replicas of a shard (tp > dcp): rotate."""
    if num_replicas < 1 or not 0 <= replica_id < num_replicas:
        raise L3Error(f"replica_id {replica_id} is outside [0, {num_replicas})")
    if page_index < 0:
        raise L3Error(f"page_index must be >= 0, got {page_index}")
    return page_index % num_replicas == replica_id


def replica_of(tp_rank: int, tp_size: int, dcp_size: int) -> tuple[int, int, int]:
    """``(dcp_rank, replica_id, num_replicas)`` of a TP rank (dcp rank = tp_rank mod dcp)."""
    if dcp_size < 1 or tp_size % dcp_size:
        raise L3Error(f"tp_size {tp_size} is not a multiple of dcp_size {dcp_size}")
    if not 0 <= tp_rank < tp_size:
        raise L3Error(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    return tp_rank % dcp_size, tp_rank // dcp_size, tp_size // dcp_size


@dataclass(frozen=True)
class L3Stats:
    hits: int = 0  # pages served
    misses: int = 0  # get calls that stopped short at a missing or corrupt page
    corrupt: int = 0  # values rejected by header/shape/checksum (also counted in misses)
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    pages_skipped: int = 0  # put of a key already stored
    pages_dropped: int = 0  # put that could not fit even after evicting and growing
    evictions: int = 0
    read_s: float = 0.0  # wall time inside get (for the cost model)
    write_s: float = 0.0


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


def _u64(b) -> int:
    return int.from_bytes(bytes(b), "big") if b is not None else 0


_SUM = 8  # checksum bytes: XXH3-64 digest


def _checksum(key: bytes, buf) -> bytes:
    """XXH3-64 of the payload seeded with the key's own XXH3-64: binds the bytes to their key."""
    return xxhash.xxh3_64_digest(buf, seed=xxhash.xxh3_64_intdigest(key))


def _dedupe(keys: list[bytes]) -> list[bytes]:
    return list(dict.fromkeys(keys))


def _b64(v: int) -> bytes:
    return int(v).to_bytes(_U64, "big")


class PageStore:
    """Persistent page store of this rank's shards. Thread-safe; multi-process on one path."""

    def __init__(self, path: str | os.PathLike, namespace: Namespace, rank: int,
                 capacity_bytes: int, map_size: int | None = None, writer: bool = True,
                 max_map_size: int | None = None, sync: bool = True,
                 batch_bytes: int = 256 << 20, verify_threads: int | None = None) -> None:
        if not isinstance(namespace, Namespace):
            raise L3Error(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if not isinstance(rank, int) or not 0 <= rank < namespace.dcp_size:
            raise L3Error(f"rank {rank!r} is outside the DCP group [0, {namespace.dcp_size})")
        page_bytes = namespace.shard_bytes
        if not isinstance(capacity_bytes, int) or capacity_bytes < page_bytes:
            raise L3Error(f"capacity_bytes {capacity_bytes!r} is smaller than one page shard "
                          f"({page_bytes} bytes)")
        self.namespace = namespace
        self.rank = rank
        self.capacity_bytes = capacity_bytes
        self.writer = bool(writer)
        self.batch_bytes = max(int(batch_bytes), page_bytes)
        self.page_bytes = page_bytes
        self._prefix = namespace.digest + rank.to_bytes(2, "big")
        self.map_size = int(map_size or 2 * capacity_bytes + (64 << 20))
        self.max_map_size = int(max_map_size or max(4 * capacity_bytes + (256 << 20),
                                                    self.map_size))
        self.path = os.fspath(path)
        if not self.writer and not os.path.exists(os.path.join(self.path, "data.mdb")):
            raise L3Error(f"read-only L3 store {self.path!r} does not exist")
        os.makedirs(self.path, exist_ok=True)
        try:
            self._env = lmdb.open(self.path, map_size=self.map_size, max_dbs=8, subdir=True,
                                  readonly=not self.writer, sync=sync, metasync=sync,
                                  readahead=False, meminit=False, max_readers=512, lock=True)
        except lmdb.Error as e:
            raise L3Error(f"cannot open L3 store {self.path!r}: {e}") from e
        try:
            self._env.reader_check()  # clear reader slots of killed processes
        except lmdb.Error:
            pass
        create = self.writer
        try:
            self._data = self._env.open_db(b"data", create=create)
            self._head = self._env.open_db(b"head", create=create)
            self._atime = self._env.open_db(b"atime", create=create)
            self._lru = self._env.open_db(b"lru", create=create)
            self._meta = self._env.open_db(b"meta", create=create)
        except lmdb.Error as e:
            self._env.close()
            raise L3Error(f"L3 store {self.path!r} is not a hicache store: {e}") from e
        self._gate = _Gate()
        self._lock = threading.Lock()
        self._stats = {f: 0 for f in L3Stats.__dataclass_fields__}
        self._stats["read_s"] = 0.0
        self._stats["write_s"] = 0.0
        self._pending_touch: list[list[bytes]] = []  # served key batches, oldest batch first
        self._pending_count = 0
        self._soft_cap = capacity_bytes  # lowered when the map fills before the capacity
        del verify_threads  # accepted for compatibility: checksums now run inline
        self._head_prefix = self._header_prefix()
        self._head_len = len(self._head_prefix) + _SUM
        self._closed = False

    def _header_prefix(self) -> bytes:
        """Header bytes of every value this store writes, up to the 8 checksum bytes."""
        ns = self.namespace
        packed = msgpack.packb({"v": FORMAT_VERSION, "ns": ns.digest, "rank": self.rank,
                                "shape": list(ns.shard_shape), "dtype": ns.dtype,
                                "n": self.page_bytes, "xxh": bytes(_SUM)})
        if packed[-_SUM - 2:-_SUM] != b"\xc4" + bytes([_SUM]):  # msgpack bin 8 of 8 bytes
            raise AssertionError("unexpected msgpack encoding of the L3 header")
        return packed[:-_SUM]

    # ---- keys --------------------------------------------------------------------------------
    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise L3Error(f"an L3 key must be {KEY_BYTES} bytes (from page_keys), got {k!r:.60}")
            if not k.startswith(self._prefix):
                raise L3Error("key belongs to another namespace or rank than this store "
                              f"(rank {self.rank}); derive keys with this store's namespace")
            out.append(bytes(k))
        return out

    def _check_tensor(self, t: torch.Tensor, what: str) -> None:
        ns = self.namespace
        if not isinstance(t, torch.Tensor):
            raise L3Error(f"{what} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != ns.shard_shape or t.dtype != ns.torch_dtype:
            raise L3Error(f"{what} has shape {tuple(t.shape)} {t.dtype}; the namespace expects "
                          f"{list(ns.shard_shape)} {ns.torch_dtype} ([layers, P, kv_dim])")

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
        with self._gate.exclusive():
            if self.map_size >= self.max_map_size:
                return False
            self.map_size = min(2 * self.map_size, self.max_map_size)
            self._env.set_mapsize(self.map_size)
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

    def _bump(self, **kv) -> None:
        with self._lock:
            for k, v in kv.items():
                self._stats[k] += v

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
    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> int:
        """Store ``shards[i]`` ([L, P, D], this rank's rows) under ``keys[i]``.

        Keys already stored are refreshed, not rewritten. Batched into few transactions
        (``batch_bytes`` each). Returns the pages newly written.
        """
        if not self.writer:
            raise L3Error("this L3 store was opened with writer=False; put is not allowed")
        keys = self._check_keys(keys)
        if len(keys) != len(shards):
            raise L3Error(f"put got {len(keys)} keys but {len(shards)} shards")
        payloads = []
        for i, t in enumerate(shards):
            self._check_tensor(t, f"shard {i}")
            payloads.append(t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
                            .numpy())
        t0 = time.perf_counter()
        items, seen = [], set()
        for k, payload in zip(keys, payloads):
            if k in seen:  # one key twice in a put (merged submissions): store it once
                continue
            seen.add(k)
            items.append((k, payload, self._head_prefix + _checksum(k, payload)))
        written = 0
        batch: list = []
        size = 0
        for item in items:
            batch.append(item)
            size += item[1].nbytes
            if size >= self.batch_bytes:
                written += self._put_batch(batch)
                batch, size = [], 0
        if batch:
            written += self._put_batch(batch)
        self._bump(write_s=time.perf_counter() - t0)
        return written

    def _put_batch(self, items: list) -> int:
        touch = self._take_touches()

        def fn(txn):
            used = self._meta_get(txn, b"used")
            clock = self._meta_get(txn, b"clock")
            fresh, existing = [], []
            for k, payload, head in items:
                (existing if txn.get(k, db=self._head) is not None else fresh).append(
                    (k, payload, head))
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
            return len(keep), len(existing), dropped, evicted, sum(
                it[1].nbytes for it in keep)

        need = sum(it[1].nbytes + len(it[2]) for it in items)
        extra = 0
        for round_ in range(1, 6):
            res = self._run(fn, write=True)
            if res is not _FULL:
                break
            # The map is full before the capacity: grow it if allowed, else evict for room.
            if not self._grow():
                extra += self._shrink(need, round_)
        else:
            self._bump(pages_dropped=len(items), evictions=extra)
            return 0
        written, skipped, dropped, evicted, nbytes = res
        self._bump(pages_written=written, pages_skipped=skipped, pages_dropped=dropped,
                   evictions=evicted + extra, bytes_written=nbytes)
        return written

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""
        keys = self._check_keys(keys)
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

    def _valid(self, key: bytes, head, data) -> bool:
        """The header is exactly the one this store writes and the data hashes to its checksum
        (format version, namespace, rank, shape, dtype and size all live in the header)."""
        if data is None or len(data) != self.page_bytes or len(head) != self._head_len:
            return False
        head = bytes(head)
        return head[:-_SUM] == self._head_prefix and head[-_SUM:] == _checksum(key, data)

    def get(self, keys: Sequence[bytes], out: Out) -> int:
        """Copy stored shards into ``out`` (a list of [L, P, D] tensors, or ``out(i)`` returning
        the destination of page i). Stops at the first missing or corrupt page; returns the
        number of pages served. A corrupt value is counted, deleted and never served."""
        keys = self._check_keys(keys)
        if not keys:
            return 0
        if not callable(out):
            if len(out) < len(keys):
                raise L3Error(f"get got {len(keys)} keys but only {len(out)} destinations")
            outs = out
            out = lambda i: outs[i]  # noqa: E731
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
                self._check_tensor(dst, f"destination {i}")
                if dst.device.type == "cpu" and dst.is_contiguous():
                    # the one copy (np.copyto releases the GIL: prefetch threads overlap)
                    np.copyto(dst.view(torch.uint8).reshape(-1).numpy(),
                              np.frombuffer(data, np.uint8))
                else:  # strided or device tensor: stage once in host memory
                    tmp = torch.empty(self.page_bytes, dtype=torch.uint8)
                    np.copyto(tmp.numpy(), np.frombuffer(data, np.uint8))
                    dst.copy_(tmp.view(dst.dtype).view(dst.shape))
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
        keys = self._check_keys(keys)

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
    @property
    def stats(self) -> L3Stats:
        with self._lock:
            return L3Stats(**self._stats)

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

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush_touches()
        finally:
            self._closed = True
            self._env.close()

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
