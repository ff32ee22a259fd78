"""L3: persistent LMDB page store of rank shards, async writer, prefetcher, cost model."""

from .agree import min_across_ranks, restore_length, restore_lengths
from .cost import CostModel
from .keys import (FORMAT_VERSION, L3Error, Namespace, chain_hashes, keys_for_rank, make_key,
                   page_keys)
from .prefetch import (PREFETCH_POLICIES, AsyncWriter, PrefetchHandle, PrefetchPolicy, Prefetcher,
                       agree_prefetch, prefetch_signals)
from .store import L3Stats, PageStore, replica_of, should_write

__all__ = [
    "FORMAT_VERSION", "L3Error", "Namespace", "chain_hashes", "keys_for_rank", "make_key",
    "page_keys", "PageStore", "L3Stats", "should_write", "replica_of", "CostModel",
    "AsyncWriter", "Prefetcher", "PrefetchHandle", "PrefetchPolicy", "PREFETCH_POLICIES",
    "agree_prefetch", "prefetch_signals", "min_across_ranks", "restore_length", "restore_lengths",
]
