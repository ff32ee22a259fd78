"""The ``learned`` eviction order: evict the node whose chain is least likely to return soon,
per a ``ReturnModel`` learnt from the returns seen so far (``returns.py`` has the why).

``Learner`` is the controller's side: at each insert it finds whether the request continued a
chain (its hit ends in a node of an earlier insert that no other request branched from, or it
regrows a chain that was evicted: a *ghost*), counts that return with the chain's class and gap,
and files every node of the request's path under the request's class. ``LearnedOrder`` keeps one
recency list per class (oldest first) and yields nodes lowest index first: a class's index is
unimodal in age (it rises through the few ticks no return comes in, then falls), so each list's
lowest is at one of its ends and a merge of both ends of every list gives the order.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import OrderedDict
from typing import Iterator

from hicache.controller.returns import (CLASSES, EDGE_LIST, ReturnModel, class_turn,
                                        request_class)
from hicache.controller.tree import Node
from hicache.ids import TOKEN_BYTES

GHOSTS_PER_PAGE = 2     # ghosts kept per device page (at least MIN_GHOSTS)
MIN_GHOSTS = 4096


class Learner:
    """Classes and returns, from the controller's inserts and removals."""

    __slots__ = ("model", "ghosts", "_cap", "_page_bytes")

    def __init__(self, device_pages: int, page_tokens: int) -> None:
        self.model = ReturnModel()
        # (parent nid, the removed node's scope tag and first page) -> (class, born, span)
        self.ghosts: OrderedDict[tuple[int, int], tuple[int, int, int]] = OrderedDict()
        self._cap = max(MIN_GHOSTS, GHOSTS_PER_PAGE * device_pages)
        self._page_bytes = page_tokens * TOKEN_BYTES

    def inserted(self, path: list[Node], old: int, new_pages: int, now: int,
                 decoded: int = 0) -> None:
        """An insert whose ``path`` holds ``old`` nodes cached before it, then its new ones
        (``new_pages`` pages), of a request that decoded ``decoded`` tokens. Its class counts
        the pages it added to the chain it continued (pages regrown where the chain was
        evicted are not its own)."""
        end = path[old - 1] if old else None
        total = sum(n.npages for n in path)
        turn, own = 0, new_pages
        model = self.model
        if end is not None and end.born >= 0 and len(end.children) <= 1 + (old < len(path)):
            model.returned(end.rclass, now - end.born)  # a continuation (one other child at
            turn = class_turn(end.rclass) + 1           # most: the last turn's decoded pages)
            own = total - end.span
        elif old < len(path):
            ghost = self.ghosts.pop(self._key(path[old]), None)
            if ghost is not None:
                cls, born, span = ghost
                model.returned(cls, now - born)
                turn, own = class_turn(cls) + 1, total - span
        cls = request_class(turn, max(own, 0), decoded)
        for n in path:
            n.rclass, n.born, n.span = cls, now, total
        model.inserted(cls, now)

    def forget(self, n: Node) -> None:
        """``n`` leaves the tree: keep a ghost of it, so that a return that regrows it counts."""
        if n.born < 0 or n.parent is None:
            return
        g, key = self.ghosts, self._key(n)
        g[key] = (n.rclass, n.born, n.span)
        g.move_to_end(key)
        if len(g) > self._cap:
            g.popitem(last=False)

    def _key(self, n: Node) -> tuple[int, int]:
        """The node's place: its parent and its first page (with a scope's tag, so that two
        tenants' equal pages under one public prefix are two ghosts), as its children key."""
        return n.parent.nid, hash(n.scope + n.tokens[:self._page_bytes])


class LearnedOrder:
    """Nodes of one tier, lowest ``model.value(class, age)`` first; until the model is ready,
    and among equal values, the least recently added or touched first (LRU)."""

    __slots__ = ("model", "_lists", "_cls", "_now", "_seq")

    def __init__(self, model: ReturnModel) -> None:
        self.model = model
        # per class: node -> (tick of its last use, sequence number of its last add or touch)
        self._lists = [OrderedDict() for _ in range(CLASSES)]
        self._cls: dict[Node, int] = {}
        self._now = 0
        self._seq = 0

    def add(self, n: Node) -> None:
        if n in self._cls:
            return
        c = n.rclass
        self._cls[n] = c
        self._seq += 1
        self._lists[c][n] = (n.last_access, self._seq)
        if n.last_access > self._now:
            self._now = n.last_access

    def remove(self, n: Node) -> None:
        del self._lists[self._cls.pop(n)][n]

    def touch(self, n: Node) -> None:
        c, t = self._cls[n], n.last_access
        if t > self._now:
            self._now = t
        self._seq += 1
        if c == n.rclass:
            lst = self._lists[c]
            lst[n] = (t, self._seq)
            lst.move_to_end(n)
            return
        del self._lists[c][n]
        c = self._cls[n] = n.rclass
        self._lists[c][n] = (t, self._seq)

    def __iter__(self) -> Iterator[Node]:
        """Nodes, first to evict first. Do not add, touch or remove while iterating."""
        model, now = self.model, self._now
        if model.ready:  # model.value, inlined (this runs for every node an eviction meets)
            rows, edges, last, find = model.rows, EDGE_LIST, len(EDGE_LIST) - 1, bisect_right

            def key(c: int, t: int) -> float:
                b = find(edges, now - t)
                return rows[c][(b if b < last else last) - 1]
        else:
            def key(c: int, t: int) -> float:
                return 0.0
        heap: list = []
        left: list[int] = [0] * CLASSES
        for c, lst in enumerate(self._lists):
            if lst:
                left[c] = len(lst)
                for end, it in enumerate((iter(lst.items()), reversed(lst.items()))):
                    n, (t, seq) = next(it)  # (both ends meet at the last node: end breaks
                    heap.append((key(c, t), seq, end, c, n, it))  # the tie)
        heapq.heapify(heap)
        while heap:
            _, _, end, c, n, it = heap[0]
            if left[c]:
                left[c] -= 1
                yield n
            nxt = next(it, None) if left[c] else None
            if nxt is None:
                heapq.heappop(heap)
            else:
                n, (t, seq) = nxt
                heapq.heapreplace(heap, (key(c, t), seq, end, c, n, it))

    def __len__(self) -> int:
        return len(self._cls)

    def __contains__(self, n: Node) -> bool:
        return n in self._cls
