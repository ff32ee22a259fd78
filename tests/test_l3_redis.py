"""L3 on a real Redis-protocol server (valkey-server started by PID): restart, server killed and
restarted, a hung server, maxmemory eviction, a 3-master cluster, and two independent 2-rank
groups sharing one store (group B restores what group A stored; tokens equal to recompute)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import redis
import torch

from hicache.l3.auth import Trust
from hicache.config import HiCacheConfig
from hicache.distributed import launch
from hicache.l3 import Namespace, RedisStore, open_store, page_keys
from hicache.l3.localserver import LocalServer
from test_l3_store import NS, PT, empty, shard, tokens
from helpers import make_cfg, secret_file
from test_service import revisit_trace, serve


def test_a_new_process_hits_what_another_stored(redis_url):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_l3_store import NS, PT, shard, tokens
        from hicache.l3 import RedisStore, page_keys
        with RedisStore({redis_url!r}, NS, 1) as s:
            assert s.put(page_keys(tokens(4, 1000), PT, NS, 1),
                         [shard(50 + i) for i in range(4)]).written == 4
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with RedisStore(redis_url, NS, 1) as s:
        keys = page_keys(tokens(6, 1000), PT, NS, 1)  # a longer request sharing the prefix
        assert s.exists_prefix(keys) == 4
        out = empty(6)
        assert s.get(keys, out) == 4
        assert all(torch.equal(out[i], shard(50 + i)) for i in range(4))


def test_server_killed_and_restarted_is_misses_then_hits(redis_factory):
    srv = redis_factory(maxmemory=64 << 20)
    k = page_keys(tokens(4), PT, NS, 0)
    with RedisStore(srv.url, NS, 0, timeout_s=0.5, retry_after_s=0.2) as s:
        assert s.put(k, [shard(i) for i in range(4)]).written == 4
        srv.kill(signal.SIGKILL)
        out = empty(4)
        t0 = time.monotonic()
        assert s.exists_prefix(k) == 0 and s.get(k, out) == 0
        res = s.put(k, [shard(i) for i in range(4)])
        assert res.stored == (False,) * 4 and res.written == 0
        assert time.monotonic() - t0 < 5  # answered at once, not after retries
        assert torch.equal(out[0], empty(1)[0])
        st = s.stats
        assert st.errors >= 1 and st.misses == 1 and st.pages_dropped == 4
        srv.start()  # the same port, an empty server (no persistence)
        deadline = time.monotonic() + 10
        while s.exists_prefix(k[:1]) == 0 and not s.put(k, [shard(i) for i in range(4)]).written:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert s.exists_prefix(k) == 4 and s.get(k, out) == 4
        assert torch.equal(out[3], shard(3))


def test_a_hung_server_costs_a_bounded_wait(redis_factory):
    """SIGSTOP the server: every call returns within its timeout, as a miss; SIGCONT heals."""
    srv = redis_factory(maxmemory=64 << 20)
    k = page_keys(tokens(2), PT, NS, 0)
    with RedisStore(srv.url, NS, 0, timeout_s=0.3, retry_after_s=0.0) as s:
        s.put(k, [shard(0), shard(1)])
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert s.exists_prefix(k) == 0
            assert s.get(k, empty(2)) == 0
            assert not any(s.put(page_keys(tokens(1, 9), PT, NS, 0), [shard(5)]).stored)
            assert time.monotonic() - t0 < 3 * 0.3 + 3  # three bounded calls, no retry loop
            assert s.stats.errors == 3
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert s.exists_prefix(k) == 2


def test_fill_past_maxmemory_every_read_is_whole_or_a_miss(redis_factory):
    """Writers fill 4x the server's maxmemory while a reader restores prefixes: every page read
    is a whole hit with the right bytes or a miss, never wrong bytes; the server evicted."""
    ns = Namespace("fill", num_layers=4, kv_dim=512, dtype="float32", page_size=4, dcp_size=1)
    srv = redis_factory(maxmemory=4 << 20)  # 4 MiB; pages of 32 KiB
    n_req, n_pages = 32, 16  # 512 pages = 16 MiB
    keys = [page_keys(list(range(r * 10_000, r * 10_000 + n_pages * 4)), 4, ns, 0)
            for r in range(n_req)]

    def val(r, i):
        return torch.full(ns.shard_shape, float(r * 100 + i))

    bad, served = [], [0]
    stop = threading.Event()

    def reader():
        with RedisStore(srv.url, ns, 0, writer=False) as s:
            while not stop.is_set():
                for r in range(n_req):
                    out = [torch.empty(ns.shard_shape) for _ in range(n_pages)]
                    got = s.get(keys[r], out)
                    served[0] += got
                    bad.extend((r, i) for i in range(got) if not torch.equal(out[i], val(r, i)))

    t = threading.Thread(target=reader)
    t.start()
    try:
        with RedisStore(srv.url, ns, 0) as w:
            for r in range(n_req):
                w.put(keys[r], [val(r, i) for i in range(n_pages)])
            assert w.stats.errors == 0
    finally:
        stop.set()
        t.join(60)
    with RedisStore(srv.url, ns, 0) as s:
        for r in range(n_req):
            out = [torch.empty(ns.shard_shape) for _ in range(n_pages)]
            got = s.get(keys[r], out)
            assert all(torch.equal(out[i], val(r, i)) for i in range(got))
        assert s.stats.corrupt == 0
    assert not bad and served[0] > 0
    with redis.Redis.from_url(srv.url) as c:
        info = c.info()
        assert info["evicted_keys"] > 0 and c.dbsize() < n_req * n_pages
        assert info["used_memory"] <= 5 << 20


def test_put_refreshes_held_pages_and_resends_only_unknown_ones(redis_factory):
    """A page the store knows held (written or served by it) is refreshed by TOUCH without its
    bytes; one it does not know is refreshed by SET NX (sent, kept as it was); a known page
    gone from the server is written again. LFU counters (log factor 0: +1 per access) show
    every put refreshed the pages. A get that stops inside a batch leaves the link in sync."""
    ns = Namespace("lru", num_layers=2, kv_dim=512, dtype="bfloat16", page_size=4, dcp_size=1)
    srv = redis_factory(maxmemory=64 << 20)
    k = page_keys(list(range(4 * ns.page_tokens)), ns.page_tokens, ns, 0)
    vals = [shard(i, ns) for i in range(4)]
    with redis.Redis.from_url(srv.url) as c, \
            RedisStore(srv.url, ns, 0, batch_bytes=3 * ns.shard_bytes) as s:
        c.config_set("maxmemory-policy", "allkeys-lfu")
        c.config_set("lfu-log-factor", 0)

        def freq():
            return [c.object("freq", b"hicache:" + key) for key in k]

        def sent(fn):
            before = c.info("stats")["total_net_input_bytes"]
            res = fn()
            return res, c.info("stats")["total_net_input_bytes"] - before

        assert s.put(k, vals).written == 4
        f0 = freq()
        res, n = sent(lambda: s.put(k, vals))  # known held: TOUCH only
        assert res.stored == (True,) * 4 and res.written == 0 and s.stats.pages_skipped == 4
        assert n < ns.shard_bytes and freq() == [f + 1 for f in f0]
        with RedisStore(srv.url, ns, 0) as other:  # never saw them: SET NX, value kept
            res, n = sent(lambda: other.put(k, [shard(9, ns)] * 4))
            assert res.stored == (True,) * 4 and res.written == 0
            assert n > 4 * ns.shard_bytes and freq() == [f + 2 for f in f0]
        c.delete(b"hicache:" + k[1], b"hicache:" + k[3])  # gone behind the store's back
        res = s.put(k, vals)
        assert res.stored == (True,) * 4 and res.written == 2
        out = empty(4, ns)
        assert s.get(k, out) == 4 and all(torch.equal(o, v) for o, v in zip(out, vals))
        c.delete(b"hicache:" + k[1])
        assert s.get(k, empty(4, ns)) == 1  # stops at page 1, drains the rest of the batch
        assert s.exists_prefix(k) == 1 and s.get(k[2:], out) == 2
        assert torch.equal(out[1], vals[3]) and s.stats.errors == 0


def test_cluster_round_trip_and_corruption(redis_cluster):
    urls = redis_cluster.urls
    with redis.RedisCluster.from_url(urls[0]) as c:
        c.flushall(target_nodes="primaries")
    k = page_keys(tokens(24), PT, NS, 0)
    with open_store(urls, NS, 0, trust=Trust(authenticate=False)) as s:
        assert s.cluster
        assert s.put(k, [shard(i) for i in range(24)]).written == 24
        out = empty(24)
        assert s.exists_prefix(k) == 24 and s.get(k, out) == 24
        assert all(torch.equal(out[i], shard(i)) for i in range(24))
        with redis.RedisCluster.from_url(urls[1]) as c:  # the pages live on several shards
            nodes = {c.get_node_from_key(b"hicache:" + key).port for key in k}
            assert len(nodes) == 3
            v = bytearray(c.get(b"hicache:" + k[5]))
            v[-1] ^= 0xFF
            c.set(b"hicache:" + k[5], bytes(v))
        out = empty(24)
        assert s.get(k, out) == 5 and s.stats.corrupt == 1
        assert torch.equal(out[5], empty(1)[0]) and s.exists_prefix(k) == 5  # deleted
        assert s.delete(k[:2]) == 2 and s.exists_prefix(k) == 0


# ---- two independent 2-rank groups sharing one store ------------------------------------------
def _group(rank, world, cfg_dicts, jobs, with_recompute):
    import torch.distributed as dist
    out = {}
    for name, d in cfg_dicts.items():
        cfg = HiCacheConfig.from_dict(d)
        results, stats = serve(cfg, "l1+l2+l3", jobs, rank, dist.group.WORLD)
        out[name] = ({r.request_id: (r.output, r.hit) for r in results}, stats)
    if with_recompute:
        cfg = HiCacheConfig.from_dict(next(iter(cfg_dicts.values())))
        results, _ = serve(cfg, "recompute", jobs, rank, dist.group.WORLD)
        out["recompute"] = {r.request_id: r.output for r in results}
    return out


def _redis_cfg(tmp_path, url):
    cfg = make_cfg(tmp_path / "l3", dcp=2, l1_pages=16, l2_ratio=1.0, prefetch="wait_complete")
    return cfg.replace(l3={"backend": "redis", "url": url, "path": "unused",
                           "secret_file": secret_file(tmp_path)}).to_dict()


def test_two_groups_share_one_store(tmp_path, redis_url, redis_cluster):
    """Group A (2 ranks, own L1/L2) serves a trace; group B (2 other ranks, cold L1/L2) serves
    it later: its first visits restore A's pages from L3, on one server and on a cluster."""
    with redis.RedisCluster.from_url(redis_cluster.urls[0]) as c:
        c.flushall(target_nodes="primaries")
    cfgs = {"standalone": _redis_cfg(tmp_path, redis_url),
            "cluster": _redis_cfg(tmp_path, list(redis_cluster.urls))}
    jobs = revisit_trace(sessions=4, seed=5)
    a = launch(2, _group, cfgs, jobs, False, timeout_s=300)
    b = launch(2, _group, cfgs, jobs, True, timeout_s=300)
    ref = b[0]["recompute"]
    assert b[1]["recompute"] == ref
    first_visits = [j.request_id for j in jobs[:4]]
    for name in cfgs:
        for group in (a, b):
            res0, res1 = group[0][name][0], group[1][name][0]
            assert {i: o for i, (o, _) in res0.items()} == ref  # tokens equal to recompute
            assert res0 == res1  # both ranks: same tokens, same agreed hits per request
        a_res, b_res = a[0][name][0], b[0][name][0]
        assert all(a_res[i][1]["l3"] == 0 for i in first_visits)  # A started cold
        assert all(b_res[i][1]["l3"] > 0 for i in first_visits), b_res  # B warm from A
        assert b[0][name][1]["hit_tokens"]["l3"] > a[0][name][1]["hit_tokens"]["l3"]
        assert b[0][name][1]["corrupt"] == 0 and b[0][name][1]["l3_errors"] == 0


# ---- the server dies mid-run ------------------------------------------------------------------
def _survive_kill(rank, world, cfg_dict, srv_args, pid_file):
    import torch.distributed as dist

    from hicache.engine.model import MLAModel
    from hicache.service import HiCache
    from hicache.serving import Server, model_config
    group = dist.group.WORLD
    cfg = HiCacheConfig.from_dict(cfg_dict)
    rng = np.random.default_rng(11)
    from hicache.workloads import Request

    def batch(tag, n=3):
        return [Request(f"{tag}{i}", 0, rng.integers(0, 128, 37), 3, i) for i in range(n)]

    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    phases = {}
    jobs = {"before": batch("a"), "down": batch("b"), "after": batch("c")}
    with HiCache(cfg, rank, group, mode="l1+l2+l3") as cache:
        Server(model, cache, group=group).run(jobs["before"])
        cache.drain()
        dist.barrier()
        if rank == 0:
            os.kill(srv_args["pid"], signal.SIGKILL)  # the server dies mid-run
        dist.barrier()
        down = Server(model, cache, group=group).run(jobs["down"] + jobs["before"][:1])
        phases["down"] = ({r.request_id: (r.output, r.hit) for r in down}, cache.stats())
        cache.drain()  # the writes of this phase fail: counted, no raise, no hang
        dist.barrier()
        if rank == 0:
            srv = LocalServer(srv_args["dir"], port=srv_args["port"],
                              maxmemory=srv_args["maxmemory"]).start()
            with open(pid_file, "w") as f:
                f.write(str(srv.pid))
        dist.barrier()
        time.sleep(1.2)  # past retry_after_s: every rank talks to the server again
        Server(model, cache, group=group).run(jobs["after"])
        cache.drain()
        phases["stats_after"] = cache.stats()
    dist.barrier()
    # cold L1/L2: hits from L3, each read waited for (bounded by 5 s, not 0.5 s: what this phase
    # checks is that the restarted server serves, not how fast a loaded machine reads)
    patient = cfg.replace(l3={"timeout_s": 5.0}, policy={"prefetch": "wait_complete"})
    with HiCache(patient, rank, group, mode="l1+l2+l3") as cold:
        again = Server(model, cold, group=group).run(jobs["after"])
        phases["again"] = {r.request_id: (r.output, r.hit) for r in again}
    with HiCache(cfg, rank, group, mode="recompute") as plain:
        ref = Server(model, plain, group=group).run(
            jobs["down"] + jobs["before"][:1] + jobs["after"])
    phases["ref"] = {r.request_id: r.output for r in ref}
    return phases


def test_server_killed_mid_run_keeps_serving_and_ranks_agree(tmp_path, redis_factory):
    srv = redis_factory(maxmemory=64 << 20)
    cfg = make_cfg(tmp_path / "l3", dcp=2, l1_pages=16, l2_ratio=1.0).replace(
        l3={"backend": "redis", "url": srv.url, "timeout_s": 0.5,
            "secret_file": secret_file(tmp_path)})
    pid_file = tmp_path / "restarted.pid"
    args = {"pid": srv.pid, "dir": srv.dir, "port": srv.port, "maxmemory": srv.maxmemory}
    try:
        out = launch(2, _survive_kill, cfg.to_dict(), args, str(pid_file), timeout_s=240)
    finally:
        if pid_file.exists():  # the server rank 0 restarted: stop it by its PID
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    r0, r1 = out
    assert r0["down"][0] == r1["down"][0]  # same tokens and same agreed hits on both ranks
    assert r0["again"] == r1["again"]
    ref = r0["ref"]
    for res in (r0["down"][0], r0["again"]):
        assert all(o == ref[i] for i, (o, _) in res.items())  # tokens equal to recompute
    assert all(h["l3"] == 0 for _, h in r0["down"][0].values())  # nothing from a dead server
    for r in out:
        assert r["down"][1]["l3_errors"] > 0  # counted
        assert r["stats_after"]["corrupt"] == 0
    assert all(h["l3"] > 0 for _, h in r0["again"].values())  # restarted server serves again
