"""The engine-free parts of the engine adapters: vLLM row shards, engine keys, weights signature."""

import os

import pytest

from hicache.errors import L3Error
from hicache.integrations.common import engine_chain, signature, store_keys, weights_signature
from hicache.integrations.rows import row_layout
from hicache.l3 import Namespace


def test_mla_dcp_row_has_one_slot_per_shard_copy():
    # tp=4, dcp=2: workers 0,2 hold DCP shard 0 and 1,3 hold shard 1 (vLLM's DCP groups are
    # consecutive TP ranks); pp=2 doubles the shards (stage 1 holds other layers).
    lay = row_layout(world_size=8, tp=4, pp=2, pcp=1, dcp=2, mla=True, single_copy=False,
                     worker_bytes=100)
    assert lay.shard_of == (0, 1, 0, 1, 2, 3, 2, 3)
    assert lay.num_shards == 4
    assert lay.slots_of(1) == (1, 3) and lay.slots_of(2) == (4, 6)
    assert lay.span(3) == slice(300, 400) and lay.used_bytes == 800


def test_rows_without_mla_or_with_pcp_keep_every_slot():
    for kw in (dict(mla=False, pcp=1, tp=4), dict(mla=True, pcp=2, tp=2)):
        lay = row_layout(world_size=4, pp=1, dcp=1, single_copy=False, worker_bytes=8, **kw)
        assert lay.shard_of == (0, 1, 2, 3) and lay.num_shards == 4


def test_single_copy_row_and_bad_sizes():
    lay = row_layout(world_size=4, tp=4, pp=1, pcp=1, dcp=1, mla=True, single_copy=True,
                     worker_bytes=8)
    assert lay.shard_of == (0,) and lay.num_shards == 1
    with pytest.raises(L3Error, match="world_size 6"):
        row_layout(world_size=6, tp=4, pp=1, pcp=1, dcp=1, mla=True, single_copy=False,
                   worker_bytes=8)
    with pytest.raises(L3Error, match="not a multiple of dcp"):
        row_layout(world_size=4, tp=4, pp=1, pcp=1, dcp=3, mla=True, single_copy=False,
                   worker_bytes=8)
    with pytest.raises(L3Error, match="single-copy"):
        row_layout(world_size=4, tp=4, pp=1, pcp=1, dcp=2, mla=True, single_copy=True,
                   worker_bytes=8)
    with pytest.raises(L3Error, match="worker_bytes"):
        row_layout(world_size=1, tp=1, pp=1, pcp=1, dcp=1, mla=True, single_copy=False,
                   worker_bytes=0)


def test_engine_keys_are_per_shard_and_per_namespace():
    ns = Namespace(model="m", num_layers=1, kv_dim=8, dtype="uint8", page_size=1, dcp_size=2)
    other = Namespace(model="m2", num_layers=1, kv_dim=8, dtype="uint8", page_size=1, dcp_size=2)
    k0, k1 = store_keys([b"abc"], ns, 0)[0], store_keys(["abc"], ns, 1)[0]
    assert k0[-16:] == k1[-16:] == engine_chain(b"abc") and k0 != k1
    assert store_keys([b"abc"], other, 0)[0] != k0
    assert engine_chain(b"abd") != engine_chain(b"abc")
    with pytest.raises(L3Error, match="engine key"):
        engine_chain(b"")
    assert signature({"b": 1, "a": [2]}) == signature({"a": [2], "b": 1}) == "a=[2],b=1"


def _ckpt(d, seed: int):
    import numpy as np
    from safetensors.numpy import save_file
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"hidden": 8}')
    g = np.random.default_rng(seed)
    save_file({"w": g.standard_normal((300, 250)).astype(np.float32)},
              str(d / "model.safetensors"))
    return str(d)


def test_weights_signature_follows_the_weight_bytes(tmp_path):
    d = tmp_path / "ckpt"
    a = weights_signature(_ckpt(d, 0))
    assert a == weights_signature(str(d))
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-5] ^= 1  # one weight of a sampled chunk: same names and sizes, other bytes
    (d / "model.safetensors").write_bytes(bytes(data))
    assert weights_signature(str(d)) != a
    assert weights_signature(str(d), override="rev-1") == "rev-1"
    assert weights_signature("org/model") == "id:org/model"
    (d / "model.safetensors").unlink()
    with pytest.raises(L3Error, match="cannot sign"):
        weights_signature(str(d))


def test_adapter_stores_take_the_fleet_secret_rule(tmp_path, monkeypatch, redis_url):
    """What both adapters call with their extra config: a Redis store without the fleet secret
    is refused with the policy's one line; the config's secret or ``authenticate: false``."""
    from helpers import secret_file

    from hicache.errors import ConfigError
    from hicache.integrations.common import open_stores, trust_of
    from hicache.l3 import auth
    from hicache.l3.keyed import KeyedStore
    monkeypatch.delenv(auth.ENV, raising=False)
    ns = Namespace(model="m", num_layers=1, kv_dim=8, dtype="uint8", page_size=1, dcp_size=2)
    with pytest.raises(ConfigError, match="secret_file: the redis backend is shared"):
        open_stores(redis_url, ns, [0, 1], trust=trust_of({"store": redis_url}))
    sec = secret_file(tmp_path)
    stores = open_stores(redis_url, ns, [0, 1], trust=trust_of({"secret_file": sec}))
    assert all(isinstance(s, KeyedStore) for s in stores.values())
    for s in stores.values():
        s.close()
    stores = open_stores(redis_url, ns, [0, 1], trust=trust_of({"authenticate": False}))
    assert not any(isinstance(s, KeyedStore) for s in stores.values())
    for s in stores.values():
        s.close()
    assert trust_of(None) == auth.Trust()
    with pytest.raises(ConfigError, match="authenticate: must be true or false"):
        trust_of({"authenticate": "false"})


def test_namespaces_name_local_weights_by_content_not_path(tmp_path):
    """Both adapters' namespace fields: the same weights at another path are the same fields
    (pages shared across nodes mounting them elsewhere); other weights never; a hub id or an
    explicit signature keeps the model name beside it."""
    import shutil

    from hicache.integrations.common import weights_fields
    a = _ckpt(tmp_path / "node-a" / "models" / "m", 1)
    b = shutil.copytree(a, tmp_path / "node-b" / "mnt" / "weights")
    other = _ckpt(tmp_path / "node-a" / "models" / "tuned", 2)
    fa, fb = weights_fields(a), weights_fields(str(b))
    assert fa == fb and set(fa) == {"weights"} and str(tmp_path) not in signature(fa)
    assert weights_fields(other) != fa
    assert weights_fields("org/model") == {"model": "org/model", "weights": "id:org/model"}
    assert weights_fields(a, "rev-1") == {"model": a, "weights": "rev-1"}


def test_a_tier_too_small_for_its_job_is_one_line_naming_the_sizes():
    from hicache.integrations.common import undersized
    line = undersized("CPU tier", 4 * 4096, 4096, 64 * 4096, 1024)
    assert line.count("\n") == 0 and "holds 16,384 B" in line
    assert "one request's KV (262,144 B at 1,024 tokens)" in line
    assert "less than one block across all layers (4,096 B)" in undersized("t", 100, 4096)
    assert undersized("t", 64 * 4096, 4096, 64 * 4096, 1024) is None
    assert undersized("t", 4096, 4096) is None  # max_model_len unknown: only the block rule
