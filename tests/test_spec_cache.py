"""The cache holds both (issue 25 point 4), one rank: a speculative request's draft KV is cached
beside the target's under the same page ids, in L1, L2 and L3; a prefix hit brings it back (no
draft token recomputed, the rows equal an uncached run's), a hit whose draft KV is absent is
still a target hit with its draft KV recomputed (counted), and the tokens are plain greedy
decoding's in every case."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from helpers import BlockedGets, BlockedPuts, admit_gated, l3_writes_land_at_once, make_cfg
from spec_cache_loop import draft_rows, spec_request

from hicache import HiCache
from hicache.checkpoints.drafter import draft_spec
from hicache.engine.model import MLAModel
from hicache.errors import UsageError
from hicache.serving import model_config

K, NEW = 3, 13


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cfg = make_cfg(tmp_path_factory.mktemp("m") / "l3")
    model = MLAModel(model_config(cfg))
    return model, noisy(model, 3)


def noisy(model, seed, scale=0.2):
    """A draft close to the target (its weights plus seeded noise): most proposals are
    accepted, some rejected."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return draft


def prompts(n_shared=40, tail=6, count=3, seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 128, n_shared)
    return [np.concatenate([shared, rng.integers(0, 128, tail)]) for _ in range(count)]


def cache_of(cfg, draft, **kw):
    return HiCache(cfg, draft=draft_spec(draft, cfg.page_tokens), **kw)


def reference(cfg, model, draft, prompt):
    """An uncached speculative run (mode l1, nothing to hit): tokens and draft rows."""
    with cache_of(cfg.replace(l3={"path": str(cfg.l3.path) + "-ref"}), draft,
                  mode="l1") as cache:
        out, p, stats, d = spec_request(cache, model, draft, "ref", prompt, K, NEW)
        rows = draft_rows(cache, p.page_table, len(prompt))
    return out, rows, stats


def write_to_l3(cfg, model, draft, prompt) -> None:
    """One speculative request through a cache with L3, drained: its pages are in the store."""
    with cache_of(cfg, draft, mode="l1+l2+l3") as cache:
        spec_request(cache, model, draft, "w", prompt, K, NEW)
        cache.drain()


def assert_whole_l3_hit(model, prompt, out, p, st) -> None:
    """A 40-token hit restored from L3 with all its draft pages, plain decoding's tokens."""
    assert p.storage_len == 40 and p.draft_len == 40 and st.draft_recomputed_tokens == 0
    assert out == model.generate(prompt.tolist(), NEW)


def test_l1_hit_restores_the_draft_kv(tmp_path, models):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3")
    a, b, _ = prompts()
    with cache_of(cfg, draft, mode="l1") as cache:
        out_a, pa, sa, _ = spec_request(cache, model, draft, "a", a, K, NEW)
        out_b, pb, sb, _ = spec_request(cache, model, draft, "b", b, K, NEW)
        assert pb.device_len == 40 and pb.draft_len == pb.hit_len == 40
        assert sb.draft_recomputed_tokens == 0
        rows = draft_rows(cache, pb.page_table, len(b))
        assert cache.draft.l1_has.sum() > 0
    ref_out, ref_rows, ref_stats = reference(cfg, model, draft, b)
    assert out_a == model.generate(a.tolist(), NEW) and out_b == ref_out
    assert out_b == model.generate(b.tolist(), NEW)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=1e-5)
    assert sb.to_dict() == ref_stats.to_dict()  # the same drafts, so the same acceptance
    assert 0 < sb.accepted < sb.proposed  # some proposals were rejected (and written)


def test_absent_draft_kv_is_a_target_hit_and_recomputed(tmp_path, models):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3")
    a, b, _ = prompts(seed=1)
    with cache_of(cfg, draft, mode="l1") as cache:
        spec_request(cache, model, None, "plain", a, K, NEW)  # written without speculation
        out_b, pb, sb, _ = spec_request(cache, model, draft, "b", b, K, NEW)
        assert pb.device_len == 40 and pb.draft_len == 0
        assert sb.draft_recomputed_tokens == 40
        rows = draft_rows(cache, pb.page_table, len(b))
    ref_out, ref_rows, ref_stats = reference(cfg, model, draft, b)
    assert out_b == ref_out == model.generate(b.tolist(), NEW)
    torch.testing.assert_close(rows, ref_rows, rtol=0, atol=1e-5)


def test_l2_and_l3_hits_restore_the_draft_kv(tmp_path, models):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", l1_pages=24, l2_ratio=2.0, prefetch="wait_complete")
    a, b, c = prompts(seed=2)
    rng = np.random.default_rng(5)
    with l3_writes_land_at_once():
        with cache_of(cfg, draft, mode="l1+l2+l3") as cache:
            spec_request(cache, model, draft, "a", a, K, NEW)
            for i in range(2):  # push a out of L1 (it stays in L2)
                spec_request(cache, model, draft, f"f{i}", rng.integers(0, 128, 46), K, NEW)
            cache.drain()
            out_b, pb, sb, _ = spec_request(cache, model, draft, "b", b, K, NEW)
            assert pb.host_len > 0 and pb.draft_len == pb.hit_len == 40
            assert sb.draft_recomputed_tokens == 0 and cache.draft.stats.pages["h2d"] > 0
            rows_b = draft_rows(cache, pb.page_table, len(b))
            assert cache.draft.stats.pages["l3_write"] > 0
            st = cache.stats()["draft"]  # the draft's bytes by tier, in the cache's stats
            assert st["bytes"]["d2h"] > 0 and st["bytes"]["h2d"] > 0
            assert st["bytes"]["l3_write"] == st["pages"]["l3_write"] * \
                draft_spec(draft, cfg.page_tokens).format.page_bytes
        with cache_of(cfg, draft, mode="l1+l2+l3") as cache:  # warm restart: L3 only
            out_c, pc, sc, _ = spec_request(cache, model, draft, "c", c, K, NEW)
            assert pc.storage_len == 40 and pc.draft_len == 40
            assert sc.draft_recomputed_tokens == 0 and cache.draft.stats.pages["l3_read"] > 0
            rows_c = draft_rows(cache, pc.page_table, len(c))
    for p, out, rows, st in ((b, out_b, rows_b, sb), (c, out_c, rows_c, sc)):
        ref_out, ref_rows, ref_stats = reference(cfg, model, draft, p)
        assert out == ref_out == model.generate(p.tolist(), NEW)
        torch.testing.assert_close(rows, ref_rows, rtol=0, atol=1e-5)
        assert st.to_dict() == ref_stats.to_dict()


def test_the_draft_pages_are_written_to_l3_off_the_step(tmp_path, models):
    # the draft's L3 put runs on its writer's thread: the step that queues it returns while the
    # put is held; released, drain() flushes it, the pages are in the store and a warm
    # restart hits them
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete")
    a, c, _ = prompts(seed=8)
    with cache_of(cfg, draft, mode="l1+l2+l3") as cache:
        gate = BlockedPuts(cache.draft.store)
        spec_request(cache, model, draft, "a", a, K, NEW)
        cache.io.wait_all()
        cache.step()  # the backups are agreed: their pages (target and draft) go to L3
        assert gate.entered.wait(60) and not gate.returned.is_set()
        assert cache.draft.stats.pages["l3_write"] == 0  # counted once written
        gate.release.set()
        cache.drain()
        assert gate.returned.is_set() and len(gate.keys) > 0
        assert cache.draft.store.exists_prefix(gate.keys) == len(gate.keys)
        assert cache.draft.stats.pages["l3_write"] == len(gate.keys)
    with cache_of(cfg, draft, mode="l1+l2+l3") as cache:  # warm restart: L3 only
        out, p, st, _ = spec_request(cache, model, draft, "c", c, K, NEW)
    assert_whole_l3_hit(model, c, out, p, st)


def test_the_draft_pages_are_read_from_l3_off_admit(tmp_path, models):
    # the draft's L3 read runs on its read thread: admit returns while its get is held (the
    # request not ready); released, the next steps agree and restore it as a synchronous read
    # did: every draft page from L3, nothing recomputed, the tokens of an uncached run
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete")
    a, c, _ = prompts(seed=10)
    write_to_l3(cfg, model, draft, a)
    seen: list = []
    with cache_of(cfg, draft, mode="l1+l2+l3") as cache:  # warm restart: L3 only
        admit_gated(cache, BlockedGets(cache.draft.store), seen)
        out, p, st, _ = spec_request(cache, model, draft, "c", c, K, NEW)
        assert cache.draft.stats.pages["l3_read"] == 10
    assert seen == [True]
    assert_whole_l3_hit(model, c, out, p, st)


def test_an_abort_with_its_draft_read_in_flight_drops_the_read(tmp_path, models):
    # aborted while its draft read is held: nothing leaks, the read ends on its thread once
    # released, and the same request admitted again restores every draft page from L3
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete")
    a, c, _ = prompts(seed=11)
    write_to_l3(cfg, model, draft, a)
    with cache_of(cfg, draft, mode="l1+l2+l3") as cache:
        gate = BlockedGets(cache.draft.store)
        assert not cache.admit("c", c).ready
        assert gate.entered.wait(60) and not gate.returned.is_set()
        cache.abort("c")
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        gate.release.set()
        out, p, st, _ = spec_request(cache, model, draft, "c", c, K, NEW)
    assert_whole_l3_hit(model, c, out, p, st)


def test_a_draft_l3_write_error_is_agreed_like_the_targets(tmp_path, models):
    # an error the draft's background put raises is recorded and agreed at a step, as the
    # target writer's: drain() (its flush, then the step) stops the cache with TransferError
    from hicache.errors import TransferError
    model, draft = models
    with cache_of(make_cfg(tmp_path / "l3"), draft, mode="l1+l2+l3") as cache:
        def put(keys, shards):
            raise RuntimeError("draft store lost")
        cache.draft.store.put = put
        spec_request(cache, model, draft, "a", prompts(seed=9)[0], K, NEW)
        with pytest.raises(TransferError, match="draft store lost"):
            cache.drain()
        assert cache.draft.stats.pages["l3_write"] == 0


def test_another_draft_never_hits_the_l3_draft_pages(tmp_path, models):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3", prefetch="wait_complete")
    a, b, _ = prompts(seed=3)
    other = noisy(model, 4)
    with l3_writes_land_at_once():
        with cache_of(cfg, draft) as cache:
            spec_request(cache, model, draft, "a", a, K, NEW)
        with cache_of(cfg, other) as cache:  # the target's pages hit, the draft's cannot
            out, p, st, _ = spec_request(cache, model, other, "b", b, K, NEW)
            assert p.storage_len == 40 and p.draft_len == 0
            assert st.draft_recomputed_tokens == 40
    assert out == model.generate(b.tolist(), NEW)


def test_later_hit_on_pages_with_rejected_rows_gives_recompute(tmp_path, models):
    # the first request's verify steps wrote target rows at rejected positions; its finish
    # caches only the accepted tokens, and a later prompt that runs through those pages
    # decodes what a fresh recompute decodes
    model, draft = models
    cfg = make_cfg(tmp_path / "l3")
    a = prompts(seed=4)[0]
    with cache_of(cfg, draft, mode="l1") as cache:
        out_a, _, sa, _ = spec_request(cache, model, draft, "a", a, K, 17)
        assert sa.accepted < sa.proposed  # rejected rows were written
        later = np.concatenate([a, out_a[:-1], [5, 6, 7]])
        out_l, pl, sl, _ = spec_request(cache, model, draft, "l", later, K, NEW)
        assert pl.hit_len >= 56 and pl.draft_len == pl.hit_len
    assert out_l == model.generate(later.tolist(), NEW)


def test_a_draft_pool_of_another_shape_is_refused(tmp_path, models):
    model, draft = models
    cfg = make_cfg(tmp_path / "l3")
    from hicache.checkpoints.drafter import drafter_for
    small = MLAModel(dataclasses.replace(model.cfg, num_layers=1))
    with cache_of(cfg, small, mode="l1") as cache:
        with pytest.raises(UsageError, match="draft pool holds 1 layers"):
            drafter_for(draft, cache.page_tokens, [], cache.l1.num_pages, pool=cache.draft.kv)


def test_the_draft_counts_in_the_memory_need_and_agrees_with_the_policy(tmp_path, models):
    from hicache import preflight
    from hicache.companions.draft import draft_need
    model, draft = models
    cfg = make_cfg(tmp_path / "l3")
    spec = draft_spec(draft, cfg.page_tokens)
    need = preflight.memory_need(cfg, 1)
    more = draft_need(need, cfg, spec, cfg.l2_num_pages)
    b = spec.format.page_bytes
    assert more.l1_per_rank == need.l1_per_rank + cfg.l1.num_pages * b
    assert more.l2_per_rank == need.l2_per_rank + cfg.l2_num_pages * b
    # a policy whose [spec] names the draft counts it already, and must name the same shape
    small = tmp_path / "small.pt"
    MLAModel(dataclasses.replace(model.cfg, num_layers=1)).save(small)
    spec_cfg = cfg.replace(spec={"method": "draft", "draft_model": str(small)})
    assert draft_need(need, spec_cfg, draft_spec(MLAModel.load(small), cfg.page_tokens), 0) \
        is need
    with pytest.raises(UsageError, match="differ from the policy's \\[spec\\] draft"):
        HiCache(spec_cfg, mode="l1", draft=spec)


def test_draft_pages_on_a_shared_redis_store(tmp_path, models, redis_url, monkeypatch):
    # the draft's L3 pages on the Redis backend (authenticated, like the fleet's): a second
    # cache (another group, a warm start) hits both the target's and the draft's pages
    from helpers import secret_file
    from hicache.l3 import registry
    model, draft = models
    monkeypatch.setenv("HICACHE_L3_SECRET_FILE", secret_file(tmp_path))
    b = registry.for_where(redis_url)
    cfg = make_cfg(tmp_path / "unused", prefetch="wait_complete").replace(
        l3={"backend": b.name, b.name: b.section_of(redis_url)})
    a, c, _ = prompts(seed=6)
    with l3_writes_land_at_once():
        with cache_of(cfg, draft) as cache:
            spec_request(cache, model, draft, "a", a, K, NEW)
            cache.drain()
            assert cache.draft.stats.pages["l3_write"] > 0
        with cache_of(cfg, draft) as cache:
            out, p, st, _ = spec_request(cache, model, draft, "c", c, K, NEW)
            assert_whole_l3_hit(model, c, out, p, st)


def test_a_failed_construction_closes_the_draft_pages(tmp_path, models, monkeypatch):
    # construction failing after the draft's pages were built (here: the settings digest the
    # ranks agree on raises) closes them too: the writer thread stopped, the store closed
    import hicache.companions.draft as dp
    built = []
    real = dp.build
    monkeypatch.setattr(dp, "build", lambda *a, **k: built.append(real(*a, **k))
                        or built[-1])

    def fail(*a, **k):
        raise RuntimeError("set-up after the draft failed")
    monkeypatch.setattr(HiCache, "_settings_digest", fail)
    _, draft = models
    with pytest.raises(RuntimeError, match="set-up after the draft failed"):
        cache_of(make_cfg(tmp_path / "l3"), draft, mode="l1+l2+l3")
    assert len(built) == 1 and built[0].store is None and built[0].writer is None
