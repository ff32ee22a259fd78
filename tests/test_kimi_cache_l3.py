"""Hybrid (Kimi Linear) KDA state snapshots in L3: written once for the DCP group, read by every
rank, agreed like every L3 read (hicache.companions.snapshots, snapshot_l3).

A warm restart (a new HiCache, empty L1 and L2, over the same LMDB store) gets the prompt's MLA
KV pages and the KDA snapshot at their end from L3, and its tokens equal recompute's: on one
rank in process, and on 2 gloo ranks (one spawned group for every check) where only rank 0
writes the snapshot and both read it. A snapshot missing on one rank only (a damaged value:
a miss on that rank) makes both ranks recompute, alike.
"""

import numpy as np
import pytest

from hicache.config import HiCacheConfig
from hicache.distributed import launch
from hicache.l3 import chain_hashes
from hicache.serving import Server
from hicache.service import HiCache
from hicache.workloads import Request

from test_kimi_cache import kimi, toks  # noqa: F401  (the module's checkpoint fixture)


def cfg_of(path, l3_dir, dcp=1):
    return HiCacheConfig.from_dict({
        "model": {"path": path, "signature": "kimi-test"},
        "parallel": {"tp": dcp, "dcp": dcp}, "cache": {"page_size": 4 // dcp},
        "l1": {"num_pages": 32}, "l2": {"ratio": 2.0},
        "hybrid": {"snapshot_every_pages": 2, "l1_state_bytes": 1 << 20},
        "l3": {"enabled": True, "lmdb": {"path": str(l3_dir), "size_bytes": 64 << 20}},
        "policy": {"l3_cost_model": False, "prefetch": "wait_complete",
                   "prefetch_wait_pages": 1 << 20, "prefetch_wait_s": 60.0}})


def jobs():
    base = toks(1, 16)  # 4-token pages: snapshots every 8 tokens and at each prefix end
    a = np.concatenate([base, toks(2, 5)])
    b = np.concatenate([base, toks(3, 5)])  # differs right after the snapshot at 16
    return [Request("A", 0, a, 3, 0)], [Request("A2", 0, a.copy(), 3, 1),
                                        Request("B", 0, b, 3, 2)]


def serve_runs(path, l3_dir, runs, mode, rank=0, group=None, damage=None):
    """Each run a fresh HiCache over the same store; per run: {id: (output, hit)} and the
    hybrid stats. ``damage(cache)`` runs between the runs (a fault on one rank)."""
    from hicache.checkpoints.hf import load_model
    model = load_model(path)
    cfg = cfg_of(path, l3_dir, 1 if group is None else 2)
    out = []
    for i, run in enumerate(runs):
        with HiCache(cfg, rank, group, mode=mode) as cache:
            if i and damage is not None:
                damage(cache)
            server = Server(model, cache, group=group, chunk_tokens=6, max_running=1)
            res = {r.request_id: (r.output, r.hit) for j in run for r in server.run([j])}
            assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
            cache.drain()  # the L3 writes land (in the background): the stats count them all
            out.append((res, cache.stats().get("hybrid")))
    return out


def check_warm(runs, ref):
    (first, _), (warm, h) = runs
    assert {**first, **warm}.keys() == ref.keys()
    for k, (output, _) in {**first, **warm}.items():
        assert output == ref[k][0], k
    # A2: 20 prompt tokens from L3 (KV pages and the snapshot at 20). B: A2 put the pages of
    # 0..16 in L1, but their snapshot at 16 is in L3 only: B's L1 hit is cut back to 0 and
    # its L3 read (pages and snapshot at 16) makes up for it
    assert warm["A2"][1] == {"l1": 0, "l2": 0, "l3": 20}
    assert warm["B"][1] == {"l1": 0, "l2": 0, "l3": 16}
    assert h["hits"]["l3"] == 2 and h["read_bytes"]["l3"] == 2 * h["snapshot_bytes"]
    assert h["lost_tokens"] == 0


def test_the_snapshots_are_written_to_l3_off_finish(kimi, tmp_path):  # noqa: F811
    # the snapshots' L3 put runs on their writer's thread: the requests finish (and the
    # server steps on) while it is held; released, drain() flushes it, the snapshots are in
    # the store, counted, and a warm restart restores from them
    from hicache.checkpoints.hf import load_model
    from helpers import BlockedPuts
    first, second = jobs()
    with HiCache(cfg_of(kimi, tmp_path / "l3"), mode="l1+l2+l3") as cache:
        gate = BlockedPuts(cache.companion("hybrid").l3.store)
        server = Server(load_model(kimi), cache, chunk_tokens=6, max_running=1)
        for j in first:
            server.run([j])
        assert gate.entered.wait(60) and not gate.returned.is_set()
        assert cache.stats()["hybrid"]["written_bytes"]["l3"] == 0  # counted once written
        gate.release.set()
        cache.drain()
        h = cache.stats()["hybrid"]
        assert gate.returned.is_set() and len(gate.keys) == 3  # snapshots at 8, 16, 20
        assert h["written_bytes"]["l3"] == 3 * h["snapshot_bytes"]
        assert all(cache.companion("hybrid").l3.store.exists_prefix([k]) for k in gate.keys)
    (warm, h), = serve_runs(kimi, tmp_path / "l3", [second], "l1+l2+l3")
    assert warm["A2"][1] == {"l1": 0, "l2": 0, "l3": 20} and h["hits"]["l3"] == 2


def test_the_snapshot_is_read_from_l3_off_admit(kimi, tmp_path):  # noqa: F811
    # the snapshot's lookups and read run on its read thread: the warm run's first admit
    # returns while its get is held (the request not ready); released, the next steps agree
    # and restore it as a synchronous read did (the same tokens, hits and bytes)
    from helpers import BlockedGets, admit_gated
    seen: list = []

    def gate(cache):
        admit_gated(cache, BlockedGets(cache.companion("hybrid").l3.store), seen)
    runs = serve_runs(kimi, tmp_path / "l3", jobs(), "l1+l2+l3", damage=gate)
    assert seen == [True]
    check_warm(runs, reference(kimi, tmp_path / "ref"))


def reference(path, tmp):
    first, second = jobs()
    return {k: v for res, _ in serve_runs(path, tmp, [first + second], "recompute")
            for k, v in res.items()}


def test_a_warm_restart_restores_the_snapshot_from_l3(kimi, tmp_path):  # noqa: F811
    runs = serve_runs(kimi, tmp_path / "l3", jobs(), "l1+l2+l3")
    check_warm(runs, reference(kimi, tmp_path / "ref"))
    assert runs[0][1]["written_bytes"]["l3"] == 3 * runs[0][1]["snapshot_bytes"]  # 8, 16, 20


def _flip_snapshot(position):
    """Flip a payload byte of the stored snapshot after A's first ``position`` tokens, in the
    LMDB file itself (what a bad disk or a foreign writer leaves)."""
    def damage(cache):
        l3 = cache.companion("hybrid").l3
        store = l3.store._store  # the PageStore under the guard
        tokens = np.asarray(jobs()[0][0].tokens[:position])
        key = l3._key(chain_hashes(tokens, cache.page_tokens)[-1])  # the page ending there
        with store._env.begin(write=True) as txn:
            value = bytearray(txn.get(key, db=store._data))
            value[len(value) // 2] ^= 0x40
            txn.put(key, bytes(value), db=store._data)
    return damage


def test_a_damaged_snapshot_is_a_miss_and_a_shallower_one_serves(kimi, tmp_path):  # noqa: F811
    runs = serve_runs(kimi, tmp_path / "l3", jobs(), "l1+l2+l3", damage=_flip_snapshot(20))
    ref = reference(kimi, tmp_path / "ref")
    (first, _), (warm, h) = runs
    for k, (output, _) in {**first, **warm}.items():
        assert output == ref[k][0], k
    assert h["l3_corrupt"] == 1  # the checksum caught it: never served
    assert warm["A2"][1] == {"l1": 0, "l2": 0, "l3": 16}  # the snapshot at 16 serves


def _damage_rank1(cache):
    """Rank 1's store loses the group's snapshots (its reads miss; rank 0's do not)."""
    if cache.rank == 1:
        cache.companion("hybrid").l3.find = lambda tokens, lo, hi: (lo, None)


def _two_ranks(rank, world, path, root):
    import torch.distributed as dist
    group = dist.group.WORLD
    ok = serve_runs(path, f"{root}/ok", jobs(), "l1+l2+l3", rank, group)
    miss = serve_runs(path, f"{root}/miss", jobs(), "l1+l2+l3", rank, group,
                      damage=_damage_rank1)
    return ok, miss


def test_two_ranks_write_the_snapshot_once_and_both_read_it(kimi, tmp_path):  # noqa: F811
    r0, r1 = launch(2, _two_ranks, kimi, str(tmp_path), timeout_s=300)
    ref = reference(kimi, tmp_path / "ref")
    (ok0, miss0), (ok1, miss1) = r0, r1
    for runs in (ok0, ok1):
        check_warm(runs, ref)
    assert ok0[0][1]["written_bytes"]["l3"] > 0 and ok1[0][1]["written_bytes"]["l3"] == 0
    # a snapshot one rank cannot read: every rank recomputes past the L1 hit, tokens equal
    for runs in (miss0, miss1):
        warm = runs[1][0]
        assert warm["A2"][1]["l3"] == 0 and runs[1][1]["hits"]["l3"] == 0
        for k, (output, _) in {**runs[0][0], **warm}.items():
            assert output == ref[k][0], k
    assert miss0[1][0] == miss1[1][0]
