"""The fixed-size MIN vector (hicache.minvec), pure: what every rank learns from the element-wise
MIN of the ranks' packed vectors, whatever their payload lengths, values or faults."""

import pytest
from hypothesis import given, settings, strategies as st

from hicache import minvec
from hicache.minvec import (BAD_VALUE, HEADER, INT64_MAX, INT64_MIN, NO_FAULT, fault_slot, pack,
                            pair, unpack)

i64 = st.integers(INT64_MIN, INT64_MAX)


def reduce_min(vecs):
    """What all_reduce(MIN) leaves on every rank."""
    assert len({len(v) for v in vecs}) == 1, "every rank must send the same size"
    return [min(col) for col in zip(*vecs)]


rank_input = st.tuples(
    st.lists(i64, min_size=0, max_size=20),      # payload
    st.sampled_from([0, 0, 0, 2, 5, 255]),       # fault code (mostly fine)
)


@settings(max_examples=300)
@given(world=st.integers(1, 5), header_len=st.integers(0, 4), capacity=st.integers(0, 8),
       data=st.data())
def test_the_min_of_packed_vectors_tells_every_rank_the_same_verdict(world, header_len,
                                                                       capacity, data):
    ranks = [data.draw(rank_input) for _ in range(world)]
    headers = [data.draw(st.lists(i64, min_size=header_len, max_size=header_len))
               for _ in range(world)]
    packed = [pack(h, p, rank=r, code=c, capacity=capacity)
              for r, (h, (p, c)) in enumerate(zip(headers, ranks))]
    assert {len(p.vec) for p in packed} == {HEADER + header_len + capacity}  # one size, always
    u = unpack(reduce_min([p.vec for p in packed]), header_len, capacity)
    bad = [(r, c) for r, (_, c) in enumerate(ranks) if c]
    assert u.fault == (min(bad) if bad else None)  # the lowest faulty rank and its code
    lengths = [len(p) for p, _ in ranks]
    assert u.length == (min(lengths), max(lengths))
    assert u.agreed == (not bad and min(lengths) == max(lengths))
    if not bad:
        assert u.header == [min(col) for col in zip(*headers)] if header_len else u.header == []
    if u.agreed:
        n = lengths[0]
        want = [min(col) for col in zip(*(p for p, _ in ranks))]
        assert u.head == want[:capacity]
        assert u.overflow == max(0, n - capacity)
        rest = reduce_min([p.rest for p in packed]) if u.overflow else []
        assert u.head + rest == want  # the second collective (agreed size) completes it
        assert all(len(p.rest) == u.overflow for p in packed)
    else:
        assert u.overflow == 0  # never a second collective without agreement


@given(st.lists(st.one_of(i64, st.integers(), st.floats(allow_nan=True), st.text(max_size=3),
                          st.none()), max_size=10))
def test_pack_never_raises_and_flags_values_that_are_not_int64(values):
    p = pack([1, -1], values, rank=3, capacity=4)
    assert len(p.vec) == HEADER + 2 + 4
    try:
        ok = all(INT64_MIN <= int(v) <= INT64_MAX for v in values)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if ok:
        assert p.code == 0 and p.vec[0] == NO_FAULT
    else:
        assert p.code == BAD_VALUE and p.vec[0] == fault_slot(3, BAD_VALUE)
        assert list(p.vec[HEADER:]) == [0] * 6  # nothing of a bad rank's input is reduced
    assert list(p.vec[1:3]) == [len(values), -len(values)]  # its length still counts


def test_pairs_give_min_and_max():
    u = unpack(reduce_min([pack(pair(a), [], rank=r, capacity=0).vec
                           for r, a in enumerate((7, 3, 9))]), 2, 0)
    assert (u.header[0], -u.header[1]) == (3, 9)


def test_bad_fault_codes_and_vector_sizes_are_refused():
    with pytest.raises(ValueError, match="fault code"):
        fault_slot(0, minvec.FAULT_CODES)
    with pytest.raises(ValueError, match="capacity"):
        unpack([0] * 5, 1, 2)


def test_a_peer_is_told_the_class_of_an_error_that_cannot_be_printed():
    from hicache.outcome import _line

    class Unprintable(ValueError):
        def __str__(self):
            raise RuntimeError("no")
    assert _line(Unprintable()) == "Unprintable"
    assert _line(ValueError("two\nlines")) == "ValueError: two"
    assert _line(KeyError()) == "KeyError"


@given(st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_every_rank_learns_another_ranks_kind_and_who(kinds):
    from hicache.minvec import HEADER_SLOTS, KIND_RANKS
    packed = [pack([r], [], rank=r, kind=k, header_slots=HEADER_SLOTS).vec
              for r, k in enumerate(kinds)]
    u = unpack(reduce_min(packed), HEADER_SLOTS)
    assert u.same_kind == (len(set(kinds)) == 1)
    assert u.agreed == u.same_kind
    assert u.header == [0] + [0] * (HEADER_SLOTS - 1)
    for r, k in enumerate(kinds):
        other, who = u.other_kind(k)
        if u.same_kind:
            continue
        assert other != k and kinds[who] == other and who == kinds.index(other)
    assert KIND_RANKS > 1 << 20


def test_a_header_longer_than_the_fixed_slots_is_refused():
    with pytest.raises(ValueError, match="header slots"):
        pack([0] * 17, [], rank=0, header_slots=16)
