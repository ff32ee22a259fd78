"""``bench/l3.py --fleet N`` and ``bench/l3.py --dead-shard N``: a shared L3 at fleet width.

--fleet N: one Redis Cluster (started here: ``--masters`` masters, no replicas, unless ``--url``
names one), the fleet secret, and first ONE writer/reader process, then N, doing the same
per-process work (``hicache.l3.fleet_load``: each puts its own sequences and the shared ones,
every process writes the shared ones, then reads every process's sequences and checks each page
served). The cluster is flushed between the two. Printed: aggregate put and get GB/s (the bytes
of all processes over the span from the first start to the last end of the phase) and their ratio
to the one-process run, each process's own GB/s, p50 / p99 latency of a put and of a lookup+get
of one sequence, pages served wrong (must be 0) and the dedup (pages offered in the first round
against pages the store wrote). The fleet model's per-process figure
(``fleet_model.shared_process_gbs`` from the one-process GB/s and the store's aggregate as
measured at the widest run) is printed next to the measured one, and its load time of one
sequence (``fleet_model.load_seconds``) next to the measured p50 of a lookup + get.

--dead-shard N: N masters without replicas, prefixes of ``--prefix-pages`` pages written with the
keys spread over the shards (hicache's placement), one master killed: what a prefix keeps
(``exists_prefix``), measured, against the model for spread and for co-located placement.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from tqdm import tqdm

from hicache import fleet_model
from hicache.l3.fleet_load import FleetJob, run_fleet

GB = 1e9


def _secret(root: str) -> str:
    path = os.path.join(root, "fleet.secret")
    with open(path, "w") as f:
        f.write(hashlib.sha256(os.urandom(32)).hexdigest())
    os.chmod(path, 0o600)
    return path


def _flush(urls) -> None:
    import redis
    with redis.RedisCluster.from_url(urls[0], socket_timeout=30) as c:
        c.flushall(target_nodes="primaries")


def _span_gbs(reports: list, phase: str, rnd: int, nbytes: int) -> float:
    lo = min(r[f"{phase}_span"][rnd][0] for r in reports)
    hi = max(r[f"{phase}_span"][rnd][1] for r in reports)
    return nbytes / (hi - lo) / GB


def _summary(reports: list, job: FleetJob, page_bytes: int) -> dict:
    """Aggregate figures of one fleet run (round 0 puts: first writes; last round gets)."""
    n = len(reports)
    put_round0 = sum(len(r["put_ms"]) // job.rounds for r in reports) * job.pages * page_bytes
    gets = [r["timeline"][-len(r["timeline"]) // job.rounds:] for r in reports]
    get_last = sum(g for t in gets for _, g, _ in t) * page_bytes
    per_proc_get = [sum(g for _, g, _ in t) * page_bytes / (r["get_span"][-1][1] -
                    r["get_span"][-1][0]) / GB for t, r in zip(gets, reports)]
    per_proc_put = [len(r["put_ms"]) // job.rounds * job.pages * page_bytes /
                    (r["put_span"][0][1] - r["put_span"][0][0]) / GB for r in reports]
    offered = n * (job.sequences + job.shared) * job.pages
    written = sum(r["stats"]["pages_written"] for r in reports)
    put_ms = [x for r in reports for x in r["put_ms"]]
    get_ms = [x for r in reports for x in r["get_ms"]]
    return {
        "processes": n, "put_gbs": _span_gbs(reports, "put", 0, put_round0),
        "get_gbs": _span_gbs(reports, "get", job.rounds - 1, get_last),
        "process_put_gbs": statistics.mean(per_proc_put),
        "process_get_gbs": statistics.mean(per_proc_get),
        "put_p50_ms": float(np.percentile(put_ms, 50)), "put_p99_ms": float(np.percentile(put_ms, 99)),
        "get_p50_ms": float(np.percentile(get_ms, 50)), "get_p99_ms": float(np.percentile(get_ms, 99)),
        "wrong": sum(r["wrong"] for r in reports),
        "corrupt": sum(r["stats"]["corrupt"] for r in reports),
        "errors": sum(r["stats"]["errors"] for r in reports),
        "pages_offered": offered, "pages_written": written,
        "unique_pages": (n * job.sequences + job.shared) * job.pages,
        "dedup_skipped": offered - written,
    }


def _job(args, urls, secret: str, w: int, n: int) -> FleetJob:
    return FleetJob(tuple(urls), w, n, secret, sequences=args.fleet_sequences,
                    shared=args.fleet_shared, pages=args.fleet_pages, rounds=2,
                    layers=args.fleet_layers, kv_dim=576, page_size=args.page_size,
                    timeout_s=30.0, retry_after_s=1.0)


def fleet(args) -> dict:
    """Runs at 1 and ``args.fleet`` processes on one cluster; their figures and ratios."""
    from hicache.l3.localserver import start_cluster
    root = tempfile.mkdtemp(prefix="hicache-fleet-bench-", dir=args.dir)
    cluster = None
    try:
        urls = args.url.split(",") if args.url else None
        if urls is None:
            cluster = start_cluster(os.path.join(root, "cluster"), masters=args.masters)
            urls = cluster.urls
        secret = _secret(root)
        runs = {}
        for n in tqdm(sorted({1, args.fleet}), desc="fleet runs", disable=args.json):
            _flush(urls)
            jobs = [_job(args, urls, secret, w, n) for w in range(n)]
            runs[n] = _summary(run_fleet(jobs, timeout_s=600), jobs[0],
                               jobs[0].namespace().shard_bytes)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return _fleet_result(args, runs)


def _page_bytes(args) -> int:
    return FleetJob((), 0, 1, layers=args.fleet_layers, kv_dim=576,
                    page_size=args.page_size).namespace().shard_bytes


def _fleet_result(args, runs: dict) -> dict:
    one, wide = runs[1], runs[args.fleet]
    n = args.fleet
    store_gbs = wide["get_gbs"]  # what the store gave all of them together
    model = fleet_model.shared_process_gbs(one["process_get_gbs"], n,
                                           store_gbs if n > 1 else 0.0)
    seq_bytes = args.fleet_pages * _page_bytes(args)
    model_ms = fleet_model.load_seconds(seq_bytes, model) * 1e3  # one sequence, one process
    return {"bench": "l3-fleet", "fleet": n, "masters": args.masters,
            "page_bytes": _page_bytes(args),
            "one": one, "wide": wide,
            "put_ratio": wide["put_gbs"] / one["put_gbs"],
            "get_ratio": wide["get_gbs"] / one["get_gbs"],
            "model_process_get_gbs": model,
            "model_vs_measured": model / wide["process_get_gbs"],
            "model_get_ms": model_ms, "model_get_ms_vs_p50": model_ms / wide["get_p50_ms"],
            "machine": {"cpus": os.cpu_count()}}


def print_fleet(res: dict) -> None:
    print(f"L3 fleet: {res['fleet']} writer/reader process(es) on one {res['masters']}-master "
          f"cluster, fleet secret, pages of {res['page_bytes'] / 1e6:.2f} MB; against 1 process "
          "in the same run")
    head = (f"{'procs':>5} {'put GB/s':>9} {'get GB/s':>9} {'proc get':>9} {'put p50/p99 ms':>15} "
            f"{'get p50/p99 ms':>15} {'wrong':>5} {'written/offered':>16}")
    print(head)
    for r in (res["one"], res["wide"]) if res["fleet"] > 1 else (res["one"],):
        print(f"{r['processes']:>5} {r['put_gbs']:>9.2f} {r['get_gbs']:>9.2f} "
              f"{r['process_get_gbs']:>9.2f} {r['put_p50_ms']:>7.1f}/{r['put_p99_ms']:<7.1f} "
              f"{r['get_p50_ms']:>7.1f}/{r['get_p99_ms']:<7.1f} {r['wrong'] + r['corrupt']:>5} "
              f"{r['pages_written']:>7}/{r['pages_offered']:<8}")
    print(f"aggregate vs 1 process: put {res['put_ratio']:.2f}x, get {res['get_ratio']:.2f}x; "
          f"fleet model per-process get {res['model_process_get_gbs']:.2f} GB/s vs measured "
          f"{res['wide']['process_get_gbs']:.2f} ({res['model_vs_measured']:.2f}x); its load "
          f"time of one sequence {res['model_get_ms']:.1f} ms vs measured p50 "
          f"{res['wide']['get_p50_ms']:.1f} ms ({res['model_get_ms_vs_p50']:.2f}x)")


# ---- one shard of N dead: what a prefix keeps ------------------------------------------------
def dead_shard(args) -> dict:
    from hicache.l3 import Namespace, RedisStore, page_keys
    from hicache.l3.localserver import start_cluster
    import torch
    n, pages, prefixes = args.dead_shard, args.prefix_pages, args.prefixes
    ns = Namespace("dead-shard", 1, 64, "bfloat16", 16, 1)
    root = tempfile.mkdtemp(prefix="hicache-dead-shard-", dir=args.dir)
    try:
        with start_cluster(os.path.join(root, "c"), masters=n, node_timeout_ms=300) as cl:
            keys = [page_keys([10_000 + p] + list(range(1, pages * ns.page_tokens)),
                              ns.page_tokens, ns, 0) for p in range(prefixes)]
            with RedisStore(cl.urls, ns, 0, timeout_s=0.5, retry_after_s=0.2,
                            check_policy=False) as s:
                page = torch.zeros(ns.shard_shape, dtype=ns.torch_dtype)
                for k in tqdm(keys, desc="write prefixes", disable=args.json):
                    s.put(k, [page] * len(k))
                cl.nodes[-1].kill()
                time.sleep(1.0)  # past cluster-node-timeout: the node is marked failed
                kept = [s.exists_prefix(k) for k in keys]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"bench": "l3-dead-shard", "shards": n, "prefix_pages": pages, "prefixes": prefixes,
            "kept_mean_pages": statistics.mean(kept),
            "kept_fraction": statistics.mean(kept) / pages,
            "prefixes_whole": sum(k == pages for k in kept) / prefixes,
            "model_spread_pages": fleet_model.kept_spread(pages, n),
            "model_colocated_pages": fleet_model.kept_colocated(pages, n)}


def print_dead_shard(r: dict) -> None:
    print(f"one of {r['shards']} shards dead, {r['prefixes']} prefixes of {r['prefix_pages']} "
          "pages, keys spread over the shards:")
    print(f"  measured: a prefix keeps {r['kept_mean_pages']:.2f} pages on average "
          f"({r['kept_fraction']:.1%}); {r['prefixes_whole']:.1%} of prefixes whole")
    print(f"  model: spread {r['model_spread_pages']:.2f} pages; co-located (hash tag per "
          f"prefix) {r['model_colocated_pages']:.2f} pages ({1 - 1 / r['shards']:.0%} of "
          "prefixes whole, the rest lost whole)")
