"""DeviceKVPool: owned rows only, vectorised translation, clear errors."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.errors import UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.layout import DCPLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def full_rows(n, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c,interleave", [(1, 1), (2, 1), (4, 1), (4, 2), (3, 1)])
def test_write_keeps_only_owned_rows(dtype, c, interleave):
    P, D, pages, L = 4, 6, 5, 2
    for length in (0, 1, c - 1, c, 2 * c + 1, P * c, pages * P * c - 1, pages * P * c):
        full = full_rows(length, D, dtype, seed=length)
        seen = torch.zeros(length, dtype=torch.int64)
        for r in range(c):
            lay = DCPLayout(c, r, P, interleave)
            pool = DeviceKVPool(lay, L, D, dtype, pages)
            slots = torch.arange(length)
            stored = pool.write(1, slots, full)
            assert stored == lay.local_length(length)
            owned, rows = pool.read(1, slots)
            assert torch.equal(rows, full[owned])
            assert bool(lay.owns(owned).all()) if owned.numel() else True
            seen[owned] += 1
            # rows are where the layout says, everything else untouched (zero)
            phys = lay.physical(owned)
            assert torch.equal(pool.layer_view(1)[phys], full[owned])
            rest = torch.ones(pool.num_rows, dtype=torch.bool)
            rest[phys] = False
            assert not pool.layer_view(1)[rest].any()
            assert not pool.layer_view(0).any()
        assert bool((seen == 1).all())  # the union of all ranks is the whole sequence


def test_sizes_and_views():
    pool = DeviceKVPool(DCPLayout(2, 1, 8), 3, 10, torch.bfloat16, 4)
    assert pool.kv.shape == (3, 32, 10)
    assert pool.layer_view(2).shape == (32, 10)
    assert pool.layer_view(2).data_ptr() == pool.kv[2].data_ptr()
    assert pool.rows_per_page == 8 and pool.num_pages == 4 and pool.num_slots == 64
    assert pool.bytes_per_page == 3 * 8 * 10 * 2
    assert pool.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pool.dtype == torch.bfloat16 and not pool.kv.any()


@settings(max_examples=40, deadline=None)
@given(c=st.sampled_from([1, 2, 4]), rank_seed=st.integers(0, 100),
       slots=st.lists(st.integers(0, 3 * 2 * 4 - 1), unique=True, max_size=24))
def test_read_after_write_random_slots(c, rank_seed, slots):
    lay = DCPLayout(c, rank_seed % c, 2)
    pool = DeviceKVPool(lay, 1, 3, torch.float32, 3 * 4 // c)
    slots = [s for s in slots if s < pool.num_slots]
    rows = full_rows(len(slots), 3, torch.float32, seed=rank_seed)
    pool.write(0, slots, rows)
    owned, got = pool.read(0, slots)
    mask = lay.owned_mask(torch.tensor(slots, dtype=torch.int64))
    assert owned.tolist() == [s for s, m in zip(slots, mask.tolist()) if m]
    assert torch.equal(got, rows[mask])


def test_bad_input_errors():
    pool = DeviceKVPool(DCPLayout(2, 0, 4), 2, 6, torch.float16, 3)  # 24 slots
    slots = torch.arange(4)
    with pytest.raises(UsageError, match="dtype torch.float32 but the pool stores torch.float16"):
        pool.write(0, slots, torch.zeros(4, 6))
    with pytest.raises(UsageError, match=r"shape \[4, 6\].*got \[4, 5\]"):
        pool.write(0, slots, torch.zeros(4, 5, dtype=torch.float16))
    with pytest.raises(UsageError, match=r"shape \[4, 6\].*got \[3, 6\]"):
        pool.write(0, slots, torch.zeros(3, 6, dtype=torch.float16))
    with pytest.raises(UsageError, match="virtual slot 24 is outside"):
        pool.write(0, [0, 24], torch.zeros(2, 6, dtype=torch.float16))
    with pytest.raises(UsageError, match="virtual slot -1 is outside"):
        pool.read(0, [-1])
    with pytest.raises(UsageError, match="integers"):
        pool.read(0, torch.tensor([1.0]))
    with pytest.raises(UsageError, match="layer 2 is outside"):
        pool.read(2, slots)
    with pytest.raises(UsageError, match="layer"):
        pool.layer_view(-1)
    with pytest.raises(UsageError, match="kv_dim"):
        DeviceKVPool(DCPLayout(1, 0, 4), 1, 0, torch.float16, 1)
    with pytest.raises(UsageError, match="DCPLayout"):
        DeviceKVPool((1, 0, 4), 1, 4, torch.float16, 1)
    assert not pool.kv.any()  # nothing written by the failed calls
