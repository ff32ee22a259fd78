"""Widened-page id allocator shared by L1 and L2.

Deterministic (lowest free ids first) so that every rank, running the same control sequence,
hands out the same ids. ``alloc`` and ``free`` are all-or-nothing: a bad request changes nothing.
Invariant: ``num_free + num_used == num_pages`` at all times.
"""

from __future__ import annotations

import heapq
import operator
from typing import Iterable, Union

import torch

PageIds = Union[Iterable[int], torch.Tensor]


class PageError(ValueError):
    """A page id that is negative, outside the pool, or not currently allocated."""


class OutOfPagesError(MemoryError):
    """The pool has fewer free pages than were asked for."""

    def __init__(self, asked: int, free: int, total: int) -> None:
        super().__init__(f"asked for {asked} pages but only {free} of {total} are free")
        self.asked, self.free, self.total = asked, free, total


def as_id_list(ids: PageIds) -> list[int]:
    """Page ids from a python iterable or an integer tensor, as python ints."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise PageError(f"page ids must be integers, got a {ids.dtype} tensor")
        return [int(x) for x in ids.reshape(-1).tolist()]
    out = []
    for x in ids:
        if isinstance(x, bool):
            raise PageError(f"page id {x!r} is not an int")
        try:
            out.append(operator.index(x))
        except TypeError:
            raise PageError(f"page id {x!r} is not an int") from None
    return out


class PageAllocator:
    """Free list over page ids ``[0, num_pages)``."""

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise PageError(f"num_pages must be an int >= 0, got {num_pages!r}")
        self._num_pages = num_pages
        self._free_heap: list[int] = list(range(num_pages))  # already a valid heap
        self._used = bytearray(num_pages)  # 1 = allocated
        self._num_used = 0

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return self._num_pages - self._num_used

    @property
    def num_used(self) -> int:
        return self._num_used

    def is_allocated(self, page: int) -> bool:
        self._check_range(page)
        return bool(self._used[page])

    def _check_range(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int):
            raise PageError(f"page id {page!r} is not an int")
        if page < 0:
            raise PageError(f"page id {page} is negative")
        if page >= self._num_pages:
            raise PageError(f"page id {page} is outside the pool [0, {self._num_pages})")

    def alloc(self, n: int) -> list[int]:
        """``n`` free page ids, lowest first; raises ``OutOfPagesError`` and allocates nothing
        when fewer than ``n`` are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PageError(f"number of pages to allocate must be an int >= 0, got {n!r}")
        if n > self.num_free:
            raise OutOfPagesError(n, self.num_free, self._num_pages)
        out = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in out:
            self._used[p] = 1
        self._num_used += n
        return out

    def free(self, ids: PageIds) -> None:
        """Return pages to the pool. Every id is checked first; on any bad id nothing is freed."""
        pages = as_id_list(ids)
        seen: set[int] = set()
        for p in pages:
            self._check_range(p)
            if not self._used[p]:
                raise PageError(f"page id {p} is not allocated (double free or foreign id)")
            if p in seen:
                raise PageError(f"page id {p} appears twice in one free() call")
            seen.add(p)
        for p in pages:
            self._used[p] = 0
            heapq.heappush(self._free_heap, p)
        self._num_used -= len(pages)

    def __repr__(self) -> str:
        return f"PageAllocator(num_pages={self._num_pages}, used={self._num_used})"
