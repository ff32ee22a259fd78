"""L1: the per-rank device KV pool (MLA latent rows, owned rows only).

One tensor ``kv`` [num_layers, num_pages * P, kv_dim] on CUDA when available, else CPU. The
caller addresses it with *virtual* slots of the widened page space (``P * c`` slots per page);
the pool keeps only the slots this rank owns, at ``layout.physical(slot)``. Memory is faulted in
at creation (``zeroed``), on transparent huge pages when it lives on the CPU (Linux).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Union

import numpy as np
import torch

from hicache.checks import check_int
from hicache.errors import UsageError
from hicache.kvport import RowWrite, Slots, checked_once
from hicache.layout import DCPLayout
from hicache.page_format import FormatSized, PageFormat, PageKind


def pick_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


_MADV_HUGEPAGE = 14  # Linux
_HUGE = 2 << 20
_libc = None


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask Linux to back a fresh (untouched) CPU tensor with transparent huge pages.

    Fewer TLB misses when copying scattered page-layer blocks. Call before the first touch; a
    no-op (False) off Linux, for small, CUDA or pinned tensors, or when madvise refuses.
    """
    global _libc
    nbytes = t.numel() * t.element_size()
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or nbytes < 2 * _HUGE \
            or t.is_pinned():
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = -(-t.data_ptr() // _HUGE) * _HUGE
        end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
        return end > start and _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           pin_memory: bool = False) -> torch.Tensor:
    """A zero-filled tensor whose memory is faulted in now (huge pages on CPU when possible)."""
    t = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    advise_hugepages(t)
    return t.zero_()


def format_row_layout(layout: DCPLayout, fmt: PageFormat) -> DCPLayout | None:
    """Where the virtual slots of a page live in a pool of ``fmt``: ``layout`` for striped
    rows, one owner of ``P*c`` rows for replicated rows, None for a state (no slots). UsageError
    when the format's rows do not fit the layout."""
    if not isinstance(layout, DCPLayout):
        raise UsageError(f"layout must be a DCPLayout, got {type(layout).__name__}")
    if not isinstance(fmt, PageFormat):
        raise UsageError(f"format must be a PageFormat, got {type(fmt).__name__}")
    if fmt.kind is PageKind.STATE:
        return None
    want = layout.page_size if fmt.striped else layout.page_tokens
    if fmt.rows != want:
        raise UsageError(f"page format {fmt.name!r} ({fmt.kind.value}) has {fmt.rows} rows a "
                         f"page but the layout (P={layout.page_size}, dcp={layout.dcp_size}) "
                         f"gives it {want}")
    return layout if fmt.striped else DCPLayout(1, 0, want, 1)


def check_shape_args(num_layers: int, kv_dim: int, num_pages: int, dtype: torch.dtype) -> None:
    for name, v in (("num_layers", num_layers), ("kv_dim", kv_dim)):
        check_int(v, name, error=UsageError)
    check_int(num_pages, "num_pages", 0, error=UsageError)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"dtype must be a torch.dtype, got {dtype!r}")


class DeviceKVPool(FormatSized):
    """Per-rank L1 storage for ``num_pages`` widened pages of one ``PageFormat``.

    ``DeviceKVPool(layout, num_layers, kv_dim, dtype, num_pages)`` holds the target KV (a
    striped format made from those numbers); ``DeviceKVPool.for_format(layout, fmt, ...)``
    holds any format. Every size is the format's."""

    def __init__(self, layout: DCPLayout, num_layers: int, kv_dim: int, dtype: torch.dtype,
                 num_pages: int, device: torch.device | str | None = None) -> None:
        if not isinstance(layout, DCPLayout):
            raise UsageError(f"layout must be a DCPLayout, got {type(layout).__name__}")
        check_shape_args(num_layers, kv_dim, num_pages, dtype)
        self._setup(layout, PageFormat.striped_kv(num_layers, layout.page_size, kv_dim, dtype),
                    num_pages, device)

    @classmethod
    def for_format(cls, layout: DCPLayout, fmt: PageFormat, num_pages: int,
                   device: torch.device | str | None = None) -> "DeviceKVPool":
        pool = cls.__new__(cls)
        pool._setup(layout, fmt, num_pages, device)
        return pool

    def _setup(self, layout: DCPLayout, fmt: PageFormat, num_pages: int,
               device: torch.device | str | None) -> None:
        check_int(num_pages, "num_pages", 0, error=UsageError)
        self.layout = layout
        self.format = fmt
        # where a virtual slot's row lives: the DCP layout for striped rows; every row on every
        # rank (one owner, P*c rows a page) for replicated ones
        self.row_layout = format_row_layout(layout, fmt)
        self.num_pages = num_pages
        self._in_range: np.ndarray | None = None  # the last unchangeable pages found in range
        self.device = pick_device(device)
        # [L, num_pages * rows, width]; every byte is written now, so the memory is faulted in.
        self.kv = zeroed(fmt.pool_shape(num_pages), fmt.dtype, self.device)

    # ---- sizes (the format's: FormatSized; rows and slots) -------------------------------------
    @property
    def num_rows(self) -> int:
        return self.num_pages * self.format.rows

    @property
    def num_slots(self) -> int:
        """Virtual slots addressable: ``num_pages * P * c``."""
        return self.num_pages * self.layout.page_tokens

    def layer_view(self, layer: int) -> torch.Tensor:
        """The rows of one layer: [num_pages * P, kv_dim] (a view)."""
        self._check_layer(layer)
        return self.kv[layer]

    # ---- access by virtual slot (the KV port, ``hicache.kvport``) -----------------------------
    def plan_write(self, virtual_slots: Slots) -> RowWrite:
        """Validate virtual slots [n] on the host and say where this rank's rows among them go."""
        return RowWrite.for_slots(self._rows(), self._slots(virtual_slots), self.device)

    def write(self, layer: int, where: Union[RowWrite, Slots], rows: torch.Tensor) -> int:
        """Store the owned rows among ``rows`` [n, kv_dim] (full rows for the slots of
        ``where``: virtual slots [n], or a ``RowWrite`` built once for many layers).

        Returns the number of rows this rank stored. One ``index_copy_`` (after an
        ``index_select`` when this rank keeps a subset): no host sync on the device.
        """
        self._check_layer(layer)
        if not isinstance(where, RowWrite):
            where = self.plan_write(where)
        else:
            self.check_pages(where.pages)
        if not isinstance(rows, torch.Tensor):
            raise UsageError(f"rows must be a tensor, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise UsageError(f"rows have dtype {rows.dtype} but the pool stores {self.dtype}")
        if rows.dim() != 2 or rows.shape[0] != where.n or rows.shape[1] != self.kv_dim:
            raise UsageError(f"rows must have shape [{where.n}, {self.kv_dim}] "
                             f"(one row per slot), got {list(rows.shape)}")
        src = rows.to(self.device, non_blocking=True)
        if where.src is not None:
            src = src.index_select(0, where.src)
        self.kv[layer].index_copy_(0, where.dst, src)
        return int(where.dst.shape[0])

    def read(self, layer: int, virtual_slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
        """The owned slots among ``virtual_slots`` (input order) and their rows [m, kv_dim]."""
        self._check_layer(layer)
        owned, phys = self._rows().local_rows(self._slots(virtual_slots))
        return owned, self.kv[layer].index_select(0, phys.to(self.device))

    # ---- validation ----------------------------------------------------------------------------
    def check_pages(self, pages: np.ndarray) -> None:
        """UsageError unless every widened page id in ``pages`` (host int array) is in the pool.
        A write's pages reused for every layer are checked once (``checked_once``)."""
        if pages is self._in_range:
            return
        if pages.size and not 0 <= pages.min() <= pages.max() < self.num_pages:
            bad = pages[(pages < 0) | (pages >= self.num_pages)][0]
            raise UsageError(f"page {int(bad)} is outside the pool's [0, {self.num_pages})")
        if checked_once(pages):
            self._in_range = pages

    def _rows(self) -> DCPLayout:
        if self.row_layout is None:
            raise UsageError(f"page format {self.format.name!r} is a state snapshot: it has "
                             "no token slots to address")
        return self.row_layout

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) \
                or not 0 <= layer < self.num_layers:
            raise UsageError(f"layer {layer!r} is outside [0, {self.num_layers})")

    def _slots(self, virtual_slots: Slots) -> torch.Tensor:
        slots = torch.as_tensor(virtual_slots)
        if slots.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
        if slots.dtype.is_floating_point or slots.dtype == torch.bool:
            raise UsageError(f"virtual slots must be integers, got dtype {slots.dtype}")
        slots = slots.to(torch.int64).reshape(-1)
        if slots.device.type != "cpu":
            slots = slots.cpu()
        if slots.numel():
            lo, hi = int(slots.min()), int(slots.max())
            if lo < 0 or hi >= self.num_slots:
                bad = lo if lo < 0 else hi
                raise UsageError(f"virtual slot {bad} is outside [0, {self.num_slots}) "
                                 f"({self.num_pages} pages of "
                                 f"{self.layout.page_tokens} slots)")
        return slots

    def __repr__(self) -> str:
        return (f"DeviceKVPool({self.format.name}, layers={self.num_layers}, "
                f"pages={self.num_pages}, "
                f"rows/page={self.rows_per_page}, kv_dim={self.kv_dim}, dtype={self.dtype}, "
                f"device={self.device}, dcp={self.layout.dcp_size}, rank={self.layout.rank})")
