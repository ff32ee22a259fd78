"""Prometheus metrics of one rank's ``HiCache`` (prometheus_client).

Counters and gauges are read from ``HiCache.stats()`` at scrape time, so a scrape and
``stats()`` always agree (one source of truth); histograms are observed when the event happens
(the service calls ``observer.observe(name, seconds, label)``). Every series has a ``rank``
label. A host engine merges the metrics into its own registry::

    metrics = HiCacheMetrics(cache, registry=engine_registry)   # or its own CollectorRegistry
    metrics.attach(new_cache)   # after a restart: counters continue from where the old one was

or serves them itself with ``metrics.serve(port)``. The names are listed in ``describe()``.
"""

from __future__ import annotations

import threading
from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .service import PREFETCH_OUTCOMES, TIERS

# Latency buckets from 100 us to 30 s: page copies are sub-ms, an L3 restore can take seconds.
BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
           2.5, 5.0, 10.0, 30.0)
DIRECTIONS = ("d2h", "h2d", "l3_read", "l3_write")

# name -> (type, help, label over which the stats() dict is spread, stats() path)
# The label values are the dict's keys; a path of one key is a scalar.
SERIES: dict[str, tuple] = {
    "hicache_requests_total": ("counter", "Requests admitted.", None, ("requests",)),
    "hicache_prompt_tokens_total": ("counter", "Prompt tokens of requests whose prefix is final.",
                                    None, ("prompt_tokens",)),
    "hicache_hit_tokens_total": ("counter", "Prompt tokens served from a tier.", "tier",
                                 ("hit_tokens",)),
    "hicache_miss_tokens_total": ("counter", "Prompt tokens that had to be prefilled.", None,
                                  ("miss_tokens",)),
    "hicache_transfer_bytes_total": ("counter", "Bytes moved, by direction.", "direction",
                                     ("bytes",)),
    "hicache_transfer_seconds_total": ("counter", "Seconds spent moving them, by direction "
                                       "(worker copy time on CPU; 0 for async CUDA copies).",
                                       "direction", ("transfer_s",)),
    "hicache_evictions_total": ("counter", "Pages evicted, by tier.", "tier", ("evictions",)),
    "hicache_l3_corrupt_values_total": ("counter", "L3 values rejected by header or checksum "
                                        "(each a counted miss, deleted).", None, ("corrupt",)),
    "hicache_l3_auth_failures_total": ("counter", "Authenticated L3 values whose MAC (or header) "
                                       "failed: forged, stale or damaged; each a counted miss, "
                                       "replaced by the next writer.", None,
                                       ("l3_auth_failures",)),
    "hicache_l3_errors_total": ("counter", "L3 calls that found the store unavailable "
                                "(connection loss, timeout): answered as misses / not stored.",
                                None, ("l3_errors",)),
    "hicache_l3_timeouts_total": ("counter", "L3 prefetches the timeout policy stopped waiting "
                                  "for (the loaded part is used).", None,
                                  ("prefetch", "timeout")),
    "hicache_l3_failures_total": ("counter", "L3 store errors raised (the first one turns L3 "
                                  "off on this rank until the service restarts).", None,
                                  ("l3_failures",)),
    "hicache_failed_copies_total": ("counter", "Device/host copies that failed on this rank.",
                                    "direction", ("failed_copies",)),
    "hicache_prefetch_total": ("counter", "L3 prefetch outcomes.", "outcome", ("prefetch",)),
    "hicache_steps_total": ("counter", "Scheduler steps (agreements).", None, ("steps",)),
    "hicache_controller_seconds_total": ("counter", "Seconds inside the cache controller.", None,
                                         ("controller_s",)),
    "hicache_pages_used": ("gauge", "Pages in use, by tier (L3: whole store).", "tier",
                           ("pages",)),
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
        else:
            for key, x in (v or {}).items():
                out[(name, str(key))] = float(x)
    return out


def _stats_with_defaults(cache) -> dict:
    s = cache.stats()
    pages = dict(s.get("pages", {}))
    store = getattr(cache, "l3", None)
    store = getattr(store, "_store", None) or store  # the backend behind the service's guard
    if store is not None and hasattr(store, "num_pages"):
        try:
            pages.setdefault("l3", store.num_pages())
        except Exception:  # a store mid-close or failed: report what is known
            pass
    s["pages"] = pages
    s.setdefault("prefetch", {}).update({o: s["prefetch"].get(o, 0) for o in PREFETCH_OUTCOMES})
    return s


class _StatsCollector(Collector):
    def __init__(self, owner: "HiCacheMetrics") -> None:
        self.owner = owner

    def describe(self):
        return [self._family(n, k, h, lab) for n, (k, h, lab, _p) in SERIES.items()]

    def _family(self, name: str, kind: str, help_: str, label):
        labels = ["rank"] + ([label] if label else [])
        if kind == "counter":  # the family name drops _total; the sample keeps it
            return CounterMetricFamily(name[:-len("_total")], help_, labels=labels)
        return GaugeMetricFamily(name, help_, labels=labels)

    def collect(self) -> Iterator:
        values = self.owner.values()
        rank = str(self.owner.rank)
        for name, (kind, help_, label, _p) in SERIES.items():
            fam = self._family(name, kind, help_, label)
            for (n, lab), v in sorted(values.items()):
                if n == name:
                    fam.add_metric([rank] + ([lab] if label else []), v)
            yield fam


class HiCacheMetrics:
    """The Prometheus view of one rank's cache: stats-backed counters/gauges plus histograms.

    ``registry``: where to register (default: a fresh ``CollectorRegistry``; pass the engine's
    own to merge). ``attach`` moves to a new ``HiCache`` (a restart after a failure): its
    counters start from the last values of the old one, so they never go backwards.
    """

    def __init__(self, cache=None, registry: CollectorRegistry | None = None,
                 rank: int | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rank = rank if rank is not None else (cache.rank if cache is not None else 0)
        self._lock = threading.Lock()
        self._cache = None
        self._base: dict = {}     # counters of detached caches, summed
        self._last: dict = {}     # the last values read (served when no cache is attached)
        self._hist = {k: Histogram(n, h, ["rank", *lab], buckets=BUCKETS,
                                   registry=self.registry)
                      for k, (n, h, lab) in HISTOGRAMS.items()}
        self._server = None
        self.registry.register(_StatsCollector(self))
        if cache is not None:
            self.attach(cache)

    # ---- the service's hook -------------------------------------------------------------------
    def observe(self, name: str, seconds: float, label: str = "") -> None:
        h = self._hist[name]
        (h.labels(str(self.rank), label) if label else h.labels(str(self.rank))).observe(seconds)

    # ---- lifecycle ----------------------------------------------------------------------------
    def attach(self, cache) -> None:
        """Read ``cache`` from now on (and receive its events); folds the previous cache in."""
        with self._lock:
            if self._cache is not None:
                self._fold(self._read(self._cache))
                self._cache.observer = None
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

    @staticmethod
    def _read(cache) -> dict:
        for _ in range(3):  # the serving thread may change a dict mid-read: read again
            try:
                return flatten(_stats_with_defaults(cache))
            except RuntimeError:
                continue
        return flatten(_stats_with_defaults(cache))

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


def describe() -> list[tuple[str, str, str]]:
    """``(name, labels, help)`` of every metric, for docs/operations.md and ``--help``."""
    rows = []
    for name, (kind, help_, label, _p) in SERIES.items():
        rows.append((name, ",".join(["rank"] + ([label] if label else [])), f"{kind}: {help_}"))
    for n, h, lab in HISTOGRAMS.values():
        rows.append((n, ",".join(["rank", *lab]), f"histogram: {h}"))
    return rows


__all__ = ["HiCacheMetrics", "SERIES", "HISTOGRAMS", "TIERS", "flatten", "describe"]
