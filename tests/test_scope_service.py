"""Cache scopes through the service: two scopes never share a page in L1, L2 or L3 (across a
restart on one L3), a declared public prefix is shared, hits inside one scope are what the
shared scope gets, the policy's default scope, hit tokens by public / scoped, and the scope in
the per-step content agreement (two ranks that admit one request in two scopes stop alike)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.errors import DivergenceError, UsageError
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.config import HiCacheConfig

from helpers import make_cfg, write_kv_rows
from test_service import revisit_trace

PROMPT = np.random.default_rng(3).integers(0, 128, 41)  # 10 whole pages of 4 before the last


def run(cache, rid, prompt=PROMPT, scope=None, public=0):
    """One request through the API (rows written, finished, one step); its ``Prefix``."""
    p = cache.admit(rid, prompt, scope, public)
    while not p.ready:
        cache.step()
    cache.alloc(rid, len(prompt))
    write_kv_rows(cache, rid, len(prompt))
    cache.finish(rid, prompt)
    cache.step()
    return p


def hits(p):
    return p.device_len, p.host_len, p.storage_len


def test_scopes_never_meet_in_l1_l2_or_l3_and_public_pages_are_shared(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=64, prefetch="wait_complete")
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
        assert hits(run(cache, 1, scope="a", public=10)) == (0, 0, 0)
        assert hits(run(cache, 2, scope="b", public=10)) == (8, 0, 0)   # the public pages
        assert hits(run(cache, 3)) == (8, 0, 0)                         # shared scope: those too
        assert hits(run(cache, 4, scope=b"a", public=8)) == (40, 0, 0)  # str and bytes alike
        assert hits(run(cache, 5, scope="a")) == (0, 0, 0)  # no public prefix: a chain of its own
        s = cache.stats()["scope_hit_tokens"]
        assert s["public"]["l1"] == 8 + 8 + 8 and s["scoped"]["l1"] == 32
        assert cache.stats()["hit_tokens"]["l1"] == 56
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:  # L1 and L2 empty: L3 only
        assert hits(run(cache, 6, scope="c", public=10)) == (0, 0, 8)
        assert hits(run(cache, 7, scope="a", public=10)) == (8, 0, 32)
        assert hits(run(cache, 8, scope="b", public=10)) == (8, 0, 32)
        assert hits(run(cache, 9, scope="d")) == (0, 0, 0)


def test_l2_pages_stay_in_their_scope(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=12, l2_ratio=4.0)
    other = np.random.default_rng(4).integers(0, 128, 41)
    with HiCache(cfg, 0, None, mode="l1+l2") as cache:
        run(cache, 1, scope="a")
        run(cache, 2, other, scope="a")  # L1 holds 12 pages: the first prompt's go to L2
        assert cache.peek(PROMPT, "a") == (0, 40)
        assert cache.peek(PROMPT, "b") == (0, 0) and cache.peek(PROMPT) == (0, 0)
        assert hits(run(cache, 3, scope="b")) == (0, 0, 0)
        assert hits(run(cache, 4, scope="a")) == (0, 40, 0)
        cache.ctrl.check()


def test_the_default_scope_and_bad_scopes(tmp_path):
    cfg = make_cfg(tmp_path / "l3")
    tenant = cfg.replace(tenancy={"default_scope": "t"})
    with HiCache(tenant, 0, None, mode="l1+l2+l3") as cache:
        run(cache, 1)
        assert cache.peek(PROMPT, "t")[0] == 40 and cache.peek(PROMPT, "u")[0] == 0
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
        assert hits(run(cache, 2)) == (0, 0, 0)          # the shared scope: none of t's
        assert hits(run(cache, 3, scope="t")) == (0, 0, 40)
        for scope, public, what in ((3, 0, "bytes, str or None"), ("", 0, "empty"),
                                    ("a", -4, "public_tokens"), ("a", 1.5, "public_tokens")):
            with pytest.raises(UsageError, match=what):
                cache.admit(9, PROMPT, scope, public)
        assert 9 not in cache._reqs


def _serve(cfg, jobs):
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, 0, None, mode="l1+l2") as cache:
        out = Server(model, cache, chunk_tokens=16, max_running=2).run(jobs)
        cache.ctrl.check()
        return {r.request_id: (r.output, r.hit) for r in out}, cache.stats()


def test_one_scope_hits_as_the_shared_scope_does(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=16, l2_ratio=2.0)
    jobs = revisit_trace(sessions=4, seed=5)
    shared, s0 = _serve(cfg, jobs)
    scoped, s1 = _serve(cfg, [replace(j, scope="tenant") for j in jobs])
    assert scoped == shared and s0["hit_tokens"] == s1["hit_tokens"]
    assert s0["hit_tokens"]["l2"] > 0
    assert s1["scope_hit_tokens"]["scoped"] == s0["scope_hit_tokens"]["public"]
    apart, s2 = _serve(cfg, [replace(j, scope=f"s{j.request_id}") for j in jobs])
    assert sum(s2["hit_tokens"].values()) == 0  # a scope per request: nothing shared
    assert {k: v[0] for k, v in apart.items()} == {k: v[0] for k, v in shared.items()}


def _diverging_scopes(rank, world, cfg_dict):
    import torch.distributed as dist
    cfg = HiCacheConfig.from_dict(cfg_dict)
    with HiCache(cfg, rank, dist.group.WORLD, mode="l1+l2") as cache:
        publishes = cache.events is not None
        cache.admit("r", PROMPT, scope="a" if rank == 0 else "b")
        try:
            cache.step()
        except DivergenceError as e:
            return publishes, str(e)
        return publishes, None


def test_ranks_admitting_in_two_scopes_stop_alike(tmp_path):
    """(And the DCP group has one KV event publisher: its rank 0.)"""
    cfg = make_cfg(tmp_path / "l3", dcp=2).replace(
        events={"endpoint": f"ipc://{tmp_path}/events"})
    out = launch(2, _diverging_scopes, cfg.to_dict(), timeout_s=120)
    assert [o[0] for o in out] == [True, False]
    assert all(o[1] is not None and "admit" in o[1] for o in out), out


def _serve_echo(cache, rid, prompt, scope):
    from test_companions import _echo_rows
    p = cache.admit(rid, prompt, scope)
    while not p.ready:
        cache.step()
    cache.alloc(rid, len(prompt))
    write_kv_rows(cache, rid, len(prompt))
    for layer in range(cache.kv.num_layers):
        cache.wait_layer(rid, layer)
    hit = _echo_rows(cache, p)
    cache.finish(rid, prompt, echo=True)
    return p, hit


def test_a_companions_l3_pages_stay_in_their_scope(tmp_path):
    """A companion's L3 copy (keyed by the request's chains, as the draft's and the KDA
    snapshots' are) is found in its scope only, after a warm restart."""
    from helpers import l3_writes_land_at_once
    from test_companions import Echo
    cfg = make_cfg(tmp_path / "l3", l1_pages=24, prefetch="wait_complete")
    with l3_writes_land_at_once():
        with HiCache(cfg, mode="l1+l2+l3", companions=[Echo]) as cache:
            _serve_echo(cache, "a", PROMPT, "a")
            cache.drain()
        with HiCache(cfg, mode="l1+l2+l3", companions=[Echo]) as cache:
            p, _ = _serve_echo(cache, "b", PROMPT, "b")
            assert p.storage_len == 0 and cache.stats()["echo"]["moved"]["l3_read"] == 0
            p, hit = _serve_echo(cache, "a2", PROMPT, "a")
            assert p.storage_len == 40 and np.array_equal(hit, PROMPT[:40])
            assert cache.stats()["echo"]["moved"]["l3_read"] == 10


def test_kda_snapshots_stay_in_their_scope(tmp_path_factory):
    """A hybrid model (Kimi Linear): a snapshot in a request's public prefix serves another
    scope; one in a scope's own pages serves that scope only; tokens equal recompute."""
    from test_kimi_cache import cfg_of, jobs_sharing, same_as_recompute
    from test_kimi_engine import make_checkpoint
    d = tmp_path_factory.mktemp("kimi_scope") / "ckpt"
    make_checkpoint(d, kda=[1, 2, 4], full=[3], first_dense=1, seed=3)
    a, b, a2 = jobs_sharing(8)  # A and B share 8 tokens; snapshots every 4 tokens
    jobs = [replace(a, scope="a", public_tokens=4), replace(b, scope="b", public_tokens=4),
            replace(a2, scope="a", public_tokens=4), replace(a2, request_id="B2", scope="b")]
    got, stats = same_as_recompute(cfg_of(str(d), every=2), jobs, "l1")
    assert got["B"].hit["l1"] == 4    # the public snapshot at 4; not a's at 8
    assert got["A2"].hit["l1"] == 12  # all of a's own
    assert got["B2"].hit["l1"] == 0   # b without a public prefix: nothing of a's or shared
    assert stats["hybrid"]["hits"]["l1"] == 2
