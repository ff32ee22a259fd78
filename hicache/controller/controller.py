"""The cache controller: one deterministic state machine per rank over widened page ids.

It never touches KV tensors. It decides what is cached where, hands out device pages, and emits
transfer ops (``BackupOp`` D2H, ``LoadOp`` H2D) for the embedding layer to run; an op changes
tree state only when ``complete`` is called with ids that every rank agreed are finished (see
``agreement.py``). Typical use per request::

    m = ctrl.match(tokens); h = ctrl.lock(m); load = ctrl.load_back(m)
    pages = ctrl.alloc_device(n_new_pages)
    ...  # prefill the unmatched suffix into the pages
    res = ctrl.insert(tokens, all_whole_pages); ctrl.unlock(h)
    ops = ctrl.take_ops()  # execute; then each step: ctrl.agree(agreement, local_done_ids)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import numpy as np

from hicache.controller.policy import ControllerPolicy
from hicache.controller.tree import Node, RadixTree, as_tokens, chain_pages
from hicache.controller.types import (BackupOp, ControllerError, ControllerStats,
                                      DeviceFullError, InsertResult, LoadOp, LockError, Match,
                                      PageOwnershipError, StaleNodeError, UnknownOpError)
from hicache.l1.allocator import PageAllocator, as_id_list, id_array

Op = Union[BackupOp, LoadOp]
_NO_IDS = np.zeros(0, np.int64)
_MAX_GRANTS = 256  # recent alloc_device results remembered for insert's fast validation


def _ids(pages) -> list[int]:
    """Page ids as a list of python ints (fast path for a list of ints)."""
    if type(pages) is list and set(map(type, pages)) <= {int}:
        return pages
    return as_id_list(pages)


class InvariantError(AssertionError):
    """The controller's internal bookkeeping is inconsistent (a bug, reported by check)."""


class LockHandle:
    """What ``lock`` returns; ``unlock`` it exactly once."""

    __slots__ = ("node", "released")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.released = False


@dataclass
class _OpRecord:
    op: Op
    nodes: list[Node]


class CacheController:
    """Radix tree over widened pages of ``page_tokens`` (= P * c) token slots, with
    ``device_pages`` L1 pages and ``host_pages`` L2 pages."""

    def __init__(self, page_tokens: int, device_pages: int, host_pages: int, *,
                 write: str = "write_through", eviction: str = "lru",
                 selective_threshold: int = 2, load_back_threshold: int = 0) -> None:
        self.policy = ControllerPolicy(write, eviction, selective_threshold, load_back_threshold)
        self.tree = RadixTree(page_tokens)
        self.tree.on_split = self._on_split
        self.page_tokens = page_tokens
        self.device = PageAllocator(device_pages)
        self.host = PageAllocator(host_pages)
        self.stats = ControllerStats()
        self._key = self.policy.eviction_key()
        self._clock = 0
        # per device page: the serial of the alloc_device call that handed it out while it is
        # not yet inserted or freed (a "request page"), else -1
        self._gen = np.full(self.device.num_pages, -1, np.int64)
        self._grants: dict[int, tuple[int, list[int], np.ndarray]] = {}  # first page -> recent
        self._serial = 0
        self._device_nodes: dict[Node, None] = {}  # nodes with device pages (ordered: determinism)
        self._host_nodes: dict[Node, None] = {}    # nodes with host pages
        self._ops: dict[int, _OpRecord] = {}       # in flight
        self._new_ops: list[Op] = []               # not yet taken
        self._next_op = 0
        self._evicting_pages = 0

    # ---- lookup ---------------------------------------------------------------------------
    def match(self, tokens) -> Match:
        """Longest cached whole-page prefix of ``tokens``: device part, then host-only part."""
        arr = as_tokens(tokens, int64=False)
        self._clock += 1
        self.stats.matches += 1
        path = self.tree.walk(arr)
        dev: list[Node] = []
        hst: list[Node] = []
        for n in path:
            if n.device is not None and not hst:
                dev.append(n)
            elif n.device is None and n.host_valid:
                hst.append(n)
            else:
                break
        clock = self._clock
        waits: list[int] = []
        for n in dev:
            n.last_access = clock
            if n.pending:
                waits.extend(o for o in n.pending if isinstance(self._ops[o].op, LoadOp))
        for n in hst:
            n.last_access = clock
        pt = self.page_tokens
        last = (hst or dev or [self.tree.root])[-1]
        return Match(device_len=pt * sum(n.npages for n in dev),
                     host_len=pt * sum(n.npages for n in hst),
                     device_pages=tuple(chain_pages(dev, "device")),
                     host_pages=tuple(chain_pages(hst, "host")),
                     device_nodes=tuple(dev), host_nodes=tuple(hst), last_node=last,
                     wait_ops=tuple(sorted(set(waits))))

    # ---- locks ----------------------------------------------------------------------------
    def lock(self, target: "Match | Node") -> LockHandle:
        """Protect the path from the root to the match's last node from eviction (both tiers)."""
        node = target.last_node if isinstance(target, Match) else target
        if not isinstance(node, Node):
            raise LockError(f"lock() takes a Match or a Node, got {type(target).__name__}")
        if not node.alive:
            raise StaleNodeError(f"cannot lock node {node.nid}: it was evicted after the match")
        n = node
        while n.parent is not None:
            n.lock_ref += 1
            n = n.parent
        return LockHandle(node)

    def unlock(self, handle: "LockHandle | Node") -> None:
        """Release one lock taken by ``lock`` (pass its handle, or the node it returned)."""
        if isinstance(handle, LockHandle):
            if handle.released:
                raise LockError(f"lock on node {handle.node.nid} was already released")
            node = handle.node
        elif isinstance(handle, Node):
            node = handle
        else:
            raise LockError(f"unlock() takes a LockHandle or Node, got {type(handle).__name__}")
        if node.parent is not None and node.lock_ref <= 0:
            raise LockError(f"unlock of node {node.nid} without a matching lock")
        n = node
        while n.parent is not None:
            n.lock_ref -= 1
            n = n.parent
        if isinstance(handle, LockHandle):
            handle.released = True

    # ---- device pages ---------------------------------------------------------------------
    def alloc_device(self, n: int) -> list[int]:
        """``n`` device pages for new tokens, evicting unlocked leaves if needed."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ControllerError(f"number of device pages must be an int >= 0, got {n!r}")
        if not n:
            return []
        if self.device.num_free < n:
            self._evict_device(n - self.device.num_free)
        if self.device.num_free < n:
            raise DeviceFullError(n, self.device.num_free, self._evicting_pages,
                                  self.device.num_pages)
        arr = self.device.alloc_array(n)
        serial = self._serial
        self._serial += 1
        self._gen[arr] = serial
        pages = arr.tolist()
        grants = self._grants
        grants[pages[0]] = (serial, pages, arr)  # lets insert validate these without converting
        if len(grants) > _MAX_GRANTS:
            del grants[next(iter(grants))]
        return pages[:]

    def _grant_cover(self, pages: list, pos: int) -> "tuple[np.ndarray, list[int]] | None":
        """``pages[pos:]`` as (int64 ids, list) if it is a run of whole recent alloc_device
        results (the last one may be cut short) whose pages are all still request pages, else
        None. Costs a list compare per page instead of an int conversion."""
        grants, gen, n = self._grants, self._gen, len(pages)
        arrs, lists, used = [], [], []
        o = pos
        try:
            while o < n:
                g = grants.get(pages[o])
                if g is None or g[0] in used:
                    return None
                serial, gl, ga = g
                k = min(len(gl), n - o)
                if k < len(gl):
                    gl, ga = gl[:k], ga[:k]
                if pages[o:o + k] != gl or not (gen[ga] == serial).all():
                    return None
                arrs.append(ga)
                lists.append(gl)
                used.append(serial)
                o += k
        except TypeError:  # an unhashable or odd id: the general path names it
            return None
        if len(arrs) == 1:
            return arrs[0], lists[0][:]
        return np.concatenate(arrs), [p for gl in lists for p in gl]

    def free_device(self, pages: Iterable[int]) -> None:
        """Return pages from ``alloc_device`` that were not inserted (e.g. a partial tail)."""
        idx = self._req_ids(pages if type(pages) is list else _ids(pages), "free")
        if self.device.has_duplicates(idx):
            raise PageOwnershipError("free_device got the same page twice")
        self._gen[idx] = -1
        self.device.free_array(idx, trusted=True)

    def _req_ids(self, pages: list, what: str) -> np.ndarray:
        """``pages`` as int64 [n] after checking each is a request page (from alloc_device)."""
        idx = id_array(pages)
        try:  # one reduce: negative where an id is negative or not a request page
            ok = not len(idx) or int((self._gen[idx] | idx).min()) >= 0
        except IndexError:
            ok = False
        if not ok:
            bad = next(int(p) for p in idx.tolist()
                       if not 0 <= p < len(self._gen) or self._gen[p] < 0)
            raise PageOwnershipError(self._foreign_page_msg(bad, what))
        return idx

    def _foreign_page_msg(self, p: int, what: str) -> str:
        if not (0 <= p < self.device.num_pages) or not self.device.is_allocated(p):
            return f"cannot {what} device page {p}: it was not allocated by alloc_device"
        return f"cannot {what} device page {p}: it is owned by a cached node"

    # ---- insert ---------------------------------------------------------------------------
    def insert(self, tokens, device_pages: Sequence[int]) -> InsertResult:
        """Cache the whole pages of ``tokens``, whose KV is in ``device_pages`` (one per whole
        page, tail tokens ignored). Pages duplicating cached ones are freed and listed."""
        arr = as_tokens(tokens, int64=False)
        pt = self.page_tokens
        n_pages = len(arr) // pt
        pages = device_pages if type(device_pages) is list else _ids(device_pages)
        if len(pages) != n_pages:
            raise ControllerError(f"insert of {len(arr)} tokens ({n_pages} whole pages of {pt}) "
                                  f"got {len(pages)} device pages; pass one per whole page and "
                                  f"free a partial tail page with free_device")
        self._clock += 1
        self.stats.inserts += 1
        path = self.tree.walk(arr)
        # validate everything before changing anything: each page either is the node's own page
        # at that position or a request page (from alloc_device), and no request page repeats
        cand: list = []  # the request pages, in order: duplicates, adopted, then new
        pos = 0
        for node in path:
            seg = pages[pos:pos + node.npages]
            own = node.device
            if own is None:
                cand += seg
            elif seg != own:
                cand += [p for p, q in zip(seg, own) if p != q]
            pos += node.npages
        new_pages = n_pages - pos
        cover = self._grant_cover(pages, pos) if new_pages and not cand else None
        if not new_pages and not cand:  # every page is the node's own: nothing to validate
            idx, new_list = _NO_IDS, None
        elif cover is None:
            cand += pages[pos:]
            idx = self._req_ids(cand, "insert")
            if self.device.has_duplicates(idx):
                raise PageOwnershipError("insert got the same device page twice")
            new_list = None
        else:  # pages of distinct valid grants are distinct request pages
            idx, new_list = cover

        if len(idx):
            self._gen[idx] = -1  # every request page is now adopted, new or freed
        freed: list[int] = []
        clock = self._clock
        pos = 0
        for node in path:
            seg = pages[pos:pos + node.npages]
            pos += node.npages
            if node.device is not None:
                dev = node.device
                if seg != dev:
                    freed += [p for p, q in zip(seg, dev) if p != q]
            else:  # host-only node recomputed by the caller: adopt its pages
                node.darr = id_array(seg)
                node.device = node.darr.tolist()
                self._device_nodes[node] = None
            node.hits += 1
            node.last_access = clock
            self._maybe_backup(node)
        last = path[-1] if path else self.tree.root
        if new_pages:
            node = self.tree.add_child(last, arr[pos * pt:n_pages * pt])
            node.darr = idx[len(idx) - new_pages:]
            node.device = node.darr.tolist() if new_list is None else new_list
            self._device_nodes[node] = None
            node.hits = 1
            node.last_access = clock
            self._maybe_backup(node)
            last = node
            path.append(node)
        if freed:
            farr = id_array(freed)
            freed = farr.tolist()
            self.device.free_array(farr, trusted=True)
        return InsertResult(freed=tuple(freed), device_pages=tuple(chain_pages(path, "device")),
                            last_node=last, new_pages=new_pages)

    def _maybe_backup(self, node: Node) -> None:
        if (node.host is not None or node.device is None or node.pending
                or not self.host.num_pages):
            return
        w = self.policy.write
        if w == "write_through" or (w == "write_through_selective"
                                    and node.hits >= self.policy.selective_threshold):
            self._backup(node)

    # ---- transfers ------------------------------------------------------------------------
    def _new_op_id(self) -> int:
        op_id = self._next_op
        self._next_op += 1
        return op_id

    def _backup(self, node: Node) -> bool:
        host = self._alloc_host(node.npages)
        if host is None:
            self.stats.backups_skipped_pages += node.npages
            return False
        node.host = host
        node.host_valid = False
        self._host_nodes[node] = None
        op = BackupOp(self._new_op_id(), tuple(node.device), tuple(host))
        node.pending.add(op.op_id)
        self._ops[op.op_id] = _OpRecord(op, [node])
        self._new_ops.append(op)
        self.stats.backups += 1
        self.stats.backup_pages += node.npages
        return True

    def load_back(self, m: Match) -> LoadOp | None:
        """Give the match's host-only pages device pages and emit the H2D op; None when there is
        nothing to load, the hit is under ``load_back_threshold`` tokens or L1 has no room (the
        caller then recomputes those tokens). The match must be locked."""
        nodes = [n for n in m.host_nodes if n.alive and n.device is None and n.host_valid]
        if not nodes:
            return None
        if m.last_node.lock_ref <= 0:
            raise LockError("lock the match before load_back (its pages could be evicted)")
        need = sum(n.npages for n in nodes)
        if need * self.page_tokens < self.policy.load_back_threshold:
            return None
        if self.device.num_free < need:
            self._evict_device(need - self.device.num_free)
        if self.device.num_free < need:
            return None
        darr = self.device.alloc_array(need)
        dpages = darr.tolist()
        hpages: list[int] = []
        op_id = self._new_op_id()
        i = 0
        for n in nodes:
            n.darr = darr[i:i + n.npages]
            n.device = dpages[i:i + n.npages]
            i += n.npages
            hpages.extend(n.host)
            self._device_nodes[n] = None
            n.pending.add(op_id)
        op = LoadOp(op_id, tuple(hpages), tuple(dpages))
        self._ops[op_id] = _OpRecord(op, nodes)
        self._new_ops.append(op)
        self.stats.loads += 1
        self.stats.load_pages += need
        return op

    def take_ops(self) -> list[Op]:
        """Ops emitted since the last call, in op-id order (the same on every rank)."""
        out, self._new_ops = self._new_ops, []
        return out

    def inflight_ops(self) -> list[int]:
        return sorted(self._ops)

    def complete(self, op_ids: Iterable[int]) -> None:
        """Apply ops that ALL ranks finished: host copies become valid, loads unpin, and nodes
        evicted under write_back free their device pages."""
        if type(op_ids) in (tuple, list) and not op_ids:
            return
        ids = sorted(set(int(o) for o in op_ids))
        for o in ids:
            if o not in self._ops:
                raise UnknownOpError(f"op {o} is not in flight (in flight: {self.inflight_ops()})")
        for o in ids:
            rec = self._ops.pop(o)
            for n in rec.nodes:
                n.pending.discard(o)
            if isinstance(rec.op, BackupOp):
                for n in rec.nodes:
                    n.host_valid = True
                for n in sorted(rec.nodes, key=lambda n: -n.depth()):
                    if n.evicting:
                        n.evicting = False
                        self._evicting_pages -= n.npages
                        if n.lock_ref == 0 and not n.pending and not n.has_device_child():
                            self._demote(n)

    def agree(self, agreement, done: Iterable[int], extras: Sequence[int] = ()):
        """One agreement step: in-flight op ids + this rank's finished ones -> ``complete``
        what every rank finished. Returns the agreement's result (its ``extras`` are MIN'd)."""
        res = agreement.step(self.inflight_ops(), done, extras,
                             digest=self.digest() if agreement.debug else None)
        self.complete(res.done_ops)
        return res

    def _on_split(self, top: Node, lower: Node) -> None:
        for o in top.pending:
            self._ops[o].nodes.append(top)
        if lower.device is not None:
            self._device_nodes[top] = None
        if lower.host is not None:
            self._host_nodes[top] = None

    # ---- eviction -------------------------------------------------------------------------
    def _device_evictable(self, n: Node) -> bool:
        return (n.device is not None and n.lock_ref == 0 and not n.pending and not n.evicting
                and not n.has_device_child())

    def _host_evictable(self, n: Node) -> bool:
        return (n.host_valid and n.lock_ref == 0 and not n.pending
                and (n.device is not None or not n.children))

    def evict_device(self, n_pages: int) -> int:
        """Evict at least ``n_pages`` device pages if possible; returns pages freed now."""
        return self._evict_device(n_pages)

    def evict_host(self, n_pages: int) -> int:
        """Drop at least ``n_pages`` host copies if possible; returns pages freed."""
        return self._evict_host(n_pages)

    def _evict_device(self, need: int) -> int:
        key = self._key
        # (key, node) of every evictable device leaf; the checks of _device_evictable inlined,
        # cheapest first (device is set for every node of _device_nodes)
        heap = [(key(n), n) for n in self._device_nodes
                if not n.lock_ref and not n.pending and not n.evicting
                and not n.has_device_child()]
        heapq.heapify(heap)
        freed = 0
        write_back = self.policy.write == "write_back"
        while heap and freed + self._evicting_pages < need:
            _, n = heapq.heappop(heap)
            if not self._device_evictable(n):
                continue
            parent = n.parent
            if n.host_valid:
                freed += self._demote(n)
            elif write_back and n.host is None and self._backup(n):
                n.evicting = True
                self._evicting_pages += n.npages
                continue
            else:
                freed += self._drop(n)
            if parent.parent is not None and self._device_evictable(parent):
                heapq.heappush(heap, (key(parent), parent))
        return freed

    def _demote(self, n: Node) -> int:
        """Free the device copy of a node that has a valid host copy."""
        self.device.free_array(n.darr, trusted=True)
        k = len(n.device)
        n.device = n.darr = None
        del self._device_nodes[n]
        self.stats.device_evicted_pages += k
        return k

    def _drop(self, n: Node) -> int:
        """Remove a device leaf with no host copy, and its host-only subtree."""
        k = len(n.device)
        stack, order = [n], []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        for x in reversed(order):
            if x.device is not None:
                self.device.free_array(x.darr, trusted=True)
                del self._device_nodes[x]
                x.device = x.darr = None
            if x.host is not None:
                self.host.free_array(id_array(x.host))
                del self._host_nodes[x]
                self.stats.host_evicted_pages += len(x.host)
                x.host = None
                x.host_valid = False
            self.tree.remove_leaf(x)
        self.stats.device_evicted_pages += k
        self.stats.dropped_pages += k
        return k

    def _alloc_host(self, n: int) -> list[int] | None:
        if n > self.host.num_pages:
            return None
        if self.host.num_free < n:
            self._evict_host(n - self.host.num_free)
        if self.host.num_free < n:
            return None
        return self.host.alloc(n)

    def _evict_host(self, need: int) -> int:
        key = self._key
        heap = [(key(n), n) for n in self._host_nodes if self._host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < need:
            _, n = heapq.heappop(heap)
            if not self._host_evictable(n):
                continue
            self.host.free_array(id_array(n.host))
            freed += len(n.host)
            n.host = None
            n.host_valid = False
            del self._host_nodes[n]
            self.stats.host_evicted_pages += n.npages
            if n.device is None:
                parent = n.parent
                self.tree.remove_leaf(n)
                if parent.parent is not None and self._host_evictable(parent):
                    heapq.heappush(heap, (key(parent), parent))
        return freed

    # ---- introspection --------------------------------------------------------------------
    def digest(self) -> list[tuple]:
        """Everything that must be identical on every rank, as comparable entries."""
        head = [("clock", self._clock, "next_op", self._next_op, "inflight",
                 tuple(self.inflight_ops()), "device_used", self.device.num_used,
                 "host_used", self.host.num_used,
                 "req_pages", tuple(np.flatnonzero(self._gen >= 0).tolist()))]
        return head + self.tree.digest()

    def iter_nodes(self):
        return self.tree.iter_nodes()

    @property
    def request_pages(self) -> frozenset[int]:
        """Device pages handed out by alloc_device and not yet inserted or freed."""
        return frozenset(np.flatnonzero(self._gen >= 0).tolist())

    def cached_pages(self) -> tuple[int, int]:
        """(device pages held by the tree, valid host copies held by the tree)."""
        d = sum(n.npages for n in self._device_nodes)
        h = sum(n.npages for n in self._host_nodes if n.host_valid)
        return d, h

    def check(self) -> None:
        """Raise InvariantError if the bookkeeping is inconsistent (tests, debug)."""
        dev_seen: set[int] = set(np.flatnonzero(self._gen >= 0).tolist())
        host_seen: set[int] = set()
        dev_nodes, host_nodes = set(), set()
        evicting = 0
        for n in self.iter_nodes():
            if not n.alive:
                raise InvariantError(f"dead node {n.nid} still in the tree")
            if n.device is None and n.host is None:
                raise InvariantError(f"node {n.nid} holds no data")
            if len(n.tokens) != n.npages * self.page_tokens * 8:
                raise InvariantError(f"node {n.nid} token count != pages")
            if n.device is not None:
                dev_nodes.add(n)
                if len(n.device) != n.npages:
                    raise InvariantError(f"node {n.nid} device page count")
                if n.darr is None or n.darr.tolist() != n.device:
                    raise InvariantError(f"node {n.nid} device array != device list")
                if n.parent.parent is not None and n.parent.device is None:
                    raise InvariantError(f"node {n.nid} on device under a host-only parent")
                for p in n.device:
                    if p in dev_seen:
                        raise InvariantError(f"device page {p} owned twice")
                    dev_seen.add(p)
            if n.host is not None:
                host_nodes.add(n)
                if len(n.host) != n.npages:
                    raise InvariantError(f"node {n.nid} host page count")
                if not n.host_valid and (not n.pending or n.device is None):
                    raise InvariantError(f"node {n.nid} has an invalid host copy with no backup")
                for p in n.host:
                    if p in host_seen:
                        raise InvariantError(f"host page {p} owned twice")
                    host_seen.add(p)
            elif n.host_valid:
                raise InvariantError(f"node {n.nid} valid without host pages")
            if n.lock_ref < 0 or n.lock_ref < max((c.lock_ref for c in n.children.values()),
                                                 default=0):
                raise InvariantError(f"node {n.nid} lock count {n.lock_ref} below a child's")
            for o in n.pending:
                if o not in self._ops or n not in self._ops[o].nodes:
                    raise InvariantError(f"node {n.nid} pending on unknown op {o}")
            if n.evicting:
                evicting += n.npages
        if dev_seen != set(self.device.used_ids().tolist()):
            raise InvariantError("device pool's allocated pages != pages held by the tree "
                                 "and requests")
        if len(dev_seen) != self.device.num_used:
            raise InvariantError(f"device pages: {self.device.num_used} allocated, "
                                 f"{len(dev_seen)} accounted for (leak)")
        if len(host_seen) != self.host.num_used:
            raise InvariantError(f"host pages: {self.host.num_used} allocated, "
                                 f"{len(host_seen)} accounted for (leak)")
        if dev_nodes != set(self._device_nodes) or host_nodes != set(self._host_nodes):
            raise InvariantError("tier node indexes disagree with the tree")
        if evicting != self._evicting_pages:
            raise InvariantError(f"evicting pages {self._evicting_pages} != {evicting}")
