"""Eviction: picking and evicting device and host copies in the eviction orders.

A section of ``CacheController`` (a mixin: the state lives on the controller, made in its
``__init__``: ``tree``, ``device``, ``host``, ``policy``, ``stats``, ``_dev``, ``_hst``,
``_evicting_pages``, ``_host_valid_pages``; backups come from the transfer section).
"""

from __future__ import annotations

import numpy as np

from hicache.controller.tree import Node


class Eviction:
    """The eviction section of ``CacheController``."""

    def _device_evictable(self, n: Node) -> bool:
        return (n.device is not None and n.lock_ref == 0 and not n.pending and not n.evicting
                and not n.has_device_child())

    def _host_evictable(self, n: Node) -> bool:
        return (n.host_valid and n.lock_ref == 0 and not n.pending
                and (n.device is not None or not n.children))

    def _pick_device(self, need: int, write_back: bool) -> list[tuple[Node, bool]]:
        """Victims in eviction order whose eviction frees ``need`` pages now, as (node, back
        up first). A node counts as a leaf once its device children are picked. Under
        write_back a node with no host copy is backed up instead of dropped, and only while
        the backups in flight (all of them) fall short of ``need``: a backup frees nothing now,
        so the scan goes on to nodes that do."""
        out: list[tuple[Node, bool]] = []
        gone: set[Node] = set()
        now, later = 0, self._evicting_pages
        for n in self._dev:
            if n.lock_ref or n.pending or n.evicting:
                continue
            if n.children and any(c.device is not None and c not in gone
                                  for c in n.children.values()):
                continue
            if write_back and not n.host_valid:
                if now + later < need:
                    out.append((n, True))
                    later += n.npages
                continue
            out.append((n, False))
            gone.add(n)
            now += n.npages
            if now >= need:
                break
        return out

    def evict_device(self, need: int) -> int:
        """Free at least ``need`` device pages now if possible; returns how many were freed.
        Scans the eviction order (no rebuild) and picks first, then evicts: a parent freed by
        its children's eviction and placed before them is met by the next pass."""
        freed = 0
        write_back = self.policy.write == "write_back"
        while freed < need:
            progress = False
            for n, backup in self._pick_device(need - freed, write_back):
                if freed >= need:
                    break
                if not n.alive or not self._device_evictable(n):
                    continue
                progress = True  # evictable: its host copy is valid (or it has none)
                if n.host_valid:
                    freed += self._demote(n)
                elif backup and self._backup(n):
                    n.evicting = True
                    self._evicting_pages += n.npages
                else:  # no host copy and none possible (or not wanted): gone
                    freed += self._drop(n)
            if not progress:
                break
        return freed

    def _demote(self, n: Node) -> int:
        """Free the device copy of a node that has a valid host copy."""
        k = self._detach_device(n)
        self.stats.device_evicted_pages += k
        return k

    def _drop(self, n: Node) -> int:
        """Remove a device leaf with no host copy, and its host-only subtree."""
        k = n.npages
        stack, order = [n], []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):
            if x.device is not None:
                self._detach_device(x)
            if x.host is not None:
                self._drop_host(x)
            self._remove_leaf(x)
        self.stats.device_evicted_pages += k
        self.stats.dropped_pages += k
        return k

    def _remove_leaf(self, n: Node) -> None:
        """Take a leaf out of the tree (the learned order keeps a ghost of it)."""
        if self._learner is not None:
            self._learner.forget(n)
        self.tree.remove_leaf(n)

    def _drop_host(self, n: Node) -> int:
        self.host.free_array(n.host, trusted=True)
        k = len(n.host)
        self.stats.host_evicted_pages += k
        if n.host_valid:
            self._host_valid_pages -= k
            if self.on_tier is not None:
                self.on_tier(False, "l2", n)
        n.host = None
        n.host_valid = False
        self._hst.remove(n)
        return k

    def _alloc_host(self, n: int) -> np.ndarray | None:
        if n > self.host.num_pages:
            return None
        return self._take(self.host, self.evict_host, n)

    def _pick_host(self, need: int) -> list[Node]:
        out: list[Node] = []
        gone: set[Node] = set()
        now = 0
        for n in self._hst:
            if not n.host_valid or n.lock_ref or n.pending:
                continue
            if n.device is None:
                if n.children and any(c not in gone for c in n.children.values()):
                    continue
                gone.add(n)
            out.append(n)
            now += n.npages
            if now >= need:
                break
        return out

    def evict_host(self, need: int) -> int:
        """Drop at least ``need`` host copies if possible; returns how many were freed."""
        freed = 0
        while freed < need:
            progress = False
            for n in self._pick_host(need - freed):
                if freed >= need:
                    break
                if not n.alive or not self._host_evictable(n):
                    continue
                progress = True
                freed += self._drop_host(n)
                if n.device is None:
                    self._remove_leaf(n)
            if not progress:
                break
        return freed

