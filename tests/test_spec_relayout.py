"""PD hand-off with a draft (issue 25 point 6): DCP1 prefill -> DCP-c decode relayouts the
target's striped KV and copies the draft's replicated KV UNCHANGED to every decode rank (only
positions < token_count, at the decode request's own slots). One process, then real gloo
processes (1 prefill + 2 decode ranks, one spawn, point-to-point)."""

import pytest
import torch

from hicache.distributed import launch
from hicache.errors import TopologyError
from hicache.l1.pool import DeviceKVPool
from hicache.layout import DCPLayout
from hicache.pcp.draft_relayout import copy_draft_local, plan_pd_draft, run_pd_draft
from hicache.pcp.relayout import plan_pd_transfer, run_pd_transfer

P, P_SRC, C, LAYERS, DIM, DRAFT_LAYERS = 4, 8, 2, 2, 6, 1
LENGTH = 13  # a partial last page on both sides
SRC_PAGES, DST_PAGES = [2, 0], [3, 1]


def sources():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(LAYERS, 3 * P_SRC, DIM, generator=g)
    draft = torch.randn(DRAFT_LAYERS, 3 * P_SRC, DIM, generator=g)  # DCP1: a dense pool
    return target, draft


def draft_pool():
    return DeviceKVPool(DCPLayout(1, 0, P * C), DRAFT_LAYERS, DIM, torch.float32, 4,
                        device="cpu")


def expect_rows(pool, draft):
    """Every position's draft row on this decode rank is the prefill's, nothing else."""
    for pos in range(LENGTH):
        src_row = SRC_PAGES[pos // P_SRC] * P_SRC + pos % P_SRC
        slot = DST_PAGES[pos // (P * C)] * P * C + pos % (P * C)
        assert torch.equal(pool.kv[:, slot], draft[:, src_row])
    assert int(pool.kv.abs().sum(-1).gt(0).sum()) == LENGTH * DRAFT_LAYERS  # no stale rows


def test_draft_copied_unchanged_to_every_decode_rank_locally():
    _, draft = sources()
    plan = plan_pd_draft(LENGTH, P_SRC, SRC_PAGES, P * C, DST_PAGES, 1, C)
    pools = [draft_pool() for _ in range(C)]
    assert copy_draft_local(plan, [draft], pools) == [LENGTH] * C
    for pool in pools:
        expect_rows(pool, draft)
    with pytest.raises(TopologyError, match="decode draft page table"):
        plan_pd_draft(40, P_SRC, SRC_PAGES * 3, P * C, [0], 1, C)
    with pytest.raises(TopologyError, match="replicated"):
        copy_draft_local(plan, [draft], [DeviceKVPool(DCPLayout(C, 0, P), 1, DIM,
                                                      torch.float32, 4, device="cpu")] * C)
    with pytest.raises(TopologyError, match="sources"):
        copy_draft_local(plan, [draft, draft], pools)


def _worker(rank, world):
    target, draft = sources()
    plan = plan_pd_transfer(LENGTH, 1, P_SRC, SRC_PAGES, C, P, DST_PAGES)
    dplan = plan_pd_draft(LENGTH, P_SRC, SRC_PAGES, P * C, DST_PAGES, 1, C)
    pool = dpool = None
    if rank > 0:
        pool = DeviceKVPool(DCPLayout(C, rank - 1, P), LAYERS, DIM, torch.float32, 4,
                            device="cpu")
        dpool = draft_pool()
    src = (target, draft) if rank == 0 else (None, None)
    stored = run_pd_transfer(plan, src[0], pool, [0], [1, 2])
    dstored = run_pd_draft(dplan, src[1], dpool, [0], [1, 2])
    if rank > 0:
        expect_rows(dpool, draft)
        owned = DCPLayout(C, rank - 1, P)
        for pos in range(LENGTH):  # the target: striped, this rank's positions only
            slot = DST_PAGES[pos // (P * C)] * P * C + pos % (P * C)
            if owned.owns(slot):
                src_row = SRC_PAGES[pos // P_SRC] * P_SRC + pos % P_SRC
                assert torch.equal(pool.kv[:, owned.physical(slot)], target[:, src_row])
    return stored, dstored


def test_draft_hand_off_across_processes():
    res = launch(3, _worker, backend="gloo", timeout_s=120)
    assert [r[1] for r in res[1:]] == [LENGTH, LENGTH]  # every decode rank: every draft row
    assert sum(r[0] for r in res[1:]) == LENGTH  # the target: striped, each row once
