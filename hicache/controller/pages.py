"""Page id pool for the controller: the PageAllocator interface at C speed per page.

A LIFO free stack (deterministic: the same calls give the same ids on every rank; a fresh pool
hands out 0, 1, 2, ...) plus a numpy used-map, so alloc/free cost a few Python operations per
call and vectorised work per page, instead of Python work per page.
"""

from __future__ import annotations

import numpy as np

from hicache.l1.allocator import OutOfPagesError, PageError, as_id_list


class PagePool:
    """Free list over page ids ``[0, num_pages)``; alloc/free are all-or-nothing."""

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise PageError(f"num_pages must be an int >= 0, got {num_pages!r}")
        self._n = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: the end is handed out first
        self._used = np.zeros(num_pages, np.bool_)

    @property
    def num_pages(self) -> int:
        return self._n

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._n - len(self._free)

    def is_allocated(self, page: int) -> bool:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self._n:
            raise PageError(f"page id {page!r} is outside the pool [0, {self._n})")
        return bool(self._used[page])

    def alloc(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageError(f"number of pages to allocate must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfPagesError(n, len(self._free), self._n)
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        self._used[out] = True
        return out

    def free(self, ids) -> None:
        pages = ids if type(ids) is list else as_id_list(ids)
        if not pages:
            return
        try:
            idx = np.asarray(pages, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            pages = as_id_list(pages)  # raises PageError naming the bad id
            idx = np.asarray(pages, dtype=np.int64)
        if idx.ndim != 1 or idx.min() < 0 or idx.max() >= self._n:
            raise PageError(f"page ids {pages} include one outside the pool [0, {self._n})")
        used = self._used[idx]
        if not used.all():
            bad = pages[int(np.argmin(used))]
            raise PageError(f"page id {bad} is not allocated (double free or foreign id)")
        if len(set(pages)) != len(pages):
            raise PageError("the same page id appears twice in one free() call")
        self._used[idx] = False
        self._free.extend(reversed(pages))

    def __repr__(self) -> str:
        return f"PagePool(num_pages={self._n}, used={self.num_used})"
