"""PD relayout plans and their local execution: exact rows, no leaks, clear errors.
(The multi-process hand-off that decodes like a DCP prefill is in test_pcp_multirank.py.)"""

import pytest
import torch

from hicache.errors import TopologyError
from hicache.l1.pool import DeviceKVPool
from hicache.layout import DCPLayout
from hicache.pcp.relayout import pack_shard, plan_pd_transfer, relayout_local, unpack_shard

P = 4  # decode physical page size
P_SRC = 8  # the prefill instance's page size


def test_relayout_local_and_errors():
    torch.manual_seed(0)
    length, c, layers, dim = 11, 4, 2, 6
    src_pages = [2, 0]  # dense pages of 8 rows, partial last page
    src = torch.randn(layers, 3 * P_SRC, dim)
    plan = plan_pd_transfer(length, 1, P_SRC, src_pages, c, P, [1])
    pools = [DeviceKVPool(DCPLayout(c, r, P), layers, dim, torch.float32, 2, device="cpu")
             for r in range(c)]
    stored = relayout_local(plan, [src], pools)
    assert stored == [DCPLayout(c, r, P).local_length(length) for r in range(c)]
    for pos in range(length):
        src_row = src_pages[pos // P_SRC] * P_SRC + pos % P_SRC
        slot = 1 * P * c + pos
        r = slot % c
        assert torch.equal(pools[r].kv[:, slot // c], src[:, src_row])
    assert sum(int(p.kv.abs().sum(-1).gt(0).sum()) for p in pools) == length * layers
    # other DCP size changes are refused with a clear message
    with pytest.raises(TopologyError, match="DCP 2 to DCP 4"):
        plan_pd_transfer(8, 2, P, [0], 4, P, [0])
    with pytest.raises(TopologyError, match="decode page table"):
        plan_pd_transfer(40, 1, P_SRC, list(range(5)), 2, P, [0])
    with pytest.raises(TopologyError, match="exact token rows"):
        unpack_shard(pools[1], plan.transfers[1], torch.zeros(layers, 99, dim))
    with pytest.raises(TopologyError, match="decode rank 1"):
        unpack_shard(pools[0], plan.transfers[1], pack_shard(src, plan.transfers[1]))
    with pytest.raises(TopologyError, match="sources"):
        relayout_local(plan, [src, src], pools)
