"""How the CUDA path issues a job, checked on CPU: the plan picks O(layers) kernel launches for
strided or scattered jobs (not one copy per page per layer), copy engines for a few contiguous
runs (a pageable host side never gets the kernel: tests/test_gpu_paths.py), and every way of issuing moves exactly the right bytes (the kernel via its torch
reference)."""

import dataclasses

import pytest
import torch

from hicache.kernels.page_copy import page_copy_reference
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.copy_cuda import CudaBackend, DeviceCopyPlan, plan_device_copy
from hicache.l2.transfer import TransferEngine, TransferJob, plan_transfer
from hicache.layout import DCPLayout

L = 5


def make(kind, pages=12):
    lay = DCPLayout(2, 0, 4)
    d = DeviceKVPool(lay, L, 8, torch.float32, pages)
    h = HostKVPool(lay, L, 8, torch.float32, pages, layout_kind=kind)
    eng = TransferEngine(d, h)
    # the host pool as on CUDA (page-locked): the only metadata the plan reads that CPU lacks
    eng.host_side = dataclasses.replace(eng.host_side, pinned=True)
    return d, h, eng, CudaBackend(eng)  # the CUDA backend's plans and issue, checked on CPU


def job(eng, direction, src, dst):
    limits = ((eng.device_pool.num_pages, eng.host_pool.num_pages) if direction == "d2h"
              else (eng.host_pool.num_pages, eng.device_pool.num_pages))
    return TransferJob(direction, plan_transfer(src, dst, *limits), L, 0)


SCATTERED = ([7, 2, 9, 0, 5, 11, 3], [1, 8, 4, 10, 6, 0, 2])


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
def test_scattered_jobs_plan_kernel_launches_per_layer_not_per_page(kind):
    d, h, eng, cb = make(kind)
    cb._device_kernel = page_copy_reference  # as on CUDA with Triton
    for direction, want in (("h2d", L), ("d2h", 1)):
        how = cb.plan(job(eng, direction, *SCATTERED))
        assert how == DeviceCopyPlan("kernel", want)
    cb._device_kernel = None                 # no Triton, no CuPy: the old per-run/page path
    how = cb.plan(job(eng, "h2d", *SCATTERED))
    n = len(SCATTERED[0])
    assert how.launches == n * L and how.method == ("pages" if kind == "page_first" else "runs")
    eng.close()


def test_plan_prefers_2d_copies_only_when_cupy_is_asked_for():
    plan = plan_transfer(*SCATTERED, 12, 12)
    assert plan_device_copy(plan, L, "h2d", False, True, True).method == "kernel"
    assert plan_device_copy(plan, L, "h2d", False, True, True, prefer_copy2d=True) == \
        DeviceCopyPlan("copy2d", len(plan.run_len) * L)
    assert plan_device_copy(plan, L, "h2d", False, False, True).method == "copy2d"
    assert plan_device_copy(plan, L, "h2d", True, False, False).method == "runs"


def test_contiguous_layer_first_uses_copy_engines():
    d, h, eng, cb = make("layer_first")
    cb._device_kernel = page_copy_reference
    how = cb.plan(job(eng, "h2d", [0, 1, 2, 3], [4, 5, 6, 7]))
    assert how == DeviceCopyPlan("runs", L)   # one copy_ per layer
    d2, h2, eng2, cb2 = make("page_first")
    cb2._device_kernel = page_copy_reference
    assert cb2.plan(job(eng2, "h2d", [0, 1, 2, 3], [4, 5, 6, 7])).method == \
        "kernel"                              # strided host side: the kernel
    eng.close()
    eng2.close()


@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
@pytest.mark.parametrize("method", ["kernel", "runs", "pages"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_every_issue_method_moves_the_right_bytes(kind, method, direction):
    d, h, eng, cb = make(kind)
    d.kv.normal_()
    h.buf.normal_()
    src, dst = SCATTERED
    before_dev, before_host = d.kv.clone(), h.buf.clone()
    j = job(eng, direction, src, dst)
    calls, layers = [], []

    def counting_kernel(*a):
        calls.append(1)
        page_copy_reference(*a)

    n = cb.issue(j, DeviceCopyPlan(method, 0), None, layers.append, kernel=counting_kernel)
    assert layers == list(range(L))           # every layer reported, in order
    if method == "kernel":
        assert n == len(calls) == (L if direction == "h2d" else 1)
    P = 4
    for layer in range(L):
        for s, t in zip(src, dst):
            if direction == "d2h":
                got, want = h.page_view(t)[layer], before_dev[layer, s * P:(s + 1) * P]
            else:
                got, want = d.kv[layer, t * P:(t + 1) * P], _host_page(h, before_host, s)[layer]
            assert torch.equal(got, want)
    untouched = set(range(12)) - set(dst)
    for p in untouched:                       # pages that were not targets are unchanged
        if direction == "d2h":
            assert torch.equal(_host_page(h, h.buf, p), _host_page(h, before_host, p))
        else:
            assert torch.equal(d.kv[:, p * P:(p + 1) * P], before_dev[:, p * P:(p + 1) * P])
    eng.close()


def _host_page(h, buf, p):
    """Host page p of ``buf`` (a tensor laid out like h.buf) as [L, P, D]."""
    saved = h.buf
    h.buf = buf
    try:
        return h.page_view(p).clone()
    finally:
        h.buf = saved
