"""The cheap path of small transfer jobs: plans checked on Python lists, page-run copies (a
strided copy per run of pages, loads completing in groups of layers) and job waits that wake a
waiter only once what it waits for has arrived. Each is checked against the general path."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import TransferError, UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2 import copy_cpu
from hicache.l2.blocks import page_view, run_page_runs
from hicache.l2.copy_cpu import LAYER_GROUP_BYTES, PAGE_RUNS_MAX, layer_group
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import DONE, SMALL_PLAN, TransferEngine, TransferJob, plan_transfer
from hicache.layout import DCPLayout


def runs_by_numpy(plan):
    return list(zip(plan.run_src.tolist(), plan.run_dst.tolist(), plan.run_len.tolist()))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_small_and_large_plans_check_and_coalesce_alike(data):
    """Either side of SMALL_PLAN: the same runs as the numpy run finder, the same refusals."""
    n = data.draw(st.sampled_from([0, 1, 2, 5, SMALL_PLAN, SMALL_PLAN + 1, 3 * SMALL_PLAN]))
    limit = 4 * SMALL_PLAN
    dst = data.draw(st.permutations(range(limit)))[:n]
    consecutive = data.draw(st.booleans())
    src = list(range(7, 7 + n)) if consecutive else data.draw(
        st.lists(st.integers(0, limit - 1), min_size=n, max_size=n))
    p = plan_transfer(src, dst, limit, limit)
    assert p.src.tolist() == src and p.dst.tolist() == dst and p.num_pages == n
    assert p.runs == runs_by_numpy(p) and p.num_runs == len(p.runs)
    assert sum(r[2] for r in p.runs) == n
    for k in (0, 1, 2, PAGE_RUNS_MAX, p.num_runs - 1, p.num_runs):
        assert p.runs_at_most(k) == (p.num_runs <= k), k  # told early for scattered plans
    assert p.src_pages.tolist() == src and p.src_pages.dtype == torch.int64
    if n:
        bad = list(dst)
        bad[-1] = limit  # one past the end of the destination pool
        with pytest.raises(UsageError, match=f"destination page id {limit} is outside"):
            plan_transfer(src, bad, limit, limit)
        with pytest.raises(UsageError, match="source page id -1 is outside"):
            plan_transfer([-1] + src[1:], dst, limit, limit)
    if n > 1:
        with pytest.raises(UsageError, match="repeats a page id"):
            plan_transfer(src, [dst[0]] + dst[1:-1] + [dst[0]], limit, limit)


def test_plans_own_their_pages():
    src = np.array([3, 4, 5])
    p = plan_transfer(src, [0, 1, 2], 8, 8)
    src[0] = 7  # the caller reuses its array
    assert p.src.tolist() == [3, 4, 5] and p.runs == [(3, 0, 3)]
    n = 3 * SMALL_PLAN  # the numpy path: arrays copied, lists converted once
    for make in (np.array, torch.tensor, list, tuple):
        src, dst = make(list(range(n))), make(list(range(n, 0, -1)))
        p = plan_transfer(src, dst, n + 1, n + 1)
        if not isinstance(src, tuple):
            src[0], dst[0] = 5, 1
        assert p.src.tolist() == list(range(n)) and p.dst.tolist() == list(range(n, 0, -1))
    with pytest.raises(UsageError, match="differ in length"):
        plan_transfer([1, 2], [1], 8, 8)


def pools(kind, L=5, D=8, pages=24, dtype=torch.bfloat16):
    lay = DCPLayout(2, 1, 4)
    d = DeviceKVPool(lay, L, D, dtype, pages)
    h = HostKVPool(lay, L, D, dtype, pages, layout_kind=kind)
    return d, h


def test_page_views_and_runs_copy_every_layer_of_a_run():
    d, h = pools("page_first")
    d.kv.normal_()
    dv = page_view(d.kv, d.num_layers, d.num_pages, False)
    hv = page_view(h.buf, h.num_layers, h.num_pages, True)
    assert dv.shape == hv.shape == (d.num_layers, d.num_pages, d.bytes_per_page // d.num_layers)
    run_page_runs([(2, 5, 3), (0, 0, 1)], dv, hv)
    for dp, hp in ((2, 5), (3, 6), (4, 7), (0, 0)):
        assert torch.equal(h.read_page(hp), d.kv[:, dp * 4:(dp + 1) * 4])
    assert not h.read_page(1).any() and not h.read_page(8).any()


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
@pytest.mark.parametrize("inline", [True, False])
def test_page_run_jobs_move_the_right_bytes(kind, inline):
    d, h = pools(kind)
    d.kv.normal_()
    ref = d.kv.clone()
    dev_pages, host_pages = [9, 3, 4, 5, 17], [0, 1, 2, 3, 4]  # runs [9], [3, 4, 5], [17]
    with TransferEngine(d, h) as eng:
        if not inline:
            eng.inline_bytes = 0  # handed to the copy thread
        job = eng.backup(dev_pages, host_pages)
        assert job.prepared == [(9, 0, 1), (3, 1, 3), (17, 4, 1)]
        job.wait(timeout=30)
        d.kv.zero_()
        back = eng.load(host_pages, [20, 21, 22, 0, 11])
        assert back.prepared == [(0, 20, 3), (3, 0, 1), (4, 11, 1)]
        for layer in range(d.num_layers):
            back.wait_layer(layer, timeout=30)
        back.wait(timeout=30)
        assert back.status() == DONE
    for src, dst in zip(dev_pages, [20, 21, 22, 0, 11]):
        assert torch.equal(d.kv[:, dst * 4:(dst + 1) * 4], ref[:, src * 4:(src + 1) * 4])
    assert not d.kv[:, 4 * 4:5 * 4].any()  # a page no load wrote


def test_many_runs_or_forced_kinds_get_block_plans():
    d, h = pools("page_first", pages=64)
    with TransferEngine(d, h) as eng:
        scattered = list(range(0, 2 * (PAGE_RUNS_MAX + 1), 2))  # PAGE_RUNS_MAX + 1 runs
        job = eng.backup(scattered, list(range(len(scattered))))
        assert type(job.prepared) is not list and job.prepared.num_blocks > 0
        eng.cpu_copy = "memmove"
        assert type(eng.backup([0], [0]).prepared) is not list
    with TransferEngine(d, h, copy_threads=3) as eng:  # split or not, few runs stay runs
        assert eng.backup([0], [0]).prepared == [(0, 0, 1)]


def test_page_run_loads_arrive_in_groups_of_layers_in_order(monkeypatch):
    L = 12
    d, h = pools("page_first", L=L, D=64, dtype=torch.float32)  # 1 KiB per page-layer
    block = d.bytes_per_page // L
    assert layer_group(L, 3 * d.bytes_per_page) == min(L, LAYER_GROUP_BYTES // (3 * block))
    assert layer_group(61, 61 << 20) == 1 and layer_group(4, 100) == 4
    monkeypatch.setattr(copy_cpu, "LAYER_GROUP_BYTES", 3 * 2 * block)  # 2 pages: 3 layers a group
    d.kv.normal_()
    arrivals = []
    with TransferEngine(d, h) as eng:
        eng.backup([0, 1], [0, 1]).wait(timeout=30)
        # the copy of a load, run here (not submitted): every arrival recorded in order
        job = TransferJob("h2d", plan_transfer([0, 1], [5, 9], h.num_pages, d.num_pages), L,
                          2 * d.bytes_per_page)
        real = job._layer_done
        job._layer_done = lambda layer: (arrivals.append(layer), real(layer))
        eng.backend.copy(job)
    assert arrivals == [2, 5, 8, 11]
    assert torch.equal(d.kv[:, 5 * 4:6 * 4], d.kv[:, 0:4])
    assert torch.equal(d.kv[:, 9 * 4:10 * 4], d.kv[:, 4:8])


def test_a_waiter_sleeps_until_its_layer_and_jobs_share_one_condition():
    cond = threading.Condition(threading.Lock())
    plan = plan_transfer([0], [0], 1, 1)
    a, b = (TransferJob("h2d", plan, 3, 0, cond=cond) for _ in range(2))
    woke = threading.Event()

    def waiter():
        a.wait_layer(1, timeout=30)
        woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    while a._want != 2:  # the waiter is asleep and wants 2 layers
        assert t.is_alive()
        woke.wait(0.001)
    b._layer_done(2)  # another job on the same condition: not what it waits for
    a._layer_done(0)
    assert not woke.wait(0.05) and a._want == 2
    a._layer_done(1)
    t.join(30)
    assert woke.is_set() and not t.is_alive()
    assert a._want > a.num_layers  # nobody sleeps now: later layers notify nobody
    # a finished job has every layer, whoever finished it
    a._succeed()
    a.wait_layer(2, timeout=0)
    assert a.done() and a.status() == DONE


def test_waits_time_out_and_failures_wake_waiters():
    plan = plan_transfer([0], [0], 1, 1)
    job = TransferJob("h2d", plan, 2, 0)
    with pytest.raises(TransferError, match="did not finish within 0.01 s"):
        job.wait(timeout=0.01)
    with pytest.raises(TransferError, match="layer 1 .* did not arrive within 0 s"):
        job.wait_layer(1, timeout=0)
    errors = []

    def waiter():
        try:
            job.wait_layer(1, timeout=30)
        except TransferError as err:
            errors.append(err)

    t = threading.Thread(target=waiter)
    t.start()
    while job._want != 2:
        assert t.is_alive()
        t.join(0.001)
    job._fail(OSError("disk on fire"))
    t.join(30)
    assert not t.is_alive() and "disk on fire" in str(errors[0])
    with pytest.raises(TransferError, match="disk on fire"):
        job.wait(timeout=0)
