"""The cache controller: one deterministic state machine per rank over widened page ids.

It never touches KV tensors. It decides what is cached where, hands out device pages, and emits
transfer ops (``BackupOp`` D2H, ``LoadOp`` H2D) for the embedding layer to run; an op changes
tree state only when ``complete`` is called with ids that every rank agreed are finished (see
``agreement.py``). Typical use per request::

    m = ctrl.match(tokens, lock=True); h = m.lock; load = ctrl.load_back(m)
    pages = ctrl.alloc_device(n_new_pages)
    ...  # prefill the unmatched suffix into the pages
    res = ctrl.insert(tokens, all_whole_pages, after=h)  # releases h
    # (the same as: res = ctrl.insert(tokens, all_whole_pages); ctrl.unlock(h), which walks
    # the prefix again)
    ops = ctrl.take_ops()  # execute; then each step: ctrl.agree(agreement, local_done_ids)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Union

import numpy as np

from hicache.controller import invariants
from hicache.controller.eviction import Eviction
from hicache.controller.insert import Insert
from hicache.controller.learned_order import Learner
from hicache.controller.order import make_order
from hicache.controller.policy import controller_policy
from hicache.controller.request_pages import RequestPages
from hicache.controller.snapshots import SnapshotIndex, SnapshotSettings
from hicache.controller.tree import DEVICE_PAGES, HOST_PAGES, Node, RadixTree, chain_pages
from hicache.controller.types import NO_IDS as _NO_IDS
from hicache.controller.types import (BackupOp, ControllerStats, LoadOp, LockHandle, Match)
from hicache.errors import UsageError
from hicache.ids import tree_tokens
from hicache.pages import PageAllocator
from hicache.scope import Scope

Op = Union[BackupOp, LoadOp]
_MAX_GRANTS = 4096


def _weak_method(owner, fn):
    """``fn`` bound to ``owner`` through a weak reference: a callback the tree holds without
    a reference cycle back to its controller (a dropped controller is freed at once, see
    ``RadixTree.__del__``)."""
    ref = weakref.ref(owner)

    def call(*args):
        obj = ref()
        if obj is not None:  # (a tree kept past its controller has no one to tell)
            fn(obj, *args)
    return call


@dataclass
class _OpRecord:
    op: Op
    nodes: list[Node]


class CacheController(RequestPages, Insert, Eviction):
    """Radix tree over widened pages of ``page_tokens`` (= P * c) token slots, with
    ``device_pages`` L1 pages and ``host_pages`` L2 pages.

    Capacities and page ids count widened pages; lengths (``Match.device_len`` ...) count
    tokens. Page ids go in as any integer sequence or buffer and come out as int64 arrays."""

    def __init__(self, page_tokens: int, device_pages: int, host_pages: int, *,
                 policy=None, snapshots: SnapshotSettings | None = None,
                 **settings) -> None:
        """``policy``: the policy file's ``[policy]`` section (``HiCacheConfig.policy``);
        keyword ``settings`` (write, eviction, selective_threshold, load_back_threshold) override
        its fields, checked against the policy file's choices and ranges (ConfigError).
        ``snapshots``: a hybrid model's state snapshot pools (``self.snaps``; None: none)."""
        self.policy = controller_policy(policy, settings)
        self.tree = RadixTree(page_tokens)
        self.tree.on_split = _weak_method(self, CacheController._on_split)
        self.snaps = SnapshotIndex(self.tree, snapshots) if snapshots is not None else None
        if self.snaps is not None:
            self.tree.on_remove = self.snaps.on_remove
        self.page_tokens = page_tokens
        # the controller frees only pages it owns or checked itself: no per-page used map
        self.device = PageAllocator(device_pages, track_used=False)
        self.host = PageAllocator(host_pages, track_used=False)
        self._hosted = host_pages > 0  # an L2 tier: inserts back up
        self.stats = ControllerStats()
        self._clock = 0
        # Request pages: handed out by alloc_device and not yet inserted or freed (the only
        # pages insert and free_device take from a caller). Each is in exactly one of:
        # - a grant: the bytes of an alloc_device result whose pages are all still request
        #   pages. Request pages taken by an insert (after any cached ones) or freed as exactly
        #   one grant skip every check, which the allocation and this set guarantee, and no
        #   per-page mark is written for them;
        # - the map: per device page, True for a request page in no grant. Request pages given
        #   back any other way first move every grant into the map (a grant may hold some of
        #   them; the next inserts then take the general check), so does passing _max_grants
        self._request_page = np.zeros(self.device.num_pages, np.bool_)
        self._grants: set[bytes] = set()
        self._max_grants = _MAX_GRANTS  # (0: no grants, every request page in the map)
        # the learned order's classes and returns (None: another order)
        self._learner = (Learner(device_pages, page_tokens)
                         if self.policy.eviction == "learned" else None)
        self._dev = make_order(self.policy.eviction, self._learner)  # device nodes, eviction order
        self._hst = make_order(self.policy.eviction, self._learner)  # host nodes, eviction order
        self._dev_pages = 0             # device pages held by tree nodes
        self._locked_dev_pages = 0      # ... of them in locked nodes
        self._host_valid_pages = 0      # valid host copies held by tree nodes
        self._ops: dict[int, _OpRecord] = {}       # in flight
        self._new_ops: list[Op] = []               # not yet taken
        self._next_op = 0
        self._evicting_pages = 0        # device pages freed once their write_back backups land
        # a listener for pages entering and leaving a tier (KV events): on_tier(stored, tier,
        # node) with tier "l1" or "l2", called as the node's pages arrive or before they go
        self.on_tier = None

    # ---- lookup ---------------------------------------------------------------------------
    def match(self, tokens, *, lock: bool = False, scope: Scope | None = None) -> Match:
        """Longest cached whole-page prefix of ``tokens``: device part, then host-only part.
        ``lock``: also lock it, as ``lock(match)`` right after would (``Match.lock`` is the
        handle), in the same pass over the path. ``scope`` (``hicache.scope.Scope``; None:
        the shared scope): pages past its public ones match only pages cached in it."""
        arr = tree_tokens(tokens)
        self._clock += 1
        self.stats.matches += 1
        path = self.tree.walk(arr, scope=scope)
        dev, hst, hpages = path, [], _NO_IDS
        try:  # the common case, every node on the device: its pages in one join
            dpages = chain_pages(path, DEVICE_PAGES)
        except TypeError:  # a host-only node (no device pages) ends the device part
            k = 0
            while path[k].device is not None:
                k += 1
            dev = path[:k]
            for n in path[k:]:  # then the host-only part (host copies agreed complete)
                if n.device is not None or not n.host_valid:
                    break
                hst.append(n)
            dpages = chain_pages(dev, DEVICE_PAGES)
            if hst:
                hpages = chain_pages(hst, HOST_PAGES)
        waits: tuple[int, ...] = ()
        if self._ops:  # matched pages still being loaded
            waits = tuple(sorted({o for n in dev for o in n.pending
                                  if isinstance(self._ops[o].op, LoadOp)}))
        used = dev + hst if hst else dev  # the whole path (host-only nodes are valid copies)
        clock, dtouch, htouch = self._clock, self._dev.touch, self._hst.touch
        if not lock:
            for n in reversed(used):  # used now, leaf first: a parent then follows its
                n.last_access = clock  # children in the eviction order
                if n.device is not None:
                    dtouch(n)
                if n.host is not None:
                    htouch(n)
        else:  # the same, and each node locked (see ``lock``)
            newly = 0
            for n in reversed(used):
                n.last_access = clock
                if n.device is not None:
                    dtouch(n)
                    if not n.lock_ref:
                        newly += n.npages
                if n.host is not None:
                    htouch(n)
                n.lock_ref += 1
            self._locked_dev_pages += newly
        pt = self.page_tokens
        last = used[-1] if used else self.tree.root
        m = Match(pt * len(dpages), pt * len(hpages), dpages, hpages, tuple(dev), tuple(hst),
                  last, waits)
        if lock:
            m.lock = LockHandle(last, m.device_len + m.host_len, self.tree._missed)
        return m

    def peek(self, tokens, scope: Scope | None = None) -> tuple[int, int]:
        """``(device_len, host_len)`` that ``match(tokens, scope=scope)`` would return now, used
        for nothing: no LRU touch, no split, no stats (a scheduler asking whether a request
        would fit)."""
        dev = host = 0
        for n, pages in self.tree.covered(tree_tokens(tokens), scope):
            if n.device is not None and not host:
                dev += pages
            elif n.device is None and n.host_valid:
                host += pages
            else:
                break
        return self.page_tokens * dev, self.page_tokens * host

    # ---- locks ----------------------------------------------------------------------------
    def lock(self, target: "Match | Node") -> LockHandle:
        """Protect the path from the root to the match's last node from eviction (both tiers)."""
        node = target.last_node if isinstance(target, Match) else target
        if not isinstance(node, Node):
            raise UsageError(f"lock() takes a Match or a Node, got {type(target).__name__}")
        if not node.alive:
            raise UsageError(f"cannot lock node {node.nid}: it was evicted after the match")
        n, newly = node, 0  # newly: device pages of nodes this lock is the first on
        while n.parent is not None:
            if not n.lock_ref and n.device is not None:
                newly += n.npages
            n.lock_ref += 1
            n = n.parent
        self._locked_dev_pages += newly
        if isinstance(target, Match):  # the match's path ends at its last node
            return LockHandle(node, target.device_len + target.host_len)
        held, n = 0, node
        while n.parent is not None:
            held += n.npages
            n = n.parent
        return LockHandle(node, held * self.page_tokens)

    def unlock(self, handle: "LockHandle | Node") -> None:
        """Release one lock taken by ``lock`` (pass its handle, or the node it returned)."""
        self._held(handle, "unlock()")
        self._release(handle)

    @staticmethod
    def _held(handle: "LockHandle | Node", what: str) -> Node:
        """The node of a lock still held (UsageError naming ``what`` otherwise); changes
        nothing."""
        if isinstance(handle, LockHandle):
            if handle.released:
                raise UsageError(f"lock on node {handle.node.nid} was already released")
            node = handle.node
        elif isinstance(handle, Node):
            node = handle
        else:
            raise UsageError(f"{what} takes a LockHandle or Node, got {type(handle).__name__}")
        if node.parent is not None and node.lock_ref <= 0:
            raise UsageError(f"unlock of node {node.nid} without a matching lock")
        return node

    def _release(self, handle: "LockHandle | Node") -> None:
        """Release a lock ``_held`` checked."""
        if isinstance(handle, LockHandle):
            handle.released = True
            node = handle.node
        else:
            node = handle
        n, last = node, 0  # last: device pages of nodes this was the last lock on
        while n.parent is not None:
            n.lock_ref -= 1
            if not n.lock_ref and n.device is not None:
                last += n.npages
            n = n.parent
        self._locked_dev_pages -= last

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
        self._hst.add(node)
        op = BackupOp(self._new_op_id(), tuple(node.device.tolist()), tuple(host.tolist()))
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
        if not m.host_nodes:  # (the common case: nothing only on the host)
            return None
        nodes = [n for n in m.host_nodes if n.alive and n.device is None and n.host_valid]
        if not nodes:
            return None
        if m.last_node.lock_ref <= 0:
            raise UsageError("lock the match before load_back (its pages could be evicted)")
        need = sum(n.npages for n in nodes)
        if need * self.page_tokens < self.policy.load_back_threshold:
            return None
        pages = self._take(self.device, self.evict_device, need)
        if pages is None:
            return None
        op_id = self._new_op_id()
        i = 0
        for n in reversed(nodes):  # leaf first, then its ancestors: eviction order
            k = n.npages
            self._attach_device(n, pages[need - i - k:need - i])
            i += k
            n.pending.add(op_id)
        p = nodes[0].parent
        while p.parent is not None:
            if p.device is not None:
                self._dev.touch(p)
            p = p.parent
        op = LoadOp(op_id, tuple(chain_pages(nodes, HOST_PAGES).tolist()), tuple(pages.tolist()))
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
        ids = sorted({int(o) for o in op_ids})
        for o in ids:
            if o not in self._ops:
                raise UsageError(f"op {o} is not in flight (in flight: {self.inflight_ops()})")
        for o in ids:
            rec = self._ops.pop(o)
            for n in rec.nodes:
                n.pending.discard(o)
            if isinstance(rec.op, BackupOp):
                for n in rec.nodes:
                    if not n.host_valid:
                        n.host_valid = True
                        self._host_valid_pages += n.npages
                        if self.on_tier is not None:
                            self.on_tier(True, "l2", n)
                evicting = [n for n in rec.nodes if n.evicting]
                if len(evicting) > 1:
                    evicting.sort(key=lambda n: -n.depth())  # children first: each is a leaf
                for n in evicting:
                    n.evicting = False
                    self._evicting_pages -= n.npages
                    if n.lock_ref == 0 and not n.pending and not n.has_device_child():
                        self._demote(n)

    def agree(self, agreement, done: Iterable[int], extras=()):
        """One agreement step: in-flight op ids + this rank's finished ones -> ``complete``
        what every rank finished. Returns the agreement's result (its ``extras`` are MIN'd)."""
        if not self._ops and not extras and agreement.local:  # nothing to agree on
            return agreement.step((), done)
        res = agreement.step(self.inflight_ops(), done, extras,
                             digest=self.digest() if agreement.debug else None)
        self.complete(res.done_ops)
        return res

    def _on_split(self, top: Node, lower: Node) -> None:
        if lower.snaps:
            self.snaps.on_split(top, lower)
        for o in top.pending:
            self._ops[o].nodes.append(top)
        if lower.device is not None:
            self._dev.add(top)  # the walk that split touches it next
        if lower.host is not None:
            self._hst.add(top)

    # ---- introspection --------------------------------------------------------------------
    def digest(self) -> list[tuple]:
        """Everything that must be identical on every rank, as comparable entries."""
        head = [("clock", self._clock, "next_op", self._next_op, "inflight",
                 tuple(self.inflight_ops()), "device_used", self.device.num_used,
                 "host_used", self.host.num_used,
                 "req_pages", tuple(np.flatnonzero(self._request_map()).tolist()))]
        snaps = [("snapshots",) + self.snaps.digest()] if self.snaps is not None else []
        return head + snaps + self.tree.digest()

    def iter_nodes(self):
        return self.tree.iter_nodes()

    @property
    def request_pages(self) -> frozenset[int]:
        """Device pages handed out by alloc_device and not yet inserted or freed."""
        return frozenset(np.flatnonzero(self._request_map()).tolist())

    def cached_pages(self) -> tuple[int, int]:
        """(device pages held by the tree, valid host copies held by the tree); O(1)."""
        return self._dev_pages, self._host_valid_pages

    def evictable_pages(self) -> int:
        """Device pages held by unlocked tree nodes (free now, or once their backups or loads
        complete); O(1). Pages of running requests' locked prefixes are not counted."""
        return self._dev_pages - self._locked_dev_pages

    def check(self) -> None:
        """Raise InvariantError if the bookkeeping is inconsistent (tests, debug)."""
        invariants.check(self)
        if self.snaps is not None:
            self.snaps.check()
