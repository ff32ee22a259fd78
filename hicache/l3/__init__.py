"""L3: a page store of rank shards behind one interface (:class:`L3Store`; LMDB embedded or
Redis / Valkey shared, opened with :func:`open_store`), async writer, prefetcher, cost model."""

from .backends import BACKENDS, open_store
from .base import L3Stats, L3Store, Out, PutResult
from .agree import min_across_ranks, restore_length, restore_lengths
from .cost import CostModel
from .keys import FORMAT_VERSION, Namespace, chain_hashes, keys_for_rank, make_key, page_keys
from .prefetch import (PREFETCH_POLICIES, AsyncWriter, PrefetchHandle, PrefetchPolicy, Prefetcher,
                       agree_prefetch, prefetch_signals)
from .redis_store import RedisStore
from .store import PageStore, replica_of, should_write, store_replica

__all__ = ["open_store", "L3Store", "PutResult", "Out", "BACKENDS", "PageStore", "RedisStore",
           "FORMAT_VERSION", "Namespace", "chain_hashes", "keys_for_rank", "make_key", "page_keys",
           "L3Stats", "should_write", "replica_of", "store_replica", "CostModel", "AsyncWriter",
           "Prefetcher", "PrefetchHandle", "PrefetchPolicy", "PREFETCH_POLICIES", "agree_prefetch",
           "prefetch_signals", "min_across_ranks", "restore_length", "restore_lengths"]
