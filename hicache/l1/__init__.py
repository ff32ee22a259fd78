"""L1 tier: the per-rank device KV pool (page ids come from ``hicache.pages``)."""

from hicache.l1.pool import DeviceKVPool

__all__ = ["DeviceKVPool"]
