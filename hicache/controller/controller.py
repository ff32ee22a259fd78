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

from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Union

import numpy as np

from hicache.controller.order import EvictionOrder
from hicache.controller.policy import controller_policy
from hicache.controller.tree import DEVICE_PAGES, HOST_PAGES, Node, RadixTree, chain_pages
from hicache.controller.types import BackupOp, ControllerStats, InsertResult, LoadOp, Match
from hicache.checks import check_int
from hicache.errors import DeviceFullError, InvariantError, UsageError
from hicache.ids import INT64, as_tokens, join_ids, page_ids
from hicache.pages import PageAllocator

Op = Union[BackupOp, LoadOp]
_NO_IDS = np.zeros(0, np.int64)
_NO_IDS.flags.writeable = False
_MAX_GRANTS = 4096


class LockHandle:
    """What ``lock`` returns; release it exactly once (``unlock``, or ``insert(after=)``).
    ``prefix_len``: tokens of the prefix it holds (the root's path to ``node``)."""

    __slots__ = ("node", "prefix_len", "released")

    def __init__(self, node: Node, prefix_len: int) -> None:
        self.node = node
        self.prefix_len = prefix_len
        self.released = False


@dataclass
class _OpRecord:
    op: Op
    nodes: list[Node]


class _InsertPlan(NamedTuple):
    """What a checked insert will do (see ``CacheController._check_insert``)."""
    cached: int                          # leading pages already in the tree (the walked path)
    dup: np.ndarray                      # int64: caller pages duplicating cached ones (freed)
    adopt: list[tuple[Node, int, int]]   # host-only path nodes taking pages[a:b]
    taken: np.ndarray                    # int64: every request page the insert takes


def _all_set(flags: np.ndarray) -> bool:
    """Whether every entry of the bool array ``flags`` is True (a byte scan: a fraction of
    the fixed cost of ``ndarray.all``)."""
    return b"\0" not in flags.tobytes()


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """The int64 arrays end to end: the one part itself, or a new array."""
    return parts[0] if len(parts) == 1 else join_ids(parts)


class CacheController:
    """Radix tree over widened pages of ``page_tokens`` (= P * c) token slots, with
    ``device_pages`` L1 pages and ``host_pages`` L2 pages.

    Capacities and page ids count widened pages; lengths (``Match.device_len`` ...) count
    tokens. Page ids go in as any integer sequence or buffer and come out as int64 arrays."""

    def __init__(self, page_tokens: int, device_pages: int, host_pages: int, *,
                 policy=None, **settings) -> None:
        """``policy``: the policy file's ``[policy]`` section (``HiCacheConfig.policy``);
        keyword ``settings`` (write, eviction, selective_threshold, load_back_threshold) override
        its fields, checked against the policy file's choices and ranges (ConfigError)."""
        self.policy = controller_policy(policy, settings)
        self.tree = RadixTree(page_tokens)
        self.tree.on_split = self._on_split
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
        lfu = self.policy.eviction == "lfu"
        self._dev = EvictionOrder(lfu)  # nodes with device pages, eviction order
        self._hst = EvictionOrder(lfu)  # nodes with host pages, eviction order
        self._dev_pages = 0             # device pages held by tree nodes
        self._locked_dev_pages = 0      # ... of them in locked nodes
        self._host_valid_pages = 0      # valid host copies held by tree nodes
        self._ops: dict[int, _OpRecord] = {}       # in flight
        self._new_ops: list[Op] = []               # not yet taken
        self._next_op = 0
        self._evicting_pages = 0        # device pages freed once their write_back backups land

    # ---- lookup ---------------------------------------------------------------------------
    def match(self, tokens, *, lock: bool = False) -> Match:
        """Longest cached whole-page prefix of ``tokens``: device part, then host-only part.
        ``lock``: also lock it, as ``lock(match)`` right after would (``Match.lock`` is the
        handle), in the same pass over the path."""
        arr = as_tokens(tokens, int64=False)
        self._clock += 1
        self.stats.matches += 1
        path = self.tree.walk(arr)
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
            m.lock = LockHandle(last, m.device_len + m.host_len)
        return m

    def peek(self, tokens) -> tuple[int, int]:
        """``(device_len, host_len)`` that ``match(tokens)`` would return now, used for nothing:
        no LRU touch, no split, no stats (a scheduler asking whether a request would fit)."""
        dev = host = 0
        for n, pages in self.tree.covered(as_tokens(tokens, int64=False)):
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

    # ---- device pages ---------------------------------------------------------------------
    def alloc_device(self, n: int, *, as_array: bool = False) -> "list[int] | np.ndarray":
        """``n`` device pages for new tokens, evicting unlocked leaves if needed; as a list of
        ints, or with ``as_array`` as a fresh int64 array (no Python int per page: with
        ``np.concatenate`` after ``Match.device_pages``, what ``insert`` takes fastest)."""
        if type(n) is not int or n < 0:
            check_int(n, "number of device pages", 0, error=UsageError)
        if not n:
            return np.zeros(0, np.int64) if as_array else []
        pages = self._take(self.device, self.evict_device, n)
        if pages is None:
            raise DeviceFullError(n, self.device.num_free, self.device.num_pages,
                                  pending=self._evicting_pages)
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
        self._dev.add(n)
        self._dev_pages += n.npages
        if n.lock_ref:
            self._locked_dev_pages += n.npages

    def _detach_device(self, n: Node) -> int:
        """Free the node's device pages; returns how many."""
        self.device.free_array(n.device, trusted=True)
        n.device = None
        self._dev.remove(n)
        k = n.npages
        self._dev_pages -= k
        if n.lock_ref:
            self._locked_dev_pages -= k
        return k

    # ---- insert ---------------------------------------------------------------------------
    def insert(self, tokens, device_pages, *, after: LockHandle | None = None) -> InsertResult:
        """Cache the whole pages of ``tokens``, whose KV is in ``device_pages``: one page per
        whole page, optionally followed by the partial tail's page, which is freed (a request
        that continues decoding keeps its tail page by not passing it). Pages duplicating
        cached ones are freed too; ``freed`` lists both. Any integer sequence or buffer of page
        ids is accepted (``Match.device_pages`` plus ``alloc_device``'s list, an int64 array,
        ``array('q')`` ...). Nothing changes when the pages are refused.

        ``after``: the request's lock (``Match.lock`` from ``match(tokens, lock=True)``, or
        what ``lock(match)`` returned), released by the insert (a refused one keeps it):
        the same result, state and refusals as ``insert(tokens, device_pages)`` then
        ``unlock(after)``, with the same ``tokens`` and ``device_pages`` (from the first
        token: those the prefix was matched with), but the walk skips the locked prefix (an
        offset, nothing copied): its nodes are read off parent pointers, with no lookups, and
        only its last page is compared with ``tokens`` (tokens that differ there are refused:
        UsageError naming the first token that differs; a suffix past the prefix, say).
        Tokens whose whole pages end inside the locked prefix (a request aborted or finished
        before its pages) are walked from the root, as a plain insert does."""
        arr = as_tokens(tokens, int64=False)
        pages = page_ids(device_pages)
        pt = self.page_tokens
        whole = len(arr) // pt
        if not whole <= len(pages) <= whole + 1 or (len(pages) > whole and len(arr) % pt == 0):
            self._whole_pages(len(arr), len(pages))  # raises
        start, held = None, 0
        if after is not None:
            if type(after) is not LockHandle or after.released or after.node.lock_ref <= 0:
                if not isinstance(after, LockHandle):
                    raise UsageError(f"insert(after=) takes the LockHandle lock() returned, "
                                     f"got {type(after).__name__}")
                self._held(after, "insert(after=)")  # raises, but for the root's lock
            if after.prefix_len <= whole * pt:
                start, held = after.node, after.prefix_len
        path = self.tree.walk(arr, start, held)
        self._clock += 1
        self.stats.inserts += 1
        plan = self._check_insert(path, pages)
        if start is None or self._hosted:  # (backups may evict: the lock holds till then)
            res = self._adopt(arr, pages, whole, path, plan)
            if after is not None:
                self._release(after)
            return res
        return self._adopt(arr, pages, whole, path, plan, after)

    def _whole_pages(self, n_tokens: int, n_pages: int) -> int:
        pt = self.page_tokens
        whole = n_tokens // pt
        if not whole <= n_pages <= -(-n_tokens // pt):
            raise UsageError(f"insert of {n_tokens} tokens ({whole} whole pages of {pt}) "
                             f"got {n_pages} device pages; pass one per whole page, "
                             f"optionally plus one for a partial tail")
        return whole

    def _check_insert(self, path: list[Node], pages: np.ndarray) -> "_InsertPlan":
        """Validate an insert along its walked ``path``; a refusal changes nothing, and once
        accepted the request pages it takes stop being request pages. At each position the
        caller's page is the cached node's own page there, or a request page the insert takes:
        one duplicating a cached page (freed), one for a host-only node the caller recomputed
        (adopted), a new page or the tail's. No request page may repeat."""
        raw = pages.tobytes()  # the caller's pages as bytes: compares without numpy calls
        try:  # the common case, every path node on the device: the path's pages in one join
            held = b"".join(map(DEVICE_PAGES, path))
        except TypeError:  # a host-only node on the path (no device pages)
            return self._check_insert_nodes(path, pages, raw)
        cached = len(held) // 8
        if raw.startswith(held):  # the cached pages are the caller's own: new pages only
            dup, taken, key = _NO_IDS, pages[cached:], raw[len(held):]
        else:  # the caller computed some cached pages itself (e.g. a concurrent request's)
            part = pages[:cached]
            dup = part[part != np.frombuffer(held, INT64)]
            taken = join_ids([dup, pages[cached:]])  # in position order
            key = taken.tobytes()
        self._take_request_pages(taken, "insert", key)
        return _InsertPlan(cached, dup, [], taken)

    def _check_insert_nodes(self, path: list[Node], pages: np.ndarray,
                            raw: bytes) -> "_InsertPlan":
        """``_check_insert`` node by node, for a path with host-only nodes."""
        cached = 0
        dups: list[np.ndarray] = []
        adopt: list[tuple[Node, int, int]] = []
        for node in path:
            end = cached + node.npages
            if node.device is None:
                adopt.append((node, cached, end))
            elif raw[8 * cached:8 * end] != node.device.tobytes():
                part = pages[cached:end]
                dups.append(part[part != node.device])
            cached = end
        taken = dups + [pages[a:b] for _, a, b in adopt]
        if len(pages) > cached:
            taken.append(pages[cached:])
        idx = _concat(taken) if taken else _NO_IDS
        self._take_request_pages(idx, "insert")
        return _InsertPlan(cached, _concat(dups) if dups else _NO_IDS, adopt, idx)

    def _adopt(self, arr: np.ndarray, pages: np.ndarray, whole: int, path: list[Node],
               plan: "_InsertPlan", held: LockHandle | None = None) -> InsertResult:
        """Apply a checked insert (of the tokens ``arr``): host-only nodes on the
        path take the caller's pages, a new leaf takes the pages past the cached ones,
        duplicates and the tail's page are freed. ``held``: a lock on a node of ``path``,
        released in the same pass (only where nothing after it depends on the lock: with no
        host tier, no backup can evict host copies)."""
        for node, a, b in plan.adopt:
            self._attach_device(node, pages[a:b].copy())
        new_pages = whole - plan.cached
        if new_pages:
            pt = self.page_tokens
            leaf = self.tree.add_child(path[-1] if path else self.tree.root,
                                       arr[plan.cached * pt:whole * pt])
            self._attach_device(leaf, pages[plan.cached:whole].copy())
            path.append(leaf)
        clock, dtouch, htouch = self._clock, self._dev.touch, self._hst.touch
        k = 0  # path[:k]: the nodes ``held`` locks
        if held is not None:
            held.released = True
            if held.node.parent is not None:
                k = path.index(held.node) + 1
        for node in reversed(path[k:]):  # used now, leaf first (as in match), each counted
            node.hits += 1                # before it is touched: LFU files a node by its count
            node.last_access = clock
            if node.device is not None:
                dtouch(node)
            if node.host is not None:
                htouch(node)
        if k:  # the same, and each unlocked (see ``unlock``)
            last = 0
            for node in reversed(path[:k]):
                node.hits += 1
                node.last_access = clock
                if node.device is not None:
                    dtouch(node)
                if node.host is not None:
                    htouch(node)
                node.lock_ref -= 1
                if not node.lock_ref and node.device is not None:
                    last += node.npages
            self._locked_dev_pages -= last
        if self._hosted:
            for node in path:
                self._maybe_backup(node)
        freed = plan.dup
        if len(pages) > whole:
            freed = join_ids([freed, pages[whole:]])
        if len(freed):  # (a new array: the caller's pages stay the caller's)
            self.device.free_array(freed, trusted=True)
        return InsertResult(freed, list(map(DEVICE_PAGES, path)),
                            path[-1] if path else self.tree.root, new_pages)

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
        for o in top.pending:
            self._ops[o].nodes.append(top)
        if lower.device is not None:
            self._dev.add(top)  # the walk that split touches it next
        if lower.host is not None:
            self._hst.add(top)

    # ---- eviction -------------------------------------------------------------------------
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
            self.tree.remove_leaf(x)
        self.stats.device_evicted_pages += k
        self.stats.dropped_pages += k
        return k

    def _drop_host(self, n: Node) -> int:
        self.host.free_array(n.host, trusted=True)
        k = len(n.host)
        self.stats.host_evicted_pages += k
        if n.host_valid:
            self._host_valid_pages -= k
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
                    self.tree.remove_leaf(n)
            if not progress:
                break
        return freed

    # ---- introspection --------------------------------------------------------------------
    def digest(self) -> list[tuple]:
        """Everything that must be identical on every rank, as comparable entries."""
        head = [("clock", self._clock, "next_op", self._next_op, "inflight",
                 tuple(self.inflight_ops()), "device_used", self.device.num_used,
                 "host_used", self.host.num_used,
                 "req_pages", tuple(np.flatnonzero(self._request_map()).tolist()))]
        return head + self.tree.digest()

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
        dev_seen: set[int] = set(np.flatnonzero(self._request_page).tolist())
        for g in self._grants:  # disjoint from each other and from the map
            gp = np.frombuffer(g, np.int64).tolist()
            if not len(gp) or not dev_seen.isdisjoint(gp) or len(set(gp)) != len(gp):
                raise InvariantError("a grant holds pages another grant or the request-page "
                                     "map holds")
            dev_seen.update(gp)
        host_seen: set[int] = set()
        dev_nodes, host_nodes = set(), set()
        evicting = dev_pages = locked = host_valid = 0
        for n in self.iter_nodes():
            if not n.alive:
                raise InvariantError(f"dead node {n.nid} still in the tree")
            if n.device is None and n.host is None:
                raise InvariantError(f"node {n.nid} holds no data")
            if len(n.tokens) != n.npages * self.page_tokens * 8:
                raise InvariantError(f"node {n.nid} token count != pages")
            if n.device is not None:
                dev_nodes.add(n)
                dev_pages += n.npages
                locked += n.npages if n.lock_ref else 0
                if len(n.device) != n.npages or n.device.dtype != np.int64:
                    raise InvariantError(f"node {n.nid} device page count or dtype")
                if n.parent.parent is not None and n.parent.device is None:
                    raise InvariantError(f"node {n.nid} on device under a host-only parent")
                for p in n.device.tolist():
                    if p in dev_seen:
                        raise InvariantError(f"device page {p} owned twice")
                    dev_seen.add(p)
            if n.host is not None:
                host_nodes.add(n)
                host_valid += n.npages if n.host_valid else 0
                if len(n.host) != n.npages:
                    raise InvariantError(f"node {n.nid} host page count")
                if not n.host_valid and (not n.pending or n.device is None):
                    raise InvariantError(f"node {n.nid} has an invalid host copy with no backup")
                for p in n.host.tolist():
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
        if host_seen != set(self.host.used_ids().tolist()):
            raise InvariantError(f"host pool's allocated pages ({self.host.num_used}) != the "
                                 f"{len(host_seen)} held by the tree")
        if dev_nodes != set(self._dev) or host_nodes != set(self._hst) \
                or len(self._dev) != len(dev_nodes) or len(self._hst) != len(host_nodes):
            raise InvariantError("tier eviction orders disagree with the tree")
        if (dev_pages, locked, host_valid) != (self._dev_pages, self._locked_dev_pages,
                                               self._host_valid_pages):
            raise InvariantError(f"page counters (device, locked, host valid) "
                                 f"{(self._dev_pages, self._locked_dev_pages)}, "
                                 f"{self._host_valid_pages} != {(dev_pages, locked, host_valid)}")
        if evicting != self._evicting_pages:
            raise InvariantError(f"evicting pages {self._evicting_pages} != {evicting}")
