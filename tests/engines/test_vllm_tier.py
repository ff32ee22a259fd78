"""hicache's L3 as a secondary tier of vLLM 0.33's CPU offload, driven by vLLM's own
TieringOffloadingManager (built by TieringOffloadingSpec from a real OffloadingConfig, with its real
shared-memory CPU tier); the tier is loaded by vLLM's factory from ``module_path``.

The test stands in for the GPU workers only: it writes each worker's slot of a CPU row (MLA, tp=4,
dcp=2: workers 0,2 hold DCP shard 0 and 1,3 shard 1) where vLLM's worker copy would."""

import contextlib
import hashlib
import multiprocessing as mp
import time
import uuid

import numpy as np
import pytest
from engine_helpers import damage  # noqa: I001  first: before vLLM (see engine_helpers)

from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadingSpec, ReqContext,
                                     ScheduleEndContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                       OffloadingGroupConfig, OffloadingModelConfig,
                                       OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache.integrations.common import store_keys
from hicache.integrations.vllm import HiCacheTier

HIT, MISS = LookupResult.HIT, LookupResult.MISS
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
WORKER_BYTES = 1024  # one worker's bytes of one block


def okey(name: str, i: int):
    return make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0)


def payload(key: bytes, shard: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(bytes(key) + bytes([shard]), digest_size=8).digest(),
                          "big")
    return np.random.default_rng(seed).integers(0, 256, WORKER_BYTES, dtype=np.uint8)


class Tiered:
    """vLLM's tiering manager (CPU primary + the hicache tier) of one scheduler process."""

    def __init__(self, where, *, tp=4, dcp=2, chunks=4, weights="w1", mla=True,
                 kv_dtype="bfloat16", replicated=False, events=False, tier_extra=None,
                 extra=None, model="tiny-mla"):
        tier = {"type": "HiCacheTier", "module_path": "hicache.integrations.vllm",
                "store": where, "mla": mla, "weights_signature": weights,
                "capacity_bytes": 32 << 20, "timeout_s": 5.0, **(tier_extra or {})}
        if events:
            tier["enable_kv_events"] = True
        row = -(-WORKER_BYTES * (1 if replicated else tp) // 4096) * 4096
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16,
                                          layer_names=("layers.0.attn", "layers.1.attn"),
                                          group_id=0),),
            worker_kv_bytes_per_block=WORKER_BYTES, enable_kv_cache_events=events,
            extra_config={"cpu_bytes_to_use": chunks * row, "secondary_tiers": [tier],
                          "tier_poll_interval_s": 0, **(extra or {})},
            engine_id=f"hicache-test-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name=model, dtype=kv_dtype),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=dcp,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False),
            replicated_layout=replicated)
        self.spec = TieringOffloadingSpec(config)
        self.mgr = self.spec.get_manager()
        # vLLM 0.33 serialises the scheduler's calls with the manager's lock; 0.32 has none
        self.lock = getattr(self.mgr, "lock", contextlib.nullcontext())
        self.tier = self.mgr.secondary_tiers[0]
        assert isinstance(self.tier, HiCacheTier)
        self.rows = np.asarray(self.mgr.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.shard_of = self.tier.layout.shard_of

    def expected(self, key) -> np.ndarray:
        return np.concatenate([payload(key, s) for s in self.shard_of])

    def step(self):
        self.tier.drain_jobs()
        with self.lock:
            self.mgr.on_schedule_end(END)

    def store(self, req: str, keys) -> list:
        """A request whose chunks the GPU workers wrote: prepare, write rows, complete (vLLM
        then cascades them to the hicache tier). Returns the keys vLLM evicted for room."""
        ctx = ReqContext(req_id=req)
        with self.lock:
            self.mgr.on_new_request(ctx)
            out = self.mgr.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for key, cid in zip(keys, out.store_spec.chunk_ids):
            self.rows[int(cid), :len(self.shard_of) * WORKER_BYTES] = self.expected(key)
        with self.lock:
            self.mgr.complete_store(keys, ctx)
            self.mgr.on_request_finished(ctx)
        self.step()
        self.step()  # the finished cascade releases its primary chunks
        return list(out.evicted_keys)

    def lookups(self, ctx, keys) -> list:
        with self.lock:
            return [self.mgr.lookup(k, ctx) for k in keys]

    def until(self, ctx, keys, done, limit_s=30.0) -> list:
        """Step the scheduler until ``done(results)`` (bounded; never a timing assertion)."""
        deadline = time.monotonic() + limit_s
        while True:
            res = self.lookups(ctx, keys)
            if done(res) or time.monotonic() > deadline:
                return res
            self.step()
            time.sleep(0.005)

    def resolve(self, ctx, keys) -> list:
        return self.until(ctx, keys, lambda r: all(x in (HIT, MISS) for x in r))

    def read(self, ctx, keys) -> list:
        """The primary rows vLLM would load to the GPU for ``keys`` (copies)."""
        with self.lock:
            spec = self.mgr.prepare_load(keys, ctx)
            out = [self.rows[int(c), :len(self.shard_of) * WORKER_BYTES].copy()
                   for c in spec.chunk_ids]
            self.mgr.complete_load(keys, ctx)
        return out

    def request(self, req: str) -> ReqContext:
        ctx = ReqContext(req_id=req)
        with self.lock:
            self.mgr.on_new_request(ctx)
        return ctx

    def shard_keys(self, keys, shard: int) -> list:
        return store_keys(keys, self.tier.namespace, shard)

    def close(self):
        self.rows = None  # unexport vLLM's buffer before its region is unmapped
        self.mgr.shutdown()


@pytest.fixture
def tiered(where):
    t = Tiered(where)
    yield t
    t.close()


def stored_and_evicted(t: Tiered, n: int = 3) -> list:
    """``n`` chunks of request a stored through vLLM, then pushed out of its CPU tier."""
    a = [okey("a", i) for i in range(n)]
    assert t.store("a", a) == []
    evicted = t.store("b", [okey("b", i) for i in range(4)])  # the CPU tier holds 4 chunks
    assert set(a) <= set(evicted)
    with t.lock:
        assert all(t.mgr.primary_tier.lookup(k, ReqContext("x")) == MISS for k in a)
    return a


def test_store_evict_promote_is_bit_exact_and_stores_each_shard_once(tiered):
    t = tiered
    assert t.shard_of == (0, 1, 0, 1)
    a = stored_and_evicted(t)
    # each distinct DCP shard once: 2 shards x 7 chunks, not 4 worker copies
    assert [s.stats.pages_written for s in t.tier.stores.values()] == [7, 7]
    for s in (0, 1):
        assert t.tier.stores[s].exists_prefix(t.shard_keys(a, s)) == 3
    ctx = t.request("c")
    assert t.resolve(ctx, a) == [HIT] * 3  # promoted back from the hicache tier
    rows = t.read(ctx, a)
    for key, row in zip(a, rows):  # every worker slot rebuilt, byte for byte
        assert np.array_equal(row, t.expected(key))
    assert sum(s.stats.hits for s in t.tier.stores.values()) == 6


def test_partial_load_reports_the_keys_that_arrived(tiered, monkeypatch):
    t = tiered
    a = stored_and_evicted(t)
    results = []
    real = t.tier.get_finished_jobs

    def spy():
        out = list(real())
        results.extend(out)
        return out

    monkeypatch.setattr(t.tier, "get_finished_jobs", spy)
    ctx = t.request("c")
    pending = LookupResult.HIT_PENDING
    assert t.until(ctx, a, lambda r: all(x == pending for x in r)) == [pending] * 3
    # promotions are queued; before vLLM submits the load, shard 1 of chunk 1 goes away
    assert t.tier.stores[1].delete(t.shard_keys(a[1:2], 1)) == 1
    assert t.resolve(ctx, a) == [HIT, MISS, MISS]
    loads = [r for r in results if r.successful_keys is not None or not r.success]
    assert len(loads) == 1 and not loads[0].success
    assert tuple(loads[0].successful_keys) == (a[0],)
    assert np.array_equal(t.read(ctx, a[:1])[0], t.expected(a[0]))


def test_corrupt_value_is_a_miss_and_is_dropped(tiered):
    t = tiered
    a = stored_and_evicted(t)
    ctx = t.request("c")
    pending = LookupResult.HIT_PENDING
    t.until(ctx, a, lambda r: all(x == pending for x in r))
    damage(t.tier.stores[0], t.shard_keys(a[1:2], 0)[0])
    assert t.resolve(ctx, a) == [HIT, MISS, MISS]
    assert t.tier.stores[0].stats.corrupt == 1
    assert np.array_equal(t.read(ctx, a[:1])[0], t.expected(a[0]))
    # the corrupt value was deleted: a later request does not even try it
    assert t.tier.stores[0].exists_prefix(t.shard_keys(a, 0)) == 1
    ctx2 = t.request("d")
    assert t.resolve(ctx2, a[1:2]) == [MISS]


def test_other_weights_never_hit(where):
    t1 = Tiered(where, weights="w1")
    try:
        a = stored_and_evicted(t1)
    finally:
        t1.close()
    t2 = Tiered(where, weights="w2")  # same model name, shapes and sizes; other weights
    try:
        assert t2.tier.namespace.digest != t1.tier.namespace.digest
        assert t2.resolve(t2.request("c"), a) == [MISS] * 3
    finally:
        t2.close()


def test_differing_mla_copies_are_not_stored(tmp_path):
    t = Tiered(str(tmp_path / "l3"))
    try:
        ctx = ReqContext(req_id="a")
        keys = [okey("a", 0)]
        with t.lock:
            t.mgr.on_new_request(ctx)
            out = t.mgr.prepare_store(keys, ctx)
        cid = int(out.store_spec.chunk_ids[0])
        t.rows[cid, :4 * WORKER_BYTES] = t.expected(keys[0])
        t.rows[cid, 2 * WORKER_BYTES] ^= 1  # worker 2's copy of shard 0 differs: not MLA
        with t.lock:
            t.mgr.complete_store(keys, ctx)
        t.step()
        assert all(s.stats.pages_written == 0 for s in t.tier.stores.values())
    finally:
        t.close()


def _scheduler(url: str, mine: str, other: str, barrier, q) -> None:
    """One scheduler process: store its own request's chunks, then promote the other's."""
    t = Tiered(url)
    try:
        t.store(mine, [okey(mine, i) for i in range(3)])
        barrier.wait(timeout=120)
        keys = [okey(other, i) for i in range(3)]
        ctx = t.request("r-" + mine)
        res = t.resolve(ctx, keys)
        exact = res == [HIT] * 3 and all(
            np.array_equal(row, t.expected(k)) for k, row in zip(keys, t.read(ctx, keys)))
        q.put((mine, [r.name for r in res], exact))
    except BaseException as e:  # report, do not hang the parent
        q.put((mine, repr(e), False))
    finally:
        t.close()


def test_two_scheduler_processes_share_one_redis_l3(redis_url):
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_scheduler, args=(redis_url, m, o, barrier, q))
             for m, o in (("x", "y"), ("y", "x"))]
    for p in procs:
        p.start()
    try:
        got = sorted(q.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == [("x", ["HIT"] * 3, True), ("y", ["HIT"] * 3, True)]


# ---- the contracts vLLM's own tier tests encode (issue 28, point 7) ----------------------------
def test_lookup_answers_per_key_in_any_order(tiered):
    """vLLM batches a step's lookups in any order (its sliding-window lookup sends a request's
    keys last first): a missing chunk is a miss for itself only, not for the keys after it."""
    t = tiered
    a = stored_and_evicted(t)
    never = okey("never", 0)
    ctx = t.request("c")
    assert t.resolve(ctx, [never, a[2], a[1], a[0]]) == [MISS, HIT, HIT, HIT]
    assert t.tier.held([a[2], never, a[0]]) == [True, False, True]


class _BareSpec(OffloadingSpec):
    """A spec with only what vLLM's base OffloadingSpec has (no CPU-spec attributes)."""

    # vLLM's base class makes these abstract; the tier reads only the spec's config, so a
    # call here is a test failure
    def get_manager(self):
        raise AssertionError("the hicache tier asked a spec for its manager")

    def get_worker(self, kv_caches):
        raise AssertionError("the hicache tier asked a spec for its worker")


def _config(tp=2, dcp=1, chunks=4, replicated=False, worker_bytes=WORKER_BYTES):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn",),
                                      group_id=0),),
        worker_kv_bytes_per_block=worker_bytes, enable_kv_cache_events=False,
        extra_config={}, engine_id=f"bare-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny-mla", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=dcp,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False),
        replicated_layout=replicated)


def test_tier_starts_from_any_spec(tmp_path):
    """A tier built from a spec that is not vLLM's CPU spec (no cpu_page_size_per_worker, no
    replicated_layout attribute) starts, and stores and loads a row exactly."""
    spec = _BareSpec(_config(tp=2))
    assert not hasattr(spec, "cpu_page_size_per_worker")
    rows = np.zeros((4, 4096), dtype=np.uint8)
    tier = HiCacheTier(spec, memoryview(rows), "HiCacheTier", store=str(tmp_path / "l3"),
                       mla=True, weights_signature="w1")
    try:
        assert tier.layout.slots == 2 and tier.layout.num_shards == 1
        key = okey("bare", 0)
        rows[1, :2 * WORKER_BYTES] = np.tile(payload(key, 0), 2)
        job = TransferJob(job_id=1, keys=[key], chunk_ids=np.array([1]), is_promotion=False,
                          req_context=ReqContext(req_id="r"))
        tier.submit_store(job)
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]
        load = TransferJob(job_id=2, keys=[key], chunk_ids=np.array([3]), is_promotion=True,
                           req_context=ReqContext(req_id="r"))
        tier.submit_load(load)
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]
        assert np.array_equal(rows[3], rows[1])
    finally:
        tier.shutdown()


def test_stores_emit_kv_events_with_the_storage_medium(tmp_path):
    t = Tiered(str(tmp_path / "l3"), events=True)
    try:
        a = [okey("a", i) for i in range(3)]
        t.store("a", a)
        with t.lock:
            events = list(t.mgr.take_events())
        mine = [e for e in events if e.medium == Medium.STORAGE]
        assert len(mine) == 1 and list(mine[0].keys) == a and not mine[0].removed
        assert mine[0].locality == Locality.LOCAL
        with t.lock:  # taken once
            assert [e for e in t.mgr.take_events() if e.medium == Medium.STORAGE] == []
    finally:
        t.close()


def test_no_kv_events_unless_asked(tmp_path):
    t = Tiered(str(tmp_path / "l3"))
    try:
        t.store("a", [okey("a", 0)])
        with t.lock:
            assert [e for e in t.mgr.take_events() if e.medium == Medium.STORAGE] == []
    finally:
        t.close()


BP = {"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}


def test_a_redis_tier_is_remote_and_gets_network_backpressure(where):
    t = Tiered(where, extra=BP)
    try:
        det = t.tier.bp_detector
        remote = where.startswith(("redis", "unix"))
        assert t.tier.locality == (Locality.REMOTE if remote else Locality.LOCAL)
        cls = type(det)
        assert det._high == (cls.NETWORK_HIGH_WATER_S if remote else cls.LOCAL_HIGH_WATER_S)
        assert det._low == (cls.NETWORK_LOW_WATER_S if remote else cls.LOCAL_LOW_WATER_S)
    finally:
        t.close()


def test_an_explicit_locality_or_water_mark_wins(redis_url):
    t = Tiered(redis_url, tier_extra={"locality": "LOCAL"}, extra=BP)
    try:
        assert t.tier.locality == Locality.LOCAL
        assert t.tier.bp_detector._high == type(t.tier.bp_detector).LOCAL_HIGH_WATER_S
    finally:
        t.close()
    t = Tiered(redis_url, extra={"backpressure": {"backpressure_cls": "EMABackpressureDetector",
                                                   "high_water_s": 0.5}})
    try:
        assert t.tier.bp_detector._high == 0.5
    finally:
        t.close()


# ---- point 4: the namespace names what changes the bytes, and nothing else -------------------
def _shared(where, first: dict, second: dict) -> bool:
    """Chunks stored by a tier of ``first`` are hits, byte for byte, for one of ``second``."""
    t1 = Tiered(where, **first)
    try:
        a = stored_and_evicted(t1)
    finally:
        t1.close()
    t2 = Tiered(where, **second)
    try:
        ctx = t2.request("c")
        res = t2.resolve(ctx, a)
        if res == [MISS] * 3:
            return False
        assert res == [HIT] * 3, res
        assert all(np.array_equal(r, t2.expected(k)) for k, r in zip(a, t2.read(ctx, a)))
        return True
    finally:
        t2.close()


def test_mla_tp_sizes_share_pages(where):
    """An MLA latent is the same on every TP rank: TP=2 and TP=4 (DCP 1) share pages, and so
    does vLLM's single-copy row."""
    assert _shared(where, dict(tp=2, dcp=1), dict(tp=4, dcp=1))
    assert _shared(where, dict(tp=4, dcp=1, replicated=True), dict(tp=2, dcp=1))


def test_head_split_tp_sizes_do_not_share(tmp_path):
    """A KV split by heads differs per TP size: no sharing."""
    assert not _shared(str(tmp_path / "l3"), dict(tp=2, dcp=1, mla=False),
                       dict(tp=4, dcp=1, mla=False))


def test_dcp_sizes_do_not_share(tmp_path):
    assert not _shared(str(tmp_path / "l3"), dict(tp=4, dcp=2), dict(tp=4, dcp=1))


@pytest.mark.parametrize("a,b,same", [("fp8_e4m3", "fp8_e5m2", False), ("fp8", "fp8_e4m3", True),
                                      ("bfloat16", "float16", False)])
def test_kv_dtype(tmp_path, a, b, same):
    assert _shared(str(tmp_path / "l3"), dict(kv_dtype=a), dict(kv_dtype=b)) is same


@pytest.mark.parametrize("field,a,b", [("quantization", None, "fp8"),
                                       ("quantization", "fp8", "awq"),
                                       ("revision", "main", "v2")])
def test_quantization_and_revision(tmp_path, field, a, b):
    where = str(tmp_path / "l3")
    assert not _shared(where, dict(tier_extra={field: a}), dict(tier_extra={field: b}))
    assert _shared(where, dict(tier_extra={field: b}), dict(tier_extra={field: b}))


# ---- point 3: L3 health through vLLM's own offloading stats ------------------------------------
def _stats(t) -> dict:
    with t.lock:
        st = t.mgr.get_stats()
    return {} if st is None else st.data["data"]


def test_health_reaches_vllms_offloading_stats(where):
    t = Tiered(where)
    try:
        a = stored_and_evicted(t)
        _stats(t)  # the store phase, reported once
        ctx = t.request("c")
        assert t.resolve(ctx, a + [okey("never", 0)]) == [HIT] * 3 + [MISS]
        t.read(ctx, a)
        d = _stats(t)
        tier = ("HiCacheTier",)
        assert d["vllm:kv_offload_hicache_l3_hits"][tier] >= 3 and d["vllm:kv_offload_hicache_l3_misses"][tier] >= 1
        assert d["vllm:kv_offload_hicache_l3_read_bytes"][tier] == 2 * 3 * WORKER_BYTES  # 2 shards x 3 chunks
        assert {op for (_, op) in d["vllm:kv_offload_hicache_l3_latency_seconds"]} >= {"lookup", "load"}
        assert "vllm:kv_offload_hicache_l3_errors" not in d
        assert "vllm:kv_offload_hicache_l3_hits" not in _stats(t)  # reset once taken
        defs = TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": [{"type": "HiCacheTier",
                                  "module_path": "hicache.integrations.vllm"}]})
        assert defs["vllm:kv_offload_hicache_l3_errors"].labelnames == ("tier", "reason")
    finally:
        t.close()


def test_corrupt_values_count_as_corrupt_errors(tiered):
    t = tiered
    a = stored_and_evicted(t)
    _stats(t)
    ctx = t.request("c")
    t.until(ctx, a, lambda r: all(x == LookupResult.HIT_PENDING for x in r))
    damage(t.tier.stores[0], t.shard_keys(a[1:2], 0)[0])
    assert t.resolve(ctx, a) == [HIT, MISS, MISS]
    assert _stats(t)["vllm:kv_offload_hicache_l3_errors"] == {("HiCacheTier", "corrupt"): 1}


def _errors_until(t, keys, reason, limit_s=30.0) -> dict:
    """Look keys up (fresh requests) until an error of ``reason`` is reported (bounded)."""
    deadline, seen, i = time.monotonic() + limit_s, {}, 0
    while time.monotonic() < deadline:
        i += 1
        t.resolve(t.request(f"probe-{reason}-{i}"), [okey(f"{reason}-{i}", 0)] + keys)
        for k, v in _stats(t).get("vllm:kv_offload_hicache_l3_errors", {}).items():
            seen[k[1]] = seen.get(k[1], 0) + v
        if reason in seen:
            return seen
        time.sleep(0.2)
    return seen


def test_redis_timeouts_and_refusals_count_by_reason(redis_factory):
    import os
    import signal
    srv = redis_factory(unix=True, maxmemory=64 << 20)
    t = Tiered(srv.url, tier_extra={"timeout_s": 0.5})
    try:
        a = stored_and_evicted(t)
        _stats(t)
        os.kill(srv.proc.pid, signal.SIGSTOP)  # a hung server: calls time out
        try:
            seen = _errors_until(t, a, "timeout")
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert set(seen) == {"timeout"}
        srv.stop()  # gone: connections are refused
        seen = _errors_until(t, a, "refused")
        assert set(seen) == {"refused"}
    finally:
        t.close()


def test_a_shared_tier_takes_the_fleet_secret_rule(redis_url, monkeypatch, fleet_secret, caplog):
    """The tier refuses a Redis store without the fleet secret with the policy's one line; the
    secret comes from the tier's own config or the environment; ``authenticate: false`` runs
    it unauthenticated with one warning line."""
    import logging

    from hicache.errors import ConfigError
    from hicache.l3 import auth
    from hicache.l3.keyed import KeyedStore
    monkeypatch.delenv(auth.ENV)
    monkeypatch.setattr(auth, "_WARNED", set())
    with pytest.raises(ConfigError, match="secret_file: the redis backend is shared .*set "
                                          "authenticate = false"):
        Tiered(redis_url)
    t = Tiered(redis_url, tier_extra={"secret_file": fleet_secret})
    try:
        assert all(isinstance(s, KeyedStore) for s in t.tier.stores.values())
        a = stored_and_evicted(t)
    finally:
        t.close()
    with caplog.at_level(logging.WARNING, logger="hicache"):
        t = Tiered(redis_url, tier_extra={"authenticate": False})
    try:
        assert not any(isinstance(s, KeyedStore) for s in t.tier.stores.values())
        assert t.resolve(t.request("c"), a) == [MISS] * 3  # the keyed pages are not its own
    finally:
        t.close()
    warned = [r for r in caplog.records if "without a fleet secret" in r.getMessage()]
    assert len(warned) == 1


def tiny_checkpoint(path, seed: int) -> str:
    """A local checkpoint directory: config.json and one safetensors file."""
    import json
    import os

    from safetensors.numpy import save_file
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8}, f)
    g = np.random.default_rng(seed)
    save_file({"model.embed_tokens.weight": g.standard_normal((64, 8)).astype(np.float32)},
              os.path.join(path, "model.safetensors"))
    return str(path)


def test_weights_are_named_by_content_not_path(tmp_path):
    """Two nodes mounting the same weights at different paths share pages; other weights at
    the first node's path never hit."""
    import shutil
    where = str(tmp_path / "l3")
    a = tiny_checkpoint(tmp_path / "node-a" / "models" / "m", 0)
    b = shutil.copytree(a, tmp_path / "node-b" / "mnt" / "weights")
    t1 = Tiered(where, weights=None, model=a)
    try:
        keys = stored_and_evicted(t1)
    finally:
        t1.close()
    t2 = Tiered(where, weights=None, model=str(b))
    try:
        assert t2.tier.namespace.digest == t1.tier.namespace.digest
        assert t2.resolve(t2.request("c"), keys) == [HIT] * 3
    finally:
        t2.close()
    shutil.rmtree(a)
    tiny_checkpoint(a, 1)  # other weights at the same path
    t3 = Tiered(where, weights=None, model=a)
    try:
        assert t3.resolve(t3.request("d"), keys) == [MISS] * 3
    finally:
        t3.close()


def test_a_tier_smaller_than_one_request_says_so_once(tmp_path, monkeypatch, caplog):
    """vLLM's CPU tier of 4 chunks (16-token blocks, one per chunk) cannot hold one request of
    max_model_len 1024 tokens (64 chunks): one warning line naming both sizes; a big enough
    tier says nothing; an LMDB capacity under one chunk's shards says so too."""
    import logging
    import types

    import hicache.integrations.vllm as hv
    monkeypatch.setattr(hv, "_current_model_config",
                        lambda: types.SimpleNamespace(max_model_len=1024))
    row = 4096  # one chunk's primary row (4 workers x 1024 B)
    with caplog.at_level(logging.WARNING, logger="hicache.integrations.vllm"):
        t = Tiered(str(tmp_path / "a"), chunks=4)
        t.close()
    lines = [r.getMessage() for r in caplog.records if "less than one" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"CPU tier (cpu_bytes_to_use) holds {4 * row:,} B" in lines[0]
    assert f"one request's KV ({64 * row:,} B at 1,024 tokens)" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.integrations.vllm"):
        t = Tiered(str(tmp_path / "b"), chunks=64)
        t.close()
        t = Tiered(str(tmp_path / "c"), chunks=64, tier_extra={"capacity_bytes": 1500})
        t.close()
    lines = [r.getMessage() for r in caplog.records if "less than one" in r.getMessage()]
    assert len(lines) == 1 and "LMDB store (capacity_bytes) holds 1,500 B, less than one " \
        "block across all layers (2,048 B)" in lines[0], lines


def _round_trip(tier, rows, key, fill) -> None:
    rows[1, :] = 0
    rows[1, :len(fill)] = fill
    tier.submit_store(TransferJob(job_id=1, keys=[key], chunk_ids=np.array([1]),
                                  is_promotion=False, req_context=ReqContext(req_id="r")))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    tier.submit_load(TransferJob(job_id=2, keys=[key], chunk_ids=np.array([3]),
                                 is_promotion=True, req_context=ReqContext(req_id="r")))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [True]
    assert np.array_equal(rows[3], rows[1])


def test_a_spec_without_worker_bytes_takes_them_from_the_row(tmp_path):
    """vLLM's own tier tests build specs with worker_kv_bytes_per_block = 0: the tier sizes
    its shards from the primary row the workers registered (split among its slots)."""
    for replicated, mla in ((False, False), (True, False), (False, True)):
        spec = _BareSpec(_config(tp=2, replicated=replicated, worker_bytes=0))
        rows = np.zeros((4, 4096), dtype=np.uint8)
        tier = HiCacheTier(spec, memoryview(rows), "HiCacheTier",
                           store=str(tmp_path / f"l3-{replicated}-{mla}"), mla=mla,
                           weights_signature="w1")
        try:
            assert tier.layout.worker_bytes == (4096 if replicated else 2048)
            key = okey("zero", int(replicated))
            data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
            if mla and not replicated:  # MLA copies are copies
                data[2048:] = data[:2048]
            _round_trip(tier, rows, key, data)
        finally:
            tier.shutdown()


def test_replicated_rows_share_across_tp_sizes_and_split_rows_do_not(tmp_path):
    """vLLM's replicated (single-copy) row holds the same bytes at every TP size: TP is not in
    its namespace, MLA or not; a row of per-worker slots split by heads keeps TP."""
    def ns(tp, replicated, mla):
        spec = _BareSpec(_config(tp=tp, replicated=replicated))
        rows = np.zeros((4, 4096 * 4), dtype=np.uint8)
        tier = HiCacheTier(spec, memoryview(rows), "HiCacheTier",
                           store=str(tmp_path / f"l3-{tp}-{replicated}-{mla}"), mla=mla,
                           weights_signature="w1")
        try:
            return tier.namespace.digest
        finally:
            tier.shutdown()
    assert ns(2, True, False) == ns(4, True, False)
    assert ns(2, True, True) == ns(4, True, True)
    assert ns(2, False, True) == ns(4, False, True)
    assert ns(2, False, False) != ns(4, False, False)
