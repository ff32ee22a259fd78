"""``CacheController.peek``: the (device_len, host_len) that ``match`` would return, read-only.

A scheduler asks it before admitting a request (does it fit without evicting?), so it must
agree with ``match`` on every tree shape (device part, host-only part after it, a node covered
only in part) and change nothing: no split, no LRU touch, no stats, no lock."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.controller import CacheController

PT = 2

# prompts over a 3-token alphabet share prefixes and diverge inside nodes
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=14).map(
    lambda t: np.asarray(t, dtype=np.int64))
actions = st.lists(st.one_of(
    st.tuples(st.just("insert"), prompts),
    st.tuples(st.just("backup"), st.just(None)),     # complete the backups in flight
    st.tuples(st.just("evict"), st.integers(1, 4)),  # free device pages (host copies stay)
), max_size=12)


def run_actions(ctrl: CacheController, acts) -> None:
    for kind, arg in acts:
        if kind == "insert":
            m = ctrl.match(arg)
            whole = len(arg) // PT
            new = whole - m.device_len // PT
            if new <= 0:
                continue
            if ctrl.device.num_free < new:
                ctrl.evict_device(new - ctrl.device.num_free)
            if ctrl.device.num_free < new:
                continue
            pages = list(m.device_pages) + list(ctrl.alloc_device(new))
            ctrl.insert(arg[:whole * PT], pages)
        elif kind == "backup":
            ctrl.take_ops()
            ctrl.complete(ctrl.inflight_ops())
        else:
            ctrl.evict_device(arg)


@settings(max_examples=150, deadline=None)
@given(acts=actions, queries=st.lists(prompts, min_size=1, max_size=6))
def test_peek_is_match_without_side_effects(acts, queries):
    ctrl = CacheController(PT, device_pages=10, host_pages=16, write="write_through")
    run_actions(ctrl, acts)
    for q in queries:
        before = (ctrl.digest(), ctrl.tree.num_nodes, ctrl.stats.matches,
                  list(ctrl._dev), list(ctrl._hst))
        got = ctrl.peek(q)
        assert (ctrl.digest(), ctrl.tree.num_nodes, ctrl.stats.matches,
                list(ctrl._dev), list(ctrl._hst)) == before
        m = ctrl.match(q)
        assert got == (m.device_len, m.host_len)
    ctrl.check()


def test_peek_counts_a_node_covered_in_part_and_the_host_part():
    ctrl = CacheController(PT, device_pages=4, host_pages=8, write="write_through")
    a = np.arange(8, dtype=np.int64)          # 4 pages, one node
    ctrl.insert(a, ctrl.alloc_device(4))
    assert ctrl.peek(a[:5]) == (4, 0)         # 2 of the node's 4 pages, no split
    assert ctrl.tree.num_nodes == 1
    ctrl.take_ops()
    ctrl.complete(ctrl.inflight_ops())        # backed up
    ctrl.evict_device(4)                      # now host only
    assert ctrl.peek(a) == (0, 8) and ctrl.peek(a[:7]) == (0, 6)
    assert ctrl.peek(np.array([9, 9, 9], np.int64)) == (0, 0)
    m = ctrl.match(a[:7])
    assert (m.device_len, m.host_len) == (0, 6)
