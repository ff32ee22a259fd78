"""The CPU copy backend: copies on host threads, for engines whose L1 pool is in host memory.

One worker thread per direction. A job of at most ``engine.inline_bytes`` is copied at submit on
the calling thread, and ``wait()`` on a job no thread has started yet runs it on the waiting
thread: either costs less than the hand-off (a thread wake-up each way, ~150 us on a busy 2-core
box). Jobs of one direction therefore need not run in submit order; the controller never has
two in flight on the same page.

``direct`` (the default ``io_backend``): a job of at most ``PAGE_RUNS_MAX`` runs of consecutive
pages (a few pages, or a contiguous range) is planned by nothing more than its runs: each run is
one strided numpy copy of a group of layers (``run_page_runs``), all layers for a backup, and
for a load (or restore) groups of about ``LAYER_GROUP_BYTES`` that arrive in order (one layer
per group once a layer is that big), so layer i is usable while later ones copy. Any other job
views both sides as flat arrays of page-layer blocks and runs the block plan made at submit
(``hicache/l2/blocks.py``). A backup plans all layers at once (a page_first host page is then
one destination run); a load (or restore) plans layer 0 and replays it per layer.

A job of at least ``engine.split_bytes`` is copied by ``engine.copy_threads`` threads at once
(``_share``): cut into chunks of about ``CHUNK_BYTES`` (a load: pieces of each layer, in layer
order), each taken by whichever thread is free, the one running the job included, so a helper
that gets no core leaves its chunks to the others; a thread waiting for the job copies chunks
too rather than sleeping (at most ``copy_threads`` copy at once); a load's layer arrives once
every piece of it landed. One thread copying a few MB at a time reaches only part of the memory bandwidth
(6-7 GB/s on the 2-core CI box, where two reach about 12); a job that is one contiguous copy
on both sides stays one memmove. ``kernel`` uses the page-copy kernel's torch reference (or the
Triton kernel itself when it was imported under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import bisect
import queue
import threading
import time

import numpy as np

from hicache.l2.blocks import (BlockPlan, block_view, page_view, plan_blocks, run_block_plan,
                               run_page_runs, split_block_plan, split_runs)
from hicache.l2.transfer import CopyBackend, PageSide, TransferJob, register_backend

# A job of at most this many runs of consecutive (src, dst) pages is copied run by run
# (``run_page_runs``): cheaper than making a block plan, in as many calls as it would take.
PAGE_RUNS_MAX = 16
# A page-run load completes in groups of layers of about this many bytes: per-layer calls and
# wake-ups cost more than they save for a few small pages.
LAYER_GROUP_BYTES = 256 << 10
# A job split across the copy threads is cut into chunks of about this many bytes (a load: into
# pieces of each layer), taken in order by whichever thread is free: the threads share the work
# as they get cores, and a layer arrives early. At most MAX_PIECES pieces per layer (or backup).
CHUNK_BYTES = 4 << 20
MAX_PIECES = 64


class CpuBackend(CopyBackend):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._kernel = None
        if engine.io_backend == "kernel":
            from hicache.kernels import page_copy

            self._kernel = page_copy
        # flat block arrays of the engine's pools (a staging side gets its own per job)
        sides = (engine.device_side, engine.host_side)
        self._blocks = {id(s): block_view(s.base, s.block_elems) for s in sides}
        self._pages = {id(s): page_view(s.base, s.num_layers, s.num_pages, s.page_major)
                       for s in sides}
        # threads that each copy a share of a big job (the thread running the job is one of
        # them; two workers may split jobs at once)
        T = self._threads = engine.copy_threads
        # helper threads take work from one queue (a put and a wake-up: cheaper than an
        # executor's future)
        self._help_q: queue.SimpleQueue = queue.SimpleQueue()
        self._helpers = [threading.Thread(target=self._helper, daemon=True,
                                          name=f"hicache-copy_{i}") for i in range(2 * (T - 1))]
        for t in self._helpers:
            t.start()
        self._workers: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}
        for direction in ("d2h", "h2d"):
            q: queue.SimpleQueue = queue.SimpleQueue()  # C-level put/get: cheap wake-ups
            t = threading.Thread(target=self._worker, args=(q,), daemon=True,
                                 name=f"hicache-{direction}")
            t.start()
            self._workers[direction] = (q, t)

    def submit(self, job: TransferJob) -> None:
        if self._kernel is None:
            job.prepared = self.plan(job)
        job._runner = self._execute
        if job.nbytes <= self.engine.inline_bytes and job._claim.acquire(False):
            self._execute(job)  # cheaper than the hand-off; layers all arrive at once
        else:
            self._workers[job.direction][0].put(job)

    def close(self) -> None:
        for q, _t in self._workers.values():
            q.put(None)
        for _q, t in self._workers.values():
            t.join()
        self._stop_helpers()

    def _stop_helpers(self) -> None:
        """Stop the helper threads (a job split afterwards is copied by its own thread)."""
        helpers, self._helpers = self._helpers, []
        for _t in helpers:
            self._help_q.put(None)
        for t in helpers:
            t.join()

    def _helper(self) -> None:
        while True:
            work = self._help_q.get()
            if work is None:
                return
            work()

    def _worker(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            if job._claim.acquire(False):  # else a waiter took it and runs it itself
                self._execute(job)

    def _execute(self, job: TransferJob) -> None:
        """Run a claimed job on this thread and finish it (failures go to the waiter)."""
        t0 = time.perf_counter()
        try:
            self.copy(job)
            job.seconds = time.perf_counter() - t0
        except BaseException as err:  # surfaced to the waiter
            job._fail(err)
        else:
            self.engine.account(job)
            job._succeed()

    def _side(self, side: PageSide) -> tuple[np.ndarray, tuple[int, int]]:
        """(flat blocks, (layer, page) block strides) of one side."""
        blocks = self._blocks.get(id(side))
        if blocks is None:
            blocks = block_view(side.base, side.block_elems)
        return blocks, side.block_strides

    def _page_side(self, side: PageSide):
        """``[L, pages, bytes]`` view of one side."""
        pages = self._pages.get(id(side))
        if pages is None:
            pages = page_view(side.base, side.num_layers, side.num_pages, side.page_major)
        return pages

    def copy(self, job: TransferJob) -> None:
        L = self.engine.num_layers
        src_side, dst_side = self.engine.sides(job)
        if self._kernel is not None:
            src, dst = src_side.pages, dst_side.pages
            si, di = job.plan.src_pages, job.plan.dst_pages
            copy = (self._kernel.page_copy_triton if self._kernel.interpreter_enabled()
                    else self._kernel.page_copy_reference)
            for layer in range(L):
                copy(src[layer:layer + 1], si, dst[layer:layer + 1], di)
                job._layer_done(layer)
            return
        bp = job.prepared if job.prepared is not None else self.plan(job)
        T = self._threads if job.nbytes >= self.engine.split_bytes else 1
        load = job.direction != "d2h"
        if type(bp) is list:  # page runs: a group of layers per call
            src, dst = self._page_side(src_side), self._page_side(dst_side)
            k = layer_group(L, job.nbytes) if load else L
            if T > 1 and k == L and len(bp) == 1 and _one_memmove(bp[0], src, dst):
                T = 1  # one contiguous copy stays one memmove (libc streams a big one)
            if T == 1:
                for l0 in range(0, L, k):
                    run_page_runs(bp, src[l0:l0 + k], dst[l0:l0 + k])
                    job._layer_done(min(L, l0 + k) - 1)
                return
            groups = range(0, L, k)
            parts = split_runs(bp, _chunks(job.nbytes // len(groups)))

            def page_chunk(chunk) -> None:
                l0, runs = chunk
                run_page_runs(runs, src[l0:l0 + k], dst[l0:l0 + k])
                if load:
                    job._layers_landed(l0, min(L, l0 + k))

            self._share(job, [(l0, p) for l0 in groups for p in parts], page_chunk, len(parts),
                        [l0 for l0 in groups for _ in parts] if load else None)
            return
        (src, (s_l, _)), (dst, (d_l, _)) = self._side(src_side), self._side(dst_side)
        if T == 1:
            if not load:  # a backup: all layers in one plan
                run_block_plan(bp, src, dst)
                job._layer_done(L - 1)
                return
            for layer in range(L):  # the layer-0 plan replayed per layer, layer i usable early
                run_block_plan(bp, src, dst, layer * s_l, layer * d_l)
                job._layer_done(layer)
            return
        if not load:
            self._share(job, split_block_plan(bp, _chunks(job.nbytes)),
                        lambda part: run_block_plan(part, src, dst), 1)
            return
        parts = split_block_plan(bp, _chunks(job.nbytes // L))

        def block_chunk(chunk) -> None:
            layer, part = chunk
            run_block_plan(part, src, dst, layer * s_l, layer * d_l)
            job._layers_landed(layer, layer + 1)

        self._share(job, [(layer, p) for layer in range(L) for p in parts], block_chunk,
                    len(parts), [layer for layer in range(L) for _ in parts])

    def _share(self, job: TransferJob, chunks: list, copy_chunk, pieces: int,
               firsts: list[int] | None = None) -> None:
        """Copy ``chunks`` in order with the helper threads: whichever thread is free takes the
        next one, this thread included, so a helper that gets no core leaves its share to this
        thread instead of holding the job up. A thread waiting for the job (``wait``,
        ``wait_layer``) takes chunks too instead of sleeping, those its layers still need
        (``firsts``: each chunk's first layer; a backup's chunks all count for every layer); at
        most ``copy_threads`` threads copy at once, this one included. A load's chunk lands its
        piece of its layers (``pieces`` per layer: a layer arrives once all landed); a backup's
        job is done at the end. Returns once every chunk taken has finished (a failed job never
        has a copy still writing), raising the first failure; after a failure no chunk is
        taken."""
        job._pieces = pieces
        share = _Sharing(chunks, copy_chunk, self._threads, firsts, self)
        job._help = share.help_waiter
        try:
            for _ in range(min(self._threads - 1, len(self._helpers))):  # none once stopped
                self._help_q.put(share.join)
            share.work(share.n)
            share.wait_taken()
        finally:
            job._help = None
        if share.failed:
            raise share.failed[0]
        if job.direction == "d2h":
            job._layer_done(self.engine.num_layers - 1)

    def plan(self, job: TransferJob) -> BlockPlan | list[tuple[int, int, int]]:
        """What a direct job runs: its page runs when they are few (and no copy kind is forced),
        else a block plan."""
        if self.engine.cpu_copy is None and job.plan.runs_at_most(PAGE_RUNS_MAX):
            return job.plan.runs
        return self.plan_blocks(job)

    def plan_blocks(self, job: TransferJob) -> BlockPlan:
        """Block plan of a direct job, made at submit time (off the worker's clock)."""
        src_side, dst_side = self.engine.sides(job)
        s_l, s_p = src_side.block_strides
        d_l, d_p = dst_side.block_strides
        ps, pd = job.plan.src, job.plan.dst
        kind = self.engine.cpu_copy
        if job.direction == "h2d":  # completes layer by layer: plan layer 0 only
            return plan_blocks(ps * s_p, pd * d_p, s_p, kind)
        # No per-layer consumer for a backup: plan all layers at once (a page_first host page
        # is then one contiguous destination run across layers).
        layers = np.arange(self.engine.num_layers, dtype=np.int64)
        if d_p > d_l:  # page-major destination (page_first host): pairs in its order
            layers, ps, pd = layers[None, :], ps[:, None], pd[:, None]
        else:
            layers = layers[:, None]
        return plan_blocks((layers * s_l + ps * s_p).reshape(-1),
                           (layers * d_l + pd * d_p).reshape(-1), s_p, kind)


def _chunks(nbytes: int) -> int:
    """Pieces to cut ``nbytes`` into for the copy threads: about ``CHUNK_BYTES`` each, at most
    ``MAX_PIECES``."""
    return max(1, min(MAX_PIECES, round(nbytes / CHUNK_BYTES)))


def _one_memmove(run: tuple[int, int, int], src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether page run ``run`` of every layer is contiguous on both ``page_view``s (a layer_first
    or staging side holding all its pages, or a single layer): one memmove copies it all."""
    s0, d0, n = run
    return src[:, s0:s0 + n].flags.c_contiguous and dst[:, d0:d0 + n].flags.c_contiguous


def layer_group(num_layers: int, nbytes: int) -> int:
    """Layers per group of a page-run load of ``nbytes`` in all: about ``LAYER_GROUP_BYTES``
    a group (every layer at once for a small job, one layer per group for a big one)."""
    per_layer = max(1, nbytes // max(1, num_layers))
    return max(1, min(num_layers, LAYER_GROUP_BYTES // per_layer))


register_backend("cpu", CpuBackend)


class _Sharing:
    """One job's chunks shared by the threads that copy it (``CpuBackend._share``): chunks
    are taken in order; at most ``threads`` threads copy at once (the job's own included)."""

    def __init__(self, chunks: list, copy_chunk, threads: int, firsts: list[int] | None,
                 backend) -> None:
        self.chunks, self.copy_chunk, self.threads = chunks, copy_chunk, threads
        self.firsts, self.backend = firsts, backend
        self.n = len(chunks)
        self.cond = threading.Condition(threading.Lock())
        self.taken = 0        # chunks taken
        self.finished = 0     # chunks finished
        self.copying = 1      # threads copying (the job's own)
        self.failed: list[BaseException] = []

    def work(self, limit: int) -> None:
        """Take chunks in order until ``limit`` were taken (or a failure)."""
        cond = self.cond
        while True:
            with cond:
                i = self.taken
                if self.failed or i >= limit:
                    return
                self.taken = i + 1
            err = None
            try:
                self.copy_chunk(self.chunks[i])
            except BaseException as e:  # reported by the thread running the job
                err = e
            with cond:
                if err is not None:
                    self.failed.append(err)
                self.finished += 1
                if self.finished == self.taken:
                    cond.notify_all()

    def join(self, limit: int | None = None) -> None:
        """A helper or a waiter: copy chunks below ``limit`` (default: all) while a copy slot
        is free."""
        limit = self.n if limit is None else limit
        with self.cond:
            if self.copying >= self.threads or self.taken >= limit or self.failed:
                return
            self.copying += 1
        try:
            self.work(limit)
        finally:
            with self.cond:
                self.copying -= 1

    def help_waiter(self, need: int) -> None:
        """A waiter for the first ``need`` layers copies the chunks they need."""
        self.join(self.n if self.firsts is None else bisect.bisect_left(self.firsts, need))
        # a helper turned away while this waiter held a copy slot does not come back by
        # itself: hand the slot on while chunks are left
        with self.cond:
            left = not self.failed and self.taken < self.n
        if left and self.backend._helpers:
            self.backend._help_q.put(self.join)

    def wait_taken(self) -> None:
        """Until every chunk taken has finished."""
        with self.cond:
            while self.finished < self.taken:
                self.cond.wait()
