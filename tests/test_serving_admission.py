"""The serving loop's admission while a request waits for L1 room (hicache.serving).

A request that finds no L1 room holds up admission (the progress guarantee), except that the
head of the queue may overtake it when its hit is ready and its new pages fit in the free
pages: then what a finished request left in L1 becomes the overtaker's hit instead of being
evicted by the waiter. Each waiter is overtaken at most ``max_overtakes`` times.
"""

import numpy as np
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.engine.model import MLAModel
from hicache.errors import ConfigError
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.workloads import Request

from helpers import write_kv_rows, tiny_sections

P = 4  # tokens per page (dcp 1)


def make_cfg(tmp_path, l1_pages=20) -> HiCacheConfig:
    """The tiny model without L3 (``tmp_path`` unused: L3 is off)."""
    return HiCacheConfig.from_dict(tiny_sections(
        page_size=P, l1_pages=l1_pages, l2_ratio=2.0, model={"signature": "test-weights"},
        policy={"l3_cost_model": False}))


def req(i, tokens, out):
    return Request(i, 0, np.asarray(tokens, dtype=np.int64), out, i)


def chain_trace(links: int):
    """A (40 tokens, 11 pages with its output) runs; W (11 pages, nothing shared) then finds
    only 9 of 20 pages free and waits; B1 extends A's prompt, B2 extends B1's, ...: each hits
    its predecessor's pages once that finished and needs 2 new pages."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 128, 40)
    jobs = [req("A", a, out=4), req("W", rng.integers(0, 128, 40), out=2)]
    prev = a
    for i in range(links):
        prev = np.concatenate([prev, rng.integers(0, 128, 5)])
        jobs.append(req(f"B{i + 1}", prev, out=1))
    return jobs


def serve(cfg, jobs, mode="l1", **kw):
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode=mode) as cache:
        server = Server(model, cache, chunk_tokens=16, max_running=2, **kw)
        order = []
        results = server.run(jobs, on_done=lambda r: order.append(r.request_id))
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
    return server, {r.request_id: r for r in results}, order


@pytest.mark.parametrize("mode", ["l1", "l1+l2"])
def test_a_request_hitting_what_just_finished_overtakes_the_waiter(tmp_path, mode):
    cfg = make_cfg(tmp_path)
    jobs = chain_trace(1)
    held, h, _ = serve(cfg, jobs, mode, max_overtakes=0)
    over, o, _ = serve(cfg, jobs, mode, max_overtakes=4)
    ref = serve(cfg, jobs, "recompute")[1]
    # strict hold: W evicts A's pages to get its room, so B1 recomputes A's prompt
    assert held.overtakes == 0 and h["B1"].hit["l1"] == 0
    # overtaking: B1 locks A's 10 cached pages before W evicts them and needs 2 free pages
    assert over.overtakes == 1 and o["B1"].hit["l1"] == 40
    assert o["W"].hit == {"l1": 0, "l2": 0, "l3": 0}
    for res in (h, o):
        assert {k: r.output for k, r in res.items()} == {k: r.output for k, r in ref.items()}


def test_a_waiter_is_overtaken_at_most_max_overtakes_times(tmp_path):
    cfg = make_cfg(tmp_path)
    jobs = chain_trace(3)  # B1, B2, B3 could each overtake W
    one, _, order1 = serve(cfg, jobs, max_overtakes=1)
    two, _, order2 = serve(cfg, jobs, max_overtakes=2)
    many, r, order = serve(cfg, jobs, max_overtakes=8)
    assert one.overtakes == 1 and order1.index("W") < order1.index("B2")
    assert two.overtakes == 2 and order2.index("B2") < order2.index("W") < order2.index("B3")
    assert many.overtakes == 3 and order.index("W") == len(jobs) - 1
    assert [r[f"B{i}"].hit["l1"] for i in (1, 2, 3)] == [40, 44, 48]  # each its predecessor's


def test_a_request_that_would_evict_does_not_overtake(tmp_path):
    """The queue head shares nothing with what finished: it would take the waiter's room by
    eviction, so it goes back to the head of the queue and W runs first."""
    cfg = make_cfg(tmp_path)
    rng = np.random.default_rng(4)
    jobs = chain_trace(0) + [req("C", rng.integers(0, 128, 40), out=1)]
    server, res, order = serve(cfg, jobs, max_overtakes=4)
    assert server.overtakes == 0 and order.index("W") < order.index("C")
    assert res["C"].prompt_len == 40


def test_max_overtakes_is_checked(tmp_path):
    cfg = make_cfg(tmp_path)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode="l1") as cache:
        for bad in (-1, 1.5, True):
            with pytest.raises(ConfigError, match="max_overtakes"):
                Server(model, cache, max_overtakes=bad)


def test_a_queue_head_sent_back_starts_its_ttft_when_admitted(tmp_path, monkeypatch):
    """C is tried past W and sent back (it would evict): it was never admitted then, so its
    TTFT counts from its real admission, as for any request that waited in the queue. The
    clock here ticks once per scheduler step: a TTFT is a number of steps."""
    import types

    import hicache.serving as serving
    clock = [0.0]
    monkeypatch.setattr(serving, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = make_cfg(tmp_path)
    rng = np.random.default_rng(4)
    jobs = chain_trace(0) + [req("C", rng.integers(0, 128, 40), out=1)]
    torch.manual_seed(0)
    with HiCache(cfg, mode="l1") as cache:
        step = cache.step

        def ticking_step():
            clock[0] += 1.0
            return step()
        cache.step = ticking_step
        server = Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16, max_running=2)
        res = {r.request_id: r for r in server.run(jobs)}
    assert server.probes_returned == 1 and server.overtakes == 0
    # admitted, then the step's agreement, then its prefill in the same iteration: one step
    assert res["C"].ttft_s == 1.0
    assert res["W"].ttft_s > 1.0  # W did wait for room after its admission


def test_a_queue_head_that_does_not_fit_is_not_admitted_to_find_out(tmp_path):
    """C's prompt is in L2 only when it is tried past the waiter W: admitting it would load
    that hit into L1's free pages (the room W waits for) before finding that C does not fit.
    The fit is asked first (``HiCache.peek``), so C stays queued untouched: it is admitted
    once, after W, and its hit is still loaded from L2 then (L2 holds everything here)."""
    cfg = HiCacheConfig.from_dict(tiny_sections(
        page_size=P, l1_pages=20, l2_ratio=4.0, model={"signature": "test-weights"},
        policy={"l3_cost_model": False}))
    rng = np.random.default_rng(5)
    x = rng.integers(0, 128, 40)
    torch.manual_seed(0)
    with HiCache(cfg, mode="l1+l2") as cache:
        server = Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16, max_running=2)
        server.run([req("C0", x, out=1)])
        cache.drain()  # C0's prompt is backed up to L2
        server.run([req("D", rng.integers(0, 128, 72), out=1)])  # evicts it from L1
        cache.drain()
        assert cache.peek(x) == (0, 36)
        admits = []
        admit = cache.admit
        cache.admit = lambda rid, tokens: admits.append(rid) or admit(rid, tokens)
        res = {r.request_id: r for r in server.run(chain_trace(0) + [req("C", x, out=1)])}
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
    assert server.probes_returned == 1 and server.overtakes == 0
    assert admits.count("C") == 1 and admits.index("W") < admits.index("C")
    assert res["C"].hit == {"l1": 0, "l2": 36, "l3": 0}


def test_peek_changes_nothing(tmp_path):
    """``peek`` reports admit's L1/L2 hit (the last prompt token never counts) and locks,
    loads and touches nothing: the eviction order is the same with or without it."""
    cfg = make_cfg(tmp_path)
    rng = np.random.default_rng(6)
    a, b = rng.integers(0, 128, 17), rng.integers(0, 128, 17)

    def evicted_first(peek: bool):
        with HiCache(cfg, mode="l1") as cache:
            for rid, toks in (("a", a), ("b", b)):
                cache.admit(rid, toks)
                cache.alloc(rid, len(toks))
                write_kv_rows(cache, rid, len(toks))
                cache.finish(rid, toks)
            if peek:
                assert cache.peek(a) == (16, 0) and cache.peek(a[:16]) == (12, 0)
                assert cache.peek(np.concatenate([a, b])) == (16, 0)
            assert cache.stats()["locks"] == 0
            cache.admit("big", rng.integers(0, 128, 4 * 17))
            cache.alloc("big", 4 * 17)  # evicts the least recently used of a's and b's pages
            write_kv_rows(cache, "big", 4 * 17)
            return cache.peek(a)[0], cache.peek(b)[0]
    assert evicted_first(True) == evicted_first(False)
