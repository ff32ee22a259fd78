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


def test_read_stops_at_the_first_missing_page(where):
    src, dst = host_pool("page_first"), host_pool("page_first")
    fill(src, 4)
    b = backend(where, src)
    b.batch_set_v1(HASHES, indices(src, [0, 1, 2, 3]))
    assert b.store.delete(b._keys(HASHES[1:2])) == 1
    r = backend(where, dst)
    assert r.batch_exists(HASHES) == 1
    fill(dst, 40)
    before = pages_of(dst, [1, 2, 3])
    assert r.batch_get_v1(HASHES, indices(dst, [0, 1, 2, 3])) == [True, False, False, False]
    assert torch.equal(pages_of(dst, [0])[0], pages_of(src, [0])[0])
    assert all(torch.equal(x, y) for x, y in zip(before, pages_of(dst, [1, 2, 3])))  # untouched
    b.close()
    r.close()


def test_corrupt_value_is_a_miss(where):
    src, dst = host_pool("layer_first"), host_pool("layer_first")
    fill(src, 5)
    b = backend(where, src)
    b.batch_set_v1(HASHES[:3], indices(src, [0, 1, 2]))
    damage(b.store, b._keys(HASHES[1:2])[0])
    r = backend(where, dst)
    fill(dst, 50)
    before = pages_of(dst, [1])[0]
    assert r.batch_get_v1(HASHES[:3], indices(dst, [0, 1, 2])) == [True, False, False]
    assert torch.equal(pages_of(dst, [0])[0], pages_of(src, [0])[0])
    assert torch.equal(pages_of(dst, [1])[0], before)  # the bad bytes never reached the pool
    assert r.store.stats.corrupt == 1
    assert r.batch_exists(HASHES[:3]) == 1  # deleted: later lookups stop before it
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
    own keys; the writer is SGLang's pick (first DCP group), the other replica only reads."""
    pools = {r: host_pool("page_first", dcp=2, rank=r % 2) for r in range(4)}
    for r in (0, 1):
        fill(pools[r], 10 + r)
    bs = {r: backend(where, pools[r], tp=4, tp_rank=r, dcp=2) for r in range(4)}
    assert [bs[r].writer for r in range(4)] == [True, True, False, False]
    for r in (0, 1):
        assert bs[r].batch_set_v1(HASHES, indices(pools[r], [0, 1, 2, 3])) == [True] * 4
    # the non-writer replica of DCP rank 0 writes nothing, reads what rank 0 wrote
    assert bs[2].batch_set_v1(HASHES, indices(pools[2], [0, 1, 2, 3])) == [False] * 4
    assert bs[2].store.stats.pages_written == 0
    assert bs[0]._keys(HASHES)[0] != bs[1]._keys(HASHES)[0]  # per-rank keys
    for r in (2, 3):  # replicas of DCP ranks 0 and 1 restore their own shard
        dst = pools[r]
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
