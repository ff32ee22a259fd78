"""Unit tests of the cache controller: tree, policies, load-back, bad input, local agreement."""

import numpy as np
import pytest
import torch

from hicache.controller import BackupOp, CacheController, LoadOp, StepAgreement
from hicache.distributed import CollectiveCounter
from hicache.errors import ConfigError, DeviceFullError, UsageError

PT = 4  # widened page: e.g. P=2, c=2


def seq(*pages, tail=0):
    """Token ids: one page per int (page k = [k*100, k*100+1, ...]) plus ``tail`` extra ids."""
    out = [p * 100 + i for p in pages for i in range(PT)]
    return np.array(out + [7777 + i for i in range(tail)], dtype=np.int64)


def serve(ctrl, tokens, complete=True):
    """One request as the embedding layer runs it; returns (match, load op, insert result)."""
    m = ctrl.match(tokens)
    h = ctrl.lock(m)
    ld = ctrl.load_back(m)
    have = m.device_len // PT + (len(ld.device_pages) if ld else 0)
    new = ctrl.alloc_device(len(tokens) // PT - have)
    pages = list(m.device_pages) + (list(ld.device_pages) if ld else []) + new
    r = ctrl.insert(tokens, pages)
    ctrl.unlock(h)
    if complete:
        ctrl.take_ops()
        ctrl.complete(ctrl.inflight_ops())
    ctrl.check()
    return m, ld, r


def test_match_insert_split_and_duplicates():
    c = CacheController(PT, 16, 16)
    assert c.match(seq(1, 2, 3)).device_len == 0
    serve(c, seq(1, 2, 3, tail=2))          # tail tokens are not cached
    m = c.match(seq(1, 2, 3, 4))
    assert (m.device_len, m.host_len) == (3 * PT, 0)
    m = c.match(seq(1, 2, 9))               # diverges inside a node: split at page 2
    assert m.device_len == 2 * PT and len(m.device_pages) == 2
    c.check()
    # a second request computed the same prefix in its own pages: they come back as duplicates
    own = c.alloc_device(3)
    r = c.insert(seq(1, 2, 5), own)
    assert set(r.freed) == set(own[:2]) and r.new_pages == 1
    assert r.device_pages[:2].tolist() == m.device_pages.tolist() and r.device_pages[2] == own[2]
    assert c.device.num_used == 4
    c.check()
    # a partially matching page does not count
    t = seq(1, 2)
    t[PT + 1] += 1
    assert c.match(t).device_len == PT


def test_tokens_types_accepted_and_rejected():
    c = CacheController(PT, 8, 8)
    serve(c, seq(1, 2))
    for t in (seq(1, 2).tolist(), torch.tensor(seq(1, 2)), seq(1, 2).astype(np.int32)):
        assert c.match(t).device_len == 2 * PT
    for bad in ([1.0, 2.0], np.ones(8, np.float32), torch.ones(8), np.ones((2, 4), np.int64),
                "abcd", [True, False], None):
        with pytest.raises(UsageError):
            c.match(bad)


def test_bad_input_errors():
    c = CacheController(PT, 8, 8)
    m = c.match(seq(1))
    h = c.lock(m)
    c.unlock(h)
    with pytest.raises(UsageError, match="already released"):
        c.unlock(h)
    serve(c, seq(1, 2))
    node = c.match(seq(1, 2)).last_node
    with pytest.raises(UsageError, match="without a matching lock"):
        c.unlock(node)
    with pytest.raises(UsageError, match="not allocated"):
        c.insert(seq(3), [5])                     # never handed out
    with pytest.raises(UsageError, match="owned by a cached node"):
        c.insert(seq(3), [c.match(seq(1)).device_pages[0]])
    p = c.alloc_device(2)
    with pytest.raises(UsageError, match="twice"):
        c.insert(seq(3, 4), [p[0], p[0]])
    with pytest.raises(UsageError, match="2 whole pages"):
        c.insert(seq(3, 4), p + [p[0] + 1])    # a third page with no tail to hold
    with pytest.raises(UsageError, match="int"):
        c.alloc_device(-1)
    with pytest.raises(UsageError):
        c.complete([12345])
    c.free_device(p)
    with pytest.raises(UsageError):
        c.free_device(p)
    with pytest.raises(ConfigError):
        CacheController(PT, 8, 8, write="write_sometimes")
    with pytest.raises(ConfigError):
        CacheController(PT, 8, 8, eviction="fifo")
    with pytest.raises(ConfigError):
        CacheController(PT, 8, 8, selective_threshold=-1)
    c.check()


def test_write_through_backup_then_host_hit_and_load_back():
    c = CacheController(PT, 3, 8)
    _, _, r = serve(c, seq(1, 2), complete=False)
    ops = c.take_ops()
    assert ops == [BackupOp(0, tuple(r.device_pages.tolist()), ops[0].host_pages)]
    # until the backup is agreed complete, the device pages cannot be evicted
    assert c.evict_device(2) == 0
    c.complete([0])
    assert c.evict_device(2) == 2                  # demoted to host
    m = c.match(seq(1, 2, 3))
    assert (m.device_len, m.host_len) == (0, 2 * PT) and tuple(m.host_pages.tolist()) == ops[0].host_pages
    h = c.lock(m)
    ld = c.load_back(m)
    assert isinstance(ld, LoadOp) and ld.host_pages == tuple(m.host_pages.tolist())
    m2 = c.match(seq(1, 2))
    assert m2.device_len == 2 * PT and m2.wait_ops == (ld.op_id,)
    assert c.evict_device(2) == 0                 # locked and loading
    c.unlock(h)
    assert c.evict_device(2) == 0                 # still loading
    c.take_ops()
    c.complete([ld.op_id])
    assert c.match(seq(1, 2)).wait_ops == ()
    c.check()


def test_load_back_needs_lock_and_threshold():
    c = CacheController(PT, 4, 8, load_back_threshold=3 * PT)
    serve(c, seq(1, 2))
    c.evict_device(2)
    m = c.match(seq(1, 2))
    assert m.host_len == 2 * PT
    with pytest.raises(UsageError):
        c.load_back(m)
    h = c.lock(m)
    assert c.load_back(m) is None                 # 8 tokens < threshold 12: recompute
    new = c.alloc_device(2)                       # recomputed: the host-only nodes adopt them
    r = c.insert(seq(1, 2), new)
    assert len(r.freed) == 0 and r.device_pages.tolist() == new
    c.unlock(h)
    assert c.match(seq(1, 2)).device_len == 2 * PT
    c.check()


def test_write_back_backs_up_on_eviction_only():
    c = CacheController(PT, 2, 8, write="write_back")
    serve(c, seq(1, 2), complete=False)
    assert c.take_ops() == []
    with pytest.raises(DeviceFullError, match="pending"):
        c.alloc_device(2)
    ops = c.take_ops()
    assert len(ops) == 1 and isinstance(ops[0], BackupOp) and len(ops[0].device_pages) == 2
    assert c.match(seq(1, 2)).device_len == 2 * PT     # still usable while backing up
    c.complete([ops[0].op_id])
    assert c.device.num_free == 2
    assert c.match(seq(1, 2)).host_len == 2 * PT
    c.check()


def test_write_back_eviction_cancelled_when_locked():
    c = CacheController(PT, 2, 8, write="write_back")
    serve(c, seq(1, 2))
    with pytest.raises(DeviceFullError):
        c.alloc_device(1)
    (op,) = c.take_ops()
    h = c.lock(c.match(seq(1, 2)))
    c.complete([op.op_id])
    m = c.match(seq(1, 2))
    assert m.device_len == 2 * PT                    # locked: kept on device, now also on host
    c.unlock(h)
    assert c.evict_device(2) == 2                    # host copy valid: plain demotion
    c.check()


def test_write_through_selective_threshold():
    c = CacheController(PT, 8, 8, write="write_through_selective", selective_threshold=2)
    serve(c, seq(1, 2), complete=False)
    assert c.take_ops() == []                        # first use
    serve(c, seq(1, 2, 3), complete=False)
    ops = c.take_ops()                               # second use of pages 1,2 -> backed up
    assert [len(o.device_pages) for o in ops] == [2]
    c.complete(c.inflight_ops())
    serve(c, seq(1, 2, 3), complete=False)
    assert [len(o.device_pages) for o in c.take_ops()] == [1]   # page 3 reached 2 uses
    c.complete(c.inflight_ops())
    c.check()


@pytest.mark.parametrize("eviction,expect_left", [("lru", 2), ("lfu", 1)])
def test_lru_and_lfu_order(eviction, expect_left):
    c = CacheController(PT, 2, 0, eviction=eviction)
    serve(c, seq(1))
    serve(c, seq(1))                                 # page 1 used twice
    serve(c, seq(2))                                 # page 2 used once, more recently
    assert c.evict_device(1) == 1
    left = 1 if c.match(seq(1)).device_len else 2
    assert left == expect_left
    c.check()


def test_l2_evicts_copies_of_l1_resident_nodes():
    c = CacheController(PT, 8, 2)
    serve(c, seq(1, 2))                              # both pages on device and host
    assert c.host.num_free == 0
    serve(c, seq(3))                                 # needs a host page: drops an L1 copy's
    assert c.stats.host_evicted_pages == 2 and c.stats.backups_skipped_pages == 0
    m = c.match(seq(1, 2))
    assert m.device_len == 2 * PT                    # still on device
    c.check()


def test_host_only_leaf_evicted_and_locked_host_kept():
    c = CacheController(PT, 2, 2)
    serve(c, seq(1, 2))
    c.evict_device(2)
    h = c.lock(c.match(seq(1, 2)))
    assert c.evict_host(2) == 0                      # locked
    c.unlock(h)
    assert c.evict_host(2) == 2
    assert c.match(seq(1, 2)).total_len == 0 and c.tree.num_nodes == 0
    c.check()


def test_stale_node_and_dropped_subtree():
    c = CacheController(PT, 2, 0)                    # no L2: eviction drops
    serve(c, seq(1, 2))
    m = c.match(seq(1, 2))
    assert c.evict_device(2) == 2 and c.stats.dropped_pages == 2
    with pytest.raises(UsageError):
        c.lock(m)
    c.check()


def test_local_agreement_issues_no_collective():
    a = StepAgreement()
    assert a.local
    with CollectiveCounter.measure() as n:
        res = a.step([3, 5, 9], {5}, extras=[7, -1])
    assert n["n"] == 0 and res.done_ops == (5,) and res.extras == (7, -1)
    assert a.step([1, 2], [True, False]).done_ops == (1,)
    with pytest.raises(Exception, match="not in flight"):
        a.step([1], {2})
    with pytest.raises(Exception, match="ascending"):
        a.step([2, 1], set())
    c = CacheController(PT, 4, 4)
    serve(c, seq(1), complete=False)
    (op,) = c.take_ops()
    c.agree(a, set())
    assert c.inflight_ops() == [op.op_id]
    c.agree(a, {op.op_id})
    assert c.inflight_ops() == []
    c.check()
