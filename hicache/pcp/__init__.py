"""Prefill context parallelism (DualChunkSwap, full-KV and ring attention) and PD relayout."""

from hicache.pcp.partition import DualChunkSwap, contiguous_work_per_rank

__all__ = ["DualChunkSwap", "contiguous_work_per_rank"]
