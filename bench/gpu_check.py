"""``make gpu-check``: every CUDA path of hicache, checked for correctness, then GPU figures.

    python bench/gpu_check.py [--json FILE] [--smoke] [--list] [--only TEXT ...]

Runs on the GPU image's own interpreter as it is (torch, triton, numpy and the small pure
packages; no lmdb, no redis client, no network needed). It first prints the check list with an
estimate of each check's time on an H200 and each check's time limit. Each check prints PASS,
FAIL (with the error) or SKIP (what is missing), each figure is printed the moment it is
measured, and the results so far are rewritten after every check to ``--json FILE`` and to
``$OUT/gpu_check.json`` when ``OUT`` is set: a run cut short keeps every figure it measured.
A check that outlives its limit gets every thread's stack dumped (faulthandler) and a FAIL line,
and the next check runs. Exit status 1 when any check failed. Without CUDA it prints the check
list, says there is no GPU and exits 0; ``--smoke`` instead runs the same checks at tiny shapes
on the CPU (kernels under ``TRITON_INTERPRET=1``), which keeps this script working where no GPU
is. docs/gpu.md says what each check measures.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib.util
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


@dataclass(frozen=True)
class Sizes:
    layers: int        # transfer / page-copy pools
    page: int          # rows per page (P)
    pages: int         # L1 and L2 pages
    move: int          # pages moved per transfer
    dec_t: int         # decode batch
    dec_h: int
    dec_r: int
    dec_dr: int
    dec_n: int         # keys in the decode shard
    ext_t: int         # tokens of the long extend
    ext_n: int
    reps: int


GPU = Sizes(layers=61, page=16, pages=2048, move=512, dec_t=4, dec_h=128, dec_r=512, dec_dr=64,
            dec_n=32768, ext_t=32768 + 64, ext_n=256, reps=5)
SMOKE = Sizes(layers=2, page=4, pages=16, move=5, dec_t=2, dec_h=4, dec_r=32, dec_dr=8,
              dec_n=40, ext_t=40, ext_n=24, reps=1)
KV_DIM = 576


@dataclass(frozen=True)
class Check:
    """One check: ``fn(*args)`` returns a detail line (raises to fail, ``Skip`` to skip).
    ``est_s``: its time on an H200 by estimate; ``limit_s``: the most it may take on a GPU."""

    name: str
    fn: Callable
    args: tuple
    est_s: float
    limit_s: float


SMOKE_LIMIT_S = 300.0  # per check on the CPU (interpreted kernels, a loaded machine)
RESULTS: list[dict] = []
FIGURES: list[dict] = []
META: dict = {}
_JSON_PATHS: list[str] = []
_CURRENT = {"check": None}


class Skip(Exception):
    """A check that cannot run here (a missing optional package)."""


def write_json() -> None:
    """The results so far, to every JSON path (written whole, then renamed into place)."""
    doc = {**META, "checks": RESULTS, "figures": FIGURES}
    for path in _JSON_PATHS:
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as fh:
                json.dump(doc, fh, indent=1)
            os.replace(tmp, path)
        except OSError as e:
            print(f"gpu-check: could not write {path}: {e}", flush=True)


def run_check(c: Check, limit_s: float, dev) -> None:
    """``c`` in its own thread, joined for at most ``limit_s``: past that every thread's stack
    is dumped and the check FAILs (its thread is left behind; the next check runs)."""
    box: dict = {}

    def body() -> None:
        try:
            if dev.type == "cuda":
                import torch
                torch.cuda.set_device(dev)
            box["detail"] = c.fn(*c.args) or ""
            box["status"] = "PASS"
        except Skip as e:
            box["status"], box["detail"] = "SKIP", str(e)
        except BaseException as e:  # every failure is reported; the other checks still run
            box["status"], box["detail"] = "FAIL", f"{type(e).__name__}: {e}"
            traceback.print_exc()
            sys.stderr.flush()

    _CURRENT["check"] = c.name
    t0 = time.perf_counter()
    th = threading.Thread(target=body, name=f"check: {c.name}", daemon=True)
    th.start()
    th.join(limit_s)
    took = time.perf_counter() - t0
    if th.is_alive():
        print(f"--- {c.name}: no result after {limit_s:g} s; every thread's stack:",
              flush=True)
        try:
            faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        except (AttributeError, OSError, ValueError):  # stdout without a file descriptor
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        sys.stdout.flush()
        status, detail = "FAIL", f"timed out after {limit_s:g} s (stacks dumped above)"
    else:
        status, detail = box["status"], box["detail"]
    RESULTS.append({"check": c.name, "status": status, "detail": detail, "s": round(took, 2),
                    "limit_s": limit_s, "est_s": c.est_s})
    print(f"{status:4}  {c.name:<44} {took:6.1f} s  {detail}", flush=True)
    write_json()


def figure(what: str, value: float, unit: str, baseline: float, base_what: str) -> None:
    """Record a figure and print it at once (a later hang cannot lose it)."""
    ratio = value / baseline if baseline and not math.isnan(baseline) else float("nan")
    FIGURES.append({"check": _CURRENT["check"], "what": what, "value": value, "unit": unit,
                    "baseline": baseline, "baseline_what": base_what, "ratio": ratio})
    base = "" if math.isnan(baseline) else \
        f"  vs {baseline:.3f} {unit} {base_what} ({ratio:.2f}x)"
    print(f"      figure  {what}: {value:.3f} {unit}{base}", flush=True)


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """(fn's result, seconds it took with the device synchronised before and after)."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def best(fn, reps: int) -> float:
    fn()  # warm-up (compiles a kernel the first time)
    return min(timed(fn)[1] for _ in range(max(reps, 1)))


def _free() -> None:
    """Give the memory of the check that just ended back (each holds GBs on a GPU)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- checks -------------------------------------------------------------------------------------
def check_env(sz: Sizes, dev) -> str:
    """What this machine is: versions, device, and whether host memory can be page-locked."""
    import numpy as np
    import torch
    import triton
    cuda = dev.type == "cuda"
    notes = [f"torch {torch.__version__}", f"triton {triton.__version__}",
             f"numpy {np.__version__}", f"python {sys.version.split()[0]}"]
    if cuda:
        p = torch.cuda.get_device_properties(dev)
        notes.append(f"{p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB "
                     f"{p.multi_processor_count} SMs, CUDA {torch.version.cuda}")
        assert torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).is_pinned()
    for mod in ("cupy", "lmdb", "redis"):
        notes.append(f"{mod} {'importable' if importlib.util.find_spec(mod) else 'absent'}")
    return "; ".join(notes)


def _pools(sz: Sizes, dev, layout: str = "page_first", pin: str | None = None, fill=True):
    import torch

    from hicache.l1.pool import DeviceKVPool
    from hicache.l2.pool import HostKVPool
    from hicache.layout import DCPLayout
    lay = DCPLayout(1, 0, sz.page)
    l1 = DeviceKVPool(lay, sz.layers, KV_DIM, torch.bfloat16, sz.pages, device=dev)
    if fill:
        g = torch.Generator(device=dev).manual_seed(0)
        l1.kv.copy_(torch.randn(l1.kv.shape, device=dev, generator=g).to(torch.bfloat16))
    pin = pin or ("on" if dev.type == "cuda" else "off")
    l2 = HostKVPool(lay, sz.layers, KV_DIM, torch.bfloat16, sz.pages, layout_kind=layout,
                    pin=pin)
    return l1, l2


def check_pools(sz: Sizes, dev) -> str:
    """L1 on the device, L2 page-locked in place with exactly its bytes; both freed the moment
    their transfer engine is dropped (no engine <-> backend reference cycle)."""
    import torch

    from hicache.l2.transfer import TransferEngine
    cuda = dev.type == "cuda"
    gc.collect()
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    l1, l2 = _pools(sz, dev, fill=False)
    assert l1.kv.device.type == dev.type, l1.kv.device
    assert l2.buf.is_pinned() == cuda, "L2 should be page-locked exactly when CUDA exists"
    assert l2.buf.untyped_storage().nbytes() == l2.nbytes == \
        sz.pages * sz.layers * sz.page * KV_DIM * 2, "L2 is not exactly the policy's bytes"
    assert not l2.buf.any() and not l1.kv.any()
    line = f"L1 {l1.kv.numel() * 2 / 2**30:.2f} GiB on {l1.kv.device}, L2 " \
           f"{l2.nbytes / 2**30:.2f} GiB pinned={l2.buf.is_pinned()}"
    from hicache.l2.copy_cuda import CudaBackend
    # on CPU (smoke) the CUDA backend is built over the pools without copying: its references
    eng = TransferEngine(l1, l2, io_backend="kernel", backend=None if cuda else CudaBackend)
    if cuda:
        eng.backup([0, 1], [1, 0]).wait()
    dead = [weakref.ref(l1), weakref.ref(l2), weakref.ref(eng), weakref.ref(eng.backend)]
    gc.disable()  # freed by reference counts alone, not by a collection
    try:
        eng.close()
        del eng, l1, l2
        alive = [r() is not None for r in dead]
        after = torch.cuda.memory_allocated(dev) if cuda else 0
    finally:
        gc.enable()
    assert not any(alive), f"still alive after drop (pool, pool, engine, backend): {alive}"
    assert after <= before, f"{(after - before) / 2**30:.2f} GiB of the pools still allocated"
    return line + "; freed on drop without gc"


def check_transfer(sz: Sizes, dev, layout: str, backend: str, method: str | None = None,
                   cupy: bool = False) -> str:
    """Backup (D2H) then layer-by-layer load (H2D) of scattered pages, bit-exact; GB/s by the
    wall clock and by the jobs' own CUDA-event ``seconds``, against one contiguous pinned copy
    of the same bytes. ``method`` forces a CUDA issue method ("pages": copy engines only)."""
    import torch

    from hicache.l2.copy_cuda import HAVE_CUPY
    from hicache.l2.transfer import TransferEngine, TransferJob
    cuda = dev.type == "cuda"
    if cupy and not HAVE_CUPY:
        raise Skip("cupy is not installed (pip install 'hicache[gpu]')")
    if method is not None and not cuda:
        raise Skip("an issue method of the CUDA backend: needs CUDA")
    L, P, D, n = sz.layers, sz.page, KV_DIM, sz.move
    l1, l2 = _pools(sz, dev, layout)
    eng = TransferEngine(l1, l2, io_backend=backend, use_cupy=cupy if cupy else None)
    if method is not None:
        eng.backend.force_method = method
    reps = 2 if method == "pages" else sz.reps
    try:
        g = torch.Generator().manual_seed(1)
        perm = torch.randperm(sz.pages, generator=g)
        dp, dp2 = perm[:n], perm[n:2 * n]                       # scattered device pages
        hp = torch.randperm(sz.pages, generator=g)[:n]         # scattered host pages
        dev4 = l1.kv.view(L, sz.pages, P, D)
        host4 = (l2.buf.view(L, sz.pages, P, D) if layout == "layer_first"
                 else l2.buf.permute(1, 0, 2, 3))              # [L, pages, P, D] either way
        ref = dev4[:, dp.to(dev)].clone()
        how = eng.backend.plan(TransferJob("d2h", _plan(dp, hp, sz), L, 0)) if cuda else None
        job = eng.backup(dp, hp)
        job.wait()
        assert torch.equal(host4[:, hp].to(dev), ref), "D2H bytes differ"
        dev4[:, dp2.to(dev)] = 0
        sync()  # the zeroing (this stream) is done before the load (its own stream) writes
        job = eng.load(hp, dp2)
        for i in range(L):  # layer i is usable once wait_layer(i) returns (an event on CUDA)
            job.wait_layer(i)
            assert torch.equal(dev4[i, dp2.to(dev)], ref[i]), f"H2D layer {i} differs"
        job.wait()
        nbytes = n * L * P * D * 2
        ev: dict[str, list[float]] = {"d2h": [], "h2d": []}

        def run(direction):
            j = eng.backup(dp, hp) if direction == "d2h" else eng.load(hp, dp2)
            j.wait()
            ev[direction].append(j.seconds)

        t_d2h = best(lambda: run("d2h"), reps)
        t_h2d = best(lambda: run("h2d"), reps)
        if cuda:  # the jobs' own seconds come from CUDA events (stats()["gbps"] reads them)
            assert min(ev["d2h"] + ev["h2d"]) > 0, f"a CUDA job's seconds stayed 0: {ev}"
    finally:
        eng.close()
    # the baseline: one contiguous copy of the same bytes between device and pinned host memory
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    r_d2h = best(lambda: h.copy_(d, non_blocking=True), sz.reps)
    r_h2d = best(lambda: d.copy_(h, non_blocking=True), sz.reps)
    tag = f"{layout} {backend}{' cupy' if cupy else ''}{f' forced {method}' if method else ''}"
    if how is not None:
        tag += f" [{how.method}]"
    figure(f"D2H {tag}, {n} scattered pages", nbytes / t_d2h / 1e9, "GB/s", nbytes / r_d2h / 1e9,
           "one contiguous pinned copy")
    figure(f"H2D {tag}, {n} scattered pages", nbytes / t_h2d / 1e9, "GB/s", nbytes / r_h2d / 1e9,
           "one contiguous pinned copy")
    line = f"{nbytes / 2**20:.0f} MiB each way bit-exact; D2H {nbytes / t_d2h / 1e9:.1f} GB/s, " \
           f"H2D {nbytes / t_h2d / 1e9:.1f} GB/s"
    if cuda:
        line += f"; by events D2H {nbytes / min(ev['d2h']) / 1e9:.1f} GB/s, H2D " \
                f"{nbytes / min(ev['h2d']) / 1e9:.1f} GB/s"
    return line


def _plan(src, dst, sz: Sizes):
    from hicache.l2.transfer import plan_transfer
    return plan_transfer(src, dst, sz.pages, sz.pages)


def check_unpinned(sz: Sizes, dev) -> str:
    """An L2 pool left pageable (``pin = "off"``; or cudaHostRegister refused): the CUDA
    backend plans plain copies for it (no Triton kernel, which cannot read pageable memory),
    and on a GPU scattered pages move bit-exact through both io backends."""
    import dataclasses

    import torch

    from hicache.l2.copy_cuda import CudaBackend
    from hicache.l2.transfer import TransferEngine, TransferJob
    cuda = dev.type == "cuda"
    small = dataclasses.replace(sz, pages=min(sz.pages, 256), move=min(sz.move, 64))
    L, n = small.layers, small.move
    l1, l2 = _pools(small, dev, "page_first", pin="off")
    assert not l2.pinned and not l2.buf.is_pinned()
    notes = []
    g = torch.Generator().manual_seed(5)
    dp = torch.randperm(small.pages, generator=g)[:n]
    hp = torch.randperm(small.pages, generator=g)[:n]
    for backend in ("kernel", "direct"):
        eng = TransferEngine(l1, l2, io_backend=backend,
                             backend=None if cuda else CudaBackend)
        try:
            cb = eng.backend
            if not cuda:  # the plan as on a GPU with Triton: only the host side's pinning differs
                cb._device_kernel = lambda *a: None
            for direction, (s, d) in (("d2h", (dp, hp)), ("h2d", (hp, dp))):
                how = cb.plan(TransferJob(direction, _plan(s, d, small), L, 0))
                assert how.method in ("runs", "pages"), \
                    f"{backend} {direction}: {how.method} for a pageable host pool"
            notes.append(f"{backend}: {how.method}")
            if cuda:
                dev4 = l1.kv.view(L, small.pages, -1)
                ref = dev4[:, dp.to(dev)].clone()
                eng.backup(dp, hp).wait()
                dev4[:, dp.to(dev)] = 0
                sync()
                eng.load(hp, dp).wait()
                assert torch.equal(dev4[:, dp.to(dev)], ref), f"{backend}: bytes differ"
        finally:
            eng.close()
    return f"{n} scattered pages, pageable L2: " + ", ".join(notes) + \
        ("; bit-exact both ways" if cuda else "; planned (copies need a GPU)")


def check_decode(sz: Sizes, dev) -> str:
    """The latent decode kernel (bf16 on CUDA) against torch; then fp32 inputs, whose
    compiled kernel must not spill registers (a FAIL names the bytes per thread)."""
    import torch

    from hicache.engine.attention import attend_latent_torch
    from hicache.kernels.decode_attention import decode_attention_latent, register_spills
    T, H, R, N = sz.dec_t, sz.dec_h, sz.dec_r, sz.dec_n
    q_lat, q_pe, kv = _latent_inputs(sz, dev, T, N, seed=2)
    q_lat, q_pe = q_lat.float(), q_pe.float()  # fp32 queries the kernel's dtype holds exactly
    cuda, dt = dev.type == "cuda", kv.dtype
    scale = 1.0 / math.sqrt(192)
    kv_pos = torch.arange(N, device=dev) * 2            # rank 0 of a DCP-2 shard
    q_pos = torch.arange(2 * N - T, 2 * N, device=dev)
    o, lse = decode_attention_latent(q_lat, q_pe, kv, q_pos, kv_pos, scale, R)
    o_ref, lse_ref = attend_latent_torch(q_lat, q_pe, kv, q_pos, kv_pos, scale, R)
    eo, el = _close(o, lse, o_ref, lse_ref, 2e-2 if cuda else 1e-4)
    tk = best(lambda: decode_attention_latent(q_lat, q_pe, kv, q_pos, kv_pos, scale, R), sz.reps)
    tt = best(lambda: attend_latent_torch(q_lat, q_pe, kv, q_pos, kv_pos, scale, R), sz.reps)
    figure(f"decode attention T={T} H={H} N={N} {str(dt)[6:]}", tk * 1e3, "ms", tt * 1e3,
           "torch reference")
    line = f"decode T={T} N={N}: max err o {eo:.2g} lse {el:.2g}; kernel {tk * 1e3:.3f} ms " \
           f"vs torch {tt * 1e3:.3f} ms"
    # fp32 rows: the kernel's fp32 dot path (exact products), checked and its spills read
    n32 = min(N, 4096)
    kv32 = kv[:n32].float()
    kp32 = kv_pos[:n32]
    o, lse = decode_attention_latent(q_lat, q_pe, kv32, q_pos, kp32, scale, R)
    o_ref, lse_ref = attend_latent_torch(q_lat, q_pe, kv32, q_pos, kp32, scale, R)
    e32, _ = _close(o, lse, o_ref, lse_ref, 1e-3)
    spills = register_spills(True), register_spills(False)
    line += f"; fp32 N={n32} max err {e32:.2g}"
    if spills[0] is None:
        return line + ("; spills: this triton does not report them" if cuda else
                       "; spills: not compiled here (interpreted)")
    line += f"; register spills fp32 {spills[0]} B, bf16 {spills[1]} B per thread"
    assert spills[0] == 0, f"the fp32 decode kernel spills {spills[0]} bytes per thread"
    return line


def check_long_extend(sz: Sizes, dev) -> str:
    """T x H x R > 2**31 elements of output: the int32 offsets of old would wrap. Timed after a
    warm-up run of the same shapes (the first call compiles a specialisation), with the peak
    memory the call takes (outputs made once: no unused zero/full buffers)."""
    import torch

    from hicache.engine.attention import attend_latent_torch
    from hicache.kernels.decode_attention import decode_attention_latent
    T, H, R, N = sz.ext_t, sz.dec_h, sz.dec_r, sz.ext_n
    q_lat, q_pe, kv = _latent_inputs(sz, dev, T, N, seed=3)
    cuda = dev.type == "cuda"
    scale = 1.0 / math.sqrt(192)
    kv_pos = torch.arange(N, device=dev) * (T // N + 1)  # keys spread over the extend

    q_pos = torch.arange(T, device=dev)

    def call():
        return decode_attention_latent(q_lat, q_pe, kv, q_pos, kv_pos, scale, R, num_splits=2)

    call()  # warm-up: compiles (its outputs are freed at once)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    (o, lse), took = timed(call)
    peak = (torch.cuda.max_memory_allocated(dev) - base) if cuda else 0
    edge = 2**31 // (H * R)  # first token whose row starts past 2**31 elements
    rows = sorted({0, 1, T // 2, edge - 1, edge, edge + 1, T - 2, T - 1} & set(range(T)))
    idx = torch.tensor(rows, device=dev)
    o_ref, lse_ref = attend_latent_torch(q_lat[idx].float(), q_pe[idx].float(), kv, q_pos[idx],
                                         kv_pos, scale, R)
    eo, el = _close(o[idx], lse[idx], o_ref, lse_ref, 2e-2 if cuda else 1e-4)
    assert bool(torch.isfinite(o).all()), "non-finite output rows"
    figure(f"extend T={T} H={H} N={N}, 2 splits, after a warm-up", took * 1e3, "ms",
           float("nan"), "-")
    line = f"T={T} ({T * H * R / 2**31:.2f} x 2**31 output elements), rows {rows}: max err " \
           f"o {eo:.2g} lse {el:.2g}; {took * 1e3:.1f} ms"
    if cuda:  # 2 split partials + the merged output (+ their LSEs), and nothing more
        want = (2 + 1) * T * H * (R + 1) * 4
        figure("extend peak memory over inputs", peak / 2**30, "GiB", want / 2**30,
               "split partials + merged output")
        line += f"; peak {peak / 2**30:.1f} GiB (outputs {want / 2**30:.1f} GiB)"
        assert peak <= want * 1.05 + (64 << 20), \
            f"the extend took {peak / 2**30:.1f} GiB, more than its outputs' " \
            f"{want / 2**30:.1f} GiB"
    return line


def check_page_copy(sz: Sizes, dev) -> str:
    """The Triton page gather/scatter against its torch reference, device <-> pinned host;
    GB/s against one pinned cudaMemcpyAsync of the same bytes (the copy engines' ceiling)."""
    import torch

    from hicache.kernels.page_copy import kernel_usable, page_copy_reference, page_copy_triton
    if not kernel_usable():
        raise Skip("triton is not usable here")
    cuda = dev.type == "cuda"
    L, W, n = sz.layers, sz.page * KV_DIM, sz.move
    src = torch.randn(L, sz.pages, W, device=dev).to(torch.bfloat16)
    host = torch.zeros(L, sz.pages, W, dtype=torch.bfloat16, pin_memory=cuda)
    host_ref = torch.zeros_like(host)
    g = torch.Generator().manual_seed(4)
    si = torch.randperm(sz.pages, generator=g)[:n].to(dev)
    di = torch.randperm(sz.pages, generator=g)[:n].to(dev)
    page_copy_triton(src, si, host, di)  # device -> pinned host, read/written in place
    sync()
    page_copy_reference(src, si, host_ref, di.cpu())
    assert torch.equal(host, host_ref), "device -> host page copy differs from the reference"
    back = torch.zeros_like(src)
    page_copy_triton(host, di, back, si)  # and back
    sync()
    assert torch.equal(back[:, si], src[:, si]), "host -> device page copy differs"
    nbytes = n * L * W * 2
    tk = best(lambda: page_copy_triton(src, si, host, di), sz.reps)
    tb = best(lambda: page_copy_triton(host, di, back, si), sz.reps)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    r_d2h = best(lambda: h.copy_(d, non_blocking=True), sz.reps)  # cudaMemcpyAsync, pinned
    r_h2d = best(lambda: d.copy_(h, non_blocking=True), sz.reps)
    figure(f"page copy kernel D2H, {n} pages x {L} layers", nbytes / tk / 1e9, "GB/s",
           nbytes / r_d2h / 1e9, "pinned cudaMemcpyAsync")
    figure(f"page copy kernel H2D, {n} pages x {L} layers", nbytes / tb / 1e9, "GB/s",
           nbytes / r_h2d / 1e9, "pinned cudaMemcpyAsync")
    return f"{nbytes / 2**20:.0f} MiB both ways bit-exact; kernel D2H " \
           f"{nbytes / tk / 1e9:.1f} GB/s, H2D {nbytes / tb / 1e9:.1f} GB/s vs pinned " \
           f"cudaMemcpyAsync {nbytes / r_d2h / 1e9:.1f} / {nbytes / r_h2d / 1e9:.1f} GB/s"


_GROUP: dict = {}


def _group(dev):
    """This process as a 1-rank group (NCCL on CUDA, gloo on CPU), made once."""
    import datetime

    import torch
    import torch.distributed as dist

    from hicache import distributed as hd
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(hd.free_port())
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
    return dist.group.WORLD


def check_nccl(sz: Sizes, dev) -> str:
    """A 1-GPU NCCL group refuses CPU tensors; the control plane's gloo twin takes them and is
    named after its parent (the name every member agrees on)."""
    import torch
    import torch.distributed as dist

    from hicache import distributed as hd
    cuda = dev.type == "cuda"
    world = _group(dev)
    notes = []
    if cuda:
        assert hd.device_types(world) == {"cuda"}, hd.device_types(world)
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)
        assert float(x.sum()) == 4.0
        try:
            dist.all_reduce(torch.zeros(1))
            notes.append("NCCL took a CPU tensor")
        except Exception:
            notes.append("NCCL refuses CPU tensors")
    ctl = hd.control_group(world)
    assert hd.control_group(world) is ctl and (ctl is not world) == cuda
    if cuda:
        want = f"hicache-control:{hd.group_name(world)}"
        assert hd.group_name(ctl) == want, f"twin named {hd.group_name(ctl)!r}, not {want!r}"
        notes.append(f"twin {hd.group_name(ctl)!r}")
    t = torch.tensor([3, 1], dtype=torch.int64)
    hd.all_reduce(t, op=dist.ReduceOp.MIN, group=ctl)  # the gloo twin takes CPU tensors
    assert t.tolist() == [3, 1]
    notes.append("gloo twin agrees" if cuda else "gloo world reused")
    return "; ".join(notes)


def check_serving(sz: Sizes, dev) -> str:
    """HiCache + the serving loop on the device (model on the pool's device): recompute, then
    L1+L2; then L1+L2+L3 on LMDB and a warm start from it only where lmdb is importable. Tokens
    compared with recompute. lmdb and redis are imported only by the L3 run that uses them."""
    import numpy as np

    from hicache.config import HiCacheConfig
    from hicache.engine.model import MLAModel
    from hicache.serving import Server, model_config
    from hicache.service import HiCache
    from hicache.workloads import Request
    group = _group(dev)
    with_l3 = importlib.util.find_spec("lmdb") is not None
    preloaded = {m for m in ("lmdb", "redis") if m in sys.modules}
    store = tempfile.mkdtemp(prefix="hicache-gpu-check-")
    big = dev.type == "cuda"  # the CPU smoke run uses a tiny model (attention interpreted)
    cfg = HiCacheConfig.from_dict({
        "model": {"num_layers": 4, "kv_lora_rank": 512 if big else 32,
                  "rope_dim": 64 if big else 8, "hidden_size": 256 if big else 64,
                  "num_heads": 16 if big else 4, "vocab_size": 1024},
        "cache": {"page_size": 16 if big else 4}, "l1": {"num_pages": 48}, "l2": {"ratio": 1.0},
        "l3": {"enabled": with_l3, "lmdb": {"path": store, "size_bytes": 1 << 30}},
        "policy": {"prefetch": "wait_complete"}, "io": {"backend": "kernel"},
    })
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, 300 if big else 40) for _ in range(6)]
    # each prompt again after two others: L1 (48 pages) + L2 hold three prompts' pages
    order = [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5] if big else [0, 1, 0, 1, 2, 3, 2, 3]
    jobs = [Request(i, s, prompts[s], 8 if big else 3, i) for i, s in enumerate(order)]
    model = MLAModel(model_config(cfg))
    modes = ["recompute", "l1+l2"] + (["l1+l2+l3", "warm"] if with_l3 else [])
    outs, hits = {}, {}
    for mode in modes:
        with HiCache(cfg, 0, group, mode="l1+l2+l3" if mode == "warm" else mode,
                     device=dev, weights_signature=model.weights_signature()) as cache:
            model.to(cache.kv.device)
            res = Server(model, cache, group=group, chunk_tokens=256, max_running=2).run(jobs)
            cache.drain()
            assert cache.l1.kv.device.type == dev.type
            outs[mode] = {r.request_id: r.output for r in res}
            st = cache.stats()
            hits[mode] = st["hit_tokens"]
        if big:  # the jobs' event-timed seconds reach the stats: no 0 GB/s on a GPU
            moved = [d for d in ("d2h", "h2d") if st["bytes"][d]]
            assert all(st["gbps"][d] > 0 for d in moved), f"{mode}: stats()['gbps'] " \
                f"{st['gbps']} for bytes {st['bytes']}"
            if mode == "l1+l2":
                gbps = {d: round(st["gbps"][d], 1) for d in moved}
        _free()
    assert hits["l1+l2"]["l1"] + hits["l1+l2"]["l2"] > 0, hits
    if with_l3:
        assert hits["warm"]["l3"] > 0, hits
    imported = {m for m in ("lmdb", "redis") if m in sys.modules} - preloaded
    allowed = {"lmdb"} if with_l3 else set()
    assert imported <= allowed, f"{sorted(imported - allowed)} imported but not used"
    same = {m: sum(outs[m][k] == outs["recompute"][k] for k in outs[m]) for m in outs}
    n = len(jobs)
    # bit-equal KV, but cuBLAS may pick other kernels for other chunk shapes: allow a rare flip
    assert min(same.values()) >= 0.9 * n, f"tokens equal to recompute: {same} of {n}"
    line = f"L1+L2 hits {hits['l1+l2']}, equal to recompute {same['l1+l2']}/{n}"
    if big:
        line += f"; stats GB/s {gbps}"
    if with_l3:
        line += f"; L3 {hits['l1+l2+l3']}, warm L3 {hits['warm']['l3']} tokens, equal " \
                f"{same['l1+l2+l3']}/{n} and {same['warm']}/{n}"
    else:
        line += "; L3 not run (lmdb absent; neither lmdb nor redis imported)"
    return line


def _close(o, lse, o_ref, lse_ref, tol: float) -> tuple[float, float]:
    import torch
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "empty rows differ"
    eo = float((o - o_ref).abs().max())
    el = float((lse[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0
    assert eo <= tol and el <= tol, f"max |o - ref| {eo:.3g}, |lse - ref| {el:.3g} > {tol}"
    return eo, el



def _latent_inputs(sz: Sizes, dev, T: int, N: int, seed: int):
    """Random decode-kernel inputs in the kernel's dtype (bf16 on CUDA): queries q_lat
    [T, H, R], q_pe [T, H, Dr] and latent rows kv [N, R + Dr]; skips without Triton."""
    import torch

    from hicache.kernels.decode_attention import available
    if not available():
        raise Skip("triton is not usable here")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(seed)
    H, R, Dr = sz.dec_h, sz.dec_r, sz.dec_dr
    return (torch.randn(T, H, R, device=dev, generator=g, dtype=dt),
            torch.randn(T, H, Dr, device=dev, generator=g, dtype=dt),
            torch.randn(N, R + Dr, device=dev, generator=g, dtype=dt))



def check_engine_step(sz: Sizes, dev) -> str:
    """Decode steps of the engine on ``dev`` under CUDA's sync debug mode set to error: the
    device index, KV write and attention must never wait for the GPU; logits as torch's."""
    import torch

    from hicache.engine.model import MLAModel, ModelConfig
    from hicache.engine.runner import DCPRunner, RequestState, reserve
    from hicache.l1.pool import DeviceKVPool
    from hicache.layout import DCPLayout
    from hicache.pages import PageAllocator
    big = dev.type == "cuda"
    cfg = ModelConfig(vocab_size=1024, hidden_size=256 if big else 64, num_layers=4,
                      num_heads=16 if big else 4, kv_lora_rank=512 if big else 32,
                      qk_rope_head_dim=64 if big else 8, intermediate_size=512 if big else 128,
                      dtype="bfloat16" if big else "float32", seed=0)
    model = MLAModel(cfg).to(dev)
    lay = DCPLayout(1, 0, sz.page)
    prompt = list(range(1, 600 if big else 12))
    steps = 8 if big else 2  # the smoke run interprets the kernel: keep it short
    out = {}
    for backend in ("triton", "torch"):
        pool = DeviceKVPool(lay, cfg.num_layers, cfg.kv_dim, cfg.torch_dtype, sz.pages, device=dev)
        runner = DCPRunner(model, pool, attn_backend=backend)
        st = RequestState()
        reserve(st, PageAllocator(sz.pages), len(prompt) + steps, lay.page_tokens)
        runner.extend(st, prompt)
        logits = []
        if big:
            sync()
            torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(steps):  # fixed ids: sampling (argmax -> int) is the caller's sync
                logits.append(runner.extend(st, [i + 3]))
        finally:
            if big:
                torch.cuda.set_sync_debug_mode("default")
        out[backend] = torch.cat(logits).float()
    err = float((out["triton"] - out["torch"]).abs().max())
    assert err < (0.1 if big else 1e-3), f"logits differ from the torch path by {err}"
    return f"{steps} decode steps without a host sync; max |logit diff| vs torch {err:.2e}"




# ---- main ---------------------------------------------------------------------------------------
def checks_for(sz: Sizes, dev, cuda: bool) -> list[Check]:
    """The checks in the order they run, with their H200 estimate and time limit (s)."""
    c = [Check("environment", check_env, (sz, dev), 3, 60),
         Check("pools (+ freed on drop, no gc)", check_pools, (sz, dev), 6, 90)]
    for layout in ("page_first", "layer_first"):
        for backend in ("direct", "kernel"):
            c.append(Check(f"transfer {layout} {backend}", check_transfer,
                           (sz, dev, layout, backend), 6, 90))
    if cuda:
        c.append(Check("transfer page_first copy engines (per page)", check_transfer,
                       (sz, dev, "page_first", "direct", "pages"), 10, 120))
        c.append(Check("transfer page_first cupy 2D copies", check_transfer,
                       (sz, dev, "page_first", "direct", None, True), 6, 90))
    c += [Check("transfer with an unpinned L2", check_unpinned, (sz, dev), 3, 60),
          Check("decode kernel vs torch (+ fp32 spills)", check_decode, (sz, dev), 15, 150),
          Check("extend kernel past 2**31 offsets", check_long_extend, (sz, dev), 8, 150),
          Check("page copy kernel vs pinned memcpy", check_page_copy, (sz, dev), 6, 90),
          Check("engine decode step, no host sync", check_engine_step, (sz, dev), 20, 150),
          Check("nccl group + gloo twin", check_nccl, (sz, dev), 5, 60),
          Check("serving loop L1+L2 (+L3 with lmdb)", check_serving, (sz, dev), 30, 180)]
    return c


STARTUP_EST_S = 15  # imports, CUDA context, allocator warm-up


def print_plan(checks: list[Check], where: str, limit_of: Callable[[Check], float]) -> None:
    total = STARTUP_EST_S + sum(c.est_s for c in checks)
    print(f"gpu-check: {len(checks)} checks {where}; about {total:.0f} s on an H200 by estimate "
          f"(limit per check in brackets)", flush=True)
    for i, c in enumerate(checks, 1):
        print(f"  {i:2}. {c.name:<44} ~{c.est_s:3.0f} s  [{limit_of(c):.0f} s]", flush=True)


def _finish_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        t = threading.Thread(target=dist.destroy_process_group, daemon=True)
        t.start()
        t.join(20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="without a GPU: run every check at tiny shapes on the CPU")
    p.add_argument("--list", action="store_true", help="print the check list and exit")
    p.add_argument("--json", help="also write the results and figures here (after every check)")
    p.add_argument("--only", action="append", metavar="TEXT",
                   help="run only the checks whose name contains TEXT (repeatable)")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sz = GPU if cuda or not args.smoke else SMOKE
    checks = checks_for(sz, dev, cuda or not args.smoke)
    if args.only:
        checks = [c for c in checks if any(t in c.name for t in args.only)]
        if not checks:
            print(f"gpu-check: no check name contains any of {args.only}", file=sys.stderr)
            return 2
    if args.list or not (cuda or args.smoke):
        print_plan(checks, "on a GPU", lambda c: c.limit_s)
        if not args.list:
            print("gpu-check: no GPU here (torch.cuda.is_available() is False); nothing run. "
                  "Run it on a CUDA machine, or with --smoke for a CPU run at tiny shapes.",
                  flush=True)
        return 0
    faulthandler.enable()  # a crash in native code still prints where
    if args.json:
        _JSON_PATHS.append(args.json)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        _JSON_PATHS.append(os.path.join(os.environ["OUT"], "gpu_check.json"))
    name = torch.cuda.get_device_name(dev) if cuda else "CPU (smoke)"
    import triton
    META.update(device=name, torch=torch.__version__, triton=triton.__version__,
                smoke=bool(args.smoke), started=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime()))
    print(f"gpu-check on {name}: torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    limit_of = (lambda c: c.limit_s) if cuda else (lambda c: SMOKE_LIMIT_S)
    print_plan(checks, "here", limit_of)
    write_json()
    t0 = time.perf_counter()
    for c in checks:
        run_check(c, limit_of(c), dev)
        _free()
    _finish_group()

    print("\nfigure                                                     value      baseline")
    for f in FIGURES:
        base = "" if math.isnan(f["baseline"]) else \
            f"{f['baseline']:9.3f} ({f['baseline_what']})  {f['ratio']:.2f}x"
        print(f"{f['what']:<56} {f['value']:9.3f} {f['unit']:<5} {base}")
    failed = [r["check"] for r in RESULTS if r["status"] == "FAIL"]
    META["total_s"] = round(time.perf_counter() - t0, 1)
    write_json()
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed or skipped in "
          f"{META['total_s']:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a check left hanging (timed out) must not hold the exit
