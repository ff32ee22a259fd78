"""Eviction order of one tier's nodes, kept incrementally: O(1) add, touch and remove.

LRU keeps one ``OrderedDict`` (a hash map threaded on a C doubly linked list: ``move_to_end``
and ``del`` are O(1) and allocate nothing) in last-touch order, oldest first. LFU keeps one such
list per use count and visits the counts in ascending order; a node moves to its count's list
when it is touched. Callers touch the nodes of a path leaf first, so a parent follows its
children at equal recency and an eviction scan meets it after them.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Iterator

from hicache.controller.tree import Node


class EvictionOrder:
    """Nodes of one tier, in the order they should be evicted (first = evict first)."""

    __slots__ = ("lfu", "_lru", "_lists", "_counts", "_where", "touch", "add", "remove")

    def __init__(self, lfu: bool = False) -> None:
        self.lfu = lfu
        self._lru: "OrderedDict[Node, None]" = OrderedDict()
        self._lists: dict[int, "OrderedDict[Node, None]"] = {}
        self._counts: list[int] = []           # use counts with a non-empty list, ascending
        self._where: dict[Node, int] = {}      # LFU: node -> the count whose list holds it
        if lfu:
            self.touch, self.add, self.remove = self._lfu_touch, self._lfu_add, self._lfu_remove
        else:  # bound C methods: no Python frame per call (a node is added only when absent)
            self.touch = self._lru.move_to_end
            self.add = self._lru.setdefault
            self.remove = self._lru.__delitem__

    # ---- LFU -------------------------------------------------------------------------------
    def _lfu_add(self, n: Node) -> None:
        c = n.hits
        lst = self._lists.get(c)
        if lst is None:
            lst = self._lists[c] = OrderedDict()
            bisect.insort(self._counts, c)
        lst[n] = None
        self._where[n] = c

    def _lfu_remove(self, n: Node) -> None:
        c = self._where.pop(n)
        lst = self._lists[c]
        del lst[n]
        if not lst:
            del self._lists[c]
            del self._counts[bisect.bisect_left(self._counts, c)]

    def _lfu_touch(self, n: Node) -> None:
        if self._where[n] == n.hits:
            self._lists[n.hits].move_to_end(n)
        else:
            self._lfu_remove(n)
            self._lfu_add(n)

    # ---- reading ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Node]:
        """Nodes, first to evict first. Do not add, touch or remove while iterating."""
        if not self.lfu:
            return iter(self._lru)
        return (n for c in self._counts for n in self._lists[c])

    def __len__(self) -> int:
        return len(self._where) if self.lfu else len(self._lru)

    def __contains__(self, n: Node) -> bool:
        return n in (self._where if self.lfu else self._lru)


def make_order(eviction: str, learner=None):
    """The eviction order a ``[policy] eviction`` choice names (lru, lfu, reuse, learned:
    ``learner``'s model, one per controller)."""
    if eviction == "learned":
        from hicache.controller.learned_order import LearnedOrder
        return LearnedOrder(learner.model)
    if eviction == "reuse":
        from hicache.controller.reuse_order import ReuseOrder
        return ReuseOrder()
    return EvictionOrder(eviction == "lfu")
