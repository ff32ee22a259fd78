"""Authenticated L3: a fleet secret keys where a page is stored and a MAC over what is stored.

Anyone who can reach a shared store (Redis) can write to it. With a fleet secret:
- **keys**: the store key of a page is ``namespace | rank | H_k(chain hash)`` where ``H_k`` is
  BLAKE3 in keyed mode under a key derived from the secret: nobody without the secret can
  compute where a prompt's pages live, so nobody can plant values for a prompt in advance;
- **values**: ``header | tag | payload`` where the tag is a BLAKE3 keyed MAC (16 bytes) over the
  store key, the header and the payload; a value whose tag does not verify is a miss, counted
  (``auth_failures``), never served, and replaced by the next writer.

Two secrets may be given for a rotation: ``current`` (writes, and the first place reads look)
and ``previous`` (reads still find what it keyed and signed). Each secret vouches only for the
keys it derived (:mod:`hicache.l3.keyed`), so a leaked previous secret cannot sign values under
the current secret's keys.

A shared backend opened without a secret is refused (:func:`unauthenticated`) wherever it is
opened from: a policy ``[l3]`` section, ``open_store`` on a URL, the engine adapters (their
extra config is a :class:`Trust`); ``authenticate = false`` runs it with one warning line.

The secret is a file readable by its owner only (``[l3] secret_file``, or the file named by
``$HICACHE_L3_SECRET_FILE``; ``previous_secret_file`` / ``$HICACHE_L3_PREVIOUS_SECRET_FILE``).
The secret's bytes never leave this module: :class:`Secret` keeps derived keys and prints as
its fingerprint.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import blake3

from ..errors import ConfigError

ENV = "HICACHE_L3_SECRET_FILE"
ENV_PREVIOUS = "HICACHE_L3_PREVIOUS_SECRET_FILE"
TAG_BYTES = 16
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
_KEYS_CONTEXT = "hicache 2026 L3 store keys"
_MAC_CONTEXT = "hicache 2026 L3 value MAC"
_ID_CONTEXT = "hicache 2026 L3 secret fingerprint"

log = logging.getLogger("hicache")


@dataclass(frozen=True)
class Secret:
    """Keys derived from one fleet secret (the secret itself is not kept)."""

    key_key: bytes = field(repr=False)   # keys the store key derivation
    mac_key: bytes = field(repr=False)   # keys the value MAC
    fingerprint: str = ""                # 8 hex digits naming the secret in logs

    @classmethod
    def from_bytes(cls, secret: bytes) -> "Secret":
        return cls(blake3.blake3(secret, derive_key_context=_KEYS_CONTEXT).digest(),
                   blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest(),
                   blake3.blake3(secret, derive_key_context=_ID_CONTEXT).hexdigest()[:8])

    def store_chain(self, chain: bytes) -> bytes:
        """The keyed chain part of a store key (same length as the chain hash)."""
        return blake3.blake3(chain, key=self.key_key).digest(length=len(chain))

    def tag(self, key: bytes, head: bytes, payload) -> bytes:
        h = blake3.blake3(key=self.mac_key, max_threads=1)
        h.update(key)
        h.update(head)
        h.update(payload)
        return h.digest(length=TAG_BYTES)


@dataclass(frozen=True)
class Secrets:
    """The current secret (writes) and the previous one (reads still accept it)."""

    current: Secret
    previous: Optional[Secret] = None

    @property
    def all(self) -> tuple:
        return (self.current,) if self.previous is None else (self.current, self.previous)


# kernel file systems whose "files" are generated as they are read: never a secret's home
PSEUDO_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "debugfs", "tracefs",
                       "securityfs", "cgroup", "cgroup2", "configfs", "efivarfs", "bpf",
                       "pstore", "fusectl", "binfmt_misc", "mqueue", "hugetlbfs", "autofs"})


def file_system(path: str) -> Optional[str]:
    """The type of the file system ``path`` lives on (the longest mount point above it in
    ``/proc/self/mountinfo``), or None where that cannot be read."""
    real = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].encode().decode("unicode_escape")  # \040 for a space
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0]
    except OSError:
        return None
    return fstype


def _read_whole(fd: int, path: str, what: str, size: int) -> bytes:
    """Every byte of an open secret file, at most MAX_SECRET_BYTES (never cut: over the bound,
    or a length other than the one the file system reported, is refused)."""
    chunks, n = [], 0
    while n <= MAX_SECRET_BYTES:
        b = os.read(fd, MAX_SECRET_BYTES + 1 - n)
        if not b:
            break
        chunks.append(b)
        n += len(b)
    if n > MAX_SECRET_BYTES:
        raise ConfigError(f"{what}: {path!r} holds over {MAX_SECRET_BYTES} bytes; a secret is "
                          f"at most {MAX_SECRET_BYTES}")
    if n != size:
        raise ConfigError(f"{what}: {path!r} reads {n} bytes but its size is {size}: not a file "
                          "on a real file system (a kernel file?); put the secret in a file")
    return b"".join(chunks)


def read_secret(path: str, what: str) -> Secret:
    """A secret file: a regular file on a real file system (not procfs, sysfs or a device) that
    only its owner can read or write, 16..4096 bytes (surrounding whitespace dropped), read
    whole. ConfigError (one line naming ``what``) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ConfigError(f"{what}: cannot open {path!r}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {path!r} is not a regular file")
        fs = file_system(path)
        if fs in PSEUDO_FS:
            raise ConfigError(f"{what}: {path!r} is on a {fs} file system (generated by the "
                              "kernel), not a secret file; put the secret in a file of its own")
        if st.st_mode & 0o077:
            raise ConfigError(f"{what}: {path!r} is readable or writable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{what}: {path!r} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()})")
        if st.st_size > MAX_SECRET_BYTES:
            raise ConfigError(f"{what}: {path!r} is {st.st_size} bytes; a secret is at most "
                              f"{MAX_SECRET_BYTES}")
        data = _read_whole(fd, path, what, st.st_size).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"{what}: {path!r} holds {len(data)} bytes; a secret needs at least "
                          f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)")
    return Secret.from_bytes(data)


def load(l3: Any, env: Optional[dict] = None) -> Optional[Secrets]:
    """The secrets an ``[l3]`` section names (its ``secret_file`` / ``previous_secret_file``,
    else the environment's); None when no secret is given."""
    env = os.environ if env is None else env
    cur = getattr(l3, "secret_file", "") or env.get(ENV, "")
    prev = getattr(l3, "previous_secret_file", "") or env.get(ENV_PREVIOUS, "")
    key = "l3.secret_file" if getattr(l3, "secret_file", "") else f"${ENV}"
    if not cur:
        if prev:
            raise ConfigError("l3.previous_secret_file: given without a current secret "
                              "(l3.secret_file)")
        return None
    current = read_secret(cur, key)
    previous = None
    if prev:
        pkey = ("l3.previous_secret_file" if getattr(l3, "previous_secret_file", "")
                else f"${ENV_PREVIOUS}")
        previous = read_secret(prev, pkey)
        if previous.mac_key == current.mac_key:
            previous = None
    return Secrets(current, previous)


@dataclass(frozen=True)
class Trust:
    """The fleet-secret keys of a store opened from a bare URL or directory (``open_store``'s
    ``trust``, the engine adapters' extra config): the policy ``[l3]`` section's keys, the same
    rule."""

    secret_file: str = ""
    previous_secret_file: str = ""
    authenticate: bool = True

    def __post_init__(self) -> None:
        for key in ("secret_file", "previous_secret_file"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}: must be a path (str), got {getattr(self, key)!r}")
        if not isinstance(self.authenticate, bool):
            raise ConfigError(f"authenticate: must be true or false, got {self.authenticate!r}")

    @classmethod
    def of(cls, extra: Any) -> "Trust":
        """The trust keys of an adapter's extra config (a dict; absent keys: the defaults)."""
        extra = extra or {}
        return cls(secret_file=extra.get("secret_file") or "",
                   previous_secret_file=extra.get("previous_secret_file") or "",
                   authenticate=extra.get("authenticate", True))


_WARNED: set = set()
_WARNED_LOCK = threading.Lock()


def unauthenticated(l3: Any, shared: bool, backend: str, prefix: str = "l3.") -> None:
    """A shared backend without a secret: refused (one line: ConfigError), unless the
    explicit ``authenticate = false``, which says so once per process (a warning line on the
    ``hicache`` logger)."""
    if not shared:
        return
    if getattr(l3, "authenticate", True):
        raise ConfigError(f"{prefix}secret_file: the {backend} backend is shared by every client "
                          f"of the server, so L3 needs a fleet secret ({prefix}secret_file or "
                          f"${ENV}: a file only its owner can read); set {prefix}authenticate = "
                          "false to run it unauthenticated")
    with _WARNED_LOCK:
        if backend in _WARNED:
            return
        _WARNED.add(backend)
    log.warning("hicache: warning: the %s L3 backend runs without a fleet secret "
                "(%sauthenticate = false): any client of the server can plant or replace the KV "
                "this engine is served", backend, prefix)


def required(l3: Any, shared: bool, backend: str, prefix: str = "l3.") -> Optional[Secrets]:
    """:func:`load`, and the refusal of a shared backend without a secret (unless ``[l3]
    authenticate = false``, which warns once)."""
    secrets = load(l3)
    if secrets is None:
        unauthenticated(l3, shared, backend, prefix)
    return secrets
