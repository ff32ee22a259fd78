"""L1 tier: the per-rank device KV pool and the widened-page allocator."""

from hicache.l1.allocator import OutOfPagesError, PageAllocator, PageError
from hicache.l1.pool import DeviceKVPool, PoolError

__all__ = ["DeviceKVPool", "OutOfPagesError", "PageAllocator", "PageError", "PoolError"]
