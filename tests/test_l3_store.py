"""L3 stores: round trip, integrity, namespaces, restart, capacity, on LMDB and on a real
Redis-protocol server (valkey-server started by the test, by PID; no mocks)."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import zlib

import lmdb
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.l3.auth import Trust
from hicache.errors import L3Error
from hicache.l3 import (FORMAT_VERSION, L3Store, Namespace, PageStore, RedisStore, open_store,
                        page_keys, replica_of, should_write, store_replica)

NS = Namespace("m", num_layers=2, kv_dim=8, dtype="bfloat16", page_size=4, dcp_size=2)
PT = NS.page_tokens  # 8
PAGE = NS.shard_bytes  # 128
SLOT = PAGE + 128  # a page's footprint including its header, rounded up


def footprint(tmp_path) -> int:
    """Bytes one page takes in the store's accounting (data + fixed-size header)."""
    with PageStore(tmp_path / "probe", NS, 0, capacity_bytes=10 * SLOT) as s:
        s.put(page_keys(tokens(1), PT, NS, 0), [shard(0)])
        return s.used_bytes()


def shard(seed: int, ns: Namespace = NS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ns.shard_shape, generator=g).to(ns.torch_dtype)


def empty(n: int, ns: Namespace = NS) -> list:
    return [torch.full(ns.shard_shape, 7.0, dtype=ns.torch_dtype) for _ in range(n)]


def tokens(n_pages: int, start: int = 0) -> list:
    return list(range(start, start + n_pages * PT))


class Backend:
    """Opens stores of one backend and reaches under them (raw values) to damage pages."""

    def __init__(self, kind: str, path, url: str | None = None) -> None:
        self.kind, self.path, self.url = kind, path, url

    def open(self, ns: Namespace = NS, rank: int = 0, cap: int = 100 * SLOT, **kw) -> L3Store:
        if self.kind == "lmdb":
            return PageStore(self.path, ns, rank, capacity_bytes=cap, **kw)
        return RedisStore(self.url, ns, rank, **kw)

    # raw (header, payload) of a stored page; LMDB keeps them in two sub-databases, Redis in
    # one value header | payload
    def raw_get(self, key: bytes) -> tuple[bytes, bytes]:
        if self.kind == "lmdb":
            env = lmdb.open(str(self.path), max_dbs=8, map_size=1 << 26)
            with env.begin() as txn:
                out = tuple(bytes(txn.get(key, db=env.open_db(n, txn=txn)))
                            for n in (b"head", b"data"))
            env.close()
            return out
        import redis
        with redis.Redis.from_url(self.url) as c:
            v = c.get(b"hicache:" + key)
        hl = len(v) - PAGE
        return v[:hl], v[hl:]

    def raw_put(self, key: bytes, head: bytes, data: bytes) -> None:
        if self.kind == "lmdb":
            env = lmdb.open(str(self.path), max_dbs=8, map_size=1 << 26)
            with env.begin(write=True) as txn:
                txn.put(key, head, db=env.open_db(b"head", txn=txn))
                txn.put(key, data, db=env.open_db(b"data", txn=txn))
            env.close()
            return
        import redis
        with redis.Redis.from_url(self.url) as c:
            c.set(b"hicache:" + key, head + data)

    def num_pages(self) -> int:
        if self.kind == "lmdb":
            with PageStore(self.path, NS, 0, capacity_bytes=100 * SLOT) as s:
                return s.num_pages()
        import redis
        with redis.Redis.from_url(self.url) as c:  # page values (not namespace records)
            return sum(1 for k in c.scan_iter(match=b"hicache:*", count=1000)
                       if not k.startswith(b"hicache:ns:"))


@pytest.fixture(params=["lmdb", "redis"])
def backend(request, tmp_path):
    if request.param == "lmdb":
        return Backend("lmdb", tmp_path)
    return Backend("redis", tmp_path, request.getfixturevalue("redis_url"))


def test_round_trip_per_rank(backend):
    toks = tokens(5)
    s0 = backend.open(NS, 0)
    k0 = page_keys(toks, PT, NS, 0)
    res = s0.put(k0, [shard(i) for i in range(5)])
    assert res.written == 5 and res.stored == (True,) * 5
    res = s0.put(k0[:2], [shard(i) for i in range(2)])
    assert res.written == 0 and res.stored == (True, True)  # already stored: skipped
    assert s0.stats.pages_skipped == 2
    s0.close()
    # rank 1 in the same store (one per node / fleet): its own keys, its own bytes
    s1 = backend.open(NS, 1)
    k1 = page_keys(toks, PT, NS, 1)
    assert s1.exists_prefix(k1) == 0
    assert s1.put(k1, [shard(100 + i) for i in range(5)]).written == 5
    out = empty(5)
    assert s1.get(k1, out) == 5
    assert all(torch.equal(out[i], shard(100 + i)) for i in range(5))
    assert backend.num_pages() == 10
    with pytest.raises(L3Error, match="another namespace or rank"):
        s1.get(k0, empty(5))
    got = {}
    assert s1.get(k1[:3], lambda i: got.setdefault(i, empty(1)[0])) == 3
    assert torch.equal(got[2], shard(102))
    st_ = s1.stats
    assert (st_.hits, st_.misses, st_.bytes_read, st_.bytes_written) == (8, 0, 8 * PAGE, 5 * PAGE)
    assert st_.errors == 0
    s1.close()


def test_ranks_in_one_process_share_one_store(backend):
    """Several ranks (threads of one process) open the same store at once; closing one leaves
    the others working (LMDB: one environment per path per process, shared)."""
    stores = [backend.open(NS, r) for r in range(2)]
    stores.append(backend.open(NS, 0, writer=False))
    for r in range(2):
        keys = page_keys(tokens(3), PT, NS, r)
        assert stores[r].put(keys, [shard(10 * r + i) for i in range(3)]).written == 3
    stores[1].close()
    out = empty(3)
    assert stores[2].get(page_keys(tokens(3), PT, NS, 0), out) == 3  # the reader sees rank 0's
    assert torch.equal(out[2], shard(2))
    with pytest.raises(L3Error, match="closed"):
        stores[1].exists_prefix(page_keys(tokens(3), PT, NS, 1))
    stores[0].close()
    stores[2].close()
    with backend.open(NS, 1) as again:  # reopened after every store on it closed
        assert again.exists_prefix(page_keys(tokens(3), PT, NS, 1)) == 3


def test_open_store_picks_the_backend(tmp_path, redis_url):
    from hicache.config import HiCacheConfig
    lm = open_store(str(tmp_path / "a"), NS, 0, capacity_bytes=100 * SLOT)
    rd = open_store(redis_url, NS, 0, timeout_s=1.0, trust=Trust(authenticate=False))
    cfg = HiCacheConfig.from_dict({"l3": {"backend": "redis", "authenticate": False,
                                          "redis": {"url": redis_url, "timeout_s": 3}}})
    rc = open_store(cfg.l3, NS, 1)
    lc = open_store(HiCacheConfig.from_dict({"l3": {"lmdb": {"path": str(tmp_path / "b")}}}).l3,
                    NS, 1)
    assert (type(lm), type(rd), type(rc), type(lc)) == (PageStore, RedisStore, RedisStore,
                                                        PageStore)
    assert rd.timeout_s == 1.0 and rc.timeout_s == 3 and lc.capacity_bytes == 1 << 30
    for s in (lm, rd, rc, lc):
        assert isinstance(s, L3Store)
        s.close()
    with pytest.raises(L3Error, match="cannot open an L3 store"):
        open_store(42, NS, 0)
    with pytest.raises(L3Error, match="scheme"):
        RedisStore("http://localhost:1", NS, 0)


def test_get_stops_at_first_miss_and_exists_prefix(backend):
    with backend.open() as s:
        k = page_keys(tokens(6), PT, NS, 0)
        s.put([k[0], k[1], k[3], k[4]], [shard(0), shard(1), shard(3), shard(4)])
        assert s.exists_prefix(k) == 2
        out = empty(6)
        assert s.get(k, out) == 2
        assert torch.equal(out[1], shard(1)) and torch.equal(out[3], empty(1)[0])  # not served
        assert s.stats.misses == 1 and s.stats.hits == 2


def _flip(backend, key, part, offset):
    head, data = backend.raw_get(key)
    buf = bytearray(head if part == "head" else data)
    buf[offset % len(buf)] ^= 0x5A
    backend.raw_put(key, bytes(buf) if part == "head" else head,
                    bytes(buf) if part == "data" else data)


@pytest.mark.parametrize("part,offset", [("data", 3), ("data", -1), ("head", 5), ("head", -2)])
def test_corruption_is_a_counted_miss_deleted_never_served(backend, part, offset):
    k = page_keys(tokens(4), PT, NS, 0)
    with backend.open() as s:
        s.put(k, [shard(i) for i in range(4)])
    _flip(backend, k[2], part, offset)
    with backend.open() as s:
        out = empty(4)
        assert s.get(k, out) == 2
        assert torch.equal(out[2], empty(1)[0])  # the corrupt value never reached the buffer
        assert (s.stats.corrupt, s.stats.misses, s.stats.hits) == (1, 1, 2)
        assert s.exists_prefix(k) == 2  # deleted
        assert backend.num_pages() == 3
        assert s.put([k[2]], [shard(2)]).written == 1  # can be stored again
        assert s.get(k, empty(4)) == 4


def test_truncated_value_is_corrupt(backend):
    k = page_keys(tokens(2), PT, NS, 0)
    with backend.open() as s:
        s.put(k, [shard(0), shard(1)])
    head, _ = backend.raw_get(k[0])
    backend.raw_put(k[0], head, b"short")
    with backend.open() as s:
        assert s.get(k, empty(2)) == 0 and s.stats.corrupt == 1


def test_namespace_mismatch_never_hits(backend):
    toks = tokens(3)
    with backend.open() as s:
        s.put(page_keys(toks, PT, NS, 0), [shard(i) for i in range(3)])
    others = [Namespace("m", 2, 8, "float16", 4, 2), Namespace("m", 2, 8, "bfloat16", 4, 2, 2),
              Namespace("m", 2, 8, "bfloat16", 2, 4), Namespace("other", 2, 8, "bfloat16", 4, 2)]
    for ns in others:
        with backend.open(ns, 0, cap=100 * (ns.shard_bytes + 128)) as s:
            keys = page_keys(toks, ns.page_tokens, ns, 0)
            assert s.exists_prefix(keys) == 0
            assert s.get(keys, empty(len(keys), ns)) == 0


def test_value_under_wrong_key_is_rejected(backend):
    """A value of another rank copied under this rank's key is not served."""
    k0 = page_keys(tokens(1), PT, NS, 0)
    k1 = page_keys(tokens(1), PT, NS, 1)
    with backend.open(NS, 1) as s:
        s.put(k1, [shard(9)])
    backend.raw_put(k0[0], *backend.raw_get(k1[0]))
    with backend.open(NS, 0) as s:
        assert s.get(k0, empty(1)) == 0 and s.stats.corrupt == 1


def test_value_copied_under_another_key_of_the_same_rank_is_rejected(backend):
    """Same namespace and rank, other prefix: the checksum is seeded with the key, so it fails."""
    ka = page_keys(tokens(1), PT, NS, 0)
    kb = page_keys(tokens(1, 500), PT, NS, 0)
    with backend.open() as s:
        s.put(ka + kb, [shard(1), shard(2)])
    backend.raw_put(kb[0], *backend.raw_get(ka[0]))
    with backend.open() as s:
        out = empty(1)
        assert s.get(kb, out) == 0 and s.stats.corrupt == 1
        assert torch.equal(out[0], empty(1)[0]) and s.exists_prefix(kb) == 0  # deleted
        assert s.get(ka, out) == 1 and torch.equal(out[0], shard(1))  # the original is intact


def test_old_format_is_a_miss_not_a_crash(backend):
    """Stores written with format 1 (CRC-32 checksum) never hit: their keys carry the old
    namespace digest, and an old-format value found under a current key is a counted miss."""
    old_ns = dataclasses.replace(NS, format_version=1)
    assert FORMAT_VERSION == 2 and NS.format_version == 2 and old_ns.digest != NS.digest
    k_old = page_keys(tokens(2), PT, old_ns, 0)
    k = page_keys(tokens(2), PT, NS, 0)
    with backend.open(old_ns, 0) as s:
        s.put(k_old, [shard(0), shard(1)])
    with backend.open() as s:
        assert s.exists_prefix(k) == 0 and s.get(k, empty(2)) == 0
        assert s.stats.corrupt == 0 and backend.num_pages() == 2
    # a format-1 value (CRC-32 header, as version 1 wrote it) planted under a current key
    payload = shard(0).view(torch.uint8).reshape(-1).numpy().tobytes()
    head = msgpack.packb({"v": 1, "ns": NS.digest, "rank": 0, "shape": list(NS.shard_shape),
                          "dtype": NS.dtype, "n": PAGE,
                          "crc": zlib.crc32(payload).to_bytes(4, "big")})
    backend.raw_put(k[0], head, payload)
    with backend.open() as s:
        out = empty(2)
        assert s.exists_prefix(k) == 1
        assert s.get(k, out) == 0 and (s.stats.corrupt, s.stats.misses) == (1, 1)
        assert torch.equal(out[0], empty(1)[0]) and s.exists_prefix(k) == 0  # deleted
        assert s.put(k, [shard(0), shard(1)]).written == 2 and s.get(k, out) == 2
        assert torch.equal(out[1], shard(1))


def test_strided_destination_and_header_is_fixed_size(backend):
    """A non-contiguous destination is filled too; every header has the same length."""
    k = page_keys(tokens(3), PT, NS, 0)
    with backend.open() as s:
        s.put(k, [shard(i) for i in range(3)])
        big = torch.zeros(NS.shard_shape[::-1], dtype=NS.torch_dtype)  # [D, P, L]
        dst = big.permute(2, 1, 0)  # [L, P, D], strided
        assert not dst.is_contiguous()
        assert s.get(k[:1], [dst]) == 1 and torch.equal(dst, shard(0))
    heads = {backend.raw_get(key)[0] for key in k}
    assert len({len(h) for h in heads}) == 1 and len(heads) == 3  # one length, own checksums


_KILL = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import hicache.l3.store as store
    from test_l3_store import NS, PT, SLOT, shard, tokens
    from hicache.l3 import PageStore, page_keys
    with PageStore({path!r}, NS, 1, capacity_bytes=1000 * SLOT) as s:  # a clean session
        s.put(page_keys(tokens(4, 1000), PT, NS, 1), [shard(50 + i) for i in range(4)])
    s = PageStore({path!r}, NS, 0, capacity_bytes=1000 * SLOT)
    s.put(page_keys(tokens(6), PT, NS, 0), [shard(i) for i in range(6)])  # committed
    real, calls = store._b64, [0]
    def slow(v):  # called once per page inside the write transaction
        calls[0] += 1
        if calls[0] == 5:
            print("in-txn", flush=True)
            time.sleep(60)
        return real(v)
    store._b64 = slow
    s.put(page_keys(tokens(10, 5000), PT, NS, 0), [shard(100 + i) for i in range(10)])
    print("finished", flush=True)
""")


def test_restart_and_kill_during_write_batch(tmp_path):
    """A new process on the same path gets hits for what earlier processes stored, including
    one SIGKILLed in the middle of a write transaction (that batch is rolled back)."""
    code = _KILL.format(tests=os.path.dirname(__file__), path=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "in-txn", p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL
    with PageStore(tmp_path, NS, 1, capacity_bytes=1000 * SLOT) as s:  # warm restart
        keys = page_keys(tokens(6, 1000), PT, NS, 1)  # a longer request sharing the prefix
        assert s.exists_prefix(keys) == 4
        out = empty(6)
        assert s.get(keys, out) == 4
        assert all(torch.equal(out[i], shard(50 + i)) for i in range(4))
    with PageStore(tmp_path, NS, 0, capacity_bytes=1000 * SLOT) as s:
        committed = page_keys(tokens(6), PT, NS, 0)
        out = empty(6)
        assert s.get(committed, out) == 6
        assert all(torch.equal(out[i], shard(i)) for i in range(6))
        assert s.exists_prefix(page_keys(tokens(10, 5000), PT, NS, 0)) == 0  # rolled back
        assert s.num_pages() == 10
        # the killed writer's lock is recovered: new writes commit
        assert s.put(page_keys(tokens(2, 9000), PT, NS, 0), [shard(1), shard(2)]).written == 2
        assert s.stats.corrupt == 0


def test_capacity_eviction_is_lru(tmp_path):
    cap = 6 * footprint(tmp_path)
    with PageStore(tmp_path, NS, 0, capacity_bytes=cap) as s:
        a = page_keys(tokens(3, 0), PT, NS, 0)
        b = page_keys(tokens(3, 100), PT, NS, 0)
        s.put(a, [shard(i) for i in range(3)])
        s.put(b, [shard(10 + i) for i in range(3)])
        assert s.num_pages() == 6
        assert s.get(a, empty(3)) == 3  # a is now more recent than b
        c = page_keys(tokens(2, 200), PT, NS, 0)
        assert s.put(c, [shard(20), shard(21)]).written == 2
        assert s.stats.evictions == 2
        assert s.exists_prefix(a) == 3
        # within b, the deeper pages went first: b's prefix survives
        assert s.exists_prefix(b) == 1
        assert s.used_bytes() <= cap
        assert s.lru_order()[-1] == c[0]  # the newest batch's first page is the newest
        assert s.get(a[:1], empty(1)) == 1  # a touch, written lazily (at close at the latest)
    with PageStore(tmp_path, NS, 0, capacity_bytes=cap) as s:  # LRU state survives a restart
        order = s.lru_order()
        assert order[-1] == a[0] and order.index(c[0]) > order.index(a[1])


def test_capacity_across_reopen_and_too_big_batch(tmp_path):
    cap = 4 * footprint(tmp_path)
    with PageStore(tmp_path, NS, 0, capacity_bytes=cap) as s:
        s.put(page_keys(tokens(3), PT, NS, 0), [shard(i) for i in range(3)])
    with PageStore(tmp_path, NS, 0, capacity_bytes=cap) as s:
        assert s.used_bytes() > 3 * PAGE  # accounting persisted
        big = page_keys(tokens(7, 500), PT, NS, 0)
        res = s.put(big, [shard(i) for i in range(7)])
        assert res.written == 4 and res.stored == (True,) * 4 + (False,) * 3  # leading pages fit
        assert s.stats.pages_dropped == 3
        assert s.exists_prefix(big) == 4 and s.used_bytes() <= cap


def test_full_map_evicts_or_grows_never_crashes(tmp_path):
    ns = Namespace("m", 4, 512, "float32", 4, 1)  # 32 KiB shards
    cap = 400 * ns.shard_bytes  # capacity larger than the map: the map fills first
    with PageStore(tmp_path, ns, 0, capacity_bytes=cap, map_size=2 << 20,
                   max_map_size=4 << 20, batch_bytes=10 * ns.shard_bytes) as s:
        for j in range(8):
            keys = page_keys(list(range(j * 1000, j * 1000 + 20 * 4)), 4, ns, 0)
            s.put(keys, [shard(i, ns) for i in range(20)])
        assert s.map_size == 4 << 20  # grew to the limit
        assert s.stats.evictions > 0
        keys = page_keys(list(range(7000, 7080)), 4, ns, 0)
        n = s.exists_prefix(keys)
        assert n > 0
        out = empty(n, ns)
        assert s.get(keys[:n], out) == n
        assert all(torch.equal(out[i], shard(i, ns)) for i in range(n))


def test_reader_only_and_bad_input(tmp_path):
    with pytest.raises(L3Error, match="does not exist"):
        PageStore(tmp_path / "nope", NS, 0, capacity_bytes=10 * SLOT, writer=False)
    with pytest.raises(L3Error, match="smaller than one page"):
        PageStore(tmp_path, NS, 0, capacity_bytes=PAGE - 1)
    with pytest.raises(L3Error, match="outside the DCP group"):
        PageStore(tmp_path, NS, 2, capacity_bytes=10 * SLOT)
    PageStore(tmp_path, NS, 0, capacity_bytes=10 * SLOT).close()
    with PageStore(tmp_path, NS, 0, capacity_bytes=10 * SLOT, writer=False):
        with pytest.raises(L3Error, match="open read-only in this process"):
            PageStore(tmp_path, NS, 1, capacity_bytes=10 * SLOT)  # the shared env is read-only


def test_bad_input_and_reader_only_on_every_backend(backend):
    k = page_keys(tokens(2), PT, NS, 0)
    with pytest.raises(L3Error, match="outside the DCP group"):
        backend.open(NS, 2)
    with backend.open() as s:
        with pytest.raises(L3Error, match="2 keys but 1 shards"):
            s.put(k, [shard(0)])
        with pytest.raises(L3Error, match="expects"):
            s.put(k[:1], [torch.zeros(2, 4, 8)])
        with pytest.raises(L3Error, match="34 bytes"):
            s.exists_prefix([b"short"])
        s.put(k, [shard(0), shard(1)])
        with pytest.raises(L3Error, match="destination 0"):
            s.get(k, [torch.zeros(3)] * 2)
        with pytest.raises(L3Error, match="only 1 destinations"):
            s.get(k, empty(1))
    with backend.open(writer=False) as s:
        assert s.get(k, empty(2)) == 2
        with pytest.raises(L3Error, match="writer=False"):
            s.put(k, [shard(0), shard(1)])
        with pytest.raises(L3Error, match="writer=False"):
            s.delete(k)
    s.close()
    with pytest.raises(L3Error, match="closed"):
        s.exists_prefix(k)


def test_should_write_rotates_one_writer_per_page():
    for tp, dcp in [(8, 2), (4, 4), (8, 1)]:
        reps = tp // dcp
        for page in range(12):
            writers = [r for r in range(tp)
                       if should_write(page, *replica_of(r, tp, dcp)[1:])]
            assert sorted(replica_of(r, tp, dcp)[0] for r in writers) == list(range(dcp))
            assert len(writers) == dcp  # each shard written by exactly one replica
        assert replica_of(tp - 1, tp, dcp) == ((tp - 1) % dcp, (tp - 1) // dcp, reps)
    with pytest.raises(L3Error):
        should_write(0, 2, 2)
    with pytest.raises(L3Error, match="multiple"):
        replica_of(0, 6, 4)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 5),
                          st.integers(1, 4)), min_size=1, max_size=25))
def test_property_served_bytes_are_what_was_put(tmp_path_factory, redis_server, ops):
    """Random puts/gets (LMDB under a tight capacity; Redis): a hit is the right bytes, a served
    prefix is always a prefix of what was stored, LMDB keeps used <= capacity."""
    import redis
    with redis.Redis.from_url(redis_server.url) as c:
        c.flushall()
    path = tmp_path_factory.mktemp("prop")
    cap = 7 * SLOT
    for s in (PageStore(path, NS, 0, capacity_bytes=cap), RedisStore(redis_server.url, NS, 0)):
        with s:
            for op, seq, n in ops:
                keys = page_keys(tokens(4, seq * 100), PT, NS, 0)[:n]
                if op == "put":
                    s.put(keys, [shard(seq * 10 + i) for i in range(n)])
                else:
                    out = empty(n)
                    got = s.get(keys, out)
                    assert got <= s.exists_prefix(keys) or got == 0
                    for i in range(got):
                        assert torch.equal(out[i], shard(seq * 10 + i))
                    assert all(torch.equal(out[i], empty(1)[0]) for i in range(got, n))
                if isinstance(s, PageStore):
                    assert s.used_bytes() <= cap
            assert s.stats.corrupt == 0


def test_a_key_twice_in_one_put_is_stored_and_counted_once(backend):
    ns = Namespace("m", 2, 8, "float32", 4, 1)
    one = torch.ones(ns.shard_shape)
    with backend.open(ns, 0, cap=1 << 22) as store:
        key = page_keys(list(range(4)), 4, ns, 0)[0]
        res = store.put([key, key], [one, one])
        assert res.written == 1 and res.stored == (True, True)
        assert backend.num_pages() == 1
        if isinstance(store, PageStore):
            used = store.used_bytes()
            assert store.delete([key]) == 1 and store.used_bytes() == 0 and used > 0
        else:
            assert store.delete([key]) == 1 and backend.num_pages() == 0


def test_each_store_gets_every_page_from_one_replica_on_it():
    # tp 8, dcp 2: replicas of each shard on two nodes of 4 ranks (one LMDB store per node).
    tp, dcp, per_node = 8, 2, 4
    node = [r // per_node for r in range(tp)]
    for page in range(12):
        for store in (0, 1):
            for shard in range(dcp):
                writers = [r for r in range(tp) if node[r] == store and r % dcp == shard
                           and should_write(page, *store_replica(r, tp, dcp, node))]
                assert len(writers) == 1, (page, store, shard, writers)
    # rotating over every replica instead leaves each node's store with half of the pages
    held = {p for p in range(12) for r in range(per_node) if r % dcp == 0
            and should_write(p, *replica_of(r, tp, dcp)[1:])}
    assert held == {p for p in range(12) if p % 4 < 2}
    assert store_replica(5, tp, dcp, node) == (0, 2)  # rank 5: shard 1, node 1, first there
    assert store_replica(3, tp, dcp, [0] * tp) == replica_of(3, tp, dcp)[1:]  # one store
    with pytest.raises(L3Error, match="stores for"):
        store_replica(0, tp, dcp, [0, 1])
