"""The L3 backend registry: the one place that knows which page-store backends exist.

A backend is one module that calls :func:`register` with a :class:`Backend`: its name, its policy
section (``[l3.<name>]``: a frozen dataclass whose fields are ``hicache.config.opt`` keys, validated
like every other policy key), how to open a store, its preflight check, what its exceptions mean
(:data:`KINDS`), a fixture the shared store-contract tests use, and whether other hosts can
reach it (then values must be authenticated). The built-in backends are registered on first use
(:data:`BUILTIN` names their modules), so neither their modules nor ``lmdb`` / ``redis`` are
imported until a policy or a caller names them. Nothing here imports a backend at import time.
"""

from __future__ import annotations

import importlib
import re
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import L3Error, L3PartialError

# name -> the module that registers it (imported when the name is first looked up)
BUILTIN = {"lmdb": "hicache.l3.lmdb_backend", "redis": "hicache.l3.redis_backend"}
DEFAULT = "lmdb"
# what a backend exception means (Backend.classify); "other" for anything else
KINDS = ("timeout", "refused", "corrupt", "auth", "tls", "full", "other")


@dataclass(frozen=True)
class StoreFixture:
    """A private, empty store for tests: ``keys`` are its ``[l3.<name>]`` keys;
    ``tamper(store, key)`` flips one payload byte of the value held under ``key``;
    ``raw_put(store, key, value)`` writes raw value bytes as an outsider would."""

    keys: dict
    tamper: Callable[[Any, bytes], None]
    raw_put: Optional[Callable[[Any, bytes, bytes], None]] = None


@dataclass(frozen=True)
class Backend:
    """What a backend module declares (see the module docstring).

    - ``section``: frozen dataclass of the ``[l3.<name>]`` keys (defaults are a usable section
      or ``complete`` says what is missing);
    - ``open(section, namespace, rank, writer=..., **options)`` -> an ``L3Store``;
    - ``preflight(section, page_bytes)`` -> warnings; ``ConfigError`` naming the key otherwise;
    - ``errors()`` -> exception types a store call may raise when the store itself failed
      (the guard turns them into "L3 off on this rank"), imported lazily;
    - ``classify(exc)`` -> one of :data:`KINDS`;
    - ``fixture(scratch_dir)`` -> a context manager yielding a :class:`StoreFixture`;
    - ``shared``: other hosts reach the store (a fleet secret is required, see ``[l3]
      authenticate``);
    - ``describe(section)``: one line naming the store, with no password;
    - ``claims(where)``: does a bare ``open_store(where)`` value (a URL, a path) belong here;
    - ``section_of(where)``: the ``[l3.<name>]`` keys of such a value;
    - ``complete(section)``: raises ``ConfigError`` when a selected section cannot run;
    - ``before_open(section)``: a check run before opening (None or the reason L3 is off);
    - ``public(table)``: the ``[l3.<name>]`` table (a dict) without secrets (passwords), for
      reports and logs;
    - ``scratch(section)``: a context manager yielding the keys of an empty store of its own
      (a cold run), removed afterwards; None: unsupported.
    - ``scan(section)`` -> :class:`Scan` of the whole store (keys and bytes per namespace digest
      and rank, and the namespace records the writers left); None: listing unsupported;
    - ``purge(section, digest, rank)`` -> ``(keys, bytes)`` deleted: every page of one namespace
      (of one rank when ``rank`` is given) and, for a whole namespace, its record; None:
      unsupported;
    - ``usage(store)`` -> :class:`Usage` of the store an open ``store`` is on (pages, bytes,
      capacity; None where unknown), cheap enough for a metrics scrape; None: unsupported.
    """

    name: str
    section: type
    open: Callable[..., Any]
    preflight: Callable[[Any, int], list]
    errors: Callable[[], tuple]
    classify: Callable[[BaseException], str]
    fixture: Callable[[str], AbstractContextManager]
    shared: bool = False
    describe: Callable[[Any], str] = repr
    claims: Callable[[Any], bool] = lambda where: False
    section_of: Optional[Callable[[Any], dict]] = None
    complete: Callable[[Any], None] = lambda section: None
    before_open: Optional[Callable[[Any], Optional[str]]] = None
    scratch: Optional[Callable[[Any], AbstractContextManager]] = None
    public: Callable[[dict], dict] = lambda table: table
    scan: Optional[Callable[[Any], "Scan"]] = None
    purge: Optional[Callable[[Any, bytes, Optional[int]], tuple]] = None
    usage: Optional[Callable[[Any], "Usage"]] = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scan:
    """What a backend's ``scan`` found: ``pages[(digest, rank)] = (keys, bytes)`` and
    ``records[digest] = raw namespace record`` (``hicache.l3.keys.Namespace.record``)."""

    pages: dict
    records: dict


@dataclass(frozen=True)
class Usage:
    """The whole store an open store is on: pages held, bytes held, capacity in bytes (None
    where the backend cannot tell cheaply)."""

    pages: Optional[int] = None
    bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace held in a store (:func:`namespaces`). ``digest``: 32 hex digits (what
    ``hicache l3 purge --namespace`` takes, or a unique prefix of at least 8); ``namespace``:
    the :class:`hicache.l3.keys.Namespace` its record describes (verified against the digest),
    None when no valid record is held (pages written before records existed, or a forged one)."""

    digest: str
    keys: int
    bytes: int
    ranks: tuple
    namespace: Any = None

    @property
    def model(self) -> str:
        return self.namespace.model if self.namespace is not None else "?"

    @property
    def layout(self) -> str:
        ns = self.namespace
        if ns is None:
            return "?"
        return (f"{ns.name}:{ns.kind} L={ns.num_layers} rows={ns.rows} width={ns.kv_dim} "
                f"{ns.dtype} P={ns.page_size} dcp={ns.dcp_size} I={ns.interleave}"
                + (f" {ns.encoding}" if ns.encoding != "raw" else ""))

    def as_dict(self) -> dict:
        return {"namespace": self.digest, "model": self.model, "layout": self.layout,
                "keys": self.keys, "bytes": self.bytes, "ranks": list(self.ranks)}


_REGISTRY: dict[str, Backend] = {}
_LOCK = threading.RLock()


_CREDENTIALS = re.compile(r"(\w+://[^\s:/@]*:)[^\s@]+@")


def scrub(text: str) -> str:
    """``text`` with any ``scheme://user:password@`` password replaced by ``***``: for lines
    that quote a backend's error messages."""
    return _CREDENTIALS.sub(r"\1***@", str(text))


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend (a module calls this at import). A second backend of one name is an error
    unless ``replace``."""
    if not isinstance(backend, Backend):
        raise L3Error(f"register() takes a Backend, got {type(backend).__name__}")
    if not backend.name.isidentifier() or backend.name != backend.name.lower():
        raise L3Error(f"an L3 backend name is a lowercase identifier, got {backend.name!r}")
    with _LOCK:
        if backend.name in _REGISTRY and not replace:
            raise L3Error(f"L3 backend {backend.name!r} is already registered")
        _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend registered at run time (tests)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every backend name, built-in or registered, without importing any backend."""
    with _LOCK:
        return tuple(dict.fromkeys([*BUILTIN, *_REGISTRY]))


def loaded() -> tuple[str, ...]:
    """Backends whose modules are imported (for tests of the lazy loading)."""
    with _LOCK:
        return tuple(_REGISTRY)


def known(name: str) -> bool:
    return name in names()


def get(name: str) -> Backend:
    """The backend called ``name`` (its module imported now if it is a built-in)."""
    with _LOCK:
        b = _REGISTRY.get(name)
        if b is not None:
            return b
        module = BUILTIN.get(name) if isinstance(name, str) else None
    if module is None:
        raise L3Error(f"unknown L3 backend {name!r}; expected one of {', '.join(names())}")
    importlib.import_module(module)  # registers itself
    with _LOCK:
        b = _REGISTRY.get(name)
    if b is None:
        raise L3Error(f"module {module} did not register the L3 backend {name!r}")
    return b


def for_where(where: Any) -> Backend:
    """The backend a bare ``open_store`` argument (URL, list of URLs, path) belongs to: the
    first other backend that claims it, else the default one (LMDB: a directory)."""
    for name in (n for n in names() if n != DEFAULT):
        b = get(name)
        if b.claims(where):
            return b
    return get(DEFAULT)


# ---- operator tools: list and purge namespaces (``hicache l3 ls`` / ``hicache l3 purge``) --------
def _section(where: Any):
    from .backends import resolve
    return resolve(where)


def namespaces(where: Any) -> list[NamespaceInfo]:
    """Every namespace held in the store on ``where`` (a URL, a list of cluster node URLs, an
    LMDB directory or a policy ``[l3]`` section), the largest first. Keys are grouped by their
    ``namespace digest | rank`` prefix, which a fleet secret leaves readable (it keys only the
    chain part), and described by the namespace records the writers keep beside the pages.
    A cluster with an unreachable node: L3PartialError whose ``partial`` lists what the
    reachable nodes hold."""
    backend, section = _section(where)
    if backend.scan is None:
        raise L3Error(f"the {backend.name} backend cannot list its namespaces")
    try:
        return _infos(backend.scan(section))
    except L3PartialError as e:
        e.partial = _infos(e.partial)
        raise


def _infos(found: Scan) -> list[NamespaceInfo]:
    from .keys import Namespace
    per: dict[bytes, list] = {}
    for (digest, rank), (n, nbytes) in found.pages.items():
        e = per.setdefault(digest, [0, 0, set()])
        e[0] += n
        e[1] += nbytes
        e[2].add(rank)
    for digest in found.records:
        per.setdefault(digest, [0, 0, set()])
    out = []
    for digest, (n, nbytes, ranks) in per.items():
        raw = found.records.get(digest)
        ns = Namespace.from_record(raw, digest) if raw is not None else None
        out.append(NamespaceInfo(digest.hex(), n, nbytes, tuple(sorted(ranks)), ns))
    return sorted(out, key=lambda i: (-i.bytes, i.digest))


def _find(name: Any, held: list[NamespaceInfo]) -> NamespaceInfo:
    if isinstance(name, (bytes, bytearray)):
        name = bytes(name).hex()
    if not isinstance(name, str) or not re.fullmatch(r"[0-9a-fA-F]{8,32}", name or ""):
        raise L3Error(f"namespace {name!r}: give the 32 hex digits `hicache l3 ls` prints "
                      "(or a unique prefix of at least 8)")
    name = name.lower()
    hits = [i for i in held if i.digest.startswith(name)]
    if not hits:
        raise L3Error(f"no namespace {name} in this store (`hicache l3 ls` lists them)")
    if len(hits) > 1:
        raise L3Error(f"namespace prefix {name} is ambiguous: "
                      f"{', '.join(i.digest for i in hits)}")
    return hits[0]


def purge(where: Any, namespace: Any, rank: Optional[int] = None) -> NamespaceInfo:
    """Delete every page of one namespace (a digest, its hex or a unique hex prefix, or a
    ``Namespace``) from the store on ``where``; only ``rank``'s pages when given (the record
    stays then). Other namespaces are untouched. Returns what was deleted (keys, bytes);
    L3Error naming the namespace when the store holds none of it."""
    backend, section = _section(where)
    if backend.purge is None:
        raise L3Error(f"the {backend.name} backend cannot purge a namespace")
    digest = getattr(namespace, "digest", None)
    ns, ranks = (namespace if digest is not None else None), ()
    if digest is None:
        try:
            held = namespaces(where)
        except L3PartialError as e:  # find it among what the reachable nodes hold
            held = e.partial
        found = _find(namespace, held)
        digest, ns, ranks = bytes.fromhex(found.digest), found.namespace, found.ranks
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        raise L3Error(f"rank must be an int >= 0, got {rank!r}")
    ranks = ranks if rank is None else (rank,)
    try:
        n, nbytes = backend.purge(section, bytes(digest), rank)
    except L3PartialError as e:  # what the reachable nodes deleted
        e.partial = NamespaceInfo(bytes(digest).hex(), *e.partial, ranks, ns)
        raise
    return NamespaceInfo(bytes(digest).hex(), n, nbytes, ranks, ns)


def usage(store: Any) -> Optional[Usage]:
    """The whole store an open store (guarded or keyed wrappers included) is on, or None where
    its backend does not say."""
    inner = store
    for attr in ("_store", "inner"):  # GuardedStore, KeyedStore
        inner = getattr(inner, attr, None) or inner
    backend = getattr(inner, "backend_name", None)
    if backend is None:
        return None
    b = get(backend)
    return b.usage(inner) if b.usage is not None else None
