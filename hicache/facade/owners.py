"""``PageOwners``: which device pages a ``HiCache``'s admitted requests own (pages ``alloc``
or an L3 restore gave them: the only ones a target write may touch) and hold (every page of
their tables, cached ones included: what a companion's write may touch), and the check of a
write's pages (remembered for a write reused at every layer until a page is released)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from hicache.errors import UsageError
from hicache.kvport import checked_once

__all__ = ["PageOwners"]


class PageOwners:
    """Ownership of one rank's device pages (replicated: every rank gives the same pages)."""

    def __init__(self, num_pages: int, check_usable: Callable[[str], None]) -> None:
        self.owned = np.zeros(num_pages, dtype=bool)
        self.held = np.zeros(num_pages, dtype=np.int32)  # a count: tables may share pages
        self.released = 0  # times owned pages were released (ends a remembered check)
        self._check_usable = check_usable
        self._writable: np.ndarray | None = None  # the last write's pages found owned ...
        self._writable_at = -1                     # ... at this count of releases

    def take(self, pages) -> None:
        """``pages`` are a request's own (fresh from ``alloc`` or a restore)."""
        self.owned[pages] = True
        self.held[pages] += 1

    def hold(self, pages) -> None:
        """``pages`` (a hit) are in a request's table."""
        self.held[pages] += 1

    def release(self, own, table) -> None:
        """A request ended: its own pages and its table's."""
        self.owned[own] = False
        self.held[table] -= 1
        self.released += 1  # a write checked before may touch these pages no more

    def check_writable(self, pages: np.ndarray) -> None:
        """UsageError unless every page of a target write is an admitted request's own."""
        self._check_usable("write_kv")
        at = self.released  # read before the check: a release during it ends the memo
        if pages is self._writable and at == self._writable_at:
            return  # the same write's next layer, and no page was released since
        bad = pages[~self.owned[pages]]
        if bad.size:
            raise UsageError(f"write_kv into device page {int(bad[0])}, which no admitted "
                             "request owns (a cached page or a free one): only pages "
                             "from alloc() take new KV")
        if checked_once(pages):
            self._writable, self._writable_at = pages, at
