"""The CUDA copy backend: copies issued on CUDA streams, for engines whose L1 pool is on a GPU.

A dedicated stream per direction, one event per layer; a backup waits for the compute queued
before it, a load (or restore) does not (it overlaps the current step). ``plan_device_copy``
picks how: ``direct`` issues ``copy_(non_blocking=True)`` per run when each layer is one or two
runs contiguous on both sides (copy engines), and otherwise launches the Triton page
gather/scatter (once per layer for a load, once for a whole backup: O(layers) launches, not one
copy per page per layer on the strided page_first side), falling back to CuPy 2D copies or
per-page copies without Triton. ``kernel`` launches the kernel. Host memory a kernel cannot
read (pageable: an unpinned staging buffer, an L2 pool with ``pin = "off"`` or whose
``cudaHostRegister`` was refused) is never handed to the kernel or CuPy: plain ``copy_`` runs.

Every stream and wait is the pool's device's (not whichever device is current). A job's
``seconds`` is the time between CUDA events recorded before its first and after its last copy
(read once the job is done), so ``stats()["gbps"]`` holds on a GPU too. Index lists go to the
device through pinned staging (torch's caching host allocator keeps the block until the copy
that reads it is done), so an upload never waits inside the driver. The backend holds its
engine weakly: engine and backend form no cycle, and a dropped engine frees its pools at once.

Importing this module needs no GPU (its plans are checked on CPU); the streams are made only
for an engine whose pool is on CUDA. (Written for the GPU machine; this project's CI has none.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hicache.errors import TransferError
from hicache.l2.transfer import (DONE, FAILED, PENDING, CopyBackend, TransferJob, TransferPlan,
                                 register_backend)

try:  # optional CUDA 2D copies (the "gpu" extra); only used when CUDA is present too
    import cupy as _cupy  # type: ignore

    HAVE_CUPY = True
except Exception:
    _cupy = None
    HAVE_CUPY = False

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
    runs = plan.num_runs
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



class CudaJob(TransferJob):
    """A job whose layers complete on a CUDA stream: one event per layer, plus timing events
    around the whole job (``seconds``, once done)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device: torch.device | None = None  # the pool's device, set at submit
        self._events = [torch.cuda.Event() for _ in range(self.num_layers - 1)]
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._events.append(self._end)  # the last layer's event times the job's end
        self._seconds: float | None = None

    @property
    def seconds(self) -> float:
        """Device time of the copies (CUDA events), 0.0 until the job is done."""
        if self._seconds is None:
            if self._state is not DONE or not self._end.query():
                return 0.0
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds

    @seconds.setter
    def seconds(self, value: float) -> None:  # TransferJob.__init__ sets 0.0: events decide
        pass

    def status(self) -> str:
        state = self._state
        if state == DONE:
            try:
                if not all(e.query() for e in self._events):
                    return PENDING
            except Exception as err:  # an asynchronous CUDA error surfaces here
                self._fail(err)
                return FAILED
        return state

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Make the pool device's current stream wait for ``layer`` (the host does not block)."""
        self._check_layer(layer)
        torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def done(self) -> bool:
        return self._state is not PENDING and all(e.query() for e in self._events)

    def wait(self, timeout: float | None = None) -> None:
        super().wait(timeout)
        if self._events:
            self._events[-1].synchronize()


def _synchronize(streams) -> None:  # pragma: no cover - needs a GPU
    for s in streams:
        s.synchronize()


def upload_index(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on ``device`` without a wait: through pinned staging on CUDA."""
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


class CudaBackend(CopyBackend):
    job_class = CudaJob
    # Force one of DEVICE_COPY_METHODS for every job whose host side is pinned (None: the
    # cheapest). gpu_check sets "pages" to measure the copy engines on scattered pages.
    force_method: str | None = None

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._kernel = None
        if engine.io_backend == "kernel":
            from hicache.kernels import page_copy

            self._kernel = page_copy
        use = engine.use_cupy
        self._cupy = HAVE_CUPY and engine.cuda if use is None else (use and HAVE_CUPY)
        self._cupy_asked = bool(use)
        # direct: the Triton page gather/scatter for strided or scattered jobs
        self._device_kernel = None
        self._streams: dict[str, torch.cuda.Stream] = {}
        if engine.cuda:  # pragma: no cover - needs a GPU (on CPU this backend only plans)
            if engine.io_backend == "direct":
                from hicache.kernels import page_copy

                if page_copy.kernel_usable():
                    self._device_kernel = page_copy.page_copy_triton
            dev = engine.device_pool.device
            self._streams = {"d2h": torch.cuda.Stream(dev), "h2d": torch.cuda.Stream(dev)}
            # an engine dropped with copies in flight: they finish before its pools are freed
            # (weakref callbacks run before the engine's attributes are cleared)
            weakref.finalize(engine, _synchronize, tuple(self._streams.values()))

    @property
    def engine(self):
        """The engine, held weakly: engine and backend form no reference cycle."""
        eng = self._engine_ref()
        if eng is None:
            raise TransferError("the transfer engine of this copy backend was freed")
        return eng

    @engine.setter
    def engine(self, engine) -> None:
        self._engine_ref = weakref.ref(engine)

    def plan(self, job: TransferJob) -> DeviceCopyPlan:
        """How ``job`` is issued (computable on CPU: tests check launch counts)."""
        src_side, dst_side = self.engine.sides(job)
        src, dst = src_side.pages, dst_side.pages
        W = self.engine.block_elems
        contiguous = src.stride(1) == W and dst.stride(1) == W
        host = dst_side if job.direction == "d2h" else src_side
        L = self.engine.num_layers
        if not host.pinned:  # pageable: no kernel or 2D copy reads it, one copy_ per run
            return DeviceCopyPlan("runs", job.plan.num_runs * L)
        if self.force_method is not None:
            if self.force_method not in DEVICE_COPY_METHODS:
                raise TransferError(f"force_method must be one of {DEVICE_COPY_METHODS}, got "
                                    f"{self.force_method!r}")
            if self.force_method == "kernel" and self._kernel is None \
                    and self._device_kernel is None:
                raise TransferError("force_method 'kernel': the page-copy kernel is not usable")
            per_job = {"kernel": L if job.direction == "h2d" else 1,
                       "pages": job.plan.num_pages * L}
            return DeviceCopyPlan(self.force_method,
                                  per_job.get(self.force_method, job.plan.num_runs * L))
        if self._kernel is not None:
            return DeviceCopyPlan("kernel", L if job.direction == "h2d" else 1)
        return plan_device_copy(job.plan, L, job.direction, contiguous,
                                self._device_kernel is not None, bool(self._cupy),
                                prefer_copy2d=self._cupy_asked)

    def submit(self, job: TransferJob) -> None:  # pragma: no cover - needs a GPU
        stream = self._streams[job.direction]
        dev = self.engine.device_pool.device
        job.device = dev
        if job.direction == "d2h":  # KV written by compute before submit must be visible
            stream.wait_stream(torch.cuda.current_stream(dev))
        # a load writes pages no running request reads and reads host copies that are
        # complete: it need not wait for the compute queued so far, so it overlaps this step
        try:
            self.copy(job)
        except BaseException as err:
            job._fail(err)
            raise TransferError(f"could not issue the {job.direction} transfer: {err!r}") from err
        self.engine.account(job)
        job._succeed()

    def copy(self, job: TransferJob) -> None:  # pragma: no cover - needs a GPU
        stream = self._streams[job.direction]
        with torch.cuda.stream(stream):
            job._start.record(stream)
            self.issue(job, self.plan(job), stream,
                       lambda layer: job._events[layer].record(stream))

    def close(self) -> None:
        for s in self._streams.values():  # pragma: no cover - needs a GPU
            s.synchronize()

    def issue(self, job: TransferJob, how: DeviceCopyPlan, stream, layer_done,
              kernel=None) -> int:
        """Issue ``job`` the way ``how`` says; ``layer_done(i)`` after layer i's copies (all
        layers at once for a one-launch backup). Returns the calls made. ``kernel`` overrides
        the page-copy kernel (tests on CPU pass the torch reference)."""
        src_side, dst_side = self.engine.sides(job)
        src, dst = src_side.pages, dst_side.pages
        plan = job.plan
        L = self.engine.num_layers
        calls = 0
        if how.method == "kernel":
            kernel = kernel or (self._kernel.page_copy_triton if self._kernel is not None
                                else self._device_kernel)
            dev = self.engine.device_pool.device
            ids = upload_index(torch.cat([plan.src_pages, plan.dst_pages]), dev)
            si, di = ids[:plan.num_pages], ids[plan.num_pages:]
            if job.direction == "d2h":  # no per-layer consumer: one launch for every layer
                kernel(src, si, dst, di)
                for layer in range(L):
                    layer_done(layer)
                return 1
            for layer in range(L):
                kernel(src[layer:layer + 1], si, dst[layer:layer + 1], di)
                layer_done(layer)
            return L
        runs = plan.runs
        W = self.engine.block_elems
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
                        s.stride(0) * es, W * es, n,
                        _cupy.cuda.runtime.memcpyDefault, stream.cuda_stream)
                    calls += 1
                else:
                    for i in range(n):
                        d[d0 + i].copy_(s[s0 + i], non_blocking=True)
                    calls += n
            layer_done(layer)
        return calls


register_backend("cuda", CudaBackend)
