"""Cache scopes in the controller's tree and in the L3 chain: two scopes never share a page past
their public prefix; one scope hits as the shared scope does; the tree's matches equal a model
built from the scoped chain hashes alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.controller import CacheController
from hicache.errors import UsageError
from hicache.l3 import chain_hashes
from hicache.scope import Scope, make_scope, public_digest, scope_tag

PT = 4


def seq(*pages, tail=0):
    out = [p * 100 + i for p in pages for i in range(PT)]
    return np.array(out + [7777 + i for i in range(tail)], dtype=np.int64)


def serve(ctrl, tokens, scope=None):
    """match (locked) + load-back + insert after the lock, as the service runs a request."""
    m = ctrl.match(tokens, lock=True, scope=scope)
    ld = ctrl.load_back(m)
    have = m.device_len // PT + (len(ld.device_pages) if ld else 0)
    new = ctrl.alloc_device(len(tokens) // PT - have)
    pages = list(m.device_pages) + (list(ld.device_pages) if ld else []) + new
    ctrl.insert(tokens, pages, after=m.lock, scope=scope)
    ctrl.take_ops()
    ctrl.complete(ctrl.inflight_ops())
    ctrl.check()
    return m


def sc(name, public_pages=0):
    return Scope(scope_tag(name), public_pages)


def test_two_scopes_never_share_one_scope_hits():
    c = CacheController(PT, 64, 0)
    serve(c, seq(1, 2, 3), sc("a"))
    assert c.match(seq(1, 2, 3), scope=sc("b")).device_len == 0
    assert c.match(seq(1, 2, 3)).device_len == 0          # nor the shared scope
    assert c.peek(seq(1, 2, 3), sc("b")) == (0, 0)
    assert c.match(seq(1, 2, 3), scope=sc("a")).device_len == 3 * PT
    assert c.peek(seq(1, 2, 3), sc("a")) == (3 * PT, 0)
    serve(c, seq(1, 2, 3))                                 # the shared scope: its own pages
    assert c.match(seq(1, 2, 3)).device_len == 3 * PT
    assert c.match(seq(1, 2, 9), scope=sc("a")).device_len == 2 * PT  # split inside a scope
    c.check()


def test_a_public_prefix_is_shared_the_rest_is_not():
    c = CacheController(PT, 64, 0)
    serve(c, seq(1, 2, 3, 4), sc("a", 2))
    # b shares the public pages only; the shared scope sees them too
    m = c.match(seq(1, 2, 3, 4), scope=sc("b", 2))
    assert m.device_len == 2 * PT
    assert c.peek(seq(1, 2, 3, 4), sc("b", 2)) == (2 * PT, 0)
    assert c.match(seq(1, 2, 3, 4)).device_len == 2 * PT
    serve(c, seq(1, 2, 3, 4), sc("b", 2))
    assert c.device.num_used == 6                         # 2 public + 2 a + 2 b
    # a shared node running past a later request's public prefix is cut there
    serve(c, seq(5, 6, 7))
    assert c.match(seq(5, 6, 7), scope=sc("a", 1)).device_len == PT
    assert c.peek(seq(5, 6, 7), sc("a", 1)) == (PT, 0)
    serve(c, seq(5, 6, 7), sc("a", 1))
    assert c.match(seq(5, 6, 7), scope=sc("a", 1)).device_len == 3 * PT
    assert c.match(seq(5, 6, 7)).device_len == 3 * PT
    c.check()


def test_scopes_survive_eviction_and_demotion():
    c = CacheController(PT, 6, 16)
    for name in ("a", "b", "c"):
        serve(c, seq(1, 2, 3), sc(name, 1))
    # L1 holds 6 pages: the first scopes' pages were demoted to L2, still in their scope
    got = {n: c.peek(seq(1, 2, 3), sc(n, 1)) for n in ("a", "b", "c")}
    assert all(sum(v) == 3 * PT for v in got.values()), got
    assert any(v[1] for v in got.values())                # some of it only on the host
    assert c.peek(seq(1, 2, 3), sc("d", 1)) == (PT, 0)
    c.check()


def test_make_scope_and_bad_input():
    assert make_scope(None, 9, PT) is None
    s = make_scope("tenant", 9, PT)
    assert s == Scope(scope_tag(b"tenant"), 2) and s.tag != b"tenant"
    assert public_digest(s.tag) != s.tag.hex() and "tenant" not in public_digest(s.tag)
    for bad, what in ((3, "bytes, str or None"), ("", "must not be empty")):
        with pytest.raises(UsageError, match=what):
            make_scope(bad, 0, PT)
    with pytest.raises(UsageError, match="public_tokens"):
        make_scope("a", -1, PT)


def test_chain_hashes_mix_the_scope_at_its_first_scoped_page():
    t = seq(1, 2, 3)
    shared, a, b = chain_hashes(t, PT), chain_hashes(t, PT, sc("a", 1)), \
        chain_hashes(t, PT, sc("b", 1))
    assert a[0] == b[0] == shared[0]                      # the public page
    assert len({a[1], b[1], shared[1]}) == 3 and len({a[2], b[2], shared[2]}) == 3
    assert chain_hashes(t, PT, sc("a", 0))[0] not in (shared[0], chain_hashes(t, PT, sc("b"))[0])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, "a", "b"]), st.integers(0, 3),
                          st.lists(st.integers(0, 2), min_size=1, max_size=5)),
                min_size=1, max_size=12))
def test_tree_matches_the_scoped_chain_model(reqs):
    """With room for everything, a request's hit is the longest run of its scoped chain hashes
    that earlier requests inserted: the tree and the chain agree on every scope."""
    c = CacheController(PT, 256, 0)
    seen: set[bytes] = set()
    for name, public, pages in reqs:
        tokens = seq(*pages)
        s = make_scope(name, public * PT, PT)
        chains = chain_hashes(tokens, PT, s)
        want = 0
        while want < len(chains) and chains[want] in seen:
            want += 1
        assert c.peek(tokens, s) == (want * PT, 0)
        assert serve(c, tokens, s).device_len == want * PT
        seen.update(chains)


def test_snapshots_stay_in_their_scope():
    from hicache.controller import SnapshotSettings
    c = CacheController(PT, 32, 0, snapshots=SnapshotSettings(8, 0, 0))
    a, b = sc("a", 1), sc("b", 1)
    serve(c, seq(1, 2, 3, 4), a)
    assert [s.pages for s in c.snaps.attach(seq(1, 2, 3, 4), [PT, 4 * PT], a)] == [1, 4]
    assert c.snaps.limit(seq(1, 2, 3, 4), scope=a)[:2] == (4 * PT, 4 * PT)
    assert c.snaps.limit(seq(1, 2, 3, 4), scope=b)[:2] == (PT, PT)  # the public page's only
    assert c.snaps.limit(seq(1, 2, 3, 4))[:2] == (PT, PT)
    assert c.snaps.attach(seq(1, 2, 3, 4), [4 * PT], b) == []  # b has no such page cached
    c.check()
