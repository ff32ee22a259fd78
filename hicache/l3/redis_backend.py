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
from ..errors import ConfigError, L3CorruptError, L3Error

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


BACKEND = registry.register(registry.Backend(
    name="redis", section=RedisSection, open=open_store, preflight=preflight, errors=errors,
    classify=classify, fixture=fixture, shared=True, describe=describe, claims=claims,
    section_of=lambda where: {"url": where}, complete=complete,
    public=lambda table: {**table, "url": redact(table.get("url", ""))}))
