"""L2 tier: the per-rank host KV pool and the transfer engine (L1 <-> L2, and L3 staging -> L1)
with its copy backends (copy_cpu.py, copy_cuda.py: one per device type)."""

from hicache.l2.pool import HostKVPool, check_host_memory, host_pages_for
from hicache.l2.transfer import (CopyBackend, TransferEngine, TransferJob, TransferPlan,
                                 TransferStats, backend_for, plan_transfer, register_backend)

__all__ = ["CopyBackend", "HostKVPool", "TransferEngine", "TransferJob", "TransferPlan",
           "TransferStats", "backend_for", "check_host_memory", "host_pages_for", "plan_transfer",
           "register_backend"]
