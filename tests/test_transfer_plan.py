"""CPU block-copy planning: every copy kind moves exactly src[s] -> dst[d]; cheap plans for the
layouts' common page patterns; plans split across copy threads; out-of-order layer landing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from hicache.errors import TransferError, UsageError
from hicache.l1.pool import DeviceKVPool, advise_hugepages, zeroed
from hicache.l2.pool import HostKVPool
from hicache.l2.blocks import COPY_KINDS, plan_blocks, run_block_plan, split_block_plan
from hicache.l2.transfer import TransferEngine, TransferJob, plan_transfer
from hicache.layout import DCPLayout

BLOCK = 24  # bytes per block in the property tests


def blocks(n, seed):
    raw = np.random.default_rng(seed).integers(0, 256, n * BLOCK, dtype=np.uint8)
    return raw.view(np.dtype((np.void, BLOCK)))


@st.composite
def copies(draw):
    """Source ids (repeats allowed), unique destination ids, pool sizes and offsets."""
    n_src = draw(st.integers(1, 40))
    n_dst = draw(st.integers(1, 40))
    n = draw(st.integers(0, n_dst))
    d = draw(st.permutations(list(range(n_dst))))[:n]
    if draw(st.booleans()):  # runs: mostly consecutive sources
        start = draw(st.integers(0, n_src - 1))
        step = draw(st.sampled_from([1, 2, 3]))
        s = [(start + i * step) % n_src for i in range(n)]
    else:
        s = draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n))
    if draw(st.booleans()):
        d = sorted(d)
    return np.array(s, dtype=np.int64), np.array(d, dtype=np.int64), n_src, n_dst


@settings(max_examples=60, deadline=None)
@given(copies(), st.sampled_from([None, *COPY_KINDS]), st.integers(1, 3), st.integers(1, 4),
       st.integers(0, 3), st.integers(0, 3))
def test_every_plan_moves_exactly_the_requested_blocks(case, kind, step, parts, so, do):
    s, d, n_src, n_dst = case
    src, dst = blocks(n_src + so, 1), blocks(n_dst + do, 2)
    want = dst.copy()
    want[do:][d] = src[so:][s]
    plan = plan_blocks(s, d, step, kind)
    assert plan.num_blocks == s.size
    assert kind is None or plan.kind == kind
    got = dst.copy()
    run_block_plan(plan, src, got, so, do)
    assert got.tobytes() == want.tobytes()
    # the same copy split for several threads: parts cover every block once
    pieces = split_block_plan(plan, parts)
    assert 1 <= len(pieces) <= max(1, parts)
    assert sum(p.num_blocks for p in pieces) == plan.num_blocks
    assert all(p.kind == plan.kind for p in pieces)
    got = dst.copy()
    for p in reversed(pieces):
        run_block_plan(p, src, got, so, do)
    assert got.tobytes() == want.tobytes()


def test_plan_kinds_and_call_counts():
    n = 64
    ids = np.arange(n)
    perm = np.random.default_rng(0).permutation(n)
    p = plan_blocks(ids, ids)  # one contiguous run on both sides: a single call
    assert p.num_calls == 1
    p = plan_blocks(perm, ids)  # gather into a contiguous destination: one take
    assert (p.kind, p.num_calls) == ("take", 1)
    p = plan_blocks(ids * 8, perm * 2, 8)  # strided source run, scattered destination
    assert (p.kind, p.num_calls) == ("scatter", 1)
    p = plan_blocks(ids[:4], ids[:4] + 10)  # tiny: the cheapest call is a memmove
    assert (p.kind, p.num_calls) == ("memmove", 1)
    p = plan_blocks(ids, ids, kind="memmove")
    assert p.ops.tolist() == [[0, 0, n]]
    assert split_block_plan(p, 3)[1].ops.tolist() == [[22, 22, 22]]
    assert plan_blocks([], []).num_calls == 0
    with pytest.raises(TransferError, match="copy kind"):
        plan_blocks(ids, ids, kind="dma")


@pytest.mark.parametrize("kind", ["layer_first", "page_first"])
def test_engine_plans_few_calls_for_common_patterns(kind):
    """Per job (backup) or per layer (load): one or two C calls for runs of whole pages,
    whether device pages are in order or scattered, with host pages in order."""
    lay = DCPLayout(2, 0, 4)
    L, pages = 3, 16
    d = DeviceKVPool(lay, L, 8, torch.float16, pages)
    h = HostKVPool(lay, L, 8, torch.float16, pages, layout_kind=kind)
    with TransferEngine(d, h) as eng:
        hp = list(range(pages))
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(3)).tolist()
        for dev_pages in (hp, perm):
            back = eng.backend.plan_blocks(
                TransferJob("d2h", plan_transfer(dev_pages, hp, pages, pages), L, 0))
            load = eng.backend.plan_blocks(
                TransferJob("h2d", plan_transfer(hp, dev_pages, pages, pages), L, 0))
            assert back.num_calls <= (1 if kind == "page_first" else L)
            assert load.num_calls == 1
            assert back.num_blocks == L * pages and load.num_blocks == pages


@pytest.mark.parametrize("kind", ["layer_first", "page_first"])
@pytest.mark.parametrize("threads", [2, 3])
def test_copy_threads_roundtrip_is_bit_identical(kind, threads):
    lay = DCPLayout(1, 0, 4)
    L, pages = 5, 12
    d = DeviceKVPool(lay, L, 8, torch.bfloat16, pages)
    h = HostKVPool(lay, L, 8, torch.bfloat16, pages, layout_kind=kind)
    d.kv.normal_()
    ref = d.kv.clone()
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
    with TransferEngine(d, h, copy_threads=threads) as eng:
        eng.backup(perm, list(range(pages))).wait()
        d.kv.zero_()
        job = eng.load(list(range(pages)), perm)
        for layer in range(L):
            job.wait_layer(layer, timeout=30)
            assert torch.equal(d.kv[layer], ref[layer])  # layer i complete once it arrived
        job.wait(timeout=30)
    assert torch.equal(d.kv, ref)
    with pytest.raises(UsageError, match="copy_threads"):
        TransferEngine(d, h, copy_threads=0)


def test_layers_arrive_in_order_when_copied_out_of_order():
    plan = plan_transfer([0], [0], 1, 1)
    job = TransferJob("h2d", plan, 3, 0)
    job._layers_landed(1, 2)
    with pytest.raises(TransferError, match="layer 0 .* did not arrive"):
        job.wait_layer(0, timeout=0.01)
    job._layers_landed(0, 1)
    job.wait_layer(1, timeout=0)  # 0 and 1 have both landed
    with pytest.raises(TransferError, match="layer 2"):
        job.wait_layer(2, timeout=0.01)
    job._layers_landed(2, 3)
    job.wait_layer(2, timeout=0)


def test_a_split_layer_arrives_once_every_piece_landed():
    job = TransferJob("h2d", plan_transfer([0], [0], 1, 1), 4, 0)
    job._pieces = 2
    job._layers_landed(0, 2)  # piece 0 of layers 0, 1
    assert job._arrived == 0
    with pytest.raises(TransferError, match="layer 0 .* did not arrive"):
        job.wait_layer(0, timeout=0.01)
    job._layers_landed(1, 4)  # piece 1 of layers 1-3: layer 0 still lacks it
    assert job._arrived == 0
    job._layers_landed(0, 1)
    assert job._arrived == 2  # layers 0, 1 whole; 2, 3 have one piece of two
    job._layers_landed(2, 4)
    job.wait_layer(3, timeout=0)


def test_zeroed_pools_and_hugepage_advice():
    t = zeroed((3 << 20,), torch.uint8, torch.device("cpu"))  # 3 MiB: holds a 2 MiB huge page
    assert t.shape == (3 << 20,) and not t.any()
    assert isinstance(advise_hugepages(torch.empty(3 << 20, dtype=torch.uint8)), bool)
    assert advise_hugepages(torch.empty(16)) is False  # too small to hold one huge page
