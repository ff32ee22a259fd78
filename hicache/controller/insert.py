"""Insert: caching a request's whole pages along its walked path (check, then adopt).

A section of ``CacheController`` (a mixin: the state lives on the controller, made in its
``__init__``; request pages come from ``RequestPages``, backups from the transfer section).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hicache.controller.tree import DEVICE_PAGES, Node
from hicache.controller.types import NO_IDS as _NO_IDS, InsertResult, LockHandle
from hicache.errors import UsageError
from hicache.ids import INT64, join_ids, page_ids, tree_tokens
from hicache.scope import Scope


class _InsertPlan(NamedTuple):
    """What a checked insert will do (see ``Insert._check_insert``)."""
    cached: int                          # leading pages already in the tree (the walked path)
    dup: np.ndarray                      # int64: caller pages duplicating cached ones (freed)
    adopt: tuple[tuple[Node, int, int], ...]  # host-only path nodes taking pages[a:b]


_new_plan = tuple.__new__  # _new_plan(_InsertPlan, (...)): the plan without a Python frame


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    """The int64 arrays end to end: the one part itself, or a new array."""
    return parts[0] if len(parts) == 1 else join_ids(parts)


class Insert:
    """The insert section of ``CacheController``."""

    def insert(self, tokens, device_pages, *, after: LockHandle | None = None,
               scope: Scope | None = None, decoded: int = 0) -> InsertResult:
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
        before its pages) are walked from the root, as a plain insert does.

        ``scope``: the request's (``match``'s); its pages past the public ones are cached in
        it, under a leaf keyed by its tag.

        ``decoded``: how many tokens the request generated (its output, the ids after its
        prompt; 0: unknown, or none). The ``learned`` eviction order classes the request by it
        (a request that answered in a few tokens comes back more often on production traces);
        other orders ignore it. A negative or non-integer count is a UsageError."""
        if type(decoded) is not int:
            if not isinstance(decoded, (int, np.integer)) or isinstance(decoded, bool):
                raise UsageError(f"insert(decoded=) takes a token count, got "
                                 f"{type(decoded).__name__}")
            decoded = int(decoded)
        if decoded < 0:
            raise UsageError(f"insert(decoded=) takes a token count >= 0, got {decoded}")
        arr = tree_tokens(tokens)
        pages = page_ids(device_pages)
        pt = self.page_tokens
        whole = len(arr) // pt
        if not whole <= len(pages) <= whole + 1 or (len(pages) > whole and len(arr) % pt == 0):
            self._whole_pages(len(arr), len(pages))  # raises
        start, held, key = None, 0, None
        if after is not None:
            if type(after) is not LockHandle or after.released or after.node.lock_ref <= 0:
                if not isinstance(after, LockHandle):
                    raise UsageError(f"insert(after=) takes the LockHandle lock() returned, "
                                     f"got {type(after).__name__}")
                self._held(after, "insert(after=)")  # raises, but for the root's lock
            if after.prefix_len <= whole * pt:
                start, held, key = after.node, after.prefix_len, after.key
        path = self.tree.walk(arr, start, held, scope, key)
        self._clock += 1
        self.stats.inserts += 1
        plan = self._check_insert(path, pages)
        if start is None or self._hosted:  # (backups may evict: the lock holds till then)
            res = self._adopt(arr, pages, whole, path, plan, scope=scope, decoded=decoded)
            if after is not None:
                self._release(after)
            return res
        return self._adopt(arr, pages, whole, path, plan, after, scope, decoded)

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
            key = raw[len(held):]
            if key in self._grants:  # one alloc_device result, as handed out: taken unchecked
                self._grants.remove(key)
                return _new_plan(_InsertPlan, (cached, _NO_IDS, ()))
            dup, taken = _NO_IDS, pages[cached:]
        else:  # the caller computed some cached pages itself (e.g. a concurrent request's)
            part = pages[:cached]
            dup = part[part != np.frombuffer(held, INT64)]
            taken = join_ids([dup, pages[cached:]])  # in position order
            key = taken.tobytes()
        self._take_request_pages(taken, "insert", key)
        return _new_plan(_InsertPlan, (cached, dup, ()))

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
        return _InsertPlan(cached, _concat(dups) if dups else _NO_IDS, tuple(adopt))

    def _adopt(self, arr: np.ndarray, pages: np.ndarray, whole: int, path: list[Node],
               plan: "_InsertPlan", held: LockHandle | None = None,
               scope: Scope | None = None, decoded: int = 0) -> InsertResult:
        """Apply a checked insert (of the tokens ``arr``): host-only nodes on the
        path take the caller's pages, a new leaf takes the pages past the cached ones,
        duplicates and the tail's page are freed. ``held``: a lock on a node of ``path``,
        released in the same pass (only where nothing after it depends on the lock: with no
        host tier, no backup can evict host copies)."""
        for node, a, b in plan.adopt:
            self._attach_device(node, pages[a:b].copy())
        new_pages = whole - plan.cached
        old = len(path)
        if new_pages:
            self._grow(arr, pages, plan.cached, whole, path, scope)
        if self._learner is not None:  # classes before the touches below file the nodes
            self._learner.inserted(path, old, new_pages, self._clock, decoded)
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

    def _grow(self, arr: np.ndarray, pages: np.ndarray, cached: int, whole: int,
              path: list[Node], scope: Scope | None) -> None:
        """New leaves for pages ``[cached, whole)`` of ``arr`` below ``path``, appended to it:
        one leaf, or in a scope whose public pages end past ``cached``, a shared leaf for the
        rest of them and the scope's own leaf (keyed by its tag) for the pages after."""
        cuts = [(cached, whole, b"")]
        if scope is not None:
            bound = scope.public_pages
            if cached < bound < whole:
                cuts = [(cached, bound, b""), (bound, whole, scope.tag)]
            elif cached == bound:
                cuts = [(cached, whole, scope.tag)]
        pt = self.page_tokens
        for a, b, tag in cuts:
            leaf = self.tree.add_child(path[-1] if path else self.tree.root,
                                       arr[a * pt:b * pt], tag)
            self._attach_device(leaf, pages[a:b].copy())
            path.append(leaf)

    def _maybe_backup(self, node: Node) -> None:
        if (node.host is not None or node.device is None or node.pending
                or not self.host.num_pages):
            return
        w = self.policy.write
        if w == "write_through" or (w == "write_through_selective"
                                    and node.hits >= self.policy.selective_threshold):
            self._backup(node)

