"""The controller's API for the types callers hold: integer buffers without copies, Match pages
straight into insert, a partial tail page, O(1) sizes, incremental eviction orders, and
write_back eviction that frees what can be freed now."""

import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.controller import CacheController, as_tokens
from hicache.controller.order import EvictionOrder
from hicache.controller.tree import Node
from hicache.errors import DeviceFullError, UsageError

PT = 4


def seq(*pages, tail=0):
    out = [p * 100 + i for p in pages for i in range(PT)]
    return np.array(out + [7777 + i for i in range(tail)], dtype=np.int64)


def serve(c, toks):
    m = c.match(toks)
    h = c.lock(m)
    new = c.alloc_device(len(toks) // PT - len(m.device_pages))
    r = c.insert(toks, np.concatenate([m.device_pages, new]).astype(np.int64))
    c.unlock(h)
    c.take_ops()
    c.complete(c.inflight_ops())
    return r


def test_integer_buffers_are_viewed_not_copied():
    t = seq(1, 2, 3)
    assert as_tokens(t) is t                                   # int64 array: as is
    a = array.array("q", t.tolist())
    v = as_tokens(a)
    assert v.tolist() == t.tolist() and np.shares_memory(v, np.frombuffer(a, np.int64))
    mv = memoryview(a)
    assert np.shares_memory(as_tokens(mv), np.frombuffer(a, np.int64))
    assert as_tokens(array.array("i", [5, 6]), int64=False).dtype == np.int32
    tt = torch.tensor(t)
    assert np.shares_memory(as_tokens(tt), tt.numpy())
    assert as_tokens(tuple(t.tolist())).tolist() == t.tolist()
    assert as_tokens([np.int64(3), 4]).tolist() == [3, 4]
    for bad in (array.array("d", [1.0]), memoryview(b"ab").cast("c"), b"abcd", [1, True],
                [False, 0], [1, 2.0], [1 << 70], np.ones(3, bool)):
        with pytest.raises(UsageError):
            as_tokens(bad)
    c = CacheController(PT, 8, 0)
    serve(c, t)
    for q in (a, mv, t.tolist(), tt, t.astype(np.int32), np.asfortranarray(t[::1])):
        assert c.match(q).device_len == 3 * PT
    strided = np.repeat(t, 2)[::2]                             # not contiguous: still right
    assert c.match(strided).device_len == 3 * PT


def test_match_pages_go_straight_into_insert_in_any_form():
    c = CacheController(PT, 16, 0)
    serve(c, seq(1, 2))
    for i, form in enumerate((lambda m, n: np.concatenate([m.device_pages, n]),
                 lambda m, n: m.device_pages.tolist() + n,
                 lambda m, n: list(m.device_pages) + n,            # numpy ints in a list
                 lambda m, n: tuple(m.device_pages.tolist() + n),
                 lambda m, n: array.array("q", m.device_pages.tolist() + n),
                 lambda m, n: torch.tensor(m.device_pages.tolist() + n, dtype=torch.int32))):
        toks = seq(1, 2, 10 + i)
        m = c.match(toks)
        h = c.lock(m)
        new = c.alloc_device(1)
        r = c.insert(toks, form(m, new))
        assert r.device_pages.dtype == np.int64 and len(r.freed) == 0 and r.new_pages == 1
        assert r.device_pages.tolist() == m.device_pages.tolist() + new
        c.unlock(h)
        c.check()
    m = c.match(seq(1, 2, 3))
    assert isinstance(m.device_pages, np.ndarray) and m.device_pages.dtype == np.int64
    m.device_pages[0] = 99                                     # the caller's copy
    assert c.match(seq(1, 2, 3)).device_pages[0] != 99
    with pytest.raises(UsageError):
        c.insert(seq(5), [1.5])


def test_insert_takes_a_partial_tail_page_and_frees_it():
    c = CacheController(PT, 8, 0)
    toks = seq(1, 2, tail=3)                                   # 2 whole pages + 3 tokens
    pages = c.alloc_device(3)
    r = c.insert(toks, pages)
    assert r.new_pages == 2 and r.device_pages.tolist() == pages[:2]
    assert r.freed.tolist() == pages[2:] and c.device.num_used == 2
    assert c.request_pages == frozenset()
    c.check()
    p = c.alloc_device(2)
    with pytest.raises(UsageError, match="1 whole pages"):
        c.insert(seq(3, tail=1), p + c.alloc_device(1))        # a page beyond the tail's
    with pytest.raises(UsageError, match="2 whole pages"):
        c.insert(seq(3, 4), p[:1])                             # too few
    with pytest.raises(UsageError):
        c.insert(seq(3, tail=1), [p[0], r.device_pages[0]])    # tail page owned by the tree
    assert c.request_pages == frozenset(p) | c.request_pages   # nothing changed on errors
    c.check()


def test_cached_and_evictable_sizes_are_counters():
    c = CacheController(PT, 8, 8)
    assert c.cached_pages() == (0, 0) and c.evictable_pages() == 0
    serve(c, seq(1, 2, 3))
    assert c.cached_pages() == (3, 3) and c.evictable_pages() == 3
    m = c.match(seq(1, 2))                                     # splits a node: sums unchanged
    h = c.lock(m)
    assert c.cached_pages() == (3, 3) and c.evictable_pages() == 1
    assert c.evict_device(3) == 1                              # only the unlocked leaf goes
    assert c.cached_pages() == (2, 3) and c.evictable_pages() == 0
    c.unlock(h)
    assert c.evictable_pages() == 2
    c.check()


def test_write_back_eviction_frees_what_frees_now():
    """An eviction that can only start a backup (write_back) frees nothing now: it must not
    count toward an allocation that needs pages now while other pages can be demoted."""
    c = CacheController(PT, 4, 8, write="write_back")
    serve(c, seq(1, 2))
    c.evict_device(2)                                          # write_back: backup first
    (op,) = c.take_ops()
    c.complete([op.op_id])                                     # 1,2 demoted to host
    m = c.match(seq(1, 2))
    h = c.lock(m)
    ld = c.load_back(m)
    c.take_ops()
    c.complete([ld.op_id])
    c.unlock(h)                                                # 1,2: device + valid host
    serve(c, seq(5, 6))                                        # 5,6: device only
    c.match(seq(1, 2))                                         # 5,6 now least recent
    assert c.device.num_free == 0
    got = c.alloc_device(2)         # 5,6 start backing up (free later); 1,2 demoted (free now)
    assert len(got) == 2 and c._evicting_pages == 2
    m = c.match(seq(1, 2))
    assert m.device_len == 0 and m.host_len == 2 * PT
    with pytest.raises(DeviceFullError) as e:
        c.alloc_device(1)                                      # 5,6 still backing up
    assert e.value.pending == 2
    (op,) = c.take_ops()
    c.complete([op.op_id])
    assert c.device.num_free == 2 and len(c.alloc_device(2)) == 2
    c.check()


def _node(nid, hits=0):
    n = Node(nid, None, b"", 1)
    n.hits = hits
    return n


def test_eviction_order_lru_and_lfu():
    a, b, c = _node(1), _node(2), _node(3)
    o = EvictionOrder()
    for n in (a, b, c):
        o.add(n)
    o.touch(a)
    assert list(o) == [b, c, a] and len(o) == 3 and a in o
    o.remove(c)
    assert list(o) == [b, a] and c not in o
    f = EvictionOrder(lfu=True)
    a.hits, b.hits, c.hits = 2, 1, 1
    for n in (a, b, c):
        f.add(n)
    assert list(f) == [b, c, a]
    b.hits = 3
    f.touch(b)                                                 # moves to its count's list
    c.hits = 1
    f.touch(c)
    assert list(f) == [c, a, b]
    f.remove(a)
    assert list(f) == [c, b] and len(f) == 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=5),
                          st.booleans()), min_size=1, max_size=30),
       st.sampled_from(["lru", "lfu"]))
def test_eviction_takes_the_oldest_unlocked_leaf(reqs, eviction):
    """Against a plain model: each evict_device(1) frees a device leaf with the smallest
    (hits for lfu, last use) among the unlocked leaves (ties: any)."""
    c = CacheController(PT, 12, 0, eviction=eviction)
    for pages, evict in reqs:
        toks = seq(*pages)
        m = c.match(toks)
        h = c.lock(m)
        try:
            new = c.alloc_device(len(pages) - len(m.device_pages))
        except DeviceFullError:
            c.unlock(h)
            continue
        c.insert(toks, np.concatenate([m.device_pages, new]).astype(np.int64))
        c.unlock(h)
        if evict:
            leaves = [n for n in c.iter_nodes() if n.device is not None and not n.lock_ref
                      and not any(ch.device is not None for ch in n.children.values())]
            key = ((lambda n: (n.hits, n.last_access)) if eviction == "lfu"
                   else (lambda n: n.last_access))
            best = min(map(key, leaves))
            allowed = {n for n in leaves if key(n) == best}
            before = set(n for n in c.iter_nodes())
            assert c.evict_device(1) >= 1
            gone = before - set(c.iter_nodes())
            assert gone and gone <= allowed
        c.check()
