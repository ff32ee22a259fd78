"""PageAllocator: deterministic, all-or-nothing, free + used == total at all times."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.errors import DeviceFullError, UsageError
from hicache.pages import PageAllocator


class StackModel:
    """The documented order, as plain Python: a fresh pool hands out 0, 1, 2, ...; freed ids come
    back most recently freed call first, each call's ids in the order given."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))  # the end is handed out first

    def alloc(self, n: int) -> list[int]:
        out = self.free[len(self.free) - n:][::-1]
        del self.free[len(self.free) - n:]
        return out

    def release(self, ids: list[int]) -> None:
        self.free.extend(ids[::-1])


def test_order_is_fresh_ids_ascending_then_last_freed_first():
    a = PageAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    a.free([1, 0])
    assert a.alloc(1) == [1]
    assert a.alloc(3) == [0, 3, 4]
    assert (a.num_free, a.num_used, a.num_pages) == (1, 5, 6)
    assert a.is_allocated(4) and not a.is_allocated(5)
    assert a.alloc(0) == [] and a.num_used == 5
    assert all(type(p) is int for p in a.alloc(1))
    assert repr(a) == "PageAllocator(num_pages=6, used=6)"


def test_two_allocators_same_sequence_same_ids():
    a, b = PageAllocator(10), PageAllocator(10)
    for op in [("a", 3), ("f", [1]), ("a", 4), ("f", [0, 5]), ("a", 2), ("f", [3, 2]),
               ("a", 5)]:
        if op[0] == "a":
            assert a.alloc(op[1]) == b.alloc(op[1])
        else:
            a.free(op[1])
            b.free(op[1])
    assert a.used_ids().tolist() == b.used_ids().tolist()


def test_out_of_pages_is_all_or_nothing_and_names_numbers():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(DeviceFullError, match=r"asked for 2 pages but only 1 of 4 are free"):
        a.alloc(2)
    with pytest.raises(DeviceFullError) as e:
        a.alloc_array(5)
    assert (e.value.asked, e.value.free, e.value.total) == (5, 1, 4)
    assert a.num_free == 1 and a.num_used == 3
    assert a.alloc(1) == [3]                          # the failed calls took nothing
    assert isinstance(DeviceFullError(1, 0, 1), MemoryError)
    with pytest.raises(DeviceFullError, match="asked for 1 pages but only 0 of 0"):
        PageAllocator(0).alloc(1)


def test_bad_frees_change_nothing():
    a = PageAllocator(4)
    ids = a.alloc(2)  # [0, 1]
    with pytest.raises(UsageError, match="page id 3 is not allocated"):
        a.free([0, 3])
    with pytest.raises(UsageError, match="page id 7 is outside"):
        a.free([7])
    with pytest.raises(UsageError, match="page id -1 is negative"):
        a.free([-1])
    with pytest.raises(UsageError, match="page id 9 is outside"):
        a.free(np.array([0, 9, -3]))                  # the first bad id is named
    with pytest.raises(UsageError, match="page id 0 appears twice"):
        a.free([0, 0])
    with pytest.raises(UsageError, match="page id 1 appears twice"):
        a.free([1, 0] + [1] * 40)                     # the vectorised duplicate check
    with pytest.raises(UsageError, match="not an int"):
        a.free([0.5])
    with pytest.raises(UsageError, match="not an int"):
        a.free([True])
    with pytest.raises(UsageError, match="integers"):
        a.free(torch.tensor([0.0]))
    with pytest.raises(UsageError, match="int64 range"):
        a.free([2 ** 70])
    assert a.num_used == 2 and all(a.is_allocated(i) for i in ids)
    a.free(torch.tensor(ids))
    with pytest.raises(UsageError, match="page id 0 is not allocated"):
        a.free([0])
    assert a.num_free == 4
    a.free([])                                        # nothing to free: a no-op
    assert a.num_free == 4
    for bad in (-1, 1.0, True):
        with pytest.raises(UsageError):
            a.alloc(bad)
    for bad in (-2, 2.0, None):
        with pytest.raises(UsageError):
            PageAllocator(bad)
    with pytest.raises(UsageError, match="page id 4 is outside"):
        a.is_allocated(4)
    with pytest.raises(UsageError, match="not an int"):
        a.is_allocated("0")


@settings(max_examples=60, deadline=None)
@given(total=st.integers(0, 24),
       ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "bad"]), st.integers(0, 30),
                              st.randoms(use_true_random=False)),
                    max_size=40))
def test_random_sequences_keep_invariants(total, ops):
    """Random allocs, frees and bad frees: the allocator follows the documented order exactly,
    never hands out a held id, rejects bad frees without changing anything, and keeps
    free + used == total."""
    a, model = PageAllocator(total), StackModel(total)
    held: set[int] = set()
    for kind, n, rnd in ops:
        if kind == "alloc":
            if n > total - len(held):
                with pytest.raises(DeviceFullError):
                    a.alloc(n)
            else:
                got = a.alloc(n) if n % 2 else a.alloc_array(n).tolist()
                assert got == model.alloc(n)          # deterministic, documented order
                assert len(set(got)) == n and not held & set(got)
                held |= set(got)
        elif kind == "free":
            victims = rnd.sample(sorted(held), min(n, len(held)))
            a.free(victims)
            model.release(victims)
            held -= set(victims)
        else:  # a free with one held id plus an id that is not held (or a repeat)
            pool = sorted(held)
            bad = rnd.choice([p for p in range(total + 2) if p not in held] or [-1])
            if pool and rnd.random() < 0.3:
                bad = rnd.choice(pool)  # repeated below: appears twice
            req = ([rnd.choice(pool)] if pool else []) + [bad]
            if len(set(req)) == len(req) and bad in held:
                continue
            with pytest.raises(UsageError):
                a.free(req)
        assert a.num_used == len(held)
        assert a.num_free + a.num_used == total
        assert a.used_ids().tolist() == sorted(held)
        assert all(a.is_allocated(p) == (p in held) for p in range(total))
