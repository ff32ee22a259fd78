"""A dummy L3 backend in one module: an in-process dict. Importing it registers ``mem``;
nothing else in hicache changes for it (tests/test_l3_registry.py runs the shared store-contract
tests, the policy file and the service on it)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from hicache.config import opt
from hicache.errors import ConfigError, L3Error
from hicache.l3 import registry
from hicache.l3.base import L3Store, PutResult, copy_into

_SERVERS: dict[str, dict] = {}  # name -> the "server": key -> value bytes
_LOCK = threading.Lock()


@dataclass(frozen=True)
class MemSection:
    name: str = opt("default", "which in-process dict holds the pages")
    max_pages: int = opt(1 << 16, "pages held at most (a put beyond is dropped)", min=1,
                         max=1 << 30)


class MemStore(L3Store):
    def __init__(self, name: str, namespace, rank: int, *, writer: bool = True,
                 max_pages: int = 1 << 16, secrets=None) -> None:
        self._init_common(namespace, rank, writer, secrets)
        with _LOCK:
            self.data = _SERVERS.setdefault(name, {})
        self.max_pages = max_pages

    def exists_prefix(self, keys) -> int:
        keys = self.check_keys(keys)
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    def get(self, keys, out) -> int:
        keys = self.check_keys(keys)
        dst = self._destinations(keys, out)
        t0, served, bad = time.perf_counter(), 0, None
        for i, k in enumerate(keys):
            v = self.data.get(k)
            if v is None:
                break
            view = memoryview(v)
            if not self._valid(k, view[:self._head_len], view[self._head_len:]):
                bad = k
                break
            copy_into(dst(i), view[self._head_len:], self.page_bytes)
            served += 1
        self._bump(hits=served, misses=int(served < len(keys)), corrupt=int(bad is not None),
                   bytes_read=served * self.page_bytes, read_s=time.perf_counter() - t0)
        if bad is not None and self.writer:
            self.delete([bad])
        return served

    def put(self, keys, shards) -> PutResult:
        keys = self.check_keys(keys)
        payloads = self._payloads(keys, shards)
        stored, written, skipped, dropped = [], 0, 0, 0
        for k, p in zip(keys, payloads):
            if self._held(k):
                stored.append(True)
                skipped += 1
            elif len(self.data) >= self.max_pages:
                stored.append(False)
                dropped += 1
            else:
                self.data[k] = self._encode(k, p)
                stored.append(True)
                written += 1
        self._bump(pages_written=written, pages_skipped=skipped, pages_dropped=dropped,
                   bytes_written=written * self.page_bytes)
        return PutResult(tuple(stored), written)

    def _held(self, k: bytes) -> bool:
        v = self.data.get(k)
        return v is not None and self._valid(k, memoryview(v)[:self._head_len],
                                             memoryview(v)[self._head_len:])

    def _encode(self, k: bytes, payload) -> bytes:
        return b"".join(bytes(p) for p in self._value_parts(k, payload))

    def delete(self, keys) -> int:
        if not self.writer:
            raise L3Error("read-only store")
        keys = self.check_keys(keys)
        return sum(self.data.pop(k, None) is not None for k in keys)

    def close(self) -> None:
        self._closed = True


def _open(section: MemSection, namespace, rank, *, writer=True, capacity_bytes=None,
          timeout_s=None, **options):
    return MemStore(section.name, namespace, rank, writer=writer, max_pages=section.max_pages,
                    secrets=options.get("secrets"))


def _preflight(section: MemSection, page_bytes: int) -> list:
    if section.name == "forbidden":
        raise ConfigError("l3.mem.name: 'forbidden' is not a place for pages")
    return []


def _tamper(store, key: bytes) -> None:
    v = bytearray(store.data[key])
    v[-1] ^= 0xFF
    store.data[key] = bytes(v)


def _raw_put(store, key: bytes, value: bytes) -> None:
    store.data[key] = bytes(value)


@contextmanager
def _fixture(scratch: str):
    name = f"fixture-{scratch}"
    try:
        yield registry.StoreFixture({"name": name}, _tamper, _raw_put)
    finally:
        _SERVERS.pop(name, None)


BACKEND = registry.register(registry.Backend(
    name="mem", section=MemSection, open=_open, preflight=_preflight,
    errors=lambda: (L3Error, OSError), classify=lambda e: "other", fixture=_fixture,
    describe=lambda s: f"mem:{s.name}", claims=lambda where: isinstance(where, str) and
    where.startswith("mem:"), section_of=lambda where: {"name": where[4:]}), replace=True)
