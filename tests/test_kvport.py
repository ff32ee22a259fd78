"""The engine's KV port and its per-request device index.

- a decode step and the KV write path issue no op that reads device data back (``.item()``,
  ``nonzero``, boolean-mask indexing, ``unique``, ...): every op the step dispatches is recorded
  on CPU (the same code path as on CUDA) and checked;
- a step indexes only its new positions (no ``arange`` over the whole context);
- the device index follows the host ``RequestState`` (restored KV, page-table growth, a failed
  extend, a replaced page table) and equals the host formula;
- ``HiCache.kv`` refuses a write into a page no admitted request owns, by slots or by a
  ``RowWrite``, like ``write_kv``; ``DeviceKVPool`` and ``HiCache.kv`` are ``KVPort``s.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hicache.errors import HiCacheError, UsageError
from hicache import HiCache, HiCacheConfig
from hicache.engine.model import MLAModel, ModelConfig
from hicache.engine.runner import DCPRunner, RequestState, reserve
from hicache.kvport import CheckedPort, KVPort, RowWrite
from hicache.l1 import DeviceKVPool
from hicache.layout import DCPLayout
from hicache.pages import PageAllocator
from helpers import write_kv_rows

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, kv_lora_rank=16,
                  qk_rope_head_dim=8, intermediate_size=64, seed=3)
PAGE = 4
# ops whose result depends on device data being read back by the host
SYNCING = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
           "aten._unique2", "aten.unique_dim", "aten.unique_consecutive", "aten.is_nonzero",
           "aten.equal", "aten.masked_scatter", "aten.repeat_interleave"}


class Ops(TorchDispatchMode):
    """Every aten op dispatched inside the block, boolean-mask indexing singled out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()
        self.arange_numel = 0
        self.index_copied = 0  # int64 elements copied (index entries)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).rsplit(".", 1)[0]  # aten.<op>, overload dropped
        if func is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            name = "aten.index(bool mask)"
        self.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        if name == "aten.arange":
            self.arange_numel += out.numel()
        if name == "aten.copy_" and args[1].dtype == torch.int64:
            self.index_copied += args[1].numel()
        return out

    def syncing(self) -> dict:
        return {k: v for k, v in self.ops.items()
                if k in SYNCING or k == "aten.index(bool mask)"}


def pool_for(layout: DCPLayout, pages: int = 32) -> DeviceKVPool:
    return DeviceKVPool(layout, CFG.num_layers, CFG.kv_dim, CFG.torch_dtype, pages, device="cpu")


def test_the_recorder_catches_a_host_sync():
    # the checks below could fail: a mask index and .item() are what the recorder flags
    t = torch.arange(6)
    with Ops() as rec:
        t[t % 2 == 0].sum().item()
    assert rec.syncing() == {"aten.index(bool mask)": 1, "aten._local_scalar_dense": 1}


def test_decode_step_reads_nothing_back_and_indexes_only_new_positions():
    model = MLAModel(CFG)
    runner = DCPRunner(model, pool_for(DCPLayout(1, 0, PAGE)), attn_backend="torch")
    st = RequestState()
    reserve(st, PageAllocator(32), 64, PAGE)
    runner.extend(st, list(range(40)))
    runner.extend(st, [4])  # (the index's device vectors grow here: amortised doubling)
    with Ops() as rec:
        runner.extend(st, [5])
    assert rec.syncing() == {}
    assert rec.ops["aten.index_copy_"] == CFG.num_layers  # one KV write per layer
    # the step's index work is its one new position, not the 42-token context: computed on the
    # host, then its pool row and position appended on the device (two one-element copies)
    assert rec.arange_numel == 0 and rec.index_copied == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_write_path_reads_nothing_back_and_stores_what_the_slot_path_stores(rank):
    layout = DCPLayout(2, rank, PAGE, interleave=2)
    fast, ref = pool_for(layout), pool_for(layout)
    st = RequestState(page_table=[7, 3, 9, 12])
    idx = st.device_index(layout, fast.device)
    rows = torch.randn(11, CFG.kv_dim)
    port = CheckedPort(fast, lambda pages: None)
    with Ops() as rec:
        w = idx.advance(0, 11)
        stored = port.write(1, w, rows)
    assert rec.syncing() == {}
    assert stored == layout.local_length(11)
    assert ref.write(1, st.slots(0, 11, layout.page_tokens), rows) == stored
    assert torch.equal(fast.kv, ref.kv)
    assert sorted(w.pages.tolist()) == [3, 7]  # 11 tokens touch the first two pages


def reference(st: RequestState, layout: DCPLayout):
    """Owned pool rows and positions of [0, st.length), by the host formula."""
    slots = st.slots(0, st.length, layout.page_tokens)
    mask = layout.owned_mask(slots)
    return layout.physical(slots[mask]), torch.arange(st.length)[mask]


def test_device_index_follows_the_request_state():
    layout = DCPLayout(2, 1, PAGE)
    page_tokens = layout.page_tokens
    st = RequestState(page_table=[4, 1], length=11)  # KV placed by a cache tier
    idx = st.device_index(layout, torch.device("cpu"))
    rows, pos = reference(st, layout)
    assert torch.equal(idx.rows.view(), rows) and torch.equal(idx.kv_pos.view(), pos)
    st.page_table.append(6)  # alloc appends: the same index goes on
    assert st.device_index(layout, torch.device("cpu")) is idx and idx.pages == 3
    idx.advance(11, 20)
    st.length = 20
    rows, pos = reference(st, layout)
    assert torch.equal(idx.rows.view(), rows) and torch.equal(idx.kv_pos.view(), pos)
    idx.advance(20, 23)  # an extend that failed before length moved: forgotten at next sync
    st.device_index(layout, torch.device("cpu"))
    assert idx.indexed == 20 and torch.equal(idx.rows.view(), rows)
    st.page_table = [0, 2, 5]  # a replaced table: rebuilt from scratch
    idx2 = st.device_index(layout, torch.device("cpu"))
    assert idx2 is not idx
    rows, pos = reference(st, layout)
    assert torch.equal(idx2.rows.view(), rows) and torch.equal(idx2.kv_pos.view(), pos)
    assert st.capacity(page_tokens) == 24


def test_pool_refuses_a_row_write_outside_it():
    pool = pool_for(DCPLayout(1, 0, PAGE), pages=2)
    w = RowWrite.for_positions(pool.layout, torch.tensor([0, 5]), [0, 5], 0, 8)
    with pytest.raises(UsageError, match="page 5 is outside"):
        pool.write(0, w, torch.zeros(8, CFG.kv_dim))


def cache_cfg(path) -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "model": {"num_layers": 2, "kv_lora_rank": 32, "rope_dim": 8, "hidden_size": 64,
                  "num_heads": 4, "vocab_size": 128},
        "parallel": {"tp": 1, "dcp": 1}, "cache": {"page_size": 4}, "l1": {"num_pages": 16},
        "l2": {"ratio": 2.0}})


def test_hicache_port_refuses_cached_pages_by_slots_and_by_row_write(tmp_path):
    cfg = cache_cfg(tmp_path)
    with HiCache(cfg, mode="l1") as cache:
        port = cache.kv
        assert isinstance(port, KVPort) and isinstance(cache.l1, KVPort)
        assert (port.layout, port.device, port.dtype) == (cache.l1.layout, cache.l1.device,
                                                          cache.l1.dtype)
        prompt = np.arange(13)
        p = cache.admit("a", prompt)
        cache.alloc("a", 13)
        write_kv_rows(cache, "a", 13)
        cache.finish("a", prompt)  # its 3 whole pages are now cached
        hit = cache.admit("b", np.concatenate([prompt[:12], [99, 98]]))
        assert hit.device_len == 12
        cache.alloc("b", 16)
        st = RequestState(page_table=hit.page_table, length=0)
        idx = st.device_index(port.layout, port.device)
        rows = torch.zeros(13, cache.l1.kv_dim)
        with pytest.raises(HiCacheError, match="no admitted request owns"):
            port.write(0, idx.advance(0, 13), rows)  # the first 12 positions are cached pages
        with pytest.raises(HiCacheError, match="no admitted request owns"):
            port.write(0, torch.tensor([hit.page_table[0] * 4]), rows[:1])
        own = RowWrite.for_positions(port.layout, torch.tensor(hit.page_table),
                                     hit.page_table, 12, 14)
        assert port.write(0, own, torch.ones(2, cache.l1.kv_dim)) == 2  # every layer is written
        assert port.write(1, own, torch.ones(2, cache.l1.kv_dim)) == 2  # its own page: fine
        assert cache.l1.kv[1, hit.page_table[3] * 4: hit.page_table[3] * 4 + 2].eq(1).all()
        assert cache.request_pages == 1
        cache.finish("b", np.concatenate([prompt[:12], [99]]))
        assert cache.request_pages == 0
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}
        del p


def test_a_write_reused_for_every_layer_is_checked_once_until_a_page_is_released(tmp_path):
    """The write path checks a ``RowWrite``'s pages once for all the layers it is reused for
    (its pages are read-only): a page released in between (the request finished) ends that,
    so the next layer's write is refused; a writable page array is checked every time."""
    with HiCache(cache_cfg(tmp_path), mode="l1") as cache:
        port, dim = cache.kv, cache.l1.kv_dim
        cache.admit("a", np.arange(9))
        table = cache.prefix("a").page_table + cache.alloc("a", 9)
        w = port.plan_write(torch.tensor([table[1] * 4, table[2] * 4 + 1]))
        assert not w.pages.flags.writeable
        with pytest.raises(ValueError):
            w.pages[0] = 15
        idx = RequestState(page_table=table).device_index(port.layout, port.device)
        assert not idx.advance(0, 9).pages.flags.writeable
        for layer in (0, 1):
            assert port.write(layer, w, torch.ones(2, dim)) == 2
        cache.abort("a")  # its pages go back to the free list
        with pytest.raises(HiCacheError, match="no admitted request owns"):
            port.write(0, w, torch.ones(2, dim))
        cache.admit("b", np.arange(100, 109))
        mine = cache.alloc("b", 9)
        pages = np.array([mine[0]], np.int64)  # the caller's own, writable array
        own = RowWrite(1, None, torch.tensor([mine[0] * 4]), pages,
                       np.array([mine[0] * 4], np.int64))
        assert port.write(0, own, torch.ones(1, dim)) == 1
        pages[0] = 15 if mine[0] != 15 else 14  # a page nobody owns, in the same array
        with pytest.raises(HiCacheError, match="no admitted request owns"):
            port.write(1, own, torch.ones(1, dim))
        cache.abort("b")
        assert cache.leaks() == {"l1": 0, "l2": 0, "locks": 0}


@pytest.mark.parametrize("dcp,rank", [(1, 0), (2, 0), (2, 1)])
def test_a_batch_index_is_what_the_device_formula_gives_per_request(dcp, rank):
    """``DCPRunner._index`` computes a batch's index on the host and uploads it once: per
    request the same owned rows and positions as the host formula, and one write whose rows
    are each request's ``RowWrite.for_positions`` (device arithmetic) end to end."""
    layout = DCPLayout(dcp, rank, PAGE, interleave=2)
    runner = DCPRunner(MLAModel(CFG), pool_for(layout, pages=64), attn_backend="torch")
    alloc = PageAllocator(64)
    states, sizes = [], [1, 7, 16, 1]
    for length, k in zip([9, 0, 21, 16], sizes):  # decodes, a prefill, a prefill chunk
        st = RequestState(length=length)
        reserve(st, alloc, length + k, layout.page_tokens)
        st.page_table.reverse()  # pages out of order
        states.append(st)
    refs, base = [], 0
    for st, k in zip(states, sizes):
        table = torch.tensor(st.page_table)
        refs.append(RowWrite.for_positions(layout, table, st.page_table, st.length,
                                           st.length + k, base))
        base += k
    with Ops() as rec:
        write, q_pos, local = runner._index(states, sizes)
    assert rec.syncing() == {} and rec.arange_numel == 0
    want = RowWrite.concat(refs)
    assert write.n == want.n == sum(sizes)
    assert torch.equal(write.dst, want.dst)
    if dcp == 1:  # every input row is kept, in order
        assert write.src is None and torch.equal(want.src, torch.arange(write.n))
    else:
        assert torch.equal(write.src, want.src)
    assert write.pages.tolist() == want.pages.tolist() and not write.pages.flags.writeable
    assert q_pos.tolist() == [p for st, k in zip(states, sizes)
                              for p in range(st.length, st.length + k)]
    for st, k, (rows, pos) in zip(states, sizes, local):
        st.length += k
        ref_rows, ref_pos = reference(st, layout)
        assert torch.equal(rows, ref_rows) and torch.equal(pos, ref_pos)
