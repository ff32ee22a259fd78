"""Prometheus metrics: scraped over HTTP they equal HiCache.stats(); histograms see events;
counters survive a restart; an engine's registry can hold them."""

import urllib.request

import numpy as np
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.model import MLAModel
from hicache.l3.registry import KINDS
from hicache.metrics import HISTOGRAMS, SERIES, HiCacheMetrics, describe
from hicache.serving import Server, model_config
from hicache.service import HiCache

from helpers import make_cfg, policy_toml
from test_service import revisit_trace


def scrape(port: int) -> dict:
    """``{(sample name, frozenset of labels): value}`` from /metrics on 127.0.0.1."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return parse(text)


def parse(text: str, models: set | None = None) -> dict:
    """Samples keyed without their ``model`` label (every hicache series has one: its values
    are added to ``models``)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if s.name.startswith("hicache_"):
                assert "model" in labels, s
                m = labels.pop("model")
                if models is not None:
                    models.add(m)
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def expected_from_stats(s: dict, rank: str = "0") -> dict:
    """The scrape a stats() dict implies (label spread per SERIES)."""
    exp = {}
    for name, (_k, _h, label, path) in SERIES.items():
        if path[0] not in s:  # derived at scrape time (capacity, L3 store, failure reasons)
            continue
        v = s
        for k in path:
            v = v[k]
        if label is None:
            exp[(name, frozenset({("rank", rank)}))] = float(v)
        elif isinstance(label, tuple):  # {second label's value: {first label's value: x}}
            for outer, inner in v.items():
                for key, x in inner.items():
                    exp[(name, frozenset({("rank", rank), (label[0], key),
                                          (label[1], outer)}))] = float(x)
        else:
            for key, x in v.items():
                exp[(name, frozenset({("rank", rank), (label, key)}))] = float(x)
    return exp


def test_scrape_equals_stats_and_moves_with_the_run(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=24, l2_ratio=1.0, prefetch="wait_complete")
    jobs = revisit_trace()
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    with HiCache(cfg, 0, None, mode="l1+l2+l3") as cache:
        metrics = HiCacheMetrics(cache)
        port = metrics.serve(0)
        try:
            server = Server(model, cache, chunk_tokens=16, max_running=2)
            before = scrape(port)
            assert value(before, "hicache_requests_total", rank="0") == 0
            seen = []
            for half in (jobs[:6], jobs[6:]):
                server.run(half)
                cache.drain()
                now = scrape(port)
                st = cache.stats()
                exp = expected_from_stats(st)
                for key, v in exp.items():
                    assert now[key] == v, key  # the scrape IS stats(), series by series
                # L3 pages: the whole store, also read at scrape time
                store = cache.l3._store  # LMDB behind the service guard
                assert value(now, "hicache_pages_used", rank="0", tier="l3") == \
                    store.num_pages() > 0
                assert value(now, "hicache_bytes_used", rank="0", tier="l3") == \
                    store.used_bytes() > 0
                assert value(now, "hicache_bytes_capacity", rank="0", tier="l3") == \
                    store.capacity_bytes
                # L1 / L2: capacity in pages and bytes, so usage ratios can be computed
                for tier, pool in (("l1", cache.l1), ("l2", cache.l2)):
                    n = cfg.l1.num_pages if tier == "l1" else cfg.l2_num_pages
                    assert value(now, "hicache_pages_capacity", rank="0", tier=tier) == n
                    assert value(now, "hicache_bytes_capacity", rank="0", tier=tier) == \
                        pool.nbytes // pool.num_pages * n
                    assert value(now, "hicache_bytes_used", rank="0", tier=tier) == \
                        pool.nbytes // pool.num_pages * st["pages"][tier]
                assert value(now, "hicache_l3_enabled", rank="0") == 1
                assert {r: value(now, "hicache_l3_failures_total", rank="0", reason=r)
                        for r in KINDS} == dict.fromkeys(KINDS, 0.0)
                seen.append(now)
            first, second = seen
            assert value(first, "hicache_requests_total", rank="0") == 6
            assert value(second, "hicache_requests_total", rank="0") == 12
            # the second visits hit lower tiers; the counters moved with them
            hits = [sum(value(s, "hicache_hit_tokens_total", rank="0", tier=t)
                        for t in ("l1", "l2", "l3")) for s in (first, second)]
            assert hits[1] > hits[0]
            assert value(second, "hicache_hit_tokens_total", rank="0", tier="l3") > 0
            assert value(second, "hicache_prefetch_total", rank="0", outcome="done") > 0
            assert value(second, "hicache_transfer_bytes_total", rank="0", direction="d2h") > \
                value(first, "hicache_transfer_bytes_total", rank="0", direction="d2h") > 0
            # histograms are observed at event time: counts match the events stats() counts
            st = cache.stats()
            steps = value(second, "hicache_agreement_step_seconds_count", rank="0")
            assert steps == st["steps"]
            assert abs(value(second, "hicache_agreement_step_seconds_sum", rank="0")
                       - st["agreement_s"]) < 1e-6
            restores = value(second, "hicache_restore_duration_seconds_count", rank="0")
            assert restores == sum(st["prefetch"][o] for o in ("done", "timeout", "error")) > 0
            d2h = value(second, "hicache_transfer_duration_seconds_count", rank="0",
                        direction="d2h")
            assert d2h > 0
            assert value(second, "hicache_locks_open", rank="0") == 0
        finally:
            metrics.close()


def test_counters_continue_across_a_restart_and_merge_into_an_engine_registry(tmp_path):
    cfg = make_cfg(tmp_path / "l3", l1_pages=24)
    engine = CollectorRegistry()
    from prometheus_client import Counter
    Counter("engine_requests", "the engine's own", registry=engine).inc(3)
    jobs = revisit_trace(sessions=3)
    torch.manual_seed(0)
    model = MLAModel(model_config(cfg))
    metrics = HiCacheMetrics(registry=engine, rank=1)
    totals = []
    for _ in range(2):  # a fresh service after "a failure": the counters do not restart at 0
        with HiCache(cfg, 0, None, mode="l1+l2") as cache:
            metrics.attach(cache)
            Server(model, cache, chunk_tokens=16, max_running=2).run(jobs)
            cache.drain()
            totals.append(cache.stats()["prompt_tokens"])
            metrics.detach()
    s = parse(generate_latest(engine).decode())
    assert value(s, "engine_requests_total") == 3  # the engine's metric is still there
    assert value(s, "hicache_prompt_tokens_total", rank="1") == sum(totals)
    assert value(s, "hicache_requests_total", rank="1") == 2 * len(jobs)
    assert value(s, "hicache_locks_open", rank="1") == 0


def test_names_follow_prometheus_conventions():
    for name, (kind, _h, _l, _p) in SERIES.items():
        assert name.startswith("hicache_")
        assert name.endswith("_total") == (kind == "counter"), name
    for n, _h, _lab in HISTOGRAMS.values():
        assert n.startswith("hicache_") and n.endswith("_seconds")
    assert len(describe()) == len(SERIES) + len(HISTOGRAMS)
    assert np.all([" " not in n for n, _l, _h in describe()])


def bench_config(l3, l1_pages: int = 48) -> str:
    """Two DCP ranks of the tiny model, L2 as large as L1, L3 at ``l3``. L3 hits are always
    loaded (``l3_cost_model`` off): the soak counts them, and on a loaded machine the measured
    step time would make short hits recompute."""
    return policy_toml(l3, dcp=2, l1_pages=l1_pages, l2_ratio=1.0,
                       policy={"l3_cost_model": False})


def _free_pair() -> int:
    import socket
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_bench_serves_metrics_per_rank_during_a_two_rank_run(tmp_path):
    import json
    import os
    import subprocess
    import sys
    import time
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "l3"))
    port = _free_pair()
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache.commands.bench", "--config", str(cfg), "--workload", "chat",
         "--scale", "0.01", "--max-output", "3", "--modes", "l1+l2+l3", "--duration", "8",
         "--no-progress", "--metrics-port", str(port), "--out", str(out)],
        env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    scrapes = {0: [], 1: []}
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for rank in (0, 1):
            try:
                scrapes[rank].append(scrape(port + rank))
            except OSError:
                pass  # not serving yet, or already done
        time.sleep(0.25)
    text = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, text
    final = json.loads(out.read_text())["modes"][0]["final_stats"]
    for rank in (0, 1):
        seen = scrapes[rank]
        assert len(seen) >= 2, f"rank {rank} was scraped {len(seen)} times"
        r = str(rank)
        reqs = [value(s, "hicache_requests_total", rank=r) for s in seen]
        assert reqs == sorted(reqs) and reqs[-1] > reqs[0], reqs  # the run moves them
        for s in seen:
            assert {dict(k[1]).get("rank") for k in s if k[0].startswith("hicache_")} == {r}
            hit = sum(value(s, "hicache_hit_tokens_total", rank=r, tier=t)
                      for t in ("l1", "l2", "l3"))
            assert hit + value(s, "hicache_miss_tokens_total", rank=r) == \
                value(s, "hicache_prompt_tokens_total", rank=r)
        # the last scrape is stats() at some point of the run: never past the final figures
        last, st = seen[-1], final[rank]
        assert 0 < value(last, "hicache_prompt_tokens_total", rank=r) <= st["prompt_tokens"]
        for d in ("d2h", "h2d", "l3_read", "l3_write"):
            assert value(last, "hicache_transfer_bytes_total", rank=r, direction=d) <= \
                st["bytes"][d]
        assert value(last, "hicache_steps_total", rank=r) <= st["steps"]


def test_bench_metrics_port_must_be_usable(tmp_path, capsys):
    import socket
    from hicache.commands import bench as bench_cli
    cfg = tmp_path / "policy.toml"
    cfg.write_text(bench_config(tmp_path / "l3"))
    assert bench_cli.main(["--config", str(cfg), "--metrics-port", "80"]) == 2
    assert "--metrics-port" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert bench_cli.main(["--config", str(cfg), "--metrics-port", str(port)]) == 2
        assert f"127.0.0.1:{port} is not free" in capsys.readouterr().err


def test_hits_by_scope_kind_and_event_batches_never_name_a_scope(tmp_path):
    """Hit tokens by tier and by public / scoped; a scope's name never appears in a label."""
    from dataclasses import replace
    import zmq
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # somewhere for the events to go
    sub.bind("tcp://127.0.0.1:0")
    cfg = make_cfg(tmp_path / "l3", l1_pages=24).replace(
        events={"endpoint": sub.getsockopt_string(zmq.LAST_ENDPOINT)})
    jobs = [replace(j, scope="tenant-x" if j.session % 2 else None)
            for j in revisit_trace(sessions=4)]
    torch.manual_seed(0)
    try:
        with HiCache(cfg, 0, None, mode="l1+l2") as cache:
            metrics = HiCacheMetrics(cache)
            Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16).run(jobs)
            text = generate_latest(metrics.registry).decode()
            stats = cache.stats()
            metrics.close()
    finally:
        sub.close(0)
        ctx.term()
    assert "tenant-x" not in text
    s = parse(text)
    hits = stats["scope_hit_tokens"]
    for kind in ("public", "scoped"):
        for tier in ("l1", "l2"):
            assert value(s, "hicache_scope_hit_tokens_total", rank="0", tier=tier,
                         scope=kind) == hits[kind][tier]
    assert hits["public"]["l2"] > 0 and hits["scoped"]["l2"] > 0
    assert sum(hits["public"].values()) + sum(hits["scoped"].values()) == \
        sum(stats["hit_tokens"].values())
    sent = value(s, "hicache_kv_events_total", rank="0", outcome="sent")
    assert 0 < sent <= stats["kv_events"]["sent"]  # (its thread may send one more between)
    assert value(s, "hicache_kv_events_total", rank="0", outcome="dropped") == 0
