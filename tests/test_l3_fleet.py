"""A shared L3 that survives its own failures: a Redis Cluster with replicas (``localserver
--cluster N --replicas R``), a master killed while writer processes run (hits resume after the
failover, every page served checked, no call hangs), a dead master without a replica (only its
own keys miss; one line names it), and the fleet's dedup of identical pages across writers.
Real valkey-server processes started by PID on private ports; real writer processes."""

import logging
import subprocess
import sys
import time

import pytest
import redis
import torch

from hicache.l3 import RedisStore, page_keys
from hicache.l3.cluster_route import slot_ranges
from hicache.l3.fleet_load import FleetJob, run_fleet
from hicache.l3.localserver import start_cluster
from helpers import secret_file
from test_l3_store import NS, PT, empty, shard, tokens


def _roles(port: int) -> dict:
    with redis.Redis(port=port, socket_timeout=5) as c:
        nodes = c.execute_command("CLUSTER", "NODES")
    nodes = nodes.decode() if isinstance(nodes, bytes) else nodes
    out = {}
    for line in nodes.splitlines():
        f = line.split()
        out[int(f[1].split("@")[0].rsplit(":", 1)[1])] = ("master" if "master" in f[2]
                                                           else "replica", f[2])
    return out


def test_localserver_cluster_starts_replicas_and_refuses_bad_flags(tmp_path):
    with start_cluster(str(tmp_path / "c"), masters=2, replicas=1, node_timeout_ms=500) as cl:
        roles = _roles(cl.nodes[0].port)
        assert [roles[n.port][0] for n in cl.nodes] == ["master"] * 2 + ["replica"] * 2
        for n in cl.nodes[2:]:  # every replica's link to its master is up
            with redis.Redis(port=n.port, socket_timeout=5) as c:
                assert c.info("replication")["master_link_status"] == "up"
    for argv, what in ((["--replicas", "1"], "--replicas needs --cluster"),
                       (["--cluster", "2", "--replicas", "-1"], "must be >= 0"),
                       (["--cluster", "2", "--node-timeout-ms", "5"], "--node-timeout-ms")):
        r = subprocess.run([sys.executable, "-m", "hicache.l3.localserver", *argv],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert what in r.stderr


def test_localserver_cli_gives_each_master_a_replica_by_default(tmp_path):
    import signal
    proc = subprocess.Popen([sys.executable, "-m", "hicache.l3.localserver", "--cluster", "2",
                             "--node-timeout-ms", "500", "--dir", str(tmp_path / "cl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        urls, pids = line.split()[0].split(","), line.split()[2:]
        assert len(urls) == 4 and len(pids) == 4, line  # 2 masters, then their replicas
        ports = [int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls]
        roles = _roles(ports[0])
        assert [roles[p][0] for p in ports] == ["master"] * 2 + ["replica"] * 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_slot_ranges():
    assert slot_ranges([0, 1, 2, 7, 9, 10]) == "0-2,7,9-10" and slot_ranges([]) == "-"


# ---- a dead master without a replica: only its own keys miss ---------------------------------
def _first_on(client, keys, port) -> int:
    return next(i for i, k in enumerate(keys)
                if client.get_node_from_key(b"hicache:" + k).port == port)


def test_a_dead_master_costs_only_its_own_keys(tmp_path, caplog):
    with start_cluster(str(tmp_path / "c"), masters=3, replicas=0, node_timeout_ms=300,
                       maxmemory=64 << 20) as cl:
        k = page_keys(tokens(48), PT, NS, 0)
        with RedisStore(cl.urls, NS, 0, timeout_s=0.5, retry_after_s=0.2) as s:
            assert s.put(k, [shard(i) for i in range(48)]).written == 48
            c = s.raw_client()
            owner = [c.get_node_from_key(b"hicache:" + x).port for x in k]
            dead = owner[min(range(48), key=lambda i: (owner[i] == owner[0], i))]
            first = _first_on(c, k, dead)  # the prefix ends at the first page on the dead shard
            assert first > 0
            cl.node(dead).kill()
            time.sleep(1.5)  # past cluster-node-timeout: the cluster marked the node failed
            live = [x for x, p in zip(k, owner) if p != dead]
            with caplog.at_level(logging.WARNING, logger="hicache"):
                for _ in range(3):
                    t0 = time.monotonic()
                    assert s.exists_prefix(k) == first
                    out = empty(48)
                    assert s.get(k, out) == first
                    assert all(torch.equal(out[i], shard(i)) for i in range(first))
                    assert s.exists_prefix(live) == len(live)
                    assert time.monotonic() - t0 < 5  # answered, never a hang
                got = empty(len(live))
                assert s.get(live, got) == len(live)
                res = s.put(k, [shard(i) for i in range(48)])  # the live shards keep writes
                assert sum(res.stored) == len(live)
            lines = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
            assert len(lines) == 1 and f"127.0.0.1:{dead}" in lines[0], lines
            assert "slots " in lines[0] and s.stats.errors >= 1


# ---- a master killed mid-run, writer processes running: hits resume after the failover -------
def test_master_killed_mid_run_fails_over_with_hits_and_no_wrong_page(tmp_path):
    secret = secret_file(tmp_path)
    with start_cluster(str(tmp_path / "c"), masters=3, replicas=1, node_timeout_ms=500,
                       maxmemory=64 << 20) as cl:
        jobs = [FleetJob(tuple(cl.urls), w, 3, secret, sequences=3, shared=2, pages=8,
                         seconds=120.0, timeout_s=0.5, retry_after_s=0.2) for w in range(3)]
        killed = {}

        def kill_a_master():  # the writers run until this returns
            time.sleep(0.3)
            killed["port"], killed["t"] = cl.nodes[1].port, time.time()
            cl.nodes[1].kill()
            deadline = time.monotonic() + 60
            while _roles(cl.nodes[0].port)[cl.nodes[4].port][0] != "master":
                assert time.monotonic() < deadline, "the replica was not promoted"
                time.sleep(0.1)
            time.sleep(3.0)  # a few rounds: each writer puts its pages again

        reports = run_fleet(jobs, timeout_s=240, aligned=False, during=kill_a_master)
    assert all(r["wrong"] == 0 and r["stats"]["corrupt"] == 0 for r in reports)
    window = [(t, g, n) for r in reports for t, g, n in r["timeline"] if t > killed["t"]]
    assert any(g < n for _, g, n in window)  # the dead shard's pages missed for a while
    assert sum(r["stats"]["errors"] for r in reports) >= 1
    for r in reports:  # every process ends with full hits: the promoted replica serves
        tail = r["timeline"][-6:]
        assert tail[0][0] > killed["t"] and all(g == n for _, g, n in tail), tail
        assert max(r["get_ms"] + r["put_ms"]) < 5000  # no call waited long (never a hang)


def test_fleet_writers_dedup_identical_pages(tmp_path, redis_cluster):
    with redis.RedisCluster.from_url(redis_cluster.urls[0]) as c:
        c.flushall(target_nodes="primaries")
    secret = secret_file(tmp_path)
    jobs = [FleetJob(tuple(redis_cluster.urls), w, 3, secret, sequences=2, shared=3, pages=4,
                     rounds=2) for w in range(3)]
    reports = run_fleet(jobs, timeout_s=240)
    written = sum(r["stats"]["pages_written"] for r in reports)
    assert written == 3 * 2 * 4 + 3 * 4  # own pages once each, shared pages once in all
    assert all(r["wrong"] == 0 for r in reports)
    last = [x for r in reports for x in r["timeline"][-(3 * 2 + 3):]]  # the second round
    assert all(g == n for _, g, n in last)  # every process reads every process's pages


# ---- serving through a failover: tokens equal to recompute, L3 hits after it -----------------
def _serve_through_failover(rank, world, cfg_dict, ports, jobs):
    import torch.distributed as dist

    from hicache.config import HiCacheConfig
    from test_service import serve
    cfg = HiCacheConfig.from_dict(cfg_dict)
    group = dist.group.WORLD
    out = {}

    def phase(name, mode="l1+l2+l3"):
        results, stats = serve(cfg, mode, jobs, rank, group)
        out[name] = ({r.request_id: (r.output, r.hit) for r in results}, stats)

    phase("before")  # cold: computes, writes L3
    dist.barrier()
    if rank == 0:
        import os
        import signal
        os.kill(ports["victim_pid"], signal.SIGKILL)  # a master dies mid-run
    dist.barrier()
    phase("window")  # fresh L1/L2: the dead shard's pages miss until its replica takes over
    if rank == 0:
        deadline = time.monotonic() + 60
        while _roles(ports["live"])[ports["replica"]][0] != "master":
            assert time.monotonic() < deadline, "the replica was not promoted"
            time.sleep(0.1)
    dist.barrier()
    phase("after")  # fresh L1/L2 again: every prefix restored from L3
    phase("recompute", "recompute")
    return out


def test_serving_through_a_failover_gives_recompute_tokens_and_l3_hits_after(tmp_path):
    from hicache.distributed import launch
    from helpers import make_cfg
    from test_service import revisit_trace
    with start_cluster(str(tmp_path / "c"), masters=3, replicas=1, node_timeout_ms=500,
                       maxmemory=64 << 20) as cl:
        cfg = make_cfg(tmp_path / "l3", dcp=2, l1_pages=16, l2_ratio=1.0,
                       prefetch="wait_complete")
        cfg = cfg.replace(l3={"backend": "redis", "url": list(cl.urls), "path": "unused",
                              "secret_file": secret_file(tmp_path), "timeout_s": 0.5}).to_dict()
        ports = {"victim_pid": cl.nodes[1].pid, "live": cl.nodes[0].port,
                 "replica": cl.nodes[4].port}
        jobs = revisit_trace(sessions=4, seed=7)
        res = launch(2, _serve_through_failover, cfg, ports, jobs, timeout_s=400)
    ref = {i: o for i, (o, _) in res[0]["recompute"][0].items()}
    first = [j.request_id for j in jobs[:4]]
    for name in ("before", "window", "after"):
        r0, r1 = res[0][name][0], res[1][name][0]
        assert {i: o for i, (o, _) in r0.items()} == ref, name  # tokens equal to recompute
        assert r0 == r1  # both ranks: the same tokens and the same agreed hits
        assert res[0][name][1]["corrupt"] == 0
    assert all(res[0]["before"][0][i][1]["l3"] == 0 for i in first)
    after = res[0]["after"][0]
    # after the failover every whole page of each 33-token prompt comes from L3 again
    assert all(after[i][1]["l3"] == 32 for i in first), after
    assert res[0]["after"][1]["hit_tokens"]["l3"] >= res[0]["window"][1]["hit_tokens"]["l3"]


def test_a_cluster_that_requires_full_coverage_is_warned_about(redis_cluster):
    import warnings
    nodes = [redis.Redis(port=n.port, socket_timeout=5) for n in redis_cluster.nodes]
    try:
        seen = {}
        for value in ("no", "yes"):
            for c in nodes:
                c.config_set("cluster-require-full-coverage", value)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                RedisStore(redis_cluster.urls, NS, 0).close()
            seen[value] = [str(x.message) for x in w if "full-coverage" in str(x.message)]
    finally:
        for c in nodes:
            c.config_set("cluster-require-full-coverage", "no")
            c.close()
    assert seen["no"] == [] and len(seen["yes"]) == 1, seen
