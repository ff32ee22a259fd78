"""Widened-page ids: the allocator shared by L1, L2 and the cache controller.

A neutral module: it imports no tier and no controller, so both sides use it without importing
each other (``tests/test_layering.py``). ``UsageError`` (a bad id) and ``DeviceFullError`` (too few
free pages) are the errors every user of page ids sees.


A LIFO free stack kept in a numpy array plus a numpy used-map: alloc/free cost a few Python
operations per call and vectorised work per page. Deterministic, so every rank running the same
control sequence hands out the same ids: a fresh pool hands out 0, 1, 2, ...; freed ids are
handed out again most recently freed call first, each call's ids in the order they were given.
``alloc`` and ``free`` are all-or-nothing: a bad request changes nothing and its error names the
offending id. Invariant: ``num_free + num_used == num_pages`` at all times.
``alloc_array``/``free_array`` skip the conversion between python ints and numpy for callers that
already hold int64 arrays. ``track_used=False`` keeps no per-page used map (for a caller whose
frees are all ``trusted``: only checked frees read the map): an allocation or a trusted free then
writes no per-page mark, and whatever reads the map (an untrusted free, ``used_ids``,
``is_allocated``) builds it from the free stack.
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Union

import numpy as np
import torch

from hicache.checks import check_int
from hicache.errors import DeviceFullError, UsageError
from hicache.ids import page_ids

__all__ = ["PageAllocator", "PageIds"]

PageIds = Union[Iterable[int], np.ndarray, torch.Tensor]


class PageAllocator:
    """Free list over page ids ``[0, num_pages)``; alloc/free are all-or-nothing."""

    def __init__(self, num_pages: int, *, track_used: bool = True) -> None:
        check_int(num_pages, "num_pages", 0, error=UsageError)
        self._n = num_pages
        # the free ids are _stack[_bot:], handed out from _bot on; a free puts its ids just
        # below _bot in their order (forward slices on both sides: no reversed copies)
        self._stack = np.arange(num_pages, dtype=np.int64)
        self._bot = 0
        self._track = track_used
        # [num_pages] True = allocated (None: not kept; _used_map builds it)
        self._used = np.zeros(num_pages, np.bool_) if track_used else None
        self._mark = np.zeros(num_pages, np.int64)  # scratch for duplicate detection
        self._iota = np.arange(0, dtype=np.int64)

    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return self._n - self._bot

    @property
    def num_used(self) -> int:
        return self._bot

    def is_allocated(self, page: int) -> bool:
        self._check_id(page)
        return bool(self._used_map()[page])

    def used_ids(self) -> np.ndarray:
        """The allocated ids, ascending, as an int64 array."""
        return np.flatnonzero(self._used_map())

    def _used_map(self) -> np.ndarray:
        """bool [num_pages], True = allocated: the kept map, or one built from the free stack."""
        if self._track:
            return self._used
        used = np.ones(self._n, np.bool_)
        used[self._stack[self._bot:]] = False
        return used

    def _check_id(self, page) -> None:
        if isinstance(page, (bool, np.bool_)):
            raise UsageError(f"page id {page!r} is not an int")
        try:
            page = operator.index(page)
        except TypeError:
            raise UsageError(f"page id {page!r} is not an int") from None
        if page < 0:
            raise UsageError(f"page id {page} is negative (outside the pool [0, {self._n}))")
        if page >= self._n:
            raise UsageError(f"page id {page} is outside the pool [0, {self._n})")

    # ---- alloc -------------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """``n`` free page ids; raises ``DeviceFullError`` and allocates nothing when fewer
        than ``n`` are free."""
        return self.alloc_array(n).tolist()

    def alloc_array(self, n: int) -> np.ndarray:
        """``n`` free page ids as a fresh int64 array [n] (see ``alloc``)."""
        if type(n) is not int or n < 0:
            check_int(n, "number of pages to allocate", 0, error=UsageError)
        b = self._bot
        if n > self._n - b:
            raise DeviceFullError(n, self._n - b, self._n)
        out = self._stack[b:b + n].copy()
        self._bot = b + n
        if self._track:
            self._used[out] = True
        return out

    # ---- vectorised checks -------------------------------------------------------------------
    def iota(self, k: int) -> np.ndarray:
        """``arange(k)`` (int64), cached."""
        if len(self._iota) < k:
            self._iota = np.arange(max(k, 2 * len(self._iota)), dtype=np.int64)
        return self._iota[:k]

    def has_duplicates(self, idx: np.ndarray) -> bool:
        """Whether the in-range ids ``idx`` [k] repeat one (vectorised: no sort, no set)."""
        k = len(idx)
        if k < 2:
            return False
        if k <= 32:
            return len(set(idx.tolist())) != k
        iota = self.iota(k)
        self._mark[idx] = iota
        return bool((self._mark[idx] != iota).any())

    def in_range(self, idx: np.ndarray) -> bool:
        """Whether every id of ``idx`` [k] lies in ``[0, num_pages)``."""
        return not len(idx) or (int(idx.min()) >= 0 and int(idx.max()) < self._n)

    def allocated(self, idx: np.ndarray) -> bool:
        """Whether every id of ``idx`` [k] is in the pool and allocated."""
        if not len(idx):
            return True
        try:
            return int(idx.min()) >= 0 and bool(self._used_map()[idx].all())
        except IndexError:
            return False

    # ---- free --------------------------------------------------------------------------------
    def free(self, ids: PageIds) -> None:
        """Return pages to the pool. Every id is checked first; on any bad id nothing is freed
        and the error names it (a bool is not a page id)."""
        self.free_array(page_ids(ids))

    def free_array(self, idx: np.ndarray, *, trusted: bool = False) -> None:
        """Return the int64 ids ``idx`` [k] to the pool (see ``free``). ``trusted``: the
        caller guarantees distinct allocated ids, so the checks are skipped."""
        k = len(idx)
        if not k:
            return
        if not trusted:
            self._check_free(idx)
        if self._track:
            self._used[idx] = False
        b = self._bot - k
        self._stack[b:b + k] = idx
        self._bot = b

    def _check_free(self, idx: np.ndarray) -> None:
        if not self.in_range(idx):
            bad = idx[(idx < 0) | (idx >= self._n)]
            self._check_id(int(bad[0]))
        used = self._used_map()[idx]
        if not used.all():
            bad = int(idx[int(np.argmin(used))])
            raise UsageError(f"page id {bad} is not allocated (double free or foreign id)")
        if self.has_duplicates(idx):
            raise UsageError(f"page id {_first_repeat(idx)} appears twice in one free() call")

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._n}, used={self.num_used})"


def _first_repeat(idx: np.ndarray) -> Optional[int]:
    seen: set[int] = set()
    for p in idx.tolist():
        if p in seen:
            return p
        seen.add(p)
    return None
