"""Request pages: the device pages ``alloc_device`` hands out until an insert takes them or
``free_device`` returns them, and the attach/detach of a node's device pages.

A section of ``CacheController`` (a mixin: the state lives on the controller, made in its
``__init__``: ``device``, ``_request_page``, ``_grants``, ``_max_grants``, ``_dev``,
``_dev_pages``, ``_locked_dev_pages``, ``_evicting_pages``; eviction is ``evict_device``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hicache.checks import check_int
from hicache.controller.tree import Node
from hicache.errors import DeviceFullError, UsageError
from hicache.ids import INT64, page_ids
from hicache.pages import PageAllocator


def _all_set(flags: np.ndarray) -> bool:
    """Whether every entry of the bool array ``flags`` is True (a byte scan: a fraction of
    the fixed cost of ``ndarray.all``)."""
    return b"\0" not in flags.tobytes()


class RequestPages:
    """The device-page section of ``CacheController``."""

    def alloc_device(self, n: int, *, as_array: bool = False) -> "list[int] | np.ndarray":
        """``n`` device pages for new tokens, evicting unlocked leaves if needed; as a list of
        ints, or with ``as_array`` as a fresh int64 array (no Python int per page: with
        ``np.concatenate`` after ``Match.device_pages``, what ``insert`` takes fastest)."""
        if type(n) is not int or n < 0:
            check_int(n, "number of device pages", 0, error=UsageError)
        if not n:
            return np.zeros(0, np.int64) if as_array else []
        dev = self.device
        if dev.num_free < n:  # (``_take``, inline: this runs once per request)
            self.evict_device(n - dev.num_free)
            if dev.num_free < n:
                raise DeviceFullError(n, dev.num_free, dev.num_pages,
                                      pending=self._evicting_pages)
        pages = dev.alloc_array(n)
        if len(self._grants) >= self._max_grants:
            self._loosen_grants()
            if not self._max_grants:
                self._request_page[pages] = True
                return pages if as_array else pages.tolist()
        self._grants.add(pages.tobytes())
        return pages if as_array else pages.tolist()  # a fresh array the controller keeps not

    def free_device(self, pages) -> None:
        """Return pages from ``alloc_device`` that were not inserted (e.g. a partial tail)."""
        idx = page_ids(pages)
        self._take_request_pages(idx, "free_device")
        self.device.free_array(idx, trusted=True)

    @staticmethod
    def _take(pool: PageAllocator, evict: Callable[[int], int], n: int) -> np.ndarray | None:
        """``n`` pages of ``pool`` (int64 [n]), evicting from its tier first when fewer are
        free; None when there are still too few."""
        if pool.num_free < n:
            evict(n - pool.num_free)
            if pool.num_free < n:
                return None
        return pool.alloc_array(n)

    def _loosen_grants(self) -> None:
        """Move every grant's pages into the request-page map."""
        for g in self._grants:
            self._request_page[np.frombuffer(g, INT64)] = True
        self._grants.clear()

    def _request_map(self) -> np.ndarray:
        """bool [device pages]: True for every request page (a new array)."""
        out = self._request_page.copy()
        for g in self._grants:
            out[np.frombuffer(g, INT64)] = True
        return out

    def _take_request_pages(self, idx: np.ndarray, what: str, grant: bytes | None = None) -> None:
        """UsageError, changing nothing, unless the ids of ``idx`` (int64 [k]; ``grant``: its
        bytes, if at hand) are distinct request pages; they then stop being request pages (the
        caller places or frees them). Exactly one grant (an ``alloc_device`` result, as handed
        out) passes at once, unchecked."""
        if not len(idx):
            return
        if grant is None:
            grant = idx.tobytes()
        if grant in self._grants:
            self._grants.remove(grant)
            return
        self._loosen_grants()  # idx may hold some grant's pages
        try:
            ok = int(idx.min()) >= 0 and _all_set(self._request_page[idx])
        except IndexError:
            ok = False
        if not ok:
            bad = next(p for p in idx.tolist()
                       if not 0 <= p < len(self._request_page) or not self._request_page[p])
            raise UsageError(self._foreign_page_msg(bad, what))
        if self.device.has_duplicates(idx):
            raise UsageError(f"{what} got the same device page twice")
        self._request_page[idx] = False

    def _foreign_page_msg(self, p: int, what: str) -> str:
        if not (0 <= p < self.device.num_pages) or not self.device.is_allocated(p):
            return f"{what} of device page {p}: it was not allocated by alloc_device"
        return f"{what} of device page {p}: it is owned by a cached node"

    def _attach_device(self, n: Node, pages: np.ndarray) -> None:
        n.device = pages
        if self.on_tier is not None:
            self.on_tier(True, "l1", n)
        self._dev.add(n)
        self._dev_pages += n.npages
        if n.lock_ref:
            self._locked_dev_pages += n.npages

    def _detach_device(self, n: Node) -> int:
        """Free the node's device pages; returns how many."""
        self.device.free_array(n.device, trusted=True)
        if self.on_tier is not None:
            self.on_tier(False, "l1", n)
        n.device = None
        self._dev.remove(n)
        k = n.npages
        self._dev_pages -= k
        if n.lock_ref:
            self._locked_dev_pages -= k
        return k

