"""hicache's L3 as an SGLang 0.5.23 HiCache storage backend: created by SGLang's real ``dynamic``
factory path, registered with SGLang's real MLA host pools (CPU), for each host layout, both DCP
ranks, on LMDB and on a real Redis server."""

import inspect
import textwrap

import pytest
import torch
from engine_helpers import damage  # noqa: I001  first: before SGLang (see engine_helpers)

import sglang.srt.managers.cache_controller as cc
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

from hicache.errors import L3Error
from hicache.integrations.sglang import LAYOUTS, UPSTREAM_DCP_CHECK, HiCacheL3Storage, page_view

LAYERS, LORA, ROPE = 3, 16, 8
P = 4  # physical rows per page on each rank


def host_pool(layout: str, dcp: int = 1, rank: int = 0, pages: int = 8):
    """SGLang's MLA host pool over CPU 'device' buffers (the assembler's real constructor)."""
    width = LORA + ROPE
    dev_tokens = pages * P
    bufs = tuple(torch.zeros(dev_tokens, 1, width, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=P * dcp,
        kv_lora_rank=LORA, qk_rope_head_dim=ROPE, kv_cache_dim=width, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    return MLATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=P * dcp, layout=layout,
        pin_memory=False, device="cpu", dcp_size=dcp, dcp_rank=rank,
        device_capacity_tokens=dev_tokens, start_layer=0, end_layer=LAYERS,
        target_layer_num=LAYERS, host_token_capacity=pages * P)


def storage_config(where, *, tp=1, tp_rank=0, dcp=1, model="org/tiny-mla", **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=model, dcp_size=dcp, dcp_rank=tp_rank % dcp,
        logical_page_size=P * dcp if dcp > 1 else None,
        extra_config={"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                      "class_name": "HiCacheL3Storage", "interface_v1": 1, "store": where,
                      "weights_signature": "w1", "timeout_s": 5.0, **extra})


def backend(where, pool, **kw):
    """SGLang's own path: StorageBackendFactory.create_backend('dynamic', ...), then register."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(where, **kw), pool)
    assert isinstance(b, HiCacheL3Storage)
    b.register_mem_pool_host(pool)
    return b


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.dtype))


def indices(pool, pages) -> torch.Tensor:
    """Host indices of logical pages (what SGLang's controller passes: logical token slots)."""
    lp = pool.page_size * pool.dcp_size
    return torch.cat([torch.arange(p * lp, (p + 1) * lp) for p in pages])


def pages_of(pool, pages) -> list:
    lp = pool.page_size * pool.dcp_size
    return [page_view(pool, p * lp).clone() for p in pages]


HASHES = [f"{i:064x}" for i in range(1, 5)]  # SGLang page hashes (hex strings)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_the_dynamic_factory(where, layout):
    src, dst = host_pool(layout), host_pool(layout)
    fill(src, 1)
    b = backend(where, src)
    assert b.batch_exists(HASHES) == 0
    assert b.batch_set_v1(HASHES, indices(src, [0, 1, 2, 3])) == [True] * 4
    assert b.batch_exists(HASHES) == 4 and b.exists(HASHES[2])
    r = backend(where, dst)
    assert r.batch_get_v1(HASHES, indices(dst, [4, 5, 6, 7])) == [True] * 4
    for a, c in zip(pages_of(src, [0, 1, 2, 3]), pages_of(dst, [4, 5, 6, 7])):
        assert torch.equal(a, c)
    b.close()
    r.close()


def test_layouts_share_one_store(tmp_path):
    where = str(tmp_path / "l3")
    src, dst = host_pool("layer_first"), host_pool("page_first")
    fill(src, 2)
    b = backend(where, src)
    b.batch_set_v1(HASHES[:2], indices(src, [1, 2]))
    r = backend(where, dst)
    assert r.batch_get_v1(HASHES[:2], indices(dst, [0, 3])) == [True, True]
    assert torch.equal(pages_of(src, [1, 2])[1], pages_of(dst, [0, 3])[1])
    b.close()
    r.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generic_path_with_flat_pages(tmp_path, layout):
    """SGLang's generic page path (no interface_v1): flat pages in the pool's own order."""
    src, dst = host_pool(layout), host_pool(layout)
    fill(src, 3)
    b = backend(str(tmp_path / "l3"), src)
    lp = src.page_size
    assert b.batch_set(HASHES[:3], [src.get_data_page(p * lp) for p in (0, 1, 2)])
    got = b.batch_get(HASHES, [dst.get_dummy_flat_data_page() for _ in HASHES])
    assert got[3] is None and all(g is not None for g in got[:3])
    for i, page in enumerate(got[:3]):
        dst.set_from_flat_data_page((5 + i) * lp, page)
    assert all(torch.equal(a, c) for a, c in
               zip(pages_of(src, [0, 1, 2]), pages_of(dst, [5, 6, 7])))
    assert b.get(HASHES[3], dst.get_dummy_flat_data_page()) is None
    b.close()


def test_reads_answer_per_key(where):
    """SGLang's interface answers per key: a missing page fails only itself (its own file
    backend reads every key), the pages after it are served; nothing else is written."""
    src, dst = host_pool("page_first"), host_pool("page_first")
    fill(src, 4)
    b = backend(where, src)
    b.batch_set_v1(HASHES, indices(src, [0, 1, 2, 3]))
    assert b.store.delete(b._keys(HASHES[1:2])) == 1
    r = backend(where, dst)
    assert r.batch_exists(HASHES) == 1  # batch_exists counts the leading pages held
    fill(dst, 40)
    before = pages_of(dst, [1])[0]
    assert r.batch_get_v1(HASHES, indices(dst, [0, 1, 2, 3])) == [True, False, True, True]
    for p in (0, 2, 3):
        assert torch.equal(pages_of(dst, [p])[0], pages_of(src, [p])[0])
    assert torch.equal(pages_of(dst, [1])[0], before)  # untouched
    b.close()
    r.close()


def test_generic_reads_answer_per_key(tmp_path):
    src, dst = host_pool("layer_first"), host_pool("layer_first")
    fill(src, 7)
    b = backend(str(tmp_path / "l3"), src)
    lp = src.page_size
    assert b.batch_set([HASHES[0], HASHES[2]], [src.get_data_page(p * lp) for p in (0, 2)])
    got = b.batch_get(HASHES[:3], [dst.get_dummy_flat_data_page() for _ in range(3)])
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert torch.equal(got[2], src.get_data_page(2 * lp))
    b.close()


def test_corrupt_value_is_a_miss(where):
    src, dst = host_pool("layer_first"), host_pool("layer_first")
    fill(src, 5)
    b = backend(where, src)
    b.batch_set_v1(HASHES[:3], indices(src, [0, 1, 2]))
    damage(b.store, b._keys(HASHES[1:2])[0])
    r = backend(where, dst)
    fill(dst, 50)
    before = pages_of(dst, [1])[0]
    assert r.batch_get_v1(HASHES[:3], indices(dst, [0, 1, 2])) == [True, False, True]
    assert torch.equal(pages_of(dst, [0])[0], pages_of(src, [0])[0])
    assert torch.equal(pages_of(dst, [2])[0], pages_of(src, [2])[0])
    assert torch.equal(pages_of(dst, [1])[0], before)  # the bad bytes never reached the pool
    assert r.store.stats.corrupt == 1
    assert r.batch_exists(HASHES[:3]) == 1  # deleted: later lookups stop before it
    st = r.get_stats()
    assert st.hicache.errors == {"corrupt": 1}
    assert st.hicache.hits == 2 and st.hicache.misses == 1
    b.close()
    r.close()


def test_other_weights_or_model_never_hit(tmp_path):
    where = str(tmp_path / "l3")
    src = host_pool("page_first")
    fill(src, 6)
    b = backend(where, src)
    b.batch_set_v1(HASHES[:2], indices(src, [0, 1]))
    other_w = StorageBackendFactory.create_backend(
        "dynamic", storage_config(where, weights_signature="w2"), src)
    other_w.register_mem_pool_host(src)
    other_m = backend(where, src, model="org/other-mla")
    assert other_w.batch_exists(HASHES[:2]) == 0 and other_m.batch_exists(HASHES[:2]) == 0
    for x in (b, other_w, other_m):
        x.close()


def test_dcp2_both_ranks_keep_their_own_shards(where):
    """DCP 2 (tp 4): each DCP rank stores and reads its own rows of the widened page under its
    own keys; SGLang's writer pick (first DCP group) is its own, and any replica may write."""
    pools = {r: host_pool("page_first", dcp=2, rank=r % 2) for r in range(4)}
    for r in (0, 1):
        fill(pools[r], 10 + r)
    bs = {r: backend(where, pools[r], tp=4, tp_rank=r, dcp=2) for r in range(4)}
    assert [bs[r].writer for r in range(4)] == [True, True, False, False]
    for r in (0, 1):
        assert bs[r].batch_set_v1(HASHES, indices(pools[r], [0, 1, 2, 3])) == [True] * 4
    # the other replica of DCP rank 0 holds the same rows: its pages are already stored
    fill(pools[2], 10)
    assert bs[2].batch_set_v1(HASHES, indices(pools[2], [0, 1, 2, 3])) == [True] * 4
    assert bs[2].store.stats.pages_written == 0
    assert bs[0]._keys(HASHES)[0] != bs[1]._keys(HASHES)[0]  # per-rank keys
    for r in (2, 3):  # replicas of DCP ranks 0 and 1 restore their own shard
        dst = pools[r]
        fill(dst, 99)
        assert bs[r].batch_get_v1(HASHES, indices(dst, [4, 5, 6, 7])) == [True] * 4
        src = pools[r - 2]
        assert all(torch.equal(a, c) for a, c in
                   zip(pages_of(src, [0, 1, 2, 3]), pages_of(dst, [4, 5, 6, 7])))
    # rank 1's shard of page 2 vanishes: rank 1 stops there, rank 0 does not
    bs[1].store.delete(bs[1]._keys(HASHES[2:3]))
    assert bs[3].batch_exists(HASHES) == 2 and bs[2].batch_exists(HASHES) == 4
    for b in bs.values():
        b.close()


def test_upstream_dcp_check_is_the_one_line_the_readme_names(monkeypatch):
    """SGLang 0.5.23 refuses dynamic backends under DCP in attach_storage_backend, on exactly
    the line UPSTREAM_DCP_CHECK names; lifting it (monkeypatch, this test only) with the
    README's change leaves dynamic backends through. Past the check, attach calls the factory
    as test_dcp2_both_ranks_keep_their_own_shards does."""
    src = textwrap.dedent(inspect.getsource(HiCacheController.attach_storage_backend))
    old, new = UPSTREAM_DCP_CHECK
    assert src.count(old) == 1
    consts = HiCacheController.attach_storage_backend.__code__.co_consts
    assert ("file", "mooncake") in consts
    ns: dict = {}
    exec(compile(src.replace(old, new), cc.__file__, "exec"), cc.__dict__, ns)
    monkeypatch.setattr(HiCacheController, "attach_storage_backend",
                        ns["attach_storage_backend"])
    consts = HiCacheController.attach_storage_backend.__code__.co_consts
    assert ("file", "mooncake", "dynamic") in consts and ("file", "mooncake") not in consts


def test_bad_set_up_is_refused(tmp_path):
    cfg = storage_config(str(tmp_path / "l3"))
    cfg.extra_config.pop("store")
    with pytest.raises(L3Error, match="needs 'store'"):
        HiCacheL3Storage(cfg)
    b = HiCacheL3Storage(storage_config(str(tmp_path / "l3")))
    with pytest.raises(L3Error, match="register_mem_pool_host"):
        b.batch_exists(HASHES)
    with pytest.raises(L3Error, match="DCP"):
        b.register_mem_pool_host(host_pool("page_first", dcp=2, rank=1))


# ---- the contracts SGLang's own storage-backend test encodes (issue 28, point 7) ---------------
def test_any_mla_rank_may_write(where):
    """A rank that is not SGLang's designated writer stores too (SGLang's test writes from any
    MLA rank; its file backend does), and the writer reads it back."""
    src, dst = host_pool("page_first"), host_pool("page_first")
    fill(src, 8)
    other = backend(where, src, tp=2, tp_rank=1)
    assert not other.writer
    assert other.batch_set_v1(HASHES, indices(src, [0, 1, 2, 3])) == [True] * 4
    assert other.store.stats.pages_written == 4
    assert other.batch_set(HASHES[:1], [src.get_data_page(0)])  # generic path too
    w = backend(where, dst, tp=2, tp_rank=0)
    assert w.batch_get_v1(HASHES, indices(dst, [4, 5, 6, 7])) == [True] * 4
    assert all(torch.equal(a, c) for a, c in
               zip(pages_of(src, [0, 1, 2, 3]), pages_of(dst, [4, 5, 6, 7])))
    other.close()
    w.close()


def test_clear_deletes_this_namespace_only(where):
    src = host_pool("page_first")
    fill(src, 9)
    b = backend(where, src)
    keep = backend(where, src, model="org/other-mla")
    b.batch_set_v1(HASHES, indices(src, [0, 1, 2, 3]))
    keep.batch_set_v1(HASHES[:2], indices(src, [0, 1]))
    assert b.batch_exists(HASHES) == 4
    b.clear()
    assert b.batch_exists(HASHES) == 0 and not any(b.batch_get_v1(
        HASHES, indices(src, [4, 5, 6, 7])))
    assert keep.batch_exists(HASHES[:2]) == 2  # another model's pages stay
    b.close()
    keep.close()


def test_get_stats_is_sglangs_storage_metrics_with_l3_health(where):
    from prometheus_client import REGISTRY
    from sglang.srt.observability.metrics_collector import StorageMetrics
    src, dst = host_pool("page_first"), host_pool("page_first")
    fill(src, 11)
    b = backend(where, src, model="org/stats-mla")
    b.batch_set_v1(HASHES[:3], indices(src, [0, 1, 2]))
    st = b.get_stats()
    assert isinstance(st, StorageMetrics) and st.backup_pgs == [3] and st.prefetch_pgs == []
    assert st.hicache.pages_written == 3 and st.hicache.bytes_written > 0
    assert b.batch_get_v1(HASHES, indices(dst, [4, 5, 6, 7])) == [True] * 3 + [False]
    st = b.get_stats()
    assert st.prefetch_pgs == [4] and len(st.prefetch_bandwidth) == 1
    assert st.hicache.hits == 3 and st.hicache.misses == 1
    assert st.hicache.bytes_read == 3 * b.store.page_bytes
    labels = {"model_name": "org/stats-mla", "tp_rank": "0", "dcp_rank": "0"}
    assert REGISTRY.get_sample_value("hicache_l3_hits_total", labels) >= 3
    assert REGISTRY.get_sample_value("hicache_l3_misses_total", labels) >= 1
    b.close()


def test_redis_outage_counts_refused(redis_factory):
    from prometheus_client import REGISTRY
    srv = redis_factory(unix=True, maxmemory=64 << 20)
    src = host_pool("page_first")
    fill(src, 12)
    b = backend(srv.url, src, model="org/outage-mla", timeout_s=0.5)
    b.batch_set_v1(HASHES[:2], indices(src, [0, 1]))
    b.get_stats()
    srv.stop()
    assert b.batch_get_v1(HASHES[:2], indices(src, [4, 5])) == [False, False]
    st = b.get_stats()
    assert st.hicache.errors == {"refused": 1} and st.hicache.misses == 2
    labels = {"model_name": "org/outage-mla", "tp_rank": "0", "dcp_rank": "0",
              "reason": "refused"}
    assert REGISTRY.get_sample_value("hicache_l3_errors_total", labels) == 1
    b.close()


# ---- point 4: the namespace names what changes the bytes -------------------------------------
@pytest.mark.parametrize("field,a,b,same", [
    ("quantization", None, "fp8", False), ("quantization", "fp8", "awq", False),
    ("revision", "main", "v2", False),
    ("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2", False),
    ("kv_cache_dtype", "fp8", "fp8_e4m3", True),
    ("kv_cache_dtype", "auto", None, True),
])
def test_namespace_field(tmp_path, field, a, b, same):
    """Two deployments differing only in ``field`` share pages exactly when the bytes are the
    same (fp8 is e4m3 in both engines; e4m3 and e5m2 have one size and other bytes)."""
    where = str(tmp_path / "l3")
    src = host_pool("page_first")
    fill(src, 13)
    w = backend(where, src, **{field: a})
    w.batch_set_v1(HASHES[:2], indices(src, [0, 1]))
    r = backend(where, host_pool("page_first"), **{field: b})
    assert r.batch_exists(HASHES[:2]) == (2 if same else 0)
    w.close()
    r.close()


def test_tp_size_is_not_in_an_mla_namespace(tmp_path):
    """An MLA latent is replicated over TP: TP=2 and TP=4 deployments share pages."""
    where = str(tmp_path / "l3")
    src = host_pool("page_first")
    fill(src, 14)
    w = backend(where, src, tp=2)
    w.batch_set_v1(HASHES[:2], indices(src, [0, 1]))
    r = backend(where, host_pool("page_first"), tp=4)
    assert r.batch_exists(HASHES[:2]) == 2
    w.close()
    r.close()


def test_a_shared_store_takes_the_fleet_secret_rule(redis_url, monkeypatch, fleet_secret,
                                                    caplog):
    """SGLang's backend refuses a Redis store without the fleet secret with the policy's one
    line; the extra config's ``secret_file`` or the environment gives it; ``authenticate:
    false`` runs unauthenticated with one warning line; a bad key is refused at once."""
    import logging

    from hicache.errors import ConfigError
    from hicache.l3 import auth
    from hicache.l3.keyed import KeyedStore
    monkeypatch.delenv(auth.ENV)
    monkeypatch.setattr(auth, "_WARNED", set())
    src = host_pool("page_first")
    fill(src, 21)
    with pytest.raises(ConfigError, match="secret_file: the redis backend is shared .*set "
                                          "authenticate = false"):
        backend(redis_url, src)
    b = backend(redis_url, src, secret_file=fleet_secret)
    assert isinstance(b.store, KeyedStore)
    assert b.batch_set_v1(HASHES[:2], indices(src, [0, 1])) == [True] * 2
    with caplog.at_level(logging.WARNING, logger="hicache"):
        u = backend(redis_url, src, authenticate=False)
    assert not isinstance(u.store, KeyedStore) and u.batch_exists(HASHES[:2]) == 0
    assert len([r for r in caplog.records if "without a fleet secret" in r.getMessage()]) == 1
    with pytest.raises(ConfigError, match="authenticate: must be true or false"):
        backend(redis_url, src, authenticate="no")
    b.close()
    u.close()


def test_weights_are_named_by_content_not_path(tmp_path):
    """The same weights at another path share pages; other weights never (no
    weights_signature given: the local checkpoint is signed by content)."""
    import shutil

    from test_vllm_tier import tiny_checkpoint
    where = str(tmp_path / "l3")
    a = tiny_checkpoint(tmp_path / "node-a" / "m", 0)
    b = shutil.copytree(a, tmp_path / "node-b" / "weights")
    other = tiny_checkpoint(tmp_path / "node-a" / "tuned", 1)
    src = host_pool("page_first")
    fill(src, 31)
    w = backend(where, src, model=a, weights_signature=None)
    assert w.batch_set_v1(HASHES[:2], indices(src, [0, 1])) == [True] * 2
    r = backend(where, host_pool("page_first"), model=str(b), weights_signature=None)
    o = backend(where, host_pool("page_first"), model=other, weights_signature=None)
    assert r.batch_exists(HASHES[:2]) == 2 and o.batch_exists(HASHES[:2]) == 0
    for x in (w, r, o):
        x.close()
