"""The API refuses what would cache rows nobody wrote (issue 27, point 4).

- ``finish(rid, tokens)`` with tokens past the rows the engine wrote (at every layer) is a
  ``UsageError``, and the request stays admitted: nothing changed, ``abort`` still works, no
  page or lock leaks. The same for a negative token id past the prompt.
- A ``RowWrite`` whose ``dst`` (or ``src``) is not this rank's rows of its slots, or whose slots
  lie outside its ``pages``, is refused before any row is copied.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.engine.model import MLAModel, ModelConfig
from hicache.engine.runner import DCPRunner, RequestState
from hicache.errors import UsageError
from hicache.kvport import RowWrite, frozen_ids
from helpers import write_kv_rows


def cfg(layers: int = 2) -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "model": {"num_layers": layers, "kv_lora_rank": 32, "rope_dim": 8, "hidden_size": 64,
                  "num_heads": 4, "vocab_size": 128},
        "parallel": {"tp": 1, "dcp": 1}, "cache": {"page_size": 16}, "l1": {"num_pages": 16},
        "l2": {"ratio": 2.0}})


def test_finish_past_the_written_rows_is_refused_and_the_request_stays():
    """The issue's case: 100 rows written, 112 tokens finished (7 whole pages of 16)."""
    with HiCache(cfg(), mode="l1+l2") as cache:
        prompt = np.arange(100) % 120
        cache.admit("a", prompt)
        cache.alloc("a", 112)
        write_kv_rows(cache, "a", 100)
        longer = np.concatenate([prompt, np.arange(12) + 3])
        with pytest.raises(UsageError, match=r"token 100 of 112 has no KV written"):
            cache.finish("a", longer)
        assert cache.prefix("a").page_table  # still admitted: nothing was released
        with pytest.raises(UsageError, match=r"token 100 is -5; token ids are non-negative"):
            cache.finish("a", np.concatenate([prompt, [-5]]))
        with pytest.raises(UsageError, match="token 100 of 120 has no KV"):
            cache.finish("a", np.arange(120))
        cache.finish("a", prompt)  # what was written: cached (6 whole pages)
        cache.drain()
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        # a later request hits exactly the written pages and no more
        p = cache.admit("b", longer)
        assert p.device_len == 96
        cache.abort("b")
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


def test_a_refused_finish_leaves_abort_working_and_nothing_leaked():
    with HiCache(cfg(), mode="l1+l2") as cache:
        cache.admit("a", np.arange(40))
        cache.alloc("a", 41)
        write_kv_rows(cache, "a", 40)
        with pytest.raises(UsageError, match="token 40 is -1"):
            cache.finish("a", np.concatenate([np.arange(40), [-1]]))
        cache.abort("a")  # not "unknown request": the refused finish kept it
        assert cache.request_pages == 0
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


def test_rows_written_at_only_some_layers_are_not_written():
    """A row counts once every layer has it (the last layer's write comes last)."""
    with HiCache(cfg(layers=3), mode="l1") as cache:
        cache.admit("a", np.arange(20))
        table = cache.prefix("a").page_table + cache.alloc("a", 20)
        w = RowWrite.for_positions(cache.kv.layout, torch.tensor(table), table, 0, 20)
        for layer in (0, 1):
            cache.kv.write(layer, w, torch.ones(20, cache.kv.kv_dim))
        with pytest.raises(UsageError, match="token 0 of 20 has no KV written"):
            cache.finish("a", np.arange(20))
        cache.kv.write(2, w, torch.ones(20, cache.kv.kv_dim))
        cache.finish("a", np.arange(20))
        assert cache.leaks()["l1"] == 0


def test_fresh_pages_forget_what_their_previous_owner_wrote():
    with HiCache(cfg(), mode="l1") as cache:
        cache.admit("a", np.arange(20))
        cache.alloc("a", 20)
        write_kv_rows(cache, "a", 20)
        cache.abort("a")  # its pages go back, written
        cache.admit("b", np.arange(50, 70))
        cache.alloc("b", 20)  # most likely the same pages
        with pytest.raises(UsageError, match="token 0 of 20 has no KV written"):
            cache.finish("b", np.arange(50, 70))
        cache.abort("b")


def test_the_engine_runner_writes_what_finish_then_caches():
    """The real write path (DCPRunner over HiCache.kv): a prefill then a decode step; finish
    takes the fed tokens, and one more (never fed back) is refused."""
    mcfg = ModelConfig(num_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, hidden_size=64,
                       num_heads=4, vocab_size=128)
    with HiCache(cfg(), mode="l1") as cache:
        runner = DCPRunner(MLAModel(mcfg), cache.kv, attn_backend="torch")
        prompt = np.arange(31) + 1
        cache.admit("a", prompt)
        cache.alloc("a", 33)
        st = RequestState(page_table=cache.prefix("a").page_table)
        nxt = int(runner.extend(st, prompt.tolist())[-1].argmax())
        runner.extend(st, [nxt])
        fed = np.concatenate([prompt, [nxt]])
        with pytest.raises(UsageError, match="token 32 of 33 has no KV written"):
            cache.finish("a", np.concatenate([fed, [7]]))
        cache.finish("a", fed)
        assert cache.leaks()["l1"] == 0


def _pool_write(cache, table, n=4):
    return RowWrite.for_positions(cache.kv.layout, torch.tensor(table), table, 0, n)


def test_a_row_write_whose_dst_is_not_its_pages_rows_is_refused():
    """The issue's case: pages name the request's own page, dst points into a cached page."""
    with HiCache(cfg(), mode="l1") as cache:
        cache.admit("old", np.arange(20))
        cache.alloc("old", 20)
        write_kv_rows(cache, "old", 20)
        cache.finish("old", np.arange(20))  # page 0 of "old" is cached now
        cached = cache.admit("look", np.arange(17)).page_table[0]
        cache.abort("look")
        cache.admit("a", np.arange(100, 120))
        table = cache.prefix("a").page_table + cache.alloc("a", 20)
        good = _pool_write(cache, table)
        before = cache.l1.kv[:, cached * 16: cached * 16 + 4].clone()
        evil = RowWrite(good.n, good.src, torch.arange(4) + cached * 16, good.pages, good.slots)
        with pytest.raises(UsageError, match="dst .* is not this rank's rows of its slots"):
            cache.kv.write(0, evil, torch.ones(4, cache.kv.kv_dim))
        slots = frozen_ids(np.arange(4, dtype=np.int64) + cached * 16)
        lying = RowWrite(4, None, torch.arange(4) + cached * 16, good.pages, slots)
        with pytest.raises(UsageError, match="which is not among its pages"):
            cache.kv.write(0, lying, torch.ones(4, cache.kv.kv_dim))
        short = RowWrite(4, None, good.dst, good.pages, good.slots[:2])
        with pytest.raises(UsageError, match="slots must be a host int64 array of its n = 4"):
            cache.kv.write(0, short, torch.ones(4, cache.kv.kv_dim))
        assert torch.equal(cache.l1.kv[:, cached * 16: cached * 16 + 4], before)
        assert cache.kv.write(0, good, torch.ones(4, cache.kv.kv_dim)) == 4
        cache.abort("a")
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


# ---- issue 33 point 5: rows at every layer, a RowWrite checked where it is used, draft_len ----
def test_rows_of_the_last_layer_only_are_not_written():
    """The issue's case: only the last layer had rows; layers 0..L-2 were never written."""
    with HiCache(cfg(layers=3), mode="l1") as cache:
        cache.admit("a", np.arange(20))
        table = cache.prefix("a").page_table + cache.alloc("a", 20)
        w = RowWrite.for_positions(cache.kv.layout, torch.tensor(table), table, 0, 20)
        cache.kv.write(2, w, torch.ones(20, cache.kv.kv_dim))
        with pytest.raises(UsageError, match="token 0 of 20 has no KV written at every layer"):
            cache.finish("a", np.arange(20))
        cache.kv.write(0, w, torch.ones(20, cache.kv.kv_dim))  # a layer skipped: still not
        cache.kv.write(2, w, torch.ones(20, cache.kv.kv_dim))
        with pytest.raises(UsageError, match="token 0 of 20 has no KV written"):
            cache.finish("a", np.arange(20))
        for layer in range(3):
            cache.kv.write(layer, w, torch.ones(20, cache.kv.kv_dim))
        cache.finish("a", np.arange(20))
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


def test_a_row_write_edited_in_place_after_its_check_is_checked_again():
    """A RowWrite reused for every layer is checked once; its dst edited in place (into a
    cached page) between two layers is caught at the next write, before a row lands."""
    with HiCache(cfg(), mode="l1") as cache:
        cache.admit("old", np.arange(20))
        cache.alloc("old", 20)
        write_kv_rows(cache, "old", 20)
        cache.finish("old", np.arange(20))
        cached = cache.admit("look", np.arange(17)).page_table[0]
        cache.abort("look")
        cache.admit("a", np.arange(100, 120))
        table = cache.prefix("a").page_table + cache.alloc("a", 20)
        w = _pool_write(cache, table)
        assert cache.kv.write(0, w, torch.ones(4, cache.kv.kv_dim)) == 4  # checked, remembered
        before = cache.l1.kv[:, cached * 16: cached * 16 + 4].clone()
        w.dst.copy_(torch.arange(4) + cached * 16)  # the same object, edited in place
        with pytest.raises(UsageError, match="dst .* is not this rank's rows of its slots"):
            cache.kv.write(1, w, torch.ones(4, cache.kv.kv_dim))
        assert torch.equal(cache.l1.kv[:, cached * 16: cached * 16 + 4], before)
        cache.abort("a")


def _draft_cache():
    from hicache.companions.draft import DraftSpec
    from hicache.page_format import PageFormat
    fmt = PageFormat.replicated(2, 16, 1, 40, torch.float32)
    return HiCache(cfg(), mode="l1", draft=DraftSpec(fmt, "draft-test"))


def _draft_write(cache, rid, end, layers):
    kv, table = cache.draft.kv, cache.prefix(rid).page_table
    w = RowWrite.for_positions(kv.layout, torch.tensor(table), table, 0, end)
    for layer in layers:
        kv.write(layer, w, torch.ones(end, kv.kv_dim))


def test_draft_len_is_not_trusted_without_the_draft_rows():
    with _draft_cache() as cache:
        cache.admit("a", np.arange(40))
        cache.alloc("a", 40)
        write_kv_rows(cache, "a", 40)
        with pytest.raises(UsageError, match=r"draft_len=32 but the draft KV of token 0 was "
                                             "not written at every draft layer"):
            cache.finish("a", np.arange(40), draft_len=32)
        _draft_write(cache, "a", 32, layers=[1])  # the last draft layer only: not written
        with pytest.raises(UsageError, match="draft KV of token 0 was not written"):
            cache.finish("a", np.arange(40), draft_len=32)
        _draft_write(cache, "a", 16, layers=[0, 1])  # page 0 whole, page 1 not
        with pytest.raises(UsageError, match="draft KV of token 16 was not written"):
            cache.finish("a", np.arange(40), draft_len=32)
        with pytest.raises(UsageError, match="draft_len must be an int >= 0"):
            cache.finish("a", np.arange(40), draft_len=-1)
        cache.finish("a", np.arange(40), draft_len=16)  # what was written: kept
        assert cache.stats()["draft"]["l1_pages_present"] == 1
        hit = cache.admit("b", np.arange(40))
        assert hit.device_len == 32 and hit.draft_len == 16
        cache.abort("b")
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


def test_the_draft_writes_through_a_checked_port():
    """Like the target's: a draft write lands only in pages an admitted request holds."""
    with _draft_cache() as cache:
        cache.admit("a", np.arange(20))
        cache.alloc("a", 20)
        free = next(p for p in range(cache.l1.num_pages) if p not in cache.prefix("a").page_table)
        kv = cache.draft.kv
        w = RowWrite.for_positions(kv.layout, torch.tensor([free]), [free], 0, 4)
        with pytest.raises(UsageError, match=f"draft KV write into device page {free}"):
            kv.write(0, w, torch.ones(4, kv.kv_dim))
        assert not cache.draft.l1.kv[:, free * 16: free * 16 + 4].any()
        cache.abort("a")
