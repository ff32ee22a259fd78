"""``DraftPages``: the draft KV's companion pages of one rank, in every tier, under the target's
page ids (speculative decoding; docs/speculative.md, "The cache holds both").

The draft's KV has a REPLICATED ``PageFormat`` (``hicache.spec_format``): every DCP rank holds
all ``P*c`` rows of a page. Device page ``p`` of the target has a companion draft page ``p``:

- L1: ``l1``, a ``DeviceKVPool`` on a ``DCPLayout(1, 0, P*c)`` with the target pool's page
  count. The engine's drafter runs on it (``hicache.engine.spec.replicated_runner(pool=...)``)
  and its request shares the target's page table, so draft page ``p`` holds the positions of
  target page ``p``. ``l1_has[p]``: the draft KV of every position of page ``p`` is there.
  A page handed out afresh has none; ``finish(draft_len=n)`` marks the request's own whole
  pages below ``n`` (a prefix written by a run without speculation has none).
- L2: ``l2``, ``[host pages, layers, P*c, width]`` (a page-major ``HostKVPool``, pinned as the
  policy's ``l2.pin`` says) beside the target's host pool, with ``l2_has``. A
  backup (D2H) or load-back (H2D) of target pages copies their draft pages too, at launch
  (the pages are immutable while the op is in flight), presence with them.
- L3: a draft page is stored ONCE for the whole DCP group: rank 0 writes (among TP replicas,
  the page's writer, as for the target), every rank reads the same key. Rank 0's writes go
  through a ``CompanionWriter`` (a background ``AsyncWriter`` over the draft's store, beside
  the target's): no store round trip in ``step``; ``TierIO`` agrees its errors and flushes it
  with the target's writer. The namespace signs
  the draft format and the draft (``DraftSpec.signature``: the MTP module or the draft
  weights) beside the target's weights, so another draft never hits.

Presence is replicated: L1/L2 flags follow the replicated controller's ops; an L3 read's page
count is MIN-agreed by the service with the target's prefetch (``signal``), so every rank
restores the same draft pages and proposes the same drafts (the target's verify is a
collective). No collective here, no controller import (tests/test_layering.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .errors import UsageError
from .l1.pool import DeviceKVPool
from .l2.pool import HostKVPool
from .layout import DCPLayout
from .page_format import PageFormat, PageKind

log = logging.getLogger("hicache")

__all__ = ["DraftSpec", "DraftPages", "DraftRead", "build_draft_pages", "draft_need"]


@dataclass(frozen=True)
class DraftSpec:
    """What the cache keeps beside the target: the draft's page format (replicated, ``P*c``
    rows) and a signature naming the draft (the MTP module or the draft's weights)."""

    format: PageFormat
    signature: str
    pairs_next: bool = False  # MTP: a page's last row also depends on the token after it

    def __post_init__(self) -> None:
        if not isinstance(self.format, PageFormat) or self.format.kind is not PageKind.REPLICATED:
            raise UsageError(f"a draft's page format must be replicated, got {self.format!r}")
        if not isinstance(self.signature, str) or not self.signature:
            raise UsageError("a draft needs a signature (its weights or MTP module identity)")


@dataclass
class DraftRead:
    """A request's L3 draft read: ``pages`` leading pages found (this rank) in ``staging``."""

    pages: int
    staging: torch.Tensor
    next_tokens: Optional[list] = None  # pairs_next: the token after each page read


@dataclass
class DraftStats:
    bytes: dict = field(default_factory=lambda: {"d2h": 0, "h2d": 0, "l3_read": 0,
                                                 "l3_write": 0})
    pages: dict = field(default_factory=lambda: {"d2h": 0, "h2d": 0, "l3_read": 0,
                                                 "l3_write": 0})


class DraftPages:
    """One rank's draft companion pages in L1, L2 and (optionally) L3."""

    def __init__(self, spec: DraftSpec, page_tokens: int, device_pages: int, host_pages: int,
                 device=None, pin: str = "auto") -> None:
        fmt = spec.format
        if fmt.rows != page_tokens:
            raise UsageError(f"draft format {fmt.describe()} has {fmt.rows} rows a page; the "
                             f"cache's widened page has {page_tokens}")
        self.spec, self.format, self.page_tokens = spec, fmt, page_tokens
        self.l1 = DeviceKVPool.for_format(DCPLayout(1, 0, page_tokens), fmt, device_pages,
                                          device=device)
        # page-major [host pages, layers, P*c, width], pinned like the target's L2 (l2.pin)
        self.l2_pool = HostKVPool.for_format(DCPLayout(1, 0, page_tokens), fmt,
                                             max(host_pages, 1), layout_kind="page_first",
                                             pin=pin)
        self.l2 = self.l2_pool.buf
        self.l1_has = np.zeros(device_pages, dtype=bool)
        self.l2_has = np.zeros(max(host_pages, 1), dtype=bool)
        # pairs_next: the token after the page its last row was computed with (-1: unknown)
        self.l1_next = np.full(device_pages, -1, dtype=np.int64)
        self.l2_next = np.full(max(host_pages, 1), -1, dtype=np.int64)
        self.store = None        # GuardedStore of the draft namespace (L3 on)
        self.namespace = None
        self.writes = False      # this rank writes the group's draft pages to L3
        self.writer = None       # rank 0: CompanionWriter of ``store`` (hicache.l3.companion)
        self._reads = None       # L3 on: the thread that reads at admission (``start_read_l3``)
        self._lock = threading.Lock()  # ``stats``: the writer's thread counts L3 writes
        self.stats = DraftStats()

    # ---- L1 presence ---------------------------------------------------------------------------
    def forget(self, pages: Sequence[int]) -> None:
        """Pages handed out afresh hold no draft KV."""
        self.l1_has[np.asarray(pages, dtype=np.int64)] = False

    def mark(self, pages: Sequence[int], next_tokens: Optional[Sequence[int]] = None) -> None:
        """The draft KV of every position of ``pages`` was written (``pairs_next``: with
        ``next_tokens[i]`` after page i; -1 where unknown leaves that page unmarked)."""
        p = np.asarray(pages, dtype=np.int64)
        if self.spec.pairs_next:
            nxt = np.asarray(next_tokens, dtype=np.int64)
            p, nxt = p[nxt >= 0], nxt[nxt >= 0]
            self.l1_next[p] = nxt
        self.l1_has[p] = True

    def present_pages(self, pages: Sequence[int], tokens: Optional[np.ndarray] = None) -> int:
        """How many of ``pages`` (the device pages of a prefix of ``tokens``, in order) have
        their draft KV for these tokens, counted from the first until one lacks it. With
        ``pairs_next`` a page's last row counts only if it was computed with the token that
        follows the page here (``tokens[(i + 1) * P*c]``)."""
        p = np.asarray(pages, dtype=np.int64)
        has = self.l1_has[p]
        if self.spec.pairs_next:
            ends = (np.arange(p.size) + 1) * self.page_tokens
            ok = ends < len(tokens)
            nxt = np.full(p.size, -2, dtype=np.int64)
            nxt[ok] = np.asarray(tokens)[ends[ok]]
            has = has & (self.l1_next[p] == nxt)
        return int(has.size if has.all() else np.argmin(has))

    def _view(self) -> torch.Tensor:
        """``l1`` as ``[layers, pages, rows, width]``."""
        f = self.format
        return self.l1.kv.view(f.layers, self.l1.num_pages, f.rows, f.row_width)

    # ---- L2: beside the target's backups and load-backs ----------------------------------------
    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        d, h = np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64)
        has = self.l1_has[d]
        self.l2_has[h] = has
        self.l2_next[h] = self.l1_next[d]
        if has.any():
            src = self._view()[:, torch.as_tensor(d[has])].transpose(0, 1).cpu()
            self.l2[torch.as_tensor(h[has])] = src
            self._count("d2h", int(has.sum()))

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        d, h = np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64)
        has = self.l2_has[h]
        self.l1_has[d] = has
        self.l1_next[d] = self.l2_next[h]
        if has.any():
            src = self.l2[torch.as_tensor(h[has])].transpose(0, 1).to(self.l1.device)
            self._view()[:, torch.as_tensor(d[has], device=self.l1.device)] = src
            self._count("h2d", int(has.sum()))

    def _count(self, what: str, pages: int) -> None:
        with self._lock:
            self.stats.pages[what] += pages
            self.stats.bytes[what] += pages * self.format.page_bytes

    # ---- L3: one copy for the whole DCP group --------------------------------------------------
    def open_l3(self, open_store, namespace, rank: int) -> None:
        """``open_store(namespace)``: a store (GuardedStore) whose keys carry rank 0 on every
        rank (one copy per group); rank 0 writes."""
        from .l3.companion import CompanionWriter
        self.namespace, self.writes = namespace, rank == 0
        self.store = open_store(namespace)
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-draft-read")
        if self.writes:
            self.writer = CompanionWriter(self.store, lambda n: self._count("l3_write", n))

    def _keys(self, chains: Sequence[bytes], next_tokens=None) -> list[bytes]:
        """Rank 0's keys of ``chains`` (``pairs_next``: each chain salted with the token after
        its page, so a page computed before another next token never hits)."""
        from .l3 import keys_for_rank
        if self.spec.pairs_next:
            chains = [_salted(c, int(t)) for c, t in zip(chains, next_tokens)]
        return keys_for_rank(chains, self.namespace, 0)

    def write_l3(self, chains: Sequence[bytes], host_pages: Sequence[int]) -> None:
        """Rank 0: queue the draft pages of ``host_pages`` (just backed up) that have one for
        the background writer (copies: the host pages may be reused before they are written)."""
        if self.writer is None:
            return
        pairs = [(c, h) for c, h in zip(chains, host_pages) if self.l2_has[h]]
        if pairs:
            keys = self._keys([c for c, _ in pairs], [self.l2_next[h] for _, h in pairs])
            self.writer.submit(keys, [self.l2[h].clone() for _, h in pairs])

    def read_l3(self, chains: Sequence[bytes], next_tokens=None) -> Optional[DraftRead]:
        """Read the leading draft pages of ``chains`` (every rank reads the same keys;
        ``pairs_next``: ``next_tokens[i]`` follows page i)."""
        if self.store is None or not chains:
            return None
        keys = self._keys(chains, next_tokens)
        n = self.store.exists_prefix(keys)
        staging = torch.empty((n, *self.format.shape), dtype=self.format.dtype)
        got = self.store.get(keys[:n], list(staging)) if n else 0
        self._count("l3_read", got)
        return DraftRead(got, staging, [int(t) for t in next_tokens[:got]]
                         if self.spec.pairs_next else None)

    def start_read_l3(self, chains: Sequence[bytes], next_tokens=None) -> Optional[Future]:
        """``read_l3`` on this rank's read thread (admission never waits on the store): a
        Future of its ``DraftRead``, None without L3 or chains. The service resolves it, with a
        bound, at the step that agrees the target's prefetch; a read still running at ``close``
        is waited for, one not started is dropped."""
        if self.store is None or self._reads is None or not chains:
            return None
        return self._reads.submit(self.read_l3, list(chains), next_tokens)

    def restore(self, read: Optional[DraftRead], device_pages: Sequence[int], pages: int) -> int:
        """Copy the first ``pages`` (agreed) read pages into ``device_pages``; how many."""
        n = min(pages, len(device_pages), read.pages if read is not None else 0)
        if n:
            d = np.asarray(device_pages[:n], np.int64)
            src = read.staging[:n].transpose(0, 1).to(self.l1.device)
            self._view()[:, torch.as_tensor(d, device=self.l1.device)] = src
            self.l1_has[d] = True
            if read.next_tokens is not None:
                self.l1_next[d] = read.next_tokens[:n]
        return n

    def report(self) -> dict:
        """Pages and bytes moved per tier (L3 writes: those the writer finished, every one
        after the service's drain), and L1 pages holding draft KV now."""
        with self._lock:
            pages, nbytes = dict(self.stats.pages), dict(self.stats.bytes)
        return {"pages": pages, "bytes": nbytes,
                "l1_pages_present": int(self.l1_has.sum()),
                "l1_bytes": self.l1.num_pages * self.format.page_bytes,
                "l2_bytes": self.l2.numel() * self.l2.element_size()}

    def close(self) -> None:
        """Stop the read thread (a read running ends first, queued ones are dropped) and the
        writer (flushed by the service's drain already; a write error here was agreed already
        or is past any step: logged), then close the store."""
        reads, self._reads = self._reads, None
        if reads is not None:
            reads.shutdown(wait=True, cancel_futures=True)
        try:
            if self.writer is not None:
                self.writer.close()
        except Exception as err:  # noqa: BLE001
            log.warning("draft L3 writer: %s", err)
        finally:
            self.writer = None
            if self.store is not None:
                self.store.close()
                self.store = None


def _salted(chain: bytes, next_token: int) -> bytes:
    """A chain hash of the same length naming the token after the page too."""
    import hashlib
    return hashlib.blake2b(chain + next_token.to_bytes(8, "little", signed=True),
                           digest_size=len(chain), person=b"hicache-next").digest()


def build_draft_pages(spec: DraftSpec, config, rank: int, device, host_pages: int, l3: bool,
                      weights_signature: str) -> DraftPages:
    """This rank's draft pages for a ``HiCache`` of ``config``; with ``l3``, a store of the
    draft's namespace (the target's weights, the draft's signature and format)."""
    pages = DraftPages(spec, config.page_tokens, config.l1.num_pages, host_pages, device,
                       pin=config.l2.pin)
    if l3:
        from .l3 import Namespace, open_store
        from .l3.guard import GuardedStore
        ns = Namespace.from_config(config, model=f"{weights_signature}|draft={spec.signature}",
                                   fmt=spec.format)
        pages.open_l3(lambda n: GuardedStore(lambda: open_store(config.l3, n, 0), config.l3, 0,
                                             n), ns, rank)
    return pages


def draft_need(need, config, spec: DraftSpec, host_pages: int):
    """The node memory ``need`` (``preflight.MemoryNeed``) with the draft's pools: counted by
    the policy already when its ``[spec]`` names the draft (then the formats must agree), else
    added here (L1: a draft page per device page; L2: one per host page)."""
    import dataclasses
    fmts = config.formats
    if "draft" in fmts.names:
        mine = fmts["draft"]
        if not mine.same_shape(spec.format) or mine.dtype != spec.format.dtype:
            raise UsageError(f"the draft's pages ({spec.format.describe()}) differ from the "
                             f"policy's [spec] draft ({mine.describe()})")
        return need
    b = spec.format.page_bytes
    return dataclasses.replace(need, l1_per_rank=need.l1_per_rank + config.l1.num_pages * b,
                               l2_per_rank=need.l2_per_rank + max(host_pages, 1) * b)
