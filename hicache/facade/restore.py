"""The agreed L3 restore of one request (``HiCache.step`` calls it once every rank holds the
request's prefetched pages): fresh device pages, the restore job, the companions' pages beside
it, or a retry while L1 has no room."""

from __future__ import annotations

from hicache.companions import JobSet
from hicache.errors import DeviceFullError
from hicache.tier_io import join

from . import report
from .request import Request

RESTORE_RETRIES = 64  # steps an agreed L3 restore may wait for L1 room before recomputing
__all__ = ["RESTORE_RETRIES", "restore"]


def restore(cache, req: Request, pages: int) -> bool:
    """Every rank holds ``pages`` prefetched pages: copy them into fresh device pages (a
    transfer job: ``wait_layer`` waits for it like for a load). False (retry at a later
    step) while L1 has no room; after ``RESTORE_RETRIES`` steps the tokens are recomputed
    instead. Both decisions follow the replicated controller state."""
    prefix = req.prefix
    try:
        with cache._timed():
            dev = cache.ctrl.alloc_device(pages)
        cache.io.unmap(dev)
    except DeviceFullError:
        req.restore_tries += 1
        prefix.room_wait = req.restore_tries
        cache._stats.restore_wait_steps += 1
        if req.restore_tries <= RESTORE_RETRIES:
            cache.io.launch(cache.ctrl.take_ops())
            return False
        dev, pages = [], 0
        cache._stats.restore_fallbacks += 1
    cache.io.launch(cache.ctrl.take_ops())
    job = cache.io.restore(req.prefetch, dev) if pages else None
    if pages:
        cache.kv.fill(dev)
        cache._pages.take(dev)
        req.own_pages += dev
        prefix.page_table += dev
        prefix.storage_len = pages * cache.page_tokens
    beside = [c.restore(cache._host, req, dev, pages) for c in cache.companions]
    for j in beside:  # the companions' agreed pages, as jobs beside the target's
        if j is not None:
            cache.io.track(j)
    if job is not None:  # (the companions' jobs, if any, ride the target's)
        req.load_job = join(req.load_job, JobSet(job, beside) if any(beside) else job)
    cache.io.end_prefetch(req.prefetch)
    req.prefetch = None
    prefix.ready = True
    report.count_hits(cache._stats, req)
    return True
