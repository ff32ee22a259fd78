"""Async writer, prefetcher policies, cost model, restore-length agreement (single process)."""

import threading
import time

import pytest
import torch

from hicache.errors import L3Error
from hicache.l3 import (AsyncWriter, CostModel, Namespace, PageStore, PrefetchPolicy, Prefetcher,
                        agree_prefetch, page_keys, prefetch_signals, restore_length,
                        restore_lengths)
from hicache.l3.store import L3Stats
from helpers import write_kv_rows

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="float16", page_size=4, dcp_size=1)
PT = NS.page_tokens  # 4
CAP = 1000 * (NS.shard_bytes + 64)


def shard(seed):
    return torch.full(NS.shard_shape, float(seed), dtype=torch.float16)


def empty(n):
    return [torch.zeros(NS.shard_shape, dtype=torch.float16) for _ in range(n)]


def test_async_writer_batches_and_flushes_on_close(tmp_path):
    store = PageStore(tmp_path, NS, 0, capacity_bytes=CAP)
    calls = []
    real = store.put
    store.put = lambda k, s: calls.append(len(k)) or real(k, s)
    w = AsyncWriter(store, batch_pages=16)
    gate = threading.Event()
    orig = store.put
    store.put = lambda k, s: (gate.wait(5), orig(k, s))[1]  # hold the thread on its first batch
    futs = [w.submit(page_keys(list(range(i * 100, i * 100 + 3 * PT)), PT, NS, 0),
                     [shard(i)] * 3) for i in range(6)]
    assert w.pending_pages == 18
    gate.set()
    w.close()  # flushes
    assert all(f.done() and f.exception() is None for f in futs)
    assert w.pending_pages == 0
    assert sum(calls) == 18 and len(calls) < 6  # queued submissions merged into few puts
    for i in range(6):
        keys = page_keys(list(range(i * 100, i * 100 + 3 * PT)), PT, NS, 0)
        out = empty(3)
        assert store.get(keys, out) == 3 and torch.equal(out[2], shard(i))
    with pytest.raises(L3Error, match="closed"):
        w.submit([], [])
    store.close()


def test_async_writer_surfaces_errors(tmp_path):
    store = PageStore(tmp_path, NS, 0, capacity_bytes=CAP)
    w = AsyncWriter(store)
    with pytest.raises(L3Error, match="shard 0"):  # bad input is refused at submit
        w.submit(page_keys(list(range(PT)), PT, NS, 0), [torch.zeros(3)])
    gate = threading.Event()
    real = store.put
    store.put = lambda k, s: (gate.wait(5), real(k, s))[1]
    fut = w.submit(page_keys(list(range(PT)), PT, NS, 0), [shard(1)])
    store.close()  # the background put now fails
    gate.set()
    with pytest.raises(L3Error, match="background write failed"):
        w.flush(timeout=10)
    assert isinstance(fut.exception(), L3Error)
    w.close()


def _filled(tmp_path, n_pages):
    store = PageStore(tmp_path, NS, 0, capacity_bytes=CAP)
    toks = list(range(n_pages * PT + 2))
    keys = page_keys(toks, PT, NS, 0)
    store.put(keys, [shard(i) for i in range(n_pages)])
    return store, keys


def test_prefetch_wait_complete_reads_stored_prefix(tmp_path):
    store, keys = _filled(tmp_path, 10)
    more = keys + page_keys(list(range(1000, 1000 + 3 * PT)), PT, NS, 0)  # 3 absent pages after
    pf = Prefetcher(store, PrefetchPolicy("wait_complete"), chunk_pages=3)
    out = empty(len(more))
    h = pf.start("r1", more, out)
    assert h.wait(10) and h.finished and h.is_ready()
    assert h.pages_done == 10 and h.tokens_done == 10 * PT and h.error is None
    assert all(torch.equal(out[i], shard(i)) for i in range(10))
    assert torch.equal(out[10], empty(1)[0])
    assert agree_prefetch([h]) == [(True, 10)]  # alone: no collective needed
    pf.close()
    store.close()


def test_prefetch_policies_readiness(tmp_path):
    store, keys = _filled(tmp_path, 4)
    block = threading.Event()
    real_get = store.get
    store.get = lambda k, o: (block.wait(10), real_get(k, o))[1]  # a slow disk
    for mode, ready_before in [("best_effort", True), ("wait_complete", False),
                               ("timeout", False)]:
        block.clear()
        pf = Prefetcher(store, PrefetchPolicy(mode, timeout_s=0.05, timeout_per_1k_s=0.0),
                        chunk_pages=2)
        h = pf.start(mode, keys, empty(4))
        assert h.is_ready() is ready_before and h.pages_done == 0
        assert prefetch_signals([h]) == [int(ready_before), 0]
        if mode == "timeout":
            assert h.is_ready(now=h.started + 0.06) and not h.is_ready(now=h.started + 0.04)
        block.set()
        assert h.wait(10) and h.is_ready() and h.pages_done == 4
        pf.close()
    store.close()


def test_prefetch_min_tokens_cancel_and_callable_out(tmp_path):
    store, keys = _filled(tmp_path, 6)
    pf = Prefetcher(store, PrefetchPolicy("best_effort", min_tokens=3 * PT), chunk_pages=1)
    h = pf.start("short", keys[:2], empty(2))  # 2 pages < 3 pages minimum: nothing read
    assert h.finished and h.pages_done == 0 and store.stats.hits == 0
    got = {}
    h = pf.start("cb", keys, lambda i: got.setdefault(i, empty(1)[0]))
    h.wait(10)
    assert h.pages_done == 6 and torch.equal(got[5], shard(5))
    # cancel: the reader stops between chunks and leaves later buffers alone
    step = threading.Semaphore(0)
    real_get = store.get
    store.get = lambda k, o: (step.acquire(timeout=10), real_get(k, o))[1]
    out = empty(6)
    h = pf.start("cancel", keys, out)
    step.release()
    deadline = time.monotonic() + 20
    while h.pages_done < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert h.pages_done >= 1
    done = h.cancel(wait=False)
    step.release()
    assert h.wait(10)
    assert h.pages_done <= 2 and done <= h.pages_done
    assert torch.equal(out[5], empty(1)[0])
    assert h.usable_pages() == 0  # below min_tokens: not usable
    pf.close()
    with pytest.raises(L3Error, match="only 1 buffers"):
        Prefetcher(store).start("x", keys[:2], empty(1))
    with pytest.raises(L3Error, match="not one of"):
        PrefetchPolicy("sometimes")
    store.close()


def test_restore_length_truncates_and_checks_agreed():
    assert restore_length(37, 8) == 32
    assert restore_lengths([37, 7, 64], 8) == [32, 0, 64]
    assert restore_length(37, 8, agreed=17) == 16
    with pytest.raises(L3Error, match="exceeds this rank"):
        restore_length(16, 8, agreed=24)
    with pytest.raises(L3Error, match="non-negative"):
        restore_length(-1, 8)
    with pytest.raises(L3Error, match="positive"):
        restore_length(8, 0)


def test_cost_model():
    cm = CostModel(read_bytes_per_s=1e9, prefill_tokens_per_s=1e4, overhead_s=0.001)
    # 1000 tokens: recompute 0.1 s; load 10 MB: 0.011 s -> load
    assert cm.should_load(1000, 10_000_000)
    # 200 MB: 0.201 s > 0.1 s -> recompute
    assert not cm.should_load(1000, 200_000_000)
    assert not cm.should_load(0, 0)
    for _ in range(50):
        cm.observe_read(1_000_000, 0.01)  # measured disk turns out slow: 100 MB/s
    assert cm.read_bytes_per_s == pytest.approx(1e8, rel=1e-3)
    assert not cm.should_load(1000, 10_000_000)  # now 0.101 s > 0.1 s
    for _ in range(50):
        cm.observe_prefill(1000, 1.0)  # prefill slower: 1K tok/s
    assert cm.should_load(1000, 10_000_000)
    st = L3Stats(bytes_read=2_000_000, read_s=0.001)
    assert CostModel.from_stats(st, 1e4).read_bytes_per_s == pytest.approx(2e9)
    with pytest.raises(L3Error, match="served nothing"):
        CostModel.from_stats(L3Stats(), 1e4)
    with pytest.raises(L3Error, match="must be > 0"):
        CostModel(0, 1)


def test_cancel_waits_a_bounded_time_for_a_stuck_read(tmp_path):
    """A read stuck in the store: ``cancel(wait=True)`` raises a clear error after the bound
    (derived from the store's call timeout and the prefetch timeout), never hangs."""
    store, keys = _filled(tmp_path, 4)
    gate = threading.Event()
    real_get = store.get
    store.get = lambda k, o: (gate.wait(30), real_get(k, o))[1]
    policy = PrefetchPolicy("timeout", timeout_s=0.5, timeout_per_1k_s=0.0)
    pf = Prefetcher(store, policy, chunk_pages=2)
    assert pf.stop_timeout_s == pytest.approx(2.0 + 0.5)  # one redis-bounded call + the policy's
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(L3Error, match="stop_timeout_s"):
            Prefetcher(store, policy, stop_timeout_s=bad)
    pf = Prefetcher(store, policy, chunk_pages=2, stop_timeout_s=0.05)
    h = pf.start("stuck", keys, empty(4))
    assert h.stop_timeout_s == 0.05
    with pytest.raises(L3Error, match="'stuck' did not stop within 0.05 s"):
        h.cancel()
    with pytest.raises(L3Error, match="within 0.01 s"):
        h.cancel(timeout=0.01)
    gate.set()  # the store answers: the reader sees the cancel after its chunk
    assert h.cancel(timeout=10) == h.pages_done <= 2 and h.finished
    pf.close()
    store.close()


def test_finishing_a_request_whose_read_is_stuck_does_not_hang(tmp_path):
    """The service's cancel of a stuck read abandons it (its staging buffer is its own) and
    the request finishes; nothing leaks."""
    from helpers import make_cfg
    from hicache.service import HiCache
    from test_faults import leaks
    from hicache.l3.prefetch import _STORE_CALL_S
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete", prefetch_wait_s=0.0)
    prompt = torch.arange(33).numpy() % 128
    with HiCache(cfg, mode="l1+l2+l3") as cache:  # write the prompt's pages to L3
        p = cache.admit("a", prompt)
        while not p.ready:
            cache.step()
        cache.alloc("a", len(prompt))
        write_kv_rows(cache, "a", len(prompt))
        cache.finish("a", prompt)
    gate = threading.Event()
    cache = HiCache(cfg, mode="l1+l2+l3")
    try:
        real_get = cache.l3.get
        cache.l3.get = lambda k, o: (gate.wait(30), real_get(k, o))[1]
        # the bound follows the store's call timeout (LMDB has none: the default bound)
        assert cache.io.prefetcher.stop_timeout_s == pytest.approx(
            _STORE_CALL_S + cfg.policy.prefetch_timeout_s
            + cfg.policy.prefetch_timeout_per_1k_s * 8 * cache.page_tokens / 1000)
        cache.io.prefetcher.stop_timeout_s = 0.05
        p = cache.admit("b", prompt)
        assert not p.ready and cache._pending  # the read is in the store
        h = cache._reqs["b"].prefetch.handle
        cache.finish("b", prompt[:4])
        assert not h.finished  # returned while the read is still in the store
        assert cache.stats()["prefetch"]["cancelled"] == 1 and not cache._pending
        assert leaks(cache) == {}
    finally:
        gate.set()
        cache.close()
