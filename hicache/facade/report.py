"""``HiCache.stats()`` assembled (``hicache.service``): the service's counters, its
``TierIO``'s bytes and copy times, the controller's evictions and pages, each companion's report
under its name (``"hybrid"``, ``"draft"``, ...) and the L3 store's figures."""

from __future__ import annotations

__all__ = ["count_hits", "leaks_of", "stats_of"]


def stats_of(cache) -> dict:
    """``HiCache.stats()`` of ``cache``: its counters, its TierIO's, its controller's, each
    companion's report under its name, the L3 store's."""
    s, io = cache._stats, cache.io.stats
    ctrl = cache.ctrl.stats
    out = {
        "requests": s.requests, "prompt_tokens": s.prompt_tokens,
        "hit_tokens": dict(s.hit_tokens),
        "miss_tokens": s.prompt_tokens - sum(s.hit_tokens.values()),
        "bytes": dict(io.bytes, l3_read=0, l3_write=0),
        "gbps": {d: (io.bytes[d] / io.transfer_s[d] / 1e9 if io.transfer_s[d] else 0.0)
                 for d in ("d2h", "h2d")},
        "evictions": {"l1": ctrl.device_evicted_pages, "l2": ctrl.host_evicted_pages,
                      "l3": 0},
        "corrupt": 0, "l3_errors": 0, "controller_s": s.controller_s, "steps": s.steps,
        "agreement_s": s.agreement_s,
        "restore_wait_steps": s.restore_wait_steps, "restore_fallbacks": s.restore_fallbacks,
        "pages": {"l1": cache.ctrl.device.num_used, "l2": cache.ctrl.host.num_used},
        # list() copies in one step: a metrics scrape may call stats() from another thread
        "locks": sum(1 for r in list(cache._reqs.values()) if r.lock is not None),
        "failed_copies": dict(io.failed_copies), "prefetch": dict(io.prefetch),
        "transfer_s": dict(io.transfer_s),
        # copy ops the controller issued: backups (d2h) and L2 load-backs (h2d)
        "copy_ops": {"d2h": ctrl.backups, "h2d": ctrl.loads},
    }
    for c in cache.companions:  # e.g. "hybrid" (KDA snapshots), "draft" (spec)
        out[c.name] = c.report()
    if cache.l3 is not None:
        l3 = cache.l3.stats
        out["evictions"]["l3"] = l3.evictions
        out["corrupt"] = l3.corrupt
        out["l3_auth_failures"] = l3.auth_failures  # forged or stale values (misses)
        out["l3_where"] = cache.l3.where  # the store, no password
        out["l3_error"] = cache.l3.first_error  # the first failure or unavailable call
        out["l3_errors"] = l3.errors  # calls that found the store unavailable (misses)
        out["bytes"]["l3_read"] = l3.bytes_read
        out["bytes"]["l3_write"] = l3.bytes_written
        out["l3_failures"] = cache.l3.failures  # store errors raised (the first ends L3)
        out["transfer_s"].update(l3_read=l3.read_s, l3_write=l3.write_s)
    return out



def count_hits(stats, prefix, sign: int = 1) -> None:
    """Count a prefix once it is final (``sign`` -1: take an aborted one back), so hit + miss
    == prompt tokens of ready requests (a request still waiting on L3 is in neither)."""
    stats.prompt_tokens += sign * prefix.prompt_len
    hits = stats.hit_tokens
    hits["l1"] += sign * prefix.device_len
    hits["l2"] += sign * prefix.host_len
    hits["l3"] += sign * prefix.storage_len


def leaks_of(cache) -> dict:
    """``HiCache.leaks()``: pages of each tier in use but not held by the cache tree, and open
    locks (requests' and tree nodes'), after the controller's invariants were checked."""
    cache.check()
    ctrl = cache.ctrl
    nodes = list(ctrl.iter_nodes())
    dev = sum(len(nd.device) for nd in nodes if nd.device is not None)
    host = sum(len(nd.host) for nd in nodes if nd.host is not None)
    return {"l1": ctrl.device.num_used - dev, "l2": ctrl.host.num_used - host,
            "locks": cache.stats()["locks"] + sum(1 for nd in nodes if nd.lock_ref > 0)}
