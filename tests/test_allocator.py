"""PageAllocator: deterministic, all-or-nothing, free + used == total at all times."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.l1.allocator import OutOfPagesError, PageAllocator, PageError


def test_lowest_ids_first_and_reuse():
    a = PageAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    a.free([1, 0])
    assert a.alloc(1) == [0]
    assert a.alloc(3) == [1, 3, 4]
    assert (a.num_free, a.num_used, a.num_pages) == (1, 5, 6)
    assert a.is_allocated(4) and not a.is_allocated(5)
    assert a.alloc(0) == []


def test_two_allocators_same_sequence_same_ids():
    a, b = PageAllocator(10), PageAllocator(10)
    for op in [("a", 3), ("f", [1]), ("a", 4), ("f", [0, 5]), ("a", 2)]:
        if op[0] == "a":
            assert a.alloc(op[1]) == b.alloc(op[1])
        else:
            a.free(op[1])
            b.free(op[1])


def test_out_of_pages_is_all_or_nothing_and_names_numbers():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(OutOfPagesError, match=r"asked for 2 pages but only 1 of 4 are free"):
        a.alloc(2)
    assert a.num_free == 1 and a.num_used == 3
    assert isinstance(OutOfPagesError(1, 0, 1), MemoryError)


def test_bad_frees_change_nothing():
    a = PageAllocator(4)
    ids = a.alloc(2)  # [0, 1]
    with pytest.raises(PageError, match="page id 3 is not allocated"):
        a.free([0, 3])
    with pytest.raises(PageError, match="page id 7 is outside"):
        a.free([7])
    with pytest.raises(PageError, match="page id -1 is negative"):
        a.free([-1])
    with pytest.raises(PageError, match="page id 0 appears twice"):
        a.free([0, 0])
    with pytest.raises(PageError, match="not an int"):
        a.free([0.5])
    with pytest.raises(PageError, match="integers"):
        a.free(torch.tensor([0.0]))
    assert a.num_used == 2 and all(a.is_allocated(i) for i in ids)
    a.free(torch.tensor(ids))
    with pytest.raises(PageError, match="page id 0 is not allocated"):
        a.free([0])
    assert a.num_free == 4
    with pytest.raises(PageError):
        a.alloc(-1)
    with pytest.raises(PageError):
        PageAllocator(-2)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 24),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.randoms(use_true_random=False)),
                    max_size=40))
def test_random_sequences_keep_invariants(total, ops):
    a = PageAllocator(total)
    held: set[int] = set()
    for is_alloc, n, rnd in ops:
        if is_alloc:
            if n > total - len(held):
                with pytest.raises(OutOfPagesError):
                    a.alloc(n)
            else:
                got = a.alloc(n)
                free_before = sorted(set(range(total)) - held)
                assert got == free_before[:n]  # lowest first, deterministic
                assert not held & set(got)
                held |= set(got)
        else:
            k = min(n, len(held))
            victims = rnd.sample(sorted(held), k)
            a.free(victims)
            held -= set(victims)
        assert a.num_used == len(held)
        assert a.num_free + a.num_used == total
        assert all(a.is_allocated(p) == (p in held) for p in range(total))
