"""Which replica writes a page to L3: pure functions of TP / DCP ranks (no store, no I/O)."""

from __future__ import annotations

from typing import Sequence

from ..errors import L3Error


def should_write(page_index: int, replica_id: int, num_replicas: int) -> bool:
    """One writer per page among ``num_replicas`` TP replicas of a shard (tp > dcp): rotate."""
    if num_replicas < 1 or not 0 <= replica_id < num_replicas:
        raise L3Error(f"replica_id {replica_id} is outside [0, {num_replicas})")
    if page_index < 0:
        raise L3Error(f"page_index must be >= 0, got {page_index}")
    return page_index % num_replicas == replica_id


def replica_of(tp_rank: int, tp_size: int, dcp_size: int) -> tuple[int, int, int]:
    """``(dcp_rank, replica_id, num_replicas)`` of a TP rank (dcp rank = tp_rank mod dcp)."""
    if dcp_size < 1 or tp_size % dcp_size:
        raise L3Error(f"tp_size {tp_size} is not a multiple of dcp_size {dcp_size}")
    if not 0 <= tp_rank < tp_size:
        raise L3Error(f"tp_rank {tp_rank} is outside [0, {tp_size})")
    return tp_rank % dcp_size, tp_rank // dcp_size, tp_size // dcp_size


def store_replica(tp_rank: int, tp_size: int, dcp_size: int,
                  store_of: Sequence[object]) -> tuple[int, int]:
    """``(writer_id, num_writers)`` of a TP rank among the replicas of its shard that share its
    L3 store, for ``HiCache(replica=...)``. ``store_of[r]`` names TP rank r's store (its node
    for LMDB, one environment per node; the same id for every rank sharing one Redis). Rotating writers over the replicas of one
    store only, every store holds every page (replicas on other nodes fill their own stores)."""
    dcp_rank, _, _ = replica_of(tp_rank, tp_size, dcp_size)
    if len(store_of) != tp_size:
        raise L3Error(f"store_of names {len(store_of)} stores for {tp_size} TP ranks")
    peers = [r for r in range(dcp_rank, tp_size, dcp_size) if store_of[r] == store_of[tp_rank]]
    return peers.index(tp_rank), len(peers)
