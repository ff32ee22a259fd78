"""The page-store contract every L3 backend implements, and the value format they share.

A store holds one rank's shards of widened pages (``[L, P, D]`` tensors of the namespace's dtype)
under keys from :func:`hicache.l3.keys.page_keys`. Callers (the service, the prefetcher, the writer,
engine adapters) use only this interface and never need to know the backend:

    store = open_store(where, namespace, rank)     # hicache.l3.open_store
    n = store.exists_prefix(keys)                  # leading keys held (stops at the first absent)
    got = store.get(keys[:n], out)                 # leading pages copied into caller's buffers
    res = store.put(keys, shards)                  # PutResult: per key stored or not
    store.delete(keys); store.stats; store.close()

Rules every backend keeps:
- ``get`` serves a prefix: it stops at the first missing, corrupt or unreadable page, and never
  writes a destination past the pages it reports. A value whose header or checksum does not match
  is a counted miss (``corrupt``), deleted when the store is a writer, never served.
- No call raises for an unavailable store (connection loss, timeout, server restart): it answers
  as a miss (``exists_prefix``/``get``) or as pages not stored (``put``), counted in
  ``stats.errors``. Calls are bounded in time. Bad input (wrong key, tensor, closed store) raises
  :class:`L3Error`.
- Stored value of a page: ``header | checksum | payload`` where the header (msgpack: format
  version, namespace digest, rank, shape, dtype, payload size) is byte-for-byte the one this
  store writes, and the checksum is XXH3-64 of the payload seeded with the key's own XXH3-64
  (a value copied under another key fails). Backends may keep header and payload apart (LMDB)
  or in one value (Redis), never a page split over two values that can be evicted separately.
"""

from __future__ import annotations

import abc
import hmac
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Sequence, Union

import msgpack
import numpy as np
import torch
import xxhash

from .keys import FORMAT_VERSION, KEY_BYTES, Namespace
from ..errors import L3Error

if TYPE_CHECKING:
    from .auth import Secret, Secrets

Out = Union[Sequence[torch.Tensor], Callable[[int], torch.Tensor]]

SUM_BYTES = 8  # checksum bytes: XXH3-64 digest
TAG_BYTES = 16  # MAC bytes of an authenticated value (hicache.l3.auth.TAG_BYTES)


@dataclass(frozen=True)
class L3Stats:
    hits: int = 0  # pages served
    misses: int = 0  # get calls that stopped short at a missing, corrupt or unreadable page
    corrupt: int = 0  # values rejected by header/shape/checksum (also counted in misses)
    auth_failures: int = 0  # of those, in an authenticated store: the MAC (or header) failed
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    pages_skipped: int = 0  # put of a key already stored
    pages_dropped: int = 0  # put that could not fit (capacity) or failed (unavailable store)
    evictions: int = 0  # pages this store evicted (LMDB; a Redis server evicts on its own)
    errors: int = 0  # calls that failed on an unavailable store (answered as misses / not stored)
    read_s: float = 0.0  # wall time inside get (for the cost model)
    write_s: float = 0.0


@dataclass(frozen=True)
class PutResult:
    """Outcome of one ``put``: ``stored[i]`` is True when ``keys[i]`` is held by the store after
    the call (written now or already there); ``written`` counts pages newly written."""

    stored: tuple[bool, ...]
    written: int = 0

    @property
    def num_stored(self) -> int:
        return sum(self.stored)

    @property
    def num_failed(self) -> int:
        return len(self.stored) - sum(self.stored)


def checksum(key: bytes, buf) -> bytes:
    """XXH3-64 of the payload seeded with the key's own XXH3-64: binds the bytes to their key."""
    return xxhash.xxh3_64_digest(buf, seed=xxhash.xxh3_64_intdigest(key))


def header_prefix(namespace: Namespace, rank: int, authenticated: bool = False) -> bytes:
    """Header bytes of every value a store of (namespace, rank) writes, up to the checksum
    (``xxh``: XXH3-64, 8 bytes) or, in an authenticated store, the MAC (``mac``: 16 bytes)."""
    name, n = ("mac", TAG_BYTES) if authenticated else ("xxh", SUM_BYTES)
    packed = msgpack.packb({"v": FORMAT_VERSION, "ns": namespace.digest, "rank": rank,
                            "shape": list(namespace.shard_shape), "dtype": namespace.dtype,
                            "n": namespace.shard_bytes, name: bytes(n)})
    if packed[-n - 2:-n] != b"\xc4" + bytes([n]):  # bin 8 of n bytes
        raise AssertionError("unexpected msgpack encoding of the L3 header")
    return packed[:-n]


def payload_of(t: torch.Tensor) -> np.ndarray:
    """A shard's bytes (uint8, C order; no copy for a contiguous CPU tensor)."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()


def copy_into(dst: torch.Tensor, data, page_bytes: int) -> None:
    """Copy one page's payload bytes (a buffer of ``page_bytes``) into the destination tensor."""
    src = np.frombuffer(data, np.uint8, count=page_bytes)
    if dst.device.type == "cpu" and dst.is_contiguous():
        np.copyto(dst.view(torch.uint8).reshape(-1).numpy(), src)  # releases the GIL
    else:  # strided or device tensor: stage once in host memory
        tmp = torch.empty(page_bytes, dtype=torch.uint8)
        np.copyto(tmp.numpy(), src)
        dst.copy_(tmp.view(dst.dtype).view(dst.shape))


class L3Store(abc.ABC):
    """A page store of one rank's shards. Thread-safe. See the module docstring for the rules."""

    namespace: Namespace
    rank: int
    page_bytes: int
    writer: bool

    def _init_common(self, namespace: Namespace, rank: int, writer: bool,
                     secrets: "Secrets | None" = None) -> None:
        if not isinstance(namespace, Namespace):
            raise L3Error(f"namespace must be a Namespace, got {type(namespace).__name__}")
        if not isinstance(rank, int) or not 0 <= rank < namespace.dcp_size:
            raise L3Error(f"rank {rank!r} is outside the DCP group [0, {namespace.dcp_size})")
        self.namespace = namespace
        self.rank = rank
        self.writer = bool(writer)
        self.page_bytes = namespace.shard_bytes
        self._prefix = namespace.digest + rank.to_bytes(2, "big")
        self.secrets = secrets  # authenticated values (hicache.l3.auth): MAC instead of XXH3
        self._sum_len = TAG_BYTES if secrets is not None else SUM_BYTES
        self._head_prefix = header_prefix(namespace, rank, secrets is not None)
        self._head_len = len(self._head_prefix) + self._sum_len
        self._lock = threading.Lock()
        self._verify = threading.local()  # .secret: which secret a read verifies (keyed.py)
        self._stats = {f.name: 0 for f in fields(L3Stats)}
        self._stats["read_s"] = 0.0
        self._stats["write_s"] = 0.0
        self._closed = False

    # ---- the contract ---------------------------------------------------------------------------
    @abc.abstractmethod
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], out: Out) -> int:
        """Copy stored shards into ``out`` (a list of [L, P, D] tensors, or ``out(i)`` returning
        the destination of page i). Stops at the first missing, corrupt or unreadable page;
        returns the number of leading pages served."""

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> PutResult:
        """Store ``shards[i]`` ([L, P, D], this rank's rows) under ``keys[i]``; keys already
        stored are not rewritten. Returns which keys are stored."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove pages; returns how many existed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store (idempotent). Later calls raise L3Error."""

    def abandon(self) -> None:
        """Release a store that failed without flushing anything more into it."""
        self.close()

    @property
    def stats(self) -> L3Stats:
        with self._lock:
            return L3Stats(**self._stats)

    # ---- shared helpers -----------------------------------------------------------------------
    def check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys as ``bytes``; L3Error for a malformed key or one of another namespace/rank."""
        if self._closed:
            raise L3Error("L3 store is closed")
        out = []
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise L3Error(f"an L3 key must be {KEY_BYTES} bytes (from page_keys), got {k!r:.60}")
            if not k.startswith(self._prefix):
                raise L3Error("key belongs to another namespace or rank than this store "
                              f"(rank {self.rank}); derive keys with this store's namespace")
            out.append(bytes(k))
        return out

    def check_tensor(self, t: torch.Tensor, what: str) -> None:
        ns = self.namespace
        if not isinstance(t, torch.Tensor):
            raise L3Error(f"{what} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != ns.shard_shape or t.dtype != ns.torch_dtype:
            raise L3Error(f"{what} has shape {tuple(t.shape)} {t.dtype}; the namespace expects "
                          f"{list(ns.shard_shape)} {ns.torch_dtype} ([layers, P, kv_dim])")

    _check_keys = check_keys
    _check_tensor = check_tensor

    def _destinations(self, keys: list[bytes], out: Out) -> Callable[[int], torch.Tensor]:
        if callable(out):
            return out
        if len(out) < len(keys):
            raise L3Error(f"get got {len(keys)} keys but only {len(out)} destinations")
        return lambda i: out[i]

    def _payloads(self, keys: list[bytes], shards: Sequence[torch.Tensor]) -> list[np.ndarray]:
        if not self.writer:
            raise L3Error("this L3 store was opened with writer=False; put is not allowed")
        if len(keys) != len(shards):
            raise L3Error(f"put got {len(keys)} keys but {len(shards)} shards")
        out = []
        for i, t in enumerate(shards):
            self.check_tensor(t, f"shard {i}")
            out.append(payload_of(t))
        return out

    def _seal(self, key: bytes, payload) -> bytes:
        """The checksum of a value (XXH3-64), or its MAC under the current secret."""
        if self.secrets is None:
            return checksum(key, payload)
        return self.secrets.current.tag(key, self._head_prefix, payload)

    def _value_parts(self, key: bytes, payload) -> tuple:
        """The buffers of the value stored under ``key``: header, checksum or MAC, payload."""
        return (self._head_prefix, self._seal(key, payload), payload)

    def _head_ok(self, head) -> bool:
        """A held header is the one this store writes (its tag is checked when it is read)."""
        return len(head) == self._head_len and bytes(head[:-self._sum_len]) == self._head_prefix

    @contextmanager
    def verifying(self, secret: "Secret"):
        """Reads in this block (this thread) verify MACs with ``secret`` alone: the secret
        whose key derivation gave the keys read (a rotation's previous secret; by default the
        current one). A value under a current-secret key never verifies with another secret."""
        self._verify.secret = secret
        try:
            yield self
        finally:
            self._verify.secret = None

    def _valid(self, key: bytes, head, data) -> bool:
        """The header is exactly the one this store writes and the data hashes to its checksum,
        or its MAC verifies under the one secret this read verifies with (:meth:`verifying`;
        the current secret unless told otherwise). Format version, namespace, rank, shape,
        dtype and size all live in the header."""
        if data is None or len(data) != self.page_bytes or len(head) != self._head_len:
            return False
        head = bytes(head)
        n = self._sum_len
        if head[:-n] != self._head_prefix:
            return False
        if self.secrets is None:
            return head[-n:] == checksum(key, data)
        secret = getattr(self._verify, "secret", None) or self.secrets.current
        return hmac.compare_digest(head[-n:], secret.tag(key, self._head_prefix, data))

    def _bump(self, **kv) -> None:
        if self.secrets is not None and kv.get("corrupt"):  # an authenticated value failed
            kv["auth_failures"] = kv["corrupt"]
        with self._lock:
            for k, v in kv.items():
                self._stats[k] += v

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
