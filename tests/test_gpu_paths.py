"""The CUDA paths' fixes that can be shown without a GPU (issue 29; the rest are checks in
bench/gpu_check.py, which prints a figure or a FAIL line naming each):

- the CUDA copy backend never hands a pageable host side (an L2 pool with pin="off" or whose
  cudaHostRegister was refused, an unpinned staging buffer) to the Triton kernel or CuPy: plan
  checked on CPU pools, the same pools seen as pinned (the only difference) get the kernel;
- ``force_method`` (the copy-engine row of gpu_check) is honoured and checked;
- engine and backend form no reference cycle: pools are freed by reference counts alone;
- the decode kernel makes no output it does not return (no zero/full buffers per call);
- the gloo twin of a CUDA-only group is named after its parent, so ranks that created
  different numbers of groups before still meet (real gloo processes);
- ``make gpu-check`` on a CPU machine prints the check list and exits 0.
"""

import dataclasses
import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from hicache.distributed import launch
from hicache.errors import TransferError
from hicache.kernels.page_copy import page_copy_reference
from hicache.l1.pool import DeviceKVPool
from hicache.l2.copy_cuda import CudaBackend, DeviceCopyPlan
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine, TransferJob, plan_transfer
from hicache.layout import DCPLayout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, PAGES = 3, 12
SCATTERED = ([7, 2, 9, 0, 5], [1, 8, 4, 10, 6])


def _engine(io_backend="direct", kind="page_first"):
    lay = DCPLayout(1, 0, 4)
    d = DeviceKVPool(lay, L, 8, torch.float32, PAGES)
    h = HostKVPool(lay, L, 8, torch.float32, PAGES, layout_kind=kind, pin="off")
    return TransferEngine(d, h, io_backend=io_backend, backend=CudaBackend)


def _job(direction, src, dst):
    return TransferJob(direction, plan_transfer(src, dst, PAGES, PAGES), L, 0)


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("kind", ["page_first", "layer_first"])
def test_a_pageable_host_side_never_gets_the_kernel(io_backend, kind):
    eng = _engine(io_backend, kind)
    cb = eng.backend
    cb._device_kernel = page_copy_reference  # as on CUDA with Triton usable
    cb._cupy = cb._cupy_asked = True         # and CuPy asked for: still not for pageable memory
    assert not eng.host_side.pinned
    for direction in ("d2h", "h2d"):
        how = cb.plan(_job(direction, *SCATTERED))
        assert how.method in ("runs", "pages"), (direction, how)
    # the same pools with the host side page-locked: the kernel (or 2D copies) is used
    eng.host_side = dataclasses.replace(eng.host_side, pinned=True)
    cb._cupy = cb._cupy_asked = False
    for direction, launches in (("d2h", 1), ("h2d", L)):
        assert cb.plan(_job(direction, *SCATTERED)) == DeviceCopyPlan("kernel", launches)
    eng.close()


def test_an_unpinned_staging_buffer_gets_plain_copies():
    eng = _engine("kernel")
    eng.host_side = dataclasses.replace(eng.host_side, pinned=True)
    staging = torch.zeros(5, L, 4, 8)
    src = dataclasses.replace(eng.host_side, medium="staging", base=staging, num_pages=5,
                              page_major=True, pinned=False)
    job = TransferJob("h2d", plan_transfer(range(5), SCATTERED[1], 5, PAGES), L, 0,
                      src, eng.device_side)
    assert eng.backend.plan(job).method in ("runs", "pages")
    eng.close()


def test_force_method_is_honoured_for_pinned_hosts_and_checked():
    eng = _engine("direct")
    eng.host_side = dataclasses.replace(eng.host_side, pinned=True)
    cb = eng.backend
    cb._device_kernel = page_copy_reference  # as on CUDA with Triton usable
    n = len(SCATTERED[0])
    cb.force_method = "pages"  # gpu_check's copy-engine row: one copy_ per page per layer
    assert cb.plan(_job("h2d", *SCATTERED)) == DeviceCopyPlan("pages", n * L)
    cb.force_method = "kernel"
    assert cb.plan(_job("d2h", *SCATTERED)) == DeviceCopyPlan("kernel", 1)
    cb._device_kernel = None  # no Triton here: forcing the kernel names that
    with pytest.raises(TransferError, match="not usable"):
        cb.plan(_job("d2h", *SCATTERED))
    cb.force_method = "bogus"
    with pytest.raises(TransferError, match="force_method"):
        cb.plan(_job("h2d", *SCATTERED))
    eng.close()


def test_engine_and_backend_are_freed_without_a_collection():
    eng = _engine("kernel")
    refs = [weakref.ref(o) for o in (eng, eng.backend, eng.device_pool, eng.host_pool,
                                     eng.host_pool.buf)]
    backend = eng.backend
    assert backend.engine is eng
    gc.collect()
    gc.disable()
    try:
        eng.close()
        del eng
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False, True, False, False, False]  # only the backend we still hold
    with pytest.raises(TransferError, match="freed"):
        backend.engine


ALLOCS = textwrap.dedent(r"""
    import json, math
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from hicache.kernels.decode_attention import decode_attention_latent

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {a.untyped_storage().data_ptr() for a in
                    torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
            for o in torch.utils._pytree.tree_leaves(out):  # tensors in new memory
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in seen:
                    self.shapes.append(list(o.shape))
            return out

    t, h, r, dr, n = 3, 4, 16, 8, 40
    g = torch.Generator().manual_seed(0)
    q_lat, q_pe = torch.randn(t, h, r, generator=g), torch.randn(t, h, dr, generator=g)
    kv = torch.randn(n, r + dr, generator=g)
    pos = torch.arange(n)
    out = {}
    for splits in (1, 2):
        decode_attention_latent(q_lat, q_pe, kv, pos[-t:], pos, 0.3, r, num_splits=splits)
        with Allocations() as a:
            o, lse = decode_attention_latent(q_lat, q_pe, kv, pos[-t:], pos, 0.3, r,
                                             num_splits=splits)
        out[splits] = a.shapes
    with Allocations() as a:
        o, lse = decode_attention_latent(q_lat, q_pe, kv[:0], pos[-t:], pos[:0], 0.3, r)
    out["empty"] = a.shapes
    out["empty_ok"] = bool((o == 0).all() and torch.isneginf(lse).all())
    print(json.dumps(out))
""")


def test_decode_kernel_makes_only_the_outputs_it_returns():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", ALLOCS], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    t, h, r = 3, 4, 16
    big = [s for s in out["1"] if s and s[-1] == r]  # [.., T, H, R] tensors
    assert big == [[1, t, h, r]], out["1"]     # the one split's output, returned as is
    big = [s for s in out["2"] if s and s[-1] == r]
    assert big == [[2, t, h, r], [t, h, r]], out["2"]  # the partials, then the merged output
    assert out["empty"] and out["empty_ok"]                     # zeros made only when empty


def _groups_then_twin(rank, world):
    """Rank 0 makes two extra groups first (rank 1 makes none), then the CUDA-only group and
    its gloo twin: their names must agree, or the twin's rendezvous hangs."""
    import torch.distributed as dist

    from hicache import distributed as hd
    if rank == 0:
        for _ in range(2):
            dist.new_group([0], use_local_synchronization=True)
    engine = dist.new_group(list(range(world)), backend="cuda:gloo")
    ctl = hd.control_group(engine)
    t = torch.tensor([10 + rank])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctl)
    return {"twin": hd.group_name(ctl), "engine": hd.group_name(engine), "min": int(t)}


def test_gloo_twin_name_agrees_across_ranks_with_different_group_histories():
    out = launch(2, _groups_then_twin, timeout_s=90)
    assert out[0]["twin"] == out[1]["twin"] == f"hicache-control:{out[0]['engine']}"
    assert [o["min"] for o in out] == [10, 10]


def test_make_gpu_check_without_a_gpu_prints_the_checks_and_exits_0():
    env = dict(os.environ, PYTHONPATH="/nonexistent", GPU_PY=sys.executable, OUT="")
    proc = subprocess.run(["make", "-s", "gpu-check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu-check: ") and "by estimate" in lines[0], lines[:2]
    est = float(lines[0].split("about ")[1].split(" s")[0])
    assert 0 < est < 240  # the whole GPU run stays under 4 minutes by estimate
    names = [ln.split(".", 1)[1].split("~")[0].strip() for ln in lines[1:]
             if ln[:4].strip().isdigit()]
    for want in ("pools", "copy engines", "unpinned L2", "decode kernel", "extend",
                 "page copy", "nccl", "serving loop"):
        assert any(want in n for n in names), (want, names)
    assert "no GPU here" in proc.stdout


def _gpu_check_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check_under_test",
                                                  os.path.join(ROOT, "bench", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_a_check_past_its_limit_fails_with_stacks_and_the_next_check_runs(tmp_path, capfd):
    import threading
    gc_mod = _gpu_check_module()
    gc_mod._JSON_PATHS.append(str(tmp_path / "gpu_check.json"))
    release = threading.Event()

    def stuck_in_a_copy(sz, dev):
        release.wait(30)  # a hung CUDA call, as far as the runner can tell

    def measured(sz, dev):
        gc_mod.figure("copy", 12.5, "GB/s", 25.0, "pinned copy")
        return "fine"

    dev = torch.device("cpu")
    try:
        gc_mod.run_check(gc_mod.Check("hangs", stuck_in_a_copy, (None, dev), 1, 60), 0.5, dev)
        first = json.loads((tmp_path / "gpu_check.json").read_text())  # written right away
        gc_mod.run_check(gc_mod.Check("measures", measured, (None, dev), 1, 60), 5, dev)
    finally:
        release.set()
    out = capfd.readouterr().out
    assert "stuck_in_a_copy" in out  # every thread's stack, the hung one included
    hung = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert len(hung) == 1 and "hangs" in hung[0] and "timed out after" in hung[0], hung
    assert "figure  copy: 12.500 GB/s" in out and "0.50x" in out  # printed when measured
    assert [c["status"] for c in first["checks"]] == ["FAIL"]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["status"] for c in doc["checks"]] == ["FAIL", "PASS"]
    assert doc["figures"][0]["check"] == "measures" and doc["figures"][0]["ratio"] == 0.5
