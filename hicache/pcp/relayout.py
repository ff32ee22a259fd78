"""Prefill/decode (PD) hand-off of one request's KV into DCP-striped decode pools.

A prefill instance holds the request's KV in its own pool under its own page table; the decode
group allocates its own widened pages. ``plan_pd_transfer`` builds on
``hicache.layout.plan_relayout`` (which decides what is allowed):

- same DCP size on both sides: the ordinary page path, rank r -> rank r, each rank's own rows;
- DCP1 prefill -> DCP-c decode: token relayout, decode rank r selects and packs the positions it
  owns from the dense source;
- any other size change: ``TopologyError``.

Only positions < ``token_count`` move, so stale rows in the tail of a partial last page (on either
side) never leak. Rows are addressed by position through both page tables, so the two sides may
use different page ids and page sizes.

    plan_pd_transfer(token_count, src_dcp, src_page_size, src_pages, dst_dcp, dst_page_size,
                     dst_pages, interleave=1) -> PDTransferPlan
    pack_shard(src_kv [L, rows, D], transfer) -> [L, n, D]
    unpack_shard(dst_pool, transfer, packed [L, n, D]) -> rows stored
    relayout_local(plan, src_kvs, dst_pools) -> rows stored per decode rank (one process)
    run_pd_transfer(plan, src_kv, dst_pool, src_ranks, dst_ranks, group=None) -> rows stored
        (every rank in src_ranks or dst_ranks calls it; point-to-point sends)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hicache.at_exit import lend
from hicache.errors import TopologyError
from hicache.layout import DCPLayout, plan_relayout, slot_of


@dataclass(frozen=True)
class RankTransfer:
    """Rows for decode rank ``dst_rank`` from prefill rank ``src_rank`` (all int64 [n])."""

    dst_rank: int
    src_rank: int
    positions: torch.Tensor  # global token positions
    src_rows: torch.Tensor  # physical rows in the source rank's pool
    dst_slots: torch.Tensor  # virtual slots of the decode request (all owned by dst_rank)
    dst_rows: torch.Tensor  # physical rows in the decode rank's pool

    @property
    def num_rows(self) -> int:
        return int(self.positions.numel())


@dataclass(frozen=True)
class PDTransferPlan:
    src_dcp: int
    dst_dcp: int
    token_count: int
    path: str  # "page" (same DCP size) or "relayout" (DCP1 -> DCPc)
    transfers: tuple[RankTransfer, ...]  # one per decode rank, in rank order


def _slots(pages, token_count: int, page_tokens: int, side: str) -> torch.Tensor:
    pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    need = -(-token_count // page_tokens)
    if pages.numel() < need:
        raise TopologyError(f"{side} page table has {pages.numel()} pages; {token_count} tokens "
                            f"need {need} pages of {page_tokens} slots")
    if pages.numel() and int(pages.min()) < 0:
        raise TopologyError(f"{side} page table holds a negative page id {int(pages.min())}")
    return slot_of(pages, torch.arange(token_count, dtype=torch.int64), page_tokens)


def plan_pd_transfer(token_count: int, src_dcp: int, src_page_size: int, src_pages,
                     dst_dcp: int, dst_page_size: int, dst_pages,
                     interleave: int = 1) -> PDTransferPlan:
    """Which rows of which prefill rank land where on each decode rank (see module doc)."""
    base = plan_relayout(src_dcp, dst_dcp, token_count, interleave)  # validates the size change
    src_slots = _slots(src_pages, token_count, src_page_size * src_dcp, "prefill")
    dst_slots = _slots(dst_pages, token_count, dst_page_size * dst_dcp, "decode")
    transfers = []
    for shard in base.shards:
        pos = shard.positions
        src = DCPLayout(src_dcp, shard.src_rank, src_page_size, interleave if src_dcp > 1 else 1)
        dst = DCPLayout(dst_dcp, shard.dst_rank, dst_page_size, interleave)
        s_slots, d_slots = src_slots[pos], dst_slots[pos]
        if not bool(src.owns(s_slots).all()) or not bool(dst.owns(d_slots).all()):
            raise TopologyError("page tables do not keep the DCP ownership of positions")
        transfers.append(RankTransfer(shard.dst_rank, shard.src_rank, pos, src.physical(s_slots),
                                      d_slots, dst.physical(d_slots)))
    path = "page" if src_dcp == dst_dcp else "relayout"
    return PDTransferPlan(src_dcp, dst_dcp, token_count, path, tuple(transfers))


def pack_shard(src_kv: torch.Tensor, transfer: RankTransfer) -> torch.Tensor:
    """The transfer's rows of every layer, packed: src_kv [L, rows, D] -> [L, n, D]."""
    if src_kv.dim() != 3:
        raise TopologyError(f"source KV must be [layers, rows, kv_dim], got {tuple(src_kv.shape)}")
    if transfer.num_rows and int(transfer.src_rows.max()) >= src_kv.shape[1]:
        raise TopologyError(f"source row {int(transfer.src_rows.max())} is outside the source "
                            f"pool's {src_kv.shape[1]} rows")
    return src_kv.index_select(1, transfer.src_rows.to(src_kv.device))


def unpack_shard(dst_pool, transfer: RankTransfer, packed: torch.Tensor) -> int:
    """Store packed rows [L, n, D] at the transfer's slots of ``dst_pool``; rows stored."""
    if dst_pool.layout.rank != transfer.dst_rank or dst_pool.layout.dcp_size < 1:
        raise TopologyError(f"transfer for decode rank {transfer.dst_rank} given to the pool of "
                            f"rank {dst_pool.layout.rank}")
    expect = (dst_pool.num_layers, transfer.num_rows, dst_pool.kv_dim)
    if tuple(packed.shape) != expect:
        raise TopologyError(f"packed rows {tuple(packed.shape)} != expected {expect} "
                            "(layers, exact token rows, kv_dim)")
    where = dst_pool.plan_write(transfer.dst_slots)  # one plan for every layer
    stored = 0
    for layer in range(dst_pool.num_layers):
        stored = dst_pool.write(layer, where, packed[layer])
    return stored


def relayout_local(plan: PDTransferPlan, src_kvs: Sequence[torch.Tensor],
                   dst_pools: Sequence) -> list[int]:
    """Run a plan in one process: ``src_kvs[r]`` is prefill rank r's [L, rows, D] KV."""
    if len(src_kvs) != plan.src_dcp or len(dst_pools) != plan.dst_dcp:
        raise TopologyError(f"plan needs {plan.src_dcp} sources and {plan.dst_dcp} decode pools, "
                            f"got {len(src_kvs)} and {len(dst_pools)}")
    return [unpack_shard(dst_pools[t.dst_rank], t, pack_shard(src_kvs[t.src_rank], t))
            for t in plan.transfers]


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange(me: int, s: int, d: int, group, num_rows: int, dst_pool, sends: list,
             pack: Callable[[], torch.Tensor], unpack: Callable[[torch.Tensor], int]
             ) -> Optional[int]:
    """One point-to-point piece of a hand-off from group rank ``s`` to ``d``, as rank ``me``:
    a local copy when both are ``me``, else the packed rows ``isend`` (kept in ``sends`` with
    their tensor until waited) or received into a buffer. Rows stored here, or None."""
    if me == s and me == d:
        return unpack(pack())
    if me == s and num_rows:
        packed = pack().contiguous()
        sends.append((dist.isend(lend(packed), _global(group, d), group), packed))
    elif me == d:
        buf = torch.empty(dst_pool.num_layers, num_rows, dst_pool.kv_dim,
                          dtype=dst_pool.dtype, device=dst_pool.device)
        if num_rows:
            dist.recv(lend(buf), _global(group, s), group)
        return unpack(buf)
    return None


def run_pd_transfer(plan: PDTransferPlan, src_kv: Optional[torch.Tensor], dst_pool,
                    src_ranks: Sequence[int], dst_ranks: Sequence[int], group=None) -> int:
    """Run a plan across processes: prefill rank i is group rank ``src_ranks[i]``, decode rank j
    is ``dst_ranks[j]``. Each caller passes its source KV [L, rows, D] and/or its decode pool
    (None where it plays no part). Returns the rows this rank stored."""
    if len(src_ranks) != plan.src_dcp or len(dst_ranks) != plan.dst_dcp:
        raise TopologyError(f"plan maps {plan.src_dcp} prefill and {plan.dst_dcp} decode ranks; "
                            f"got {len(src_ranks)} and {len(dst_ranks)} group ranks")
    me = dist.get_rank(group) if dist.is_initialized() else 0
    stored = 0
    sends = []
    for t in plan.transfers:
        s, d = src_ranks[t.src_rank], dst_ranks[t.dst_rank]
        if me == s and src_kv is None:
            raise TopologyError(
                f"group rank {me} is prefill rank {t.src_rank} but has no source KV")
        if me == d and dst_pool is None:
            raise TopologyError(f"group rank {me} is decode rank {t.dst_rank} but has no pool")
        got = exchange(me, s, d, group, t.num_rows, dst_pool, sends,
                       lambda: pack_shard(src_kv, t), lambda buf: unpack_shard(dst_pool, t, buf))
        stored = stored if got is None else got
    for work, _packed in sends:  # the packed tensor stays alive until its send completes
        work.wait()
    return stored
