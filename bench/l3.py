"""L3 store benchmark: store put/get GB/s per rank against the raw client of the same backend
moving the same bytes (LMDB, and Redis / Valkey), the Redis store against the LMDB store, and
loading a prefix from L3 against recomputing it with the engine's prefill, in one run.

    python bench/l3.py [--json] [--quick] [--ranks N] [--pages N] [--sync]
                       [--backend lmdb|redis|both] [--url URL] [--shapes]
    python bench/l3.py --fleet N [--masters M] [--url URL,URL...]   # bench/l3_fleet.py
    python bench/l3.py --dead-shard N [--prefix-pages P] [--prefixes K]

Each rank is a process writing/reading its own shards into ONE shared store, concurrently with the
other ranks. LMDB: the raw baseline writes the same payload bytes under the same keys into a
plain LMDB environment (no header, checksum, LRU or accounting) and reads them back into the same
buffers. Redis: the raw baseline is pipelined SET / GET of the same payload bytes with the same
client set-up and batch sizes, copied into the same buffers, each raw phase right next to its
store twin (order alternating per repeat); the Redis ratios are medians of the per-repeat paired
ratios, robust to load from other jobs drifting during the run. Without ``--url`` a local
valkey-server is started on a private port (and stopped). ``--shapes`` also times raw SET / GET
with each command packer (hiredis / pure Python) and reply parser (hiredis / pure Python).
The recompute baseline runs ``MLAModel`` prefill (dense forward) over the tokens whose KV one
page set holds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # bench/l3_fleet.py

from hicache.l3 import CostModel, Namespace, PageStore, RedisStore, page_keys  # noqa: E402

GB = 1e9


def _model_config(quick: bool):
    from hicache.engine.model import ModelConfig
    return ModelConfig(vocab_size=1024, hidden_size=256 if quick else 512,
                       num_layers=4, num_heads=8, kv_lora_rank=512, qk_nope_head_dim=64,
                       qk_rope_head_dim=64, v_head_dim=64,
                       intermediate_size=704 if quick else 1408, dtype="bfloat16")


def _rank_worker(rank, ranks, args, path_store, path_raw, barrier, queue):
    torch.set_num_threads(1)
    cfg = _model_config(args.quick)
    ns = Namespace("bench", cfg.num_layers, cfg.kv_dim, cfg.dtype, args.page_size, ranks)
    pt = ns.page_tokens
    tokens = list(range(args.pages * pt))
    keys = page_keys(tokens, pt, ns, rank)
    g = torch.Generator().manual_seed(rank)
    shards = [torch.randn(ns.shard_shape, generator=g).to(ns.torch_dtype)
              for _ in range(args.pages)]
    payloads = [s.view(torch.uint8).reshape(-1).numpy() for s in shards]
    outs = [torch.zeros(ns.shard_shape, dtype=ns.torch_dtype) for _ in range(args.pages)]
    nbytes = args.pages * ns.shard_bytes
    cap = 2 * ranks * args.pages * (ns.shard_bytes + 4096)
    batch = args.batch_pages * ns.shard_bytes
    import lmdb

    res = {"store_put": [], "store_get": [], "raw_put": [], "raw_get": []}
    if args.url:
        res.update({"redis_put": [], "redis_get": [], "redis_raw_put": [], "redis_raw_get": []})
    it = range(args.repeats)
    if rank == 0:
        it = tqdm(it, desc=f"l3 bench ({ranks} rank(s))", file=sys.stderr)
    def raw(rep):
        barrier.wait()
        env = lmdb.open(f"{path_raw}-{rep}", map_size=2 * cap + (64 << 20), max_dbs=2,
                        sync=args.sync, metasync=args.sync, readahead=False, meminit=False)
        db = env.open_db(b"raw")
        barrier.wait()
        t0 = time.perf_counter()
        for i in range(0, args.pages, args.batch_pages):
            with env.begin(write=True) as txn:
                for k, p in zip(keys[i:i + args.batch_pages], payloads[i:i + args.batch_pages]):
                    txn.put(k, p, db=db)
        res["raw_put"].append(time.perf_counter() - t0)
        barrier.wait()
        t0 = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for k, o in zip(keys, outs):
                np.copyto(o.view(torch.uint8).reshape(-1).numpy(),
                          np.frombuffer(txn.get(k, db=db), dtype=np.uint8))
        res["raw_get"].append(time.perf_counter() - t0)
        env.close()

    def ours(rep):
        barrier.wait()
        store = PageStore(f"{path_store}-{rep}", ns, rank, capacity_bytes=cap, sync=args.sync,
                          batch_bytes=batch)
        barrier.wait()
        t0 = time.perf_counter()
        store.put(keys, shards)
        res["store_put"].append(time.perf_counter() - t0)
        barrier.wait()
        t0 = time.perf_counter()
        served = store.get(keys, outs)
        res["store_get"].append(time.perf_counter() - t0)
        assert served == args.pages and torch.equal(outs[-1], shards[-1])
        store.close()

    def redis_rep(rep):
        """Raw SET then store put, raw GET then store get (the order alternates per repeat):
        each store phase runs right next to its raw twin, so one repeat gives a paired ratio
        even while other jobs' load on the machine drifts."""
        import redis
        client = redis.Redis.from_url(args.url, **_client_kw())
        rkeys = [b"raw%d:" % rep + k for k in keys]
        store = RedisStore(args.url, ns, rank, batch_bytes=batch, key_prefix=b"store%d:" % rep,
                           timeout_s=30.0, check_policy=False)
        got = {}

        def raw_put():
            for i in range(0, args.pages, args.batch_pages):
                pipe = client.pipeline(transaction=False)
                for k, p in zip(rkeys[i:i + args.batch_pages], payloads[i:i + args.batch_pages]):
                    pipe.set(k, memoryview(p))
                pipe.execute()

        def raw_get():
            for i in range(0, args.pages, args.batch_pages):
                pipe = client.pipeline(transaction=False)
                for k in rkeys[i:i + args.batch_pages]:
                    pipe.get(k)
                for o, v in zip(outs[i:i + args.batch_pages], pipe.execute()):
                    np.copyto(o.view(torch.uint8).reshape(-1).numpy(), np.frombuffer(v, np.uint8))

        def store_put():
            got["put"] = store.put(keys, shards)

        def store_get():
            got["get"] = store.get(keys, outs)

        for phase in ((raw_put, store_put), (raw_get, store_get)):
            for fn in (phase if rep % 2 == 0 else phase[::-1]):
                name = {raw_put: "redis_raw_put", raw_get: "redis_raw_get",
                        store_put: "redis_put", store_get: "redis_get"}[fn]
                barrier.wait()
                t0 = time.perf_counter()
                fn()
                res[name].append(time.perf_counter() - t0)
        assert got["put"].written == args.pages and got["get"] == args.pages
        assert torch.equal(outs[-1], shards[-1]) and store.stats.errors == 0
        store.delete(keys)
        store.close()
        client.delete(*rkeys)
        client.close()

    sides = [raw, ours] if args.backend in ("lmdb", "both") else []
    if args.url:
        sides += [redis_rep]
    for rep in it:  # alternate the order so no side always gets a warmer machine
        for fn in (sides if rep % 2 == 0 else sides[::-1]):
            fn(rep)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    for op in ("put", "get"):  # median over repeats of the paired (same repeat) ratios
        if res.get(f"redis_{op}"):
            med[f"redis_{op}_ratio"] = statistics.median(
                r / s for r, s in zip(res[f"redis_raw_{op}"], res[f"redis_{op}"]))
    queue.put((rank, med, nbytes))


def _client_kw():
    """The client set-up RedisStore uses: pure-Python command packer (a large value goes out as
    its own buffer), hiredis reply parser (the default when hiredis is installed)."""
    import redis
    from redis.connection import PythonRespSerializer
    enc = redis.connection.Encoder("utf-8", "strict", False)
    return {"command_packer": PythonRespSerializer(6000, enc.encode), "socket_timeout": 30}


def _shapes(url: str, pages: int, page_bytes: int, batch: int, repeats: int) -> list[dict]:
    """Raw pipelined SET / GET GB/s for each command packer x reply parser."""
    import redis
    from redis.connection import HiredisRespSerializer, PythonRespSerializer, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE
    enc = redis.connection.Encoder("utf-8", "strict", False)
    vals = [np.random.default_rng(i).integers(0, 255, page_bytes, dtype=np.uint8)
            for i in range(pages)]
    out = np.empty(page_bytes, np.uint8)
    rows = []
    packers = {"python": PythonRespSerializer(6000, enc.encode)}
    if HIREDIS_AVAILABLE:
        packers["hiredis"] = HiredisRespSerializer()
    parsers = {"python": _RESP2Parser}
    if HIREDIS_AVAILABLE:
        from redis.connection import _HiredisParser
        parsers["hiredis"] = _HiredisParser
    for pk, packer in packers.items():
        for ps, parser in parsers.items():
            c = redis.Redis.from_url(url, command_packer=packer, parser_class=parser)
            keys = [b"shape:%d" % i for i in range(pages)]
            tp, tg = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for i in range(0, pages, batch):
                    pipe = c.pipeline(transaction=False)
                    for k, v in zip(keys[i:i + batch], vals[i:i + batch]):
                        pipe.set(k, memoryview(v))
                    pipe.execute()
                tp.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(0, pages, batch):
                    pipe = c.pipeline(transaction=False)
                    for k in keys[i:i + batch]:
                        pipe.get(k)
                    for v in pipe.execute():
                        np.copyto(out, np.frombuffer(v, np.uint8))
                tg.append(time.perf_counter() - t0)
            c.delete(*keys)
            c.close()
            n = pages * page_bytes
            rows.append({"packer": pk, "parser": ps, "set_gbs": n / statistics.median(tp) / GB,
                         "get_gbs": n / statistics.median(tg) / GB})
    return rows


def _auth_bench(url: str, pages: int, batch: int, repeats: int, root: str) -> dict:
    """Authenticated store (fleet secret: keyed store keys, BLAKE3 MAC checked on every read)
    against the raw client moving the same 1 MB values (pipelined SET / GET, same client
    set-up, same batches), paired per repeat, order alternating; and the MAC's and XXH3's
    GB/s on the same buffers."""
    import redis
    import xxhash

    from hicache.l3 import auth, open_store
    ns = Namespace("bench-auth", 4, 1024, "bfloat16", 128, 1)  # 4 * 128 * 1024 * 2 B = 1 MiB
    secret = os.path.join(root, "fleet.secret")
    with open(secret, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(secret, 0o600)
    secrets = auth.load(None, env={auth.ENV: secret})
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(ns.shard_shape, generator=g).to(ns.torch_dtype) for _ in range(pages)]
    payloads = [s.view(torch.uint8).reshape(-1).numpy() for s in shards]
    outs = [torch.zeros(ns.shard_shape, dtype=ns.torch_dtype) for _ in range(pages)]
    keys = page_keys(list(range(pages * ns.page_tokens)), ns.page_tokens, ns, 0)
    client = redis.Redis.from_url(url, **_client_kw())
    t = {"raw_put": [], "auth_put": [], "raw_get": [], "auth_get": []}
    for rep in range(repeats):
        rkeys = [b"rawauth%d:" % rep + k for k in keys]
        store = open_store(url, ns, 0, secrets=secrets, batch_bytes=batch * ns.shard_bytes,
                           key_prefix=b"auth%d:" % rep, timeout_s=30.0, check_policy=False)

        def raw_put():
            for i in range(0, pages, batch):
                pipe = client.pipeline(transaction=False)
                for k, p in zip(rkeys[i:i + batch], payloads[i:i + batch]):
                    pipe.set(k, memoryview(p))
                pipe.execute()

        def raw_get():
            for i in range(0, pages, batch):
                pipe = client.pipeline(transaction=False)
                for k in rkeys[i:i + batch]:
                    pipe.get(k)
                for o, v in zip(outs[i:i + batch], pipe.execute()):
                    np.copyto(o.view(torch.uint8).reshape(-1).numpy(), np.frombuffer(v, np.uint8))

        got = {}
        fns = {"raw_put": raw_put, "auth_put": lambda: got.update(put=store.put(keys, shards)),
               "raw_get": raw_get, "auth_get": lambda: got.update(get=store.get(keys, outs))}
        for pair in (("raw_put", "auth_put"), ("raw_get", "auth_get")):
            for name in (pair if rep % 2 == 0 else pair[::-1]):
                t0 = time.perf_counter()
                fns[name]()
                t[name].append(time.perf_counter() - t0)
        assert got["put"].written == pages and got["get"] == pages
        assert torch.equal(outs[-1], shards[-1]) and store.stats.auth_failures == 0
        store.delete(keys)
        store.close()
        client.delete(*rkeys)
    client.close()
    nbytes = pages * ns.shard_bytes
    mac, xxh = [], []
    head = b"h" * 80
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, p in zip(keys, payloads):
            secrets.current.tag(k, head, p)
        mac.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in payloads:
            xxhash.xxh3_64_digest(p)
        xxh.append(time.perf_counter() - t0)
    return {"value_bytes": ns.shard_bytes, "pages": pages,
            "auth_put_gbs": nbytes / statistics.median(t["auth_put"]) / GB,
            "raw_put_gbs": nbytes / statistics.median(t["raw_put"]) / GB,
            "auth_get_gbs": nbytes / statistics.median(t["auth_get"]) / GB,
            "raw_get_gbs": nbytes / statistics.median(t["raw_get"]) / GB,
            "put_ratio": statistics.median(r / a for r, a in zip(t["raw_put"], t["auth_put"])),
            "get_ratio": statistics.median(r / a for r, a in zip(t["raw_get"], t["auth_get"])),
            "mac_gbs": nbytes / statistics.median(mac) / GB,
            "xxh3_gbs": nbytes / statistics.median(xxh) / GB}


def _recompute_seconds(args, n_tokens: int) -> tuple[float, int]:
    """Prefill seconds for n_tokens with the engine's model, measured on at most ``cap``
    tokens and scaled linearly (attention is superlinear: a lower bound for recompute).
    Falls back to a GEMM stand-in when the engine is absent. Returns (seconds, measured)."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    m = min(n_tokens, 256 if args.quick else 1024)
    try:
        from hicache.engine.model import MLAModel
        model = MLAModel(_model_config(args.quick))
        toks = [t % model.cfg.vocab_size for t in range(m)]
        run = lambda: model(toks)  # noqa: E731
        model(toks[:16])  # warm up
    except ImportError:  # the engine is not there: GEMMs of a similar size
        w = torch.randn(512, 512)
        x = torch.randn(m, 512)
        run = lambda: [x @ w for _ in range(32)]  # noqa: E731
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times) * n_tokens / m, m


def _auth_main(args) -> int:
    root = tempfile.mkdtemp(prefix="hicache-l3-auth-bench-", dir=args.dir)
    server = None
    try:
        if not args.url:
            from hicache.l3.localserver import start_server
            server = start_server(os.path.join(root, "valkey"), maxmemory=0)
            args.url = server.url
        pages = args.pages or (16 if args.quick else 64)
        res = _auth_bench(args.url, pages, min(args.batch_pages, 16),
                          args.repeats or (3 if args.quick else 7), root)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps({"bench": "l3-auth", **res}))
        return 0
    print(f"authenticated L3 (Redis, {res['pages']} values of {res['value_bytes'] / 2**20:.0f} "
          f"MiB) against the raw client, same run, paired medians:")
    print(f"  put {res['auth_put_gbs']:.2f} GB/s vs raw {res['raw_put_gbs']:.2f} GB/s: "
          f"{res['put_ratio']:.2f}x")
    print(f"  get {res['auth_get_gbs']:.2f} GB/s vs raw {res['raw_get_gbs']:.2f} GB/s: "
          f"{res['get_ratio']:.2f}x")
    print(f"  MAC (BLAKE3 keyed) {res['mac_gbs']:.2f} GB/s; XXH3-64 {res['xxh3_gbs']:.2f} GB/s")
    return 0


def _fleet_main(ap, args) -> int:
    import l3_fleet
    if args.fleet < 0 or args.dead_shard < 0 or args.masters < 1 or args.prefix_pages < 1 \
            or args.prefixes < 1 or min(args.fleet_sequences, args.fleet_pages) < 1 \
            or args.fleet_shared < 0:
        ap.error("--fleet, --dead-shard, --masters and the --fleet-* / --prefix* sizes must be "
                 "positive")
    if args.dead_shard == 1:
        ap.error("--dead-shard needs at least 2 masters (one dies, the others answer)")
    if args.fleet_layers is None:
        args.fleet_layers = 2 if args.quick else 16
    res = l3_fleet.dead_shard(args) if args.dead_shard else l3_fleet.fleet(args)
    if args.json:
        print(json.dumps(res))
    elif args.dead_shard:
        l3_fleet.print_dead_shard(res)
    else:
        l3_fleet.print_fleet(res)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a small, fast run")
    ap.add_argument("--ranks", type=int, default=2, help="DCP ranks sharing the node's env")
    ap.add_argument("--pages", type=int, default=None, help="widened pages per rank")
    ap.add_argument("--page-size", type=int, default=64, help="physical page size P")
    ap.add_argument("--batch-pages", type=int, default=32, help="pages per write transaction")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sync", action="store_true", help="fsync each commit (both sides)")
    ap.add_argument("--dir", default=None, help="where to put the environments (default: tmp)")
    ap.add_argument("--backend", default="both", choices=("lmdb", "redis", "both"))
    ap.add_argument("--url", default=None, help="Redis / Valkey URL (default: start a local "
                    "valkey-server on a private port)")
    ap.add_argument("--shapes", action="store_true",
                    help="also time raw SET/GET per command packer and reply parser")
    ap.add_argument("--auth", action="store_true",
                    help="only the authenticated Redis store (fleet secret, MAC) against the "
                         "raw client on 1 MB values, and the MAC's GB/s")
    ap.add_argument("--fleet", type=int, default=0,
                    help="N writer/reader processes on one Redis Cluster against one process "
                         "(bench/l3_fleet.py)")
    ap.add_argument("--masters", type=int, default=3, help="--fleet / --dead-shard: masters")
    ap.add_argument("--fleet-sequences", type=int, default=4, help="--fleet: own sequences "
                    "per process")
    ap.add_argument("--fleet-shared", type=int, default=2, help="--fleet: sequences every "
                    "process writes (dedup)")
    ap.add_argument("--fleet-pages", type=int, default=8, help="--fleet: pages per sequence")
    ap.add_argument("--fleet-layers", type=int, default=None,
                    help="--fleet: layers per page (default 16; --quick 2)")
    ap.add_argument("--dead-shard", type=int, default=0,
                    help="N masters, one killed: what a prefix keeps (bench/l3_fleet.py)")
    ap.add_argument("--prefix-pages", type=int, default=32, help="--dead-shard: pages")
    ap.add_argument("--prefixes", type=int, default=200, help="--dead-shard: prefixes")
    args = ap.parse_args(argv)
    if args.auth:
        return _auth_main(args)
    if args.fleet or args.dead_shard:
        return _fleet_main(ap, args)
    if args.ranks < 1 or (args.pages is not None and args.pages < 1):
        ap.error("--ranks and --pages must be >= 1")
    args.pages = args.pages or (24 if args.quick else 96)
    args.repeats = args.repeats or (2 if args.quick else 3)

    root = tempfile.mkdtemp(prefix="hicache-l3-bench-", dir=args.dir)
    server = None
    shapes = []
    try:
        if args.backend != "lmdb" and not args.url:
            from hicache.l3.localserver import start_server
            server = start_server(os.path.join(root, "valkey"), maxmemory=0)
            args.url = server.url
        if args.backend == "lmdb":
            args.url = None
        if args.shapes and args.url:
            ns0 = Namespace("bench", 4, 576, "bfloat16", args.page_size, args.ranks)
            shapes = _shapes(args.url, args.pages, ns0.shard_bytes, args.batch_pages,
                             args.repeats)
        ctx = mp.get_context("spawn")
        barrier, queue = ctx.Barrier(args.ranks), ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank_worker, args=(r, args.ranks, args,
                                                        os.path.join(root, "store"),
                                                        os.path.join(root, "raw"), barrier, queue))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            print("a rank worker failed", file=sys.stderr)
            return 1
        per_rank = {}
        while not queue.empty():
            rank, med, nbytes = queue.get()
            per_rank[rank] = med
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)

    cfg = _model_config(args.quick)
    n_tokens = args.pages * args.page_size * args.ranks  # tokens whose KV one rank set holds
    recompute_s, measured = _recompute_seconds(args, n_tokens)
    rows = []
    for r in sorted(per_rank):
        m = per_rank[r]
        row = {"rank": r}
        if "store_get" in m:
            row.update({"store_put_gbs": nbytes / m["store_put"] / GB,
                        "raw_put_gbs": nbytes / m["raw_put"] / GB,
                        "store_get_gbs": nbytes / m["store_get"] / GB,
                        "raw_get_gbs": nbytes / m["raw_get"] / GB,
                        "put_ratio": m["raw_put"] / m["store_put"],
                        "get_ratio": m["raw_get"] / m["store_get"],
                        "load_s": m["store_get"]})
        if "redis_get" in m:
            row.update({"redis_put_gbs": nbytes / m["redis_put"] / GB,
                        "redis_raw_put_gbs": nbytes / m["redis_raw_put"] / GB,
                        "redis_get_gbs": nbytes / m["redis_get"] / GB,
                        "redis_raw_get_gbs": nbytes / m["redis_raw_get"] / GB,
                        "redis_put_ratio": m["redis_put_ratio"],
                        "redis_get_ratio": m["redis_get_ratio"]})
            if "store_get" in m:
                row["redis_vs_lmdb_put"] = m["store_put"] / m["redis_put"]
                row["redis_vs_lmdb_get"] = m["store_get"] / m["redis_get"]
            else:
                row["load_s"] = m["redis_get"]
        rows.append(row)
    load_s = max(r["load_s"] for r in rows)  # ranks load in parallel: the slowest decides
    cost = CostModel(read_bytes_per_s=nbytes / load_s, prefill_tokens_per_s=n_tokens / recompute_s)
    result = {
        "bench": "l3", "ranks": args.ranks, "pages_per_rank": args.pages,
        "shard_bytes": nbytes // args.pages, "bytes_per_rank": nbytes, "sync": args.sync,
        "per_rank": rows, "backend": args.backend, "redis_shapes": shapes,
        "recompute": {"tokens": n_tokens, "measured_tokens": measured, "prefill_s": recompute_s, "load_s": load_s,
                      "speedup_load_vs_recompute": recompute_s / load_s,
                      "cost_model_should_load": cost.should_load(n_tokens, nbytes),
                      "model": {"layers": cfg.num_layers, "hidden": cfg.hidden_size,
                                "kv_dim": cfg.kv_dim, "dtype": cfg.dtype}},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"L3 store, {args.ranks} rank(s) sharing one env, {args.pages} pages x "
          f"{nbytes // args.pages / 1e6:.2f} MB per rank, sync={args.sync}")
    for pre, name in (("", "lmdb"), ("redis_", "redis")):
        if f"{pre}put_ratio" not in rows[0]:
            continue
        sp, sg = ("store_put_gbs", "store_get_gbs") if not pre else ("redis_put_gbs",
                                                                     "redis_get_gbs")
        print(f"{name:>6} {'rank':>4} {'put GB/s':>9} {'raw put':>8} {'ratio':>6} "
              f"{'get GB/s':>9} {'raw get':>8} {'ratio':>6}")
        for r in rows:
            print(f"{'':>6} {r['rank']:>4} {r[sp]:>9.2f} {r[pre + 'raw_put_gbs']:>8.2f} "
                  f"{r[pre + 'put_ratio']:>6.2f} {r[sg]:>9.2f} {r[pre + 'raw_get_gbs']:>8.2f} "
                  f"{r[pre + 'get_ratio']:>6.2f}")
    if "redis_vs_lmdb_get" in rows[0]:
        print("redis store vs lmdb store: " + ", ".join(
            f"rank {r['rank']} put {r['redis_vs_lmdb_put']:.2f}x get {r['redis_vs_lmdb_get']:.2f}x"
            for r in rows))
    for sh in shapes:
        print(f"raw redis packer={sh['packer']:<7} parser={sh['parser']:<7} "
              f"SET {sh['set_gbs']:.2f} GB/s  GET {sh['get_gbs']:.2f} GB/s")
    rc = result["recompute"]
    print(f"load {n_tokens} tokens' KV from L3: {load_s * 1e3:.1f} ms; recompute with MLAModel "
          f"prefill: {recompute_s * 1e3:.1f} ms (measured on {measured} tokens, scaled "
          f"linearly); load is {rc['speedup_load_vs_recompute']:.1f}x "
          f"faster; cost model says load={rc['cost_model_should_load']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
