"""HostKVPool: layouts, page access for L3, sizing and host-memory checks, pinning rules."""

import psutil
import pytest
import torch

from hicache.errors import ConfigError, HostMemoryError, UsageError
from hicache.l2.pool import HostKVPool, check_host_memory, host_pages_for
from hicache.layout import DCPLayout

LAY = DCPLayout(2, 1, 4)


@pytest.mark.parametrize("kind,shape", [("layer_first", (3, 20, 6)), ("page_first", (5, 3, 4, 6))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layouts_and_page_access(kind, shape, dtype):
    h = HostKVPool(LAY, 3, 6, dtype, 5, layout_kind=kind, pin="off")
    assert h.buf.shape == shape and not h.buf.any() and not h.pinned
    assert h.bytes_per_page == 3 * 4 * 6 * h.buf.element_size()
    assert h.page_view(2).shape == (3, 4, 6)
    assert h.page_view(2).is_contiguous() == (kind == "page_first")
    page = torch.randn(3, 4, 6).to(dtype)
    h.write_page(2, page)
    assert torch.equal(h.read_page(2), page) and h.read_page(2).is_contiguous()
    # layer views see the same data at [layer][page]
    for layer in range(3):
        assert torch.equal(h.layer_pages(layer)[2], page[layer])
        assert h.layer_pages(layer).shape == (5, 4, 6)
    # the other pages are untouched
    others = [p for p in range(5) if p != 2]
    assert all(not h.page_view(p).any() for p in others)
    raw = h.read_page_bytes(2)
    assert isinstance(raw, bytes) and len(raw) == h.bytes_per_page
    h.write_page_bytes(4, raw)
    assert torch.equal(h.read_page(4), page)
    # read_page returns a copy: changing it does not change the pool
    copy = h.read_page(4)
    copy.zero_()
    assert torch.equal(h.read_page(4), page)


def test_page_access_errors():
    h = HostKVPool(LAY, 2, 6, torch.float16, 3, pin="off")
    with pytest.raises(UsageError, match="host page id 3 is outside"):
        h.read_page(3)
    with pytest.raises(UsageError, match="host page id -1"):
        h.page_view(-1)
    with pytest.raises(UsageError, match="dtype torch.float32"):
        h.write_page(0, torch.zeros(2, 4, 6))
    with pytest.raises(UsageError, match=r"shape \[2, 4, 6\], got \[2, 4, 5\]"):
        h.write_page(0, torch.zeros(2, 4, 5, dtype=torch.float16))
    with pytest.raises(UsageError, match="page data has 3 bytes"):
        h.write_page_bytes(0, b"abc")
    with pytest.raises(UsageError, match="layer 2"):
        h.layer_pages(2)
    with pytest.raises(UsageError, match="layout_kind"):
        HostKVPool(LAY, 2, 6, torch.float16, 3, layout_kind="row_first")
    with pytest.raises(UsageError, match="pin"):
        HostKVPool(LAY, 2, 6, torch.float16, 3, pin="yes")


def test_pinning_follows_cuda():
    h = HostKVPool(LAY, 1, 4, torch.float16, 2, pin="auto")
    assert h.pinned == torch.cuda.is_available() == h.buf.is_pinned()
    if torch.cuda.is_available():
        assert HostKVPool(LAY, 1, 4, torch.float16, 2, pin="on").buf.is_pinned()
    else:
        with pytest.raises(UsageError, match="pin='on' needs CUDA"):
            HostKVPool(LAY, 1, 4, torch.float16, 2, pin="on")


def test_sizing():
    assert host_pages_for(10, 100, size_bytes=0, ratio=2.0) == 20
    assert host_pages_for(10, 100, ratio=0.55) == 5
    assert host_pages_for(10, 100, size_bytes=1050) == 10  # bytes win over the ratio
    with pytest.raises(UsageError, match="smaller than one page"):
        host_pages_for(10, 100, size_bytes=50)
    with pytest.raises(UsageError, match="ratio"):
        host_pages_for(10, 100, ratio=0)
    with pytest.raises(UsageError, match="size_bytes"):
        host_pages_for(10, 100, size_bytes=-1)


def test_pool_larger_than_host_memory_fails_before_allocating():
    avail = psutil.virtual_memory().available
    per_page = 4 * 64 * 576 * 2  # layers * P * D * bf16
    pages = int(avail // per_page * 4) + 1  # four times what is available
    lay = DCPLayout(1, 0, 64)
    rss = psutil.Process().memory_info().rss
    with pytest.raises(HostMemoryError, match=r"host KV pool needs \d+ bytes .* available"):
        HostKVPool(lay, 4, 576, torch.bfloat16, pages, pin="off")
    assert psutil.Process().memory_info().rss < rss + 2**28  # nothing big was allocated
    with pytest.raises(HostMemoryError):
        check_host_memory(avail * 2)
    check_host_memory(1024)  # a small pool fits


def test_node_memory_counts_every_local_rank():
    from hicache.l2.pool import pinned_host_tensor
    from hicache.preflight import MemoryNeed, check_node_memory

    def need(ranks, l2, l1_host=0):
        return MemoryNeed(ranks, l1_host, l2, l1_on_host=l1_host > 0)
    assert need(8, 100).host_total == 800
    assert need(4, 100, 30).host_total == 520  # L1 on the host counts too
    assert check_node_memory(need(8, 100), 1000) == 800
    with pytest.raises(HostMemoryError, match=r"8 rank\(s\) on this node need 1200 bytes .*"
                                              r"\(L2 150 bytes per rank\)"):
        check_node_memory(need(8, 150), 1000)  # one rank alone (150) would fit
    with pytest.raises(HostMemoryError, match=r"L1 50 bytes \+ L2 100 bytes per rank"):
        check_node_memory(need(8, 100, 50), 1000)
    with pytest.raises(ConfigError, match="ranks on the node"):
        MemoryNeed(0, 0, 1, l1_on_host=False)
    # exactly the bytes asked for: no power-of-two rounding (plain memory without CUDA)
    t = pinned_host_tensor((3, 5, 7), torch.bfloat16, pin=torch.cuda.is_available())
    assert t.untyped_storage().nbytes() == 3 * 5 * 7 * 2 and not t.any()
    h = HostKVPool(LAY, 3, 6, torch.float16, 5, pin="auto")
    assert h.buf.untyped_storage().nbytes() == h.nbytes == 5 * 3 * LAY.page_size * 6 * 2


def test_hicache_checks_host_memory_for_the_whole_node(tmp_path, monkeypatch):
    from hicache.config import HiCacheConfig
    from hicache.service import HiCache
    total = psutil.virtual_memory().total
    cfg = HiCacheConfig.from_dict({"l2": {"size_bytes": total // 4}, "l1": {"num_pages": 4}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks x a quarter of the node
    rss = psutil.Process().memory_info().rss
    with pytest.raises(HostMemoryError, match=r"8 rank\(s\) on this node"):
        HiCache(cfg, mode="l1+l2")
    assert psutil.Process().memory_info().rss < rss + 2**28  # refused before allocating
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    small = cfg.replace(l2={"size_bytes": 1 << 20})
    HiCache(small, mode="l1+l2").close()
