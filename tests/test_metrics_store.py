"""Metrics of the L3 store itself: its gauges on LMDB and on Redis, reported by one rank per
store (two real gloo ranks sharing one store: a sum over ranks counts it once), the one
failure counter by reason, the ``model`` label, and the docs listing every series."""

import re
from pathlib import Path

import numpy as np
import redis
import torch
from prometheus_client import generate_latest

from hicache.config import HiCacheConfig
from hicache.distributed import launch
from hicache.engine.model import MLAModel
from hicache.l3.registry import KINDS
from hicache.metrics import SERIES, HiCacheMetrics, describe
from hicache.serving import Server, model_config
from hicache.service import HiCache
from hicache.workloads import Request

from helpers import l3_writes_land_at_once, make_cfg, secret_file
from test_metrics import parse, value
from test_service import revisit_trace

ROOT = Path(__file__).resolve().parents[1]
STORE_SERIES = ("hicache_pages_used", "hicache_bytes_used", "hicache_bytes_capacity")


def _redis_cfg(tmp_path, url, dcp=1):
    cfg = make_cfg(tmp_path / "l3", dcp=dcp, l1_pages=16, l2_ratio=1.0,
                   prefetch="wait_complete")
    return cfg.replace(l3={"backend": "redis", "url": url, "path": "unused",
                           "secret_file": secret_file(tmp_path)})


def _store_truth(cache, kind: str, url: str | None) -> dict:
    """What the store holds, read past hicache's metrics: LMDB's own counters; Redis DBSIZE,
    used_memory and maxmemory from a client of our own."""
    if kind == "lmdb":
        s = cache.l3._store
        return {"pages": s.num_pages(), "capacity": s.capacity_bytes, "bytes": s.used_bytes()}
    with redis.Redis.from_url(url) as c:
        return {"pages": c.dbsize(), "capacity": int(c.config_get("maxmemory")["maxmemory"]),
                "bytes": int(c.info("memory")["used_memory"])}


# ---- two ranks sharing one store: the store's gauges are reported once -----------------------
def _two_ranks(rank, world, cfgs, jobs):
    import torch.distributed as dist
    group = dist.group.WORLD
    out = {}
    for kind, (d, url) in cfgs.items():
        cfg = HiCacheConfig.from_dict(d)
        torch.manual_seed(0)
        with HiCache(cfg, rank, group, mode="l1+l2+l3") as cache:
            Server(MLAModel(model_config(cfg)), cache, group=group, chunk_tokens=16,
                   max_running=2).run(jobs)
            cache.drain()
            dist.barrier()  # both ranks' pages are in the store
            models: set = set()
            scrape = parse(generate_latest(HiCacheMetrics(cache).registry).decode(), models)
            truth = _store_truth(cache, kind, url)
            dist.barrier()  # neither rank writes more before the other has read
        out[kind] = (scrape, truth, models)
    return out


def test_a_shared_store_is_counted_once_across_two_ranks(tmp_path, redis_factory):
    srv = redis_factory(unix=True, maxmemory=96 << 20)
    lmdb_cfg = make_cfg(tmp_path / "l3", dcp=2, l1_pages=16, l2_ratio=1.0,
                        prefetch="wait_complete")
    cfgs = {"lmdb": (lmdb_cfg.to_dict(), None),
            "redis": (_redis_cfg(tmp_path, srv.url, dcp=2).to_dict(), srv.url)}
    res = launch(2, _two_ranks, cfgs, revisit_trace(sessions=4, seed=3), timeout_s=300)
    for kind in cfgs:
        truth = res[0][kind][1]
        assert res[1][kind][1]["pages"] == truth["pages"] > 0  # both ranks see one store
        for series, field in zip(STORE_SERIES, ("pages", "bytes", "capacity")):
            per_rank = [sum(v for (n, lab), v in r[kind][0].items()
                            if n == series and ("tier", "l3") in lab) for r in res]
            assert per_rank[1] == 0, (kind, series)  # rank 1 does not report the store ...
            assert not any(n == series and ("tier", "l3") in lab
                           for (n, lab) in res[1][kind][0]), (kind, series)
            if field == "bytes" and kind == "redis":  # the server's memory moves on its own
                assert per_rank[0] > 0
            else:  # ... so the sum over ranks is the store's own figure, counted once
                assert sum(per_rank) == truth[field], (kind, series, per_rank, truth)
        for r in (0, 1):
            s = res[r][kind][0]
            assert res[r][kind][2] == {"builtin"}  # every series carries the model label
            # what each rank holds itself is reported by each rank
            assert value(s, "hicache_pages_capacity", rank=str(r), tier="l1") == 16
            assert value(s, "hicache_l3_enabled", rank=str(r)) == 1


# ---- one failure counter, by reason ----------------------------------------------------------
def test_l3_failures_are_one_counter_by_reason(tmp_path, redis_factory):
    srv = redis_factory(unix=True, maxmemory=64 << 20)
    cfg = _redis_cfg(tmp_path, srv.url)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 128, 33) for _ in range(3)]
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with l3_writes_land_at_once(), HiCache(cfg, mode="l1+l2+l3") as cache:
        metrics = HiCacheMetrics(cache, model="tiny-mla")
        server = Server(model, cache, chunk_tokens=16, max_running=1)
        server.run([Request(i, i, p, 2, i) for i, p in enumerate(prompts)])
        cache.drain()
        models: set = set()
        before = parse(generate_latest(metrics.registry).decode(), models)
        assert models == {"tiny-mla"}
        assert {r: value(before, "hicache_l3_failures_total", rank="0", reason=r)
                for r in KINDS} == dict.fromkeys(KINDS, 0.0)
        assert value(before, "hicache_pages_used", rank="0", tier="l3") > 0  # Redis too
        srv.kill()  # the server is gone: L3 calls are answered as misses, each counted
        server.run([Request(10 + i, 10 + i, rng.integers(0, 128, 33), 2, 10 + i)
                    for i in range(3)])
        cache.drain()
        after = parse(generate_latest(metrics.registry).decode())
        st = cache.stats()
        got = {r: value(after, "hicache_l3_failures_total", rank="0", reason=r) for r in KINDS}
        assert got["refused"] == st["l3_errors"] > 0, (got, st["l3_errors"])
        assert sum(got.values()) == got["refused"]  # nothing double counted elsewhere
        assert value(after, "hicache_l3_enabled", rank="0") == 1  # misses, L3 still on
        metrics.close()
    # none of the old overlapping names is served any more
    assert not any(n in SERIES for n in ("hicache_l3_corrupt_values_total",
                                         "hicache_l3_auth_failures_total",
                                         "hicache_l3_errors_total",
                                         "hicache_l3_timeouts_total"))


# ---- the docs list every series --------------------------------------------------------------
def test_docs_list_every_series_with_its_labels():
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = {m.group(1): m.group(2) for m in
            re.finditer(r"^\| `(hicache_[a-z0-9_]+)` \| ((?:[^|\\]|\\\|)+) \|", text, re.M)}
    for name, labels, _help in describe():
        assert name in rows, f"docs/operations.md does not list {name}"
        shown = {w.split("=")[0].strip() for w in rows[name].split(",")}
        assert shown == set(labels.split(",")), (name, rows[name], labels)
    assert set(rows) == {n for n, _l, _h in describe()}  # and nothing that is not served
