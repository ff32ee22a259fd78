"""Token ids in the cache are int32 (``hicache.ids.TOKEN``: every vocabulary fits): the radix
tree holds four bytes per token, any integer form of the same ids matches alike, and an id
outside int32 is refused by name with nothing changed (controller and service)."""

from array import array

import numpy as np
import pytest
import torch

from hicache.controller import CacheController
from hicache.errors import UsageError
from hicache.service import HiCache

from helpers import make_cfg

PT = 16


def cache(ctrl, tokens):
    m = ctrl.match(tokens, lock=True)
    new = ctrl.alloc_device(len(tokens) // PT - m.device_len // PT, as_array=True)
    return ctrl.insert(tokens, np.concatenate((m.device_pages, new)), after=m.lock)


def test_the_tree_holds_four_bytes_per_token_and_every_int_form_matches_alike():
    ctrl = CacheController(PT, 32, 0)
    t64 = np.arange(4 * PT, dtype=np.int64) * 1000 + (1 << 30)
    res = cache(ctrl, t64)
    assert len(res.last_node.tokens) == 4 * len(t64)  # int32 bytes, not int64's
    assert ctrl.tree.path_tokens(res.last_node).dtype == np.int32
    assert np.array_equal(ctrl.tree.path_tokens(res.last_node), t64)
    forms = [t64, t64.astype(np.int32), t64.tolist(), torch.tensor(t64), t64.astype(np.uint32),
             array("q", t64.tolist()), np.repeat(t64, 2)[::2]]  # (the last strided: converted)
    for form in forms:
        assert ctrl.match(form).device_len == len(t64)
        assert ctrl.peek(form) == (len(t64), 0)
    ctrl.check()


@pytest.mark.parametrize("bad, words", [
    (lambda t: t.tolist()[:17] + [1 << 31] + t.tolist()[18:], "token 17 is 2147483648"),
    (lambda t: np.concatenate([t[:5], [-(1 << 31) - 1], t[6:]]), "token 5 is -2147483649"),
    (lambda t: np.concatenate([t[:3], [1 << 32], t[4:]]).astype(np.uint64),
     "token 3 is 4294967296"),
])
def test_a_token_id_outside_int32_is_refused_by_name_and_changes_nothing(bad, words, tmp_path):
    ctrl = CacheController(PT, 32, 0)
    good = np.arange(3 * PT, dtype=np.int64)
    cache(ctrl, good)
    before, stats = ctrl.tree.digest(), (ctrl.stats.matches, ctrl.stats.inserts)
    tokens = bad(good)
    with pytest.raises(UsageError, match=words + r": token ids must fit int32"):
        ctrl.match(tokens)
    pages = ctrl.alloc_device(3, as_array=True)
    with pytest.raises(UsageError, match=words):
        ctrl.insert(tokens, pages)
    ctrl.free_device(pages)
    assert ctrl.tree.digest() == before and (ctrl.stats.matches, ctrl.stats.inserts) == stats
    edge = np.array([-(1 << 31), (1 << 31) - 1] * (PT // 2) * 2, np.int64)  # the bounds fit
    assert cache(ctrl, edge).new_pages == 2
    ctrl.check()
    with HiCache(make_cfg(tmp_path / "l3"), 0, None, mode="l1") as hc:
        with pytest.raises(UsageError, match=words):
            hc.admit("r", tokens)
        assert hc.stats()["requests"] == 0
        hc.admit("r", good)  # the id was not taken by the refused admission
