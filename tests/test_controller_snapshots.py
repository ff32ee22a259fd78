"""The controller's state snapshot bookkeeping for hybrid models (hicache.controller.snapshots).

A snapshot belongs to the page that ends at its position; a hybrid match is cut back to the
deepest matched page holding one; snapshots move with node splits, go with their node, and are
evicted on their own under pressure (which frees no page and shortens later hits).
"""

import numpy as np
import pytest

from hicache.controller import CacheController, SnapshotSettings
from hicache.errors import UsageError

from test_controller import PT, seq, serve


def ctrl(l1=8, l2=0, every=0, device=16, host=0):
    return CacheController(PT, device, host,
                           snapshots=SnapshotSettings(l1, l2, every))


def test_positions_follow_the_policy():
    assert ctrl().snaps.positions(0, 4 * PT + 3) == [4 * PT]
    assert ctrl(every=2).snaps.positions(0, 5 * PT) == [2 * PT, 4 * PT, 5 * PT]
    assert ctrl(every=2).snaps.positions(2 * PT, 4 * PT) == [4 * PT]  # no duplicate end
    assert ctrl(every=1).snaps.positions(3 * PT, 3 * PT + 2) == []    # no new whole page
    with pytest.raises(UsageError, match="at least one"):
        SnapshotSettings(0)


def test_match_is_cut_back_to_the_deepest_snapshot_and_splits_keep_them():
    c = ctrl()
    serve(c, seq(1, 2, 3, 4))
    assert c.snaps.limit(seq(1, 2, 3, 4)) == (4 * PT, 0, None)  # cached, no snapshot yet
    new = c.snaps.attach(seq(1, 2, 3, 4), [2 * PT, 4 * PT, 3])     # 3: not a page end
    assert [s.pages for s in new] == [2, 4]
    assert c.snaps.limit(seq(1, 2, 3, 4))[:2] == (4 * PT, 4 * PT)
    assert c.snaps.limit(seq(1, 2, 3, 9))[:2] == (3 * PT, 2 * PT)  # 1 page lost
    # a prompt diverging after page 3 splits the node after 3 pages: both snapshots stay
    serve(c, seq(1, 2, 3, 8))
    assert c.tree.num_nodes == 3
    assert sorted(s.pages for s in c.snaps.all()) == [2, 4]
    assert c.snaps.limit(seq(1, 2, 3, 4))[:2] == (4 * PT, 4 * PT)
    assert c.snaps.limit(seq(1, 2, 3, 8))[:2] == (4 * PT, 2 * PT)
    c.snaps.attach(seq(1, 2, 3, 8), [3 * PT])  # the end of the shared node now
    assert c.snaps.limit(seq(1, 2, 3, 8))[:2] == (4 * PT, 3 * PT)
    assert c.snaps.attach(seq(1, 2, 3, 8), [3 * PT]) == []  # already there
    c.check()


def test_pressure_evicts_the_least_recently_used_snapshot_not_pages():
    c = ctrl(l1=2)
    for p in (1, 2, 3):
        serve(c, seq(p, 10 + p))
        c.snaps.attach(seq(p, 10 + p), [2 * PT])
    assert c.snaps.stats.l1_evicted == 1 and c.snaps.stats.dropped == 1
    assert c.snaps.limit(seq(1, 11)) == (2 * PT, 0, None)  # pages kept, snapshot gone
    _, _, s2 = c.snaps.limit(seq(2, 12))
    c.snaps.use(s2)  # a hit: 3 is now the least recently used
    serve(c, seq(4, 14))
    c.snaps.attach(seq(4, 14), [2 * PT])
    assert c.snaps.limit(seq(2, 12))[1] == 2 * PT and c.snaps.limit(seq(3, 13))[1] == 0
    assert c.cached_pages()[0] == 8
    c.check()


def test_snapshots_go_with_their_node_and_outlive_a_device_copy_in_l2():
    c = ctrl(l1=4, device=2)
    serve(c, seq(1, 2))
    c.snaps.attach(seq(1, 2), [PT, 2 * PT])
    serve(c, seq(3, 4))  # evicts 1, 2 (no L2): the node and its snapshots go
    assert c.snaps.all() == [] and c.snaps.stats.dropped == 2
    c.check()
    h = ctrl(l1=1, l2=4, device=2, host=8)
    serve(h, seq(1, 2))
    h.snaps.attach(seq(1, 2), [2 * PT])
    serve(h, seq(3, 4))  # demoted to L2: the snapshot keeps its host slot
    serve(h, seq(5, 6))
    h.snaps.attach(seq(5, 6), [2 * PT])  # takes the only L1 slot
    cached, usable, s = h.snaps.limit(seq(1, 2))
    assert (cached, usable) == (2 * PT, 2 * PT) and s.l1 is None and s.l2 is not None
    assert h.snaps.limit(seq(1, 2), hosted=False)[:2] == (0, 0)
    h.check()


def test_a_plain_controller_has_no_snapshots():
    c = CacheController(PT, 16, 16)
    serve(c, seq(1, 2))
    assert c.snaps is None and not any(e[0] == "snapshots" for e in c.digest())
    assert all(n.snaps is None for n in c.iter_nodes())


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_snapshot_on_its_own_page(seed):
    """Random requests over shared prefixes, with L1 and L2 evicting, splits, snapshot pressure
    and snapshots evicted on their own: every snapshot stays on the page it was attached to
    (its path's tokens are the prefix it was taken after), slots are never lost or shared, and
    ``limit`` only ever names a snapshot inside what it found cached."""
    rng = np.random.default_rng(seed)
    c = ctrl(l1=3, l2=5, every=int(seed % 3), device=8, host=12)
    taken = {}  # id(snap) -> the token prefix it was attached after
    for _ in range(60):
        pages = [int(rng.integers(1, 4))] + [int(rng.integers(1, 6))
                                             for _ in range(int(rng.integers(0, 4)))]
        tokens = seq(*pages, tail=int(rng.integers(0, PT)))
        cached, usable, s = c.snaps.limit(tokens, hosted=True)
        assert usable <= cached and (s is None) == (usable == 0)
        if s is not None:
            assert s.pages * PT == usable and (s.l1 is not None or s.l2 is not None)
            assert np.array_equal(taken[id(s)], tokens[:usable])
        serve(c, tokens)
        for s in c.snaps.attach(tokens, c.snaps.positions(0, len(tokens))):
            taken[id(s)] = tokens[:s.pages * PT].copy()
        if rng.random() < 0.2 and c.snaps.all():
            c.snaps.evict(c.snaps.all()[int(rng.integers(0, len(c.snaps.all())))])
        c.check()
        for s in c.snaps.all():
            assert np.array_equal(c.tree.path_tokens(s.node)[:s.pages * PT], taken[id(s)])
