"""L2: the per-rank host KV pool, same widened page ids as L1, this rank's P rows per page.

Two layouts:
- ``layer_first``: ``buf`` [L, num_pages * P, D], mirrors L1 (one slice per layer and page run).
- ``page_first``: ``buf`` [num_pages, L, P, D], one page contiguous across layers (one copy per
  page to and from L3).

Pinned when CUDA exists (``pin="auto"``); plain memory otherwise, since pinning raises without
CUDA. The size is checked against available host memory (psutil) before allocating, and the
memory is faulted in (zero-filled) at creation, on transparent huge pages when unpinned (Linux).
"""

from __future__ import annotations

import math

import psutil
import torch

from hicache.l1.allocator import PageError
from hicache.l1.pool import PoolError, check_shape_args, zeroed
from hicache.layout import DCPLayout

LAYOUTS = ("layer_first", "page_first")
PIN_MODES = ("auto", "on", "off")


class HostMemoryError(MemoryError):
    """The host pool would not fit in available host memory."""


def host_pages_for(l1_pages: int, bytes_per_page: int, size_bytes: int = 0,
                   ratio: float = 2.0) -> int:
    """L2 page count: ``size_bytes // bytes_per_page`` when ``size_bytes > 0``, else
    ``floor(l1_pages * ratio)``. ``bytes_per_page`` is this rank's bytes for one widened page."""
    if bytes_per_page <= 0:
        raise PoolError(f"bytes_per_page must be > 0, got {bytes_per_page}")
    if size_bytes < 0:
        raise PoolError(f"l2 size_bytes must be >= 0, got {size_bytes}")
    if size_bytes > 0:
        pages = size_bytes // bytes_per_page
        if pages < 1:
            raise PoolError(f"l2 size_bytes {size_bytes} is smaller than one page "
                            f"({bytes_per_page} bytes per rank)")
        return int(pages)
    if not ratio > 0 or math.isinf(ratio):
        raise PoolError(f"l2 ratio must be a positive finite number, got {ratio}")
    return int(math.floor(l1_pages * ratio))


def check_host_memory(nbytes: int, max_fraction: float = 0.9) -> None:
    """Raise ``HostMemoryError`` when ``nbytes`` exceeds ``max_fraction`` of available memory."""
    avail = psutil.virtual_memory().available
    if nbytes > avail * max_fraction:
        raise HostMemoryError(
            f"host KV pool needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) but only {avail} bytes "
            f"({avail / 2**30:.2f} GiB) of host memory are available (limit {max_fraction:.0%}); "
            "lower l2.size_bytes or l2.ratio")


def resolve_pin(pin: str) -> bool:
    if pin not in PIN_MODES:
        raise PoolError(f"pin must be one of {PIN_MODES}, got {pin!r}")
    if pin == "on" and not torch.cuda.is_available():
        raise PoolError("pin='on' needs CUDA (pinned host memory cannot be allocated without it); "
                        "use pin='auto' or 'off'")
    return pin == "on" or (pin == "auto" and torch.cuda.is_available())


class HostKVPool:
    """Per-rank L2 storage of ``num_pages`` widened pages."""

    def __init__(self, layout: DCPLayout, num_layers: int, kv_dim: int, dtype: torch.dtype,
                 num_pages: int, layout_kind: str = "page_first", pin: str = "auto",
                 max_memory_fraction: float = 0.9) -> None:
        if not isinstance(layout, DCPLayout):
            raise PoolError(f"layout must be a DCPLayout, got {type(layout).__name__}")
        check_shape_args(num_layers, kv_dim, num_pages, dtype)
        if layout_kind not in LAYOUTS:
            raise PoolError(f"layout_kind must be one of {LAYOUTS}, got {layout_kind!r}")
        self.layout = layout
        self.num_layers = num_layers
        self.kv_dim = kv_dim
        self.dtype = dtype
        self.num_pages = num_pages
        self.layout_kind = layout_kind
        self.pinned = resolve_pin(pin)
        P = layout.page_size
        shape = ((num_layers, num_pages * P, kv_dim) if layout_kind == "layer_first"
                 else (num_pages, num_layers, P, kv_dim))
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_host_memory(math.prod(shape) * itemsize, max_memory_fraction)
        # Faulted in now (zero-filled), not on the first transfer; huge pages when unpinned.
        self.buf = zeroed(shape, dtype, torch.device("cpu"), pin_memory=self.pinned)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def rows_per_page(self) -> int:
        return self.layout.page_size

    @property
    def bytes_per_page(self) -> int:
        return self.num_layers * self.rows_per_page * self.kv_dim * self.buf.element_size()

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

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
        expect = [self.num_layers, self.rows_per_page, self.kv_dim]
        if not isinstance(rows, torch.Tensor):
            raise PoolError(f"page rows must be a tensor, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise PoolError(f"page rows have dtype {rows.dtype} but the pool stores {self.dtype}")
        if list(rows.shape) != expect:
            raise PoolError(f"page rows must have shape {expect}, got {list(rows.shape)}")
        self.page_view(page).copy_(rows)

    def read_page_bytes(self, page: int) -> bytes:
        """One page as raw bytes (layer-major [L, P, D]); ``bytes_per_page`` long."""
        t = self.page_view(page).contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()

    def write_page_bytes(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page from raw bytes produced by ``read_page_bytes``."""
        if len(data) != self.bytes_per_page:
            raise PoolError(f"page data has {len(data)} bytes, expected {self.bytes_per_page}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = raw.view(self.dtype).view(self.num_layers, self.rows_per_page, self.kv_dim)
        self.page_view(page).copy_(rows)

    # ---- validation ----------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise PoolError(f"layer {layer!r} is outside [0, {self.num_layers})")

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise PageError(f"host page id {page!r} is outside the pool [0, {self.num_pages})")

    def __repr__(self) -> str:
        return (f"HostKVPool({self.layout_kind}, layers={self.num_layers}, "
                f"pages={self.num_pages}, rows/page={self.rows_per_page}, kv_dim={self.kv_dim}, "
                f"dtype={self.dtype}, pinned={self.pinned})")
