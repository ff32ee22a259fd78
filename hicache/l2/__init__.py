"""L2 tier: the per-rank host KV pool and the L1<->L2 transfer engine."""

from hicache.l2.pool import HostKVPool, HostMemoryError, check_host_memory, host_pages_for
from hicache.l2.transfer import (TransferEngine, TransferError, TransferJob, TransferPlan,
                                 TransferStats, plan_transfer)

__all__ = ["HostKVPool", "HostMemoryError", "TransferEngine", "TransferError", "TransferJob",
           "TransferPlan", "TransferStats", "check_host_memory", "host_pages_for",
           "plan_transfer"]
