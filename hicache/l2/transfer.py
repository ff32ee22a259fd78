"""Per-rank transfers between the L1 device pool and host memory (the L2 pool, or the buffer an
L3 read filled).

``backup(device_pages, host_pages)`` copies whole widened pages (this rank's P rows of every
layer) device -> host; ``load(host_pages, device_pages)`` copies host -> device;
``restore(staging, device_pages)`` copies pages an L3 read left in a staging buffer
``[n, L, P, D]`` into device pages, host -> device like a load. Each returns a ``TransferJob``
whose layers complete in order: ``wait_layer(i)`` lets the engine compute layer i-1 while layer
i is still loading. No collective is ever issued: each rank moves its own shard.

The engine validates page lists, sees each end of a job as a ``PageSide`` (whole pages as an
``[L, pages, W]`` view, ``W`` = the elements of one page-layer block of the pools'
``PageFormat``), counts finished jobs, and hands every job to one
copy backend, chosen by the L1 pool's device type from a registry (``backend_for``):

- ``cpu`` -> ``hicache/l2/copy_cpu.py``: a worker thread per direction; small jobs copied at
  submit on the calling thread; ``wait()`` runs a job no thread has started; planned block
  copies (``hicache/l2/blocks.py``) or the page-copy kernel's torch reference.
- ``cuda`` -> ``hicache/l2/copy_cuda.py``: a stream per direction, one event per layer; copy
  engines, the Triton page gather/scatter, CuPy 2D copies or per-page copies.

- pools of different dtypes (a conversion ``hicache.page_format`` declares, exact from the device
  to the host) -> ``hicache/l2/copy_convert.py``: torch copies that convert, on any device.

A backend for another kind of device is a new file with a ``CopyBackend`` subclass, named in
``BACKEND_MODULES`` (or passed to ``register_backend``); the engine has no branch per backend.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
import time
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from hicache.config import IOSection, bounds, choices, default
from hicache.errors import TransferError, UsageError
from hicache.ids import page_ids
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.page_format import conversion

PageList = Union[Sequence[int], torch.Tensor]
# the policy file's choices and defaults (hicache.config is their one home)
IO_BACKENDS: tuple[str, ...] = choices(IOSection, "backend")
# CPU copy backend: threads that copy one big job together (see ``TransferEngine.split_bytes``)
COPY_THREADS: int = default(IOSection, "copy_threads")
MAX_COPY_THREADS: int = bounds(IOSection, "copy_threads")[1]
MEDIA = ("device", "host", "staging")  # L1 pool, L2 pool, an L3 read's staging buffer


# A job's state, read in ONE attribute read (``TransferJob.status``): it only ever moves from
# PENDING to DONE or to FAILED, so a caller deciding "failed or done" never sees a mix.
PENDING, DONE, FAILED = "pending", "done", "failed"
_ENDED = 1 << 30   # TransferJob._block: wait for the job's end, not for a number of layers
_NOBODY = 1 << 31  # TransferJob._want when no thread sleeps on the job


@dataclass(frozen=True)
class TransferPlan:
    """Pages to move, validated: source page ``src[i]`` -> destination page ``dst[i]``. The
    coalesced runs of consecutive (src, dst) pages are worked out when first asked for."""

    src: np.ndarray  # int64 [n], owned (never a caller's array)
    dst: np.ndarray  # int64 [n], owned

    @property
    def num_pages(self) -> int:
        return int(self.src.size)

    @property
    def src_pages(self) -> torch.Tensor:
        """``src`` as an int64 tensor (shares its memory)."""
        return torch.from_numpy(self.src)

    @property
    def dst_pages(self) -> torch.Tensor:
        return torch.from_numpy(self.dst)

    @property
    def num_runs(self) -> int:
        """Runs of consecutive (src, dst) pages."""
        return len(self.runs) if self.src.size <= SMALL_PLAN else int(self._bounds.size) - 1

    def runs_at_most(self, k: int) -> bool:
        """Whether the plan has at most ``k`` runs; a scattered plan is told from its first
        pages (a few Python compares) without counting all its runs."""
        if self.src.size > SMALL_PLAN:
            s, d = self.src[:k + 2].tolist(), self.dst[:k + 2].tolist()
            breaks = sum(1 for i in range(1, len(s))
                         if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1)
            if breaks >= k:  # k + 1 runs or more in these pages alone
                return False
        return self.num_runs <= k

    @property
    def runs(self) -> list[tuple[int, int, int]]:
        """(first src page, first dst page, pages) of each run, as Python ints (found once)."""
        runs = self.__dict__.get("_runs")  # frozen: cached in the instance dict directly
        if runs is None:
            runs = self.__dict__["_runs"] = self._find_runs()
        return runs

    def _find_runs(self) -> list[tuple[int, int, int]]:
        if self.src.size > SMALL_PLAN:
            return list(zip(self.run_src.tolist(), self.run_dst.tolist(),
                            self.run_len.tolist()))
        out: list[tuple[int, int, int]] = []
        for a, b in zip(self.src.tolist(), self.dst.tolist()):
            if out and a == out[-1][0] + out[-1][2] and b == out[-1][1] + out[-1][2]:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((a, b, 1))
        return out

    @property
    def _bounds(self) -> np.ndarray:
        """Index of each run's first page, then the page count (int64 [runs + 1])."""
        b = self.__dict__.get("_bounds_")
        if b is None:
            s, d = self.src, self.dst
            if s.size == 0:
                b = np.zeros(1, dtype=np.int64)
            else:
                starts = np.flatnonzero((s[1:] - s[:-1] != 1) | (d[1:] - d[:-1] != 1)) + 1
                b = np.concatenate(([0], starts, [s.size]))
            self.__dict__["_bounds_"] = b
        return b

    @property
    def run_src(self) -> np.ndarray:  # int64 [runs] first src page of each run
        return self.src[self._bounds[:-1]]

    @property
    def run_dst(self) -> np.ndarray:  # int64 [runs] first dst page of each run
        return self.dst[self._bounds[:-1]]

    @property
    def run_len(self) -> np.ndarray:  # int64 [runs] pages in each run
        return np.diff(self._bounds)


# Up to this many pages, a plan's checks run on Python lists (min, max, set): a few hundred
# nanoseconds, where each numpy call costs about a microsecond.
SMALL_PLAN = 64


def _check_range(lo: int, hi: int, limit: int, name: str) -> None:
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise UsageError(f"{name} page id {bad} is outside the {name} pool [0, {limit})")


def plan_transfer(src_pages: PageList, dst_pages: PageList, src_limit: int, dst_limit: int,
                  src_name: str = "source", dst_name: str = "destination") -> TransferPlan:
    """Validate page lists (equal length, in range, no repeated destination)."""
    s = page_ids(src_pages, f"{src_name} pages")
    d = page_ids(dst_pages, f"{dst_name} pages")
    n = int(s.size)
    if n != d.size:
        raise UsageError(f"{src_name} and {dst_name} page lists differ in length: "
                         f"{n} vs {d.size}")
    if n == 0:
        pass
    elif n <= SMALL_PLAN:
        sl, dl = s.tolist(), d.tolist()
        _check_range(min(sl), max(sl), src_limit, src_name)
        _check_range(min(dl), max(dl), dst_limit, dst_name)
        if len(set(dl)) != n:
            raise UsageError(f"{dst_name} page list repeats a page id: {dl}")
    else:
        _check_range(int(s.min()), int(s.max()), src_limit, src_name)
        _check_range(int(d.min()), int(d.max()), dst_limit, dst_name)
        if not (d[1:] > d[:-1]).all():
            ds = np.sort(d)
            if (ds[1:] == ds[:-1]).any():
                raise UsageError(f"{dst_name} page list repeats a page id: {d.tolist()}")
    # the plan owns its arrays (the caller may reuse its own); ids converted from a list,
    # tuple or range already are new arrays
    fresh = (list, tuple, range)
    return TransferPlan(s if type(src_pages) in fresh else s.copy(),
                        d if type(dst_pages) in fresh else d.copy())


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
    host (a count of arrived layers and the state, under a condition the engine's jobs share:
    a job is cheap to make, and a waiter re-checks its own job when woken); a backend whose
    copies complete elsewhere (CUDA events) subclasses it."""

    def __init__(self, direction: str, plan: TransferPlan, num_layers: int, nbytes: int,
                 src: PageSide | None = None, dst: PageSide | None = None,
                 cond: threading.Condition | None = None) -> None:
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
        # while the job's chunks are shared among copy threads: a waiter copies chunks the
        # layers it waits for still need instead of sleeping (``_help(need)``, the backend's)
        self._help = None
        self._arrived = 0
        # pieces of each layer copied, possibly out of order (a job split across copy threads
        # lands a layer once per piece, ``_pieces`` of them)
        self._landed = bytearray(num_layers)
        self._pieces = 1
        # guards _arrived, _landed, _want and _state changes; the engine's, or the job's own
        self._cond = cond if cond is not None else threading.Condition(threading.Lock())
        self._want = _NOBODY  # the fewest layers a sleeping waiter wants

    @property
    def device_pages(self) -> torch.Tensor:
        return self.plan.src_pages if self.direction == "d2h" else self.plan.dst_pages

    @property
    def host_pages(self) -> torch.Tensor:
        return self.plan.dst_pages if self.direction == "d2h" else self.plan.src_pages

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise UsageError(f"layer {layer!r} is outside [0, {self.num_layers})")

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
        """Block until ``layer`` has arrived (a job the copy threads share gets the waiter's
        help with the chunks of layers up to ``layer`` first, as in ``wait``)."""
        self._check_layer(layer)
        if self._arrived <= layer and self._state is PENDING:
            helping = self._help
            if helping is not None:
                helping(layer + 1)
        if self._arrived <= layer and self._state is PENDING \
                and not self._block(layer + 1, timeout):
            raise TransferError(f"layer {layer} of a {self.direction} transfer did not arrive "
                                f"within {timeout} s")
        self._raise_if_failed()

    def done(self) -> bool:
        return self._state is not PENDING

    def wait(self, timeout: float | None = None) -> None:
        """Block until every layer has arrived (raises if the transfer failed). A job no copy
        thread has started yet is run by the waiting thread itself, and a job the copy threads
        share gets the waiting thread's help (``_help``) before it sleeps: either way the
        waiter may copy past ``timeout`` (a copy is never abandoned half done)."""
        if self._state is PENDING:
            runner = self._runner
            if runner is not None and self._claim.acquire(False):
                runner(self)
            else:
                helping = self._help
                if helping is not None:
                    helping(_ENDED)
            if self._state is PENDING and not self._block(_ENDED, timeout):
                raise TransferError(f"{self.direction} transfer did not finish within "
                                    f"{timeout} s")
        self._raise_if_failed()

    def _block(self, need: int, timeout: float | None) -> bool:
        """Sleep until ``need`` layers have arrived or the job ended (``_ENDED``: only the end
        will do); False on timeout. A sleeper marks the layer count it wants (``_want``, the
        least any sleeper on this job wants), so a copy thread wakes the job's sleepers only
        when that is reached, and never where nobody sleeps."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._arrived < need and self._state is PENDING:
                self._want = min(self._want, need)
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._cond.wait(left):
                    return self._arrived >= need or self._state is not PENDING
        return True

    def _wake(self) -> None:
        """Under ``_cond``: wake the sleepers once the layers they want arrived (or it ended)."""
        if self._want != _NOBODY and (self._arrived >= self._want or self._state is not PENDING):
            self._want = _NOBODY
            self._cond.notify_all()

    # called by the backend
    def _layer_done(self, layer: int) -> None:
        """Layers 0..layer have arrived."""
        with self._cond:
            self._arrived = max(self._arrived, layer + 1)
            self._wake()

    def _layers_landed(self, first: int, end: int) -> None:
        """One piece of each of layers ``first..end-1`` was copied (the copy threads of a split
        job land their pieces independently); a layer arrives once all its ``_pieces`` pieces
        and every earlier layer have landed, so layers still arrive in order."""
        with self._cond:
            landed = self._landed
            for layer in range(first, end):
                landed[layer] += 1
            a, whole = self._arrived, self._pieces
            while a < self.num_layers and landed[a] >= whole:
                a += 1
            if a != self._arrived:
                self._arrived = a
                self._wake()

    def _succeed(self) -> None:
        with self._cond:
            self._arrived = self.num_layers  # a finished job has every layer
            self._state = DONE
            self._wake()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        with self._cond:
            self._state = FAILED
            self._wake()


# ---- copy backends ----------------------------------------------------------------------------
class CopyBackend(ABC):
    """Runs the copies of one engine's jobs. ``submit`` starts a job (it then completes layer by
    layer: ``job._layer_done`` / ``_layers_landed``, then ``_succeed`` or ``_fail``, and
    ``engine.account(job)`` on success); ``copy`` moves a job's bytes, the one call in which a
    copy fails (``hicache.faults`` wraps it); ``close`` finishes queued jobs."""

    job_class: type[TransferJob] = TransferJob

    def __init__(self, engine: "TransferEngine") -> None:
        self.engine = engine

    @abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Start ``job``; it completes layer by layer (see the class docstring)."""

    @abstractmethod
    def copy(self, job: TransferJob) -> None:
        """Move ``job``'s bytes (raises when the copy fails)."""

    def close(self) -> None:
        pass


# device type -> module that registers its backend when imported (imported on first use, so a
# CPU-only machine never imports the CUDA backend's optional dependencies)
BACKEND_MODULES = {"cpu": "hicache.l2.copy_cpu", "cuda": "hicache.l2.copy_cuda"}
# pools whose dtypes differ (a declared ``hicache.page_format.Conversion``): any device
CONVERT_MODULE = "hicache.l2.copy_convert"
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
        raise UsageError(f"no copy backend for {device_type!r} devices; registered: "
                         f"{', '.join(sorted(set(_BACKENDS) | set(BACKEND_MODULES)))}") from None


class TransferEngine:
    """Moves whole widened pages between ``device_pool`` (L1) and host memory (``host_pool``,
    L2, or an L3 read's staging buffer) through the copy backend of the device's type
    (``backend`` overrides it)."""

    cpu_copy: str | None = None  # CPU direct path: force one of COPY_KINDS (tests); None = cheapest
    # CPU: jobs of at most this many bytes are copied at submit on the calling thread (a
    # 256 KiB copy takes about as long as waking the copy thread); 0 = always hand off
    inline_bytes: int = 256 << 10
    # CPU: jobs of at least this many bytes are split across ``copy_threads`` threads (byte
    # ranges of every layer); smaller ones are copied by one thread
    split_bytes: int = 8 << 20

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 io_backend: str = default(IOSection, "backend"), use_cupy: bool | None = None,
                 copy_threads: int = COPY_THREADS, backend: type[CopyBackend] | None = None
                 ) -> None:
        if io_backend not in IO_BACKENDS:
            raise UsageError(f"io_backend must be one of {IO_BACKENDS}, got {io_backend!r}")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) \
                or not 1 <= copy_threads <= MAX_COPY_THREADS:
            raise UsageError(f"copy_threads must be an int in [1, {MAX_COPY_THREADS}], got "
                             f"{copy_threads!r}")
        d, h = device_pool, host_pool
        # the pools' formats: same shape; the host's dtype may differ through a declared
        # conversion that is exact from the device's (a backup never rounds)
        try:
            self.conversion = conversion(d.format, h.format)
        except UsageError as e:
            raise UsageError(f"device and host pools disagree: {e}") from None
        if self.conversion is not None and not self.conversion.exact:
            raise UsageError(f"device and host pools disagree on dtype: {d.dtype} -> {h.dtype} "
                             "would round on every backup; the host needs a dtype that holds "
                             "every device value")
        if (d.layout.dcp_size, d.layout.rank, d.layout.page_size) != \
                (h.layout.dcp_size, h.layout.rank, h.layout.page_size):
            raise UsageError(f"device and host pools have different layouts: {d.layout} vs "
                             f"{h.layout}")
        self.device_pool, self.host_pool = d, h
        self.io_backend = io_backend
        self.use_cupy = use_cupy
        self.copy_threads = copy_threads
        self.num_layers = d.num_layers
        self.cuda = d.device.type == "cuda"
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())  # shared by this engine's jobs
        self._closed = False
        W = d.format.block_elems  # elements of one page-layer
        self.block_elems = W
        self.device_side = PageSide("device", d.kv, d.num_layers, d.num_pages, W)
        self.host_side = PageSide("host", h.buf, h.num_layers, h.num_pages, W,
                                  page_major=h.layout_kind != "layer_first", pinned=h.pinned)
        if backend is None:  # elements that change type: the converting backend
            backend = (importlib.import_module(CONVERT_MODULE).ConvertBackend
                       if self.conversion is not None else backend_for(d.device.type))
        self.backend = backend(self)

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
        d, fmt = self.device_pool, self.host_pool.format  # an L3 value holds a host page
        want = fmt.shape
        if not isinstance(staging, torch.Tensor) or staging.dim() != 4 \
                or tuple(staging.shape[1:]) != want or staging.dtype != fmt.dtype \
                or staging.device.type != "cpu" or not staging.is_contiguous():
            got = (f"{tuple(staging.shape)} {staging.dtype} on {staging.device}"
                   if isinstance(staging, torch.Tensor) else type(staging).__name__)
            raise UsageError(f"restore needs a contiguous CPU staging tensor [n, "
                             f"{', '.join(map(str, want))}] of {fmt.dtype}, got {got}")
        dst = page_ids(device_pages, "device pages")
        n = int(staging.shape[0])
        if dst.size > n:
            raise UsageError(f"restore of {dst.size} pages from a staging buffer of {n}")
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
        nbytes = plan.num_pages * self.device_pool.format.page_bytes
        job = self.backend.job_class(direction, plan, self.num_layers, nbytes, src, dst,
                                     self._cond)
        self.backend.submit(job)
        return job
