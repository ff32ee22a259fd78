import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.errors import TopologyError
from hicache.layout import DCPLayout, common_page_tokens, local_length, plan_relayout


def owned(c, r, n, interleave=1):
    lay = DCPLayout(c, r, 16 * interleave, interleave)
    return lay.local_rows(torch.arange(n))[0].tolist()


def test_source_examples():
    assert owned(4, 0, 8) == [0, 4]
    assert owned(4, 3, 8) == [3, 7]
    assert owned(2, 0, 8) == [0, 2, 4, 6]
    assert owned(2, 1, 8) == [1, 3, 5, 7]
    assert DCPLayout(4, 0, 16).page_tokens == 64
    assert DCPLayout(4, 0, 16).virtual_capacity(1000) == 4000


def test_owner_physical_ints_and_tensors_agree():
    lay = DCPLayout(4, 1, 8, interleave=2)
    v = torch.arange(200)
    assert lay.owner(v).tolist() == [lay.owner(int(x)) for x in v]
    assert lay.physical(v).tolist() == [lay.physical(int(x)) for x in v]
    # interleave 2 over 4 ranks: 0,1 -> r0; 2,3 -> r1; ...; 8,9 -> r0 again at rows 2,3
    assert [lay.owner(x) for x in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    assert lay.for_rank(0).physical(torch.tensor([0, 1, 8, 9])).tolist() == [0, 1, 2, 3]


def test_virtual_is_inverse_of_physical():
    for c, i in [(1, 1), (2, 1), (4, 2), (3, 4)]:
        for r in range(c):
            lay = DCPLayout(c, r, 4 * i, i)
            slots, rows = lay.local_rows(torch.arange(500))
            assert torch.equal(lay.virtual(rows), slots)


def test_widened_page_maps_to_one_physical_page():
    for c, i in [(2, 1), (4, 1), (4, 4), (8, 2)]:
        for r in range(c):
            lay = DCPLayout(c, r, 16, i)
            page = 5
            slots = torch.arange(page * lay.page_tokens, (page + 1) * lay.page_tokens)
            _, rows = lay.local_rows(slots)
            assert sorted(rows.tolist()) == lay.page_rows(torch.tensor([page])).tolist()


def test_local_length_when_c_divides_length():
    # a known engine bug gave every rank one extra token when c | L
    for c in (1, 2, 4, 8):
        for r in range(c):
            assert local_length(8 * c, c, r) == 8
            assert local_length(0, c, r) == 0
    assert [local_length(5, 4, r) for r in range(4)] == [2, 1, 1, 1]
    assert [local_length(3, 4, r) for r in range(4)] == [1, 1, 1, 0]


def test_bad_layouts():
    with pytest.raises(TopologyError, match="interleave"):
        DCPLayout(2, 0, 10, interleave=4)
    with pytest.raises(TopologyError, match="rank"):
        DCPLayout(2, 2, 16)
    with pytest.raises(TopologyError, match="dcp_size"):
        DCPLayout(0, 0, 16)
    with pytest.raises(TopologyError, match="length"):
        local_length(-1, 2, 0)


def test_effective_page_size_absent_when_groups_disagree():
    assert common_page_tokens([16, 16], 4) == 64
    assert common_page_tokens([16, 32], 4) is None
    assert common_page_tokens([], 4) is None


@settings(max_examples=150, deadline=None)
@given(c=st.integers(1, 8), interleave=st.sampled_from([1, 2, 4]),
       slots=st.lists(st.integers(0, 5000), max_size=300, unique=True))
def test_local_rows_partition_any_slot_set(c, interleave, slots):
    t = torch.tensor(slots, dtype=torch.int64)
    seen = []
    rows_of = {}
    for r in range(c):
        lay = DCPLayout(c, r, 4 * interleave, interleave)
        mine, rows = lay.local_rows(t)
        assert torch.equal(lay.owner(mine), torch.full_like(mine, r))
        seen += mine.tolist()
        for s, row in zip(mine.tolist(), rows.tolist()):
            assert (r, row) not in rows_of  # no two slots share a physical row
            rows_of[(r, row)] = s
    assert sorted(seen) == sorted(slots)
    # order within a rank follows input order
    if c > 1:
        lay0 = DCPLayout(c, 0, 4 * interleave, interleave)
        assert lay0.local_rows(t)[0].tolist() == [s for s in slots if lay0.owner(s) == 0]


@settings(max_examples=150, deadline=None)
@given(c=st.integers(1, 8), interleave=st.sampled_from([1, 2, 3, 8]), n=st.integers(0, 3000))
def test_local_lengths_balanced_and_exact(c, interleave, n):
    lengths = [local_length(n, c, r, interleave) for r in range(c)]
    assert sum(lengths) == n
    assert max(lengths) - min(lengths) <= interleave
    lay = DCPLayout(c, 0, interleave, interleave)
    assert lengths[0] == int((lay.owner(torch.arange(n)) == 0).sum())


def test_relayout_same_size_and_dcp1():
    same = plan_relayout(4, 4, 10)
    for s in same.shards:
        assert s.src_rank == s.dst_rank
        assert torch.equal(s.src_rows, s.dst_rows)
    up = plan_relayout(1, 4, 10)
    assert up.shards[1].positions.tolist() == [1, 5, 9]
    assert up.shards[1].src_rows.tolist() == [1, 5, 9]
    assert up.shards[1].dst_rows.tolist() == [0, 1, 2]
    assert all(s.src_rank == 0 for s in up.shards)


def test_relayout_rejects_other_size_changes():
    with pytest.raises(TopologyError, match="DCP 2 to DCP 4"):
        plan_relayout(2, 4, 10)
    with pytest.raises(TopologyError, match="DCP 4 to DCP 1"):
        plan_relayout(4, 1, 10)


@settings(max_examples=100, deadline=None)
@given(c=st.integers(1, 8), n=st.integers(0, 700), interleave=st.sampled_from([1, 2, 4]))
def test_relayout_never_reads_past_token_count(c, n, interleave):
    plan = plan_relayout(1, c, n, interleave)
    got = []
    for s in plan.shards:
        assert (s.src_rows < n).all() if len(s.src_rows) else True
        assert len(s.dst_rows) == local_length(n, c, s.dst_rank, interleave)
        assert s.dst_rows.tolist() == list(range(len(s.dst_rows)))  # packed, no holes
        got += s.positions.tolist()
    assert sorted(got) == list(range(n))
