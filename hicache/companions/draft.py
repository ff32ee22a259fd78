"""``DraftPages``: the draft KV's companion pages of one rank, in every tier, under the target's
page ids (speculative decoding; docs/speculative.md, "The cache holds both"). A ``Companion``
(``hicache.companions.base``): the service knows it only through that protocol.

The draft's KV has a REPLICATED ``PageFormat`` (``hicache.companions.draft_format``): every DCP
rank holds all ``P*c`` rows of a page. Device page ``p`` of the target has a companion draft
page ``p`` (allocated per page, with the target's):

- L1: ``l1``, a ``DeviceKVPool`` on a ``DCPLayout(1, 0, P*c)`` with the target pool's page
  count. The engine's drafter writes it through ``kv``, a ``CheckedPort`` like the target's
  (``hicache.engine.spec.replicated_runner(pool=cache.draft.kv)``): a write lands only in pages
  an admitted request holds, and a row counts once every draft layer wrote it. Its request
  shares the target's page table, so draft page ``p`` holds the positions of target page ``p``.
  ``l1_has[p]``: the draft KV of every position of page ``p`` is there. A page handed out
  afresh has none; ``finish(draft_len=n)`` marks the request's own whole pages below ``n``,
  refused unless their draft rows were written at every layer (a prefix written by a run
  without speculation has none).
- L2: ``l2``, ``[host pages, layers, P*c, width]`` (a page-major ``HostKVPool``, pinned as the
  policy's ``l2.pin`` says) beside the target's host pool, with ``l2_has``. A backup (D2H) or
  load-back (H2D) of target pages copies their draft pages too, as a job of the draft's own
  ``TransferEngine`` (timed, per layer) that rides the target's op: the op completes when both
  did, a failure of either is agreed like a copy's.
- L3: a draft page is stored ONCE for the whole DCP group: rank 0 writes (among TP replicas,
  the page's writer, as for the target), every rank reads the same key. Rank 0's writes go
  through a ``CompanionWriter`` (a background ``AsyncWriter`` over the draft's store, beside
  the target's): no store round trip in ``step``; ``TierIO`` agrees its errors and flushes it
  with the target's writer. The namespace signs the draft format and the draft
  (``DraftSpec.signature``: the MTP module or the draft weights) beside the target's weights,
  so another draft never hits. An agreed read is restored into L1 by a transfer job.

Presence is replicated: L1/L2 flags follow the replicated controller's ops; an L3 read's page
count is MIN-agreed by the service with the target's prefetch (the step field
``draft.pages``), so every rank restores the same draft pages and proposes the same drafts (the
target's verify is a collective); a finish's ``draft_len`` is in the step's content digest, so
ranks that keep different draft lengths raise ``DivergenceError`` at that step. No collective
here, no controller import (tests/test_layering.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from hicache.errors import UsageError
from hicache.kvport import CheckedPort, span_slots
from hicache.l1.pool import DeviceKVPool
from hicache.l2.pool import HostKVPool
from hicache.l2.transfer import TransferEngine
from hicache.layout import DCPLayout
from hicache.page_format import PageFormat, PageKind

from .base import Companion, Host

log = logging.getLogger("hicache")

__all__ = ["DraftSpec", "DraftPages", "DraftRead", "build", "draft_need"]


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


class _Req:
    """A request's draft read from L3: its Future until resolved, then what it found, and the
    pages every rank holds (agreed)."""

    __slots__ = ("future", "read", "agreed")

    def __init__(self, future) -> None:
        self.future, self.read, self.agreed = future, None, 0


class DraftPages(Companion):
    """One rank's draft companion pages in L1, L2 and (optionally) L3."""

    name = "draft"
    finish_arg = "draft_len"

    def __init__(self, spec: DraftSpec, page_tokens: int, device_pages: int, host_pages: int,
                 device=None, pin: str = "auto", **io) -> None:
        fmt = spec.format
        if fmt.rows != page_tokens:
            raise UsageError(f"draft format {fmt.describe()} has {fmt.rows} rows a page; the "
                             f"cache's widened page has {page_tokens}")
        self.spec, self.format, self.page_tokens = spec, fmt, page_tokens
        self.signature = spec.signature
        rows = DCPLayout(1, 0, page_tokens)
        self.l1 = DeviceKVPool.for_format(rows, fmt, device_pages, device=device)
        # page-major [host pages, layers, P*c, width], pinned like the target's L2 (l2.pin)
        self.l2_pool = HostKVPool.for_format(rows, fmt, max(host_pages, 1),
                                             layout_kind="page_first", pin=pin)
        self.l2 = self.l2_pool.buf
        # its own copies (io: the policy's io_backend / copy_threads, as the target's)
        self.transfer = TransferEngine(self.l1, self.l2_pool, **io)
        self.kv = CheckedPort(self.l1, self._check_writable)
        self.l1_has = np.zeros(device_pages, dtype=bool)
        self.l2_has = np.zeros(max(host_pages, 1), dtype=bool)
        # pairs_next: the token after the page its last row was computed with (-1: unknown)
        self.l1_next = np.full(device_pages, -1, dtype=np.int64)
        self.l2_next = np.full(max(host_pages, 1), -1, dtype=np.int64)
        self.host: Optional[Host] = None  # the service's (``attach``): which pages are held
        self.store = None        # GuardedStore of the draft namespace (L3 on)
        self.namespace = None
        self.writes = False      # this rank writes the group's draft pages to L3
        self.writer = None       # rank 0: CompanionWriter of ``store`` (hicache.l3.companion)
        self._reads = None       # L3 on: the thread that reads at admission (``start_read``)
        self._lock = threading.Lock()  # ``stats``: the writer's thread counts L3 writes
        self.stats = DraftStats()

    # ---- L1: presence and the checked port -----------------------------------------------------
    def _check_writable(self, pages: np.ndarray) -> None:
        """A draft write lands only in pages an admitted request holds (its own, or its hit's:
        a drafter recomputes what the hit lacks); a shared page written so is no longer known
        to hold its chain's draft KV (never served as present again until marked)."""
        h = self.host
        if h is None:
            return
        h.check_usable("write draft KV")
        own = h.owned[pages]
        bad = pages[~(own | (h.held[pages] > 0))]
        if bad.size:
            raise UsageError(f"draft KV write into device page {int(bad[0])}, which no admitted "
                             "request holds: only the pages of an admitted request's table "
                             "take draft KV")
        self.l1_has[pages[~own]] = False

    def forget(self, pages: Sequence[int]) -> None:
        """Pages handed out afresh hold no draft KV."""
        p = np.asarray(pages, dtype=np.int64)
        self.l1_has[p] = False
        self.kv.forget(p)

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

    def settle(self, host: Host, req) -> None:
        """The L1/L2 hit's draft KV (presence came with the loads): ``prefix.draft_len``."""
        prefix = req.prefix
        prefix.draft_len = self.present_pages(prefix.page_table, req.tokens) * self.page_tokens

    # ---- L2: jobs beside the target's backups and load-backs -----------------------------------
    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int]):
        d, h = np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64)
        has = self.l1_has[d]
        self.l2_has[h] = has
        self.l2_next[h] = self.l1_next[d]
        if not has.any():
            return None
        self._count("d2h", int(has.sum()))
        return self.transfer.backup(d[has], h[has])

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]):
        d, h = np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64)
        has = self.l2_has[h]
        self.l1_has[d] = has
        self.l1_next[d] = self.l2_next[h]
        self.kv.forget(d[~has])
        if not has.any():
            return None
        self.kv.fill(d[has])
        self._count("h2d", int(has.sum()))
        return self.transfer.load(h[has], d[has])

    def _count(self, what: str, pages: int) -> None:
        with self._lock:
            self.stats.pages[what] += pages
            self.stats.bytes[what] += pages * self.format.page_bytes

    # ---- L3: one copy for the whole DCP group --------------------------------------------------
    def open_l3(self, open_store, namespace, rank: int) -> None:
        """``open_store(namespace)``: a store (GuardedStore) whose keys carry rank 0 on every
        rank (one copy per group); rank 0 writes."""
        from hicache.l3.companion import CompanionWriter
        self.namespace, self.writes = namespace, rank == 0
        self.store = open_store(namespace)
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="hicache-l3-draft-read")
        if self.writes:
            self.writer = CompanionWriter(self.store, lambda n: self._count("l3_write", n))

    def _keys(self, chains: Sequence[bytes], next_tokens=None) -> list[bytes]:
        """Rank 0's keys of ``chains`` (``pairs_next``: each chain salted with the token after
        its page, so a page computed before another next token never hits)."""
        from hicache.l3 import keys_for_rank
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

    def start_read(self, host: Host, req) -> None:
        """After an L1/L2 hit that has all its draft pages: start reading the L3 draft pages
        past it on this rank's read thread (admission never waits on the store); the service
        resolves it, with a bound, at the step that agrees the target's prefetch."""
        prefix, w = req.prefix, self.page_tokens
        if self.store is None or self._reads is None or prefix.draft_len < prefix.hit_len:
            return
        arr, first = req.tokens, prefix.hit_len // w
        chains = req.chains(arr[:-1])[first:]
        if not chains:
            return
        nxt = arr[(np.arange(first, first + len(chains)) + 1) * w]  # the token after each
        req.parts[self.name] = _Req(self._reads.submit(self.read_l3, list(chains), nxt))

    def resolve(self, req, wait) -> None:
        part = req.parts.get(self.name)
        if part is not None and part.future is not None:
            part.read = wait(part.future, None, "draft pages")
            part.future = None

    def fields(self, req) -> dict[str, int]:
        part = req.parts.get(self.name)
        return {"pages": getattr(getattr(part, "read", None), "pages", 0)}

    def decide(self, host: Host, req, agreed: dict[str, int], pages: int) -> int:
        part = req.parts.get(self.name)
        if part is not None:
            part.agreed = agreed["pages"]
        return pages

    def restore(self, host: Host, req, dev: list, pages: int):
        """The agreed L3 draft pages (at most the target's restored ``pages``) into ``dev``, a
        job of the draft's transfer engine; they extend ``draft_len`` only when the L1/L2 hit
        had all its draft pages."""
        self.forget(dev)
        part = req.parts.pop(self.name, None)
        read = getattr(part, "read", None)
        n = min(pages, len(dev), part.agreed if part else 0, read.pages if read else 0)
        if not n:
            return None
        d = np.asarray(dev[:n], np.int64)
        job = self.transfer.restore(read.staging[:n], d)
        self.l1_has[d] = True
        self.kv.fill(d)
        if read.next_tokens is not None:
            self.l1_next[d] = read.next_tokens[:n]
        prefix = req.prefix
        if prefix.draft_len == prefix.device_len + prefix.host_len:
            prefix.draft_len += n * self.page_tokens
        return job

    def drop(self, req) -> None:
        part = req.parts.pop(self.name, None)
        if part is not None and part.future is not None:
            part.future.cancel()  # one running ends on its thread; its result is dropped

    # ---- finish: the request's own whole pages below draft_len keep their draft KV -------------
    def check_finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        """``draft_len`` is trusted only where the draft rows exist: every page below it holds
        its draft KV (present, or written at every draft layer)."""
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise UsageError(f"finish of request {req.prefix.request_id!r}: draft_len must be "
                             f"an int >= 0, got {value!r}")
        w, table = self.page_tokens, req.prefix.page_table
        n = min(int(value), end) // w
        if not n:
            return
        pages = np.asarray(table[:n], np.int64)
        slots = span_slots(pages, 0, n * w, w)
        unwritten = self.kv._layers[slots].reshape(n, w).min(1) < self.kv.num_layers
        bad = np.flatnonzero(unwritten & ~self.l1_has[pages])
        if bad.size:
            raise UsageError(f"finish of request {req.prefix.request_id!r}: draft_len={value} "
                             f"but the draft KV of token {int(bad[0]) * w} was not written at "
                             "every draft layer; pass the tokens whose draft KV the drafter "
                             f"wrote (at most {int(bad[0]) * w} here)")

    def digest(self, value) -> tuple:
        return (int(value) if isinstance(value, (int, np.integer)) else 0,)

    def finish(self, host: Host, req, arr: np.ndarray, end: int, value) -> None:
        """The request's own pages wholly below ``draft_len`` hold their draft KV (with the
        token after each page, -1 past ``arr``)."""
        w, own = self.page_tokens, set(req.own_pages)
        table = req.prefix.page_table
        idx = [i for i, p in enumerate(table[:min(int(value or 0), end) // w]) if p in own]
        self.mark([table[i] for i in idx],
                  [int(arr[(i + 1) * w]) if (i + 1) * w < arr.size else -1 for i in idx])

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
        """Stop the copies and the read thread (a read running ends first, queued ones are
        dropped) and the writer (flushed by the service's drain already; a write error here
        was agreed already or is past any step: logged), then close the store."""
        reads, self._reads = self._reads, None
        if reads is not None:
            reads.shutdown(wait=True, cancel_futures=True)
        self.transfer.close()
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


def build(host: Host, spec: DraftSpec, host_pages: int) -> DraftPages:
    """This rank's draft pages for the ``HiCache`` of ``host``; with L3, a store of the
    draft's namespace (the target's weights, the draft's signature and format)."""
    config = host.config
    pages = DraftPages(spec, config.page_tokens, config.l1.num_pages, host_pages, host.device,
                       pin=config.l2.pin, io_backend=config.io.backend,
                       copy_threads=config.io.copy_threads)
    pages.host = host
    rank, weights_signature = host.rank, host.weights_signature
    if "l3" in host.tiers:
        from hicache.l3 import Namespace, open_store
        from hicache.l3.guard import GuardedStore
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
