"""The service's tenancy and events parts: a request's scope from what ``admit`` was given and the
policy's ``[tenancy] default_scope``; hit tokens counted by tier and scope kind (public /
scoped, never a scope's name); the DCP group's KV event publisher (``[events]``), kept on the
group's rank 0 and fed by the controller's tier listener and this rank's L3 writes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .scope import Scope, make_scope

TIERS = ("l1", "l2", "l3")
KINDS = ("public", "scoped")


def request_scope(config, scope, public_tokens: int, page_tokens: int) -> "Scope | None":
    """The ``Scope`` a request is admitted in (None: the shared scope): its own, else the
    policy's default scope, else the shared one (UsageError for a bad scope or count)."""
    if scope is None and config.tenancy.default_scope:
        scope = config.tenancy.default_scope
    return make_scope(scope, public_tokens, page_tokens)


def scope_note(scope: "Scope | None") -> tuple:
    """What the per-step content agreement folds in for a request's scope (its tag's hex and
    public pages; ranks that admit one request in two scopes raise ``DivergenceError``)."""
    return ("shared",) if scope is None else (scope.tag.hex(), scope.public_pages)


@dataclass
class ScopeHits:
    """Hit tokens by scope kind and tier: ``{"public": {"l1": n, ...}, "scoped": {...}}``."""
    tokens: dict = field(default_factory=lambda: {k: dict.fromkeys(TIERS, 0) for k in KINDS})

    def add(self, prefix, scope: "Scope | None", page_tokens: int, sign: int = 1) -> None:
        """Count a final prefix's hits (``sign`` -1: take an aborted request's back out)."""
        bound = prefix.prompt_len if scope is None else scope.bound(page_tokens)
        start = 0
        for tier, n in zip(TIERS, (prefix.device_len, prefix.host_len, prefix.storage_len)):
            public = max(0, min(start + n, bound) - start)
            self.tokens["public"][tier] += sign * public
            self.tokens["scoped"][tier] += sign * (n - public)
            start += n

    def report(self) -> dict:
        return {k: dict(v) for k, v in self.tokens.items()}


def open_events(config, rank: int, replica: tuple[int, int], page_tokens: int, ctrl):
    """The group's ``TierEvents`` on its rank 0 when ``[events] endpoint`` is set (the
    controller's tier listener set), else None. Starts with ``AllBlocksCleared``: this cache
    holds nothing in L1 and L2 yet."""
    ev = config.events
    if not ev.endpoint or rank != 0:
        return None
    from .events.publisher import Publisher, PublisherSettings
    from .events.tiers import TierEvents
    pub = Publisher(PublisherSettings(ev.endpoint, ev.replay_endpoint, ev.topic,
                                      ev.queue_batches, ev.replay_batches), index=replica[0])
    events = TierEvents(pub, page_tokens)
    ctrl.on_tier = events.on_tier
    events.cleared()
    events.flush(time.time())
    return events


def close_events(events, ctrl) -> None:
    """Announce that this cache's L1 and L2 are gone (``AllBlocksCleared``), send what is
    queued, close the publisher."""
    if events is None:
        return
    if ctrl is not None:
        ctrl.on_tier = None
    events.cleared()
    events.flush(time.time())
    events.publisher.close()


def purge_l3(cache) -> int:
    """``HiCache.purge_l3`` once its writes landed: this rank's pages of the cache's namespace
    deleted; the group's events name every page deleted where the store's keys name their
    pages (no fleet secret), and every page the group wrote or found in L3."""
    from .errors import L3Error
    from .l3 import registry
    gone: list = []
    try:
        n = registry.purge(cache.config.l3, cache.namespace, cache.rank, gone).keys
    except L3Error:  # nothing of this rank's is stored
        n = 0
    if cache.events is not None:
        cache.events.l3_purged(cache.io.chains_named(gone))
        cache.events.flush(time.time())
    return n


def events_report(events) -> dict:
    """``stats()["kv_events"]``: batches sent and dropped by this group's publisher (0 and 0
    on a rank that publishes none)."""
    if events is None:
        return {"sent": 0, "dropped": 0}
    return {"sent": events.publisher.sent, "dropped": events.publisher.dropped}
