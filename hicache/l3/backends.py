"""``open_store``: one entry point to every registered L3 backend (:mod:`hicache.l3.registry`)."""

from __future__ import annotations

from typing import Any

from . import registry
from .base import L3Store
from .keys import Namespace
from ..errors import ConfigError, L3Error


def resolve(where: Any) -> tuple[registry.Backend, Any]:
    """``(backend, its section)`` of an ``open_store`` argument: an ``[l3]`` policy section,
    a Redis URL or a list of cluster node URLs, or an LMDB directory."""
    name = getattr(where, "backend", None)
    if name is not None and hasattr(where, "options"):  # a policy [l3] section
        return registry.get(name), where.options
    if isinstance(where, (str, bytes)) and not where:
        raise L3Error("cannot open an L3 store on an empty path or URL")
    b = registry.for_where(where)
    if b.section_of is None or not (b.claims(where) or b.name == registry.DEFAULT) or \
            not isinstance(where, (str, list, tuple)) and not hasattr(where, "__fspath__"):
        raise L3Error(f"cannot open an L3 store on {where!r}: give a policy [l3] section, a Redis "
                      "URL, a list of cluster node URLs or an LMDB directory")
    try:
        return b, b.section(**b.section_of(where))
    except ConfigError as e:
        raise L3Error(str(e)) from None


_POLICY = object()


def _is_section(where: Any) -> bool:
    return getattr(where, "backend", None) is not None and hasattr(where, "options")


def secrets_for(where: Any, backend: registry.Backend, trust: Any = None):
    """The fleet secrets a store on ``where`` uses: a policy ``[l3]`` section's, else
    ``trust``'s (:class:`hicache.l3.auth.Trust`: the adapters' extra config), else the
    environment's (``$HICACHE_L3_SECRET_FILE``). A shared backend without one is refused
    (one line), unless ``authenticate = false`` (one warning line); None: unauthenticated."""
    from . import auth
    if _is_section(where):
        return auth.required(where, backend.shared, backend.name)
    return auth.required(trust or auth.Trust(), backend.shared, backend.name, prefix="")


def open_store(where: Any, namespace: Namespace, rank: int, *, writer: bool = True,
               capacity_bytes: int | None = None, timeout_s: float | None = None,
               secrets: Any = _POLICY, trust: Any = None, **options) -> L3Store:
    """Open this rank's L3 page store on ``where`` (see :func:`resolve`). ``capacity_bytes``
    and ``timeout_s`` override the section's (where the backend has them); ``secrets``
    (:class:`hicache.l3.auth.Secrets`) overrides :func:`secrets_for`, and ``secrets=None``
    (unauthenticated) on a shared backend needs ``trust=Trust(authenticate=False)`` like any
    other way in; ``options`` go to the backend's store class. An authenticated store comes
    wrapped in :class:`hicache.l3.keyed.KeyedStore`."""
    backend, section = resolve(where)
    if secrets is _POLICY:
        secrets = secrets_for(where, backend, trust)
    elif secrets is None:
        from . import auth
        auth.unauthenticated(where if _is_section(where) else (trust or auth.Trust()),
                             backend.shared, backend.name,
                             prefix="l3." if _is_section(where) else "")
    store = backend.open(section, namespace, rank, writer=writer, capacity_bytes=capacity_bytes,
                         timeout_s=timeout_s, secrets=secrets, **options)
    if secrets is None:
        return store
    from .keyed import KeyedStore
    return KeyedStore(store, secrets)


def __getattr__(name: str):
    if name == "BACKENDS":  # the registry's names (kept for callers of the old constant)
        return registry.names()
    raise AttributeError(name)
