"""HiCache embedded in the engine: hits per tier, identical outputs, warm restart, 2 ranks."""


import numpy as np
import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.errors import ConfigError, DeviceFullError, HiCacheError, TransferError
from hicache.serving import Server, model_config
from hicache.service import HiCache, CACHE_MODES
from hicache.workloads import Request

from helpers import write_kv_rows, admit_ready, l3_writes_land_at_once, make_cfg


def req(i, tokens, out=4):
    return Request(i, 0, np.asarray(tokens, dtype=np.int64), out, i)


def serve(cfg, mode, jobs, rank=0, group=None, max_running=2):
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, rank, group, mode=mode) as cache:
        results = Server(model, cache, group=group, chunk_tokens=16,
                         max_running=max_running).run(jobs)
        cache.ctrl.check()
        stats = cache.stats()
    return results, stats


def test_second_request_sharing_a_prefix_hits(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 128, 40)
    a = req(0, np.concatenate([shared, rng.integers(0, 128, 5)]))
    b = req(1, np.concatenate([shared, rng.integers(0, 128, 7)]))
    results, stats = serve(cfg, "l1", [a, b], max_running=1)
    assert results[0].hit["l1"] == 0
    assert results[1].hit["l1"] == 40  # 10 whole pages of 4 tokens
    assert stats["hit_tokens"]["l1"] == 40
    assert stats["hit_tokens"]["l1"] + stats["miss_tokens"] == stats["prompt_tokens"] == 45 + 47
    ref, _ = serve(cfg, "recompute", [a, b], max_running=1)
    assert [r.output for r in results] == [r.output for r in ref]
    assert ref[1].hit == {"l1": 0, "l2": 0, "l3": 0}


def revisit_trace(sessions=6, length=33, seed=0):
    """Each session's prompt twice, round robin: the second visit finds it in a lower tier."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 128, length) for _ in range(sessions)]
    order = list(range(sessions)) * 2
    return [Request(i, s, prompts[s], 3, i) for i, s in enumerate(order)]


def test_every_mode_gives_the_same_tokens_and_each_tier_serves(tmp_path):
    # L1 holds 24 pages (~3 requests of 9 pages); 6 sessions cycle through it. L2 at 3x L1 keeps
    # every session (L2 hits); at 1x L1 it cannot, so the second visits come from L3.
    jobs = revisit_trace()
    outs = {}
    for mode in CACHE_MODES:
        cfg = make_cfg(tmp_path / mode / "l3", l1_pages=24, l2_ratio=1.0 if "l3" in mode else 3.0,
                       prefetch="wait_complete")
        with l3_writes_land_at_once():
            results, stats = serve(cfg, mode, jobs)
        outs[mode] = {r.request_id: r.output for r in results}  # completion order may differ
        hits = stats["hit_tokens"]
        assert sum(hits.values()) + stats["miss_tokens"] == stats["prompt_tokens"]
        assert sum(sum(r.hit.values()) for r in results) == sum(hits.values())
        assert all(sum(r.hit.values()) <= 32 for r in results)  # the last token is computed
        if mode == "recompute":
            assert sum(hits.values()) == 0
        if mode == "l1+l2":
            assert hits["l2"] >= 3 * 32 and stats["bytes"]["h2d"] > 0
        if "l2" in mode:
            assert stats["bytes"]["d2h"] > 0
        if "l3" in mode:
            assert hits["l3"] >= 2 * 32 and stats["bytes"]["l3_read"] > 0
        assert stats["locks"] == 0
    for mode in CACHE_MODES:
        assert outs[mode] == outs["recompute"], mode


def _kv_of(cache, table, n_tokens):
    slots = torch.arange(n_tokens)
    page_tokens = cache.page_tokens
    virt = torch.tensor(table)[slots // page_tokens] * page_tokens + slots % page_tokens
    return torch.stack([cache.l1.read(i, virt)[1] for i in range(cache.l1.num_layers)])


def test_l2_and_l3_restored_kv_is_bit_identical_to_prefill(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=2.0, prefetch="wait_complete")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 128, 33)
    model = MLAModel(model_config(cfg))
    # fresh prefill
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        server = Server(model, cache, chunk_tokens=16)
        fresh = server.run([req("a", prompt)])[0]
        # push it out of L1 with other requests, then ask again: an L2 hit
        server.run([req(f"f{i}", rng.integers(0, 128, 33)) for i in range(2)])
        cache.drain()  # the fillers' backups agreed: their L1 pages may now be evicted
        p = cache.admit("again", prompt)
        assert p.host_len > 0 and p.device_len + p.host_len == 32
        cache.alloc("again", 33)
        write_kv_rows(cache, "again", 33)
        cache.wait_layer("again", cache.l1.num_layers - 1)
        cache.prefix("again").ready or cache.step()
        restored = _kv_of(cache, p.page_table, 32)
        cache.finish("again", [])
        again = server.run([req("a2", prompt)])[0]
        assert again.output == fresh.output
    # rows as prefill wrote them
    with HiCache(cfg.replace(l3={"path": str(tmp_path / "other")}), mode="l1") as cache:
        Server(model, cache, chunk_tokens=16).run([req("ref", prompt, out=1)])
        m = cache.admit("look", prompt)
        reference = _kv_of(cache, m.page_table, 32)
        cache.finish("look", [])
    assert torch.equal(restored, reference)
    # warm restart: a new HiCache on the same L3 path restores from storage
    with HiCache(cfg, mode="l1+l2+l3") as cache:
        p = cache.admit("warm", prompt)
        assert not p.ready and p.device_len == p.host_len == 0
        st = cache.stats()  # a request still waiting on L3 counts as neither hit nor miss
        assert st["prompt_tokens"] == st["miss_tokens"] == 0 and st["requests"] == 1
        while not cache.step():
            pass
        assert p.ready and p.storage_len == 32
        assert torch.equal(_kv_of(cache, p.page_table, 32), reference)
        cache.finish("warm", prompt)  # the restored pages join the tree: the next visit hits L1
        warm = Server(model, cache, chunk_tokens=16).run([req("w", prompt)])[0]
        assert warm.output == fresh.output and warm.hit["l1"] == 32
        assert cache.stats()["hit_tokens"] == {"l1": 32, "l2": 0, "l3": 32}


def _serve_signed(cfg, model, mode, jobs):
    """Serve with ``model``'s own weights digest as the L3 weights signature."""
    with HiCache(cfg, mode=mode, weights_signature=model.weights_signature()) as cache:
        results = Server(model, cache, chunk_tokens=16).run(jobs)
        cache.drain()
        stats = cache.stats()
    return {r.request_id: r.output for r in results}, stats


def test_other_weights_of_the_same_shapes_never_hit_l3(tmp_path):
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete")
    prompts = [np.random.default_rng(20 + i).integers(0, 128, 33) for i in range(3)]
    jobs = [req(i, p, out=6) for i, p in enumerate(prompts)]
    old = MLAModel(model_config(cfg, seed=0))
    new = MLAModel(model_config(cfg, seed=1))  # a new checkpoint, same architecture
    assert old.weights_signature() != new.weights_signature()
    _, first = _serve_signed(cfg, old, "l1+l2+l3", jobs)
    assert first["bytes"]["l3_write"] > 0
    again, warm = _serve_signed(cfg, old, "l1+l2+l3", jobs)  # control: same weights do hit
    assert warm["hit_tokens"]["l3"] == 3 * 32
    out, stats = _serve_signed(cfg, new, "l1+l2+l3", jobs)  # same L3 path, other weights
    assert stats["hit_tokens"]["l3"] == 0 and stats["bytes"]["l3_read"] == 0
    ref, _ = _serve_signed(cfg, new, "recompute", jobs)
    assert out == ref
    assert out != again  # the weights really differ: the old KV would have changed tokens


def test_l3_needs_a_weights_signature(tmp_path):
    from hicache.l3 import Namespace
    cfg = make_cfg(tmp_path / "l3").replace(model={"signature": ""})
    with pytest.raises(ConfigError, match=r"model\.signature"):
        HiCache(cfg, mode="l1+l2+l3")
    with pytest.raises(ConfigError, match=r"model\.signature"):
        HiCache(cfg)  # the policy file enables L3
    HiCache(cfg, mode="l1+l2").close()  # no L3, no signature needed
    with HiCache(cfg, mode="l1+l2+l3", weights_signature="ckpt-a") as a:
        ns_a = a.namespace
    signed = cfg.replace(model={"signature": "ckpt-a"})
    with HiCache(signed) as b:  # the file's key names the same weights: same namespace
        assert b.namespace.digest == ns_a.digest
    with HiCache(signed, weights_signature="ckpt-b") as c:  # the argument overrides the file
        assert c.namespace.digest != ns_a.digest
    assert Namespace.from_config(signed, model="x").digest == \
        Namespace.from_config(cfg, model="x").digest  # the field itself is not signed twice


def test_api_misuse_is_a_clear_error(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    with pytest.raises(HiCacheError, match="unknown mode"):
        HiCache(cfg, mode="l2-only")
    with pytest.raises(HiCacheError, match="parallel.dcp is 2"):
        HiCache(make_cfg(tmp_path / "l3", dcp=2))
    with HiCache(cfg, mode="l1+l2") as cache:
        cache.admit(1, [1, 2, 3])
        with pytest.raises(HiCacheError, match="already admitted"):
            cache.admit(1, [1, 2, 3])
        with pytest.raises(HiCacheError, match="unknown request"):
            cache.finish(2, [1])
        with pytest.raises(HiCacheError, match="no tokens"):
            cache.admit(3, [])
        cache.finish(1, [1, 2, 3])
        assert cache.stats()["locks"] == 0
    big = make_cfg(tmp_path / "l3", l1_pages=2)
    with pytest.raises(ConfigError, match="l1.num_pages"):
        serve(big, "l1", [req(0, list(range(20)))])


def _two_rank(rank, world, cfg_dict, jobs):
    import torch.distributed as dist
    cfg = HiCacheConfig.from_dict(cfg_dict)
    out = {}
    for mode in ("recompute", "l1+l2+l3"):
        with l3_writes_land_at_once():
            results, stats = serve(cfg.replace(l3={"path": cfg.l3.path + mode}), mode, jobs,
                                   rank, dist.group.WORLD)
        out[mode] = ({r.request_id: r.output for r in results}, stats)
    return out


def test_two_ranks_agree_and_match_one_rank(tmp_path):
    jobs = revisit_trace(sessions=5, seed=2)
    cfg2 = make_cfg(tmp_path / "two" / "l3", dcp=2, l1_pages=16, l2_ratio=1.0,
                    prefetch="wait_complete")
    per_rank = launch(2, _two_rank, cfg2.to_dict(), jobs, timeout_s=300)
    one, _ = serve(make_cfg(tmp_path / "one" / "l3", l1_pages=24), "recompute", jobs)
    for rank_out in per_rank:
        assert rank_out["recompute"][0] == {r.request_id: r.output for r in one}
        assert rank_out["l1+l2+l3"][0] == {r.request_id: r.output for r in one}
    s0, s1 = per_rank[0]["l1+l2+l3"][1], per_rank[1]["l1+l2+l3"][1]
    assert s0["hit_tokens"] == s1["hit_tokens"]  # replicated control plane
    assert s0["hit_tokens"]["l2"] > 0 and s0["hit_tokens"]["l3"] > 0
    # each rank stores only its half of every page: equal bytes (whole pages of 2*P tokens)
    assert s0["bytes"]["d2h"] == s1["bytes"]["d2h"] > 0


def _one_rank_lacks_a_page(rank, world, cfg_dict, prompt):
    import torch.distributed as dist
    from hicache.l3 import PageStore, chain_hashes, keys_for_rank
    cfg = HiCacheConfig.from_dict(cfg_dict)
    group = dist.group.WORLD
    first, _ = serve(cfg, "l1+l2+l3", [req("a", prompt)], rank, group)  # fills L3 on close
    dist.barrier()
    if rank == 1:  # this rank loses its shard of the third page
        with HiCache(cfg, rank, group, mode="l1+l2+l3") as cache:
            keys = keys_for_rank(chain_hashes(prompt[:-1], cache.page_tokens), cache.namespace, 1)
        store = PageStore(cfg.l3.path, cache.namespace, 1, cfg.l3.size_bytes)
        assert store.exists_prefix(keys) == 4 and store.delete(keys[2:3]) == 1
        store.close()
    else:
        HiCache(cfg, rank, group, mode="l1+l2+l3").close()  # keep the ranks in step
    dist.barrier()
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, rank, group, mode="l1+l2+l3") as cache:
        p = cache.admit("b", prompt)
        while not cache.step():
            pass
        storage_len = p.storage_len
        cache.abort("b")
        again = Server(model, cache, group=group).run([req("c", prompt)])[0]
    return storage_len, first[0].output, again.output


def test_a_page_one_rank_lacks_is_used_by_neither(tmp_path):
    cfg = make_cfg(tmp_path / "l3", dcp=2, prefetch="wait_complete")
    prompt = np.random.default_rng(7).integers(0, 128, 33)
    out = launch(2, _one_rank_lacks_a_page, cfg.to_dict(), prompt, timeout_s=300)
    assert [o[0] for o in out] == [16, 16]  # rank 0 has 4 pages, rank 1 only 2: MIN = 2 pages
    for storage_len, first, again in out:
        assert again == first


def test_one_l3_writer_per_page_among_replicas(tmp_path):
    from hicache.l3 import PageStore, chain_hashes, keys_for_rank
    prompt = np.random.default_rng(3).integers(0, 128, 41)  # 10 whole pages of 4
    cfg = make_cfg(tmp_path / "l3")
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, mode="l1+l2+l3", replica=(1, 2)) as cache:
        Server(model, cache).run([req("a", prompt, out=1)])
        cache.drain()
        keys = keys_for_rank(chain_hashes(prompt, 4), cache.namespace, 0)
    with PageStore(cfg.l3.path, cache.namespace, 0, cfg.l3.size_bytes) as store:
        stored = [store.exists_prefix([k]) for k in keys]
    assert stored == [i % 2 for i in range(10)]  # replica 1 of 2 writes the odd pages
    with pytest.raises(HiCacheError, match="replica"):
        HiCache(cfg, replica=(2, 2))


def _fill(cache, table, value):
    cache.l1.kv[:, cache.layout.page_rows(torch.tensor(table))] = value


def test_reused_device_pages_never_carry_an_old_l3_key(tmp_path):
    """write_back + L3: a page that held prefix M and is reused for prefix N by a load-back of a
    request that is then preempted must not be written to L3 under M's keys."""
    from hicache.l3 import chain_hashes
    cfg = make_cfg(tmp_path / "l3", l1_pages=5, l2_ratio=0.4, write="write_back",
                   prefetch="wait_complete")
    rng = np.random.default_rng(1)
    tn, tm, tx = rng.integers(0, 128, 8), rng.integers(0, 128, 16), rng.integers(0, 128, 8)

    def run(cache, rid, prompt, value):  # a request whose computed KV is all `value`
        p = admit_ready(cache, rid, np.concatenate([prompt, [1]]))
        _fill(cache, p.page_table[p.hit_len // 4:], value)
        cache.finish(rid, prompt)
        cache.step()

    def pressure(cache, rid, tokens):  # forces evictions, then is preempted
        p = admit_ready(cache, rid, tokens, alloc=False)
        try:
            cache.alloc(rid, len(tokens))
            write_kv_rows(cache, rid, len(tokens))
        except DeviceFullError:
            pass
        cache.abort(rid)
        for _ in range(3):
            cache.drain()

    with HiCache(cfg, mode="l1+l2+l3") as cache:
        run(cache, "N", tn, 1.0)
        pressure(cache, "x", np.arange(20))
        run(cache, "M", tm, 2.0)
        cache.admit("R", np.concatenate([tn, [5]]))  # L2 hit on N lands on M's old pages
        cache.abort("R")
        cache.drain()
        run(cache, "X", tx, 3.0)
        cache.admit("t", np.concatenate([tn, [9]]))
        cache.abort("t")
        pressure(cache, "z", np.arange(300, 305))
        pressure(cache, "y", np.arange(100, 120))  # N evicted: backed up and written to L3
        cache.drain()
        cache.io.writer.flush()
        q = cache.admit("Q", np.concatenate([tm, [7]]))  # M's prompt
        while not q.ready:
            cache.step()
        restored = cache.l1.kv[:, cache.layout.page_rows(torch.tensor(q.page_table))]
        assert set(restored.unique().tolist()) <= {2.0}  # M's KV or nothing, never N's 1.0
        keys = cache.io.keys(chain_hashes(tn, 4))
        assert cache.l3.exists_prefix(keys) == 2  # N itself went to L3 under its own keys
        cache.abort("Q")


def test_a_failed_copy_is_never_agreed(tmp_path, monkeypatch):
    import hicache.l2.copy_cpu as copy_cpu
    from hicache.l3 import chain_hashes
    cfg = make_cfg(tmp_path / "l3", l1_pages=8)
    tokens = np.random.default_rng(0).integers(0, 128, 8)
    cache = HiCache(cfg, mode="l1+l2+l3")
    p = admit_ready(cache, "a", np.concatenate([tokens, [1]]))
    _fill(cache, p.page_table, 1.0)

    def broken(*args, **kwargs):
        raise OSError("simulated copy failure")
    monkeypatch.setattr(copy_cpu, "run_block_plan", broken)
    monkeypatch.setattr(copy_cpu, "run_page_runs", broken)
    cache.finish("a", tokens)  # the write-through backup's D2H copy fails
    for rec in cache.io.inflight.values():
        with pytest.raises(TransferError):
            rec.job.wait()
    with pytest.raises(TransferError, match="simulated copy failure"):
        cache.step()
    node = next(n for n in cache.ctrl.iter_nodes() if n.parent is not None)
    assert not node.host_valid  # the host copy was never made valid
    keys = cache.io.keys(chain_hashes(tokens, 4))
    cache.close(flush=False)
    from hicache.l3 import PageStore
    with PageStore(cfg.l3.path, cache.namespace, 0, cfg.l3.size_bytes) as store:
        assert store.exists_prefix(keys) == 0  # nothing reached L3


def _one_rank_copy_fails(rank, world, cfg_dict, tokens):
    import torch.distributed as dist
    import hicache.l2.copy_cpu as copy_cpu
    cfg = HiCacheConfig.from_dict(cfg_dict)
    cache = HiCache(cfg, rank, dist.group.WORLD, mode="l1+l2")
    cache.admit("a", np.concatenate([tokens, [1]]))
    cache.alloc("a", len(tokens) + 1)
    write_kv_rows(cache, "a", len(tokens) + 1)
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("simulated copy failure")
        copy_cpu.run_block_plan = broken
        copy_cpu.run_page_runs = broken
    cache.finish("a", tokens)  # the backup's copy fails on rank 1 only
    try:
        cache.drain()
        outcome = "no error"
    except TransferError as e:
        outcome = str(e)
    cache.close(flush=False)
    return outcome


def test_a_copy_failing_on_one_rank_stops_both_at_the_same_step(tmp_path):
    cfg = make_cfg(tmp_path / "l3", dcp=2)
    tokens = np.random.default_rng(4).integers(0, 128, 16)
    out = launch(2, _one_rank_copy_fails, cfg.to_dict(), tokens, timeout_s=120)
    assert "another rank" in out[0]
    assert "simulated copy failure" in out[1]


def test_l3_cost_model_switch(tmp_path, monkeypatch):
    """With measured reads far slower than prefill, the cost model recomputes an L3 hit;
    ``l3_cost_model = false`` always loads it."""
    from hicache.l3.base import L3Stats
    for on in (True, False):
        with HiCache(make_cfg(tmp_path / str(on) / "l3", l3_cost_model=on), mode="l1+l2+l3") as cache:
            slow = L3Stats(bytes_read=1, read_s=10.0)  # 0.1 B/s from the store
            monkeypatch.setattr(type(cache.l3), "stats", property(lambda self: slow))
            cache.observe_prefill(1 << 20, 1e-3)     # ~1e9 tokens/s of prefill
            assert cache.io.worth_loading(4) is (not on)
            monkeypatch.undo()
