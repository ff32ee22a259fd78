"""Copy backends: the registry picks one per device type, a new backend is a class (no engine
branch), and restore jobs (an L3 read's staging buffer -> L1) move the right bytes, layer by
layer, through every CPU way of copying and through the CUDA issue plan checked on CPU."""

import dataclasses
import threading

import pytest
import torch

from hicache.errors import TransferError, UsageError
from hicache.kernels.page_copy import page_copy_reference
from hicache.l1.pool import DeviceKVPool
from hicache.l2 import transfer
from hicache.l2.copy_cpu import CpuBackend
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import CopyBackend, TransferEngine, backend_for, register_backend
from hicache.layout import DCPLayout

L, P, D = 3, 4, 8


def pools(kind="page_first", pages=8, dtype=torch.float32):
    lay = DCPLayout(2, 1, P)
    return (DeviceKVPool(lay, L, D, dtype, pages),
            HostKVPool(lay, L, D, dtype, pages, layout_kind=kind))


def dev_page(d, p):
    """Device page p, every layer: [L, P, D]."""
    return d.kv[:, p * P:(p + 1) * P]


class CallerThreadBackend(CopyBackend):
    """A whole backend in a few lines: each job copied at submit on the calling thread, layer
    by layer, with torch indexing on the [L, pages, W] views of both sides."""

    def submit(self, job):
        try:
            self.copy(job)
        except BaseException as err:  # noqa: BLE001 - the job carries it to the waiter
            job._fail(err)
            return
        self.engine.account(job)
        job._succeed()

    def copy(self, job):
        src, dst = (side.pages for side in self.engine.sides(job))
        for layer in range(job.num_layers):
            dst[layer, job.plan.dst_pages] = src[layer, job.plan.src_pages]
            job._layer_done(layer)


def test_registry_picks_a_backend_per_device_type():
    assert backend_for("cpu") is CpuBackend
    assert backend_for("cuda").__name__ == "CudaBackend"  # importable without a GPU
    with pytest.raises(UsageError, match="no copy backend for 'npu'.*cpu, cuda"):
        backend_for("npu")
    with pytest.raises(TypeError, match="CopyBackend"):
        register_backend("npu", object)
    try:
        assert register_backend("npu", CallerThreadBackend) is CallerThreadBackend
        assert backend_for("npu") is CallerThreadBackend
    finally:
        transfer._BACKENDS.pop("npu")
    d, h = pools()
    with TransferEngine(d, h) as eng:
        assert type(eng.backend) is CpuBackend


def test_a_backend_without_copy_is_refused_when_built():
    class SubmitOnly(CopyBackend):
        def submit(self, job):
            pass
    with pytest.raises(TypeError, match="copy"):
        SubmitOnly(None)


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
def test_a_new_backend_is_a_class_not_an_engine_branch(kind):
    d, h = pools(kind)
    d.kv.normal_()
    before = d.kv.clone()
    with TransferEngine(d, h, backend=CallerThreadBackend) as eng:
        assert isinstance(eng.backend, CallerThreadBackend)
        job = eng.backup([5, 0, 3], [1, 2, 0])
        assert job.done() and eng.stats.jobs_d2h == 1  # copied at submit, counted
        d.kv.zero_()
        job = eng.load([1, 2, 0], [2, 7, 4])
        for layer in range(L):
            job.wait_layer(layer)
        for s, t in zip([5, 0, 3], [2, 7, 4]):
            assert torch.equal(dev_page(d, t), before[:, s * P:(s + 1) * P])
        staging = torch.randn(2, L, P, D)
        eng.restore(staging, [6, 1]).wait()
        assert torch.equal(dev_page(d, 6), staging[0]) and torch.equal(dev_page(d, 1), staging[1])
        assert eng.stats.jobs_h2d == 2
        eng.backend.copy = lambda job: (_ for _ in ()).throw(OSError("backend broke"))
        with pytest.raises(TransferError, match="backend broke"):
            eng.load([0], [0]).wait()


@pytest.mark.parametrize("io,threads,inline", [("direct", 1, True), ("direct", 1, False),
                                               ("direct", 3, False), ("kernel", 1, False)])
def test_restore_copies_staging_pages_into_device_pages(io, threads, inline):
    d, h = pools()
    with TransferEngine(d, h, io_backend=io, copy_threads=threads) as eng:
        if not inline:
            eng.inline_bytes = 0  # through the h2d worker thread
        staging = torch.randn(5, L, P, D)
        before = d.kv.clone()
        targets = [6, 0, 3, 4]  # 4 of the 5 staged pages, scattered
        job = eng.restore(staging, targets)
        assert job.direction == "h2d" and job.src.medium == "staging"
        for layer in range(L):
            job.wait_layer(layer, timeout=30)
            for i, t in enumerate(targets):  # layer `layer` has landed on every target
                assert torch.equal(d.kv[layer, t * P:(t + 1) * P], staging[i, layer])
        job.wait(timeout=30)
        for p in set(range(8)) - set(targets):
            assert torch.equal(dev_page(d, p), before[:, p * P:(p + 1) * P])
        assert eng.stats.jobs_h2d == 1 and eng.stats.bytes_h2d == 4 * d.bytes_per_page


def test_restore_refuses_bad_staging_and_pages():
    d, h = pools()
    with TransferEngine(d, h) as eng:
        for bad in (torch.zeros(2, L, P + 1, D), torch.zeros(2, L, P, D, dtype=torch.float16),
                    torch.zeros(L, P, D), torch.zeros(2, P, L, D).transpose(1, 2), [[0.0]]):
            with pytest.raises(UsageError, match="staging"):
                eng.restore(bad, [0])
        with pytest.raises(UsageError, match="3 pages from a staging buffer of 2"):
            eng.restore(torch.zeros(2, L, P, D), [0, 1, 2])
        with pytest.raises(UsageError, match="outside the device pool"):
            eng.restore(torch.zeros(2, L, P, D), [0, 8])
        with pytest.raises(UsageError, match="repeats"):
            eng.restore(torch.zeros(2, L, P, D), [3, 3])


def test_restore_jobs_wait_runs_an_unstarted_job_and_failures_surface():
    d, h = pools()
    with TransferEngine(d, h) as eng:
        eng.inline_bytes = 0
        gate, started = threading.Event(), threading.Event()
        real = eng.backend.copy

        def gated(job):
            if job.src is None and not started.is_set():  # hold the worker on a plain load
                started.set()
                gate.wait(30)
            real(job)
        eng.backend.copy = gated
        first = eng.load([0], [0])
        assert started.wait(30)
        staging = torch.randn(1, L, P, D)
        job = eng.restore(staging, [5])  # queued behind the held load: this thread runs it
        job.wait(timeout=30)
        assert torch.equal(dev_page(d, 5), staging[0]) and not first.done()
        gate.set()
        first.wait(timeout=30)

        def broken(job):
            raise OSError("staging read failed")
        eng.backend.copy = broken
        job = eng.restore(staging, [2])
        with pytest.raises(TransferError, match="staging read failed"):
            job.wait_layer(0, timeout=30)
        assert job.status() == transfer.FAILED


def test_cuda_plan_copies_unpinned_staging_with_copy_engines():
    """A kernel cannot read pageable host memory: an unpinned staging buffer is copied with
    copy_ runs on CUDA even where a scattered load would launch the kernel; checked on CPU."""
    from hicache.l2.copy_cuda import CudaBackend, DeviceCopyPlan
    d, h = pools()
    with TransferEngine(d, h) as eng:
        cb = CudaBackend(eng)
        cb._device_kernel = page_copy_reference  # as on CUDA with Triton
        staging = torch.randn(3, L, P, D)
        job = eng.restore(staging, [7, 1, 4])
        job.wait()
        d.kv.zero_()
        how = cb.plan(job)
        assert how == DeviceCopyPlan("runs", 3 * L)
        layers = []
        assert cb.issue(job, how, None, layers.append) == 3 * L
        assert layers == list(range(L))
        for i, t in enumerate([7, 1, 4]):
            assert torch.equal(dev_page(d, t), staging[i])
        load = eng.load([0, 3, 5], [2, 6, 0])
        load.wait()
        assert cb.plan(load).method == "runs"    # a pageable L2 pool: no kernel either
        eng.host_side = dataclasses.replace(eng.host_side, pinned=True)
        assert cb.plan(load).method == "kernel"  # the pinned pool path is unchanged
