"""The serving loop with L3 on (hicache.serving): a request waiting on L3 neither blocks what
could run past it nor evicts the prefix it is about to read.

- A queue head whose L3 lookup is still in flight overtakes a request waiting for L1 room when
  its new pages fit in the free pages (the lookup being agreed or not changes no room need: a
  restored page takes the L1 page its prefill would have).
- A request waiting on L3 (its read, or room for its agreed restore) is matched again when a
  request that finished put its prefix in L1: it takes that L1 hit instead of evicting it to
  make room for restoring the same tokens from L3.

Each scenario runs on one rank and on 2 gloo ranks (one group for both), whose decisions must
agree; token ids always equal recompute's.
"""


import numpy as np
import torch

from hicache.config import HiCacheConfig
from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.workloads import Request

from helpers import tiny_sections

TOKENS = 4  # tokens per (widened) page: P 4 on one rank, P 2 on two


def make_cfg(l3_path, dcp: int = 1, l1_pages: int = 20) -> HiCacheConfig:
    return HiCacheConfig.from_dict(tiny_sections(
        l3_path, dcp=dcp if dcp > 1 else None, page_size=TOKENS // dcp, l1_pages=l1_pages,
        l2_ratio=2.0, model={"signature": "test-weights"}, l3={"size_bytes": 64 << 20},
        policy={"l3_cost_model": False, "prefetch": "wait_complete",
                # every read waited for at admission (bounded): see serve()
                "prefetch_wait_pages": 1 << 20, "prefetch_wait_s": 60.0}))


def req(i, tokens, out):
    return Request(i, 0, np.asarray(tokens, dtype=np.int64), out, i)


def serve(cfg, jobs, mode, rank=0, group=None, **kw):
    """Run ``jobs``; the server's counters, results by id, finishing order, cache stats. Every
    L3 read is waited for at its admission (as short reads are), so what is agreed at which
    step does not depend on how fast this machine reads."""
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, rank, group, mode=mode) as cache:
        server = Server(model, cache, group=group, chunk_tokens=16, **kw)
        order = []
        results = server.run(jobs, on_done=lambda r: order.append(r.request_id))
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        stats = cache.stats()
    counters = {"overtakes": server.overtakes, "rematches": server.rematches,
                "preemptions": server.preemptions}
    return counters, {r.request_id: (r.output, r.hit) for r in results}, order, stats


def overtake_traces():
    """W (64 tokens, 17 pages with its output) is computed once and reaches L3 (the first run).
    Then, on an empty L1: A (40 tokens, 11 pages with its output) runs; W reads its 15 pages
    from L3, and its restore waits for room (9 pages free). B extends A's prompt: once A
    finished, A's 10 cached pages are B's hit and B needs 2 new pages; its own L3 lookup (of
    its last page) is in flight when it is admitted, past W. Without B overtaking, W's restore
    evicts A's pages to make its room."""
    rng = np.random.default_rng(3)
    a, w = rng.integers(0, 128, 40), rng.integers(0, 128, 64)
    warm = [req("W", w, out=1)]
    jobs = [req("A", a, out=4), req("W", w, out=2),
            req("B", np.concatenate([a, rng.integers(0, 128, 5)]), out=1)]
    return warm, jobs


def rematch_traces():
    """Q (40 tokens) is computed once and reaches L3 (the first run). Then, on an empty L1:
    X = Q + 20 tokens restores Q and decodes 8 tokens holding 17 of 20 pages; R = Q + 4 tokens
    reads Q from L3 too, and its restore (10 pages) waits for room until X finishes. X's finish
    puts Q in L1: R must take it as its L1 hit, not evict it to restore Q from L3."""
    rng = np.random.default_rng(5)
    q = rng.integers(0, 128, 40)
    warm = [req("Q", np.concatenate([q, rng.integers(0, 128, 3)]), out=1)]
    jobs = [req("X", np.concatenate([q, rng.integers(0, 128, 20)]), out=8),
            req("R", np.concatenate([q, rng.integers(0, 128, 4)]), out=1)]
    return warm, jobs


def overtake_scenario(l3_path, dcp=1, rank=0, group=None, max_overtakes=4):
    cfg = make_cfg(l3_path, dcp)
    warm, jobs = overtake_traces()
    serve(cfg, warm, "l1+l2+l3", rank, group)  # W in L3 once the cache closed (drained)
    return serve(cfg, jobs, "l1+l2+l3", rank, group, max_running=2,
                 max_overtakes=max_overtakes)


def rematch_scenario(l3_path, dcp=1, rank=0, group=None):
    cfg = make_cfg(l3_path, dcp)
    warm, jobs = rematch_traces()
    serve(cfg, warm, "l1+l2+l3", rank, group)  # Q in L3 once the cache closed (drained)
    return serve(cfg, jobs, "l1+l2+l3", rank, group, max_running=2)


def recompute(jobs):
    cfg = make_cfg(None)
    return {k: out for k, (out, _) in serve(cfg, jobs, "recompute")[1].items()}


def outputs(res):
    return {k: out for k, (out, _) in res.items()}


def test_a_request_whose_l3_lookup_is_in_flight_overtakes_the_waiter(tmp_path):
    held, h, _, _ = overtake_scenario(tmp_path / "held", max_overtakes=0)
    over, o, order, _ = overtake_scenario(tmp_path / "over")
    # strict hold: W evicts A's pages for its restore; B reads A's prompt back from L3
    assert held["overtakes"] == 0 and h["B"][1]["l1"] == 0
    # B is admitted with its lookup in flight, still overtakes, and hits A's pages in L1
    assert over["overtakes"] == 1 and o["B"][1] == {"l1": 40, "l2": 0, "l3": 0}
    assert order.index("B") < order.index("W")
    ref = recompute(overtake_traces()[1])
    assert outputs(h) == outputs(o) == ref


def test_a_request_waiting_on_l3_takes_the_prefix_a_finished_request_put_in_l1(tmp_path):
    counters, res, order, stats = rematch_scenario(tmp_path / "l3")
    assert order == ["X", "R"]
    assert res["X"][1] == {"l1": 0, "l2": 0, "l3": 40}  # X restored Q from L3
    # R waited on L3 while X ran; X's finish put Q in L1: R matched again and hit it there
    assert counters["rematches"] >= 1
    assert res["R"][1] == {"l1": 40, "l2": 0, "l3": 0}
    assert stats["restore_fallbacks"] == 0 and stats["evictions"]["l1"] == 0
    assert outputs(res) == recompute(rematch_traces()[1])


def _two_ranks(rank, world, root):
    import torch.distributed as dist
    group = dist.group.WORLD
    out = {"overtake": overtake_scenario(f"{root}/over", 2, rank, group),
           "rematch": rematch_scenario(f"{root}/rematch", 2, rank, group)}
    return {k: (c, res, order, s["hit_tokens"]) for k, (c, res, order, s) in out.items()}


def test_two_ranks_overtake_and_rematch_alike(tmp_path):
    r0, r1 = launch(2, _two_ranks, str(tmp_path), timeout_s=120)
    assert r0 == r1  # the same decisions and hits on both ranks (replicated facts only)
    over, o, order, _ = r0["overtake"]
    assert over["overtakes"] == 1 and o["B"][1] == {"l1": 40, "l2": 0, "l3": 0}
    assert order.index("B") < order.index("W")
    counters, res, _, _ = r0["rematch"]
    assert counters["rematches"] >= 1 and res["R"][1] == {"l1": 40, "l2": 0, "l3": 0}
    assert outputs(o) == recompute(overtake_traces()[1])
    assert outputs(res) == recompute(rematch_traces()[1])
