"""The L3 tier of the replay: a page set of bounded size, least recently used out first (the
order LMDB's capacity and Redis ``allkeys-lru`` evict in), keyed by page chain keys."""

from __future__ import annotations

from collections import OrderedDict


class L3Pages:
    """Pages (chain keys) held by L3, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._pages: "OrderedDict[int, None]" = OrderedDict()
        self.written = 0   # pages put (new ones)
        self.read = 0      # pages served
        self.evicted = 0

    def hit(self, keys: list[int], start: int) -> int:
        """How many of ``keys[start:]`` are held, consecutively from ``start`` (touched)."""
        n = 0
        pages = self._pages
        for k in keys[start:]:
            if k not in pages:
                break
            pages.move_to_end(k)
            n += 1
        return n

    def served(self, pages: int) -> None:
        self.read += pages

    def put(self, keys: list[int]) -> None:
        """Write ``keys`` (a page already held is refreshed), evicting the oldest past
        capacity."""
        pages = self._pages
        for k in keys:
            if k in pages:
                pages.move_to_end(k)
            else:
                pages[k] = None
                self.written += 1
        while len(pages) > self.capacity:
            pages.popitem(last=False)
            self.evicted += 1
