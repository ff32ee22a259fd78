"""DualChunkSwap partition: coverage, chunk shape, causal-work formula and balance."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.errors import TopologyError
from hicache.pcp.partition import DualChunkSwap, causal_pairs, contiguous_work_per_rank


@settings(max_examples=150, deadline=None)
@given(length=st.integers(0, 3000), n=st.integers(1, 8))
def test_partition_covers_every_position_once(length, n):
    part = DualChunkSwap(length, n)
    allpos = torch.cat([part.positions(r) for r in range(n)])
    assert sorted(allpos.tolist()) == list(range(length))
    for r in range(n):
        pos = part.positions(r)
        assert pos.dtype == torch.int64
        assert torch.all(pos[1:] > pos[:-1])  # ascending
        assert part.num_positions(r) == pos.numel()
        for p in pos.tolist()[:: max(1, len(pos) // 7)]:
            assert part.owner_of(p) == r
    # chunks: all full-size except a short tail; rank r holds chunks r and 2N-1-r
    sizes = [part.chunk(i).size for i in range(2 * n)]
    cs = part.chunk_size
    assert cs == -(-length // (2 * n))
    first_short = next((i for i, s in enumerate(sizes) if s < cs), 2 * n)
    assert all(s == cs for s in sizes[:first_short])
    assert all(s == 0 for s in sizes[first_short + 1:])
    early, late = part.rank_chunks(n - 1)
    assert (early.index, late.index) == (n - 1, n)


@settings(max_examples=150, deadline=None)
@given(length=st.integers(0, 2000), n=st.integers(1, 6))
def test_causal_work_matches_brute_force(length, n):
    part = DualChunkSwap(length, n)
    for r in range(n):
        brute = int((part.positions(r) + 1).sum())
        assert part.causal_work(r) == brute
    assert sum(part.work_per_rank()) == length * (length + 1) // 2
    assert sum(contiguous_work_per_rank(length, n)) == length * (length + 1) // 2


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 500), n=st.integers(1, 8))
def test_exact_balance_when_divisible(k, n):
    part = DualChunkSwap(2 * n * k, n)
    assert len(set(part.work_per_rank())) == 1
    assert part.imbalance() == 0.0


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("length", [32 * 1024 + 7, 100_003, 131_072])
def test_balance_for_long_prompts_within_a_few_percent(n, length):
    part = DualChunkSwap(length, n)
    assert part.imbalance() < 0.02
    naive = contiguous_work_per_rank(length, n)
    # the naive contiguous split is badly skewed: the last rank does ~2N-1 times the first
    assert max(naive) / min(naive) > 2 * n - 1.5


def test_causal_pairs_and_errors():
    assert causal_pairs(0, 1) == 1 and causal_pairs(0, 4) == 10 and causal_pairs(2, 4) == 7
    assert causal_pairs(5, 5) == 0
    with pytest.raises(TopologyError, match="pcp_size"):
        DualChunkSwap(10, 0)
    with pytest.raises(TopologyError, match="length"):
        DualChunkSwap(-1, 2)
    with pytest.raises(TopologyError, match="rank 2"):
        DualChunkSwap(10, 2).positions(2)
    with pytest.raises(TopologyError, match="position 10"):
        DualChunkSwap(10, 2).owner_of(10)
    short = DualChunkSwap(3, 4)  # fewer tokens than chunks: empty chunks, no padding
    assert [short.num_positions(r) for r in range(4)] == [1, 1, 1, 0]
