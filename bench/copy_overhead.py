"""Fixed cost of one small transfer job on the calling (scheduler) thread, against the raw copy.

    python bench/copy_overhead.py [--json] [--quick] [--pages 1 2 4] [--jobs N] [--reps R]

A serving engine backs up a finished request's last few pages and loads a few L2-hit pages back
per request: jobs of 1-4 pages, where validating, planning and completing the job can cost more
than its bytes. Each row times ``job = engine.backup(device, host)`` (or ``load``), ``job.wait()``
and one ``job.status()`` read, ``--jobs`` jobs back to back on fresh page lists (Python lists,
as the controller hands them), on the CPU copy backend. The baseline, measured in the same run
and interleaved with it, is the raw torch copy of the same rows: per page one
``dst[:, h].copy_(src[:, d])`` between the pools' ``[L, pages, W]`` views (every layer of the
page in one strided copy; no checks, no plan, no completion). ``ratio`` = job time / raw copy time: 1.0
would mean the engine adds nothing. Shapes: ``chat`` (the built-in model of ``make bench``: 4
layers, kv_dim 80, fp32, P 16) and ``v3`` (a DeepSeek-V3 rank shard: 61 layers, kv_dim 576,
bf16, P 16). Best of ``--reps`` repetitions per row; a ratio, never an absolute, is the claim.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache.l1.pool import DeviceKVPool  # noqa: E402
from hicache.l2.pool import HostKVPool  # noqa: E402
from hicache.l2.transfer import DONE, TransferEngine  # noqa: E402
from hicache.layout import DCPLayout  # noqa: E402

SHAPES = {"chat": (4, 80, torch.float32), "v3": (61, 576, torch.bfloat16)}
POOL_PAGES = 256


def _page_lists(n: int, jobs: int, pages: int) -> list[tuple[list[int], list[int]]]:
    """``jobs`` (device, host) page lists of ``n`` pages: device pages scattered (as after
    churn), host pages consecutive (fresh L2 allocations), each job on other pages."""
    g = torch.Generator().manual_seed(n)
    out = []
    for j in range(jobs):
        dev = torch.randperm(pages, generator=g)[:n].tolist()
        h0 = (j * n) % (pages - n)
        out.append((dev, list(range(h0, h0 + n))))
    return out


def measure(shape: str, layout: str, n: int, jobs: int, reps: int) -> list[dict]:
    layers, kv_dim, dtype = SHAPES[shape]
    lay = DCPLayout(1, 0, 16)
    dev = DeviceKVPool(lay, layers, kv_dim, dtype, POOL_PAGES)
    host = HostKVPool(lay, layers, kv_dim, dtype, POOL_PAGES, layout_kind=layout)
    dev.kv.normal_()
    eng = TransferEngine(dev, host)
    d3, h3 = eng.device_side.pages, eng.host_side.pages  # [L, pages, W] views
    lists = _page_lists(n, jobs, POOL_PAGES)
    rows = []
    for direction in ("d2h", "h2d"):
        back = direction == "d2h"
        src3, dst3 = (d3, h3) if back else (h3, d3)

        def engine_jobs() -> None:
            for d, h in lists:
                job = eng.backup(d, h) if back else eng.load(h, d)
                job.wait()
                assert job.status() == DONE

        def raw() -> None:
            for ds, hs in lists:
                for s, t in (zip(ds, hs) if back else zip(hs, ds)):
                    dst3[:, t].copy_(src3[:, s])

        engine_jobs(), raw()  # warm up
        t_job = t_raw = float("inf")
        for i in range(reps):  # interleaved, alternating which goes first
            for fn in ((engine_jobs, raw) if i % 2 else (raw, engine_jobs)):
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                if fn is raw:
                    t_raw = min(t_raw, dt)
                else:
                    t_job = min(t_job, dt)
        us_job, us_raw = t_job / jobs * 1e6, t_raw / jobs * 1e6
        rows.append(dict(shape=shape, layout=layout, direction=direction, pages=n,
                         bytes=n * dev.bytes_per_page, job_us=round(us_job, 2),
                         raw_us=round(us_raw, 2), ratio=round(us_job / us_raw, 3)))
    eng.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer jobs and repetitions")
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["chat", "v3"])
    ap.add_argument("--jobs", type=int, default=None, help="jobs per timing (default 200)")
    ap.add_argument("--reps", type=int, default=None, help="timings per row (default 7)")
    args = ap.parse_args(argv)
    jobs = args.jobs or (20 if args.quick else 200)
    reps = args.reps or (2 if args.quick else 7)
    for n in args.pages:
        if not 1 <= n <= POOL_PAGES // 2:
            ap.error(f"--pages: {n} is outside [1, {POOL_PAGES // 2}]")
    if jobs < 1 or reps < 1:
        ap.error("--jobs and --reps must be >= 1")
    torch.set_num_threads(1)  # the raw copy on one thread, like the engine's inline copy
    rows = [r for s in args.shapes for lay in ("page_first", "layer_first") for n in args.pages
            for r in measure(s, lay, n, jobs, reps)]
    meta = dict(jobs=jobs, reps=reps, load=os.getloadavg()[0], pool_pages=POOL_PAGES)
    if args.json:
        print(json.dumps({"rows": rows, "meta": meta}))
        return 0
    print(f"per-job issue + complete vs the raw torch copy of the same rows "
          f"({jobs} jobs, best of {reps}, load average {meta['load']:.1f})")
    print(f"{'shape':<6}{'layout':<12}{'dir':<5}{'pages':>6}{'KB':>8}{'job us':>9}"
          f"{'raw us':>9}{'ratio':>8}")
    for r in rows:
        print(f"{r['shape']:<6}{r['layout']:<12}{r['direction']:<5}{r['pages']:>6}"
              f"{r['bytes'] / 1024:>8.0f}{r['job_us']:>9.1f}{r['raw_us']:>9.1f}{r['ratio']:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
