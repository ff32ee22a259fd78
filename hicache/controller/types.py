"""Value types and errors of the cache controller (bookkeeping only: token ids and page ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hicache.ids import join_ids

if TYPE_CHECKING:  # pragma: no cover
    from hicache.controller.tree import Node

NO_IDS = np.zeros(0, np.int64)  # an empty int64 page-id array, shared (read-only)
NO_IDS.flags.writeable = False


class LockHandle:
    """What ``lock`` returns; release it exactly once (``unlock``, or ``insert(after=)``).
    ``prefix_len``: tokens of the prefix it holds (the root's path to ``node``). ``key``: the
    page key the match's walk missed, if any (a hint ``insert(after=)``'s walk reuses)."""

    __slots__ = ("node", "prefix_len", "released", "key")

    def __init__(self, node: "Node", prefix_len: int, key: "bytes | None" = None) -> None:
        self.node = node
        self.prefix_len = prefix_len
        self.released = False
        self.key = key


@dataclass(frozen=True)
class BackupOp:
    """Copy device pages to host pages (D2H), page i to page i. Host pages are not a valid copy
    until this op is agreed complete on every rank."""
    op_id: int
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]


@dataclass(frozen=True)
class LoadOp:
    """Copy host pages to device pages (H2D), page i to page i. The device pages stay pinned
    until this op is agreed complete; the engine waits on it locally per layer."""
    op_id: int
    host_pages: tuple[int, ...]
    device_pages: tuple[int, ...]


@dataclass(eq=False, slots=True)
class Match:
    """Result of ``match``: the longest cached whole-page prefix, by tier.

    Tokens ``[0, device_len)`` are on the device (``device_pages``), then
    ``[device_len, device_len + host_len)`` only on the host (``host_pages``). ``wait_ops`` are in-flight loads that some matched
    device pages still depend on. Page ids are int64 arrays (the caller's copy), one per page;
    ``device_pages`` can go straight into ``insert`` (``np.concatenate`` or ``list() +`` with
    ``alloc_device``'s pages). ``lock``: the match's lock, from ``match(tokens, lock=True)``
    (else None)."""
    device_len: int
    host_len: int
    device_pages: np.ndarray  # int64 [device_len // page_tokens]
    host_pages: np.ndarray    # int64 [host_len // page_tokens]
    device_nodes: tuple["Node", ...]
    host_nodes: tuple["Node", ...]
    last_node: "Node"
    wait_ops: tuple[int, ...] = ()
    lock: "LockHandle | None" = None

    @property
    def total_len(self) -> int:
        return self.device_len + self.host_len


class InsertResult:
    """Result of ``insert``: ``freed`` are the caller's pages the controller returned to the pool
    (pages duplicating cached ones, then a partial tail's page); ``device_pages`` are the tree's
    pages for the inserted whole pages as of the insert (use them instead of the freed ones;
    built on first use); ``last_node`` ends the path. Page ids are int64 arrays."""

    __slots__ = ("freed", "last_node", "new_pages", "_parts", "_pages")

    def __init__(self, freed: np.ndarray, parts: list[np.ndarray], last_node: "Node",
                 new_pages: int) -> None:
        self.freed = freed            # int64 [k]
        self.last_node = last_node
        self.new_pages = new_pages    # pages of the new leaf (0: all were cached)
        self._parts = parts           # the path's device page arrays, root side first
        self._pages: np.ndarray | None = None

    @property
    def device_pages(self) -> np.ndarray:
        """int64 [whole pages]: the tree's page of each inserted whole page."""
        if self._pages is None:
            self._pages = join_ids(self._parts)
        return self._pages


@dataclass
class ControllerStats:
    matches: int = 0
    inserts: int = 0
    device_evicted_pages: int = 0
    host_evicted_pages: int = 0
    backups: int = 0
    backup_pages: int = 0
    backups_skipped_pages: int = 0  # wanted a backup but L2 had no room
    loads: int = 0
    load_pages: int = 0
    dropped_pages: int = 0  # evicted from L1 with no host copy: gone
