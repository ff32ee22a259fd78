"""L1 <-> L2 transfer benchmark: shard bytes per rank per second against a plain memcpy.

    python bench/transfer.py [--json] [--quick] [--io direct|kernel] [--pattern P]
                             [--copy-threads N] [--memcpy-pieces]

For DCP sizes c in 1, 2, 4, 8, both host layouts and both directions, one rank's shard of a
``--tokens``-token sequence (MLA rows of kv_dim 576, bf16, ``--layers`` layers, physical page
size 16) moves between its DeviceKVPool and HostKVPool through the TransferEngine (its default
``copy_threads``, 2: a job of 8 MiB or more is copied by two threads; ``--copy-threads 1`` for
one). The baseline,
measured in the same run and interleaved with each measurement, is one contiguous memcpy of
the same number of bytes (libc ``memmove`` via ctypes on CPU, between buffers allocated and
faulted in like the pools, huge pages included; a pinned ``copy_(non_blocking=True)``, i.e.
cudaMemcpyAsync, on CUDA). Page patterns: ``contiguous`` (device and host pages in order) and
``scattered`` (device pages a random permutation, as after cache churn).
Each timing submits a batch of jobs (about 48 MB in flight) and waits for all, as an engine
would. After two warm-up rounds, times are the best of ``--reps`` repetitions, the transfer and
the memcpy alternating which goes first, so both see the same machine load (this is a shared
machine: best-of filters out other processes' interference). Both sides touch the same distinct
memory: the pools hold exactly the shard and every job of a batch copies all of it, as the
memcpy copies its own pair of shard-sized buffers (at c=8, 2 x 18.9 MB: cache-resident alike).
``cpu`` is the CPU time of all the process's threads for the transfer over the memcpy's (least
of each): the copy work itself, whatever the scheduling (under 1: cheaper than the memcpy).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache.l1.pool import DeviceKVPool, zeroed  # noqa: E402
from hicache.l2.pool import HostKVPool  # noqa: E402
from hicache.l2.transfer import COPY_THREADS, TransferEngine  # noqa: E402
from hicache.layout import DCPLayout  # noqa: E402

KV_DIM, PAGE = 576, 16


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of this process) of one call."""
    _sync()
    c, t = time.process_time(), time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t, time.process_time() - c


def _memcpy_pair(nbytes: int, direction: str, dtype: torch.dtype):
    """Contiguous source/destination of ``nbytes`` matching the transfer's devices."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    cuda = torch.cuda.is_available()
    dev = zeroed((n,), dtype, torch.device("cuda" if cuda else "cpu"))
    host = zeroed((n,), dtype, torch.device("cpu"), pin_memory=cuda)
    src, dst = (dev, host) if direction == "d2h" else (host, dev)
    if cuda:  # a raw pinned cudaMemcpyAsync of the same bytes
        return lambda: dst.copy_(src, non_blocking=True)
    return lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)  # libc memcpy


def measure(c: int, kind: str, pattern: str, tokens: int, layers: int, reps: int, io: str,
            dtype: torch.dtype, copy_threads: int = 1) -> list[dict]:
    lay = DCPLayout(c, 0, PAGE)
    pages = -(-tokens // lay.page_tokens)  # widened pages holding the sequence
    dev = DeviceKVPool(lay, layers, KV_DIM, dtype, pages)
    host = HostKVPool(lay, layers, KV_DIM, dtype, pages, layout_kind=kind)
    dev.kv.normal_()
    eng = TransferEngine(dev, host, io_backend=io, copy_threads=copy_threads)
    host_pages = list(range(pages))
    if pattern == "scattered":
        g = torch.Generator().manual_seed(c)
        dev_pages = torch.randperm(pages, generator=g).tolist()
    else:
        dev_pages = list(range(pages))
    out = []
    nbytes = pages * dev.bytes_per_page
    batch = max(1, (48 << 20) // nbytes)  # jobs in flight per timing: amortises thread wake-ups
    for direction in ("d2h", "h2d"):
        submit = ((lambda: eng.backup(dev_pages, host_pages)) if direction == "d2h"
                  else (lambda: eng.load(host_pages, dev_pages)))

        def run() -> None:
            jobs = [submit() for _ in range(batch)]
            for j in jobs:
                j.wait()

        one = _memcpy_pair(nbytes, direction, dtype)

        def memcpy() -> None:
            for _ in range(batch):
                one()

        for _ in range(2):  # warm up
            run(), memcpy()
        job, mem = [], []  # (wall, cpu) of each repetition
        for i in range(reps):  # interleave (alternating order) so both see the same load
            for fn, acc in ((run, job), (memcpy, mem))[::1 if i % 2 else -1]:
                acc.append(_timed(fn))
        t_job, t_mem = min(w for w, _ in job) / batch, min(w for w, _ in mem) / batch
        gbps, mgbps = nbytes / t_job / 1e9, nbytes / t_mem / 1e9
        # CPU seconds of all threads, the job's over the memcpy's (least of each): the copy
        # work itself, whatever the scheduling (< 1: cheaper than the memcpy)
        cpu = min(c for _, c in job) / max(1e-9, min(c for _, c in mem))
        out.append(dict(layout=kind, direction=direction, dcp=c, pattern=pattern, bytes=nbytes,
                        gbps=round(gbps, 3), memcpy_gbps=round(mgbps, 3),
                        ratio=round(gbps / mgbps, 3), cpu_ratio=round(cpu, 3)))
    eng.close()
    return out


def memcpy_pieces(c: int, tokens: int, layers: int, reps: int, dtype: torch.dtype) -> list[dict]:
    """What a copy's size does to libc memmove on this machine: the bytes of one rank's c-way
    shard moved by one memmove, in pieces of a layer (what a load copies at a time) up to half
    the bytes, and in layer pieces by two threads, interleaved, best of ``reps``. glibc switches
    to streaming (non-temporal) stores above a size threshold; run under
    ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=...`` to move it."""
    from concurrent.futures import ThreadPoolExecutor

    lay = DCPLayout(c, 0, PAGE)
    pages = -(-tokens // lay.page_tokens)
    nbytes = pages * layers * PAGE * KV_DIM * torch.empty((), dtype=dtype).element_size()
    src = zeroed((nbytes,), torch.uint8, torch.device("cpu")).fill_(1)
    dst = zeroed((nbytes,), torch.uint8, torch.device("cpu"))
    s0, d0, layer = src.data_ptr(), dst.data_ptr(), nbytes // layers
    pool = ThreadPoolExecutor(1)

    def pieces(size: int, lo: int = 0, hi: int = nbytes) -> None:
        for o in range(lo, hi, size):
            ctypes.memmove(d0 + o, s0 + o, min(size, hi - o))

    def two_threads() -> None:
        f = pool.submit(pieces, layer // 2, nbytes // 2, nbytes)
        pieces(layer // 2, 0, nbytes // 2)
        f.result()

    ways = {"one memmove": lambda: pieces(nbytes)}
    k = 1
    while k * layer <= nbytes // 2:
        ways[f"pieces of {k * layer / 1e6:.1f} MB"] = (lambda n=k * layer: pieces(n))
        k *= 2
    ways["2 threads, pieces of half a layer"] = two_threads
    best = dict.fromkeys(ways, float("inf"))
    names = list(ways)
    for i in range(reps + 1):  # the first round warms up
        for name in (names if i % 2 else names[::-1]):
            t = time.perf_counter()
            ways[name]()
            if i:
                best[name] = min(best[name], time.perf_counter() - t)
    pool.shutdown()
    return [dict(way=name, dcp=c, bytes=nbytes, gbps=round(nbytes / t / 1e9, 3))
            for name, t in best.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="smaller sequence, fewer repetitions")
    ap.add_argument("--tokens", type=int, default=None,
                    help="sequence length (default 16384; 8192 with --quick)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--io", choices=("direct", "kernel"), default="direct")
    ap.add_argument("--pattern", choices=("contiguous", "scattered", "both"), default="both")
    ap.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--copy-threads", type=int, default=COPY_THREADS,
                    help="CPU threads that copy one big job together (default: the engine's, "
                         f"{COPY_THREADS}; the memcpy baseline stays one thread)")
    ap.add_argument("--memcpy-pieces", action="store_true",
                    help="only time libc memmove of the first --dcp size's bytes: one call, in "
                         "pieces of a layer and more, and by two threads")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.copy_threads < 1 or (args.tokens or 1) < 1 or (args.reps or 1) < 1:
        ap.error("--layers, --copy-threads, --tokens and --reps must be >= 1")
    tokens = args.tokens or (8192 if args.quick else 16384)
    reps = args.reps or (4 if args.quick else 11)
    if args.memcpy_pieces:
        rows = memcpy_pieces(args.dcp[0], tokens, args.layers, reps, torch.bfloat16)
        meta = dict(load=os.getloadavg()[0], glibc_tunables=os.environ.get("GLIBC_TUNABLES"))
        if args.json:
            print(json.dumps({"memcpy_pieces": rows, "meta": meta}))
            return 0
        print(f"libc memmove of {rows[0]['bytes'] / 1e6:.1f} MB (one rank's shard at "
              f"c={args.dcp[0]}), best of {reps}, load average {meta['load']:.1f}, "
              f"GLIBC_TUNABLES={meta['glibc_tunables'] or ''}")
        for r in rows:
            print(f"{r['way']:<36}{r['gbps']:>8.2f} GB/s")
        return 0
    patterns = ("contiguous", "scattered") if args.pattern == "both" else (args.pattern,)
    dtype = torch.bfloat16
    combos = [(c, k, p) for p in patterns for k in ("page_first", "layer_first") for c in args.dcp]
    results = []
    for c, kind, pattern in tqdm(combos, desc="transfer", disable=args.json, file=sys.stderr):
        results += measure(c, kind, pattern, tokens, args.layers, reps, args.io, dtype,
                           args.copy_threads)
    meta = dict(device="cuda" if torch.cuda.is_available() else "cpu",
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                tokens=tokens, layers=args.layers, kv_dim=KV_DIM, page_size=PAGE,
                dtype=str(dtype), io=args.io, reps=reps, copy_threads=args.copy_threads)
    if args.json:
        print(json.dumps({"results": results, "meta": meta}))
        return 0
    print(f"L1<->L2 transfers, one rank's shard of {tokens} tokens, {args.layers} layers, "
          f"kv_dim {KV_DIM}, bf16, P={PAGE}, io={args.io}, copy threads {args.copy_threads}, "
          f"{meta['device']}")
    print(f"{'pattern':<11}{'layout':<12}{'dir':<5}{'dcp':>4}{'MB':>9}{'GB/s':>8}"
          f"{'memcpy':>8}{'ratio':>7}{'cpu':>7}")
    for r in results:
        print(f"{r['pattern']:<11}{r['layout']:<12}{r['direction']:<5}{r['dcp']:>4}"
              f"{r['bytes'] / 1e6:>9.1f}{r['gbps']:>8.2f}{r['memcpy_gbps']:>8.2f}"
              f"{r['ratio']:>6.2f}x{r['cpu_ratio']:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
