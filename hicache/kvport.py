"""The KV port: what an engine needs from the KV cache of its rank, and nothing more.

An engine (``hicache.engine.runner.DCPRunner``, PCP prefill, an adapter) holds a ``KVPort``, never
a pool or the cache itself. The port gives the striping ``layout``, the KV shape
(``num_layers``, ``kv_dim``), where it lives (``device``, ``dtype``), a layer's rows to attend
over (``layer_view``), and two writes (``plan_write(slots)`` makes the second from the first):

- ``write(layer, slots, rows)``: full rows [n, kv_dim] for virtual ``slots`` [n] (host ints or a
  CPU tensor, any order); the rank keeps the rows it owns. Validated on the host.
- ``write(layer, RowWrite, rows)``: the engine's hot path. A ``RowWrite`` says which input rows
  this rank keeps (``src``) and at which pool rows (``dst``), both index tensors on the port's
  device, built once per step (the runner computes them on the host and uploads the batch's in
  one copy; ``RowWrite.for_positions`` is the same by device arithmetic) and reused for every
  layer; its ``pages`` are read-only, so a check of them holds for every layer. The copy
  is one ``index_select`` + ``index_copy_``: no boolean mask, no ``.item()``, no data-dependent
  shape, so the GPU is never synchronised by a KV write.

Two ports exist: ``DeviceKVPool`` (the bare L1 pool: an engine run without a cache) and
``HiCache.kv`` (``CheckedPort``: the same pool, but a write is refused unless every page it
touches was given to an admitted request by ``alloc``; the refusal is decided on the host from
``RowWrite.pages``, so it costs no sync either).

This module imports no tier, controller or service (``tests/test_layering.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

from hicache.errors import UsageError
from hicache.layout import DCPLayout

Slots = Union[torch.Tensor, Sequence[int]]


def frozen_ids(a: np.ndarray) -> np.ndarray:
    """``a`` (an array the caller just made, owning its data), made read-only: a
    ``RowWrite``'s pages."""
    a.flags.writeable = False
    return a


def checked_once(pages: np.ndarray) -> bool:
    """Whether ``pages`` cannot change once checked: a read-only array owning its data (a
    ``RowWrite``'s, made here). A check of it may then be remembered by identity, as long as
    what it was checked against did not change."""
    return not pages.flags.writeable and pages.base is None


def span_slots(pages: np.ndarray, start: int, end: int, page_tokens: int) -> np.ndarray:
    """Virtual slots (read-only int64 [end - start]) of positions [start, end) of a request
    whose widened pages from page ``start // page_tokens`` on are ``pages``."""
    w = page_tokens
    pos = np.arange(start, end, dtype=np.int64)
    return frozen_ids(np.asarray(pages, dtype=np.int64)[pos // w - start // w] * w + pos % w)


def check_ties(layout: DCPLayout, w: "RowWrite") -> None:
    """UsageError unless ``w`` writes where it says: its ``slots`` are ``n`` slots in its
    ``pages``, and its ``src``/``dst`` are exactly this rank's rows of them (compared where
    ``dst`` lives on the CPU; on an accelerator that would cost a sync per write, and the
    constructors above derive ``dst`` from the same host arithmetic)."""
    slots = w.slots
    if not isinstance(slots, np.ndarray) or slots.shape != (w.n,):
        raise UsageError(f"RowWrite.slots must be a host int64 array of its n = {w.n} slots")
    if slots.size and not np.isin(slots // layout.page_tokens, w.pages).all():
        bad = slots[~np.isin(slots // layout.page_tokens, w.pages)][0]
        raise UsageError(f"RowWrite slot {int(bad)} lies in page "
                         f"{int(bad) // layout.page_tokens}, which is not among its pages")
    if w.dst.device.type != "cpu":
        return
    if layout.dcp_size == 1 and w.src is None:
        src, kept = None, slots
    else:
        src = np.flatnonzero(layout.owner(slots) == layout.rank)
        kept = slots[src]
    dst = w.dst.numpy()
    ok = dst.shape == kept.shape and np.array_equal(dst, layout.physical(kept))
    if ok and src is not None:
        ok = w.src is not None and np.array_equal(w.src.cpu().numpy(), src)
    if not ok:
        raise UsageError("RowWrite.dst (or src) is not this rank's rows of its slots: a write "
                         "lands only in the pages it names (build it with RowWrite.for_slots "
                         "or for_positions)")


@dataclass(frozen=True)
class RowWrite:
    """Where the rows of one write land on this rank.

    n:     rows the write takes (rows [n, kv_dim], one per slot / new token)
    src:   int64 [m] on the port's device: the input rows this rank keeps (None: all n, in order)
    dst:   int64 [m] on the port's device: their rows in the pool
    pages: int64 [k] host array: the widened pages written (what a checked port verifies);
           read-only in the writes the constructors below make, so a check of one write
           holds for every layer it is reused for (see ``checked_once``)
    slots: int64 [n] host array: the virtual slot of each of the n input rows (read-only). A
           checked port ties the rest to it once per write (``check_ties``): every slot in
           ``pages``, and ``src``/``dst`` exactly this rank's rows of them; it records the
           slots a write of the last layer filled (``CheckedPort.unwritten``)
    """

    n: int
    src: torch.Tensor | None
    dst: torch.Tensor
    pages: np.ndarray
    slots: np.ndarray

    @staticmethod
    def for_slots(layout: DCPLayout, slots: torch.Tensor, device: torch.device) -> "RowWrite":
        """From validated virtual slots int64 [n] on the CPU (ownership decided on the host)."""
        n = int(slots.numel())
        pages = frozen_ids(np.unique((slots // layout.page_tokens).numpy()))
        if layout.dcp_size == 1:
            src, kept = None, slots
        else:
            src = torch.nonzero(layout.owned_mask(slots)).reshape(-1)  # host tensor: no sync
            kept = slots[src]
            src = src.to(device, non_blocking=True)
        dst = layout.physical(kept).to(device, non_blocking=True)
        return RowWrite(n, src, dst, pages, frozen_ids(slots.numpy().astype(np.int64)))

    @staticmethod
    def for_positions(layout: DCPLayout, table: torch.Tensor, pages: Sequence[int],
                      start: int, end: int, base: int = 0) -> "RowWrite":
        """The new tokens at positions [start, end) of one request, whose rows are input rows
        ``base .. base + end - start - 1``. ``table`` is the request's page table on the device
        (int64 [>= pages needed]); ``pages`` the same ids on the host. Everything on the device
        comes from ``arange`` and arithmetic on host-known bounds: nothing reads device data
        back."""
        w = layout.page_tokens
        pos = layout.owned_positions(start, end, device=table.device)  # [m]
        dst = layout.physical(layout.slot_of(table, pos))
        src = pos - (start - base)
        touched = frozen_ids(np.array(pages[start // w: -(-end // w)], dtype=np.int64))
        return RowWrite(end - start, src, dst, touched, span_slots(touched, start, end, w))

    @staticmethod
    def concat(parts: Sequence["RowWrite"]) -> "RowWrite":
        """One write for several requests' rows laid out one after another (each part's
        ``src`` already offset by its ``base``)."""
        if len(parts) == 1:
            return parts[0]
        return RowWrite(sum(p.n for p in parts), torch.cat([p.src for p in parts]),
                        torch.cat([p.dst for p in parts]),
                        frozen_ids(np.concatenate([p.pages for p in parts])),
                        frozen_ids(np.concatenate([p.slots for p in parts])))


@runtime_checkable
class KVPort(Protocol):
    """The engine's view of its rank's KV cache (see the module docstring)."""

    layout: DCPLayout
    num_layers: int
    kv_dim: int
    device: torch.device
    dtype: torch.dtype

    def plan_write(self, slots: Slots) -> RowWrite:
        """Validate virtual slots [n] on the host; where this rank's rows among them go."""

    def write(self, layer: int, where: Union[RowWrite, Slots], rows: torch.Tensor) -> int:
        """Store this rank's rows among ``rows`` [n, kv_dim]; the number stored."""

    def check_pages(self, pages: np.ndarray) -> None:
        """Raise (one line) unless a write may touch every widened page in ``pages`` (host
        int64): what ``write`` checks, for callers that must refuse on every rank alike."""

    def layer_view(self, layer: int) -> torch.Tensor:
        """One layer's rows [pool rows, kv_dim] (a view; attention reads it)."""


def _version(t) -> int:
    """The in-place version counter of an index tensor (-1 for None)."""
    return -1 if t is None else t._version


class CheckedPort:
    """A port onto ``pool`` whose writes first pass ``check(pages)`` (host int64 array of the
    widened pages a write touches), which raises to refuse the whole write."""

    def __init__(self, pool, check: Callable[[np.ndarray], None]) -> None:
        self._pool = pool
        self._check = check
        self.layout = pool.layout
        self.num_layers = pool.num_layers
        self.kv_dim = pool.kv_dim
        self.device = pool.device
        self.dtype = pool.dtype
        # how many leading layers of each virtual slot hold written rows (a write of layer l
        # counts only after layers 0..l-1; layer 0 starts a row afresh): a slot is written
        # once it reaches num_layers. The same on every rank (every rank gets the same slots)
        self._layers = np.zeros(pool.num_pages * self.layout.page_tokens, dtype=np.int32)
        # the last write whose slots/dst were checked, with its index tensors' versions then
        # (an in-place edit of dst or src bumps them: the write is checked again where used)
        self._tied: tuple | None = None

    def plan_write(self, slots: Slots) -> RowWrite:
        return self._pool.plan_write(slots)

    def write(self, layer: int, where: Union[RowWrite, Slots], rows: torch.Tensor) -> int:
        if not isinstance(where, RowWrite):
            where = self._pool.plan_write(where)
        self.check_pages(where.pages)
        stamp = (where, _version(where.dst), _version(where.src))
        tied = self._tied
        if tied is None or tied[0] is not where or tied[1:] != stamp[1:]:
            check_ties(self.layout, where)
            if checked_once(where.pages) and checked_once(where.slots):
                self._tied = stamp
        stored = self._pool.write(layer, where, rows)
        if isinstance(layer, int) and 0 <= layer < self.num_layers:
            cur = self._layers[where.slots]
            self._layers[where.slots] = np.where(cur >= layer, layer + 1, cur)
        return stored

    # ---- what was written (the service refuses to cache anything else) ------------------------
    def forget(self, pages) -> None:
        """Pages handed out afresh hold no written row."""
        w = self.layout.page_tokens
        self._layers.reshape(-1, w)[np.asarray(pages, dtype=np.int64)] = 0

    def fill(self, pages) -> None:
        """Whole pages whose rows were put there by the cache (a restore)."""
        w = self.layout.page_tokens
        self._layers.reshape(-1, w)[np.asarray(pages, dtype=np.int64)] = self.num_layers

    def unwritten(self, slots: np.ndarray) -> int:
        """The index of the first of ``slots`` no write of every layer filled, or -1."""
        miss = np.flatnonzero(self._layers[slots] < self.num_layers)
        return int(miss[0]) if miss.size else -1

    @property
    def rows_per_page(self) -> int:
        return self._pool.rows_per_page

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def check_pages(self, pages: np.ndarray) -> None:
        self._pool.check_pages(pages)  # in the pool first: the port's check indexes by page
        self._check(pages)

    def layer_view(self, layer: int) -> torch.Tensor:
        return self._pool.layer_view(layer)

    def __repr__(self) -> str:
        return f"CheckedPort({self._pool!r})"


__all__ = ["CheckedPort", "KVPort", "RowWrite", "Slots", "check_ties", "checked_once",
           "frozen_ids", "span_slots"]
