"""What a cache could hit on a trace, known only offline: the infinite-cache ideal and the
reference that evicts the page used furthest in the future (Belady's rule, per page, with a page
never used again not kept at all). Both take requests one after another in arrival order.

Pure: lists of page keys in (``ReplayKeys``), hit tokens out."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

NEVER = 1 << 62  # next use of a page no later request asks for


@dataclass
class ReplayKeys:
    """Per request: ``match`` (keys of the whole pages a lookup asks for), ``insert`` (keys of
    the whole pages it caches at its end), ``prompt`` tokens; ``page_tokens`` per key."""
    page_tokens: int
    match: list[list[int]] = field(default_factory=list)
    insert: list[list[int]] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    def add(self, match: list[int], insert: list[int], prompt_len: int) -> None:
        self.match.append(match)
        self.insert.append(insert)
        self.prompt.append(prompt_len)


def leading(match, held) -> int:
    """How many of ``match``'s pages, from the first, ``held`` holds (a prefix hit)."""
    n = 0
    for k in match:
        if k not in held:
            break
        n += 1
    return n


def ideal_hits(keys: ReplayKeys) -> int:
    """Hit tokens with unlimited memory."""
    seen: set[int] = set()
    hits = 0
    for match, insert in zip(keys.match, keys.insert):
        hits += leading(match, seen) * keys.page_tokens
        seen.update(insert)
    return hits


def next_uses(keys: ReplayKeys) -> list[list[int]]:
    """Per request, per inserted page: the index of the next request that asks for it."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in keys.insert]
    for i in range(len(keys.insert) - 1, -1, -1):
        out[i] = [last.get(k, NEVER) for k in keys.insert[i]]
        for k in keys.match[i]:
            last[k] = i
    return out


def reference_hits(keys: ReplayKeys, capacity_pages: int,
                   uses: list[list[int]] | None = None) -> int:
    """Hit tokens of a cache of ``capacity_pages`` pages that evicts the page whose next use is
    furthest away (``uses``: ``next_uses(keys)``, computed once for a sweep)."""
    uses = next_uses(keys) if uses is None else uses
    cache: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for match, insert, nus in zip(keys.match, keys.insert, uses):
        hits += leading(match, cache) * keys.page_tokens
        for k, nu in zip(insert, nus):
            if nu == NEVER:
                cache.pop(k, None)
                continue
            cache[k] = nu
            heapq.heappush(heap, (-nu, k))
        while len(cache) > capacity_pages:
            nu, k = heapq.heappop(heap)
            if cache.get(k) == -nu:
                del cache[k]
        if len(heap) > 4 * len(cache) + 1024:  # drop stale entries now and then
            heap = [(-nu, k) for k, nu in cache.items()]
            heapq.heapify(heap)
    return hits
