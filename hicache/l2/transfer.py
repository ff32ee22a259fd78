"""Per-rank transfers between the L1 device pool and the L2 host pool.

``backup(device_pages, host_pages)`` copies whole widened pages (this rank's P rows of every
layer) device -> host; ``load(host_pages, device_pages)`` copies host -> device. Each returns a
``TransferJob`` whose layers complete in order: ``wait_layer(i)`` lets the engine compute layer
i-1 while layer i is still loading. No collective is ever issued: each rank moves its own shard.

Execution:
- CPU (no CUDA): one worker thread per direction. A job of at most ``inline_bytes`` is copied
  at submit on the calling thread, and ``wait()`` on a job no thread has started yet runs it on
  the waiting thread: either costs less than the hand-off (a thread wake-up each way, ~150 us
  on a busy 2-core box). Jobs of one direction therefore need not run in submit order; the
  controller never has two in flight on the same page. The ``direct`` backend views both pools
  as flat arrays of page-layer blocks (P rows of one layer, ``P * kv_dim`` elements). At submit,
  ``plan_blocks`` turns the page lists into a few C-level copy loops, whichever kind needs the
  fewest calls: ``numpy.take`` into each contiguous destination run, a numpy scatter from each
  (strided) source run, or one ``memmove`` per run contiguous on both sides (all release the
  GIL). A backup plans all layers at once (a page_first host page is then one destination
  run); a load plans layer 0 and replays it per layer, so layer i is usable while layer i+1
  copies. ``copy_threads > 1`` splits a job across that many threads (layers round-robin for
  a load). The ``kernel`` backend uses the page-copy kernel's torch reference (or the Triton
  kernel itself when it was imported under ``TRITON_INTERPRET=1``).
- CUDA: a dedicated stream per direction, one event per layer; a backup waits for the compute
  queued before it, a load does not (it overlaps the current step). ``plan_device_copy`` picks
  how: ``direct`` issues ``copy_(non_blocking=True)`` per run when each layer is one or two runs
  contiguous on both sides (copy engines), and otherwise launches the Triton page
  gather/scatter (once per layer for a load, once for a whole backup: O(layers) launches, not
  one copy per page per layer on the strided page_first side), falling back to CuPy 2D copies
  or per-page copies without Triton. ``kernel`` always launches the kernel.
  (The CUDA paths are written for the GPU machine; this project's CI has no GPU.)
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from hicache.l1.allocator import PageError
from hicache.l1.pool import DeviceKVPool, PoolError
from hicache.l2.pool import HostKVPool

PageList = Union[Sequence[int], torch.Tensor]
IO_BACKENDS = ("direct", "kernel")

_memmove = ctypes.memmove

try:  # optional CUDA 2D copies (the "gpu" extra); only used when CUDA is present too
    import cupy as _cupy  # type: ignore

    HAVE_CUPY = True
except Exception:
    _cupy = None
    HAVE_CUPY = False


class TransferError(RuntimeError):
    """A transfer failed, or the engine was used after ``close()``."""


# A job's state, read in ONE attribute read (``TransferJob.status``): it only ever moves from
# PENDING to DONE or to FAILED, so a caller deciding "failed or done" never sees a mix.
PENDING, DONE, FAILED = "pending", "done", "failed"


@dataclass(frozen=True)
class TransferPlan:
    """Pages to move, validated, plus the coalesced runs of consecutive (src, dst) pages."""

    src_pages: torch.Tensor  # int64 [n]
    dst_pages: torch.Tensor  # int64 [n]
    run_src: np.ndarray  # int64 [runs] first src page of each run
    run_dst: np.ndarray  # int64 [runs] first dst page of each run
    run_len: np.ndarray  # int64 [runs] pages in each run

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.numel())


def _as_pages(pages: PageList, what: str) -> np.ndarray:
    """Page ids as a flat int64 numpy array (validated kind and shape)."""
    if isinstance(pages, torch.Tensor):
        t = pages
        if t.numel() == 0:
            return np.zeros(0, dtype=np.int64)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise PageError(f"{what} must be integer page ids, got dtype {t.dtype}")
        if t.dim() > 1:
            raise PageError(f"{what} must be a flat list of page ids, got shape {list(t.shape)}")
        return t.reshape(-1).to(device="cpu", dtype=torch.int64).numpy()
    a = np.asarray(pages)
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise PageError(f"{what} must be integer page ids, got dtype {a.dtype}")
    if a.ndim > 1:
        raise PageError(f"{what} must be a flat list of page ids, got shape {list(a.shape)}")
    return a.reshape(-1).astype(np.int64, copy=False)


def plan_transfer(src_pages: PageList, dst_pages: PageList, src_limit: int, dst_limit: int,
                  src_name: str = "source", dst_name: str = "destination") -> TransferPlan:
    """Validate page lists (equal length, in range, no repeated destination) and find runs."""
    s = _as_pages(src_pages, f"{src_name} pages")
    d = _as_pages(dst_pages, f"{dst_name} pages")
    if s.size != d.size:
        raise PageError(f"{src_name} and {dst_name} page lists differ in length: "
                        f"{s.size} vs {d.size}")
    for a, limit, name in ((s, src_limit, src_name), (d, dst_limit, dst_name)):
        if a.size:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise PageError(f"{name} page id {bad} is outside the {name} pool [0, {limit})")
    step_d = d[1:] - d[:-1]
    if d.size > 1 and not (step_d > 0).all() and np.unique(d).size != d.size:
        raise PageError(f"{dst_name} page list repeats a page id: {d.tolist()}")
    src, dst = torch.from_numpy(s.copy()), torch.from_numpy(d.copy())  # caller may reuse lists
    if s.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return TransferPlan(src, dst, empty, empty, empty)
    starts = np.flatnonzero((s[1:] - s[:-1] != 1) | (step_d != 1)) + 1
    bounds = np.concatenate(([0], starts, [s.size]))
    return TransferPlan(src, dst, s[bounds[:-1]], d[bounds[:-1]], bounds[1:] - bounds[:-1])


# CUDA copy issue plan --------------------------------------------------------------------------
DEVICE_COPY_METHODS = ("runs", "kernel", "copy2d", "pages")


@dataclass(frozen=True)
class DeviceCopyPlan:
    """How the CUDA path issues one job. ``runs``: one ``copy_`` per run of consecutive pages
    contiguous on both sides; ``kernel``: the Triton page gather/scatter, one launch per layer
    for a load (layers complete in order) and one for all layers of a backup; ``copy2d``: one
    CuPy ``memcpy2DAsync`` per run; ``pages``: one ``copy_`` per page (last resort).
    ``launches`` counts the calls the job issues."""

    method: str
    launches: int


def plan_device_copy(plan: TransferPlan, num_layers: int, direction: str, contiguous: bool,
                     have_kernel: bool, have_cupy: bool, max_runs: int = 2,
                     prefer_copy2d: bool = False) -> DeviceCopyPlan:
    """Pick the cheapest way to issue ``plan`` on CUDA: copy engines (``copy_``) when each
    layer is at most ``max_runs`` contiguous copies, else the kernel (O(layers) launches, not
    O(pages x layers)), else 2D copies, else runs or pages. ``prefer_copy2d`` (CuPy asked for
    explicitly) puts 2D copies before the kernel."""
    runs = len(plan.run_len)
    per_layer = 1 if direction == "h2d" else 0
    if contiguous and runs <= max_runs:
        return DeviceCopyPlan("runs", runs * num_layers)
    if have_cupy and prefer_copy2d and not contiguous:
        return DeviceCopyPlan("copy2d", runs * num_layers)
    if have_kernel:
        return DeviceCopyPlan("kernel", num_layers if per_layer else 1)
    if contiguous:
        return DeviceCopyPlan("runs", runs * num_layers)
    if have_cupy:
        return DeviceCopyPlan("copy2d", runs * num_layers)
    return DeviceCopyPlan("pages", plan.num_pages * num_layers)


# CPU block copies ------------------------------------------------------------------------------
COPY_KINDS = ("memmove", "take", "scatter")
# Rough cost of one call in microseconds (Python dispatch + setup), used to pick a kind, and a
# per-block surcharge for memmove: one long memmove measured a few % slower than numpy's
# per-block copies of the same bytes on the 2-core CI box (bench/transfer.py).
_CALL_COST = {"memmove": 0.7, "take": 1.5, "scatter": 2.0}
_MEMMOVE_BLOCK_COST = 0.05


@dataclass(frozen=True)
class BlockPlan:
    """How to copy blocks ``src[s[i]] -> dst[d[i]]`` of two flat block arrays.

    kind "memmove": ``ops`` int64 [k, 3] rows (src block, dst block, count), both sides
    contiguous. "take": ``ops`` tuple of (dst start, src ids int64 [n]) filling the contiguous
    destination run [start, start + n). "scatter": ``ops`` tuple of (src start, step, dst ids
    int64 [n]) reading the source run ``start, start + step, ...``.
    """

    kind: str
    ops: object
    num_blocks: int

    @property
    def num_calls(self) -> int:
        return len(self.ops)


def _runs(brk: np.ndarray, n: int) -> tuple[list[int], list[int]]:
    """Start and length of each run of a length-``n`` sequence with breaks ``brk`` [n-1]."""
    starts = np.flatnonzero(brk) + 1
    bounds = [0] + starts.tolist() + [n]
    return bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def plan_blocks(s: np.ndarray, d: np.ndarray, src_step: int = 1, kind: str | None = None
                ) -> BlockPlan:
    """Plan the copy of blocks ``s`` [n] -> ``d`` [n] (int64 ids, ``d`` without repeats).

    Picks the kind with the lowest estimated call cost unless ``kind`` forces one. Scatter runs
    follow the source with step 1 or ``src_step`` (a strided source such as one layer of a
    page_first host pool). Already sorted inputs skip the sorts.
    """
    s = np.asarray(s, dtype=np.int64).reshape(-1)
    d = np.asarray(d, dtype=np.int64).reshape(-1)
    n = int(s.size)
    if kind is not None and kind not in COPY_KINDS:
        raise TransferError(f"copy kind must be one of {COPY_KINDS}, got {kind!r}")
    if n == 0:
        return BlockPlan(kind or "memmove", np.zeros((0, 3), dtype=np.int64), 0)
    diff_d = d[1:] - d[:-1]
    if (diff_d > 0).all():  # already in destination order (the common case)
        sd, dd = s, d
    else:
        od = np.argsort(d, kind="stable")
        sd, dd = s[od], d[od]
        diff_d = dd[1:] - dd[:-1]
    diff_sd = sd[1:] - sd[:-1]
    brk_d = diff_d != 1
    if not brk_d.any() and (kind == "take" or kind is None and _CALL_COST["memmove"]
                            + n * _MEMMOVE_BLOCK_COST >= _CALL_COST["take"]):
        # one take fills the whole destination run: nothing is cheaper
        return BlockPlan("take", ((int(dd[0]), sd),), n)
    brk_m = brk_d | (diff_sd != 1)
    if (diff_sd >= 0).all():
        ss, ds, diff_s = sd, dd, diff_sd
    else:
        os_ = np.argsort(s, kind="stable")
        ss, ds = s[os_], d[os_]
        diff_s = ss[1:] - ss[:-1]
    brk_s = diff_s != 1
    n_s = int(np.count_nonzero(brk_s))
    step = 1
    if src_step > 1:
        brk_t = diff_s != src_step
        n_t = int(np.count_nonzero(brk_t))
        if n_t < n_s:
            brk_s, n_s, step = brk_t, n_t, int(src_step)
    cost = {"memmove": (1 + int(np.count_nonzero(brk_m))) * _CALL_COST["memmove"]
            + n * _MEMMOVE_BLOCK_COST,
            "take": (1 + int(np.count_nonzero(brk_d))) * _CALL_COST["take"],
            "scatter": (1 + n_s) * _CALL_COST["scatter"]}
    if kind is None:
        kind = min(COPY_KINDS, key=cost.__getitem__)
    if kind == "memmove":
        starts, lens = _runs(brk_m, n)
        ops = np.stack((sd[starts], dd[starts], np.asarray(lens, dtype=np.int64)), axis=1)
        return BlockPlan(kind, ops, n)
    if kind == "take":
        starts, lens = _runs(brk_d, n)
        return BlockPlan(kind, tuple((int(dd[a]), sd[a:a + m]) for a, m in zip(starts, lens)), n)
    starts, lens = _runs(brk_s, n)
    return BlockPlan(kind, tuple((int(ss[a]), step, ds[a:a + m]) for a, m in zip(starts, lens)),
                     n)


def run_block_plan(plan: BlockPlan, src: np.ndarray, dst: np.ndarray, src_off: int = 0,
                   dst_off: int = 0) -> None:
    """Execute ``plan`` on flat block arrays (1-D, contiguous, same void dtype), block ids
    shifted by ``src_off`` / ``dst_off``. Every call is a C loop that releases the GIL."""
    if plan.kind == "memmove":
        bs = src.dtype.itemsize
        sb = src.ctypes.data + src_off * bs
        db = dst.ctypes.data + dst_off * bs
        mm = _memmove
        for s0, d0, n in plan.ops.tolist():
            mm(db + d0 * bs, sb + s0 * bs, n * bs)
        return
    src = src[src_off:]
    dst = dst[dst_off:]
    if plan.kind == "take":
        take = np.take
        for d0, ids in plan.ops:
            take(src, ids, out=dst[d0:d0 + ids.size], mode="clip")
        return
    for s0, step, ids in plan.ops:
        dst[ids] = src[s0:s0 + step * (ids.size - 1) + 1:step]


def split_block_plan(plan: BlockPlan, parts: int) -> list[BlockPlan]:
    """Cut ``plan`` into at most ``parts`` plans of about equal block counts (same kind)."""
    n = plan.num_blocks
    if parts <= 1 or n < 2:
        return [plan]
    target = -(-n // parts)
    out: list[list] = [[]]
    room = target
    if plan.kind == "memmove":
        items = [(s0, d0, c) for s0, d0, c in plan.ops.tolist()]
    elif plan.kind == "take":
        items = [(d0, ids) for d0, ids in plan.ops]
    else:
        items = [(s0, st, ids) for s0, st, ids in plan.ops]
    for it in items:
        cnt = it[2] if plan.kind == "memmove" else it[-1].size
        a = 0
        while a < cnt:
            if room == 0:
                out.append([])
                room = target
            b = min(cnt, a + room)
            if plan.kind == "memmove":
                out[-1].append((it[0] + a, it[1] + a, b - a))
            elif plan.kind == "take":
                out[-1].append((it[0] + a, it[1][a:b]))
            else:
                out[-1].append((it[0] + a * it[1], it[1], it[2][a:b]))
            room -= b - a
            a = b
    res = []
    for ops in out:
        blocks = sum(o[2] if plan.kind == "memmove" else o[-1].size for o in ops)
        res.append(BlockPlan(plan.kind, np.asarray(ops, dtype=np.int64).reshape(-1, 3)
                             if plan.kind == "memmove" else tuple(ops), blocks))
    return res


def block_view(t: torch.Tensor, block_elems: int) -> np.ndarray:
    """A contiguous CPU tensor as a 1-D numpy array of ``block_elems``-element blocks."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise TransferError("block views need a contiguous CPU tensor")
    nbytes = block_elems * t.element_size()
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, nbytes)))


@dataclass
class TransferStats:
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    jobs_d2h: int = 0
    jobs_h2d: int = 0


class TransferJob:
    """One asynchronous transfer; layers complete in order 0..L-1."""

    def __init__(self, direction: str, plan: TransferPlan, num_layers: int, nbytes: int,
                 cuda: bool) -> None:
        self.direction = direction  # "d2h" (backup) or "h2d" (load)
        self.plan = plan
        self.num_layers = num_layers
        self.nbytes = nbytes
        self.seconds = 0.0  # copy time on the worker (CPU path; 0 on CUDA, where it is async)
        self._cuda = cuda
        self._error: BaseException | None = None
        self._state = PENDING  # written once, by _succeed or _fail
        self._blocks: BlockPlan | None = None  # CPU direct: the copy plan, made at submit
        # CPU: whoever takes this lock first runs the job (the worker, or a thread in wait()
        # that would otherwise sleep: no hand-off); _runner is the engine's executor
        self._claim = threading.Lock()
        self._runner = None
        if cuda:
            self._events = [torch.cuda.Event() for _ in range(num_layers)]
        else:  # CPU: one condition and a count of arrived layers (cheaper than L events)
            self._arrived = 0
            self._landed = bytearray(num_layers)  # layers copied, possibly out of order
            self._cond = threading.Condition(threading.Lock())
        self._finished = threading.Event()

    @property
    def device_pages(self) -> torch.Tensor:
        return self.plan.src_pages if self.direction == "d2h" else self.plan.dst_pages

    @property
    def host_pages(self) -> torch.Tensor:
        return self.plan.dst_pages if self.direction == "d2h" else self.plan.src_pages

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise PoolError(f"layer {layer!r} is outside [0, {self.num_layers})")

    @property
    def failed(self) -> bool:
        """The copy raised: ``done()`` is True but the data is not there (``wait`` raises)."""
        return self._error is not None

    def status(self) -> str:
        """PENDING, DONE or FAILED from one read of the job's state: decide on this, never on
        ``failed`` then ``done()`` (a copy failing between the two reads would look done)."""
        state = self._state
        if state == DONE and self._cuda:
            try:
                if not all(e.query() for e in self._events):
                    return PENDING
            except Exception as err:  # an asynchronous CUDA error surfaces here
                self._fail(err)
                return FAILED
        return state

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransferError(f"{self.direction} transfer of {self.plan.num_pages} pages "
                                f"failed: {self._error!r}") from self._error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block (CPU) until ``layer`` has arrived; on CUDA make the current stream wait."""
        self._check_layer(layer)
        if self._cuda:
            torch.cuda.current_stream().wait_event(self._events[layer])
            return
        if self._arrived <= layer and self._error is None:
            with self._cond:
                arrived = self._cond.wait_for(
                    lambda: self._arrived > layer or self._error is not None, timeout)
        else:
            arrived = True
        if not arrived:
            raise TransferError(f"layer {layer} of a {self.direction} transfer did not arrive "
                                f"within {timeout} s")
        self._raise_if_failed()

    def done(self) -> bool:
        if self._cuda:
            return self._finished.is_set() and all(e.query() for e in self._events)
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block the host until every layer has arrived (raises if the transfer failed). On
        CPU a job no copy thread has started yet is run by the waiting thread itself."""
        runner = self._runner
        if runner is not None and not self._finished.is_set() and self._claim.acquire(False):
            runner(self)
        if not self._finished.wait(timeout):
            raise TransferError(f"{self.direction} transfer did not finish within {timeout} s")
        self._raise_if_failed()
        if self._cuda and self._events:
            self._events[-1].synchronize()

    # called by the engine
    def _layer_done(self, layer: int) -> None:
        """CPU: layers 0..layer have arrived."""
        with self._cond:
            self._arrived = max(self._arrived, layer + 1)
            self._cond.notify_all()

    def _layer_landed(self, layer: int) -> None:
        """CPU: ``layer`` was copied (copy threads may finish layers out of order); layers
        arrive in order, once every earlier one has landed too."""
        with self._cond:
            self._landed[layer] = 1
            a = self._arrived
            while a < self.num_layers and self._landed[a]:
                a += 1
            if a != self._arrived:
                self._arrived = a
                self._cond.notify_all()

    def _succeed(self) -> None:
        self._state = DONE
        self._finished.set()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._state = FAILED
        if not self._cuda:
            with self._cond:
                self._cond.notify_all()
        self._finished.set()


class TransferEngine:
    """Moves whole widened pages between ``device_pool`` (L1) and ``host_pool`` (L2)."""

    cpu_copy: str | None = None  # CPU direct path: force one of COPY_KINDS (tests); None = cheapest
    # CPU: jobs of at most this many bytes are copied at submit on the calling thread (a
    # 256 KiB copy takes about as long as waking the copy thread); 0 = always hand off
    inline_bytes: int = 256 << 10

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 io_backend: str = "direct", use_cupy: bool | None = None,
                 copy_threads: int = 1) -> None:
        if io_backend not in IO_BACKENDS:
            raise PoolError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) \
                or copy_threads < 1:
            raise PoolError(f"copy_threads must be an int >= 1, got {copy_threads!r}")
        d, h = device_pool, host_pool
        for name in ("num_layers", "kv_dim", "dtype"):
            if getattr(d, name) != getattr(h, name):
                raise PoolError(f"device and host pools disagree on {name}: "
                                f"{getattr(d, name)} vs {getattr(h, name)}")
        if (d.layout.dcp_size, d.layout.rank, d.layout.page_size) != \
                (h.layout.dcp_size, h.layout.rank, h.layout.page_size):
            raise PoolError(f"device and host pools have different layouts: {d.layout} vs "
                            f"{h.layout}")
        self.device_pool, self.host_pool = d, h
        self.io_backend = io_backend
        self.num_layers = d.num_layers
        self.cuda = d.device.type == "cuda"
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._closed = False
        W = d.rows_per_page * d.kv_dim
        self._page_elems = W
        # Both pools as [L, pages, W] page views (W = P * kv_dim elements of one page-layer).
        self._dev3 = d.kv.view(d.num_layers, d.num_pages, W)
        if h.layout_kind == "layer_first":
            self._host3 = h.buf.view(h.num_layers, h.num_pages, W)
        else:
            self._host3 = h.buf.view(h.num_pages, h.num_layers, W).permute(1, 0, 2)
        if not self.cuda:  # flat block arrays and (layer, page) block strides of both pools
            self._dev_blocks = block_view(d.kv, W)
            self._host_blocks = block_view(h.buf, W)
            self._dev_strides = (d.num_pages, 1)
            self._host_strides = ((h.num_pages, 1) if h.layout_kind == "layer_first"
                                  else (1, h.num_layers))
        self._kernel = None
        if io_backend == "kernel":
            from hicache.kernels import page_copy

            self._kernel = page_copy
        self._cupy = HAVE_CUPY and self.cuda if use_cupy is None else (use_cupy and HAVE_CUPY)
        self._cupy_asked = bool(use_cupy)
        # CUDA direct: the Triton page gather/scatter for strided or scattered jobs
        self._device_kernel = None
        if self.cuda and io_backend == "direct":
            from hicache.kernels import page_copy

            if page_copy.kernel_usable():
                self._device_kernel = page_copy.page_copy_triton
        # CPU: threads that each copy a share of a job (the worker itself is one of them).
        self.copy_threads = 1 if self.cuda else copy_threads
        self._helpers = (ThreadPoolExecutor(2 * (copy_threads - 1), "hicache-copy")
                         if self.copy_threads > 1 else None)
        if self.cuda:
            self._streams = {"d2h": torch.cuda.Stream(d.device), "h2d": torch.cuda.Stream(d.device)}
            self._workers: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}
        else:
            self._workers = {}
            for direction in ("d2h", "h2d"):
                q: queue.SimpleQueue = queue.SimpleQueue()  # C-level put/get: cheap wake-ups
                t = threading.Thread(target=self._worker, args=(q,), daemon=True,
                                     name=f"hicache-{direction}")
                t.start()
                self._workers[direction] = (q, t)

    # ---- public API ----------------------------------------------------------------------------
    def backup(self, device_pages: PageList, host_pages: PageList) -> TransferJob:
        """D2H: device page ``device_pages[i]`` -> host page ``host_pages[i]``."""
        plan = plan_transfer(device_pages, host_pages, self.device_pool.num_pages,
                             self.host_pool.num_pages, "device", "host")
        return self._submit("d2h", plan)

    def load(self, host_pages: PageList, device_pages: PageList) -> TransferJob:
        """H2D: host page ``host_pages[i]`` -> device page ``device_pages[i]``, layer by layer."""
        plan = plan_transfer(host_pages, device_pages, self.host_pool.num_pages,
                             self.device_pool.num_pages, "host", "device")
        return self._submit("h2d", plan)

    def close(self) -> None:
        """Finish queued jobs and stop the workers."""
        if self._closed:
            return
        self._closed = True
        for q, t in self._workers.values():
            q.put(None)
        for q, t in self._workers.values():
            t.join()
        if self._helpers is not None:
            self._helpers.shutdown()
        if self.cuda:
            for s in self._streams.values():
                s.synchronize()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------
    def _submit(self, direction: str, plan: TransferPlan) -> TransferJob:
        if self._closed:
            raise TransferError("transfer engine is closed")
        nbytes = plan.num_pages * self.device_pool.bytes_per_page
        job = TransferJob(direction, plan, self.num_layers, nbytes, self.cuda)
        if self.cuda:
            self._run_cuda(job)
        else:
            if self._kernel is None:
                job._blocks = self._plan_blocks(direction, plan)
            job._runner = self._execute
            if nbytes <= self.inline_bytes and job._claim.acquire(False):
                self._execute(job)  # cheaper than the hand-off; layers all arrive at once
            else:
                self._workers[direction][0].put(job)
        return job

    def _views(self, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self._dev3, self._host3) if direction == "d2h" else (self._host3, self._dev3)

    def _account(self, job: TransferJob) -> None:
        with self._lock:
            if job.direction == "d2h":
                self.stats.bytes_d2h += job.nbytes
                self.stats.jobs_d2h += 1
            else:
                self.stats.bytes_h2d += job.nbytes
                self.stats.jobs_h2d += 1

    # CPU ----------------------------------------------------------------------------------------
    def _worker(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            if job._claim.acquire(False):  # else a waiter took it and runs it itself
                self._execute(job)

    def _execute(self, job: TransferJob) -> None:
        """Run a claimed CPU job on this thread and finish it (failures go to the waiter)."""
        t0 = time.perf_counter()
        try:
            self._run_cpu(job)
            job.seconds = time.perf_counter() - t0
        except BaseException as err:  # surfaced to the waiter
            job._fail(err)
        else:
            self._account(job)
            job._succeed()

    def _cpu_sides(self, direction: str):
        """(src blocks, src strides, dst blocks, dst strides) for a direction."""
        dev = (self._dev_blocks, self._dev_strides)
        host = (self._host_blocks, self._host_strides)
        (sb, sst), (db, dst) = (dev, host) if direction == "d2h" else (host, dev)
        return sb, sst, db, dst

    def _run_cpu(self, job: TransferJob) -> None:
        plan = job.plan
        L = self.num_layers
        if self._kernel is not None:
            src, dst = self._views(job.direction)
            si, di = plan.src_pages, plan.dst_pages
            copy = (self._kernel.page_copy_triton if self._kernel.interpreter_enabled()
                    else self._kernel.page_copy_reference)
            for layer in range(L):
                copy(src[layer:layer + 1], si, dst[layer:layer + 1], di)
                job._layer_done(layer)
            return
        src, (s_l, s_p), dst, (d_l, d_p) = self._cpu_sides(job.direction)
        bp = job._blocks if job._blocks is not None else self._plan_blocks(job.direction, plan)
        T = self.copy_threads
        if job.direction == "d2h":  # all layers in one plan (split across the copy threads)
            parts = split_block_plan(bp, T)
            futs = [self._helpers.submit(run_block_plan, p, src, dst) for p in parts[1:]]
            run_block_plan(parts[0], src, dst)
            for f in futs:
                f.result()
            job._layer_done(L - 1)
            return
        # A load: the layer-0 plan replayed per layer, layer i usable early. With T threads,
        # thread t copies layers t, t + T, ...; a layer arrives once all before it landed.
        def layers(first: int) -> None:
            for layer in range(first, L, T):
                run_block_plan(bp, src, dst, layer * s_l, layer * d_l)
                job._layer_landed(layer)

        futs = [self._helpers.submit(layers, t) for t in range(1, min(T, L))]
        layers(0)
        for f in futs:
            f.result()

    def _plan_blocks(self, direction: str, plan: TransferPlan) -> BlockPlan:
        """Block plan of a CPU direct job, made at submit time (off the worker's clock)."""
        src, (s_l, s_p), dst, (d_l, d_p) = self._cpu_sides(direction)
        ps, pd = plan.src_pages.numpy(), plan.dst_pages.numpy()
        if direction == "h2d":  # completes layer by layer: plan layer 0 only
            return plan_blocks(ps * s_p, pd * d_p, s_p, self.cpu_copy)
        # No per-layer consumer for a backup: plan all layers at once (a page_first host page
        # is then one contiguous destination run across layers).
        layers = np.arange(self.num_layers, dtype=np.int64)
        if d_p > d_l:  # page-major destination (page_first host): pairs in its order
            layers, ps, pd = layers[None, :], ps[:, None], pd[:, None]
        else:
            layers = layers[:, None]
        return plan_blocks((layers * s_l + ps * s_p).reshape(-1),
                           (layers * d_l + pd * d_p).reshape(-1), s_p, self.cpu_copy)

    # CUDA ---------------------------------------------------------------------------------------
    def device_copy_plan(self, job: TransferJob) -> DeviceCopyPlan:
        """The CUDA issue plan of ``job`` (also computable on CPU: tests check launch counts)."""
        src, dst = self._views(job.direction)
        W = self._page_elems
        contiguous = src.stride(1) == W and dst.stride(1) == W
        if self._kernel is not None:
            return DeviceCopyPlan("kernel", self.num_layers if job.direction == "h2d" else 1)
        return plan_device_copy(job.plan, self.num_layers, job.direction, contiguous,
                                self._device_kernel is not None, bool(self._cupy),
                                prefer_copy2d=self._cupy_asked)

    def _run_cuda(self, job: TransferJob) -> None:  # pragma: no cover - needs a GPU
        stream = self._streams[job.direction]
        if job.direction == "d2h":  # KV written by compute before submit must be visible
            stream.wait_stream(torch.cuda.current_stream())
        # a load writes pages no running request reads and reads host copies that are
        # complete: it need not wait for the compute queued so far, so it overlaps this step
        try:
            with torch.cuda.stream(stream):
                self._issue(job, self.device_copy_plan(job), stream,
                            lambda layer: job._events[layer].record(stream))
        except BaseException as err:
            job._fail(err)
            raise TransferError(f"could not issue the {job.direction} transfer: {err!r}") from err
        self._account(job)
        job._succeed()

    def _issue(self, job: TransferJob, how: DeviceCopyPlan, stream, layer_done,
               kernel=None) -> int:
        """Issue ``job`` the way ``how`` says; ``layer_done(i)`` after layer i's copies (all
        layers at once for a one-launch backup). Returns the calls made. ``kernel`` overrides
        the page-copy kernel (tests on CPU pass the torch reference)."""
        src, dst = self._views(job.direction)
        plan = job.plan
        L = self.num_layers
        calls = 0
        if how.method == "kernel":
            kernel = kernel or (self._kernel.page_copy_triton if self._kernel is not None
                                else self._device_kernel)
            dev = self._dev3.device
            si = plan.src_pages.to(dev, non_blocking=True)
            di = plan.dst_pages.to(dev, non_blocking=True)
            if job.direction == "d2h":  # no per-layer consumer: one launch for every layer
                kernel(src, si, dst, di)
                for layer in range(L):
                    layer_done(layer)
                return 1
            for layer in range(L):
                kernel(src[layer:layer + 1], si, dst[layer:layer + 1], di)
                layer_done(layer)
            return L
        runs = list(zip(plan.run_src.tolist(), plan.run_dst.tolist(), plan.run_len.tolist()))
        for layer in range(L):
            s, d = src[layer], dst[layer]  # [pages, W]
            for s0, d0, n in runs:
                if how.method == "runs":
                    d[d0:d0 + n].copy_(s[s0:s0 + n], non_blocking=True)
                    calls += 1
                elif how.method == "copy2d":  # pragma: no cover - needs a GPU and CuPy
                    es = s.element_size()
                    _cupy.cuda.runtime.memcpy2DAsync(
                        d[d0].data_ptr(), d.stride(0) * es, s[s0].data_ptr(),
                        s.stride(0) * es, self._page_elems * es, n,
                        _cupy.cuda.runtime.memcpyDefault, stream.cuda_stream)
                    calls += 1
                else:
                    for i in range(n):
                        d[d0 + i].copy_(s[s0 + i], non_blocking=True)
                    calls += n
            layer_done(layer)
        return calls
