"""TransferEngine in one process: both layouts x directions x dtypes x io backends."""

import pytest
import torch

from hicache.distributed import CollectiveCounter
from hicache.errors import TransferError, UsageError
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine, plan_transfer
from hicache.layout import DCPLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def slots_of(pages, length, page_tokens):
    """Virtual slots of token positions [0, length) stored in widened pages ``pages``."""
    pos = torch.arange(length)
    table = torch.tensor(pages, dtype=torch.int64)
    return table[pos // page_tokens] * page_tokens + pos % page_tokens


def make(kind, dtype, backend="direct", c=2, rank=1, P=4, L=3, D=8, dev_pages=8, host_pages=6):
    lay = DCPLayout(c, rank, P)
    d = DeviceKVPool(lay, L, D, dtype, dev_pages)
    h = HostKVPool(lay, L, D, dtype, host_pages, layout_kind=kind, pin="auto")
    return lay, d, h, TransferEngine(d, h, backend)


def test_plan_coalesces_runs():
    p = plan_transfer([0, 1, 2, 5, 6, 9], [3, 4, 5, 0, 1, 7], 10, 10)
    assert p.run_src.tolist() == [0, 5, 9]
    assert p.run_dst.tolist() == [3, 0, 7]
    assert p.run_len.tolist() == [3, 2, 1]
    p = plan_transfer(torch.tensor([4, 3]), [0, 1], 5, 2)
    assert p.run_len.tolist() == [1, 1]
    assert plan_transfer([], [], 1, 1).num_pages == 0


@pytest.mark.parametrize("backend", ["direct", "direct-memmove", "direct-take", "direct-scatter",
                                     "kernel"])
@pytest.mark.parametrize("kind", ["layer_first", "page_first"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backup_overwrite_load_is_bit_identical(kind, dtype, backend):
    lay, d, h, eng = make(kind, dtype, backend.split("-")[0])
    if backend.startswith("direct-"):  # force one CPU copy kind instead of the cheapest
        eng.cpu_copy = backend.split("-")[1]
    page_tokens = lay.page_tokens  # 8 slots per widened page
    length = 3 * page_tokens + 5  # partial last page
    src_pages = [6, 0, 1, 3]  # runs [6], [0, 1], [3]
    full = [torch.randn(length, d.kv_dim).to(dtype) for _ in range(d.num_layers)]
    slots = slots_of(src_pages, length, page_tokens)
    for layer in range(d.num_layers):
        d.write(layer, slots, full[layer])
    with CollectiveCounter.measure() as m:
        eng.backup(src_pages, [2, 3, 4, 0]).wait()
        d.kv.normal_()  # overwrite L1 with garbage
        dst_pages = [7, 2, 3, 4]
        job = eng.load([2, 3, 4, 0], dst_pages)
        new_slots = slots_of(dst_pages, length, page_tokens)
        for layer in range(d.num_layers):  # layer by layer, as the engine would consume it
            job.wait_layer(layer)
            owned, rows = d.read(layer, new_slots)
            want = full[layer][lay.owned_mask(new_slots)]
            assert torch.equal(rows, want)
            assert rows.shape[0] == lay.local_length(length)
        job.wait()
        assert job.done()
    assert m["n"] == 0  # a transfer never issues a collective
    assert eng.stats.bytes_d2h == eng.stats.bytes_h2d == 4 * d.bytes_per_page == job.nbytes
    assert eng.stats.jobs_d2h == eng.stats.jobs_h2d == 1
    assert job.host_pages.tolist() == [2, 3, 4, 0] and job.device_pages.tolist() == dst_pages
    # host pages that were not targets stay untouched
    assert not h.page_view(1).any() and not h.page_view(5).any()
    eng.close()


@pytest.mark.parametrize("kind", ["layer_first", "page_first"])
def test_whole_pages_and_host_page_api_agree(kind):
    lay, d, h, eng = make(kind, torch.bfloat16, c=1, rank=0, dev_pages=5, host_pages=5)
    d.kv.normal_()
    eng.backup([0, 1, 2, 3, 4], [4, 3, 2, 1, 0]).wait()
    for p in range(5):  # device page p landed in host page 4 - p, every layer
        want = d.kv[:, p * lay.page_size:(p + 1) * lay.page_size]
        assert torch.equal(h.read_page(4 - p), want)
    eng.close()


def test_many_queued_jobs_run_in_order():
    lay, d, h, eng = make("page_first", torch.float32, dev_pages=4, host_pages=4)
    jobs = []
    for value in range(1, 6):  # each load overwrites device page 0 from a fresh host page
        h.write_page(value % 4, torch.full((3, 4, 8), float(value)))
        jobs.append(eng.load([value % 4], [0]))
        jobs[-1].wait()
        assert bool((d.kv[:, :4] == value).all())
    eng.close()
    assert all(j.done() for j in jobs)


def test_bad_page_lists():
    lay, d, h, eng = make("layer_first", torch.float16, dev_pages=4, host_pages=3)
    with pytest.raises(UsageError, match="host page id 3 is outside the host pool"):
        eng.backup([0], [3])
    with pytest.raises(UsageError, match="device page id 4 is outside the device pool"):
        eng.backup([4], [0])
    with pytest.raises(UsageError, match="device page id -1"):
        eng.load([0], [-1])
    with pytest.raises(UsageError, match="differ in length: 2 vs 1"):
        eng.load([0, 1], [0])
    with pytest.raises(UsageError, match="repeats a page id"):
        eng.load([0, 1], [2, 2])
    with pytest.raises(UsageError, match="integer page ids"):
        eng.backup(torch.tensor([0.0]), [0])
    assert eng.stats.jobs_d2h == eng.stats.jobs_h2d == 0
    eng.close()
    with pytest.raises(TransferError, match="closed"):
        eng.backup([0], [0])


def test_mismatched_pools_and_backend():
    lay = DCPLayout(2, 0, 4)
    d = DeviceKVPool(lay, 2, 8, torch.float16, 2)
    with pytest.raises(UsageError, match="differ in shape"):  # 4 elements a row, not 8
        TransferEngine(d, HostKVPool(lay, 2, 4, torch.float16, 2))
    with pytest.raises(UsageError, match="no declared conversion"):  # another dtype: only
        TransferEngine(d, HostKVPool(lay, 2, 8, torch.bfloat16, 2))  # through a conversion
    with pytest.raises(UsageError, match="layouts"):
        TransferEngine(d, HostKVPool(DCPLayout(2, 1, 4), 2, 8, torch.float16, 2))
    with pytest.raises(UsageError, match="io_backend"):
        TransferEngine(d, HostKVPool(lay, 2, 8, torch.float16, 2), io_backend="dma")


def test_failed_transfer_surfaces_on_wait():
    lay, d, h, eng = make("layer_first", torch.float32)

    def boom(job):
        raise OSError("disk on fire")

    eng.backend.copy = boom
    job = eng.load([0], [0])
    with pytest.raises(TransferError, match="disk on fire"):
        job.wait(timeout=30)
    with pytest.raises(TransferError, match="disk on fire"):
        job.wait_layer(1, timeout=30)
    with pytest.raises(UsageError, match="layer 3"):
        job.wait_layer(3)
    assert eng.stats.jobs_h2d == 0
    eng.close()


def test_copies_run_off_the_calling_thread():
    """The CPU worker does the copy while the caller is free: block the worker on a gate and
    show the caller still runs and the job is not done until the gate opens."""
    import threading

    lay, d, h, eng = make("layer_first", torch.float32)
    eng.inline_bytes = 0  # a job this small is otherwise copied at submit (see below)
    gate = threading.Event()
    real = eng.backend.copy

    def gated(job):
        gate.wait(30)
        real(job)

    eng.backend.copy = gated
    d.kv.fill_(3.0)
    job = eng.backup([0, 1], [0, 1])
    assert not job.done()  # caller returned immediately; the worker is still blocked
    gate.set()
    job.wait(timeout=30)
    assert bool((h.buf[:, :8] == 3.0).all())
    eng.close()


def test_small_jobs_inline_and_waiters_run_unstarted_jobs():
    """A job of at most inline_bytes is done when submit returns; wait() on a job the copy
    thread has not started runs it on the waiting thread (no hand-off); results identical."""
    import threading

    lay, d, h, eng = make("page_first", torch.float32)
    d.kv.normal_()
    P = lay.page_size

    def dev(p):  # device page p, every layer: [L, P, D]
        return d.kv[:, p * P:(p + 1) * P]

    job = eng.backup([0, 1], [1, 0])
    assert job.nbytes <= eng.inline_bytes and job.done() and not job.failed
    assert bool((h.read_page(1) == dev(0)).all())
    # hold the worker on a first job; a second one waited for runs on this thread
    eng.inline_bytes = 0
    gate, started = threading.Event(), threading.Event()
    real = eng.backend.copy
    ran_on = {}

    def gated(job):
        ran_on[job.direction] = threading.current_thread().name
        if job.direction == "d2h" and not started.is_set():  # hold the first backup only
            started.set()
            gate.wait(30)
        real(job)

    eng.backend.copy = gated
    first = eng.backup([2], [2])
    assert started.wait(30)
    second = eng.load([1], [3])  # the h2d worker may or may not have claimed it yet
    second.wait(timeout=30)
    assert second.done() and bool((dev(3) == h.read_page(1)).all())
    third = eng.backup([3], [3])  # queued behind the gated job: this thread runs it
    third.wait(timeout=30)
    assert third.done() and not first.done()
    assert ran_on["d2h"] == threading.current_thread().name
    gate.set()
    first.wait(timeout=30)
    assert bool((h.read_page(3) == dev(3)).all())
    assert eng.stats.jobs_d2h == 3 and eng.stats.jobs_h2d == 1
    eng.close()
