"""L2: the per-rank host KV pool, same widened page ids as L1, this rank's P rows per page.

Two layouts:
- ``layer_first``: ``buf`` [L, num_pages * P, D], mirrors L1 (one slice per layer and page run).
- ``page_first``: ``buf`` [num_pages, L, P, D], one page contiguous across layers (one copy per
  page to and from L3).

Pinned when CUDA exists (``pin="auto"``); plain memory otherwise, since pinning raises without
CUDA. Pinning page-locks an ordinary allocation of exactly the pool's bytes (``cudaHostRegister``):
torch's pinned allocator would round a 150 GiB pool up to 256 GiB. The size is checked against
host memory before allocating (per rank against what is available; every rank of the node
together against the node's memory: ``hicache.preflight.check_node_memory``, which the service
runs), and the memory is faulted in
(zero-filled) at creation, on transparent huge pages (Linux).
"""

from __future__ import annotations

import ctypes
import math
import warnings
import weakref

import psutil
import torch

from hicache.checks import check_int
from hicache.config import L2Section, choices, default
from hicache.errors import HostMemoryError, UsageError
from hicache.l1.pool import advise_hugepages, check_shape_args, format_row_layout
from hicache.layout import DCPLayout
from hicache.page_format import FormatSized, PageFormat

# the policy file's choices and defaults (hicache.config is their one home)
LAYOUTS: tuple[str, ...] = choices(L2Section, "layout")
PIN_MODES: tuple[str, ...] = choices(L2Section, "pin")
DEFAULT_LAYOUT: str = default(L2Section, "layout")
DEFAULT_PIN: str = default(L2Section, "pin")


def host_pages_for(l1_pages: int, bytes_per_page: int, size_bytes: int = 0,
                   ratio: float = default(L2Section, "ratio")) -> int:
    """L2 page count: ``size_bytes // bytes_per_page`` when ``size_bytes > 0``, else
    ``floor(l1_pages * ratio)``. ``bytes_per_page`` is this rank's bytes for one widened page."""
    if bytes_per_page <= 0:
        raise UsageError(f"bytes_per_page must be > 0, got {bytes_per_page}")
    if size_bytes < 0:
        raise UsageError(f"l2 size_bytes must be >= 0, got {size_bytes}")
    if size_bytes > 0:
        pages = size_bytes // bytes_per_page
        if pages < 1:
            raise UsageError(f"l2 size_bytes {size_bytes} is smaller than one page "
                             f"({bytes_per_page} bytes per rank)")
        return int(pages)
    if not ratio > 0 or math.isinf(ratio):
        raise UsageError(f"l2 ratio must be a positive finite number, got {ratio}")
    return int(math.floor(l1_pages * ratio))


def check_host_memory(nbytes: int, max_fraction: float = 0.9) -> None:
    """Raise ``HostMemoryError`` when ``nbytes`` exceeds ``max_fraction`` of available memory."""
    avail = psutil.virtual_memory().available
    if nbytes > avail * max_fraction:
        raise HostMemoryError(
            f"host KV pool needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) but only {avail} bytes "
            f"({avail / 2**30:.2f} GiB) of host memory are available (limit {max_fraction:.0%}); "
            "lower l2.size_bytes or l2.ratio")


_CUDA_SUCCESS = 0
_REGISTER_PORTABLE_MAPPED = 1 | 2  # every context, and a device address (the Triton copy path)


def _cudart():
    """torch's CUDA runtime binding, or libcudart through ctypes when it lacks host register."""
    rt = torch.cuda.cudart()
    if hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister"):
        return (lambda p, n: int(rt.cudaHostRegister(p, n, _REGISTER_PORTABLE_MAPPED)),
                lambda p: int(rt.cudaHostUnregister(p)))
    for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise OSError("neither torch.cuda.cudart() nor libcudart offer cudaHostRegister")
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    return (lambda p, n: int(lib.cudaHostRegister(p, n, _REGISTER_PORTABLE_MAPPED)),
            lambda p: int(lib.cudaHostUnregister(p)))


def pinned_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zero-filled CPU tensor of exactly ``shape`` (no rounding), page-locked in place when
    ``pin`` (unregistered again when the tensor is freed). Raises OSError when CUDA refuses."""
    t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t)
    t.zero_()  # faulted in now, not on the first transfer
    nbytes = t.numel() * t.element_size()
    if not pin or nbytes == 0:
        return t
    register, unregister = _cudart()
    err = register(t.data_ptr(), nbytes)
    if err != _CUDA_SUCCESS:
        raise OSError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err} "
                      "(locked-memory limit? see ulimit -l)")
    weakref.finalize(t, unregister, t.data_ptr())
    return t


def resolve_pin(pin: str) -> bool:
    if pin not in PIN_MODES:
        raise UsageError(f"pin must be one of {PIN_MODES}, got {pin!r}")
    if pin == "on" and not torch.cuda.is_available():
        raise UsageError("pin='on' needs CUDA (pinned host memory cannot be allocated without it); "
                         "use pin='auto' or 'off'")
    return pin == "on" or (pin == "auto" and torch.cuda.is_available())


class HostKVPool(FormatSized):
    """Per-rank L2 storage of ``num_pages`` widened pages of one ``PageFormat``.

    ``HostKVPool(layout, num_layers, kv_dim, dtype, num_pages, ...)`` holds the target KV (a
    striped format made from those numbers); ``HostKVPool.for_format(layout, fmt, ...)`` holds
    any format (e.g. the target KV kept in a wider dtype). Every size is the format's."""

    def __init__(self, layout: DCPLayout, num_layers: int, kv_dim: int, dtype: torch.dtype,
                 num_pages: int, layout_kind: str = DEFAULT_LAYOUT, pin: str = DEFAULT_PIN,
                 max_memory_fraction: float = 0.9) -> None:
        if not isinstance(layout, DCPLayout):
            raise UsageError(f"layout must be a DCPLayout, got {type(layout).__name__}")
        check_shape_args(num_layers, kv_dim, num_pages, dtype)
        fmt = PageFormat.striped_kv(num_layers, layout.page_size, kv_dim, dtype)
        self._setup(layout, fmt, num_pages, layout_kind, pin, max_memory_fraction)

    @classmethod
    def for_format(cls, layout: DCPLayout, fmt: PageFormat, num_pages: int,
                   layout_kind: str = DEFAULT_LAYOUT, pin: str = DEFAULT_PIN,
                   max_memory_fraction: float = 0.9) -> "HostKVPool":
        pool = cls.__new__(cls)
        pool._setup(layout, fmt, num_pages, layout_kind, pin, max_memory_fraction)
        return pool

    def _setup(self, layout: DCPLayout, fmt: PageFormat, num_pages: int, layout_kind: str,
               pin: str, max_memory_fraction: float) -> None:
        format_row_layout(layout, fmt)  # the format's rows fit the layout
        check_int(num_pages, "num_pages", 0, error=UsageError)
        if layout_kind not in LAYOUTS:
            raise UsageError(f"layout_kind must be one of {LAYOUTS}, got {layout_kind!r}")
        self.layout = layout
        self.format = fmt
        self.num_pages = num_pages
        self.layout_kind = layout_kind
        self.pinned = resolve_pin(pin)
        shape = fmt.pool_shape(num_pages, page_major=layout_kind == "page_first")
        check_host_memory(fmt.pool_bytes(num_pages), max_memory_fraction)
        try:  # exactly the policy's bytes, page-locked in place
            self.buf = pinned_host_tensor(shape, fmt.dtype, self.pinned)
        except OSError as e:
            if pin == "on":
                raise HostMemoryError(f"cannot pin the host KV pool: {e}") from None
            warnings.warn(f"host KV pool left unpinned (slower copies): {e}", RuntimeWarning)
            self.pinned = False
            self.buf = pinned_host_tensor(shape, fmt.dtype, False)

    # ---- sizes (the format's: FormatSized; the buffer's device) ---------------------------------
    @property
    def device(self) -> torch.device:
        return self.buf.device

    # ---- views ---------------------------------------------------------------------------------
    def layer_pages(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` as [num_pages, P, D] (contiguous for layer_first, page-strided for
        page_first)."""
        self._check_layer(layer)
        if self.layout_kind == "layer_first":
            return self.buf[layer].view(self.num_pages, self.rows_per_page, self.kv_dim)
        return self.buf[:, layer]

    def page_view(self, page: int) -> torch.Tensor:
        """One page's rows for all layers, [L, P, D], a view (contiguous only for page_first)."""
        self._check_page(page)
        if self.layout_kind == "page_first":
            return self.buf[page]
        P = self.rows_per_page
        return self.buf[:, page * P:(page + 1) * P]

    def read_page(self, page: int) -> torch.Tensor:
        """A contiguous copy of one page, [L, P, D] (layer-major)."""
        return self.page_view(page).clone(memory_format=torch.contiguous_format)

    def write_page(self, page: int, rows: torch.Tensor) -> None:
        """Overwrite one page from ``rows`` [L, P, D] of the pool's dtype."""
        expect = list(self.format.shape)
        if not isinstance(rows, torch.Tensor):
            raise UsageError(f"page rows must be a tensor, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise UsageError(f"page rows have dtype {rows.dtype} but the pool stores {self.dtype}")
        if list(rows.shape) != expect:
            raise UsageError(f"page rows must have shape {expect}, got {list(rows.shape)}")
        self.page_view(page).copy_(rows)

    def read_page_bytes(self, page: int) -> bytes:
        """One page as raw bytes (layer-major [L, P, D]); ``bytes_per_page`` long."""
        t = self.page_view(page).contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()

    def write_page_bytes(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page from raw bytes produced by ``read_page_bytes``."""
        if len(data) != self.bytes_per_page:
            raise UsageError(f"page data has {len(data)} bytes, expected {self.bytes_per_page}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = raw.view(self.dtype).view(self.format.shape)
        self.page_view(page).copy_(rows)

    # ---- validation ----------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise UsageError(f"layer {layer!r} is outside [0, {self.num_layers})")

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise UsageError(f"host page id {page!r} is outside the pool [0, {self.num_pages})")

    def __repr__(self) -> str:
        return (f"HostKVPool({self.format.name}, {self.layout_kind}, layers={self.num_layers}, "
                f"pages={self.num_pages}, rows/page={self.rows_per_page}, kv_dim={self.kv_dim}, "
                f"dtype={self.dtype}, pinned={self.pinned})")
