"""The controller's memory and its walk shortcuts: a dropped controller frees its tree at once
(no cyclic-GC pass), a walk compares an only child in place but never enters a scoped one, and
the page key a walk missed is only a hint (an insert that gets a wrong one caches the same)."""

import gc
import tracemalloc

import numpy as np

from hicache.controller import CacheController
from hicache.ids import tree_tokens
from hicache.scope import Scope, scope_tag

PT = 64


def toks(*blocks: int) -> np.ndarray:
    """One page of tokens per block id (equal ids: equal pages)."""
    return np.concatenate([np.full(PT, b, np.int64) + np.arange(PT) for b in blocks])


def cache(ctrl: CacheController, tokens: np.ndarray, scope=None):
    m = ctrl.match(tokens, lock=True, scope=scope)
    new = ctrl.alloc_device(len(tokens) // PT - m.device_len // PT, as_array=True)
    return ctrl.insert(tokens, np.concatenate((m.device_pages, new)), after=m.lock, scope=scope)


def test_a_dropped_controller_frees_its_tree_without_a_gc_pass():
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        ctrl = CacheController(PT, 4096, 0)
        for r in range(40):  # a chain of turns and branches: parents, children, splits
            cache(ctrl, toks(1, 2, *range(1000 * r, 1000 * r + 30)))
            cache(ctrl, toks(1, 2, *range(1000 * r, 1000 * r + 20), 7, 8))
        held = tracemalloc.get_traced_memory()[0] - base
        assert held > 40 * 30 * PT * 8  # the tree holds every cached token
        del ctrl
        left = tracemalloc.get_traced_memory()[0] - base
        assert left < held / 20, (held, left)
    finally:
        tracemalloc.stop()
        gc.enable()


def test_an_only_child_in_a_scope_is_not_matched_from_the_shared_scope():
    sc = Scope(scope_tag(b"tenant"), 1)
    ctrl = CacheController(PT, 64, 0)
    cache(ctrl, toks(1, 2, 3), scope=sc)  # shared page 1, then the tenant's pages 2, 3
    (shared,) = ctrl.tree.root.children.values()
    assert len(shared.children) == 1  # the tenant's leaf, its only child
    assert ctrl.match(toks(1, 2, 3)).device_len == PT
    assert ctrl.match(toks(1, 2, 3), scope=sc).device_len == 3 * PT
    res = cache(ctrl, toks(1, 2, 3))  # the shared scope's own copy of pages 2, 3
    assert res.new_pages == 2 and len(shared.children) == 2
    assert ctrl.match(toks(1, 2, 3, 4)).device_len == 3 * PT
    ctrl.check()


def test_a_wrong_key_hint_caches_what_no_hint_does():
    ctrl = CacheController(PT, 64, 0)
    cache(ctrl, toks(1, 2))
    cache(ctrl, toks(1, 3))  # page 1 now has two children: lookups hash a page key
    m = ctrl.match(toks(1, 2, 9), lock=True)
    assert m.device_len == 2 * PT
    m.lock.key = tree_tokens(toks(4)).tobytes()  # not the page looked up: ignored
    new = ctrl.alloc_device(1, as_array=True)
    res = ctrl.insert(toks(1, 2, 9), np.concatenate((m.device_pages, new)), after=m.lock)
    assert res.new_pages == 1 and not len(res.freed)
    m = ctrl.match(toks(1, 5, 9), lock=True)  # misses page 5 under page 1
    cache(ctrl, toks(1, 5, 9))  # meanwhile another request caches pages 5, 9
    m.lock.key = tree_tokens(toks(5, 9)).tobytes()  # starts with the page looked up but is longer: ignored
    new = ctrl.alloc_device(2, as_array=True)
    res = ctrl.insert(toks(1, 5, 9), np.concatenate((m.device_pages, new)), after=m.lock)
    assert res.new_pages == 0 and sorted(res.freed.tolist()) == sorted(new.tolist())
    m = ctrl.match(toks(1, 4), lock=True)  # misses page 4 under page 1: the hint is its key
    assert m.device_len == PT and m.lock.key == tree_tokens(toks(4)).tobytes()
    new = ctrl.alloc_device(1, as_array=True)
    res = ctrl.insert(toks(1, 4), np.concatenate((m.device_pages, new)), after=m.lock)
    assert res.new_pages == 1
    assert [ctrl.match(toks(1, b)).device_len for b in (2, 3, 4, 5, 6)] == [2 * PT] * 4 + [PT]
    ctrl.check()
