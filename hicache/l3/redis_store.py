"""RedisStore: the L3 page store on a Redis (7+) / Valkey (8+) server or Redis Cluster.

One value per (namespace, rank, chain hash), ``header | checksum | payload`` (see
:mod:`hicache.l3.base`), so server-side eviction drops a whole page or nothing. Keys are
``key_prefix + store key`` (no hash tag: a rank's consecutive pages spread over a cluster's
shards). Capacity is the server's ``maxmemory`` with an ``allkeys-lru`` (or -lfu) policy: a page
evicted under a running restore is a miss for the tail, never a wrong page.

Requests are pipelined: ``exists_prefix`` one round trip of EXISTS, ``get`` GETs in batches of
about ``batch_bytes`` of payload, ``put`` one round trip per such batch: ``SET NX`` of each page
(the server keeps a value already there and refreshes its LRU clock), or ``TOUCH`` for a page this
store already knows held (it wrote, skipped or served it; a bounded, in-process hint), so a page
restored from L3 and written back is refreshed, not resent. A hinted page found gone is sent with
``SET NX`` in one more round trip. A page held by the server but unknown to this store is sent once
more and dropped by NX. In cluster mode the client's cluster pipeline groups the commands by node.
The client is ``redis`` with the ``hiredis`` parser and the pure-Python command packer, which sends
a large value as its own buffer instead of copying it into one packed request (``python
bench/l3.py --shapes`` measures the four combinations); a value goes out as three buffers
(header, checksum, the caller's payload memory), never joined into one copy.

An unavailable server (refused, reset, timed out, restarting, cluster down) never raises: the call
answers a miss or "not stored", is counted in ``stats.errors``, and for ``retry_after_s`` later
calls answer the same at once without touching the network, so a dead server costs serving at
most one ``timeout_s`` per ``retry_after_s``. Every socket operation has ``timeout_s``.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from typing import Sequence
from urllib.parse import urlsplit

import torch

from .base import L3Store, Out, PutResult, copy_into
from .redis_backend import parse_url, redact
from .keys import Namespace
from ..errors import L3Error

HINT_KEYS = 1 << 15  # keys a store remembers as held (to TOUCH instead of resending their pages)


class _Value(tuple):
    """One bulk-string argument given as several buffers (header, checksum, payload)."""


def _packer(encode):
    """The pure-Python command packer, taught to send a :class:`_Value` as one bulk string made
    of its buffers (a large payload stays the caller's memory: no join, no copy)."""
    from redis.connection import PythonRespSerializer

    class Packer(PythonRespSerializer):
        def pack(self, *args):
            if not any(type(a) is _Value for a in args):
                return super().pack(*args)
            out, buff = [], b"*%d\r\n" % len(args)
            for a in args:
                if type(a) is not _Value:
                    a = self.encode(a)
                    buff = b"".join((buff, b"$%d\r\n" % len(a), a, b"\r\n"))
                    continue
                parts = [memoryview(p).cast("B") for p in a]
                buff += b"$%d\r\n" % sum(len(p) for p in parts)
                for p in parts:
                    if len(p) <= self._buffer_cutoff:  # header, checksum: into the request
                        buff += p
                    else:  # the payload: its own buffer, sent from the caller's memory
                        out += (buff, p)
                        buff = b""
                buff += b"\r\n"
            out.append(buff)
            return out

    return Packer(6000, encode)


def _conf(reply) -> dict:
    """A CONFIG GET reply as a dict of str."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes)
            else v) for k, v in dict(reply).items()}


def _close_quietly(client) -> None:
    """Close a client that is being dropped (the server may already be gone)."""
    if client is None:
        return
    try:
        client.close()
    except Exception:
        pass


USAGE_TTL_S = 5.0  # a metrics scrape reads the server's usage at most this often


class RedisStore(L3Store):
    """Page store of this rank's shards on a Redis / Valkey server or cluster. Thread-safe."""

    backend_name = "redis"

    def __init__(self, url: str | Sequence[str], namespace: Namespace, rank: int, *,
                 writer: bool = True, timeout_s: float = 2.0, retry_after_s: float = 1.0,
                 batch_bytes: int = 32 << 20, key_prefix: bytes = b"hicache:",
                 check_policy: bool = True, secrets=None) -> None:
        self._init_common(namespace, rank, writer, secrets)
        self.url = parse_url(url)
        if not timeout_s > 0 or retry_after_s < 0:
            raise L3Error(f"timeout_s must be > 0 and retry_after_s >= 0, got {timeout_s}, "
                          f"{retry_after_s}")
        if not isinstance(key_prefix, bytes):
            raise L3Error(f"key_prefix must be bytes, got {key_prefix!r}")
        self.cluster = isinstance(self.url, list)
        self.timeout_s = float(timeout_s)
        self.retry_after_s = float(retry_after_s)
        self.batch_pages = max(1, int(batch_bytes) // self.page_bytes)
        self.key_prefix = key_prefix
        self._client = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._check_policy = check_policy
        self._held: OrderedDict[bytes, None] = OrderedDict()  # hint: keys seen held, newest last
        self.last_error: BaseException | None = None
        self.first_error: BaseException | None = None  # for the run's one warning line
        self._connected_once = False
        self.error_reasons: dict[str, int] = {}  # unavailable calls by registry.KINDS reason
        self._usage: tuple[float, object] | None = None  # (when, registry.Usage)
        from .redis_backend import record_key
        self._record = (record_key(namespace.digest, key_prefix), namespace.record())
        import redis  # the optional dependency: pip install 'hicache[redis]'
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self._redis = redis
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                        redis.exceptions.ClusterError, redis.exceptions.BusyLoadingError,
                        OSError, IndexError)  # IndexError: a cluster client with no live node
        from .cluster_route import ClusterRouter
        self._router = ClusterRouter(
            (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError),
            self.retry_after_s, self._count_error,
            ",".join(redact(self.url)) if self.cluster else redact(self.url))
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        self._client_kw = dict(
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
            command_packer=_packer(encoder.encode))
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
                    packer = kw.pop("command_packer")  # the cluster builds its connections

                    class Connection(r.Connection):
                        def __init__(self, **ckw):
                            super().__init__(**ckw, command_packer=packer)

                    # url=: the node connections come from a pool of our connection class
                    host, port = nodes[0].host, nodes[0].port
                    host = f"[{host}]" if ":" in host else host  # an IPv6 literal
                    client = r.RedisCluster(url=f"redis://{host}:{port}",
                                            startup_nodes=nodes[1:],
                                            require_full_coverage=False,
                                            connection_class=Connection, **kw)
                else:
                    client = r.Redis.from_url(self.url, **self._client_kw)
                    client.ping()
            except self._errors + (r.exceptions.RedisError,) as e:
                self._fail(e)
                if not self._connected_once and self._tls_mismatch(e):
                    raise L3Error(f"L3 Redis {redact(self.url)}: the TLS handshake failed "
                                  f"({type(e).__name__}: {e}); is the server plaintext "
                                  "(redis://)? L3 is off for this run") from None
                return None
            self._client = client
            self._connected_once = True
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
        conf = _conf(conf)
        policy = conf.get("maxmemory-policy", "")
        if not policy.startswith("allkeys-") or conf.get("maxmemory") in ("0", None):
            warnings.warn(f"L3 Redis {redact(self.url)}: maxmemory={conf.get('maxmemory')} "
                          f"maxmemory-policy={policy}; set maxmemory and an allkeys-lru policy "
                          "or the server fills up and refuses writes", stacklevel=3)
        if self.cluster:
            self._warn_coverage(client)

    def _warn_coverage(self, client) -> None:
        """A cluster whose nodes require full slot coverage refuses EVERY key while one shard
        has no live node: say so once (``cluster-require-full-coverage no`` keeps the rest)."""
        try:
            vals = client.config_get("cluster-require-full-coverage", target_nodes="all")
        except Exception:  # CONFIG disabled: nothing to check
            return
        confs = vals.values() if isinstance(vals, dict) and any(
            isinstance(v, dict) for v in vals.values()) else [vals]
        if any(_conf(c).get("cluster-require-full-coverage") == "yes" for c in confs):
            warnings.warn(f"L3 Redis cluster {redact(self.url)}: cluster-require-full-coverage "
                          "yes; one shard without a live node then makes every node refuse "
                          "every key (all of L3 misses); set it to no", stacklevel=4)

    def _count_error(self, err: BaseException) -> None:
        """One call (or one cluster node's share of it) found the store unavailable."""
        from .redis_backend import classify
        reason = classify(err)
        with self._lock:
            self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1
        self._bump(errors=1)
        self.last_error = err
        if self.first_error is None:
            self.first_error = err

    def _fail(self, err: BaseException) -> None:
        """The server is unavailable: count it and answer at once for ``retry_after_s``."""
        self._count_error(err)
        self._down_until = time.monotonic() + self.retry_after_s
        client, self._client = self._client, None
        _close_quietly(client)

    def _tls_mismatch(self, e: BaseException) -> bool:
        """A first connection over ``rediss://`` that failed in the TLS handshake (or timed out
        in it, the server waiting for a command that never comes): a plaintext server."""
        from .redis_backend import classify
        urls = self.url if isinstance(self.url, list) else [self.url]
        if not any(u.startswith("rediss://") for u in urls):
            return False
        return classify(e) in ("tls", "timeout")

    def _pipeline(self, commands: list[tuple]) -> list | None:
        """Run commands in one pipelined round trip (cluster: grouped by node). Per-command
        errors come back as exception objects; None when the server is unavailable."""
        client = self._connect()
        if client is None:
            return None
        try:
            if self.cluster:  # node by node: a dead shard costs its own keys only
                return self._router.run(client, commands)
            pipe = client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return pipe.execute(raise_on_error=False)
        except self._errors + (self._redis.exceptions.RedisError,) as e:
            self._fail(e)
            return None

    def _replies(self, commands: list[tuple]):
        """Yield the reply of each command as it arrives (an exception object for a command the
        server refused), so a large value is checked and copied while still in the CPU cache;
        stops early when the server is unavailable (counted). One round trip; a cluster goes
        through its pipeline (grouped by node) and yields when all replies are in."""
        client = self._connect()
        if client is None:
            return
        if self.cluster:
            yield from self._pipeline(commands) or ()
            return
        r = self._redis
        pool, conn, left = client.connection_pool, None, len(commands)
        try:
            conn = pool.get_connection()
            conn.send_packed_command(conn.pack_commands(commands))
            while left:
                try:
                    reply = conn.read_response()
                except r.exceptions.ResponseError as e:  # this command failed, not the link
                    reply = e
                left -= 1
                yield reply
        except self._errors + (r.exceptions.RedisError,) as e:
            self._fail(e)
        finally:
            if conn is not None:
                if left:  # replies left unread (failure, or the caller stopped): drop the link
                    conn.disconnect()
                pool.release(conn)

    def _rkey(self, key: bytes) -> bytes:
        return self.key_prefix + key

    def _hint(self, held: Sequence[bytes] = (), gone: Sequence[bytes] = ()) -> None:
        """Remember keys seen held (the newest ``HINT_KEYS``) and forget keys seen gone."""
        with self._lock:
            h = self._held
            for k in gone:
                h.pop(k, None)
            for k in held:
                h[k] = None
                h.move_to_end(k)
            while len(h) > HINT_KEYS:
                h.popitem(last=False)

    def _value(self, key: bytes, payload) -> _Value:
        return _Value(self._value_parts(key, payload))

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
            replies, seen = self._replies([("GET", self._rkey(k)) for k in batch]), 0
            try:
                for i, (k, v) in enumerate(zip(batch, replies), start=lo):
                    seen += 1
                    if stop:  # read the rest of this round trip's replies, serve no more
                        continue
                    if not isinstance(v, bytes):  # absent (None) or this key's node failed
                        stop = True
                        continue
                    view = memoryview(v)
                    if len(v) != hl + pb or not self._valid(k, view[:hl], view[hl:]):
                        bad, stop = k, True
                        continue
                    dst = dst_of(i)
                    self.check_tensor(dst, f"destination {i}")
                    copy_into(dst, view[hl:], pb)
                    served += 1
            finally:
                replies.close()
            if stop or seen < len(batch):  # a miss, or the server became unavailable
                break
        self._bump(hits=served, misses=int(served < len(keys)), corrupt=int(bad is not None),
                   bytes_read=served * pb, read_s=time.perf_counter() - t0)
        self._hint(held=keys[:served], gone=keys[served:served + 1])
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
        with self._lock:
            known = {k for k in items if k in self._held}
        stored: dict[bytes, bool] = {}
        written = skipped = 0
        todo, resend = list(items), []  # resend: hinted keys the server no longer holds
        while todo:
            for lo in range(0, len(todo), self.batch_pages):
                batch = todo[lo:lo + self.batch_pages]
                # TOUCH answers 1 (held, LRU refreshed) or 0; SET NX answers OK (written) or
                # None (held: kept, and its LRU clock refreshed by the lookup)
                # the namespace record rides last in each round trip (`hicache l3 ls`)
                res = self._pipeline([("TOUCH", self._rkey(k)) if k in known else
                                      ("SET", self._rkey(k), self._value(k, items[k]), "NX")
                                      for k in batch] + [("SET", *self._record)])
                if res is None:
                    todo = resend = []
                    break
                for k, r in zip(batch, res):
                    if k in known:
                        if r == 1:
                            stored[k] = True
                            skipped += 1
                        elif r == 0:
                            resend.append(k)
                    elif r is True or r == b"OK":
                        stored[k] = True
                        written += 1
                    elif r is None or r is False:  # NX: held already (or stored meanwhile)
                        stored[k] = True
                        skipped += 1
                    # else an error for this key (e.g. OOM with a noeviction server): not stored
            todo, resend, known = resend, [], set()
        self._hint(held=list(stored), gone=[k for k in items if k not in stored])
        self._bump(pages_written=written, pages_skipped=skipped,
                   pages_dropped=len(items) - written - skipped,
                   bytes_written=written * self.page_bytes, write_s=time.perf_counter() - t0)
        return PutResult(tuple(stored.get(k, False) for k in keys), written)

    def delete(self, keys: Sequence[bytes]) -> int:
        if not self.writer:
            raise L3Error("this L3 store was opened with writer=False; delete is not allowed")
        keys = self.check_keys(keys)
        if not keys:
            return 0
        self._hint(gone=keys)
        res = self._pipeline([("DEL", self._rkey(k)) for k in keys])
        return 0 if res is None else sum(1 for r in res if r == 1)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._client_lock:
            client, self._client = self._client, None
        _close_quietly(client)

    # ---- introspection --------------------------------------------------------------------------
    def usage(self):
        """The server's usage (``redis_backend.usage``): keys, bytes, maxmemory; a copy at most
        ``USAGE_TTL_S`` old; None fields while the server is unavailable."""
        from .registry import Usage
        now = time.monotonic()
        with self._lock:
            if self._usage is not None and now - self._usage[0] < USAGE_TTL_S:
                return self._usage[1]
        u, client = Usage(), self._connect()
        if client is not None:
            u = _usage(client, self.cluster, self._errors + (self._redis.exceptions.RedisError,))
        with self._lock:
            self._usage = (now, u)
        return u

    def raw_client(self):
        """The underlying redis client (None while the server is unavailable): for tools."""
        return self._connect()


def _usage(client, cluster: bool, errors: tuple):
    """DBSIZE, ``INFO memory`` used_memory and ``maxmemory`` (a cluster: summed over its
    primaries); a field the server does not answer (CONFIG disabled) is None."""
    from .registry import Usage

    def conf(c) -> int:
        c = {(k.decode() if isinstance(k, bytes) else k): v for k, v in dict(c).items()}
        return int(c.get("maxmemory", 0))

    out = {}
    try:
        if cluster:
            n = client.dbsize(target_nodes=client.PRIMARIES)
            out["pages"] = int(sum(n.values()) if isinstance(n, dict) else n)
        else:
            out["pages"] = int(client.dbsize())
    except errors:
        pass
    try:
        if cluster:
            mem = client.info("memory", target_nodes=client.PRIMARIES)
            out["bytes"] = sum(int(v["used_memory"]) for v in mem.values())
        else:
            out["bytes"] = int(client.info("memory")["used_memory"])
    except errors + (KeyError, TypeError, ValueError):
        pass
    try:
        if cluster:
            cap = sum(conf(v) for v in
                      client.config_get("maxmemory", target_nodes=client.PRIMARIES).values())
        else:
            cap = conf(client.config_get("maxmemory"))
        out["capacity_bytes"] = cap or None  # 0: unlimited
    except errors + (KeyError, TypeError, ValueError):
        pass
    return Usage(**out)
