"""Single-process properties of context-parallel attention: run splitting, and both modes equal
plain causal attention over the same rows for any position order (world size 1). The multi-rank
runs are in test_pcp_multirank.py."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.engine.attention import attend_latent
from hicache.errors import UsageError
from hicache.pcp.ring import ContextParallelAttention, KVPlacement, contiguous_runs

R, DR, H = 8, 4, 2


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True, max_size=40), st.integers(0, 7))
def test_contiguous_runs_partition_positions(pos, chunk):
    runs = contiguous_runs(torch.tensor(pos, dtype=torch.int64), chunk)
    assert sum(r.hi - r.lo for r in runs) == len(pos)
    lo = 0
    for run in runs:
        assert run.lo == lo and run.hi > run.lo
        assert pos[run.lo:run.hi] == list(range(run.first, run.last + 1))
        lo = run.hi
        if chunk:  # never spans a chunk boundary
            assert run.first // chunk == run.last // chunk
    for a, b in zip(runs, runs[1:]):  # maximal: neighbours do not continue each other
        assert b.first != a.last + 1 or (chunk and b.first % chunk == 0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), seed=st.integers(0, 10_000), chunk=st.integers(0, 5),
       mode=st.sampled_from(["full_kv", "ring"]))
def test_single_rank_equals_causal_attention(n, seed, chunk, mode):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(3 * n, generator=g)[:n]  # arbitrary order, gaps included
    q_lat = torch.randn(n, H, R, generator=g)
    q_pe = torch.randn(n, H, DR, generator=g)
    kv = torch.randn(n, R + DR, generator=g)
    attn = ContextParallelAttention(KVPlacement((pos,), chunk), 0, pos, mode)
    o, lse = attn(q_lat, q_pe, kv, 0.3, R)
    o_ref, lse_ref = attend_latent(q_lat, q_pe, kv, pos, pos, 0.3, R)
    assert torch.allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lse, lse_ref, atol=1e-5, rtol=1e-5)
    # skipping the causal future never scores fewer pairs than the causal ones
    causal = int((pos[None, :] <= pos[:, None]).sum())
    assert causal <= attn.pairs_computed <= n * n


def test_placement_and_mode_errors():
    with pytest.raises(UsageError, match="one rank each"):
        KVPlacement((torch.tensor([0, 1]), torch.tensor([1, 2])))
    with pytest.raises(UsageError, match=">= 0"):
        KVPlacement((torch.tensor([-1, 0]),))
    pl = KVPlacement((torch.arange(4),))
    with pytest.raises(UsageError, match="mode"):
        ContextParallelAttention(pl, 0, torch.arange(4), "dense")
    with pytest.raises(UsageError, match="rank 1"):
        ContextParallelAttention(pl, 1, torch.arange(4), "ring")
    attn = ContextParallelAttention(pl, 0, torch.arange(4), "ring")
    with pytest.raises(UsageError, match="queries"):
        attn(torch.zeros(3, H, R), torch.zeros(3, H, DR), torch.zeros(4, R + DR), 1.0, R)
    assert pl.capacity == 4 and pl.lengths == (4,) and pl.world_size == 1
