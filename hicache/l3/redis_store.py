"""RedisStore: the L3 page store on a Redis (7+) / Valkey (8+) server or Redis Cluster.

One value per (namespace, rank, chain hash), ``header | checksum | payload`` (see
:mod:`hicache.l3.base`), so server-side eviction drops a whole page or nothing. Keys are
``key_prefix + store key`` (no hash tag: a rank's consecutive pages spread over a cluster's
shards). Capacity is the server's ``maxmemory`` with an ``allkeys-lru`` (or -lfu) policy: a page
evicted under a running restore is a miss for the tail, never a wrong page.

Requests are pipelined: ``exists_prefix`` one round trip of EXISTS, ``get`` GETs in batches of
about ``batch_bytes``, ``put`` one round trip of TOUCH (keys already stored are refreshed, not
resent) then ``SET NX`` of the absent pages in batches. In cluster mode the client's cluster
pipeline groups the commands by node. The client is ``redis`` with the ``hiredis`` parser and the
pure-Python command packer, which sends a large value as its own buffer instead of copying it
into one packed request (``python bench/l3.py --shapes`` measures the four combinations).

An unavailable server (refused, reset, timed out, restarting, cluster down) never raises: the call
answers a miss or "not stored", is counted in ``stats.errors``, and for ``retry_after_s`` later
calls answer the same at once without touching the network, so a dead server costs serving at
most one ``timeout_s`` per ``retry_after_s``. Every socket operation has ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Sequence
from urllib.parse import urlsplit

import torch

from .base import L3Store, Out, PutResult, checksum, copy_into
from .keys import L3Error, Namespace

_SCHEMES = ("redis", "rediss", "unix")


def parse_url(url) -> str | list[str]:
    """Validate ``url``: ``redis://host:port/db``, ``rediss://...``, ``unix:///path`` (one
    server), or a non-empty list of ``redis[s]://host:port`` (Redis Cluster startup nodes).
    Returns it normalised (a str or a list); L3Error naming what is wrong otherwise."""
    if isinstance(url, (list, tuple)):
        if not url:
            raise L3Error("a Redis Cluster needs at least one node URL, got an empty list")
        out = []
        for u in url:
            if not isinstance(u, str):
                raise L3Error(f"a cluster node URL must be a string, got {u!r}")
            parts = _split(u)
            if parts.scheme == "unix":
                raise L3Error(f"cluster node {u!r}: cluster nodes are host:port, not unix sockets")
            if parts.path not in ("", "/", "/0"):
                raise L3Error(f"cluster node {u!r}: a cluster has only database 0")
            out.append(u)
        return out
    if not isinstance(url, str):
        raise L3Error(f"a Redis URL must be a string or a list of node URLs, got {url!r}")
    parts = _split(url)
    if parts.scheme != "unix":
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise L3Error(f"{url!r}: the database must be a number (redis://host:port/0)")
    return url


def _split(url: str):
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a non-numeric port
    except ValueError as e:
        raise L3Error(f"bad Redis URL {url!r}: {e}") from None
    if parts.scheme not in _SCHEMES:
        raise L3Error(f"bad Redis URL {url!r}: the scheme must be one of "
                      f"{', '.join(s + '://' for s in _SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise L3Error(f"bad Redis URL {url!r}: unix:// needs a socket path (unix:///path)")
    elif not parts.hostname:
        raise L3Error(f"bad Redis URL {url!r}: no host (redis://host:port/db)")
    del port
    return parts


class RedisStore(L3Store):
    """Page store of this rank's shards on a Redis / Valkey server or cluster. Thread-safe."""

    def __init__(self, url: str | Sequence[str], namespace: Namespace, rank: int, *,
                 writer: bool = True, timeout_s: float = 2.0, retry_after_s: float = 1.0,
                 batch_bytes: int = 32 << 20, key_prefix: bytes = b"hicache:",
                 check_policy: bool = True) -> None:
        self._init_common(namespace, rank, writer)
        self.url = parse_url(url)
        if not timeout_s > 0 or retry_after_s < 0:
            raise L3Error(f"timeout_s must be > 0 and retry_after_s >= 0, got {timeout_s}, "
                          f"{retry_after_s}")
        if not isinstance(key_prefix, bytes):
            raise L3Error(f"key_prefix must be bytes, got {key_prefix!r}")
        self.cluster = isinstance(self.url, list)
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.batch_pages = max(1, int(batch_bytes) // (self.page_bytes + self._head_len))
        self.key_prefix = key_prefix
        self._client = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._check_policy = check_policy
        self.last_error: BaseException | None = None
        import redis  # the optional dependency: pip install 'hicache[redis]'
        from redis.backoff import NoBackoff
        from redis.connection import PythonRespSerializer
        from redis.retry import Retry
        self._redis = redis
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ClusterError, redis.exceptions.BusyLoadingError,
                        OSError, IndexError)  # IndexError: a cluster client with no live node
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        self._client_kw = dict(
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
            command_packer=PythonRespSerializer(6000, encoder.encode))
        self._connect()  # best effort: an unreachable server is a miss now, retried later

    # ---- connection -----------------------------------------------------------------------------
    def _connect(self):
        """The client, created on first use (a cluster client needs a live node to start)."""
        with self._client_lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            r = self._redis
            try:
                if self.cluster:
                    nodes = []
                    for u in self.url:
                        p = urlsplit(u)
                        nodes.append(r.cluster.ClusterNode(p.hostname, p.port or 6379))
                    kw = dict(self._client_kw)
                    kw.pop("command_packer")  # the cluster client builds its own connections
                    client = r.RedisCluster(startup_nodes=nodes, **kw)
                else:
                    client = r.Redis.from_url(self.url, **self._client_kw)
                    client.ping()
            except self._errors + (r.exceptions.RedisError,) as e:
                self._fail(e)
                return None
            self._client = client
        if self._check_policy:
            self._check_policy = False
            self._warn_policy(client)
        return client

    def _warn_policy(self, client) -> None:
        try:
            if self.cluster:
                vals = client.config_get("maxmemory*", target_nodes="all")
                conf = next(iter(vals.values())) if isinstance(vals, dict) and any(
                    isinstance(v, dict) for v in vals.values()) else vals
            else:
                conf = client.config_get("maxmemory*")
        except Exception:  # CONFIG may be disabled on a managed server: nothing to check
            return
        conf = {(k.decode() if isinstance(k, bytes) else k):
                (v.decode() if isinstance(v, bytes) else v) for k, v in dict(conf).items()}
        policy = conf.get("maxmemory-policy", "")
        if not policy.startswith("allkeys-") or conf.get("maxmemory") in ("0", None):
            warnings.warn(f"L3 Redis {self.url}: maxmemory={conf.get('maxmemory')} "
                          f"maxmemory-policy={policy}; set maxmemory and an allkeys-lru policy "
                          "or the server fills up and refuses writes", stacklevel=3)

    def _fail(self, err: BaseException) -> None:
        """The server is unavailable: count it and answer at once for ``retry_after_s``."""
        self._bump(errors=1)
        self._down_until = time.monotonic() + self.retry_after_s
        self.last_error = err
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def _pipeline(self, commands: list[tuple]) -> list | None:
        """Run commands in one pipelined round trip (cluster: grouped by node). Per-command
        errors come back as exception objects; None when the server is unavailable."""
        client = self._connect()
        if client is None:
            return None
        try:
            pipe = client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return pipe.execute(raise_on_error=False)
        except self._errors + (self._redis.exceptions.RedisError,) as e:
            self._fail(e)
            return None

    def _rkey(self, key: bytes) -> bytes:
        return self.key_prefix + key

    # ---- the contract ---------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        keys = self.check_keys(keys)
        if not keys:
            return 0
        res = self._pipeline([("EXISTS", self._rkey(k)) for k in keys])
        if res is None:
            return 0
        n = 0
        for r in res:
            if r != 1:  # 0, or an error object for this key's node
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes], out: Out) -> int:
        keys = self.check_keys(keys)
        if not keys:
            return 0
        dst_of = self._destinations(keys, out)
        t0 = time.perf_counter()
        served, bad, stop = 0, None, False
        hl, pb = self._head_len, self.page_bytes
        for lo in range(0, len(keys), self.batch_pages):
            batch = keys[lo:lo + self.batch_pages]
            vals = self._pipeline([("GET", self._rkey(k)) for k in batch])
            if vals is None:
                break
            for i, (k, v) in enumerate(zip(batch, vals), start=lo):
                if not isinstance(v, bytes):  # absent (None) or this key's node failed
                    stop = True
                    break
                view = memoryview(v)
                if len(v) != hl + pb or not self._valid(k, view[:hl], view[hl:]):
                    bad, stop = k, True
                    break
                dst = dst_of(i)
                self.check_tensor(dst, f"destination {i}")
                copy_into(dst, view[hl:], pb)
                served += 1
            if stop:
                break
        self._bump(hits=served, misses=int(served < len(keys)), corrupt=int(bad is not None),
                   bytes_read=served * pb, read_s=time.perf_counter() - t0)
        if bad is not None and self.writer:
            self.delete([bad])
        return served

    def put(self, keys: Sequence[bytes], shards: Sequence[torch.Tensor]) -> PutResult:
        keys = self.check_keys(keys)
        payloads = self._payloads(keys, shards)
        if not keys:
            return PutResult(())
        t0 = time.perf_counter()
        items = dict(zip(keys, payloads))  # one key twice (merged submissions): stored once
        uniq = list(items)
        stored: dict[bytes, bool] = {}
        written = nbytes = skipped = dropped = 0
        # TOUCH: 1 when held (and refreshed for the LRU), 0 when absent.
        held = self._pipeline([("TOUCH", self._rkey(k)) for k in uniq])
        if held is not None:
            for k, h in zip(uniq, held):
                if h == 1:
                    stored[k] = True
                    skipped += 1
            fresh = [k for k in uniq if k not in stored]
            for lo in range(0, len(fresh), self.batch_pages):
                batch = fresh[lo:lo + self.batch_pages]
                cmds = []
                for k in batch:
                    p = items[k]
                    value = b"".join((self._head_prefix, checksum(k, p), p))
                    cmds.append(("SET", self._rkey(k), value, "NX"))
                res = self._pipeline(cmds)
                if res is None:
                    break
                for k, r in zip(batch, res):
                    if r is True or r == b"OK":  # written now
                        stored[k] = True
                        written += 1
                        nbytes += self.page_bytes
                    elif r is None or r is False:  # NX: another writer stored it meanwhile
                        stored[k] = True
                        skipped += 1
                    # else an error for this key (e.g. OOM with a noeviction server): not stored
        dropped = len(uniq) - written - skipped
        self._bump(pages_written=written, pages_skipped=skipped, pages_dropped=dropped,
                   bytes_written=nbytes, write_s=time.perf_counter() - t0)
        return PutResult(tuple(stored.get(k, False) for k in keys), written)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not self.writer:
            raise L3Error("this L3 store was opened with writer=False; delete is not allowed")
        keys = self.check_keys(keys)
        if not keys:
            return 0
        res = self._pipeline([("DEL", self._rkey(k)) for k in keys])
        return 0 if res is None else sum(1 for r in res if r == 1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    # ---- introspection --------------------------------------------------------------------------
    def raw_client(self):
        """The underlying redis client (None while the server is unavailable): for tools."""
        return self._connect()
