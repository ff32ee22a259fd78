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

from ..errors import L3Error

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
    extra: dict = field(default_factory=dict)


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
