"""Prefill/decode hand-off of a request's DRAFT KV (speculative decoding) beside the target's.

The target's MLA KV is striped and relayouts (``hicache.pcp.relayout``). A draft's KV is
replicated: every rank of either side holds every row (``DCPLayout(1, 0, P*c)`` pools, the
draft pages of ``hicache.companions.draft``). So the draft moves UNCHANGED: each decode rank j gets
all ``token_count`` rows, from prefill rank ``j % src_dcp`` (DCP1 -> DCP-c: from the one
prefill rank), written at the decode request's own slots (its widened page table). Only
positions < ``token_count`` move, as for the target.

    plan_pd_draft(token_count, src_page_tokens, src_pages, dst_page_tokens, dst_pages,
                  src_dcp, dst_dcp) -> DraftHandoff
    copy_draft_local(plan, src_drafts, dst_pools) -> rows stored per decode rank (one process)
    run_pd_draft(plan, src_draft, dst_pool, src_ranks, dst_ranks, group=None) -> rows stored
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hicache.errors import TopologyError
from hicache.pcp.relayout import _slots, exchange

__all__ = ["DraftHandoff", "plan_pd_draft", "copy_draft_local", "run_pd_draft"]


@dataclass(frozen=True)
class DraftHandoff:
    """Every decode rank gets rows ``src_rows`` of prefill rank ``source(j)`` at its
    ``dst_slots`` (replicated pools: a slot is its row). int64 [token_count] each."""

    src_dcp: int
    dst_dcp: int
    token_count: int
    src_rows: torch.Tensor
    dst_slots: torch.Tensor

    def source(self, dst_rank: int) -> int:
        return dst_rank % self.src_dcp


def plan_pd_draft(token_count: int, src_page_tokens: int, src_pages, dst_page_tokens: int,
                  dst_pages, src_dcp: int, dst_dcp: int) -> DraftHandoff:
    """The draft rows' move for a request of ``token_count`` tokens (page tokens: the widened
    page sizes ``P*c`` of each side, the draft pools' page size)."""
    for name, v in (("src_dcp", src_dcp), ("dst_dcp", dst_dcp)):
        if not isinstance(v, int) or v < 1:
            raise TopologyError(f"{name} must be a positive int, got {v!r}")
    src = _slots(src_pages, token_count, src_page_tokens, "prefill draft")
    dst = _slots(dst_pages, token_count, dst_page_tokens, "decode draft")
    return DraftHandoff(src_dcp, dst_dcp, token_count, src, dst)


def _check_pool(pool) -> None:
    if pool.layout.dcp_size != 1:
        raise TopologyError(f"a draft pool is replicated (DCPLayout(1, 0, P*c)); got DCP "
                            f"{pool.layout.dcp_size}")


def _pack(src_draft: torch.Tensor, plan: DraftHandoff) -> torch.Tensor:
    if src_draft.dim() != 3:
        raise TopologyError(f"source draft KV must be [layers, rows, width], got "
                            f"{tuple(src_draft.shape)}")
    if plan.token_count and int(plan.src_rows.max()) >= src_draft.shape[1]:
        raise TopologyError(f"source draft row {int(plan.src_rows.max())} is outside the "
                            f"source pool's {src_draft.shape[1]} rows")
    return src_draft.index_select(1, plan.src_rows.to(src_draft.device))


def _unpack(pool, plan: DraftHandoff, packed: torch.Tensor) -> int:
    _check_pool(pool)
    expect = (pool.num_layers, plan.token_count, pool.kv_dim)
    if tuple(packed.shape) != expect:
        raise TopologyError(f"packed draft rows {tuple(packed.shape)} != expected {expect}")
    where = pool.plan_write(plan.dst_slots)
    stored = 0
    for layer in range(pool.num_layers):
        stored = pool.write(layer, where, packed[layer].to(pool.device))
    return stored


def copy_draft_local(plan: DraftHandoff, src_drafts: Sequence[torch.Tensor],
                     dst_pools: Sequence) -> list[int]:
    """Run the hand-off in one process: ``src_drafts[i]`` is prefill rank i's draft KV."""
    if len(src_drafts) != plan.src_dcp or len(dst_pools) != plan.dst_dcp:
        raise TopologyError(f"the hand-off needs {plan.src_dcp} sources and {plan.dst_dcp} "
                            f"decode draft pools, got {len(src_drafts)} and {len(dst_pools)}")
    return [_unpack(pool, plan, _pack(src_drafts[plan.source(j)], plan))
            for j, pool in enumerate(dst_pools)]


def run_pd_draft(plan: DraftHandoff, src_draft: Optional[torch.Tensor], dst_pool,
                 src_ranks: Sequence[int], dst_ranks: Sequence[int], group=None) -> int:
    """Across processes (point-to-point, like ``run_pd_transfer``): prefill rank i is group
    rank ``src_ranks[i]``, decode rank j is ``dst_ranks[j]``. Rows this rank stored."""
    if len(src_ranks) != plan.src_dcp or len(dst_ranks) != plan.dst_dcp:
        raise TopologyError(f"the hand-off maps {plan.src_dcp} prefill and {plan.dst_dcp} "
                            f"decode ranks; got {len(src_ranks)} and {len(dst_ranks)}")
    me = dist.get_rank(group) if dist.is_initialized() else 0
    stored, sends = 0, []
    for j, d in enumerate(dst_ranks):
        s = src_ranks[plan.source(j)]
        if me == s and src_draft is None:
            raise TopologyError(f"group rank {me} is a prefill rank but has no draft KV")
        if me == d and dst_pool is None:
            raise TopologyError(f"group rank {me} is decode rank {j} but has no draft pool")
        got = exchange(me, s, d, group, plan.token_count, dst_pool, sends,
                       lambda: _pack(src_draft, plan), lambda buf: _unpack(dst_pool, plan, buf))
        stored = stored if got is None else got
    for work, _packed in sends:
        work.wait()
    return stored
