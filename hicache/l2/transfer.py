"""Per-rank transfers between the L1 device pool and host memory (the L2 pool, or the buffer an
L3 read filled).

``backup(device_pages, host_pages)`` copies whole widened pages (this rank's P rows of every
layer) device -> host; ``load(host_pages, device_pages)`` copies host -> device;
``restore(staging, device_pages)`` copies pages an L3 read left in a staging buffer
``[n, L, P, D]`` into device pages, host -> device like a load. Each returns a ``TransferJob``
whose layers complete in order: ``wait_layer(i)`` lets the engine compute layer i-1 while layer
i is still loading. No collective is ever issued: each rank moves its own shard.

The engine validates page lists, sees each end of a job as a ``PageSide`` (whole pages as an
``[L, pages, W]`` view, ``W = P * kv_dim``), counts finished jobs, and hands every job to one
copy backend, chosen by the L1 pool's device type from a registry (``backend_for``):

- ``cpu`` -> ``hicache/l2/copy_cpu.py``: a worker thread per direction; small jobs copied at
  submit on the calling thread; ``wait()`` runs a job no thread has started; planned block
  copies (``hicache/l2/blocks.py``) or the page-copy kernel's torch reference.
- ``cuda`` -> ``hicache/l2/copy_cuda.py``: a stream per direction, one event per layer; copy
  engines, the Triton page gather/scatter, CuPy 2D copies or per-page copies.

A backend for another kind of device is a new file with a ``CopyBackend`` subclass, named in
``BACKEND_MODULES`` (or passed to ``register_backend``); the engine has no branch per backend.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from hicache.ids import PageError, page_ids
from hicache.l1.pool import DeviceKVPool, PoolError
from hicache.l2.pool import HostKVPool

PageList = Union[Sequence[int], torch.Tensor]
IO_BACKENDS = ("direct", "kernel")
MEDIA = ("device", "host", "staging")  # L1 pool, L2 pool, an L3 read's staging buffer


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


def plan_transfer(src_pages: PageList, dst_pages: PageList, src_limit: int, dst_limit: int,
                  src_name: str = "source", dst_name: str = "destination") -> TransferPlan:
    """Validate page lists (equal length, in range, no repeated destination) and find runs."""
    s = page_ids(src_pages, f"{src_name} pages")
    d = page_ids(dst_pages, f"{dst_name} pages")
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




@dataclass(frozen=True)
class PageSide:
    """One end of a transfer: ``base``, a contiguous tensor of ``num_pages`` whole pages of
    ``num_layers`` layers, each page-layer a block of ``block_elems`` elements (P rows x kv_dim).
    ``page_major``: a page's layers are adjacent (``[pages, L, W]``: a page_first host pool, a
    staging buffer), else a layer's pages are (``[L, pages, W]``). ``pinned``: host memory a
    device kernel may read directly."""

    medium: str  # one of MEDIA
    base: torch.Tensor
    num_layers: int
    num_pages: int
    block_elems: int
    page_major: bool = False
    pinned: bool = False

    @property
    def pages(self) -> torch.Tensor:
        """The side as ``[L, pages, W]`` (a view of ``base``)."""
        if self.page_major:
            return self.base.view(self.num_pages, self.num_layers,
                                  self.block_elems).permute(1, 0, 2)
        return self.base.view(self.num_layers, self.num_pages, self.block_elems)

    @property
    def block_strides(self) -> tuple[int, int]:
        """(layer, page) strides of ``base`` in blocks."""
        return (1, self.num_layers) if self.page_major else (self.num_pages, 1)


@dataclass
class TransferStats:
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    jobs_d2h: int = 0
    jobs_h2d: int = 0


class TransferJob:
    """One asynchronous transfer; layers complete in order 0..L-1. Completion is tracked on the
    host (a condition and a count of arrived layers); a backend whose copies complete elsewhere
    (CUDA events) subclasses it."""

    def __init__(self, direction: str, plan: TransferPlan, num_layers: int, nbytes: int,
                 src: PageSide | None = None, dst: PageSide | None = None) -> None:
        self.direction = direction  # "d2h" (backup) or "h2d" (load, restore)
        self.plan = plan
        self.num_layers = num_layers
        self.nbytes = nbytes
        self.src, self.dst = src, dst  # None: the engine's pools, by direction
        self.seconds = 0.0  # copy time on the copying thread (0 where the copy is async)
        self.prepared: object = None  # what the backend planned at submit (off the copy clock)
        self._error: BaseException | None = None
        self._state = PENDING  # written once, by _succeed or _fail
        # Whoever takes this lock first runs the job (a backend's thread, or a thread in wait()
        # that would otherwise sleep: no hand-off); _runner is the backend's executor.
        self._claim = threading.Lock()
        self._runner = None
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
        return self._state

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransferError(f"{self.direction} transfer of {self.plan.num_pages} pages "
                                f"failed: {self._error!r}") from self._error

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` has arrived."""
        self._check_layer(layer)
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
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer has arrived (raises if the transfer failed). A job no copy
        thread has started yet is run by the waiting thread itself."""
        runner = self._runner
        if runner is not None and not self._finished.is_set() and self._claim.acquire(False):
            runner(self)
        if not self._finished.wait(timeout):
            raise TransferError(f"{self.direction} transfer did not finish within {timeout} s")
        self._raise_if_failed()

    # called by the backend
    def _layer_done(self, layer: int) -> None:
        """Layers 0..layer have arrived."""
        with self._cond:
            self._arrived = max(self._arrived, layer + 1)
            self._cond.notify_all()

    def _layer_landed(self, layer: int) -> None:
        """``layer`` was copied (copy threads may finish layers out of order); layers arrive in
        order, once every earlier one has landed too."""
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
        with self._cond:
            self._cond.notify_all()
        self._finished.set()


# ---- copy backends ----------------------------------------------------------------------------
class CopyBackend:
    """Runs the copies of one engine's jobs. ``submit`` starts a job (it then completes layer by
    layer: ``job._layer_done`` / ``_layer_landed``, then ``_succeed`` or ``_fail``, and
    ``engine.account(job)`` on success); ``copy`` moves a job's bytes, the one call in which a
    copy fails (``hicache.faults`` wraps it); ``close`` finishes queued jobs."""

    job_class: type[TransferJob] = TransferJob

    def __init__(self, engine: "TransferEngine") -> None:
        self.engine = engine

    def submit(self, job: TransferJob) -> None:
        raise NotImplementedError

    def copy(self, job: TransferJob) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# device type -> module that registers its backend when imported (imported on first use, so a
# CPU-only machine never imports the CUDA backend's optional dependencies)
BACKEND_MODULES = {"cpu": "hicache.l2.copy_cpu", "cuda": "hicache.l2.copy_cuda"}
_BACKENDS: dict[str, type[CopyBackend]] = {}


def register_backend(device_type: str, cls: type[CopyBackend]) -> type[CopyBackend]:
    """Make ``cls`` the copy backend of engines whose L1 pool lives on ``device_type``."""
    if not (isinstance(cls, type) and issubclass(cls, CopyBackend)):
        raise TypeError(f"a copy backend must subclass CopyBackend, got {cls!r}")
    _BACKENDS[device_type] = cls
    return cls


def backend_for(device_type: str) -> type[CopyBackend]:
    """The copy backend registered for ``device_type`` (its module imported on first use)."""
    if device_type not in _BACKENDS and device_type in BACKEND_MODULES:
        importlib.import_module(BACKEND_MODULES[device_type])
    try:
        return _BACKENDS[device_type]
    except KeyError:
        raise PoolError(f"no copy backend for {device_type!r} devices; registered: "
                        f"{', '.join(sorted(set(_BACKENDS) | set(BACKEND_MODULES)))}") from None


class TransferEngine:
    """Moves whole widened pages between ``device_pool`` (L1) and host memory (``host_pool``,
    L2, or an L3 read's staging buffer) through the copy backend of the device's type
    (``backend`` overrides it)."""

    cpu_copy: str | None = None  # CPU direct path: force one of COPY_KINDS (tests); None = cheapest
    # CPU: jobs of at most this many bytes are copied at submit on the calling thread (a
    # 256 KiB copy takes about as long as waking the copy thread); 0 = always hand off
    inline_bytes: int = 256 << 10

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 io_backend: str = "direct", use_cupy: bool | None = None,
                 copy_threads: int = 1, backend: type[CopyBackend] | None = None) -> None:
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
        self.use_cupy = use_cupy
        self.copy_threads = copy_threads
        self.num_layers = d.num_layers
        self.cuda = d.device.type == "cuda"
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._closed = False
        W = d.rows_per_page * d.kv_dim  # elements of one page-layer
        self.block_elems = W
        self.device_side = PageSide("device", d.kv, d.num_layers, d.num_pages, W)
        self.host_side = PageSide("host", h.buf, h.num_layers, h.num_pages, W,
                                  page_major=h.layout_kind != "layer_first", pinned=h.pinned)
        self.backend = (backend or backend_for(d.device.type))(self)

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

    def restore(self, staging: torch.Tensor, device_pages: PageList) -> TransferJob:
        """H2D from an L3 read's staging buffer: page i of ``staging`` (a contiguous CPU tensor
        ``[n, L, P, D]`` of the pool dtype) -> device page ``device_pages[i]``, layer by layer
        like a load. The caller keeps ``staging`` unchanged until the job is done."""
        d = self.device_pool
        want = (d.num_layers, d.rows_per_page, d.kv_dim)
        if not isinstance(staging, torch.Tensor) or staging.dim() != 4 \
                or tuple(staging.shape[1:]) != want or staging.dtype != d.dtype \
                or staging.device.type != "cpu" or not staging.is_contiguous():
            got = (f"{tuple(staging.shape)} {staging.dtype} on {staging.device}"
                   if isinstance(staging, torch.Tensor) else type(staging).__name__)
            raise PoolError(f"restore needs a contiguous CPU staging tensor [n, "
                            f"{', '.join(map(str, want))}] of {d.dtype}, got {got}")
        dst = page_ids(device_pages, "device pages")
        n = int(staging.shape[0])
        if dst.size > n:
            raise PageError(f"restore of {dst.size} pages from a staging buffer of {n}")
        plan = plan_transfer(np.arange(dst.size, dtype=np.int64), dst, n, d.num_pages,
                             "staging", "device")
        src = PageSide("staging", staging, d.num_layers, n, self.block_elems, page_major=True,
                       pinned=staging.is_pinned())
        return self._submit("h2d", plan, src, self.device_side)

    def sides(self, job: TransferJob) -> tuple[PageSide, PageSide]:
        """(source, destination) of ``job``: its own, else the pools by direction."""
        if job.src is not None:
            return job.src, job.dst
        if job.direction == "d2h":
            return self.device_side, self.host_side
        return self.host_side, self.device_side

    def account(self, job: TransferJob) -> None:
        """Count a finished job (backends call it once the copy succeeded)."""
        with self._lock:
            if job.direction == "d2h":
                self.stats.bytes_d2h += job.nbytes
                self.stats.jobs_d2h += 1
            else:
                self.stats.bytes_h2d += job.nbytes
                self.stats.jobs_h2d += 1

    def close(self) -> None:
        """Finish queued jobs and stop the backend."""
        if self._closed:
            return
        self._closed = True
        self.backend.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, direction: str, plan: TransferPlan, src: PageSide | None = None,
                dst: PageSide | None = None) -> TransferJob:
        if self._closed:
            raise TransferError("transfer engine is closed")
        nbytes = plan.num_pages * self.device_pool.bytes_per_page
        job = self.backend.job_class(direction, plan, self.num_layers, nbytes, src, dst)
        self.backend.submit(job)
        return job
