"""The Redis / Valkey backend's registration: ``[l3.redis]`` keys, URL rules, preflight, error
meaning, test fixture.

The store itself is :class:`hicache.l3.redis_store.RedisStore`; it (and ``redis``) is imported
only when a store is opened, never by importing this module.
"""

from __future__ import annotations

import os
import socket
import ssl
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from . import registry
from ..config import opt
from ..errors import ConfigError, L3CorruptError, L3Error, L3PartialError

SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class RedisSection:
    url: Any = opt("", "redis://host:port/db, rediss://... (TLS), unix:///path.sock, or a list "
                       "of redis://host:port cluster nodes", type=(str, list, tuple))
    timeout_s: float = opt(2.0, "bound on every call (connect, read, write) in seconds",
                           min=0.001, max=600.0, type=(int, float))

    def __repr__(self) -> str:  # no password in logs or tracebacks
        return f"RedisSection(url={redact(self.url)!r}, timeout_s={self.timeout_s!r})"

    def __post_init__(self) -> None:
        if isinstance(self.url, list):
            object.__setattr__(self, "url", tuple(self.url))
        if self.url:
            try:
                parse_url(list(self.url) if isinstance(self.url, tuple) else self.url)
            except L3Error as e:
                raise ConfigError(f"l3.redis.url: {e}") from None


def complete(section: RedisSection) -> None:
    if not section.url:
        raise ConfigError("l3.redis.url: the redis backend needs a url (redis://host:port/db, "
                          "unix:///path.sock, or a list of cluster node URLs)")


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
                raise L3Error(f"cluster node {redact(u)!r}: cluster nodes are host:port, not "
                              "unix sockets")
            if parts.path not in ("", "/", "/0"):
                raise L3Error(f"cluster node {redact(u)!r}: a cluster has only database 0")
            out.append(u)
        return out
    if not isinstance(url, str):
        raise L3Error(f"a Redis URL must be a string or a list of node URLs, got {type(url)}")
    parts = _split(url)
    if parts.scheme != "unix":
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise L3Error(f"{redact(url)!r}: the database must be a number (redis://host:port/0)")
    return url


def _split(url: str):
    try:
        parts = urlsplit(url)
        port = parts.port  # raises for a non-numeric port
    except ValueError as e:
        raise L3Error(f"bad Redis URL {redact(url)!r}: {e}") from None
    if parts.scheme not in SCHEMES:
        raise L3Error(f"bad Redis URL {redact(url)!r}: the scheme must be one of "
                      f"{', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise L3Error(f"bad Redis URL {redact(url)!r}: unix:// needs a socket path "
                          "(unix:///path)")
    elif not parts.hostname:
        raise L3Error(f"bad Redis URL {redact(url)!r}: no host (redis://host:port/db)")
    del port
    return parts


def redact(url: Any) -> Any:
    """``url`` with its password replaced by ``***`` (a list: each URL). Never raises."""
    if isinstance(url, (list, tuple)):
        return type(url)(redact(u) for u in url)
    if not isinstance(url, str):
        return url
    try:
        p = urlsplit(url)
        if p.password is None:
            return url
        user = p.username or ""
        host = p.netloc.rsplit("@", 1)[1]
        return urlunsplit((p.scheme, f"{user}:***@{host}", p.path, p.query, p.fragment))
    except ValueError:
        return "<unparsable url>" if "@" in url else url


def describe(section: RedisSection) -> str:
    u = redact(section.url)
    return ",".join(u) if isinstance(u, tuple) else str(u)


def open_store(section: RedisSection, namespace, rank: int, *, writer: bool = True,
               capacity_bytes: int | None = None, timeout_s: float | None = None, **options):
    from .redis_store import RedisStore
    del capacity_bytes  # the server's maxmemory
    url = list(section.url) if isinstance(section.url, tuple) else section.url
    return RedisStore(url, namespace, rank, writer=writer,
                      timeout_s=timeout_s if timeout_s is not None else section.timeout_s,
                      **options)


def preflight(section: RedisSection, page_bytes: int) -> list[str]:
    complete(section)
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ConfigError("l3.backend: \"redis\" needs the redis package (pip install "
                          "'hicache[redis]')") from None
    return []


def errors() -> tuple:
    import redis
    return (L3Error, OSError, redis.exceptions.RedisError)


def classify(e: BaseException) -> str:
    """What a backend exception means: timeout, refused, auth, tls, full, corrupt or other."""
    text = str(e)
    name = type(e).__name__
    if isinstance(e, L3CorruptError):
        return "corrupt"
    if isinstance(e, (ssl.SSLError,)) or "SSL" in text or "ssl" in name.lower() \
            or "wrong version number" in text:
        return "tls"
    if "AuthenticationError" in name or "AuthorizationError" in name or any(
            w in text for w in ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password",
                                "invalid username-password")):
        return "auth"
    if isinstance(e, (TimeoutError, socket.timeout)) or "Timeout" in name or \
            "timed out" in text.lower():
        return "timeout"
    if isinstance(e, ConnectionRefusedError) or "refused" in text.lower() or \
            "No such file" in text or "Error 111" in text or "Error 2 " in text:
        return "refused"
    if text.startswith("OOM") or "maxmemory" in text:
        return "full"
    return "other"


def claims(where) -> bool:
    if isinstance(where, (list, tuple)):
        return True
    return isinstance(where, str) and where.startswith(tuple(s + "://" for s in SCHEMES))


def _raw(store):
    import redis
    return redis.Redis.from_url(store.url, socket_timeout=5) if isinstance(store.url, str) \
        else redis.RedisCluster.from_url(store.url[0], socket_timeout=5)


def _tamper(store, key: bytes) -> None:
    with _raw(store) as c:
        v = bytearray(c.get(store.key_prefix + key))
        v[-1 - (len(v) - store._head_len) // 2] ^= 0xFF
        c.set(store.key_prefix + key, bytes(v))


def _raw_put(store, key: bytes, value: bytes) -> None:
    with _raw(store) as c:
        c.set(store.key_prefix + key, value)


@contextmanager
def fixture(scratch: str):
    from .localserver import start_server
    srv = start_server(os.path.join(scratch, "redis"), unix=True, maxmemory=64 << 20)
    try:
        yield registry.StoreFixture({"url": srv.url}, _tamper, _raw_put)
    finally:
        srv.stop()


KEY_PREFIX = b"hicache:"  # RedisStore's default key_prefix
RECORD = b"ns:"  # KEY_PREFIX + RECORD + hex digest -> Namespace.record()
_KEY = 34  # namespace digest (16) | rank (2) | chain (16)
_RECORD_KEY = len(RECORD) + 32


def record_key(digest: bytes, key_prefix: bytes = KEY_PREFIX) -> bytes:
    return key_prefix + RECORD + digest.hex().encode()


def _glob(raw: bytes) -> bytes:
    """``raw`` escaped for a SCAN MATCH pattern."""
    return b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in raw)


def admin_client(section: RedisSection):
    """A plain client for operator tools (one ``timeout_s`` bound on every call); L3Error
    naming the store and what went wrong when it cannot be reached."""
    complete(section)
    try:
        import redis
    except ImportError:
        raise L3Error("a Redis URL needs the redis package: pip install 'hicache[redis]'") \
            from None
    url = list(section.url) if isinstance(section.url, tuple) else section.url
    kw = dict(socket_timeout=section.timeout_s, socket_connect_timeout=section.timeout_s)
    try:
        if isinstance(url, list):  # the first node's URL carries credentials and TLS
            nodes = [redis.cluster.ClusterNode(p.hostname, p.port or 6379)
                     for p in map(urlsplit, url[1:])]
            client = redis.RedisCluster.from_url(url[0], startup_nodes=nodes or None, **kw)
        else:
            client = redis.Redis.from_url(url, **kw)
        client.ping()
    except (redis.exceptions.RedisError, OSError, IndexError) as e:
        raise L3Error(f"cannot reach the L3 store {describe(section)}: {classify(e)}: "
                      f"{registry.scrub(str(e)).splitlines()[0] if str(e) else type(e).__name__}"
                      ) from None
    return client


def _scan_keys(client, pattern: bytes):
    """Every key matching ``pattern`` (a cluster: on every primary), in batches."""
    batch = []
    for k in client.scan_iter(match=pattern, count=1000):
        batch.append(bytes(k))
        if len(batch) >= 1000:
            yield batch
            batch = []
    if batch:
        yield batch


def _nodes(client) -> list:
    """``(name, plain client)`` per primary of a cluster (a standalone server: itself)."""
    import redis
    if isinstance(client, redis.RedisCluster):
        return [(f"{n.host}:{n.port}", client.get_redis_connection(n))
                for n in client.get_primaries()]
    return [("server", client)]


def _per_node(section: RedisSection, what: str, fn, result):
    """Run ``fn(node client)`` on every primary; a node that fails is named, the others still
    run. L3PartialError (carrying ``result``: what the reachable nodes answered) when any
    failed."""
    import redis
    client = admin_client(section)
    reached, lost = [], []
    try:
        for name, node in _nodes(client):
            try:
                fn(node)
                reached.append(name)
            except (redis.exceptions.RedisError, OSError) as e:
                lost.append(f"{name} ({classify(e)})")
    finally:
        client.close()
    if lost:
        raise L3PartialError(
            f"{what} {describe(section)}: cluster node(s) {', '.join(lost)} unreachable; "
            f"{what} covered only {', '.join(reached) or 'no node'}", result, reached, lost)
    return result


def scan(section: RedisSection) -> registry.Scan:
    """SCAN the ``hicache:`` keys on every primary (O(keys held): one round trip per thousand
    keys, plus one pipelined STRLEN per key for the bytes) and read the namespace records."""
    n = len(KEY_PREFIX)
    found = registry.Scan({}, {})
    pages, records = found.pages, found.records

    def node_scan(client) -> None:
        for batch in _scan_keys(client, _glob(KEY_PREFIX) + b"*"):
            data = [k for k in batch if len(k) == n + _KEY]
            recs = [k for k in batch if len(k) == n + _RECORD_KEY and k[n:].startswith(RECORD)]
            pipe = client.pipeline(transaction=False)
            for k in data:
                pipe.strlen(k)
            for k in recs:
                pipe.get(k)
            res = pipe.execute(raise_on_error=False)
            for k, size in zip(data, res):
                if not isinstance(size, int) or size == 0:
                    continue  # evicted or deleted meanwhile
                key = (k[n:n + 16], int.from_bytes(k[n + 16:n + 18], "big"))
                c, b = pages.get(key, (0, 0))
                pages[key] = (c + 1, b + size)
            for k, v in zip(recs, res[len(data):]):
                if isinstance(v, bytes):
                    try:
                        records[bytes.fromhex(k[n + len(RECORD):].decode())] = v
                    except ValueError:
                        pass

    return _per_node(section, "listing", node_scan, found)


def purge(section: RedisSection, digest: bytes, rank: int | None) -> tuple[int, int]:
    """SCAN the namespace's keys on every primary and UNLINK them (pipelined, a thousand a
    round trip); then its record. Writers running meanwhile may add pages back."""
    prefix = KEY_PREFIX + digest + (rank.to_bytes(2, "big") if rank is not None else b"")
    total = [0, 0]
    rec = record_key(digest)

    def node_purge(client) -> None:
        for batch in _scan_keys(client, _glob(prefix) + b"*"):
            batch = [k for k in batch if len(k) == len(KEY_PREFIX) + _KEY]
            pipe = client.pipeline(transaction=False)
            for k in batch:
                pipe.strlen(k)
            for k in batch:
                pipe.unlink(k)
            res = pipe.execute(raise_on_error=False)
            for size, gone in zip(res, res[len(batch):]):
                if gone == 1:
                    total[0] += 1
                    total[1] += size if isinstance(size, int) else 0
        if rank is None:  # the record lives on one node: the one whose SCAN finds it
            for batch in _scan_keys(client, _glob(rec)):
                client.unlink(*batch)

    try:
        _per_node(section, "purge", node_purge, total)
    except L3PartialError as e:
        e.partial = tuple(total)
        raise
    return total[0], total[1]


def usage(store) -> registry.Usage:
    """The server (a cluster: every primary, summed): keys held (DBSIZE: every key of the
    database, the namespace records and other applications' keys included), bytes
    (``INFO memory`` used_memory) and capacity (``maxmemory``; None when unlimited). Three O(1)
    commands, answered from a copy at most ``USAGE_TTL_S`` old."""
    return store.usage()


BACKEND = registry.register(registry.Backend(
    name="redis", section=RedisSection, open=open_store, preflight=preflight, errors=errors,
    classify=classify, fixture=fixture, shared=True, describe=describe, claims=claims,
    section_of=lambda where: {"url": where}, complete=complete,
    public=lambda table: {**table, "url": redact(table.get("url", ""))},
    scan=scan, purge=purge, usage=usage))
