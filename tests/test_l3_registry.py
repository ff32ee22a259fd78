"""L3 backends as a registry: the shared store contract on every registered backend (a dummy
in-memory one included, registered by importing its one module), ``[l3.<backend>]`` policy
tables validated like every key, the old flat keys read with one deprecation line, and no
backend imported until used (a fresh interpreter where ``import lmdb`` / ``import redis``
fail runs an L1+L2 cache)."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import l3_mem_backend  # registers the "mem" backend: the one module it takes
from hicache.config import HiCacheConfig, describe, loads
from hicache.errors import ConfigError, L3Error
from hicache.l3 import Namespace, open_store, page_keys, registry
from hicache.l3.guard import GuardedStore

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=4, dcp_size=2)
PT = NS.page_tokens
BACKENDS = registry.names()  # the built-ins and "mem", registered by importing its module
registry.unregister("mem")  # registered only while this module's tests run (below)


@pytest.fixture(autouse=True, scope="module")
def mem_registered():
    """The dummy backend is registered for this module's tests only: other tests in the same
    process see the built-in registry."""
    registry.register(l3_mem_backend.BACKEND, replace=True)
    yield
    registry.unregister("mem")


def shard(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NS.shard_shape, generator=g).to(NS.torch_dtype)


def empty(n: int) -> list:
    return [torch.full(NS.shard_shape, 7.0, dtype=NS.torch_dtype) for _ in range(n)]


def keys_of(n_pages: int, start: int = 0, rank: int = 0) -> list:
    return page_keys(list(range(start, start + n_pages * PT)), PT, NS, rank)


@pytest.fixture(params=BACKENDS)
def made(request, tmp_path):
    """(backend, fixture, open) for every registered backend."""
    b = registry.get(request.param)
    with b.fixture(str(tmp_path)) as fx:
        section = b.section(**fx.keys)
        opened = []

        def open_(rank=0, writer=True):
            s = b.open(section, NS, rank, writer=writer)
            opened.append(s)
            return s

        yield b, fx, open_
        for s in opened:
            s.close()


def test_the_dummy_backend_is_registered_by_its_module_alone():
    assert "mem" in registry.names() and {"lmdb", "redis"} <= set(registry.names())
    assert registry.get("mem").section.__module__ == "l3_mem_backend"


# ---- the store contract, on every registered backend -----------------------------------------
def test_contract_put_get_exists_prefix(made):
    b, fx, open_ = made
    s = open_()
    k = keys_of(5)
    assert s.exists_prefix(k) == 0
    res = s.put(k[:3], [shard(i) for i in range(3)])
    assert res.stored == (True, True, True) and res.written == 3
    again = s.put(k[:4], [shard(i) for i in range(4)])  # per-key status: 3 held, 1 new
    assert again.stored == (True,) * 4 and again.written == 1
    assert s.exists_prefix(k) == 4
    out = empty(5)
    assert s.get(k, out) == 4  # a prefix: stops at the first absent page
    for i in range(4):
        assert torch.equal(out[i], shard(i))
    assert torch.equal(out[4], empty(1)[0])  # never written past what it served
    st = s.stats
    assert st.hits == 4 and st.misses == 1 and st.pages_written == 4 and st.pages_skipped == 3
    assert st.bytes_read == 4 * NS.shard_bytes and st.corrupt == 0


def test_contract_get_into_a_callable_and_other_ranks_are_apart(made):
    b, fx, open_ = made
    s0, s1 = open_(0), open_(1)
    s0.put(keys_of(2), [shard(0), shard(1)])
    assert s1.exists_prefix(keys_of(2, rank=1)) == 0
    buf = torch.zeros((2, *NS.shard_shape), dtype=NS.torch_dtype)
    assert s0.get(keys_of(2), lambda i: buf[i]) == 2
    assert torch.equal(buf[1], shard(1))
    with pytest.raises(L3Error, match="another namespace or rank"):
        s0.get(keys_of(1, rank=1), empty(1))


def test_contract_delete_and_close(made):
    b, fx, open_ = made
    s = open_()
    k = keys_of(3)
    s.put(k, [shard(i) for i in range(3)])
    assert s.delete(k[1:2]) == 1 and s.delete(k[1:2]) == 0
    assert s.exists_prefix(k) == 1
    s.close()
    s.close()  # idempotent
    with pytest.raises(L3Error, match="closed"):
        s.exists_prefix(k)


def test_contract_a_corrupt_value_is_a_counted_miss_never_served(made):
    b, fx, open_ = made
    s = open_()
    k = keys_of(3)
    s.put(k, [shard(i) for i in range(3)])
    fx.tamper(s, k[1])
    out = empty(3)
    assert s.get(k, out) == 1
    assert torch.equal(out[1], empty(1)[0])
    assert s.stats.corrupt == 1 and s.stats.misses == 1
    assert s.exists_prefix(k) == 1  # the writer deleted it
    assert s.put(k[1:2], [shard(1)]).written == 1  # and the next put stores it again
    assert s.get(k, empty(3)) == 3


def test_contract_a_reader_cannot_write(made):
    b, fx, open_ = made
    open_().put(keys_of(1), [shard(0)])
    r = open_(writer=False)
    assert r.exists_prefix(keys_of(1)) == 1
    with pytest.raises(L3Error, match="writer"):
        r.put(keys_of(1), [shard(0)])


# ---- the policy file ---------------------------------------------------------------------------
def test_backend_tables_are_validated_like_every_key():
    cfg = loads('[l3]\nenabled = true\nbackend = "mem"\n[l3.mem]\nname = "x"\nmax_pages = 9\n')
    assert cfg.l3.options == l3_mem_backend.MemSection("x", 9) and cfg.l3.max_pages == 9
    assert HiCacheConfig.from_dict(cfg.to_dict()) == cfg
    for text, words in [
        ('[l3]\nbackend = "mem"\n[l3.mem]\nnmae = "x"', "l3.mem.nmae: unknown key .*'name'"),
        ('[l3]\nbackend = "mem"\n[l3.mem]\nmax_pages = 0', r"l3.mem.max_pages: 0 is out of range"),
        ('[l3]\nbackend = "mem"\n[l3.mem]\nname = 3', "l3.mem.name: expected str"),
        ('[l3]\nbackend = "nosuch"', "l3.backend: 'nosuch' is not one of 'lmdb', 'redis'"),
        ('[l3.nosuch]\nx = 1', "l3.nosuch: unknown backend table"),
        ('[l3.lmdb]\nsize_bytes = 5', r"l3.lmdb.size_bytes: 5 is out of range"),
        ('[l3.redis]\nurl = "http://x:1"', "l3.redis.url: bad Redis URL .*scheme"),
        ('[l3]\nbackend = "redis"', "l3.redis.url: the redis backend needs a url"),
        ('[l3]\nbogus = 1', "l3.bogus: unknown key"),
    ]:
        with pytest.raises(ConfigError, match=words) as e:
            loads(text)
        assert "\n" not in str(e.value)


def test_the_selected_backends_preflight_runs(tmp_path):
    from hicache.preflight import Machine, validate
    machine = Machine(cuda=False, host_available=64 << 30)
    cfg = loads('[l3]\nenabled = true\nbackend = "mem"\n[l3.mem]\nname = "forbidden"\n')
    with pytest.raises(ConfigError, match="l3.mem.name: 'forbidden'"):
        validate(cfg, machine=machine)
    cfg = loads(f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/f"\nsize_bytes = 1048576\n'
                '[model]\nnum_layers = 64\nkv_lora_rank = 4096\n')
    with pytest.raises(ConfigError, match="l3.lmdb.size_bytes: 1048576 is smaller than one page"):
        validate(cfg, machine=machine)


def test_old_flat_keys_are_read_with_one_deprecation_line(tmp_path):
    with pytest.warns(FutureWarning) as rec:
        cfg = loads(f'[l3]\nenabled = true\npath = "{tmp_path}/s"\nsize_bytes = 2097152\n')
    (w,) = rec
    msg = str(w.message)
    assert "\n" not in msg and "l3.lmdb.path" in msg and "l3.lmdb.size_bytes" in msg
    assert cfg.l3.options.path == f"{tmp_path}/s" and cfg.l3.size_bytes == 2097152
    with pytest.warns(FutureWarning, match="l3.redis.url"):
        red = loads('[l3]\nbackend = "redis"\nurl = "redis://h:1/0"\ntimeout_s = 3\n')
    assert red.l3.options.url == "redis://h:1/0" and red.l3.timeout_s == 3
    with warnings.catch_warnings():  # the new layout, and replace() with flat keys, say nothing
        warnings.simplefilter("error")
        again = loads(f'[l3]\nenabled = true\n[l3.lmdb]\npath = "{tmp_path}/s"\n'
                      'size_bytes = 2097152\n')
        assert again == cfg
        assert cfg.replace(l3={"path": "/x"}).l3.path == "/x"
        r = cfg.replace(l3={"backend": "mem", "name": "y"})
        assert r.l3.options.name == "y" and r.l3.stores  # the lmdb table is kept beside it
        assert HiCacheConfig.from_dict(r.to_dict()) == r


def test_describe_lists_every_registered_backends_keys():
    keys = [k for k, _, _ in describe()]
    assert {"l3.lmdb.path", "l3.redis.url", "l3.mem.max_pages", "l3.backend"} <= set(keys)
    assert "l3.path" not in keys and "l3.stores" not in keys


# ---- the guard and open_store know no backend -------------------------------------------------
def test_open_store_and_the_guard_on_the_dummy_backend():
    cfg = loads('[l3]\nenabled = true\nbackend = "mem"\n[l3.mem]\nname = "g"\n')
    s = open_store(cfg.l3, NS, 0)
    assert isinstance(s, l3_mem_backend.MemStore)
    assert isinstance(open_store("mem:g", NS, 1), l3_mem_backend.MemStore)
    g = GuardedStore(lambda: s, cfg.l3, 0, NS)
    assert g.where == "mem:g" and not g.failed
    g.put(keys_of(1), [shard(0)])
    assert g.exists_prefix(keys_of(1)) == 1

    def broken():
        raise OSError("the dict fell over")
    bad = GuardedStore(broken, cfg.l3, 0, NS)
    assert bad.failed and "fell over" in bad.failure and bad.failure_kind == "other"
    assert bad.get(keys_of(1), empty(1)) == 0
    g.close()


def test_redis_errors_mean_what_they_say():
    redis = pytest.importorskip("redis")
    c = registry.get("redis").classify
    assert c(redis.exceptions.TimeoutError("Timeout reading from socket")) == "timeout"
    assert c(redis.exceptions.ConnectionError("Error 111 connecting to h:1. Connection "
                                              "refused.")) == "refused"
    assert c(redis.exceptions.AuthenticationError("invalid username-password pair")) == "auth"
    assert c(redis.exceptions.ResponseError("NOPERM this user has no permissions")) == "auth"
    assert c(redis.exceptions.ConnectionError("SSL: WRONG_VERSION_NUMBER")) == "tls"
    assert c(redis.exceptions.ResponseError("OOM command not allowed")) == "full"
    lm = registry.get("lmdb").classify
    import lmdb
    assert lm(lmdb.CorruptedError("x")) == "corrupt" and lm(lmdb.DiskError("x")) == "full"


# ---- no backend is imported until used ---------------------------------------------------------
BLOCKED = textwrap.dedent("""
    import sys
    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lmdb", "redis", "hiredis"):
                raise ImportError(f"{name} is not installed on this machine")
            return None
    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, TESTS)
    import numpy as np, torch
    import hicache.service
    from hicache.config import HiCacheConfig
    from hicache.engine.model import MLAModel
    from hicache.serving import Server, model_config
    from hicache.workloads import Request
    from helpers import tiny_sections
    cfg = HiCacheConfig.from_dict(tiny_sections(l2_ratio=2.0, l1_pages=12))
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 128, 40)
    jobs = [Request(i, 0, np.concatenate([shared, rng.integers(0, 128, 3)]), 2, i)
            for i in range(4)]
    torch.manual_seed(0)
    with hicache.service.HiCache(cfg, 0, None, mode="l1+l2") as cache:
        res = Server(MLAModel(model_config(cfg)), cache, chunk_tokens=16,
                     max_running=1).run(jobs)
    hits = sum(r.hit["l1"] + r.hit["l2"] for r in res)
    assert hits >= 40, hits
    loaded = sorted(m for m in sys.modules if m.startswith(("lmdb", "redis", "hicache.l3.store",
        "hicache.l3.redis", "hicache.l3.lmdb")))
    print("OK", hits, loaded)
""")


def test_an_l1_l2_cache_runs_where_lmdb_and_redis_cannot_be_imported():
    import os
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + BLOCKED],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].endswith("[]"), r.stdout
