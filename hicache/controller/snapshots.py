"""Snapshot bookkeeping for hybrid models (pure: slot ids and tree positions, no tensors).

A snapshot is a hybrid model's linear-attention (KDA) state after exactly the last position of
a widened page: the STATE format of that page id. It belongs to the tree node holding that page
(``Node.snaps``: the page's 1-based index inside the node -> ``Snap``), moves with it when the
node splits and goes when the node is removed. Each snapshot has an L1 slot (the device state
pool) and, with an L2 tier, a host slot; it is usable while it has either. A full pool evicts
its least recently used snapshot on its own: that shortens later hits and frees no page.

``limit(tokens)`` is the hybrid match rule: the longest cached prefix (device part, then host
part, as ``match``) is cut back to the deepest page holding a usable snapshot. The state is
replicated bookkeeping: every rank makes the same choices in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache.errors import UsageError


@dataclass(frozen=True)
class SnapshotSettings:
    """Pool capacities (snapshots per rank) and the policy's ``snapshot_every_pages``."""
    l1_slots: int
    l2_slots: int = 0
    every_pages: int = 0

    def __post_init__(self) -> None:
        if self.l1_slots < 1:
            raise UsageError(f"the snapshot pool holds {self.l1_slots} snapshots; a hybrid "
                             "model needs room for at least one")
        if self.l2_slots < 0 or self.every_pages < 0:
            raise UsageError(f"snapshot settings must be >= 0: {self}")


class Snap:
    """One snapshot: its node, page index inside the node, and its slot per tier."""

    __slots__ = ("node", "index", "l1", "l2")

    def __init__(self, node, index: int) -> None:
        self.node = node
        self.index = index       # the snapshot follows the node's index-th page (1-based)
        self.l1: int | None = None
        self.l2: int | None = None

    @property
    def pages(self) -> int:
        """Pages before the snapshot, from the root."""
        pages, n = self.index, self.node.parent
        while n is not None and n.parent is not None:
            pages += n.npages
            n = n.parent
        return pages


@dataclass
class SnapshotStats:
    taken: int = 0          # snapshots attached
    l1_evicted: int = 0     # L1 slots taken back from a snapshot for another
    l2_evicted: int = 0
    dropped: int = 0        # snapshots gone (no copy left), with their node or on their own


class _Pool:
    """Slot ids of one tier, least recently used first (insertion order of ``used``)."""

    def __init__(self, slots: int) -> None:
        self.free = list(range(slots - 1, -1, -1))
        self.used: dict[Snap, None] = {}

    def touch(self, s: Snap) -> None:
        self.used.pop(s, None)
        self.used[s] = None


class SnapshotIndex:
    """The snapshots of one controller's tree (``CacheController.snaps``)."""

    def __init__(self, tree, settings: SnapshotSettings) -> None:
        self.tree = tree
        self.settings = settings
        self.page_tokens = tree.page_tokens
        self.l1 = _Pool(settings.l1_slots)
        self.l2 = _Pool(settings.l2_slots)
        self.stats = SnapshotStats()

    # ---- the policy ---------------------------------------------------------------------------
    def positions(self, start: int, end: int) -> list[int]:
        """Page-aligned positions in ``(start, end]`` where a request that computed tokens
        ``[start, end)`` and inserts them should snapshot: the end of its whole pages, and
        every ``every_pages`` pages."""
        pt, every = self.page_tokens, self.settings.every_pages
        last = end // pt * pt
        out = []
        if every:
            step = every * pt
            out = list(range((start // step + 1) * step, last, step))
        if last > start:
            out.append(last)
        return out

    # ---- lookup -------------------------------------------------------------------------------
    def limit(self, tokens: np.ndarray, hosted: bool = True,
              scope=None) -> tuple[int, int, Snap | None]:
        """``(cached, usable, snap)``: the tokens ``match(tokens, scope=scope)`` would find
        (device part, then host part when ``hosted``), the deepest position in them holding a
        usable snapshot (0: none) and that snapshot. Read-only (no split, no touch)."""
        pages, best, host = 0, None, False
        for n, k in self.tree.covered(tokens, scope):
            if n.device is None:
                if not (hosted and n.host_valid):
                    break
                host = True
            elif host:
                break
            if n.snaps:
                for i, s in n.snaps.items():
                    if i <= k and (best is None or pages + i > best[0]):
                        best = (pages + i, s)
            pages += k
        pt = self.page_tokens
        if best is None:
            return pages * pt, 0, None
        return pages * pt, best[0] * pt, best[1]

    def use(self, s: Snap) -> None:
        """A hit used ``s``: most recently used in each tier holding it."""
        if s.l1 is not None:
            self.l1.touch(s)
        if s.l2 is not None:
            self.l2.touch(s)

    # ---- insert -------------------------------------------------------------------------------
    def attach(self, tokens: np.ndarray, positions, scope=None) -> list[Snap]:
        """Give the cached pages of ``tokens`` (in ``scope``) ending at ``positions``
        snapshots: the new ones (each with an L1 slot and, with L2, a host slot), in position
        order. A position that is not the end of a cached page, or already holds a snapshot,
        is skipped."""
        out = []
        pt = self.page_tokens
        for p in sorted(set(int(p) for p in positions)):
            if p <= 0 or p % pt or p > len(tokens):
                continue
            covered = self.tree.covered(tokens[:p], scope)
            if not covered or sum(k for _, k in covered) * pt != p:
                continue
            node, k = covered[-1]
            if node.snaps and k in node.snaps:
                self.use(node.snaps[k])
                continue
            s = Snap(node, k)
            s.l1 = self._slot(self.l1, "l1")
            self.l1.touch(s)
            if self.settings.l2_slots:
                s.l2 = self._slot(self.l2, "l2")
                self.l2.touch(s)
            if node.snaps is None:
                node.snaps = {}
            node.snaps[k] = s
            self.stats.taken += 1
            out.append(s)
        return out

    def _slot(self, pool: _Pool, tier: str) -> int:
        """A free slot of ``pool``, taken from its least recently used snapshot when full."""
        if not pool.free:
            victim = next(iter(pool.used))
            del pool.used[victim]
            slot = getattr(victim, tier)
            setattr(victim, tier, None)
            setattr(self.stats, f"{tier}_evicted", getattr(self.stats, f"{tier}_evicted") + 1)
            if victim.l1 is None and victim.l2 is None:
                self._forget(victim)
            return slot
        return pool.free.pop()

    def _forget(self, s: Snap) -> None:
        del s.node.snaps[s.index]
        if not s.node.snaps:
            s.node.snaps = None
        self.stats.dropped += 1

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, s: Snap) -> None:
        """Drop ``s`` from every tier (its pages stay cached: later hits end before it)."""
        for pool, tier in ((self.l1, "l1"), (self.l2, "l2")):
            slot = getattr(s, tier)
            if slot is not None:
                del pool.used[s]
                pool.free.append(slot)
                setattr(s, tier, None)
        self._forget(s)

    # ---- tree hooks ---------------------------------------------------------------------------
    def on_split(self, top, lower) -> None:
        """``lower`` kept its last pages and ``top`` took its first ``top.npages``."""
        if not lower.snaps:
            return
        k = top.npages
        up = {i: s for i, s in lower.snaps.items() if i <= k}
        down = {i - k: s for i, s in lower.snaps.items() if i > k}
        for i, s in up.items():
            s.node = top
        for i, s in down.items():
            s.index = i
        top.snaps, lower.snaps = up or None, down or None

    def on_remove(self, node) -> None:
        """``node`` left the tree: its snapshots go with it."""
        for s in list((node.snaps or {}).values()):
            self.evict(s)

    # ---- introspection ------------------------------------------------------------------------
    def all(self) -> list[Snap]:
        return [s for n in self.tree.iter_nodes() if n.snaps for _, s in sorted(n.snaps.items())]

    def digest(self) -> tuple:
        """What must agree on every rank: each snapshot's position and slots, the LRU orders."""
        return (tuple((s.pages, s.l1, s.l2) for s in self.all()),
                tuple(s.l1 for s in self.l1.used), tuple(s.l2 for s in self.l2.used))

    def check(self) -> None:
        """Raise UsageError if a slot is lost or held twice (tests, debug)."""
        snaps = self.all()
        for pool, tier, cap in ((self.l1, "l1", self.settings.l1_slots),
                                (self.l2, "l2", self.settings.l2_slots)):
            held = [getattr(s, tier) for s in snaps if getattr(s, tier) is not None]
            if sorted(held + pool.free) != list(range(cap)) or set(pool.used) != {
                    s for s in snaps if getattr(s, tier) is not None}:
                raise UsageError(f"snapshot {tier} slots inconsistent: held {sorted(held)}, "
                                 f"free {sorted(pool.free)} of {cap}")
        for s in snaps:
            if s.l1 is None and s.l2 is None:
                raise UsageError(f"snapshot after page {s.pages} has no copy")
