"""Prometheus metrics of one rank's ``HiCache`` (prometheus_client).

Counters and gauges are read from ``HiCache.stats()`` at scrape time, so a scrape and
``stats()`` always agree (one source of truth); histograms are observed when the event happens
(the service calls ``observer.observe(name, seconds, label)``). Every series has a ``rank``
and a ``model`` label. A host engine merges the metrics into its own registry::

    metrics = HiCacheMetrics(cache, registry=engine_registry, model="deepseek-v3")
    metrics.attach(new_cache)   # after a restart: counters continue from where the old one was

or serves them itself with ``metrics.serve(port)``. The names are listed in ``describe()``.

The L3 store's own gauges (pages, bytes and capacity of the whole store, every namespace and rank
in it) are read at scrape time from the backend (``registry.usage``: LMDB's own counters; Redis
DBSIZE, INFO memory and maxmemory, three O(1) commands at most every few seconds) and reported
by ONE rank per store, so a sum over ranks counts each store once: for a store shared by the
fleet (Redis) the DCP rank 0 of TP replica 0; for a node-local one (LMDB) the first rank of each
node (``rank % local_world_size == 0``) of replica 0. ``HiCacheMetrics(reports_store=...)``
overrides the choice.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .l3 import registry as l3_registry
from .service import PREFETCH_OUTCOMES, TIERS

# Latency buckets from 100 us to 30 s: page copies are sub-ms, an L3 restore can take seconds.
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0, 30.0)
DIRECTIONS = ("d2h", "h2d", "l3_read", "l3_write")

# name -> (type, help, label over which the stats() dict is spread, stats() path)
# The label values are the dict's keys; a path of one key is a scalar. Two labels (a tuple)
# spread a dict of dicts: {second label's value: {first label's value: x}}.
SERIES: dict[str, tuple] = {
    "hicache_requests_total": ("counter", "Requests admitted.", None, ("requests",)),
    "hicache_prompt_tokens_total": ("counter", "Prompt tokens of requests whose prefix is final.",
                                    None, ("prompt_tokens",)),
    "hicache_hit_tokens_total": ("counter", "Prompt tokens served from a tier.", "tier",
                                 ("hit_tokens",)),
    "hicache_scope_hit_tokens_total": ("counter", "Prompt tokens served from a tier, by scope "
                                       "kind: public (the shared scope: no scope, or a "
                                       "request's declared public prefix) or scoped (a "
                                       "request's own scope; scope names never appear).",
                                       ("tier", "scope"), ("scope_hit_tokens",)),
    "hicache_kv_events_total": ("counter", "KV event batches of this DCP group's publisher "
                                "(one rank per group): sent, or dropped (the queue was full: "
                                "a slow or absent subscriber; serving never waits).", "outcome",
                                ("kv_events",)),
    "hicache_miss_tokens_total": ("counter", "Prompt tokens that had to be prefilled.", None,
                                  ("miss_tokens",)),
    "hicache_transfer_bytes_total": ("counter", "Bytes moved, by direction.", "direction",
                                     ("bytes",)),
    "hicache_transfer_seconds_total": ("counter", "Seconds spent moving them, by direction "
                                       "(worker copy time on CPU; 0 for async CUDA copies).",
                                       "direction", ("transfer_s",)),
    "hicache_evictions_total": ("counter", "Pages evicted, by tier.", "tier", ("evictions",)),
    "hicache_l3_failures_total": ("counter", "L3 failures by reason (one count per event): "
                                  "corrupt (a value failed its header or checksum), auth (an "
                                  "authenticated value's MAC failed: forged, stale or damaged), "
                                  "timeout / refused / tls / other (a call found the store "
                                  "unavailable), full (a write the store could not hold). A "
                                  "failed value is a counted miss, replaced by the next writer; "
                                  "an unavailable store answers misses / not stored.", "reason",
                                  ("l3_failure_reasons",)),
    "hicache_l3_enabled": ("gauge", "1 while this rank uses L3; 0 after a store error turned "
                           "it off (until the service restarts) or without L3.", None,
                           ("l3_enabled",)),
    "hicache_failed_copies_total": ("counter", "Device/host copies that failed on this rank.",
                                    "direction", ("failed_copies",)),
    "hicache_prefetch_total": ("counter", "L3 prefetch outcomes.", "outcome", ("prefetch",)),
    "hicache_steps_total": ("counter", "Scheduler steps (agreements).", None, ("steps",)),
    "hicache_controller_seconds_total": ("counter", "Seconds inside the cache controller.", None,
                                         ("controller_s",)),
    "hicache_pages_used": ("gauge", "Pages in use, by tier (L3: keys in the whole store, "
                           "reported by one rank per store).", "tier", ("pages",)),
    "hicache_pages_capacity": ("gauge", "Pages a tier holds at most (L1, L2 on this rank).",
                               "tier", ("pages_capacity",)),
    "hicache_bytes_used": ("gauge", "Bytes in use, by tier (L1, L2: this rank's pages; L3: the "
                           "whole store, reported by one rank per store).", "tier",
                           ("bytes_used",)),
    "hicache_bytes_capacity": ("gauge", "Bytes a tier holds at most (L3: the store's capacity "
                               "where it has one), for usage ratios.", "tier",
                               ("bytes_capacity",)),
    "hicache_locks_open": ("gauge", "Requests holding a lock on cached pages.", None,
                           ("locks",)),
}
HISTOGRAMS = {
    "transfer": ("hicache_transfer_duration_seconds",
                 "Duration of one device/host copy job (CPU worker time).", ("direction",)),
    "restore": ("hicache_restore_duration_seconds",
                "From the start of an L3 prefetch to its pages restored into L1.", ()),
    "agreement": ("hicache_agreement_step_seconds",
                  "The per-step agreement collective, waiting on other ranks included.", ()),
}


def _get(stats: dict, path: tuple):
    v = stats
    for k in path:
        v = v.get(k, 0) if isinstance(v, dict) else 0
    return v


def flatten(stats: dict) -> dict[tuple[str, str], float]:
    """``{(metric name, label value or ""): value}`` of the stats-backed series."""
    out: dict[tuple[str, str], float] = {}
    for name, (_kind, _help, label, path) in SERIES.items():
        v = _get(stats, path)
        if label is None:
            out[(name, "")] = float(v)
        elif isinstance(label, tuple):
            for outer, inner in (v or {}).items():
                for key, x in inner.items():
                    out[(name, (str(key), str(outer)))] = float(x)
        else:
            for key, x in (v or {}).items():
                out[(name, str(key))] = float(x)
    return out


def _pool_bytes(pool, pages: int) -> int:
    n = getattr(pool, "num_pages", 0) or 0
    return int(pool.nbytes // n * pages) if pool is not None and n else 0


def reports_store(cache) -> bool:
    """The default: does this rank report its L3 store's gauges (see the module docstring)?"""
    l3 = getattr(cache, "l3", None)
    if l3 is None or getattr(cache, "replica", (0, 1))[0] != 0:
        return False
    backend = getattr(l3, "backend", None)
    if backend is not None and backend.shared:
        return cache.rank == 0
    from .distributed import local_world_size
    return cache.rank % local_world_size() == 0


def _stats_with_defaults(cache, store_gauges: bool = True) -> dict:
    s = cache.stats()
    pages = dict(s.get("pages", {}))
    ctrl = getattr(cache, "ctrl", None)
    cap = {}
    if ctrl is not None:
        cap["l1"] = ctrl.device.num_pages
        if "l2" in getattr(cache, "tiers", ("l2",)):
            cap["l2"] = ctrl.host.num_pages
    pools = {"l1": getattr(cache, "l1", None), "l2": getattr(cache, "l2", None)}
    used_b = {t: _pool_bytes(pools[t], pages.get(t, 0)) for t in cap}
    cap_b = {t: _pool_bytes(pools[t], cap[t]) for t in cap}
    l3 = getattr(cache, "l3", None)
    reasons = dict.fromkeys(l3_registry.KINDS, 0)
    if l3 is not None:
        if hasattr(l3, "failure_reasons"):
            reasons.update(l3.failure_reasons())
        if store_gauges:
            try:
                u = l3_registry.usage(l3)
            except Exception:  # a store mid-close or failed: report what is known
                u = None
            if u is not None:
                for out, v in ((pages, u.pages), (used_b, u.bytes), (cap_b, u.capacity_bytes)):
                    if v is not None:
                        out["l3"] = v
    else:
        pages.pop("l3", None)
    if not store_gauges:
        pages.pop("l3", None)
    s["pages"], s["pages_capacity"] = pages, cap
    s["bytes_used"], s["bytes_capacity"] = used_b, cap_b
    s["l3_failure_reasons"] = reasons
    s["l3_enabled"] = int(l3 is not None and not getattr(l3, "failed", False))
    s.setdefault("prefetch", {}).update({o: s["prefetch"].get(o, 0) for o in PREFETCH_OUTCOMES})
    return s


def _names(label) -> list:
    """A series' own label names (none, one, or a tuple of them)."""
    return list(label) if isinstance(label, tuple) else [label] if label else []


class _StatsCollector(Collector):
    def __init__(self, owner: "HiCacheMetrics") -> None:
        self.owner = owner

    def describe(self):
        return [self._family(n, k, h, lab) for n, (k, h, lab, _p) in SERIES.items()]

    def _family(self, name: str, kind: str, help_: str, label):
        labels = ["rank", "model"] + _names(label)
        if kind == "counter":  # the family name drops _total; the sample keeps it
            return CounterMetricFamily(name[:-len("_total")], help_, labels=labels)
        return GaugeMetricFamily(name, help_, labels=labels)

    def collect(self) -> Iterator:
        values = self.owner.values()
        rank, model = str(self.owner.rank), self.owner.model
        for name, (kind, help_, label, _p) in SERIES.items():
            fam = self._family(name, kind, help_, label)
            for (n, lab), v in sorted(values.items()):
                if n == name:
                    fam.add_metric([rank, model] + (list(lab) if isinstance(lab, tuple) else
                                                    [lab] if label else []), v)
            yield fam


class HiCacheMetrics:
    """The Prometheus view of one rank's cache: stats-backed counters/gauges plus histograms.

    ``registry``: where to register (default: a fresh ``CollectorRegistry``; pass the engine's
    own to merge). ``attach`` moves to a new ``HiCache`` (a restart after a failure): its
    counters start from the last values of the old one, so they never go backwards.
    ``model``: the ``model`` label (default: the policy's model: preset, checkpoint directory
    name, else ``builtin``). ``reports_store``: whether this rank reports the L3 store's own
    gauges (default :func:`reports_store`).
    """

    def __init__(self, cache=None, registry: CollectorRegistry | None = None,
                 rank: int | None = None, model: str | None = None,
                 reports_store: bool | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rank = rank if rank is not None else (cache.rank if cache is not None else 0)
        self.model = model if model is not None else (model_name(cache) if cache is not None
                                                      else "")
        self._reports_store = reports_store
        self._lock = threading.Lock()
        self._cache = None
        self._base: dict = {}     # counters of detached caches, summed
        self._last: dict = {}     # the last values read (served when no cache is attached)
        self._hist = {k: Histogram(n, h, ["rank", "model", *lab], buckets=BUCKETS,
                                   registry=self.registry)
                      for k, (n, h, lab) in HISTOGRAMS.items()}
        self._server = None
        self.registry.register(_StatsCollector(self))
        if cache is not None:
            self.attach(cache)

    # ---- the service's hook -------------------------------------------------------------------
    def observe(self, name: str, seconds: float, label: str = "") -> None:
        h = self._hist[name]
        base = (str(self.rank), self.model)
        (h.labels(*base, label) if label else h.labels(*base)).observe(seconds)

    # ---- lifecycle ----------------------------------------------------------------------------
    def attach(self, cache) -> None:
        """Read ``cache`` from now on (and receive its events); folds the previous cache in."""
        with self._lock:
            if self._cache is not None:
                self._fold(self._read(self._cache))
                self._cache.observer = None
            if not self.model:
                self.model = model_name(cache)
            self._cache = cache
            cache.observer = self

    def detach(self) -> None:
        """Stop reading the cache (call before it is closed, or after); counters keep their
        last values."""
        with self._lock:
            if self._cache is not None:
                self._fold(self._read(self._cache))
                self._cache.observer = None
                self._cache = None

    def _fold(self, cur: dict) -> None:
        """Counters of a cache being left add to the base; its gauges are served until the
        next cache is attached."""
        self._last = {}
        for key, v in cur.items():
            if SERIES[key[0]][0] == "counter":
                self._base[key] = self._base.get(key, 0.0) + v
            else:
                self._last[key] = v

    def _read(self, cache) -> dict:
        store = self._reports_store if self._reports_store is not None else reports_store(cache)
        for _ in range(3):  # the serving thread may change a dict mid-read: read again
            try:
                return flatten(_stats_with_defaults(cache, store))
            except RuntimeError:
                continue
        return flatten(_stats_with_defaults(cache, store))

    def values(self) -> dict[tuple[str, str], float]:
        """What a scrape serves now: ``{(name, label value): value}``."""
        with self._lock:
            cur = self._read(self._cache) if self._cache is not None else dict(self._last)
            out = dict(cur)
            for key, v in self._base.items():
                out[key] = out.get(key, 0.0) + v
            return out

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` of this registry over HTTP (a daemon thread); the bound port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def close(self) -> None:
        self.detach()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def model_name(cache) -> str:
    """The ``model`` label of a cache: its policy's model preset, checkpoint directory name, or
    ``builtin`` (the built-in tiny model)."""
    import os
    m = getattr(getattr(cache, "config", None), "model", None)
    if m is None:
        return ""
    path = getattr(m, "path", "") or ""
    return (getattr(m, "preset", "") or (os.path.basename(os.path.normpath(path)) if path
                                         else "") or "builtin")


def describe() -> list[tuple[str, str, str]]:
    """``(name, labels, help)`` of every metric, for docs/operations.md and ``--help``."""
    rows = []
    for name, (kind, help_, label, _p) in SERIES.items():
        rows.append((name, ",".join(["rank", "model"] + _names(label)),
                     f"{kind}: {help_}"))
    for n, h, lab in HISTOGRAMS.values():
        rows.append((n, ",".join(["rank", "model", *lab]), f"histogram: {h}"))
    return rows


__all__ = ["HiCacheMetrics", "SERIES", "HISTOGRAMS", "TIERS", "flatten", "describe",
           "model_name", "reports_store"]
