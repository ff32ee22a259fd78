"""Radix tree over widened pages (``page_tokens = P * c`` token slots per page).

A node holds a run of whole pages (token ids as the bytes of an int32 array, ``ids.TOKEN``:
every vocabulary fits, and it halves what is copied, compared and held) plus, per tier, one page
id per page (an int64 array). Children are keyed by the bytes of their first page, so a walk
costs one dict lookup and one memcmp per node (``bytes.startswith`` against a memoryview of the
query: no copy of an int32 query, one conversion of any other); numpy locates the first
differing page only where a walk diverges inside a node. Only structure lives here (walk, split,
add, remove, digest); policies live in ``controller.py``.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Iterator, Sequence

import numpy as np

from hicache.checks import check_int
from hicache.errors import UsageError
from hicache.ids import INT64, TOKEN, TOKEN_BYTES, as_tokens, tree_tokens  # noqa: F401
                                          # (as_tokens: re-exported)
from hicache.scope import Scope


class Node:
    """One run of whole pages. ``device``/``host``: page ids (int64 [npages]), or None if not
    there."""

    __slots__ = ("nid", "parent", "children", "tokens", "npages", "device", "host", "host_valid",
                 "lock_ref", "hits", "last_access", "pending", "evicting", "alive", "snaps",
                 "scope", "chain", "rclass", "born", "span")

    def __init__(self, nid: int, parent: "Node | None", tokens: bytes, npages: int) -> None:
        self.nid = nid
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.tokens = tokens          # bytes of int32 [npages * page_tokens] (ids.TOKEN)
        self.npages = npages
        self.device: np.ndarray | None = None  # int64 [npages]
        self.host: np.ndarray | None = None    # int64 [npages]
        self.host_valid = False       # host pages hold an agreed-complete copy
        self.lock_ref = 0
        self.hits = 0
        self.last_access = 0
        self.pending: set[int] = set()  # in-flight op ids touching this node
        self.evicting = False         # free device pages once the pending backup completes
        self.alive = True
        self.snaps: dict | None = None  # hybrid models: page index -> snapshot (snapshots.py)
        self.scope = b""  # a scope's tag where its scoped part starts here (hicache.scope)
        self.chain: bytes | None = None  # its last page's chain hash, once asked (events)
        self.rclass = 0  # the learned eviction order's class of the insert that last used it
        self.born = -1   # ... and that insert's tick (-1: none)
        self.span = 0    # ... and how many pages that insert's path held

    def has_device_child(self) -> bool:
        for c in self.children.values():
            if c.device is not None:
                return True
        return False

    def depth(self) -> int:
        d, n = 0, self
        while n.parent is not None:
            d, n = d + 1, n.parent
        return d

    def __repr__(self) -> str:
        return (f"Node(nid={self.nid}, pages={self.npages}, device={self.device}, "
                f"host={self.host}, valid={self.host_valid}, lock={self.lock_ref})")


class RadixTree:
    """Structure of the page radix tree. Not thread-safe; deterministic."""

    def __init__(self, page_tokens: int) -> None:
        check_int(page_tokens, "page_tokens", error=UsageError)
        self.page_tokens = page_tokens
        self._next_id = 1
        self.root = Node(0, None, b"", 0)
        self.root.lock_ref = 1  # never evicted
        self.num_nodes = 0
        self.on_split = None  # callback(top, lower) so owners can re-point op records
        self.on_remove = None  # callback(node) for a removed node holding snapshots
        self._missed: bytes | None = None  # the page key a walk last looked up and missed

    def __del__(self) -> None:
        """Break the nodes' parent/child reference cycles, so a dropped tree's nodes (and
        their token bytes: most of its memory) are freed now, not at the next full collection
        of the cyclic GC."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}

    def _new_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def walk(self, arr: np.ndarray, start: "Node | None" = None, held: int = 0,
             scope: Scope | None = None, key: bytes | None = None) -> list[Node]:
        """``_walk`` in the shared scope (``scope`` None), else ``_walk_scoped``. ``key``: a
        hint, the page key an earlier walk of these tokens missed (``LockHandle.key``): used
        as the lookup key if it equals the page looked up (its hash is kept), else ignored.
        ``arr``: token ids in any form ``ids.tree_tokens`` takes (the controller's, an int32
        array, is walked in place; any other is converted once)."""
        arr = tree_tokens(arr)
        if scope is None:
            return self._walk(arr, start, held, key)
        return self._walk_scoped(arr, start, held, scope)

    def _walk_scoped(self, arr: np.ndarray, start: "Node | None", held: int,
                     scope: Scope) -> list[Node]:
        """``walk`` in ``scope``: the public pages in the shared tree (a node running past them
        is split there), then, from the node that ends them, the child keyed by the scope's
        tag and the first scoped page, then on below it as usual."""
        pt = self.page_tokens
        bound, whole = scope.bound(pt), len(arr) // pt * pt
        if held > bound:  # the walk starts inside the scoped part
            return self._walk(arr, start, held)
        path = self._walk(arr[:bound], start, held)
        if bound >= whole or sum(n.npages for n in path) * pt != bound:
            return path
        at = path[-1] if path else self.root
        q = arr[:whole].tobytes()
        a = bound * TOKEN_BYTES
        child = at.children.get(scope.tag + q[a:a + pt * TOKEN_BYTES])
        if child is None:
            return path
        e = a + len(child.tokens)
        if e > len(q) or not q.startswith(child.tokens, a):
            path.append(self._cut(child, q, a, min(e, len(q))))
            return path
        return self._walk(arr, child, bound + child.npages * pt)

    def _walk(self, arr: np.ndarray, start: "Node | None" = None, held: int = 0,
              key: bytes | None = None) -> list[Node]:
        """Nodes covering the longest cached whole-page prefix of ``arr`` (int32, contiguous:
        ``tree_tokens``), root excluded.

        With ``start`` (a node in the tree whose path from the root holds ``held`` tokens, at
        most ``arr``'s whole pages), the walk skips that prefix: the path is ``start``'s
        ancestors and itself (read off parent pointers, no lookups), then the nodes below it
        covering what follows. Only the prefix's last page is compared with ``arr``
        (UsageError naming the first token that differs, nothing changed): a caller holding
        a lock on what it matched passes the same tokens, and the page catches one that
        passes others (a suffix: tokens shifted by the prefix) without reading the whole
        prefix from memory again (that costs a tenth of a chat request).

        A node only partly covered is split, so the path ends exactly on the matched prefix.
        Per node: one dict lookup on the page's bytes and one memcmp of the node's tokens,
        against the query in place (a memoryview: no copy of the prompt)."""
        pt = self.page_tokens
        q = memoryview(arr).cast("B")
        if start is None or start is self.root:
            start, path, a = self.root, [], 0
        else:
            a, w = held * TOKEN_BYTES, pt * TOKEN_BYTES
            if not (w <= a <= len(arr) // pt * w and start.tokens.endswith(q[a - w:a])):
                raise UsageError(self._differs(arr, start, held))
            path, n = [], start
            while n.parent is not None:
                path.append(n)
                n = n.parent
            path.reverse()
        children = start.children
        if not children:  # (e.g. an insert below the leaf its request matched)
            return path
        total = len(arr) // pt * pt * TOKEN_BYTES  # bytes of the whole pages
        return self._walk_view(q, a, total, children, path, key)

    def _differs(self, arr: np.ndarray, start: Node, held: int) -> str:
        """Why the first ``held`` tokens of ``arr`` are not ``start``'s path's."""
        want = self.path_tokens(start)
        if len(want) != held:
            return f"node {start.nid}'s path holds {len(want)} tokens, not {held}"
        if len(arr) // self.page_tokens * self.page_tokens < held:
            return (f"the tokens' whole pages ({len(arr)} tokens) end inside the locked prefix "
                    f"({held} tokens)")
        got = np.asarray(arr[:held], np.int64)
        i = int(np.flatnonzero(got != want)[0])
        return (f"token {i} is {int(got[i])} but the locked prefix ({held} tokens, node "
                f"{start.nid}) has {int(want[i])} there: pass the tokens the prefix was matched "
                f"with, from the first")

    def _walk_view(self, q: memoryview, a: int, total: int, children: "dict[bytes, Node]",
                   path: list[Node], hint: bytes | None = None) -> list[Node]:
        """``walk`` on the query in place (``q``: its int32 bytes, not copied), from byte ``a``
        on; ``hint``: see ``walk``."""
        w = self.page_tokens * TOKEN_BYTES
        while a < total and children:
            if len(children) == 1:  # an only child is compared in place: no page key to hash
                (child,) = children.values()
                ct = child.tokens
                e = a + len(ct)
                if e <= total and not child.scope and ct.startswith(q[a:e]):
                    path.append(child)
                    a = e
                    children = child.children
                    continue
                if child.scope or not ct.startswith(q[a:a + w]):  # its key differs
                    break
            else:
                if hint is not None and len(hint) == w and hint.startswith(q[a:a + w]):
                    key = hint  # the same page: its hash is not computed again
                else:
                    key = q[a:a + w].tobytes()
                hint = None
                child = children.get(key)
                if child is None:
                    self._missed = key  # (its hash is kept: add_child may key a leaf by it)
                    break
                ct = child.tokens
                e = a + len(ct)
                if e <= total and ct.startswith(q[a:e]):  # the whole node matches
                    path.append(child)
                    a = e
                    children = child.children
                    continue
            path.append(self._cut(child, q, a, min(e, total)))
            break
        return path

    def _cut(self, child: Node, q, a: int, e: int) -> Node:
        """``child`` matched by its first page at query byte ``a``, but not whole: the query
        (bytes-like ``q``) ends at byte ``e`` inside it or differs before. Returns the child
        split after the pages that match."""
        pt = self.page_tokens
        m = (e - a) // (pt * TOKEN_BYTES)  # pages of the node the query covers
        k = 1  # the lookup matched the first page
        if m > 1:
            ne = (np.frombuffer(q, TOKEN, m * pt, a)
                  != np.frombuffer(child.tokens, TOKEN, m * pt))
            k = int(ne.argmax()) // pt if ne.any() else m
        return self.split(child, k) if k < child.npages else child

    def split(self, node: Node, k: int) -> Node:
        """Split ``node`` after ``k`` pages; returns the new upper node (the original object
        keeps the lower part, so locks and op records that point to it stay valid)."""
        w = self.page_tokens * TOKEN_BYTES
        top = Node(self._new_id(), node.parent, node.tokens[:k * w], k)
        top.scope, node.scope = node.scope, b""  # the scope enters at the upper part
        node.tokens = node.tokens[k * w:]
        node.npages -= k
        if node.device is not None:
            top.device, node.device = node.device[:k], node.device[k:]
        if node.host is not None:
            top.host, node.host = node.host[:k], node.host[k:]
        top.host_valid = node.host_valid
        top.lock_ref, top.hits, top.last_access = node.lock_ref, node.hits, node.last_access
        top.rclass, top.born, top.span = node.rclass, node.born, node.span
        top.pending = set(node.pending)
        top.evicting = node.evicting
        parent = node.parent
        parent.children[top.scope + top.tokens[:w]] = top
        top.children[node.tokens[:w]] = node
        node.parent = top
        self.num_nodes += 1
        if self.on_split is not None:
            self.on_split(top, node)
        return top

    def covered(self, arr: np.ndarray, scope: Scope | None = None) -> list[tuple[Node, int]]:
        """The nodes ``walk(arr, scope=scope)`` would return, each with how many of its pages
        ``arr`` covers (all but maybe the last's), splitting none: a read-only walk (no fast
        path: for questions asked once per request, like ``CacheController.peek``)."""
        w = self.page_tokens * TOKEN_BYTES
        total = len(arr) // self.page_tokens * w
        q = tree_tokens(arr)[:total // TOKEN_BYTES].tobytes()
        tag, enter = ((scope.tag, scope.bound(self.page_tokens) * TOKEN_BYTES) if scope
                      else (b"", -1))
        a, out, children = 0, [], self.root.children
        while a < total:
            child = children.get((tag if a == enter else b"") + q[a:a + w])
            if child is None:
                break
            ct = child.tokens
            if a < enter < a + len(ct):  # a shared node past the public pages: the scope's
                k = 1                      # part cannot hang inside it
                while (a + (k + 1) * w <= enter
                       and q[a + k * w:a + (k + 1) * w] == ct[k * w:(k + 1) * w]):
                    k += 1
                out.append((child, k))
                break
            if q.startswith(ct, a):
                out.append((child, child.npages))
                a += len(ct)
                children = child.children
                continue
            k = 1  # the first page matched (the key); count the pages after it that do
            while a + (k + 1) * w <= total and q[a + k * w:a + (k + 1) * w] == ct[k * w:(k + 1) * w]:
                k += 1
            out.append((child, k))
            break
        return out

    def add_child(self, parent: Node, tokens: np.ndarray, tag: bytes = b"") -> Node:
        """New leaf under ``parent`` for ``tokens`` (ints, whole pages); ``tag``: a scope's,
        where the scoped part of a chain starts at this leaf."""
        pt = self.page_tokens
        kb = (tokens if tokens.dtype is TOKEN else tree_tokens(tokens)).tobytes()
        node = Node(self._next_id, parent, kb, len(tokens) // pt)
        self._next_id += 1
        node.scope = tag
        key, self._missed = self._missed, None  # the page a walk just missed, if it is this
        w = pt * TOKEN_BYTES
        if tag or key is None or len(key) != w or not kb.startswith(key):  # the leaf's: not
            key = tag + kb[:w]
        parent.children[key] = node
        self.num_nodes += 1
        return node

    def remove_leaf(self, node: Node) -> None:
        assert not node.children and node is not self.root
        del node.parent.children[node.scope + node.tokens[:self.page_tokens * TOKEN_BYTES]]
        if node.snaps and self.on_remove is not None:
            self.on_remove(node)
        node.alive = False
        self.num_nodes -= 1

    def iter_nodes(self) -> Iterator[Node]:
        """Every node but the root, depth-first, children in key order (deterministic)."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                yield n
            stack.extend(n.children[k] for k in sorted(n.children, reverse=True))

    def path_tokens(self, node: Node) -> np.ndarray:
        parts = []
        while node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return np.frombuffer(b"".join(parts[::-1]), TOKEN)

    def digest(self) -> list[tuple]:
        """One comparable entry per node (depth-first, key order): what must agree across ranks."""
        out = []
        stack = [(self.root, 0)]
        while stack:
            n, d = stack.pop()
            if n is not self.root:
                h = hashlib.blake2b(n.scope + n.tokens, digest_size=8).hexdigest()
                out.append((d, n.npages, h,
                            tuple(n.device.tolist()) if n.device is not None else None,
                            tuple(n.host.tolist()) if n.host is not None else None, n.host_valid,
                            n.lock_ref, n.hits, n.last_access, tuple(sorted(n.pending)),
                            n.evicting))
            stack.extend((n.children[k], d + 1) for k in sorted(n.children, reverse=True))
        return out


DEVICE_PAGES = operator.attrgetter("device")  # node -> its device page ids (C calls in map:
HOST_PAGES = operator.attrgetter("host")      # no Python frame per node)


def chain_pages(nodes: Sequence[Node], tier: "operator.attrgetter") -> np.ndarray:
    """The nodes' page ids of one tier (``DEVICE_PAGES`` or ``HOST_PAGES``), end to end (a new
    writable int64 array: one C join of their bytes, every node's array being contiguous);
    TypeError if a node is not on that tier."""
    if len(nodes) == 1:  # (the common path: one node; a copy costs a third of the join)
        pages = tier(nodes[0])
        if pages is None:
            raise TypeError("the node is not on that tier")
        return pages.copy()
    return np.frombuffer(bytearray().join(map(tier, nodes)), INT64)
