"""The service's data movement (hicache/tier_io.py): typed in-flight records, the L3 restore as
a transfer job (per-layer completion, overlapping the step that agreed it, counted and timed as
H2D, its failure agreed like any copy's) and the one cost model."""

import threading

import numpy as np
import pytest
import torch

from hicache.controller import BackupOp
from hicache.engine.model import MLAModel
from hicache.errors import L3Error, TransferError
from hicache.l2.transfer import DONE, PENDING, TransferJob
from hicache.l3 import CostModel, L3Stats, chain_hashes
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.tier_io import InFlight, L3Read, PageChain, Waits

from helpers import admit_ready, make_cfg
from test_service import _kv_of, req


def _stored(cfg, prompt):
    """``prompt`` computed once and written to L3 (a cold cache, closed)."""
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        Server(model, cache, chunk_tokens=16).run([req("cold", prompt, out=1)])
        cache.drain()


def _reference(cfg, tmp_path, prompt, n):
    """The KV rows prefill writes for the first ``n`` tokens of ``prompt``: [L, n, D]."""
    model = MLAModel(model_config(cfg))
    with HiCache(cfg.replace(l3={"path": str(tmp_path / "ref")}), mode="l1") as cache:
        Server(model, cache, chunk_tokens=16).run([req("ref", prompt, out=1)])
        m = cache.admit("look", prompt)
        out = _kv_of(cache, m.page_table, n)
        cache.finish("look", [])
    return out


def test_in_flight_records_are_typed(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=8, prefetch="wait_complete")
    tokens = np.random.default_rng(0).integers(0, 128, 12)
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        admit_ready(cache, "a", np.concatenate([tokens, [1]]))
        cache.finish("a", tokens)  # write_through: one backup of 3 pages
        (op_id, rec), = cache.io.inflight.items()
        assert isinstance(rec, InFlight) and isinstance(rec.op, BackupOp)
        assert rec.op.op_id == op_id and rec.direction == "d2h"
        assert isinstance(rec.job, TransferJob) and rec.job.direction == "d2h"
        want = {PageChain(c, i) for i, c in enumerate(chain_hashes(tokens, 4))}
        assert set(rec.chains) == want and len(rec.chains) == 3
        for page, chain in zip(rec.op.device_pages, rec.chains):
            assert cache.io.chain_of_page[page] == chain  # what the page held when launched
        rec.job.wait()
        cache.step()
        assert cache.io.inflight == {} and cache.stats()["bytes"]["d2h"] == rec.job.nbytes


def test_l3_restore_is_a_transfer_job_that_overlaps_and_is_counted(tmp_path):
    """The agreed restore returns at once with the copy still running (held on a gate here):
    ``wait_layer`` blocks until it lands, then the rows are prefill's; the next step counts it
    as H2D bytes."""
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, prefetch="wait_complete")
    prompt = np.random.default_rng(1).integers(0, 128, 33)
    _stored(cfg, prompt)
    reference = _reference(cfg, tmp_path, prompt, 32)
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        cache.transfer.inline_bytes = 0  # through the copy thread, so the gate can hold it
        gate = threading.Event()
        real = cache.transfer.backend.copy

        def gated(job):
            if job.src is not None and job.src.medium == "staging":
                gate.wait(30)
            real(job)
        cache.transfer.backend.copy = gated
        p = cache.admit("warm", prompt)
        assert isinstance(cache._reqs["warm"].prefetch, L3Read)
        while not cache.step():
            pass
        assert p.ready and p.storage_len == 32
        (rec,) = cache.io.restores
        assert rec.op is None and rec.direction == "h2d"
        assert rec.job.status() == PENDING  # ready while its bytes are still being copied
        assert cache._reqs["warm"].load_job is rec.job
        landed = threading.Event()
        waiter = threading.Thread(target=lambda: (cache.wait_layer("warm", 0), landed.set()))
        waiter.start()
        assert not landed.wait(0.2)  # cannot land while the copy is held
        gate.set()
        waiter.join(30)
        assert landed.is_set()
        for layer in range(cache.l1.num_layers):
            cache.wait_layer("warm", layer)
        assert torch.equal(_kv_of(cache, p.page_table, 32), reference)
        rec.job.wait(30)  # the last layer has arrived; the job is marked done right after
        assert rec.job.status() == DONE
        h2d = cache.stats()["bytes"]["h2d"]
        cache.step()
        assert cache.io.restores == []
        st = cache.stats()
        assert st["bytes"]["h2d"] - h2d == rec.job.nbytes == 8 * cache.l1.bytes_per_page
        assert st["transfer_s"]["h2d"] > 0 and st["failed_copies"]["h2d"] == 0
        assert cache.transfer.stats.jobs_h2d == 1
        cache.finish("warm", prompt)


def test_an_l3_request_with_an_l2_hit_waits_on_both_copies(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=2.0, prefetch="wait_complete")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 128, 33)
    _stored(cfg, prompt)
    reference = _reference(cfg, tmp_path, prompt, 32)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        server = Server(model, cache, chunk_tokens=16)
        server.run([req("head", np.concatenate([prompt[:16], [3]]), out=1)])  # 4 pages
        server.run([req(f"f{i}", rng.integers(0, 128, 33), out=1) for i in range(2)])
        cache.drain()  # the head now lives in L2 only
        p = cache.admit("again", prompt)
        assert p.host_len == 16 and p.device_len == 0
        while not p.ready:
            cache.step()
        assert p.storage_len == 16
        assert isinstance(cache._reqs["again"].load_job, Waits)
        for layer in range(cache.l1.num_layers):
            cache.wait_layer("again", layer)
        assert torch.equal(_kv_of(cache, p.page_table, 32), reference)
        cache.finish("again", prompt)


def test_a_restore_that_fails_is_agreed_and_leaks_nothing(tmp_path):
    from test_faults import leaks
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, prefetch="wait_complete")
    prompt = np.random.default_rng(3).integers(0, 128, 33)
    _stored(cfg, prompt)
    cache = HiCache(cfg, mode="l1+l2+l3")

    def broken(job):
        raise OSError("simulated restore failure")
    cache.transfer.backend.copy = broken
    p = cache.admit("warm", prompt)
    while not cache.step():
        pass
    assert p.storage_len == 32  # agreed: the copy failed on this rank, said at the next step
    with pytest.raises(TransferError, match="simulated restore failure"):
        cache.wait_layer("warm", 0) or cache.step()
    assert cache.stats()["failed_copies"]["h2d"] == 1
    cache.finish("warm", prompt)
    cache.close()
    assert leaks(cache) == {}


def test_one_cost_model_decides_load_or_recompute():
    cm = CostModel(None, None)
    assert not cm.measured
    with pytest.raises(L3Error, match="not measured"):
        cm.should_load(100, 100)
    cm.observe_prefill(1000, 1.0)  # the first observation is the rate
    assert cm.prefill_tokens_per_s == 1000.0
    cm.observe_prefill(3000, 1.0)  # then a running average
    assert cm.prefill_tokens_per_s == pytest.approx(1400.0)
    cm.observe_store(L3Stats())  # served nothing: still unmeasured
    assert not cm.measured
    cm.observe_store(L3Stats(bytes_read=10_000, read_s=1.0))
    assert cm.measured and cm.read_bytes_per_s == 10_000
    assert not cm.should_load(1000, 20_000)  # 2 s to read, 0.7 s to prefill
    assert cm.should_load(1000, 5_000)
    with pytest.raises(L3Error, match="must be > 0"):
        CostModel(None, 0)


def test_the_service_feeds_the_cost_model(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l3_cost_model=True)
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        assert cache.io.worth_loading(4)  # nothing measured: try the store
        cache.observe_prefill(4000, 2.0)
        assert cache.io.cost.prefill_tokens_per_s == 2000.0


def test_a_load_costs_a_scheduler_step_more_than_its_read(tmp_path):
    """An L3 hit is usable a step after its admission (its read is agreed then) while its
    recompute starts at once: the step the engine reports is the cost model's load overhead,
    so a short hit is recomputed and a long one still loaded. The serving loop reports it."""
    cfg = make_cfg(tmp_path / "l3", l3_cost_model=True)
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        io = cache.io
        io.cost.observe_read(1 << 30, 1.0)  # 1 GB/s: reading a page costs about nothing
        cache.observe_prefill(1000, 1.0)    # 1000 tokens/s: a page (4 tokens) costs 4 ms
        assert io.worth_loading(1)
        cache.observe_step(0.0)             # nothing measured: ignored
        cache.observe_step(0.05)            # a step takes 50 ms
        assert io.cost.overhead_s == 0.05
        assert not io.worth_loading(1)      # 4 ms of prefill < 50 ms of waiting
        assert io.worth_loading(100)        # 400 ms of prefill > 50 ms
        cache.observe_step(0.15)            # a running average, like the rates
        assert io.cost.overhead_s == pytest.approx(0.07)
    with HiCache(make_cfg(tmp_path / "s" / "l3"), mode="l1+l2+l3") as cache:
        Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16).run(
            [req(i, list(range(i, i + 20)), out=3) for i in range(2)])
        assert cache.io.cost.overhead_s > 0  # the loop measured its steps


def test_a_short_l3_read_is_agreed_in_the_step_right_after_admission(tmp_path, monkeypatch):
    """A read of at most ``prefetch_wait_pages`` pages is waited for at admission (bounded),
    so the step right after admission agrees on it; a longer read is never waited for there,
    nor any read with ``prefetch_wait_pages = 0``."""
    # a long bound keeps it deterministic on a busy machine
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete", prefetch_wait_s=60.0)
    prompt = list(range(3, 43))  # 40 tokens: 9 whole pages of 4 before its last token
    with HiCache(cfg, mode="l1+l2+l3") as cache:  # L3 holds the prompt once closed (drained)
        Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16).run([req("w", prompt)])
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        short = cache.admit("short", prompt[:20] + [99])  # 5 pages in L3, L1 empty
        assert cache._reqs["short"].prefetch.handle.finished
        cache.step()
        assert short.ready and short.storage_len == 20
        cache.abort("short")
        gate = threading.Event()
        real_get = type(cache.l3).get
        monkeypatch.setattr(type(cache.l3), "get",
                            lambda self, *a, **k: gate.wait(60) and real_get(self, *a, **k))
        # 9 pages: its admission does not wait for them
        _read_not_waited_for(cache, gate, "long", prompt, storage_len=36)
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete", prefetch_wait_pages=0)
    gate.clear()  # the store's get still waits for this gate
    with HiCache(cfg, mode="l1+l2+l3") as cache:  # never wait: even a short read is not
        _read_not_waited_for(cache, gate, "short", prompt[:20] + [99], storage_len=20)


def _read_not_waited_for(cache, gate, rid, tokens, storage_len):
    """Admit ``rid`` while the store's reads wait for ``gate``: admission returns with the read
    in flight; once released, steps agree on ``storage_len`` tokens."""
    p = cache.admit(rid, tokens)
    assert not cache._reqs[rid].prefetch.handle.finished and not p.ready
    gate.set()
    while not p.ready:
        cache.step()
    assert p.storage_len == storage_len
    cache.abort(rid)
