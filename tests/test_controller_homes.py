"""One home per fact around the controller: the policy file's [policy] section is the
controller's policy, one token coercion and one page-id coercion (``hicache.ids``) serve the
controller, the service, the L3 keys, the allocator and the transfer engine, and the radix walk
compares any query form (short as bytes, long in place, other dtypes converted as it goes)."""

import ast

import numpy as np
import pytest
import torch

from hicache.errors import ConfigError, UsageError
from hicache import ids
from hicache.config import HiCacheConfig, PolicySection
from hicache.controller import EVICTION_POLICIES, WRITE_POLICIES, CacheController
from hicache.controller import controller as controller_module
from hicache.controller import request_pages

PT = 4


def test_policy_is_the_policy_file_section():
    cfg = HiCacheConfig.from_dict({"policy": {"write": "write_back", "eviction": "lfu",
                                              "load_back_threshold": 8}})
    c = CacheController(PT, 8, 8, policy=cfg.policy)
    assert c.policy is cfg.policy or c.policy == cfg.policy
    c = CacheController(PT, 8, 8, policy=cfg.policy, eviction="lru")  # a keyword overrides
    assert (c.policy.write, c.policy.eviction, c.policy.load_back_threshold) == (
        "write_back", "lru", 8)
    assert isinstance(CacheController(PT, 8, 8).policy, PolicySection)
    assert CacheController(PT, 8, 8).policy == PolicySection()      # the file's defaults
    fields = PolicySection.__dataclass_fields__
    assert WRITE_POLICIES == fields["write"].metadata["choices"]
    assert EVICTION_POLICIES == fields["eviction"].metadata["choices"]
    # the file's ranges, with the key named: selective_threshold >= 1 there, so here too
    with pytest.raises(ConfigError, match=r"policy\.selective_threshold"):
        CacheController(PT, 8, 8, selective_threshold=0)
    with pytest.raises(ConfigError, match=r"policy\.write: 'write_often' is not one of"):
        CacheController(PT, 8, 8, write="write_often")
    with pytest.raises(ConfigError, match="unknown controller setting"):
        CacheController(PT, 8, 8, prefetch_s=1)
    with pytest.raises(ConfigError, match="PolicySection"):
        CacheController(PT, 8, 8, policy={"write": "write_back"})


def test_one_coercion_of_each_kind_everywhere():
    from hicache import service
    from hicache.controller import tree
    from hicache import pages as allocator
    from hicache.l2 import transfer
    from hicache.l3 import keys
    assert tree.as_tokens is keys.as_tokens is ids.as_tokens
    assert tree.tree_tokens is service.tree_tokens is ids.tree_tokens  # the cache's int32 form
    assert transfer.page_ids is allocator.page_ids is request_pages.page_ids is ids.page_ids
    assert allocator.UsageError is transfer.UsageError is ids.UsageError
    # tiers may import it: it imports no other part of hicache but the errors (a leaf)
    tree_ = ast.parse(open(ids.__file__).read())
    imported = [a.name for n in ast.walk(tree_) if isinstance(n, ast.Import) for a in n.names]
    imported += [("." * n.level) + (n.module or "") for n in ast.walk(tree_)
                 if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.startswith(("hicache", "."))
                             and m != "hicache.errors"]


@pytest.mark.parametrize("n", [3, 300])  # short lists: a scan of the types; long: numpy
def test_bools_are_never_ids(n):
    good = list(range(2, 2 + n))
    assert ids.page_ids(good).tolist() == good
    assert ids.as_tokens(good).tolist() == good
    for bad in (good[:-1] + [True], [False] + good[1:], good[:-1] + [np.bool_(1)]):
        with pytest.raises(UsageError, match="not an int"):
            ids.page_ids(bad)
        with pytest.raises(ids.UsageError, match="not an int"):
            ids.as_tokens(bad)
        with pytest.raises(ids.UsageError, match="not an int"):
            ids.tree_tokens(bad)
    assert ids.page_ids(good[:-1] + [np.int32(7)])[-1] == 7
    with pytest.raises(UsageError, match="int64 range"):
        ids.page_ids(good + [1 << 64])
    with pytest.raises(UsageError, match="int64 range"):
        ids.page_ids(np.array([1 << 63], np.uint64))
    assert ids.page_ids(np.array([[1, 2], [3, 4]], np.int32)).tolist() == [1, 2, 3, 4]
    with pytest.raises(UsageError, match="integer page ids"):
        ids.page_ids(torch.tensor([0.5]))


def test_grants_are_a_shortcut_not_a_rule():
    c = CacheController(PT, 64, 0)
    a = c.alloc_device(3)
    toks = np.arange(3 * PT, dtype=np.int64)
    c.free_device(a)                                  # given back another way: stale grant
    with pytest.raises(UsageError, match="not allocated"):
        c.insert(toks, a)                             # the shortcut still checks ownership
    b = c.alloc_device(3)                             # the same ids again (LIFO order)
    assert sorted(b) == sorted(a)
    r = c.insert(toks, b)
    assert list(r.device_pages) == b and c.request_pages == frozenset()
    for _ in range(controller_module._MAX_GRANTS + 5):  # never given back: bounded memory
        c.free_device(c.alloc_device(1))
    assert len(c._grants) <= controller_module._MAX_GRANTS
    c.check()


def _serve(c, toks):
    m = c.match(toks)
    h = c.lock(m)
    new = c.alloc_device(len(toks) // PT - len(m.device_pages))
    r = c.insert(toks, m.device_pages.tolist() + new)
    c.unlock(h)
    return r


@pytest.mark.parametrize("form", ["int64", "int32", "strided", "tensor", "list"])
def test_walk_long_queries_in_every_form(form):
    """A prompt past the 64 KiB the walk first converts: matched in place (int64) or converted
    as the walk goes (other forms), diverging or ending inside a node past that point."""
    n = 3 * 8192  # tokens: 192 KiB as int64
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, n, dtype=np.int64)
    c = CacheController(PT, 2 * n // PT + 8, 0)
    _serve(c, base)

    def as_form(a):
        if form == "int32":
            return a.astype(np.int32)
        if form == "strided":
            return np.repeat(a, 2)[::2]
        if form == "tensor":
            return torch.from_numpy(a.copy())
        return a.tolist() if form == "list" else a

    assert c.match(as_form(base)).device_len == n
    other = base.copy()
    other[n - 1000] += 1                              # differs in page (n - 1000) // PT
    assert c.match(as_form(other)).device_len == (n - 1000) // PT * PT
    assert c.match(as_form(base[:n - 998])).device_len == (n - 998) // PT * PT
    r = _serve(c, as_form(other))                     # shares the split prefix
    assert r.new_pages == n // PT - (n - 1000) // PT
    assert c.match(as_form(base)).device_len == n
    c.check()
