"""Page id pool for the controller: the PageAllocator interface at C speed per page.

A LIFO free stack kept in a numpy array (deterministic: the same calls give the same ids on every
rank; a fresh pool hands out 0, 1, 2, ...) plus a numpy used-map, so alloc/free cost a few Python
operations per call and vectorised work per page. ``alloc_array``/``free_array`` skip the
conversion between python ints and numpy for callers that already hold int64 arrays.
"""

from __future__ import annotations

import array

import numpy as np

from hicache.l1.allocator import OutOfPagesError, PageError, as_id_list


def id_array(ids) -> np.ndarray:
    """Page ids (list of ints, int array or tensor) as a 1-D int64 array; PageError otherwise.

    A list is converted by ``array.array`` (a C loop that rejects floats, strings and None)."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids
    if type(ids) is list:
        try:
            return np.frombuffer(array.array("q", ids), np.int64)
        except (TypeError, ValueError, OverflowError):
            pass  # the slow path names the bad id
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu" and ids.ndim == 1:
        return ids.astype(np.int64)
    try:
        return np.array(as_id_list(ids), dtype=np.int64).reshape(-1)
    except OverflowError:
        raise PageError(f"page ids {ids!r} include one out of the int64 range") from None


class PagePool:
    """Free list over page ids ``[0, num_pages)``; alloc/free are all-or-nothing."""

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise PageError(f"num_pages must be an int >= 0, got {num_pages!r}")
        self._n = num_pages
        # stack: ids [0, _top) are free, the end is handed out first
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._used = np.zeros(num_pages, np.bool_)
        self._mark = np.zeros(num_pages, np.int64)  # scratch for duplicate detection
        self._iota = np.arange(0, dtype=np.int64)

    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self._n - self._top

    def is_allocated(self, page: int) -> bool:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self._n:
            raise PageError(f"page id {page!r} is outside the pool [0, {self._n})")
        return bool(self._used[page])

    def alloc(self, n: int) -> list[int]:
        return self.alloc_array(n).tolist()

    def alloc_array(self, n: int) -> np.ndarray:
        """``n`` free page ids as an int64 array [n]."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageError(f"number of pages to allocate must be an int >= 0, got {n!r}")
        top = self._top
        if n > top:
            raise OutOfPagesError(n, top, self._n)
        out = self._stack[top - n:top][::-1].copy()
        self._top = top - n
        self._used[out] = True
        return out

    def iota(self, k: int) -> np.ndarray:
        """``arange(k)`` (int64), cached."""
        if len(self._iota) < k:
            self._iota = np.arange(max(k, 2 * len(self._iota)), dtype=np.int64)
        return self._iota[:k]

    def has_duplicates(self, idx: np.ndarray) -> bool:
        """Whether the in-range ids ``idx`` repeat one (vectorised: no sort, no set)."""
        k = len(idx)
        if k < 2:
            return False
        if k <= 32:
            return len(set(idx.tolist())) != k
        iota = self.iota(k)
        self._mark[idx] = iota
        return bool((self._mark[idx] != iota).any())

    def in_range(self, idx: np.ndarray) -> bool:
        return not len(idx) or (int(idx.min()) >= 0 and int(idx.max()) < self._n)

    def allocated(self, idx: np.ndarray) -> bool:
        """Whether every id of ``idx`` [k] is in the pool and allocated."""
        if not len(idx):
            return True
        try:
            return int(idx.min()) >= 0 and bool(self._used[idx].all())
        except IndexError:
            return False

    def free(self, ids) -> None:
        self.free_array(id_array(ids), ids)

    def free_array(self, idx: np.ndarray, shown=None, *, trusted: bool = False) -> None:
        """Return the int64 ids ``idx`` [k] to the pool (``shown``: how errors name them).
        ``trusted``: the caller guarantees distinct allocated ids (skips the checks)."""
        k = len(idx)
        if not k:
            return
        if not trusted:
            if not self.in_range(idx):
                raise PageError(f"page ids {_show(idx, shown)} include one outside the pool "
                                f"[0, {self._n})")
            used = self._used[idx]
            if not used.all():
                bad = int(idx[int(np.argmin(used))])
                raise PageError(f"page id {bad} is not allocated (double free or foreign id)")
            if self.has_duplicates(idx):
                raise PageError("the same page id appears twice in one free() call")
        self._used[idx] = False
        top = self._top
        self._stack[top:top + k] = idx[::-1]
        self._top = top + k

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self._n}, used={self.num_used})"


def _show(idx: np.ndarray, shown) -> str:
    return str(shown if shown is not None else idx.tolist())
