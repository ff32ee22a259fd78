"""The controller's vectorised page bookkeeping: the allocator's array API, and insert's fast
validation of pages that came straight from alloc_device ("grants") against the general path."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.controller import CacheController
from hicache.errors import DeviceFullError, InvariantError, UsageError
from hicache.ids import join_ids
from hicache.ids import page_ids as id_array
from hicache.pages import PageAllocator

PT = 4


def fresh_tokens(serial: int, n_pages: int) -> np.ndarray:
    """Tokens no other call shares (so an insert never matches cached pages)."""
    return np.arange(n_pages * PT, dtype=np.int64) + 1_000_000 * (serial + 1)


def test_allocator_array_api_lifo_order_and_errors():
    p = PageAllocator(6)
    assert p.alloc(3) == [0, 1, 2] and p.num_free == 3 and p.num_used == 3
    a = p.alloc_array(2)
    assert a.tolist() == [3, 4] and p.is_allocated(4) and not p.is_allocated(5)
    p.free([1, 0])
    assert p.alloc(2) == [1, 0]                       # freed pages come back in their order
    with pytest.raises(UsageError, match="not allocated"):
        p.free([5])
    with pytest.raises(UsageError, match="outside"):
        p.free([6])
    with pytest.raises(UsageError, match="outside"):
        p.free([-1])
    with pytest.raises(UsageError, match="twice"):
        p.free([1, 1])
    with pytest.raises(UsageError, match="not an int"):
        p.free([1.5])
    with pytest.raises(DeviceFullError):
        p.alloc(2)
    p.free(np.array([3, 4, 2], np.int32))             # int arrays are accepted too
    assert p.num_free == 4 and not p.is_allocated(3)
    big = PageAllocator(100)
    ids = big.alloc_array(80)
    assert big.has_duplicates(np.concatenate([ids[:50], ids[10:11]]))
    assert not big.has_duplicates(ids)


def test_vectorised_checks_and_trusted_free():
    p = PageAllocator(8)
    ids = p.alloc_array(5)                            # [0..4]
    assert p.allocated(ids) and p.allocated(ids[:0])
    assert not p.allocated(np.array([0, 5])) and not p.allocated(np.array([0, 8]))
    assert not p.allocated(np.array([-1]))
    assert p.in_range(np.array([0, 7])) and not p.in_range(np.array([8]))
    assert not p.in_range(np.array([-1]))
    p.free_array(ids[3:], trusted=True)               # skips the checks, keeps the books
    assert (p.num_free, p.num_used) == (5, 3) and p.used_ids().tolist() == [0, 1, 2]
    assert p.alloc_array(2).tolist() == [3, 4]
    assert p.iota(3).tolist() == [0, 1, 2] and len(p.iota(100)) == 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "trusted", "ask"]),
                          st.integers(0, 4), st.integers(0, 2 ** 16)), max_size=30))
def test_allocator_without_a_used_map_answers_the_same(steps):
    """``track_used=False`` (the controller's pools: no per-page mark per allocation or trusted
    free) hands out, frees, refuses and reports exactly what the tracked allocator does."""
    a, b = PageAllocator(12), PageAllocator(12, track_used=False)
    held: list[int] = []
    for kind, k, seed in steps:
        rng = np.random.default_rng(seed)
        if kind == "alloc":
            if k > a.num_free:
                with pytest.raises(DeviceFullError):
                    b.alloc_array(k)
                continue
            got = a.alloc_array(k).tolist()
            assert b.alloc_array(k).tolist() == got
            held += got
        elif kind == "trusted" and held:
            sub = rng.choice(held, size=min(k, len(held)), replace=False).astype(np.int64)
            a.free_array(sub, trusted=True), b.free_array(sub, trusted=True)
            held = [p for p in held if p not in set(sub.tolist())]
        elif kind == "free":                          # untrusted: maybe foreign or repeated
            ids = rng.integers(-1, 13, size=k).tolist()
            errs = []
            for pool in (a, b):
                try:
                    pool.free(ids)
                    errs.append(None)
                except UsageError as e:
                    errs.append(str(e))
            assert errs[0] == errs[1]
            if errs[0] is None:
                held = [p for p in held if p not in set(ids)]
        idx = np.array(held[:3] + [int(rng.integers(0, 12))], np.int64)
        assert a.allocated(idx) == b.allocated(idx)
        assert a.used_ids().tolist() == b.used_ids().tolist() == sorted(held)
        assert [a.is_allocated(p) for p in range(12)] == [b.is_allocated(p) for p in range(12)]
        assert (a.num_free, a.num_used) == (b.num_free, b.num_used)


def test_page_ids_types():
    assert id_array([3, 1]).tolist() == [3, 1]
    assert id_array([np.int64(3), 2]).tolist() == [3, 2]
    a = np.array([5, 6], np.int64)
    assert id_array(a) is a                           # already int64 1-D: no copy
    assert id_array(np.array([2, 9], np.uint8)).dtype == np.int64
    t = torch.tensor([4, 7], dtype=torch.int32)
    got = id_array(t)
    assert got.dtype == np.int64 and got.tolist() == [4, 7]
    got[0] = 99                                       # a copy: the caller's tensor is unchanged
    assert t.tolist() == [4, 7]
    assert id_array(torch.tensor([[1, 2], [3, 4]])).tolist() == [1, 2, 3, 4]
    for bad_t in (torch.tensor([1.0]), torch.tensor([True]), np.array([1.5])):
        with pytest.raises(UsageError, match="integers"):
            id_array(bad_t)
    for bad in ([1.0], ["a"], [None]):
        with pytest.raises(UsageError):
            id_array(bad)


def test_insert_from_several_grants_with_a_cut_tail():
    c = CacheController(PT, 32, 0)
    a, b, d = c.alloc_device(3), c.alloc_device(2), c.alloc_device(3)
    pages = a + b + d[:1]                             # the last grant is cut short
    r = c.insert(fresh_tokens(0, 6), pages)
    assert r.new_pages == 6 and list(r.device_pages) == pages
    assert r.device_pages.dtype == np.int64
    assert c.request_pages == frozenset(d[1:])
    c.free_device(d[1:])
    assert c.request_pages == frozenset() and c.device.num_used == 6
    c.check()


def test_insert_rejects_reused_or_stale_grants():
    c = CacheController(PT, 32, 0)
    a = c.alloc_device(2)
    with pytest.raises(UsageError, match="twice"):
        c.insert(fresh_tokens(0, 4), a + a)           # the same grant twice
    c.free_device(a[1:])
    b = c.alloc_device(1)                             # LIFO: the same id, a newer grant
    assert b == a[1:]
    r = c.insert(fresh_tokens(1, 2), a)               # still request pages: accepted
    assert list(r.device_pages) == a
    with pytest.raises(UsageError, match="owned by a cached node"):
        c.insert(fresh_tokens(2, 2), a)               # consumed: now the tree's
    mine = c.alloc_device(2)
    mine[0] = 31                                      # the caller's copy: ours is unchanged
    with pytest.raises(UsageError, match="not allocated"):
        c.insert(fresh_tokens(3, 2), mine)
    c.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "insert"]),
                          st.integers(0, 4), st.integers(0, 2 ** 16)), max_size=25))
def test_insert_validation_matches_a_set_model(steps):
    """Random grants, frees and inserts of (possibly cut, reordered, repeated or foreign) page
    lists: insert accepts exactly when every page is a request page and none repeats."""
    c = CacheController(PT, 24, 0)
    grants: list[list[int]] = []
    req: set[int] = set()
    for i, (kind, k, seed) in enumerate(steps):
        rng = np.random.default_rng(seed)
        if kind == "alloc":
            if k > c.device.num_free:
                continue
            g = c.alloc_device(k)
            grants.append(g)
            req |= set(g)
        elif kind == "free" and req:
            sub = sorted(rng.choice(sorted(req), size=min(k, len(req)), replace=False).tolist())
            c.free_device(sub)
            req -= set(sub)
        elif kind == "insert" and grants:
            pick = [grants[int(j)] for j in rng.integers(0, len(grants), size=1 + k % 3)]
            pages = [p for g in pick for p in g]
            mode = int(rng.integers(0, 4))
            if mode == 1 and pages:
                pages = pages[:int(rng.integers(1, len(pages) + 1))]
            elif mode == 2:
                pages = pages[::-1]
            elif mode == 3 and pages:
                pages[int(rng.integers(0, len(pages)))] = int(rng.integers(0, 24))
            ok = set(pages) <= req and len(set(pages)) == len(pages)
            toks = fresh_tokens(i, len(pages))
            if ok:
                r = c.insert(toks, pages)
                assert list(r.device_pages) == pages
                req -= set(pages)
            else:
                with pytest.raises(UsageError):
                    c.insert(toks, pages)
        assert c.request_pages == frozenset(req)
        c.check()


def _general_only(c: CacheController) -> CacheController:
    """``c`` with insert's one-join check and the grant shortcut off (node by node, full
    range and duplicate checks): the reference for the fast paths."""
    c._max_grants = 0
    c._check_insert = lambda path, pages: c._check_insert_nodes(path, pages, pages.tobytes())
    return c


def _outcome(fn):
    try:
        r = fn()
    except UsageError as e:
        return ("error", str(e))
    if r is None:
        return None
    return (r.freed.tolist(), r.device_pages.tolist(), r.new_pages)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6),
                          st.integers(0, 9)), min_size=1, max_size=30),
       st.integers(1, 4), st.sampled_from([(40, 0, 0), (9, 0, 0), (9, 12, 0), (9, 12, 10 ** 6)]))
def test_fast_paths_give_what_the_general_check_gives(reqs, inflight, caps):
    """Requests sharing prefixes run concurrently (so inserts meet pages another request
    cached meanwhile: duplicates), with host-tier load-backs (host-only nodes adopted) and
    pages handed back whole, cut, reordered, repeated or foreign, and tokens cut inside the
    locked prefix (an abort), with a partial tail, or cut to the suffix past the locked prefix
    (a misuse of ``after=``). The controller with its fast paths returns, refuses and caches
    exactly what the general node-by-node check does, and a match that locks (``lock=True``)
    and an insert after the request's lock (``after=``, the same tokens and pages; it
    releases the lock) exactly what a match, a lock, an insert and an unlock do, except that
    tokens which differ from the locked prefix's last page (the page compared) are refused
    (nothing changed, the lock kept)."""
    dev, host, threshold = caps  # a threshold past every hit: host hits are recomputed
    fast = CacheController(PT, dev, host, load_back_threshold=threshold)
    slow = _general_only(CacheController(PT, dev, host, load_back_threshold=threshold))
    q = []

    def finish():
        toks, hf, hs, pages, mode = q.pop(0)
        released = False
        if pages is not None:
            if mode == 1 and len(pages) > 1:            # reordered
                pages = pages[::-1].copy()
            elif mode == 2 and len(pages):              # a page repeated
                pages = np.concatenate([pages[:-1], pages[:1]])
            elif mode == 3 and len(pages):              # a foreign page
                pages = pages.copy()
                pages[-1] = (pages[-1] + 1) % dev
            elif mode == 4 and len(pages) > 1 and int(pages[-1]) in fast.request_pages:
                # the last page of the grant given back, and its page's tokens not inserted
                fast.free_device(pages[-1:]), slow.free_device(pages[-1:])
                pages, toks = pages[:-1], toks[:(len(pages) - 1) * PT]
            elif mode == 5 and hf.prefix_len:           # finished inside its locked prefix
                k = hf.prefix_len // PT // 2
                mine = fast.request_pages
                rest = [p for p in pages[k:].tolist() if p in mine]
                fast.free_device(rest), slow.free_device(rest)
                pages, toks = pages[:k], toks[:k * PT + 1]
            elif mode == 6:                             # a partial tail, its page kept
                toks = np.concatenate([toks, np.full(PT - 1, 99, np.int64)])
            refused = False  # misuse that insert(after=) must refuse
            if mode in (7, 8):  # misuse: the suffix past the prefix (the old API's argument)
                held, pre = hf.prefix_len, fast.tree.path_tokens(hf.node)
                sub = toks[held:]
                if mode == 7:  # with a partial tail, every page passed
                    sub = np.concatenate([toks, np.full(PT - 1, 99, np.int64)])[held:]
                ends = held and len(sub) // PT * PT >= held  # (else walked from the root)
                same = ends and np.array_equal(sub[:held], pre)
                if ends and not same and np.array_equal(sub[held - PT:held], pre[held - PT:]):
                    sub = None  # the prefix's last page (the one compared) agrees
                if sub is not None:
                    refused = ends and not same
                    if mode == 8:  # as many pages as the suffix has
                        k = len(sub) // PT
                        mine = fast.request_pages
                        rest = [p for p in pages[k:].tolist() if p in mine]
                        fast.free_device(rest), slow.free_device(rest)
                        pages = pages[:k]
                    toks = sub
            got = _outcome(lambda: fast.insert(toks, pages, after=hf))
            released = got[0] != "error"
            if refused:  # by the page count, or by the tokens: nothing changed
                assert got[0] == "error", got
            else:
                assert got == _outcome(lambda: slow.insert(toks, pages))
            assert hf.released == released            # a refused insert keeps the lock
            if got[0] == "error":                      # give the request pages back
                mine = [p for p in set(pages.tolist()) if p in fast.request_pages]
                fast.free_device(mine), slow.free_device(mine)
        if not released:
            fast.unlock(hf)
        slow.unlock(hs)
        for c in (fast, slow):
            c.take_ops()
            c.complete(c.inflight_ops())

    for page_keys, mode in reqs:
        toks = np.array([k * 10 + i for k in page_keys for i in range(PT)], np.int64)
        mf, ms = fast.match(toks, lock=True), slow.match(toks)
        assert mf.device_pages.tolist() == ms.device_pages.tolist()
        hf, hs = mf.lock, slow.lock(ms)
        assert hf.prefix_len == hs.prefix_len == ms.total_len and ms.lock is None
        lf, ls = fast.load_back(mf), slow.load_back(ms)
        assert lf == ls
        have = len(mf.device_pages) + (len(lf.device_pages) if lf else 0)
        pages = None
        try:
            new = fast.alloc_device(len(page_keys) - have, as_array=True)
        except DeviceFullError:
            with pytest.raises(DeviceFullError):
                slow.alloc_device(len(page_keys) - have, as_array=True)
        else:
            assert slow.alloc_device(len(page_keys) - have, as_array=True).tolist() == new.tolist()
            loaded = np.array(lf.device_pages if lf else [], np.int64)
            pages = np.concatenate([mf.device_pages, loaded, new])
        q.append((toks, hf, hs, pages, mode))
        if len(q) >= inflight:
            finish()
        assert fast.digest() == slow.digest()
        fast.check()
    while q:
        finish()
    assert fast.digest() == slow.digest() and fast.request_pages == slow.request_pages


def test_insert_after_a_lock_takes_the_full_tokens_and_pages():
    c = CacheController(PT, 32, 0)
    base = fresh_tokens(0, 3)
    c.insert(base, c.alloc_device(3))
    toks = np.concatenate([base, fresh_tokens(1, 2)])
    m = c.match(toks, lock=True)
    h = m.lock
    assert h.prefix_len == m.total_len == 3 * PT
    pages = np.concatenate([m.device_pages, c.alloc_device(2, as_array=True)])
    with pytest.raises(UsageError, match=r"insert of 20 tokens \(5 whole pages of 4\) got 3 "):
        c.insert(toks, pages[:3], after=h)               # counts only what was passed
    assert not h.released and c.evictable_pages() == 0  # refused: still locked
    r = c.insert(toks, pages, after=h)
    assert h.released and c.evictable_pages() == 5      # inserted, and released
    assert r.new_pages == 2 and r.device_pages.tolist() == pages.tolist()
    assert c.match(toks).device_len == 5 * PT
    spare = c.alloc_device(1)
    with pytest.raises(UsageError, match="already released"):
        c.insert(fresh_tokens(2, 1), spare, after=h)
    with pytest.raises(UsageError, match="LockHandle"):
        c.insert(fresh_tokens(2, 1), spare, after=m.last_node)
    other = fresh_tokens(3, 2)                          # nothing cached: the root's lock
    h2 = c.lock(c.match(other))
    assert h2.prefix_len == 0
    assert c.insert(other, spare + c.alloc_device(1), after=h2).new_pages == 2
    assert c.match(other).device_len == 2 * PT and c.evictable_pages() == 7
    # a request that ends inside its locked prefix (an abort, a finish before its pages):
    # walked from the root, as insert then unlock would, and the lock released all the same
    h3 = c.match(toks, lock=True).lock
    assert c.evictable_pages() == 2
    r = c.insert(toks[:2 * PT + 1], r.device_pages[:2], after=h3)
    assert h3.released and r.new_pages == 0 and not len(r.freed)
    assert c.evictable_pages() == 7
    c.check()


def test_insert_after_refuses_tokens_other_than_the_locked_prefix():
    """The misuse the old ``insert(tokens[h.prefix_len:], pages, after=h)`` invited: with the
    full tokens the contract, a suffix (or any tokens that differ from the locked prefix's
    last page, the page compared) is refused with an error naming the first token that
    differs; nothing changes and the lock is kept. The page count lets a suffix with the
    request's pages through only when the locked prefix is one page, the page compared. Before,
    that case cached the tokens shifted by a page and a partly written tail page as a whole
    page."""
    c = CacheController(PT, 16, 0)
    c.insert(np.arange(PT), c.alloc_device(1))          # one cached page
    toks = np.arange(11)                                # 2 whole pages and a partial tail
    m = c.match(toks, lock=True)
    h = m.lock
    assert h.prefix_len == PT
    pages = np.concatenate([m.device_pages, c.alloc_device(2, as_array=True)])  # + new + tail
    before = c.digest()
    with pytest.raises(UsageError, match=r"token 0 is 4 but the locked prefix \(4 tokens"):
        c.insert(toks[h.prefix_len:], pages[:2], after=h)   # the suffix, its whole pages
    with pytest.raises(UsageError, match=r"insert of 7 tokens \(1 whole pages of 4\) got 3"):
        c.insert(toks[h.prefix_len:], pages, after=h)       # the suffix, the tail's page too
    other = toks.copy()
    other[2] = 77                                       # another prompt's tokens
    with pytest.raises(UsageError, match="token 2 is 77 but the locked prefix"):
        c.insert(other, pages, after=h)
    assert c.digest() == before and not h.released
    r = c.insert(toks, pages, after=h)                  # the contract: the full tokens
    assert h.released and r.new_pages == 1 and r.freed.tolist() == [int(pages[2])]
    got = c.match(np.arange(12))
    assert got.device_len == 2 * PT                     # [0..7]: the tail page not cached
    assert c.tree.path_tokens(got.last_node).tolist() == list(range(8))
    c.check()


def test_check_compares_the_host_pool_by_ids():
    """``check`` finds a host page the pool holds as allocated but no node owns, even when
    the counts agree (the allocator keeps no used map to compare with)."""
    c = CacheController(PT, 8, 8)
    c.insert(fresh_tokens(0, 2), c.alloc_device(2))
    c.complete(c.inflight_ops())
    c.check()
    node = next(n for n in c.iter_nodes() if n.host is not None)
    node.host = node.host.copy()
    free = np.setdiff1d(np.arange(8), c.host.used_ids())
    node.host[0] = free[0]                              # a page the pool never handed out
    with pytest.raises(InvariantError, match="host pool's allocated pages"):
        c.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.booleans()), max_size=6))
def test_join_ids_is_concatenate(parts):
    """Page arrays joined as bytes: the same ids as np.concatenate, int64, a new writable array
    (strided parts included)."""
    arrays = [np.arange(n * (2 if strided else 1), dtype=np.int64)[::2 if strided else 1] + s
              for n, s, strided in parts]
    got = join_ids(arrays)
    want = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert got.flags.writeable and not any(np.shares_memory(got, a) for a in arrays)
    with pytest.raises(TypeError):                    # a node not on the tier has None pages
        join_ids(arrays + [None])


def test_non_native_int64_tokens_take_the_general_path():
    """A big-endian int64 prompt is not the native dtype the fast paths test by identity: it
    is converted, and matches and inserts as the native one does."""
    c = CacheController(PT, 16, 0)
    toks = fresh_tokens(0, 3)
    be = toks.astype(">i8")
    assert be.dtype.kind == "i" and be.dtype.itemsize == 8 and be.dtype is not np.dtype(np.int64)
    r = c.insert(be, c.alloc_device(3))
    assert r.new_pages == 3
    assert c.match(toks).device_len == 3 * PT and c.match(be).device_len == 3 * PT
    assert c.insert(toks, c.match(be).device_pages).new_pages == 0
    c.check()


def test_grants_hold_only_request_pages():
    """A grant passes an insert unchecked, so every grant kept holds only request pages: pages
    given back any other way empty the set; the next inserts take the general check."""
    c = CacheController(PT, 32, 0)
    a, b = c.alloc_device(3, as_array=True), c.alloc_device(2, as_array=True)
    assert {a.tobytes(), b.tobytes()} == c._grants
    c.free_device(a[2:])                              # part of a grant: not one of them
    assert not c._grants
    c.free_device(a[:1])
    with pytest.raises(UsageError, match="not allocated"):
        c.insert(fresh_tokens(0, 2), a[:2])           # a[0] went back: refused, nothing kept
    assert c.request_pages == frozenset([int(a[1])] + b.tolist())
    r = c.insert(fresh_tokens(1, 2), b)               # general check: accepted all the same
    assert r.device_pages.tolist() == b.tolist()
    d = c.alloc_device(2, as_array=True)
    c.insert(fresh_tokens(2, 2), d)                   # a grant: used up
    assert not c._grants
    c.free_device(a[1:2])
    c.check()
