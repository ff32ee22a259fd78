"""The ``reuse`` eviction order: recency, with extra life for nodes that were used again.

Most of a production trace's prompt pages are used once (Mooncake conversation: 74% of new
pages never come back); a page that came back once comes back again far more often (42-84%).
LRU gives both the same time in memory; LFU keeps stale counts forever. Here a node's level is
how many times requests cached through it after the first (``Node.hits - 1``, up to
``LEVELS - 1``), and its key is its last use plus ``level x residency``: each reuse buys it one
more residency time, the age at which nodes of level 0 are being evicted now (a running
average, learnt as the order runs, so the bonus scales with the cache and the workload; a
frequency-plus-recency design in the family of LRFU and S3-FIFO, where frequency buys time
rather than a separate queue).

Each level is one LRU list (``OrderedDict``: O(1) add, touch, remove); keys within a level
follow recency, so a scan merges the levels' heads (``LEVELS`` lists).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterator

from hicache.controller.tree import Node

LEVELS = 4
_ALPHA = 1 / 64  # running average weight of one eviction's age



class ReuseOrder:
    """Nodes of one tier, smallest ``last use + level x residency`` first."""

    __slots__ = ("_lists", "_level", "residency", "_now")

    def __init__(self) -> None:
        self._lists = [OrderedDict() for _ in range(LEVELS)]  # node -> tick of its last use
        self._level: dict[Node, int] = {}
        self.residency = 0.0  # ticks a level-0 node stays, as evicted lately
        self._now = 0

    @staticmethod
    def _lvl(n: Node) -> int:
        return min(max(n.hits - 1, 0), LEVELS - 1)

    def add(self, n: Node) -> None:
        if n in self._level:
            return
        c = self._lvl(n)
        self._now = max(self._now, n.last_access)
        self._level[n] = c
        self._lists[c][n] = n.last_access

    def remove(self, n: Node) -> None:
        c = self._level.pop(n)
        t = self._lists[c].pop(n)
        if c == 0:  # how long level 0 lives now: the bonus one reuse buys
            age = max(self._now - t, 0)
            self.residency += (_ALPHA if self.residency else 1.0) * (age - self.residency)

    def touch(self, n: Node) -> None:
        c, c2 = self._level[n], self._lvl(n)
        t = n.last_access
        if t > self._now:
            self._now = t
        if c == c2:
            lst = self._lists[c]
            lst[n] = t
            lst.move_to_end(n)
            return
        del self._lists[c][n]
        self._lists[c2][n] = t
        self._level[n] = c2

    def _keys(self, c: int):
        bonus = c * self.residency
        for n, t in self._lists[c].items():
            yield t + bonus, n.nid, n

    def __iter__(self) -> Iterator[Node]:
        """Nodes, first to evict first. Do not add, touch or remove while iterating."""
        streams = [self._keys(c) for c in range(LEVELS) if self._lists[c]]
        if len(streams) == 1:
            return (n for _, _, n in streams[0])
        return (n for _, _, n in heapq.merge(*streams))

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, n: Node) -> bool:
        return n in self._level
